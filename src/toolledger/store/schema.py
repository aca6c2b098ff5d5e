"""The ledger's tables. Migrations in ``migrations/`` must build exactly this (a test checks)."""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import (
    DDL,
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    ForeignKeyConstraint,
    Index,
    Integer,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    Text,
    TypeDecorator,
    and_,
    event,
    func,
    or_,
    text,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.sql.elements import ColumnElement

from toolledger.domain.states import CallStatus, EffectClass
from toolledger.store.chain import (
    PG_DROP_SQL,
    PG_TEXT_FUNCTION_SQL,
    PG_TEXT_FUNCTION_V2_SQL,
    PG_TRIGGER_FUNCTION_SQL,
    PG_TRIGGER_SQL,
    SQLITE_TRIGGER_SQL,
)

NAMING_CONVENTION = {
    "pk": "pk_%(table_name)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ix": "ix_%(column_0_label)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
}

metadata = MetaData(naming_convention=NAMING_CONVENTION)


def storable_text(text: str) -> str:
    """Text as both databases hold it: PostgreSQL's text takes neither NUL nor lone
    surrogates (SQLite takes both), so those are spelled as escapes on both."""
    if text.isascii() and "\x00" not in text:
        return text
    return text.replace("\x00", "\\u0000").encode("utf-8", "backslashreplace").decode("utf-8")


class StorableText(TypeDecorator[str]):
    """A free-text column: whatever writes it (a transition, an operator's reason, the API's
    words about a session), the same ``storable_text`` rule applies."""

    impl = Text
    cache_ok = True

    def process_bind_param(self, value: str | None, dialect: Dialect) -> str | None:
        return None if value is None else storable_text(value)


class UtcDateTime(TypeDecorator[datetime]):
    """A moment, read back as a timezone-aware UTC datetime on both databases: no reader
    converts. PostgreSQL's timestamptz arrives in the session's time zone; SQLite keeps UTC
    digits as text (``store.engine.utc_now``) and gives them back naive.

    Written as UTC: a naive moment is taken to be UTC, an aware one is converted (on SQLite
    the digits are what is compared, so 09:00+02:00 must be stored as 07:00)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        utc = value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
        return utc.replace(tzinfo=None) if dialect.name == "sqlite" else utc

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None or value.tzinfo is UTC:
            return value
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


ID = String(255)

_STATUSES = ", ".join(f"'{s.value}'" for s in CallStatus)
_EFFECTS = ", ".join(f"'{e.value}'" for e in EffectClass)
CLAIMABLE = ("pending", "running", "unknown", "succeeded", "failed")
"""States recovery scans for: a partial index keeps that scan flat as finished calls pile up."""

AWAITED = (*CLAIMABLE, "awaiting_approval")
"""States in which the session still awaits a call's result, besides submitted-unconfirmed."""

OPEN_CALL_SQL = (
    f"status IN ({', '.join(repr(s) for s in AWAITED)}) OR (status = 'submitted' AND confirmed_at IS NULL)"
)
"""Calls the session may still be waiting on: start-up recovery looks for their sessions."""


PRUNABLE_SQL = "status IN ('submitted', 'abandoned')"
"""Calls pruning may delete (``store.audit.PRUNABLE``, which must stay the same for its index to
serve): their result was accepted, or nobody awaits them any more."""


def open_call_clause() -> ColumnElement[bool]:
    """``OPEN_CALL_SQL`` as an expression (bracketed, so it combines safely with others)."""
    return or_(
        tool_calls.c.status.in_(AWAITED),
        and_(tool_calls.c.status == CallStatus.SUBMITTED.value, tool_calls.c.confirmed_at.is_(None)),
    )


tool_calls = Table(
    "tool_calls",
    metadata,
    Column("session_id", ID, nullable=False),
    Column("turn_id", ID, nullable=False),
    Column("call_id", ID, nullable=False),
    Column("tool_name", String(255), nullable=False),
    Column("arguments", StorableText, nullable=False),
    Column("arguments_sha256", String(64), nullable=False),
    Column("status", String(32), nullable=False),
    Column("effect_class", String(16), nullable=False),
    Column("idempotency_key", String(64), nullable=False, unique=True),
    Column("attempt_count", Integer, nullable=False, server_default=text("0")),
    Column("lease_owner", String(255)),
    Column("lease_token", BigInteger, nullable=False, server_default=text("0")),
    Column("lease_expires_at", UtcDateTime()),
    Column("result", StorableText),
    Column("error_stage", String(16)),
    Column("error_detail", StorableText),
    Column("created_at", UtcDateTime(), nullable=False),
    Column("started_at", UtcDateTime()),
    Column("finished_at", UtcDateTime()),
    Column("submitted_at", UtcDateTime()),
    Column("confirmed_at", UtcDateTime()),
    Column("updated_at", UtcDateTime(), nullable=False),
    Column("submission_count", Integer, nullable=False, server_default=text("0")),
    Column("last_submission_error", StorableText),
    Column("abandoned_reason", StorableText),
    # Approval gates: when an unapproved call's wait ends, who decided and when, and the
    # arguments an approver amended (what the handler then receives).
    Column("approval_expires_at", UtcDateTime()),
    Column("approval_decided_by", String(255)),
    Column("approval_decided_at", UtcDateTime()),
    Column("approved_arguments", StorableText),
    Column("approved_arguments_sha256", String(64)),
    # The Idempotency-Key of the request the stored result goes out in, recorded before it is
    # first posted (a batch's members share it): every resend replays exactly that request.
    Column("request_key", String(64)),
    PrimaryKeyConstraint("session_id", "turn_id", "call_id"),
    CheckConstraint(f"status IN ({_STATUSES})", name="status"),
    CheckConstraint(f"effect_class IN ({_EFFECTS})", name="effect_class"),
    Index(
        "ix_tool_calls_claimable",
        "status",
        "lease_expires_at",
        postgresql_where=text(f"status IN ({', '.join(repr(s) for s in CLAIMABLE)})"),
        sqlite_where=text(f"status IN ({', '.join(repr(s) for s in CLAIMABLE)})"),
    ),
    Index(
        "ix_tool_calls_unconfirmed",
        "session_id",
        postgresql_where=text("status = 'submitted' AND confirmed_at IS NULL"),
        sqlite_where=text("status = 'submitted' AND confirmed_at IS NULL"),
    ),
    Index(
        "ix_tool_calls_open",
        "session_id",
        postgresql_where=text(OPEN_CALL_SQL),
        sqlite_where=text(OPEN_CALL_SQL),
    ),
    Index("ix_tool_calls_created_at", "created_at"),
    Index("ix_tool_calls_tool_name_created_at", "tool_name", "created_at"),
    # Audit views at millions of calls (benchmarks/audit.py times each one):
    # `calls show CALL_ID` names a call by its id alone, the key's last column.
    Index("ix_tool_calls_call_id", "call_id"),
    # Listings sorted by status or by tool are paged in (value, key) order: these indexes hold
    # that order, so any page reads its own rows instead of sorting every call.
    Index("ix_tool_calls_status_key", "status", "session_id", "turn_id", "call_id"),
    Index("ix_tool_calls_tool_name_key", "tool_name", "session_id", "turn_id", "call_id"),
    # Pruning deletes finished calls last changed before a moment, a batch at a time: without
    # this each batch would scan the table from its start again.
    Index(
        "ix_tool_calls_prunable",
        "updated_at",
        postgresql_where=text(PRUNABLE_SQL),
        sqlite_where=text(PRUNABLE_SQL),
    ),
)

SEARCH_COLUMNS = ("tool_name", "session_id", "turn_id", "call_id")
"""What the audit views' free-text search matches a substring of (lowercased)."""

# The audit search matches a substring anywhere, which no B-tree can find: trigrams can, for a
# term of three characters or more. PostgreSQL only (pg_trgm ships with it); on SQLite a
# search scans the table.
Index(
    "ix_tool_calls_search",
    *(func.lower(tool_calls.c[name]).label(name) for name in SEARCH_COLUMNS),
    postgresql_using="gin",
    postgresql_ops=dict.fromkeys(SEARCH_COLUMNS, "gin_trgm_ops"),
).ddl_if(dialect="postgresql")
event.listen(
    tool_calls,
    "before_create",
    DDL("CREATE EXTENSION IF NOT EXISTS pg_trgm").execute_if(dialect="postgresql"),  # type: ignore[no-untyped-call]
    propagate=True,  # copies of the table (``to_metadata``) need the extension as well
)

tool_call_events = Table(
    "tool_call_events",
    metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True),
    Column("session_id", ID, nullable=False),
    Column("turn_id", ID, nullable=False),
    Column("call_id", ID, nullable=False),
    Column("at", UtcDateTime(), nullable=False),
    Column("actor", String(255), nullable=False),
    Column("kind", String(32), nullable=False),
    Column("from_status", String(32)),
    Column("to_status", String(32)),
    Column("lease_token", BigInteger),
    Column("reason", StorableText),
    Column("detail", StorableText),
    # The trail's hash chain (``domain.trail``), set by the database's trigger on insert
    # (``store.chain``): NULL only in a row written past it.
    Column("prev_sha256", String(64)),
    Column("sha256", String(64)),
    # The digest of the call's content right after the event's write (``domain.trail``), set
    # by the statement that writes the event; NULL in events written before it was kept.
    Column("content_sha256", String(64)),
    # The event's keyed MAC (``domain.trail.TrailKey``: the content parts it wrote, then the
    # HMAC), set by the application when it holds the trail key.
    Column("trail_mac", String(100)),
    ForeignKeyConstraint(
        ["session_id", "turn_id", "call_id"],
        ["tool_calls.session_id", "tool_calls.turn_id", "tool_calls.call_id"],
        ondelete="CASCADE",
    ),
    Index("ix_tool_call_events_call", "session_id", "turn_id", "call_id", "id"),
    Index("ix_tool_call_events_at", "at"),
)

