"""Compares what a session awaits with what the ledger holds, and closes the gap.

For one session: read its open calls from the ledger, then retrieve the session (in that
order, so a call recorded meanwhile is never mistaken for one the session stopped awaiting),
then
- run every listed ``function_call`` through the executor: a call never seen is executed, a
  stored result is resubmitted, an ``unknown`` one is settled by its effect class;
- for open calls no longer listed: confirm submitted ones; never send a stored result: it is
  confirmed when a request carrying it went out (taken as answered by it), abandoned when
  none did (a call recorded moments ago is looked at again instead: the session may not list
  it yet); abandon what nobody awaits any more;
- a failed or deleted session: abandon its unanswered calls and stop watching it.
Required actions of other kinds (MCP or computer-use approvals, environment connections)
are not ours: they are left alone and logged once.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from toolledger.crashpoints import CP_DURING_RECONCILE, crash_point
from toolledger.domain.delivered import delivered_key
from toolledger.domain.keys import CallKey
from toolledger.domain.records import CallRecord
from toolledger.domain.states import RESULT_STATUSES, CallStatus
from toolledger.errors import SessionGoneError
from toolledger.gateway.agents import AgentsGateway, FunctionCallAction
from toolledger.logs import log_fields
from toolledger.runtime.executor import LEASE_WAKE_MARGIN, Executor, HandleReport
from toolledger.runtime.loop_logging import log_failure
from toolledger.runtime.submitter import LISTING_RACE_SECONDS, UNLISTED_REASON, Unlisted
from toolledger.store.sessions import SessionStore

log = logging.getLogger("toolledger.reconciler")

RunCall = Callable[[str, Any, CallRecord | None], Awaitable[HandleReport | None]]
"""Runs a listed call: its session, the ``function_call`` action, the call as the ledger
held it before the session was read (if it did)."""
LOGGED_ACTIONS_KEPT = 10_000
DEFAULT_CONCURRENCY = 16


@dataclass
class SessionReconciliation:
    session_id: str
    actions: Counter[str] = field(default_factory=Counter)
    status: str | None = None
    stopped: str | None = None
    """Why the session is no longer watched (failed or deleted), if it was stopped."""
    known: dict[CallKey, CallRecord] = field(default_factory=dict)
    """The session's open calls as the ledger held them before the session was read."""
    retry_in: float | None = None
    """Seconds after which the session should be reconciled again: the soonest known end of
    a wait among its calls (another worker's lease, a deadline, a submission backoff)."""

    def retry_after(self, seconds: float | None) -> None:
        if seconds is not None and (self.retry_in is None or seconds < self.retry_in):
            self.retry_in = seconds


@dataclass
class PassSummary:
    sessions: int = 0
    stopped: int = 0
    errors: int = 0
    actions: Counter[str] = field(default_factory=Counter)

    def add(self, result: SessionReconciliation) -> None:
        self.sessions += 1
        self.stopped += result.stopped is not None
        self.actions.update(result.actions)

    def as_json(self) -> dict[str, Any]:
        return {
            "sessions": self.sessions,
            "stopped": self.stopped,
            "errors": self.errors,
            "actions": dict(sorted(self.actions.items())),
        }


