"""Smart batching of ledger writes: whatever queued while the previous flush ran goes out
together in the next one, and nothing ever waits to fill a batch.

A write that finds a flush free starts one at once. The flush is a task, so it runs after the
tasks that were ready with the write's own: the calls of one ``requires_action`` (started
together, one task each) and whatever else became ready at that moment join it. Under load
this turns many round trips and commits into few; a lone write pays for one task.

Up to ``flushes`` batches may be in flight at once (PostgreSQL commits several at a time and
groups their WAL flushes itself; SQLite has one writer): at light load each write goes out at
once, as without batching, and only writes that find every flush busy wait, for the first to
finish, and then go together.

Each flush runs in a task of its own: a caller that is cancelled gives up waiting for its
write, not the write of the others in its batch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")

Flush = Callable[[Sequence[Item]], Awaitable[Sequence[Result | BaseException]]]
"""Writes a batch; returns one result or exception per item, in order. An exception it raises
instead is every item's."""


class WriteBatcher(Generic[Item, Result]):
    def __init__(self, flush: Flush[Item, Result], *, flushes: int = 1) -> None:
        self._flush = flush
        self._flushes = flushes
        self._queued: list[tuple[Item, asyncio.Future[Result]]] = []
        self._flushing: set[asyncio.Task[None]] = set()

    async def add(self, item: Item) -> Result:
        """Queue ``item`` for the next flush and wait for its own result (or exception)."""
        (future,) = self._enqueue([item])
        return await future

    async def add_many(self, items: Sequence[Item]) -> list[Result | BaseException]:
        """Queue ``items`` for the same flush; each one's result or exception, in order."""
        return list(await asyncio.gather(*self._enqueue(items), return_exceptions=True))

    def _enqueue(self, items: Sequence[Item]) -> list[asyncio.Future[Result]]:
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[Result]] = [loop.create_future() for _ in items]
        self._queued.extend(zip(items, futures, strict=True))
        if len(self._flushing) < self._flushes:
            task = asyncio.create_task(self._drain())
            self._flushing.add(task)
            task.add_done_callback(self._flushing.discard)
        return futures

    async def _drain(self) -> None:
        try:
            while self._queued:
                batch, self._queued = self._queued, []
                await self._run(batch)
        except asyncio.CancelledError:
            for _item, future in self._queued:
                future.cancel()
            self._queued = []
            raise
        finally:
            # Not left to the done callback: that runs a loop turn later, after the callers
            # this flush just answered, and a caller writing again at once would find every
            # flush "busy", queue behind a flush that has already looked for the last time,
            # and wait until some other write came along (forever, on a quiet ledger).
            task = asyncio.current_task()
            if task is not None:
                self._flushing.discard(task)

    async def _run(self, batch: list[tuple[Item, asyncio.Future[Result]]]) -> None:
        results: Sequence[Result | BaseException]
        try:
            results = await self._flush([item for item, _future in batch])
        except asyncio.CancelledError:
            for _item, future in batch:
                future.cancel()
            raise
        except Exception as error:
            results = [error] * len(batch)
        for (_item, future), result in zip(batch, results, strict=True):
            if future.done():  # its caller stopped waiting
                continue
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)


__all__ = ["WriteBatcher"]