# The trail's trigger and functions come with the table, copies of it (``to_metadata``) included.
_TRAIL_DDL = (
    *(
        ("after_create", "postgresql", sql)
        for sql in (PG_TEXT_FUNCTION_SQL, PG_TEXT_FUNCTION_V2_SQL, PG_TRIGGER_FUNCTION_SQL, PG_TRIGGER_SQL)
    ),
    ("after_create", "sqlite", SQLITE_TRIGGER_SQL),
    # Dropping the table drops its trigger; the functions stay unless dropped with it.
    *(("after_drop", "postgresql", sql) for sql in PG_DROP_SQL[1:]),
)
for _when, _dialect, _sql in _TRAIL_DDL:
    event.listen(
        tool_call_events,
        _when,
        DDL(_sql).execute_if(dialect=_dialect),  # type: ignore[no-untyped-call]
        propagate=True,
    )

sessions = Table(
    "sessions",
    metadata,
    Column("session_id", ID, primary_key=True),
    Column("watched", Boolean, nullable=False, server_default=text("true")),
    Column("owner", String(255)),
    Column("lease_token", BigInteger, nullable=False, server_default=text("0")),
    Column("lease_expires_at", UtcDateTime()),
    Column("last_event_id", String(255)),
    Column("last_polled_at", UtcDateTime()),
    Column("status", String(32)),
    Column("created_at", UtcDateTime(), nullable=False),
    Column("updated_at", UtcDateTime(), nullable=False),
    Column("reason", StorableText),
    Column("intake", String(16)),
    Column("agent_id", String(255)),
    Column("look_requested_at", UtcDateTime()),
    Column("look_seq", BigInteger, nullable=False, server_default=text("0")),
    Column("look_owner", String(255)),
    Column("look_expires_at", UtcDateTime()),
    Index("ix_sessions_owner", "owner"),
    Index("ix_sessions_look_requested_at", "look_requested_at"),
)
"""Sessions the service answers. ``watched``: followed by an event stream (registered, or
recovered with open calls). ``intake``: how a session came without registration (``webhook``,
``sweep``); such a session is served by *looks*: ``look_requested_at`` (null: nothing to look
at; in the future: look then) is set by a webhook, the sweep or a known wait, one replica claims
the look (``look_owner`` until ``look_expires_at``), reconciles the session and clears it unless
``look_seq`` moved on meanwhile (asked again while it looked). ``agent_id``: its root agent,
once read: a session of an agent not configured is never answered."""

