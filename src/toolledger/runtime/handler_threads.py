"""Threads for sync handlers: a bounded set of their own, apart from the event loop's default
executor.

The default executor is everyone's: asyncio resolves host names there (``loop.getaddrinfo``,
on every new connection of the openai SDK) and ``asyncio.to_thread`` runs there. Sync
handlers used to run there too: on 2 CPUs it has 6 threads, and 6 stuck handlers stalled every
new event stream and every other sync handler of the process, for as long as they hung.

Here every run of a sync handler gets a thread of its own, once a slot is free: at most
``size`` at once (``TOOLLEDGER_HANDLER_THREADS``), at most a tool's ``threads=`` of that tool,
and never two at once for one call. Waiting runs are served in the order they came, except
that one whose tool (or call) is at its limit lets the next go first.

A thread cannot be stopped. A run whose caller gave up on it (its timeout passed, or the
service stopped) keeps its slot until the handler returns, and is counted apart
(``timed_out``), so that status and metrics say what holds the slots. The threads are daemon
threads: the interpreter does not wait for them at exit (it joins the default executor's,
which kept a stopped ``serve`` alive for as long as a handler hung).
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time
import weakref
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from toolledger import metrics
from toolledger.domain.keys import CallKey

T = TypeVar("T")

_POOLS: weakref.WeakSet[HandlerThreads] = weakref.WeakSet()
"""Every pool of this process, for what is process-wide: the exit of ``serve``, the metrics."""


class ThreadTimeout(Exception):
    """The run's timeout passed, counted from its thread's start; the thread goes on."""


@dataclass
class ThreadRun:
    """One run of a sync handler: waiting for a thread, or in one."""

    tool: str
    key: CallKey
    queued_at: float
    """When it asked for a thread (monotonic)."""
    started_at: float | None = None
    """When its thread started (monotonic); None while it waits for one."""
    given_up_at: float | None = None
    """When its caller stopped waiting for it (timed out, or cut off at shutdown) while the
    thread still ran: the thread keeps its slot until the handler returns."""

    @property
    def timed_out(self) -> bool:
        return self.given_up_at is not None

    def describe(self, now: float | None = None) -> str:
        """How it stands, for a log line (no arguments: they may hold secrets)."""
        now = time.monotonic() if now is None else now
        if self.started_at is None:
            return f"waiting {now - self.queued_at:.1f}s for a handler thread (never started)"
        state = "timed out or cut off, still running" if self.timed_out else "running"
        return f"{state} for {now - self.started_at:.1f}s in a thread"


@dataclass
class _Waiter:
    run: ThreadRun
    limit: int | None
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[None]
    granted: bool = False


@dataclass
class ThreadSlot:
    """A thread slot held for one run: ``run`` starts the thread (once)."""

    pool: HandlerThreads
    run_info: ThreadRun
    started: bool = field(default=False)

    async def run(
        self,
        function: Callable[[], T],
        *,
        time_limit: float | None = None,
        on_start: Callable[[], None] | None = None,
    ) -> T:
        """``function()`` in a new thread (with this task's context variables), its result or
        exception returned here. ``time_limit`` (seconds) counts from the thread's start:
        ThreadTimeout once it passes. Cancelled or timed out, the thread goes on and keeps its
        slot."""
        if self.started:
            raise RuntimeError("a thread slot runs one function")
        self.started = True
        return await self.pool._start(self.run_info, function, time_limit, on_start)


class HandlerThreads:
    """At most ``size`` sync handlers at once, each in a daemon thread of its own."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError("a handler thread pool needs at least one thread")
        self.size = size
        self._lock = threading.Lock()
        self._busy_by_tool: Counter[str] = Counter()
        self._busy = 0
        """Slots taken: threads alive, and slots granted whose thread is not started yet."""
        self._live_keys: set[CallKey] = set()
        self._waiting: list[_Waiter] = []
        self._runs: dict[int, ThreadRun] = {}
        """Runs whose thread is alive, by the id of their ThreadRun."""
        _POOLS.add(self)
        metrics.HANDLER_THREADS.track(self)

    # ------------------------------------------------------------------ taking a slot

    @asynccontextmanager
    async def slot(self, *, tool: str, key: CallKey, limit: int | None = None) -> AsyncIterator[ThreadSlot]:
        """Wait for a thread slot (counted as waiting meanwhile); ``limit``: at most that many
        runs of ``tool`` at once. Left without starting a thread, the slot is given back; once
        a thread started, its end gives it back."""
        run = ThreadRun(tool, key, time.monotonic())
        await self._acquire(run, limit)
        slot = ThreadSlot(self, run)
        try:
            yield slot
        finally:
            if not slot.started:
                self._release(run)

    async def run(
        self,
        function: Callable[[], T],
        *,
        tool: str,
        key: CallKey,
        limit: int | None = None,
        time_limit: float | None = None,
    ) -> T:
        """``slot`` and ``ThreadSlot.run`` in one."""
        async with self.slot(tool=tool, key=key, limit=limit) as slot:
            return await slot.run(function, time_limit=time_limit)

    async def _acquire(self, run: ThreadRun, limit: int | None) -> None:
        loop = asyncio.get_running_loop()
        waiter = _Waiter(run, limit, loop, loop.create_future())
        with self._lock:
            fits = self._fits(waiter)
            if fits:
                self._take(waiter)
            else:
                self._waiting.append(waiter)
        if not fits:
            try:
                await waiter.future
            except BaseException:
                with self._lock:
                    if waiter in self._waiting:
                        self._waiting.remove(waiter)
                        granted = False
                    else:
                        granted = waiter.granted
                if granted:
                    # Granted as it was cancelled: the slot goes to the next in line.
                    self._release(run)
                raise
        metrics.HANDLER_THREAD_WAIT.observe(time.monotonic() - run.queued_at)

    def _fits(self, waiter: _Waiter) -> bool:
        run = waiter.run
        return (
            self._busy < self.size
            and (waiter.limit is None or self._busy_by_tool[run.tool] < waiter.limit)
            and run.key not in self._live_keys
        )

    def _take(self, waiter: _Waiter) -> None:
        """Under the lock."""
        self._busy += 1
        self._busy_by_tool[waiter.run.tool] += 1
        self._live_keys.add(waiter.run.key)
        waiter.granted = True

    def _release(self, run: ThreadRun) -> None:
        """A slot given back (its thread ended, or it was never started): from any thread."""
        with self._lock:
            self._busy -= 1
            self._busy_by_tool[run.tool] -= 1
            if self._busy_by_tool[run.tool] <= 0:
                del self._busy_by_tool[run.tool]
            self._live_keys.discard(run.key)
            self._runs.pop(id(run), None)
            granted = []
            for waiter in list(self._waiting):
                if self._fits(waiter):
                    self._waiting.remove(waiter)
                    self._take(waiter)
                    granted.append(waiter)
        for waiter in granted:
            try:
                waiter.loop.call_soon_threadsafe(_wake, waiter.future)
            except RuntimeError:
                # Its event loop is closed: nobody will use the slot.
                self._release(waiter.run)

    # ------------------------------------------------------------------ running

    async def _start(
        self,
        run: ThreadRun,
        function: Callable[[], T],
        time_limit: float | None,
        on_start: Callable[[], None] | None,
    ) -> T:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        context = contextvars.copy_context()

        def work() -> None:
            try:
                outcome: tuple[bool, Any] = (True, context.run(function))
            except BaseException as error:
                outcome = (False, error)
            self._release(run)
            # Its event loop closed meanwhile: nobody waits for this result any more.
            with suppress(RuntimeError):
                loop.call_soon_threadsafe(_settle, future, outcome)

        thread = threading.Thread(target=work, name=f"toolledger-handler {run.tool}", daemon=True)
        run.started_at = time.monotonic()
        with self._lock:
            self._runs[id(run)] = run
        if on_start is not None:
            on_start()
        try:
            thread.start()
        except BaseException:
            self._release(run)
            raise
        try:
            async with asyncio.timeout(time_limit) as deadline:
                return await future
        except TimeoutError:
            if deadline.expired():
                self._give_up(run)
                raise ThreadTimeout(f"no answer within {time_limit}s") from None
            raise
        except BaseException:
            self._give_up(run)
            raise

    def _give_up(self, run: ThreadRun) -> None:
        with self._lock:
            if id(run) in self._runs:
                run.given_up_at = time.monotonic()

    # ------------------------------------------------------------------ looking

    def runs(self) -> list[ThreadRun]:
        """Copies of the runs in threads and of those waiting for one, oldest first."""
        with self._lock:
            found = [*self._runs.values(), *(waiter.run for waiter in self._waiting)]
        return sorted((replace(run) for run in found), key=lambda run: run.queued_at)

    def snapshot(self) -> metrics.HandlerThreadsSnapshot:
        with self._lock:
            timed_out = sum(1 for run in self._runs.values() if run.timed_out)
            return metrics.HandlerThreadsSnapshot(
                size=self.size, busy=self._busy, timed_out=timed_out, waiting=len(self._waiting)
            )


def running_handler_threads() -> list[ThreadRun]:
    """Every handler thread of this process still running (any pool), oldest first."""
    return sorted(
        (run for pool in list(_POOLS) for run in pool.runs() if run.started_at is not None),
        key=lambda run: run.queued_at,
    )


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _settle(future: asyncio.Future[Any], outcome: tuple[bool, Any]) -> None:
    if future.done():
        return
    ok, value = outcome
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)


__all__ = ["HandlerThreads", "ThreadRun", "ThreadSlot", "ThreadTimeout", "running_handler_threads"]
