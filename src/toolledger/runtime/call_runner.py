"""Runs delivered calls concurrently, each at most once at a time in this process.

The ledger already guarantees at-most-once across processes; this only saves the database
round trips when one call is announced several times while it runs (a repeated event, a
reconnect's snapshot, a reconcile pass), or again just after this process submitted its
result (every later ``requires_action`` event of the turn lists the calls still awaited a
moment before: with ten parallel calls, forty-five such announcements per turn).

Nothing here waits for a handler slot: a delivered call is recorded and claimed at once, and
only its handler's run waits, under its lease, for a slot and a thread (``handler_runner``).
When every slot was taken before recording, hung handlers kept new calls (async ones too)
from even being recorded.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from toolledger.domain.delivered import delivered_key
from toolledger.domain.keys import CallKey
from toolledger.domain.records import CallRecord
from toolledger.domain.states import CallStatus
from toolledger.errors import AgentsAuthError
from toolledger.runtime.executor import Executor, HandleAction, HandleReport
from toolledger.runtime.loop_logging import log_failure, note_interruption

log = logging.getLogger("toolledger.calls")

SUBMITTED_REMEMBERED = 100_000


class CallRunner:
    def __init__(
        self,
        executor: Executor,
        *,
        on_report: Callable[[HandleReport], None] | None = None,
        on_fatal: Callable[[AgentsAuthError], None] | None = None,
    ) -> None:
        """``on_report`` hears of every call handled (the service schedules what waits);
        ``on_fatal`` of refused credentials, which no retry of a call will mend. How many
        handlers run at once is the executor's to bound (``max_concurrent_calls``)."""
        self.executor = executor
        self._on_report = on_report
        self._on_fatal = on_fatal
        self._inflight: dict[CallKey, asyncio.Task[HandleReport]] = {}
        self._running: dict[str, set[CallKey]] = {}
        """Per session, its calls being handled now."""
        executor.submitter.follow_running(lambda session_id: self._running.get(session_id, ()))
        self._submitted: OrderedDict[CallKey, float] = OrderedDict()
        """Calls this process saw accepted, and when (monotonic): a listing shortly after is stale."""
        self._accepting = True

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    def is_running(self, key: CallKey) -> bool:
        return key in self._inflight

    def dispatch(
        self,
        session_id: str,
        action: Any,
        known: CallRecord | None = None,
        *,
        listing_may_be_stale: bool = False,
    ) -> asyncio.Task[HandleReport] | None:
        """Start handling a ``function_call`` action (or join the run already going on);
        ``known`` and ``listing_may_be_stale`` as for ``Executor.handle``."""
        key = delivered_key(session_id, action)
        running = self._inflight.get(key)
        if running is not None:
            return running
        if not self._accepting:
            return None
        if self._just_submitted(key):
            return self._finished(
                HandleReport(key, HandleAction.ALREADY_SUBMITTED, CallStatus.SUBMITTED, True)
            )
        task = asyncio.create_task(self._run(key, action, known, listing_may_be_stale), name=f"call {key}")
        self._inflight[key] = task
        task.add_done_callback(lambda _: self._inflight.pop(key, None))
        return task

    async def run(self, session_id: str, action: Any, known: CallRecord | None = None) -> HandleReport | None:
        """Handle an action and wait for the report (None when shutting down)."""
        task = self.dispatch(session_id, action, known)
        # Shielded: a caller giving up (a follower reconnecting) must not cancel the call.
        return None if task is None else await asyncio.shield(task)

    async def wait_for_running(self, session_id: str) -> None:
        """Wait until the calls of a session running now are done with (submitted or not)."""
        running = [t for k, t in self._inflight.items() if k.session_id == session_id]
        if running:
            await asyncio.wait([asyncio.shield(t) for t in running])

    def _just_submitted(self, key: CallKey) -> bool:
        """Accepted by the API within the resubmission window: the ledger would answer
        "already submitted" (a submitted call never goes back), so it is not asked."""
        accepted_at = self._submitted.get(key)
        window = self.executor.settings.resubmit_after_seconds
        return accepted_at is not None and time.monotonic() - accepted_at < window

    def _remember(self, report: HandleReport) -> None:
        if report.submitted and report.action is not HandleAction.ALREADY_SUBMITTED:
            self._submitted[report.key] = time.monotonic()
            self._submitted.move_to_end(report.key)
            if len(self._submitted) > SUBMITTED_REMEMBERED:
                self._submitted.popitem(last=False)

    @staticmethod
    def _finished(report: HandleReport) -> asyncio.Task[HandleReport]:
        async def known() -> HandleReport:
            return report

        return asyncio.ensure_future(known())

    async def _run(
        self, key: CallKey, action: Any, known: CallRecord | None, listing_may_be_stale: bool
    ) -> HandleReport:
        # A stored result is only sent again: it runs no handler, so it takes no handler's
        # slot. After a crash, a session's stored results then reach the submitter together
        # and go in one request (queued for slots, they trickled out a few at a time).
        running = self._running.setdefault(key.session_id, set())
        running.add(key)
        try:
            report = await self._handle(key, action, known, listing_may_be_stale)
        finally:
            running.discard(key)
            if not running and self._running.get(key.session_id) is running:
                del self._running[key.session_id]
            await self.executor.submitter.running_finished(key.session_id)
        self._remember(report)
        if self._on_report is not None:
            self._on_report(report)
        return report

    async def _handle(
        self, key: CallKey, action: Any, known: CallRecord | None, listing_may_be_stale: bool
    ) -> HandleReport:
        # A call cut off here is looked at again once its lease can have run out: by then the
        # ledger says what is left to do (run again, wait for an operator, or send a result).
        look_again = self.executor.settings.lease_seconds
        try:
            return await self.executor.handle(
                key.session_id, action, known, listing_may_be_stale=listing_may_be_stale
            )
        except AgentsAuthError as error:
            if self._on_fatal is not None:
                self._on_fatal(error)
            return HandleReport(key, HandleAction.ERROR, None)
        except Exception:
            # Most likely the database or the API is away. The ledger holds how far the
            # call got.
            log_failure(log, "handling call %s stopped", key)
            return HandleReport(key, HandleAction.ERROR, None, retry_in=look_again)
        except BaseException:
            # A handler's own BaseException: the call's lease will expire into `unknown`.
            note_interruption(log, "handling call %s interrupted", key)
            return HandleReport(key, HandleAction.INTERRUPTED, None, retry_in=look_again)

    async def drain(
        self, grace: float, *, before_cut: Callable[[list[CallKey]], None] | None = None
    ) -> list[CallKey]:
        """Take no new calls; wait up to ``grace`` seconds for running ones, then cancel the
        rest (their leases expire and they become ``unknown``, as after a crash; a sync
        handler's thread is not stopped by it). Returns the calls cut off; ``before_cut``
        hears of them before they are cancelled (while their handlers' state can be told)."""
        self._accepting = False
        pending = {task: key for key, task in self._inflight.items()}
        if not pending:
            return []
        _, still_running = await asyncio.wait(pending, timeout=grace)
        cut = sorted((pending[task] for task in still_running), key=str)
        if cut and before_cut is not None:
            before_cut(cut)
        for task in still_running:
            task.cancel()
        await asyncio.gather(*still_running, return_exceptions=True)
        return cut
