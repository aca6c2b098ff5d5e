"""One call's life: record and claim, run the handler, store the outcome, submit, mark submitted.

Every step that matters is committed before the next one starts, so a crash anywhere leaves
the ledger saying exactly how far the call got; ``recover()`` picks it up from there.

The executor coordinates four parts: the decider (``decider``: what a recorded call needs
next, pure), the handler runner (``handler_runner``: the application's code), the submitter
(``submitter``: the Agents API) and the ledger writes that outlast a database away
(``retried_ledger``).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from toolledger.crashpoints import (
    CP_AFTER_CLAIM_COMMIT,
    CP_AFTER_HANDLER,
    CP_AFTER_RESULT_COMMIT,
    CP_DURING_RECOVERY,
    crash_point,
)
from toolledger.domain.delivered import DeliveredCall
from toolledger.domain.keys import ArgumentsRefused, CallKey, parse_arguments
from toolledger.domain.records import CallRecord
from toolledger.domain.results import FailureStage, InDoubt, Outcome, failed
from toolledger.domain.states import RESULT_STATUSES, UNCONFIRMED_ALERT_AFTER, CallStatus, EffectClass
from toolledger.domain.submissions import SubmitOutcome
from toolledger.errors import FencedError
from toolledger.gateway.agents import AgentsGateway
from toolledger.logs import log_fields
from toolledger.runtime.decider import (
    AskOperator,
    Claim,
    ExpireApproval,
    HandleAction,
    Policy,
    Report,
    Resubmit,
    Settle,
    TakeOver,
    Verified,
    Verify,
    decide,
    tool_for,
)
from toolledger.runtime.handler_runner import HandlerRunner, _failure, _Stage
from toolledger.runtime.handler_threads import HandlerThreads
from toolledger.runtime.registry import RegisteredTool, ToolRegistry
from toolledger.runtime.retried_ledger import RetriedLedger
from toolledger.runtime.submitter import Submitter, submission_backoff
from toolledger.settings import Settings
from toolledger.store.engine import finished_on_sqlite
from toolledger.store.ledger import LedgerStore
from toolledger.store.liveness import Liveness
from toolledger.tracing import CallSpan, call_span

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection

__all__ = [
    "LEASE_WAKE_MARGIN",
    "Executor",
    "HandleAction",
    "HandleReport",
    "RecoveryReport",
    "SubmitOutcome",
    "_Stage",
    "_failure",
    "submission_backoff",
]

log = logging.getLogger("toolledger.executor")

LEASE_WAKE_MARGIN = 0.25
"""Seconds past a lease's expiry before looking again: the expiry is compared on the
database's clock, and a look exactly at the expiry could find it a hair short."""
ASKED_REMEMBERED = 10_000
RECOVERY_SESSIONS_AT_ONCE = 16
"""Sessions whose stored results ``recover`` reads and resends at once."""


@dataclass(frozen=True)
class HandleReport:
    """What handling one delivered call did."""

    key: CallKey
    action: HandleAction
    status: CallStatus | None
    submitted: bool = False
    retry_in: float | None = None
    """Seconds after which the call should be looked at again, when it waits for something
    whose end is known: another worker's lease, an ``unknown_deadline``, a submission's
    backoff. None when nothing will change by itself."""
    submission: SubmitOutcome | None = None
    """What sending the result came to, when this handling sent it."""


@dataclass
class RecoveryReport:
    expired: int = 0
    actions: Counter[str] = field(default_factory=Counter)


