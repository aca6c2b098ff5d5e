"""What a recorded call needs next: decided from the call, its tool's policy and the time alone.

No database, no network, no clock read: the executor does what the decision says and, after
a step that changes the call (a lease taken over, a verify hook asked), decides again.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime
from enum import StrEnum

from toolledger.domain.records import CallRecord
from toolledger.domain.results import (
    NOT_APPROVED_IN_TIME_MESSAGE,
    POISON_MESSAGE,
    UNKNOWN_OUTCOME_MESSAGE,
    FailureStage,
    Outcome,
    failed,
    gave_up_after_attempts,
    gave_up_after_deadline,
)
from toolledger.domain.states import RESULT_STATUSES, CallStatus, EffectClass
from toolledger.runtime.context import VerifyAnswer
from toolledger.runtime.registry import RegisteredTool, ToolRegistry
from toolledger.settings import Settings

VERIFY_RETRY_SECONDS = 5.0
"""A verify hook that could not tell (its downstream away) is asked again after this."""
APPROVAL_WAKE_MARGIN = 0.25
"""Seconds past an approval's deadline before looking again (the deadline is the database's
moment; a look exactly at it could find it a hair short)."""


class HandleAction(StrEnum):
    """What handling one call did: every value a ``HandleReport`` carries."""

    EXECUTED = "executed"
    """Recorded (or found pending) and claimed here; the handler ran and its result was stored."""
    RERUN = "rerun"
    """An ``unknown`` call whose effect class allows it was run again here."""
    RESUBMITTED = "resubmitted"
    """A stored result was sent (again)."""
    SETTLED = "settled"
    """An ``unknown`` call got its outcome without a run (verify hook, attempts or deadline
    used up), which was then sent."""
    ALREADY_SUBMITTED = "already_submitted"
    """Accepted moments ago: the listing predates the submission."""
    WAITING_FOR_OPERATOR = "waiting_for_operator"
    """An ``unknown`` call nobody may re-run: ``toolledger calls resolve`` settles it."""
    RUNNING_ELSEWHERE = "running_elsewhere"
    """Another worker holds the call (or won the race to claim or settle it)."""
    REFUSED_ARGUMENTS_MISMATCH = "refused_arguments_mismatch"
    """Redelivered with other arguments than those recorded: refused and flagged."""
    FENCED = "fenced"
    """The lease was lost while the handler ran: its result was refused."""
    LEFT_FOR_SERVICE = "left_for_service"
    """This process runs no handlers (``reconcile`` without ``--tools``)."""
    WAITING_FOR_APPROVAL = "waiting_for_approval"
    """The tool needs a person's approval: ``toolledger calls approve`` or ``deny``."""
    APPROVAL_EXPIRED = "approval_expired"
    """Not approved within the tool's ``approval_timeout``: a fixed failure was sent."""
    NOTHING_TO_DO = "nothing_to_do"
    """The call is over (abandoned)."""
    ERROR = "error"
    """Handling stopped on an error (the database or the API away); the ledger holds how far
    it got (``CallRunner``)."""
    INTERRUPTED = "interrupted"
    """A handler's own BaseException stopped it; the lease expires into ``unknown`` (``CallRunner``)."""


@dataclass(frozen=True)
class Policy:
    """The settings the decisions depend on."""

    run_handlers: bool
    resubmit_after_seconds: float
    max_attempts: int

    @classmethod
    def of(cls, settings: Settings, *, run_handlers: bool) -> Policy:
        return cls(run_handlers, settings.resubmit_after_seconds, settings.max_attempts)


@dataclass(frozen=True)
class Verified:
    """A verify hook's answer, with the outcome to store when the first run happened."""

    answer: VerifyAnswer
    outcome: Outcome | None = None


# ------------------------------------------------------------------ decisions


@dataclass(frozen=True)
class Report:
    """Nothing to do now: report it."""

    action: HandleAction
    submitted: bool = False
    retry_in: float | None = None


@dataclass(frozen=True)
class Resubmit:
    """Send the stored result (again)."""

    unconfirmed: bool = False
    """Accepted earlier and still awaited long after: note it (an operator may need to know)."""


@dataclass(frozen=True)
class TakeOver:
    """Running under a lease: take it over if the lease ran out or its owner is gone, else
    report it running elsewhere."""


@dataclass(frozen=True)
class Claim:
    """Take a new lease, then run the handler."""

    source: CallStatus
    reason: str
    action: HandleAction


@dataclass(frozen=True)
class Verify:
    """Ask the tool's verify hook whether the first run happened, then decide again."""


@dataclass(frozen=True)
class Settle:
    """Give the ``unknown`` call this outcome without running it (the catalogue's SETTLE, the
    one meaning of "settle" here), then send it."""

    outcome: Outcome
    reason: str


@dataclass(frozen=True)
class AskOperator:
    """Wait for an operator to settle the call."""

    deadline_in: float | None
    """Seconds until a fixed failure is sent (``unknown_deadline``); None: never."""
    retry_in: float | None
    """Seconds after which to look again."""


@dataclass(frozen=True)
class ExpireApproval:
    """Not approved in time: store the fixed failure instead of running, then send it."""

    outcome: Outcome
    reason: str


Decision = Report | Resubmit | TakeOver | Claim | Verify | Settle | AskOperator | ExpireApproval


# ------------------------------------------------------------------ deciding


