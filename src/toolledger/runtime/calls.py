"""Runs delivered calls concurrently, bounded, each at most once at a time in this process.

The ledger already guarantees at-most-once across processes; this only saves the database
round trips when one call is announced several times while it runs (a repeated event, a
reconnect's snapshot, a reconcile pass).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from toolledger.domain.keys import CallKey
from toolledger.runtime.executor import Executor, HandleReport
from toolledger.runtime.failures import log_failure, note_interruption

log = logging.getLogger("toolledger.calls")


class CallRunner:
    def __init__(self, executor: Executor, limit: int) -> None:
        self.executor = executor
        self._slots = asyncio.Semaphore(limit)
        self._inflight: dict[CallKey, asyncio.Task[HandleReport]] = {}
        self._accepting = True

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    def is_running(self, key: CallKey) -> bool:
        return key in self._inflight

    def dispatch(self, session_id: str, action: Any) -> asyncio.Task[HandleReport] | None:
        """Start handling a ``function_call`` action (or join the run already going on)."""
        key = CallKey(session_id, _field(action, "turn_id"), _field(action, "call_id"))
        running = self._inflight.get(key)
        if running is not None:
            return running
        if not self._accepting:
            return None
        task = asyncio.create_task(self._run(key, action), name=f"call {key}")
        self._inflight[key] = task
        task.add_done_callback(lambda _: self._inflight.pop(key, None))
        return task

    async def run(self, session_id: str, action: Any) -> HandleReport | None:
        """Handle an action and wait for the report (None when shutting down)."""
        task = self.dispatch(session_id, action)
        # Shielded: a caller giving up (a follower reconnecting) must not cancel the call.
        return None if task is None else await asyncio.shield(task)

    async def settle(self, session_id: str) -> None:
        """Wait until the calls of a session running now are done with (submitted or not)."""
        running = [t for k, t in self._inflight.items() if k.session_id == session_id]
        if running:
            await asyncio.wait([asyncio.shield(t) for t in running])

    async def _run(self, key: CallKey, action: Any) -> HandleReport:
        async with self._slots:
            try:
                return await self.executor.handle(key.session_id, action)
            except Exception:
                # Most likely the database or the API is away. The ledger holds how far the
                # call got; the reconciler picks it up from there.
                log_failure(log, "handling call %s stopped", key)
                return HandleReport(key, "error", None)
            except BaseException:
                # A handler's own BaseException: the call's lease will expire into `unknown`.
                note_interruption(log, "handling call %s interrupted", key)
                return HandleReport(key, "interrupted", None)

    async def drain(self, grace: float) -> int:
        """Take no new calls; wait up to ``grace`` seconds for running ones, then cancel the
        rest (their leases expire and they become ``unknown``, as after a crash). Returns how
        many were cancelled."""
        self._accepting = False
        pending = set(self._inflight.values())
        if not pending:
            return 0
        _, still_running = await asyncio.wait(pending, timeout=grace)
        for task in still_running:
            task.cancel()
        await asyncio.gather(*still_running, return_exceptions=True)
        return len(still_running)


def _field(action: Any, name: str) -> str:
    value = action[name] if isinstance(action, dict) else getattr(action, name)
    return str(value)