class Executor:
    def __init__(
        self,
        registry: ToolRegistry,
        store: LedgerStore,
        gateway: AgentsGateway | None,
        settings: Settings,
        *,
        run_handlers: bool = True,
        liveness: Liveness | None = None,
        threads: HandlerThreads | None = None,
    ) -> None:
        """``run_handlers=False``: a process without the application's tools (``toolledger
        reconcile`` with no ``--tools``) resubmits and confirms, but never runs or settles a
        call: that needs the tool's code and declaration. ``liveness`` tells which lease
        owners are provably gone, so their calls are taken without waiting for the lease.
        ``threads``: the process's pool for sync handlers (``Runtime.handler_threads``);
        without it, one of this executor's own."""
        self.registry = registry
        self.store = store
        self.gateway = gateway
        self.settings = settings
        self.run_handlers = run_handlers
        self.liveness = liveness
        self.policy = Policy.of(settings, run_handlers=run_handlers)
        self.ledger = RetriedLedger(store, settings)
        self.handlers = HandlerRunner(store, settings, threads)
        self.submitter = Submitter(gateway, self.ledger, batching=settings.batching)
        self._asked: OrderedDict[CallKey, None] = OrderedDict()

    # ------------------------------------------------------------------ entry

    async def handle(
        self,
        session_id: str,
        action: Any,
        known: CallRecord | None = None,
        *,
        listing_may_be_stale: bool = False,
    ) -> HandleReport:
        """Handle one ``function_call`` entry of a session's ``required_actions`` (or the
        ``DeliveredCall`` read from it).

        ``known``: the call as the ledger held it moments ago (a reconciler's snapshot). A
        stored result there is sent without recording the call again: results never change,
        and a submission that raced another process's is harmless (same bytes, same key).
        ``listing_may_be_stale``: the call was listed by an event, not by a read of the session
        just now: a call submitted already is not sent again on its word (see ``decide``).
        """
        delivered = DeliveredCall.parse(session_id, action, self.settings.max_arguments_bytes)
        key = delivered.key
        with (
            log_fields(session_id=key.session_id, turn_id=key.turn_id, call_id=key.call_id),
            call_span("toolledger.call", key, tool=delivered.tool_name) as span,
        ):
            if (
                known is not None
                and known.key == key
                and known.status in RESULT_STATUSES
                and known.arguments_sha256 == delivered.fingerprint
            ):
                report = await self._continue(known)
            else:
                report = await self._handle(delivered, listing_may_be_stale)
            _note_report(span, report)
            log.debug(
                "call %s (%s): %s, now %s", key.call_id, delivered.tool_name, report.action, report.status
            )
            return report

    async def _handle(self, delivered: DeliveredCall, listing_may_be_stale: bool) -> HandleReport:
        key = delivered.key
        if not self.run_handlers:
            known = await self.store.get(key)
            if known is None:
                return HandleReport(key, HandleAction.LEFT_FOR_SERVICE, None)
            return await self._continue(known, listing_may_be_stale=listing_may_be_stale)
        tool = self.registry.get(delivered.tool_name)
        if tool is not None and tool.gated and self._needs_approval(tool, delivered):
            recorded = await self.ledger.record_for_approval(delivered, tool.effect, tool.approval_timeout)
        else:
            recorded = await self.ledger.record(
                delivered, tool.effect if tool is not None else EffectClass.UNREGISTERED
            )
        if recorded.arguments_mismatch:
            log.warning("call %s redelivered with other arguments: refused", key)
            return HandleReport(key, HandleAction.REFUSED_ARGUMENTS_MISMATCH, recorded.call.status)
        if recorded.claimed:
            crash_point(CP_AFTER_CLAIM_COMMIT)
            return await self._run_and_submit(tool, recorded.call, HandleAction.EXECUTED, delivered)
        return await self._continue(recorded.call, listing_may_be_stale=listing_may_be_stale)

    def _needs_approval(self, tool: RegisteredTool, delivered: DeliveredCall) -> bool:
        """Whether this call waits for a person. Arguments that cannot be read run nothing
        (the call fails on them), so they need no one's approval; a rule that raises is
        answered "yes": a gate must not open because its rule is broken."""
        if delivered.arguments is None:
            return False
        rule = tool.approval
        if isinstance(rule, bool):
            return rule
        try:
            return bool(rule(dict(delivered.arguments), self.handlers.context_for(tool, delivered.key)))
        except Exception as error:
            log.warning(
                "call %s: the approval rule of %s raised %s: it waits for approval",
                delivered.key,
                tool.name,
                type(error).__name__,
            )
            return True

    async def recover(self) -> RecoveryReport:
        """Pick up every call a crash or a lost connection left behind."""
        report = RecoveryReport()
        report.expired = len(await self.store.expire_leases(gone_owners=await self.gone_owners()))
        crash_point(CP_DURING_RECOVERY)
        for call in await self.store.in_states([CallStatus.UNKNOWN, CallStatus.PENDING]):
            report.actions[(await self._continue(call)).action.value] += 1
        # Stored results are sent only while their sessions await them: each session is read
        # first, and its awaited results go out together (in the requests they were recorded in).
        by_session: dict[str, list[CallRecord]] = {}
        for call in await self.store.in_states(RESULT_STATUSES):
            by_session.setdefault(call.key.session_id, []).append(call)
        slots = asyncio.Semaphore(RECOVERY_SESSIONS_AT_ONCE)

        async def resubmit(session_id: str, calls: list[CallRecord]) -> dict[CallKey, SubmitOutcome]:
            async with slots:
                return await self.submitter.submit_awaited(session_id, calls)

        for outcomes in await asyncio.gather(*(resubmit(s, calls) for s, calls in by_session.items())):
            for outcome in outcomes.values():
                report.actions[
                    "resubmitted" if outcome is SubmitOutcome.SUBMITTED else f"submit_{outcome}"
                ] += 1
        return report

    async def gone_owners(self) -> frozenset[str]:
        """Owners of running calls that are provably gone (their leases can be taken now)."""
        if self.liveness is None:
            return frozenset()
        return await self.liveness.gone(await self.store.running_owners())

    async def handle_recorded(self, call: CallRecord) -> HandleReport:
        """Carry on with a call already in the ledger, as if the session had just listed it
        (an operator's re-run of an ``unknown`` call starts here)."""
        key = call.key
        with (
            log_fields(session_id=key.session_id, turn_id=key.turn_id, call_id=key.call_id),
            call_span("toolledger.call", key, tool=call.tool_name) as span,
        ):
            report = await self._continue(call)
            _note_report(span, report)
            return report

    async def submit(self, call: CallRecord, *, listed: bool = True) -> SubmitOutcome:
        """Send the stored result in the request recorded for it (``runtime.submitter``).

        ``listed``: the call was in the session's ``required_actions`` just now. False: the
        session is read first, and the result sent only if it still awaits the call.
        """
        return await self.submitter.submit(call, listed=listed)

    async def take_over(self, call: CallRecord) -> list[CallRecord]:
        """A running call whose lease ran out, or whose owner is provably gone, becomes
        ``unknown`` (to be settled by its effect class); [] while its owner may still run it."""
        expired = await self.store.expire_leases(call.key)
        owner = call.lease_owner
        if expired or self.liveness is None or owner is None or owner == self.store.owner:
            return expired
        if not await self.liveness.gone([owner]):
            return []
        log.info("call %s: its lease owner %s is gone; taking the call over", call.key, owner)
        return await self.store.expire_leases(call.key, gone_owners=[owner])

    # ------------------------------------------------------------ existing calls

    async def _continue(
        self, call: CallRecord, verified: Verified | None = None, *, listing_may_be_stale: bool = False
    ) -> HandleReport:
        """Do what the decider says the recorded call needs next."""
        tool = tool_for(call, self.registry)
        decision = decide(
            call, tool, self.policy, datetime.now(UTC), verified, listing_may_be_stale=listing_may_be_stale
        )
        match decision:
            case Report(action=action, submitted=submitted, retry_in=retry_in):
                return HandleReport(call.key, action, call.status, submitted, retry_in)
            case Resubmit(unconfirmed=unconfirmed):
                report = await self._submitted_report(call, call, HandleAction.RESUBMITTED)
                if unconfirmed and report.submitted:
                    await self._note_unconfirmed(call)
                return report
            case TakeOver():
                expired = await self.take_over(call)
                if not expired:
                    wait = await self.store.lease_remaining(call.key)
                    retry_in = None if wait is None else wait + LEASE_WAKE_MARGIN
                    return HandleReport(
                        call.key, HandleAction.RUNNING_ELSEWHERE, call.status, retry_in=retry_in
                    )
                return await self._continue(expired[0])
            case Claim(source=source, reason=reason, action=action):
                claimed = await self.ledger.claim(call.key, source, reason)
                if claimed is None:
                    return HandleReport(call.key, HandleAction.RUNNING_ELSEWHERE, None)
                return await self._run_and_submit(tool, claimed, action)
            case Verify():
                assert tool is not None
                return await self._continue(call, await self.handlers.verify(tool, call))
            case Settle(outcome=outcome, reason=reason):
                settled = await self.store.settle(call.key, outcome, reason=reason)
                return await self._submitted_report(call, settled, HandleAction.SETTLED)
            case ExpireApproval(outcome=outcome, reason=reason):
                denied = await self.store.deny(call.key, outcome, decided_by="toolledger", reason=reason)
                return await self._submitted_report(call, denied, HandleAction.APPROVAL_EXPIRED)
            case AskOperator(deadline_in=deadline_in, retry_in=retry_in):
                self._ask_operator(call, deadline_in)
                return HandleReport(
                    call.key, HandleAction.WAITING_FOR_OPERATOR, call.status, retry_in=retry_in
                )
        raise AssertionError(f"unhandled decision {decision!r}")

    async def _note_unconfirmed(self, call: CallRecord) -> None:
        """Accepted again and again, yet still awaited: the service says "accepted" but does
        not consume it. Nothing toolledger can do beyond resubmitting; an operator should know."""
        count = await self.store.note_resubmission(call.key)
        if count == UNCONFIRMED_ALERT_AFTER:
            log.warning(
                "call %s: accepted %d times but still awaited by the session (unconfirmed)", call.key, count
            )
            await self.store.flag(
                call.key, "unconfirmed", f"accepted {count} times but still in required_actions"
            )

    def _ask_operator(self, call: CallRecord, deadline_in: float | None) -> None:
        """Once per call and process: a warning an operator can act on, with the command."""
        if call.key in self._asked:
            return
        self._asked[call.key] = None
        if len(self._asked) > ASKED_REMEMBERED:
            self._asked.popitem(last=False)
        until = (
            f"; unless settled, a fixed failure is sent in {deadline_in:.0f}s (unknown_deadline)"
            if deadline_in is not None
            else "; the session waits until then"
        )
        log.warning(
            "call %s (%s, %s) has an unknown outcome: its handler may have run. Settle it: "
            "toolledger calls resolve %s --output TEXT | --error TEXT | --rerun --reason WHY%s",
            call.key,
            call.tool_name,
            call.effect_class.value,
            call.key,
            until,
        )

    async def _submitted_report(
        self, call: CallRecord, settled: CallRecord | None, action: HandleAction
    ) -> HandleReport:
        """Submit ``settled`` (``call`` as it is now); None: another worker moved it first."""
        if settled is None:
            return HandleReport(call.key, HandleAction.RUNNING_ELSEWHERE, None)
        return _submission_report(settled, action, await self.submit(settled))

    # ------------------------------------------------------------------ running

    async def _run_and_submit(
        self,
        tool: RegisteredTool | None,
        call: CallRecord,
        action: HandleAction,
        delivered: DeliveredCall | None = None,
    ) -> HandleReport:
        """Run a claimed call and submit its result. ``delivered``: the call as it was just
        recorded from, whose arguments are read already."""
        try:
            done = await self._run(tool, call, delivered)
        except FencedError:
            log.warning("call %s: lease lost while running; result refused (fenced)", call.key)
            return HandleReport(call.key, HandleAction.FENCED, None)
        if done.status is CallStatus.UNKNOWN:
            # The handler could not tell whether its effect happened: no result to send. The
            # call is settled by its effect class now, as after a lease that ran out.
            log.info(
                "call %s (%s, %s): the handler could not tell whether its effect happened; "
                "the call is unknown",
                call.key,
                call.tool_name,
                call.effect_class.value,
            )
            return await self._continue(done)
        crash_point(CP_AFTER_RESULT_COMMIT)
        return _submission_report(done, action, await self.submit(done))

    async def _run(
        self, tool: RegisteredTool | None, call: CallRecord, delivered: DeliveredCall | None
    ) -> CallRecord:
        token = call.lease_token
        if tool is None:
            outcome = failed(call.key, f"Unknown tool: {call.tool_name}", FailureStage.LOOKUP)
            return await self.store.complete(call.key, token, outcome)
        try:
            arguments = self._arguments(call, delivered)
        except ArgumentsRefused as error:
            outcome = failed(call.key, str(error), FailureStage.ARGUMENTS)
            return await self.store.complete(call.key, token, outcome)

        async def keep(outcome: Outcome | InDoubt, connection: AsyncConnection | None) -> CallRecord:
            # The one moment the handler has returned and its outcome is in this process only.
            crash_point(CP_AFTER_HANDLER)
            if isinstance(outcome, InDoubt):
                return await self.ledger.mark_unknown(call.key, token, outcome)
            if connection is not None:
                return await self.store.complete(call.key, token, outcome, connection=connection)
            return await self.ledger.store_outcome(call.key, token, outcome)

        if tool.effect is EffectClass.TRANSACTIONAL:
            # On SQLite its transaction holds the file's write lock: it ends by commit or
            # rollback, never cut off mid-statement (see run_to_completion). Its handler's
            # timeout bounds the wait at shutdown.
            done = await finished_on_sqlite(
                self.store.engine, self.handlers.run_transactional(tool, call, arguments, keep)
            )
            # A failure's writes are rolled back; the failure result (or the doubt) is still kept.
            return done if isinstance(done, CallRecord) else await keep(done, None)
        return await self.handlers.run(tool, call, arguments, keep)

    def _arguments(self, call: CallRecord, delivered: DeliveredCall | None) -> dict[str, Any]:
        """The arguments the handler gets: as read from the delivery just recorded, or else
        from the stored text (after a crash only that is left: a refused call's preview is
        refused too). Raises ArgumentsRefused."""
        if call.approved_arguments is not None:
            # Amended by the person who approved the call: what they approved is what runs.
            return parse_arguments(call.approved_arguments, self.settings.max_arguments_bytes)
        if delivered is not None and delivered.key == call.key:
            if delivered.refused is not None:
                raise delivered.refused
            assert delivered.arguments is not None
            return delivered.arguments
        return parse_arguments(call.arguments, self.settings.max_arguments_bytes)


def _note_report(span: CallSpan, report: HandleReport) -> None:
    span.set("action", report.action.value)
    span.set("status", None if report.status is None else str(report.status))


def _submission_report(call: CallRecord, action: HandleAction, outcome: SubmitOutcome) -> HandleReport:
    retry_in = submission_backoff(call) if outcome is SubmitOutcome.FAILED else None
    return HandleReport(call.key, action, call.status, outcome is SubmitOutcome.SUBMITTED, retry_in, outcome)
