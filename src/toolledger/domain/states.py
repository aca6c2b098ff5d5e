"""A call's states, the transitions between them, and the effect classes that settle doubt."""

from __future__ import annotations

from enum import StrEnum


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
    """The handler may have run, but its lease expired without a result."""
    SUBMITTED = "submitted"
    """The result was accepted by the Agents API (``confirmed_at`` once it left required_actions)."""
    ABANDONED = "abandoned"
    """No longer awaited by the session before a result was submitted."""


UNCONFIRMED_ALERT_AFTER = 5
"""Acceptances of a call the session still awaits after which an operator is alerted."""

RESULT_STATUSES = frozenset({CallStatus.SUCCEEDED, CallStatus.FAILED})
"""A result is stored and waits to be submitted."""

ALLOWED_TRANSITIONS: dict[CallStatus, frozenset[CallStatus]] = {
    CallStatus.PENDING: frozenset({CallStatus.RUNNING, CallStatus.FAILED, CallStatus.ABANDONED}),
    CallStatus.RUNNING: frozenset(
        {CallStatus.SUCCEEDED, CallStatus.FAILED, CallStatus.UNKNOWN, CallStatus.ABANDONED}
    ),
    # PENDING: an operator allowed a re-run (``toolledger calls resolve --rerun``).
    CallStatus.UNKNOWN: frozenset(
        {
            CallStatus.PENDING,
            CallStatus.RUNNING,
            CallStatus.SUCCEEDED,
            CallStatus.FAILED,
            CallStatus.ABANDONED,
        }
    ),
    CallStatus.SUCCEEDED: frozenset({CallStatus.SUBMITTED, CallStatus.ABANDONED}),
    CallStatus.FAILED: frozenset({CallStatus.SUBMITTED, CallStatus.ABANDONED}),
    CallStatus.SUBMITTED: frozenset(),
    CallStatus.ABANDONED: frozenset(),
}


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