def tool_for(call: CallRecord, registry: ToolRegistry) -> RegisteredTool | None:
    """The handler for a recorded call. A call that arrived for a tool no one had registered
    keeps its lookup failure even if a later deployment registers the name: its answer
    must not depend on when a crash let it be retried."""
    if call.effect_class is EffectClass.UNREGISTERED:
        return None
    return registry.get(call.tool_name)


def decide(
    call: CallRecord,
    tool: RegisteredTool | None,
    policy: Policy,
    now: datetime,
    verified: Verified | None = None,
    *,
    listing_may_be_stale: bool = False,
) -> Decision:
    """What ``call`` needs next. ``tool``: ``tool_for(call, ...)``; ``verified``: the verify
    hook's answer, once a ``Verify`` decision had it asked; ``listing_may_be_stale``: the call
    was listed by an event, which may have waited any time to be read (a busy process reads
    its streams late), not by a read of the session just now."""
    if call.status in RESULT_STATUSES:
        return Resubmit()
    if call.status is CallStatus.SUBMITTED:
        if call.submitted_at is not None and seconds_between(call.submitted_at, now) < (
            policy.resubmit_after_seconds
        ):
            # Listed in an event sent before our submission landed: nothing to do.
            return Report(HandleAction.ALREADY_SUBMITTED, submitted=True)
        if listing_may_be_stale:
            # Not evidence that the submission was lost: an event read late lists calls
            # answered since (after a restart, a stream's first event was read seconds after
            # the reconcile had sent every result it listed). A read of the session now decides.
            return Report(HandleAction.ALREADY_SUBMITTED, submitted=True, retry_in=0.0)
        # Still awaited well after an accepted submission: send the same bytes again; the
        # Idempotency-Key makes the service apply them once at most.
        return Resubmit(unconfirmed=True)
    if call.status is CallStatus.AWAITING_APPROVAL:
        # Decided by the call alone (its deadline is in the row): a process without the
        # tools' code can end the wait as well as one with it.
        return _awaiting_approval(call, now)
    if not policy.run_handlers and call.status in (
        CallStatus.PENDING,
        CallStatus.UNKNOWN,
        CallStatus.RUNNING,
    ):
        return Report(HandleAction.LEFT_FOR_SERVICE)
    if call.status is CallStatus.RUNNING:
        return TakeOver()
    if call.status is CallStatus.PENDING:
        return Claim(CallStatus.PENDING, "claimed", HandleAction.EXECUTED)
    if call.status is CallStatus.UNKNOWN:
        return _unknown(call, tool, policy, now, verified)
    return Report(HandleAction.NOTHING_TO_DO)


def _unknown(
    call: CallRecord, tool: RegisteredTool | None, policy: Policy, now: datetime, verified: Verified | None
) -> Decision:
    """An interrupted run left no result: decide by the tool's effect class, never by guessing."""
    effect = tool.effect if tool is not None else call.effect_class
    if effect is EffectClass.VERIFIED and tool is not None:
        if verified is None:
            return Verify()
        if verified.answer is VerifyAnswer.EXECUTED:
            assert verified.outcome is not None, "an executed verification carries its outcome"
            return Settle(verified.outcome, "verify hook: the first run happened")
        if verified.answer is VerifyAnswer.UNKNOWN:
            waiting = _wait_or_give_up(tool, call, now)
            if not isinstance(waiting, AskOperator):
                return waiting
            # The hook could not tell (its downstream away, say): ask it again soon.
            return replace(
                waiting, retry_in=min(waiting.retry_in or VERIFY_RETRY_SECONDS, VERIFY_RETRY_SECONDS)
            )
    elif not effect.rerun_is_safe:
        return _wait_or_give_up(tool, call, now)
    max_attempts = (tool.max_attempts if tool else None) or policy.max_attempts
    if call.attempt_count >= max_attempts:
        return Settle(
            failed(call.key, POISON_MESSAGE, FailureStage.RECOVERY),
            gave_up_after_attempts(call.attempt_count),
        )
    return Claim(CallStatus.UNKNOWN, f"re-run after an unknown outcome ({effect.value})", HandleAction.RERUN)


def _awaiting_approval(call: CallRecord, now: datetime) -> Report | ExpireApproval:
    if call.approval_expires_at is None:
        return Report(HandleAction.WAITING_FOR_APPROVAL)
    left = seconds_between(now, call.approval_expires_at)
    if left <= 0:
        return ExpireApproval(
            failed(call.key, NOT_APPROVED_IN_TIME_MESSAGE, FailureStage.APPROVAL), "not approved in time"
        )
    return Report(HandleAction.WAITING_FOR_APPROVAL, retry_in=left + APPROVAL_WAKE_MARGIN)


def _wait_or_give_up(tool: RegisteredTool | None, call: CallRecord, now: datetime) -> Settle | AskOperator:
    deadline = tool.unknown_deadline if tool is not None else None
    if deadline is None:
        return AskOperator(deadline_in=None, retry_in=None)
    waited = seconds_between(call.lease_expires_at or call.created_at, now)
    if waited >= deadline:
        return Settle(
            failed(call.key, UNKNOWN_OUTCOME_MESSAGE, FailureStage.RECOVERY),
            gave_up_after_deadline(deadline),
        )
    return AskOperator(deadline_in=deadline - waited, retry_in=deadline - waited)


def seconds_between(moment: datetime, now: datetime) -> float:
    """Seconds from ``moment`` to ``now`` (the ledger reads every time back as aware UTC)."""
    return (now - moment).total_seconds()
