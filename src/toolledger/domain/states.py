"""A call's states, the transitions between them, and the effect classes that settle doubt."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple


class CallStatus(StrEnum):
    PENDING = "pending"
    """Recorded, not claimed."""
    RUNNING = "running"
    """Claimed under a lease; the handler may be running."""
    SUCCEEDED = "succeeded"
    """The handler returned; the result is stored, not yet submitted."""
    FAILED = "failed"
    """A failure result is stored, not yet submitted."""
    UNKNOWN = "unknown"
    """The handler may have run, but left no result: its lease expired first, or it said
    itself that it could not tell (``MaybeExecuted``)."""
    SUBMITTED = "submitted"
    """The result was accepted by the Agents API (``confirmed_at`` once it left required_actions)."""
    ABANDONED = "abandoned"
    """No longer awaited by the session before a result was submitted."""
    AWAITING_APPROVAL = "awaiting_approval"
    """Recorded for a tool that needs a person's approval: not run until approved (then
    ``pending``), denied or expired (then ``failed``)."""


UNCONFIRMED_ALERT_AFTER = 5
"""Acceptances of a call the session still awaits after which an operator is alerted."""

RESULT_STATUSES = frozenset({CallStatus.SUCCEEDED, CallStatus.FAILED})
"""A result is stored and waits to be submitted."""


class Fencing(StrEnum):
    """Who may make a transition, besides finding the call in one of its source states."""

    NONE = "none"
    """Compare-and-set on the status alone: whoever finds the call in a source state wins."""
    LEASE_TOKEN = "lease_token"  # noqa: S105 (a column's name, not a secret)
    """Only the holder of the current lease token: a worker that lost its lease is refused."""
    LEASE_LAPSED = "lease_lapsed"
    """Only once the lease ran out, or its owner is provably gone."""
    APPROVAL_OPEN = "approval_open"
    """Only while the call's approval is open: before its ``approval_expires_at`` on the
    database's clock (whoever has or has not yet written the expiry), and for the arguments
    the person saw (their sha256, given with the approval)."""


@dataclass(frozen=True)
class Transition:
    """One write of the ledger that changes a call's status, declared once: the store runs it
    as a compare-and-set (``UPDATE ... WHERE status IN sources``) plus its audit event."""

    name: str
    sources: frozenset[CallStatus]
    """The states it may start from; empty: the call is created by it."""
    target: CallStatus
    writes: frozenset[str]
    """The columns it sets besides ``status`` and ``updated_at``."""
    event: str = "transition"
    """The kind of its audit event."""
    fencing: Fencing = Fencing.NONE
    durable: bool = True
    """False: its commit need not wait for the disk (PostgreSQL ``synchronous_commit = off``
    for its transaction alone, SQLite ``synchronous = NORMAL`` for its transaction: it
    survives the process being killed, not the machine losing power). Only for a write
    whose loss in a database crash leaves the call as a crash of ours just before the write
    would, a moment the crash matrix covers."""


_OUTCOME_COLUMNS = frozenset({"result", "error_stage", "error_detail", "finished_at", "lease_expires_at"})
_RECORDED_COLUMNS = frozenset(
    {"tool_name", "arguments", "arguments_sha256", "effect_class", "idempotency_key", "created_at"}
)
_DECISION_COLUMNS = frozenset({"approval_decided_by", "approval_decided_at"})
_LEASE_COLUMNS = frozenset({"lease_token", "attempt_count", "lease_owner", "lease_expires_at", "started_at"})

RECORD = Transition("record", frozenset(), CallStatus.RUNNING, _LEASE_COLUMNS | _RECORDED_COLUMNS)
"""A delivered call recorded and claimed in one commit (commit point 1)."""

RECORD_FOR_APPROVAL = Transition(
    "record_for_approval",
    frozenset(),
    CallStatus.AWAITING_APPROVAL,
    _RECORDED_COLUMNS | {"approval_expires_at"},
)
"""A delivered call of a tool that needs approval, recorded and not claimed: nothing runs
until a person approves it."""

APPROVE = Transition(
    "approve",
    frozenset({CallStatus.AWAITING_APPROVAL}),
    CallStatus.PENDING,
    _DECISION_COLUMNS | {"approved_arguments", "approved_arguments_sha256"},
    event="approval",
    fencing=Fencing.APPROVAL_OPEN,
)
"""A person approved the call in time (before its deadline, on the database's clock), bound
to the fingerprint of the arguments they saw, perhaps with amended arguments: it may now be
claimed, once. The claim that runs it moves it on, so no second claim can run it on the same
approval. No claim starts from ``awaiting_approval``: this compare-and-set is the only gate."""

DENY = Transition(
    "deny",
    frozenset({CallStatus.AWAITING_APPROVAL}),
    CallStatus.FAILED,
    _OUTCOME_COLUMNS | _DECISION_COLUMNS,
    event="approval",
)
"""Denied by a person (the model gets their reason), or not approved in time (a fixed text):
a failure result, stored and then submitted like any other."""

CLAIM = Transition(
    "claim", frozenset({CallStatus.PENDING, CallStatus.UNKNOWN}), CallStatus.RUNNING, _LEASE_COLUMNS
)
"""A new lease (a new token) on a recorded call: a re-run, or an operator's re-run."""


class ByOutcome(NamedTuple):
    """A transition that stores an outcome, declared for each: the same columns are written
    whether the run succeeded or not, only the target differs."""

    succeeded: Transition
    failed: Transition

    def of(self, success: bool) -> Transition:
        return self.succeeded if success else self.failed


def _outcome_stored(name: str, source: CallStatus, fencing: Fencing) -> ByOutcome:
    succeeded, failed = (
        Transition(name, frozenset({source}), target, _OUTCOME_COLUMNS, fencing=fencing)
        for target in (CallStatus.SUCCEEDED, CallStatus.FAILED)
    )
    return ByOutcome(succeeded, failed)


COMPLETE = _outcome_stored("complete", CallStatus.RUNNING, Fencing.LEASE_TOKEN)
"""A run's outcome stored (commit point 2), by the run that holds the lease."""

COMPLETE_LATE = _outcome_stored("complete_late", CallStatus.UNKNOWN, Fencing.LEASE_TOKEN)
"""The only run's outcome, after its lease expired but before anyone claimed the call again:
its token is still current, and that is the one true outcome."""

SETTLE = _outcome_stored("settle", CallStatus.UNKNOWN, Fencing.NONE)
"""An unknown call given its outcome without running it (verify hook, operator, deadline)."""

REOPEN = Transition(
    "reopen", frozenset({CallStatus.UNKNOWN}), CallStatus.PENDING, frozenset({"lease_expires_at"})
)
"""An operator allows an unknown call to run again (``toolledger calls resolve --rerun``)."""

EXPIRE = Transition(
    "expire",
    frozenset({CallStatus.RUNNING}),
    CallStatus.UNKNOWN,
    frozenset({"lease_expires_at"}),
    fencing=Fencing.LEASE_LAPSED,
)
"""A running call whose lease ran out without a result (or whose owner is gone)."""

MARK_UNKNOWN = Transition(
    "mark_unknown",
    frozenset({CallStatus.RUNNING}),
    CallStatus.UNKNOWN,
    frozenset({"lease_expires_at"}),
    fencing=Fencing.LEASE_TOKEN,
)
"""The run holding the lease ended without knowing whether its side effect happened (its
handler raised ``MaybeExecuted``): the call is ``unknown`` at once, as it would be once its
lease ran out, and is settled by its effect class the same way."""

SUBMIT = Transition(
    "submit",
    RESULT_STATUSES,
    CallStatus.SUBMITTED,
    frozenset({"submitted_at", "submission_count", "last_submission_error"}),
    event="submission",
    # Lost with the database, the call is as after a crash at after_submit_response: its
    # stored result is sent again under the same key, or recognised as answered already.
    durable=False,
)
"""The Agents API accepted the stored result (commit point 3)."""

ABANDON = Transition(
    "abandon",
    frozenset(
        {
            CallStatus.PENDING,
            CallStatus.RUNNING,
            CallStatus.UNKNOWN,
            CallStatus.AWAITING_APPROVAL,
            *RESULT_STATUSES,
        }
    ),
    CallStatus.ABANDONED,
    frozenset({"abandoned_reason", "lease_expires_at"}),
)
"""The session stopped awaiting a call before its result was submitted."""

TRANSITIONS: tuple[Transition, ...] = (
    RECORD,
    RECORD_FOR_APPROVAL,
    APPROVE,
    DENY,
    CLAIM,
    *COMPLETE,
    *COMPLETE_LATE,
    *SETTLE,
    REOPEN,
    EXPIRE,
    MARK_UNKNOWN,
    SUBMIT,
    ABANDON,
)
"""Every transition of the ledger: the store runs these and no others."""

ALLOWED_TRANSITIONS: dict[CallStatus, frozenset[CallStatus]] = {
    status: frozenset(t.target for t in TRANSITIONS if status in t.sources) for status in CallStatus
}
"""The state table, derived from ``TRANSITIONS`` (the one place it is declared)."""

FINAL_STATUSES = frozenset(status for status, targets in ALLOWED_TRANSITIONS.items() if not targets)
"""States no transition leaves."""


def sources_of(target: CallStatus) -> tuple[CallStatus, ...]:
    """The states a transition to ``target`` may start from."""
    return tuple(source for source, targets in ALLOWED_TRANSITIONS.items() if target in targets)


class EffectClass(StrEnum):
    """What a second run of a tool would do; recovery of an ``unknown`` call follows from it."""

    AT_MOST_ONCE = "at_most_once"
    """Never run again; an unknown outcome waits for an operator or a deadline."""
    IDEMPOTENT = "idempotent"
    """Safe to run again with the same idempotency key."""
    READ_ONLY = "read_only"
    """No side effect: safe to run again."""
    TRANSACTIONAL = "transactional"
    """Writes through the ledger's transaction: effect and result commit together."""
    VERIFIED = "verified"
    """A verify hook asks the downstream system whether the first run happened."""
    UNREGISTERED = "unregistered"
    """No tool of that name was registered when the call arrived: no handler ever runs for it;
    it is answered with a lookup failure, however often it is retried."""

    @property
    def rerun_is_safe(self) -> bool:
        return self in (
            EffectClass.IDEMPOTENT,
            EffectClass.READ_ONLY,
            EffectClass.TRANSACTIONAL,
            EffectClass.UNREGISTERED,
        )
