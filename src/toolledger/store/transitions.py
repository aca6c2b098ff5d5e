"""The SQL of the ledger's writes: what each transition of ``domain.states.TRANSITIONS`` sets,
and the notes, writes that keep a call's status (a counter, a moment) and say so in its trail.

Declared here once, as data; ``PostgresLedger`` and ``SqliteLedger`` turn each into
statements their own way (one statement with its event, or a transaction of several).
Every statement names the call through bind parameters (``key_params`` fills them), so it is
built once per shape and reused.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Float, String, Update, and_, bindparam, case, or_
from sqlalchemy.sql.elements import BindParameter, ColumnElement

from toolledger.domain.keys import CallKey
from toolledger.domain.states import (
    ABANDON,
    APPROVE,
    CLAIM,
    COMPLETE,
    COMPLETE_LATE,
    DENY,
    EXPIRE,
    MARK_UNKNOWN,
    RECORD,
    RECORD_FOR_APPROVAL,
    REOPEN,
    SETTLE,
    SUBMIT,
    TRANSITIONS,
    CallStatus,
    Fencing,
    Transition,
)
from toolledger.domain.trail import CONTENT_FIELDS, parts_written
from toolledger.store.engine import utc_after, utc_now
from toolledger.store.schema import StorableText, storable_text, tool_calls

KEY_COLUMNS = (tool_calls.c.session_id, tool_calls.c.turn_id, tool_calls.c.call_id)

CONTENT_COLUMNS = tuple(tool_calls.c[name] for name in CONTENT_FIELDS)
"""What the digest of a call's content covers (``domain.trail``): every statement that writes
an event reads them from the row it changed, or from the row as it is."""

EVENT_COLUMNS = (
    "session_id",
    "turn_id",
    "call_id",
    "at",
    "actor",
    "kind",
    "from_status",
    "to_status",
    "lease_token",
    "reason",
    "detail",
    "content_sha256",
    "trail_mac",
)
"""What a statement inserting events gives each one (the database's trigger sets the hashes)."""

KEY_MATCH = and_(
    tool_calls.c.session_id == bindparam("k_session_id"),
    tool_calls.c.turn_id == bindparam("k_turn_id"),
    tool_calls.c.call_id == bindparam("k_call_id"),
)
"""A call's key as bind parameters (``key_params`` fills them)."""


def key_params(key: CallKey) -> dict[str, str]:
    return {"k_session_id": key.session_id, "k_turn_id": key.turn_id, "k_call_id": key.call_id}


LEASE_RAN_OUT = tool_calls.c.lease_expires_at < utc_now()

APPROVAL_OPEN = (
    # Decided by the database's clock in the same compare-and-set, not by when `serve` wakes
    # to write the expiry: a late approval finds nothing to approve.
    or_(tool_calls.c.approval_expires_at.is_(None), tool_calls.c.approval_expires_at > utc_now()),
    tool_calls.c.arguments_sha256 == bindparam("p_seen_sha256", type_=String),
)
"""What ``APPROVE`` requires besides its source state (``Fencing.APPROVAL_OPEN``)."""

_NEW_LEASE: dict[str, Any] = {
    "lease_owner": bindparam("p_owner"),
    "lease_expires_at": utc_after(bindparam("p_lease_seconds", type_=Float)),
    "started_at": utc_now(),
}

_OUTCOME: dict[str, Any] = {
    "result": bindparam("p_result"),
    "error_stage": bindparam("p_error_stage"),
    "error_detail": bindparam("p_error_detail"),
    "finished_at": utc_now(),
    "lease_expires_at": None,
}

_RECORDED: dict[str, Any] = {
    "tool_name": bindparam("p_tool_name"),
    "arguments": bindparam("p_arguments"),
    "arguments_sha256": bindparam("p_sha256"),
    "effect_class": bindparam("p_effect_class"),
    "idempotency_key": bindparam("p_idempotency_key"),
    "created_at": utc_now(),
}

_DECIDED: dict[str, Any] = {
    "approval_decided_by": bindparam("p_decided_by"),
    "approval_decided_at": utc_now(),
}

WRITES: Mapping[str, Mapping[str, Any]] = {
    RECORD.name: {**_NEW_LEASE, **_RECORDED, "lease_token": 1, "attempt_count": 1},
    RECORD_FOR_APPROVAL.name: {
        **_RECORDED,
        "approval_expires_at": utc_after(bindparam("p_approval_seconds", type_=Float)),
    },
    APPROVE.name: {
        **_DECIDED,
        "approved_arguments": bindparam("p_approved_arguments"),
        "approved_arguments_sha256": bindparam("p_approved_sha256"),
    },
    DENY.name: {**_OUTCOME, **_DECIDED},
    CLAIM.name: {
        **_NEW_LEASE,
        "lease_token": tool_calls.c.lease_token + 1,
        "attempt_count": tool_calls.c.attempt_count + 1,
    },
    COMPLETE.succeeded.name: _OUTCOME,
    COMPLETE_LATE.succeeded.name: _OUTCOME,
    SETTLE.succeeded.name: _OUTCOME,
    REOPEN.name: {"lease_expires_at": None},
    # When the run's lease ended: an unknown call's deadline counts from here.
    EXPIRE.name: {"lease_expires_at": case((LEASE_RAN_OUT, tool_calls.c.lease_expires_at), else_=utc_now())},
    # The run ends here: an unknown call's deadline counts from now, as from a lease's end.
    MARK_UNKNOWN.name: {"lease_expires_at": utc_now()},
    SUBMIT.name: {
        "submitted_at": utc_now(),
        "submission_count": tool_calls.c.submission_count + 1,
        "last_submission_error": None,
    },
    ABANDON.name: {"abandoned_reason": bindparam("p_abandoned_reason"), "lease_expires_at": None},
}
"""The columns each transition sets (by name) besides ``status`` and ``updated_at``: constant
expressions and bind parameters, so that its statement is built once."""


def changes(transition: Transition) -> dict[str, Any]:
    """Everything a transition's UPDATE (or INSERT) sets."""
    return {"status": transition.target.value, "updated_at": utc_now(), **WRITES[transition.name]}


def fenced(transition: Transition) -> tuple[ColumnElement[bool], ...]:
    """What a transition's UPDATE requires besides its source state."""
    if transition.fencing is Fencing.LEASE_TOKEN:
        return (tool_calls.c.lease_token == bindparam("p_token"),)
    if transition.fencing is Fencing.NONE:
        return ()
    if transition.fencing is Fencing.APPROVAL_OPEN:
        return APPROVAL_OPEN
    # LEASE_LAPSED depends on who is known to be gone: ``LedgerStore.expire_leases`` says it.
    raise ValueError(f"transition {transition.name} is fenced by {transition.fencing}: not a keyed update")


def record_insert(insert: Callable[..., Any], transition: Transition = RECORD) -> Any:
    """``RECORD`` (a delivered call inserted running) or ``RECORD_FOR_APPROVAL``, unless its
    key or idempotency key is already recorded (``insert``: the database's own, which knows
    ON CONFLICT)."""
    return (
        insert(tool_calls)
        .values(
            session_id=bindparam("k_session_id"),
            turn_id=bindparam("k_turn_id"),
            call_id=bindparam("k_call_id"),
            **changes(transition),
        )
        # No conflict target: the idempotency key is unique too, and a racing insert can
        # hit either constraint first; both mean "already recorded".
        .on_conflict_do_nothing()
        .returning(tool_calls)
    )


HEARTBEAT = (
    tool_calls.update()
    .where(
        KEY_MATCH,
        tool_calls.c.status == CallStatus.RUNNING.value,
        tool_calls.c.lease_token == bindparam("p_token"),
    )
    .values(lease_expires_at=utc_after(bindparam("p_lease_seconds", type_=Float)), updated_at=utc_now())
)
"""A running call's lease extended by the run that holds it (fenced by its token); no status
changes and nothing is noted: a heartbeat is not an event of the call's life."""


@dataclass(frozen=True)
class Note:
    """A write that keeps the call's status, noted in its audit trail (no lease token: no
    run is behind it)."""

    name: str
    where: tuple[ColumnElement[bool], ...]
    """What the call must be like, besides its key."""
    writes: Mapping[str, Any]
    """Columns set besides ``updated_at``."""
    event: str
    status: CallStatus | None
    """The status the event names as both from and to, if it names one."""
    returns: tuple[Any, ...] = ()
    """Columns returned besides the key."""

    def update(self, match: ColumnElement[bool]) -> Update:
        """The note's UPDATE for the calls ``match`` selects, returning their keys and content
        (its event carries the digest of the content)."""
        return (
            tool_calls.update()
            .where(match, *self.where)
            .values(updated_at=utc_now(), **self.writes)
            .returning(*KEY_COLUMNS, *CONTENT_COLUMNS, *self.returns)
        )


RESUBMISSION = Note(
    "note_resubmission",
    (tool_calls.c.status == CallStatus.SUBMITTED.value,),
    {"submission_count": tool_calls.c.submission_count + 1},
    "resubmission",
    None,
    returns=(tool_calls.c.submission_count,),
)
"""A submitted call still awaited was sent again and accepted again."""

SUBMISSION_FAILURE = Note(
    "record_submission_failure",
    (),
    {"submission_count": tool_calls.c.submission_count + 1, "last_submission_error": bindparam("p_error")},
    "submission_failed",
    None,
)
"""A submission was refused or failed (in whatever state the call is)."""

CONFIRM = Note(
    "mark_confirmed",
    (tool_calls.c.status == CallStatus.SUBMITTED.value, tool_calls.c.confirmed_at.is_(None)),
    {"confirmed_at": utc_now()},
    "confirmed",
    CallStatus.SUBMITTED,
)
"""The session no longer awaits a submitted result: it was consumed."""


def content_written(transition: Transition, params: Mapping[str, Any]) -> dict[str, str | None]:
    """The call's content ``transition`` sets with ``params``, as the row will hold it: what
    its event's keyed MAC covers besides the event's own fields (``domain.trail.mac_text``)."""
    written: dict[str, str | None] = {}
    for name in CONTENT_FIELDS:
        if name in transition.writes:
            value = params[WRITES[transition.name][name].key]
            written[name] = stored_value(name, value)
    return written


def stored_value(name: str, value: str | None) -> str | None:
    """``value`` as column ``name`` of ``tool_calls`` stores it (a free-text column's rule)."""
    if value is None or not isinstance(tool_calls.c[name].type, StorableText):
        return value
    return storable_text(value)


def _check_catalogue() -> None:
    """Each transition sets exactly the columns it declares: the catalogue and its SQL are
    one declaration, checked when this module loads. What it sets of a call's content, it
    sets whole parts of, from parameters (its event's keyed MAC names them)."""
    for transition in TRANSITIONS:
        declared, written = set(transition.writes), set(WRITES[transition.name])
        if declared != written:
            raise RuntimeError(
                f"transition {transition.name}: declares {sorted(declared)}, writes {sorted(written)}"
            )
        parts_written(transition.writes)
        for name in set(CONTENT_FIELDS) & written:
            if not isinstance(WRITES[transition.name][name], BindParameter):
                raise RuntimeError(f"transition {transition.name}: sets {name} from no parameter")
    stray = set(WRITES) - {t.name for t in TRANSITIONS}
    if stray:
        raise RuntimeError(f"SQL for transitions not in the catalogue: {sorted(stray)}")


_check_catalogue()

__all__ = [
    "APPROVAL_OPEN",
    "CONFIRM",
    "CONTENT_COLUMNS",
    "EVENT_COLUMNS",
    "HEARTBEAT",
    "KEY_COLUMNS",
    "KEY_MATCH",
    "LEASE_RAN_OUT",
    "RESUBMISSION",
    "SUBMISSION_FAILURE",
    "WRITES",
    "Note",
    "changes",
    "content_written",
    "fenced",
    "key_params",
    "record_insert",
    "stored_value",
]