replicas = Table(
    "replicas",
    metadata,
    Column("replica_id", ID, primary_key=True),
    Column("hostname", String(255), nullable=False),
    Column("pid", Integer, nullable=False),
    Column("started_at", UtcDateTime(), nullable=False),
    Column("heartbeat_at", UtcDateTime(), nullable=False),
    Column("expires_at", UtcDateTime(), nullable=False),
    Column("handler_load", Text),
    Column("intake_counts", Text),
)
"""Live ``serve`` processes: each takes a fair share of the watched sessions. ``handler_load``:
how its handlers stood at its last heartbeat (JSON: slots, threads, waits); ``intake_counts``:
its webhook intake's counts since it started (JSON: accepted, duplicate, refused by reason)."""

webhook_deliveries = Table(
    "webhook_deliveries",
    metadata,
    Column("webhook_id", String(255), primary_key=True),
    Column("event_type", String(64), nullable=False),
    Column("session_id", ID),
    Column("received_at", UtcDateTime(), nullable=False),
    Index("ix_webhook_deliveries_received_at", "received_at"),
)
"""Every verified webhook taken, by its ``webhook-id``: a delivery retried by the sender is
taken once (its insert conflicts). Pruned after a week, far past the sender's retries."""

agent_sweeps = Table(
    "agent_sweeps",
    metadata,
    Column("agent_id", String(255), primary_key=True),
    Column("watermark", BigInteger),
    Column("resume_after", String(255)),
    Column("runs", BigInteger, nullable=False, server_default=text("0")),
    Column("owner", String(255)),
    Column("lease_expires_at", UtcDateTime()),
    Column("last_run_at", UtcDateTime()),
    Column("last_found", Integer),
    Column("last_error", Text),
)
"""Per configured agent, its sessions' sweep: ``watermark`` (the ``created_at`` of the newest
session the last sweep saw: the next one pages down to it), ``resume_after`` (the session the
rolling pass over older sessions stopped after: the next sweep goes on from there), who sweeps
now (one replica, under a lease) and how the last run went."""

alert_cursors = Table(
    "alert_cursors",
    metadata,
    Column("name", String(64), primary_key=True),
    Column("last_event_id", BigInteger, nullable=False),
    Column("owner", String(255)),
    Column("lease_token", BigInteger, nullable=False, server_default=text("0")),
    Column("lease_expires_at", UtcDateTime()),
    Column("updated_at", UtcDateTime(), nullable=False),
)
"""How far an alert sender has read the audit trail (every event up to ``last_event_id`` is
dealt with), and which replica sends now: one row per destination, under a lease, so that
replicas never send the same alert twice at once and a restart goes on where it stopped."""