class Reconciler:
    def __init__(
        self,
        executor: Executor,
        gateway: AgentsGateway,
        sessions: SessionStore,
        *,
        run_call: RunCall | None = None,
        in_flight: Callable[[CallKey], bool] | None = None,
        concurrency: int = DEFAULT_CONCURRENCY,
    ) -> None:
        """``run_call`` runs a listed call (the service passes its bounded runner) and
        ``in_flight`` tells which calls it is busy with (their submission may be on its way).

        ``concurrency``: sessions whose ledger and API reads are in progress at once. A
        thousand sessions reconciling together (a timer tick, a restart) would otherwise queue
        on the connection pool ahead of the calls' own outcome writes and time them out.
        Running the listed calls is not counted: the call runner bounds that. Closing a pass
        (what the session no longer lists) has slots of its own: queued behind the reads of
        every session still to come, a session that had sent its results waited seconds to
        read its events (after a restart with a thousand sessions, 6 s)."""
        self.executor = executor
        self.gateway = gateway
        self.sessions = sessions
        self._run_call = run_call or executor.handle
        self._in_flight = in_flight or (lambda _key: False)
        self._logged: OrderedDict[tuple[str, ...], None] = OrderedDict()
        self._slots = asyncio.Semaphore(concurrency)
        self._closing = asyncio.Semaphore(concurrency)

    async def reconcile_session(self, session_id: str) -> SessionReconciliation:
        with log_fields(session_id=session_id):
            return await self._reconcile_session(session_id)

    async def _reconcile_session(self, session_id: str) -> SessionReconciliation:
        result = SessionReconciliation(session_id)
        async with self._slots:
            listed = await self._read(result)
        if listed is None:
            return result
        await self._run_listed(result, listed)
        async with self._closing:
            await self._close_unlisted(result, listed)
        return result

    async def _read(self, result: SessionReconciliation) -> dict[CallKey, FunctionCallAction] | None:
        """The session's open calls, then the session: what it lists (None once stopped)."""
        session_id = result.session_id
        store = self.executor.store
        result.known = {call.key: call for call in await store.open_calls(session_id)}
        known = result.known
        crash_point(CP_DURING_RECONCILE)
        try:
            session = await self.gateway.retrieve(session_id)
        except SessionGoneError:
            await self._stop(result, known.values(), "session deleted", status="deleted")
            return None
        result.status = session.status
        if session.status == "failed":
            # The API's failure text may quote anything: it is redacted before it is kept or logged.
            error = self.executor.store.redactor.text(session.error) if session.error else None
            reason = f"session failed: {error}" if error else "session failed"
            await self._stop(result, known.values(), reason, status="failed")
            return None

        listed: dict[CallKey, FunctionCallAction] = {}
        for action in session.required_actions:
            if isinstance(action, FunctionCallAction):
                listed[delivered_key(session_id, action)] = action
            else:
                self.note_foreign_action(session_id, action)
                result.actions["left_alone"] += 1
        return listed

    async def _close_unlisted(
        self, result: SessionReconciliation, listed: dict[CallKey, FunctionCallAction]
    ) -> None:
        """Open calls the session no longer lists: confirm, resubmit or abandon them."""
        session_id = result.session_id
        store = self.executor.store
        unlisted = [key for key in result.known if key not in listed]
        busy = {key for key in unlisted if self._in_flight(key)}
        result.actions["in_flight"] += len(busy)
        # Read again: the snapshot predates the retrieve, and a call's own run may have moved
        # it on since (submitted it, say), which must not be mistaken for work left over.
        current = await store.get_many([key for key in unlisted if key not in busy])
        still_open = [
            c for c in current.values() if c.status is not CallStatus.ABANDONED and c.confirmed_at is None
        ]
        # The common case, a turn over with every result in: confirmed in one statement.
        consumed = [c.key for c in still_open if c.status is CallStatus.SUBMITTED]
        confirmed = await store.mark_confirmed_many(consumed)
        result.actions["confirmed"] += len(confirmed)
        result.actions["raced"] += len(consumed) - len(confirmed)
        for call in still_open:
            if call.status is not CallStatus.SUBMITTED:
                result.actions[await self._close_one_unlisted(call, result)] += 1
        for counted in ("confirmed", "raced"):
            if not result.actions[counted]:
                del result.actions[counted]
        if not result.actions["in_flight"]:
            del result.actions["in_flight"]
        await self.sessions.mark_polled(session_id, status=result.status)

    async def confirm_turn(self, session_id: str, turn_id: str) -> int | None:
        """The session said turn ``turn_id`` completed: its submitted results were consumed.
        When those are all the session has open (none on its way here), they are confirmed
        from the event alone, without reading the session back; returns how many. None when
        anything else is open: a full reconcile must look."""
        async with self._slots:
            open_calls = await self.executor.store.open_calls(session_id)
            if not open_calls or any(
                call.key.turn_id != turn_id
                or call.status is not CallStatus.SUBMITTED
                or self._in_flight(call.key)
                for call in open_calls
            ):
                return None
            confirmed = await self.executor.store.mark_confirmed_many([c.key for c in open_calls])
        # A call another process moved meanwhile: a full reconcile looks at what became of it.
        return len(confirmed) if len(confirmed) == len(open_calls) else None

    async def reconcile_many(
        self,
        session_ids: Iterable[str],
        *,
        concurrency: int = 8,
        progress: Callable[[SessionReconciliation | None], None] | None = None,
    ) -> PassSummary:
        """One pass over many sessions, a few at a time; ``progress`` hears of each one
        (None for a session whose reconciliation failed)."""
        summary = PassSummary()
        slots = asyncio.Semaphore(concurrency)

        async def one(session_id: str) -> None:
            reconciled: SessionReconciliation | None = None
            async with slots:
                try:
                    reconciled = await self.reconcile_session(session_id)
                    summary.add(reconciled)
                except Exception:
                    log_failure(log, "reconciling session %s failed", session_id)
                    summary.errors += 1
            if progress is not None:
                progress(reconciled)

        await asyncio.gather(*(one(s) for s in session_ids))
        return summary

    # ----------------------------------------------------------------- internals

    async def _run_listed(
        self, result: SessionReconciliation, listed: dict[CallKey, FunctionCallAction]
    ) -> None:
        reports = await asyncio.gather(
            *(self._run_call(k.session_id, a, result.known.get(k)) for k, a in listed.items())
        )
        for report in reports:
            result.actions[report.action.value if report is not None else "shutting_down"] += 1
            if report is not None:
                result.retry_after(report.retry_in)

    async def _close_one_unlisted(self, call: CallRecord, result: SessionReconciliation) -> str:
        """An open call the session no longer lists."""
        store = self.executor.store
        if call.status is CallStatus.SUBMITTED:
            return "confirmed" if await store.mark_confirmed(call.key) else "raced"
        if call.status in RESULT_STATUSES:
            # Never sent again: confirmed if a request carrying it went out, else abandoned.
            fate = await self.executor.submitter.close_unlisted(
                call, may_have_landed=call.request_key is not None, session_status=result.status
            )
            if fate is Unlisted.AWAITING_LISTING:
                result.retry_after(LISTING_RACE_SECONDS)
            return fate.value
        if call.status is CallStatus.RUNNING and not await self.executor.take_over(call):
            # Nobody awaits it, but it is open until its run ends or its lease runs out.
            wait = await store.lease_remaining(call.key)
            result.retry_after(None if wait is None else wait + LEASE_WAKE_MARGIN)
            return "running_elsewhere"
        abandoned = await store.abandon(call.key, UNLISTED_REASON)
        return "abandoned" if abandoned is not None else "raced"

    async def _stop(
        self, result: SessionReconciliation, calls: Iterable[CallRecord], reason: str, *, status: str
    ) -> None:
        """A failed or deleted session awaits nothing: abandon its unanswered calls."""
        for call in calls:
            if call.status is not CallStatus.SUBMITTED and await self.executor.store.abandon(
                call.key, reason
            ):
                result.actions["abandoned"] += 1
        await self.sessions.unwatch(result.session_id, reason, status=status)
        result.stopped = reason
        log.info("session %s: %s; no longer watched", result.session_id, reason)

    def note_foreign_action(self, session_id: str, action: Any) -> None:
        ident = (
            session_id,
            str(getattr(action, "type", "?")),
            str(getattr(action, "request_id", "") or getattr(action, "environment_id", "")),
        )
        if ident in self._logged:
            return
        self._logged[ident] = None
        if len(self._logged) > LOGGED_ACTIONS_KEPT:
            self._logged.popitem(last=False)
        log.info("session %s requires a %s action: not a function call, left alone", session_id, ident[1])
