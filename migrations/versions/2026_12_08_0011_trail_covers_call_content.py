"""the trail covers each call's content: tool_call_events.content_sha256 and trail_mac

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-07 22:00:00

Each event the ledger writes from now on carries the digest of its call's content as it is
right after the event's write (domain.trail.content_sha256: tool name, effect class, arguments
and their fingerprint, approved arguments and theirs, result, error stage and detail), and,
when the writer holds TOOLLEDGER_TRAIL_KEY, its keyed MAC. An event carrying either is hashed
as the trail text's version 2, which covers both: the trigger function is replaced to hash
either version (store.chain). The events already stored keep their version 1 hashes and carry
no content digest: nothing here can know what a call's content was when they were written.
A call's content is held to its trail from its next event on.

Two nullable columns without defaults: added in place on PostgreSQL, no rewrite, no long lock.
The downgrade puts back the version 1 trigger and re-chains, as version 1, the calls whose
trails hold version 2 events (the release before this revision verifies version 1 only), then
drops the columns; exports made meanwhile no longer match those calls' heads.

Self-contained: it depends on nothing but revision 0010 and spells its SQL out.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

from toolledger.domain import trail

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# The trail's SQL as this revision creates it: spelled out rather than imported, so the
# migration keeps meaning what it meant when written (a test holds store.chain's to it).
PG_TEXT_FUNCTION_V2 = """CREATE FUNCTION toolledger_trail_text_v2(
    e_prev_sha256 text,
    e_session_id text,
    e_turn_id text,
    e_call_id text,
    e_at timestamptz,
    e_actor text,
    e_kind text,
    e_from_status text,
    e_to_status text,
    e_lease_token bigint,
    e_reason text,
    e_detail text,
    e_content_sha256 text,
    e_trail_mac text
) RETURNS text LANGUAGE sql STABLE PARALLEL SAFE AS $$
SELECT 'toolledger-trail-v2' || chr(10)
    || 'prev_sha256 ' || coalesce(length(e_prev_sha256) || ':' || e_prev_sha256, '-') || chr(10)
    || 'session_id ' || coalesce(length(e_session_id) || ':' || e_session_id, '-') || chr(10)
    || 'turn_id ' || coalesce(length(e_turn_id) || ':' || e_turn_id, '-') || chr(10)
    || 'call_id ' || coalesce(length(e_call_id) || ':' || e_call_id, '-') || chr(10)
    || 'at ' || coalesce(
        length(to_char(e_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')) || ':'
        || to_char(e_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'), '-') || chr(10)
    || 'actor ' || coalesce(length(e_actor) || ':' || e_actor, '-') || chr(10)
    || 'kind ' || coalesce(length(e_kind) || ':' || e_kind, '-') || chr(10)
    || 'from_status ' || coalesce(length(e_from_status) || ':' || e_from_status, '-') || chr(10)
    || 'to_status ' || coalesce(length(e_to_status) || ':' || e_to_status, '-') || chr(10)
    || 'lease_token ' || coalesce(
        length(e_lease_token::text) || ':'
        || e_lease_token::text, '-') || chr(10)
    || 'reason ' || coalesce(length(e_reason) || ':' || e_reason, '-') || chr(10)
    || 'detail ' || coalesce(length(e_detail) || ':' || e_detail, '-') || chr(10)
    || 'content_sha256 ' || coalesce(
        length(e_content_sha256) || ':'
        || e_content_sha256, '-') || chr(10)
    || 'trail_mac ' || coalesce(length(e_trail_mac) || ':' || e_trail_mac, '-') || chr(10)
$$"""

PG_TRIGGER_FUNCTION_V2 = """CREATE OR REPLACE FUNCTION toolledger_chain_event()
RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    genesis CONSTANT text := '0000000000000000000000000000000000000000000000000000000000000000';
    last_id bigint;
    last_sha256 text;
BEGIN
    -- One link at a time per call: whoever holds the call's row writes the next link.
    PERFORM 1 FROM tool_calls
     WHERE session_id = NEW.session_id AND turn_id = NEW.turn_id AND call_id = NEW.call_id
       FOR NO KEY UPDATE;
    SELECT id, sha256 INTO last_id, last_sha256 FROM tool_call_events
     WHERE session_id = NEW.session_id AND turn_id = NEW.turn_id AND call_id = NEW.call_id
     ORDER BY id DESC LIMIT 1;
    IF NEW.id <= last_id THEN
        -- Its id was taken before the lock, while another event of the call went first.
        NEW.id := nextval('tool_call_events_id_seq');
    END IF;
    NEW.prev_sha256 := coalesce(last_sha256, genesis);
    IF NEW.content_sha256 IS NULL AND NEW.trail_mac IS NULL THEN
        NEW.sha256 := encode(sha256(convert_to(toolledger_trail_text(
            NEW.prev_sha256, NEW.session_id, NEW.turn_id, NEW.call_id, NEW.at, NEW.actor,
            NEW.kind, NEW.from_status, NEW.to_status, NEW.lease_token, NEW.reason, NEW.detail
        ), 'UTF8')), 'hex');
    ELSE
        NEW.sha256 := encode(sha256(convert_to(toolledger_trail_text_v2(
            NEW.prev_sha256, NEW.session_id, NEW.turn_id, NEW.call_id, NEW.at, NEW.actor,
            NEW.kind, NEW.from_status, NEW.to_status, NEW.lease_token, NEW.reason, NEW.detail,
            NEW.content_sha256, NEW.trail_mac
        ), 'UTF8')), 'hex');
    END IF;
    RETURN NEW;
END
$$"""

# Revision 0008's, put back by the downgrade.
PG_TRIGGER_FUNCTION_V1 = """CREATE OR REPLACE FUNCTION toolledger_chain_event()
RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    genesis CONSTANT text := '0000000000000000000000000000000000000000000000000000000000000000';
    last_id bigint;
    last_sha256 text;
BEGIN
    -- One link at a time per call: whoever holds the call's row writes the next link.
    PERFORM 1 FROM tool_calls
     WHERE session_id = NEW.session_id AND turn_id = NEW.turn_id AND call_id = NEW.call_id
       FOR NO KEY UPDATE;
    SELECT id, sha256 INTO last_id, last_sha256 FROM tool_call_events
     WHERE session_id = NEW.session_id AND turn_id = NEW.turn_id AND call_id = NEW.call_id
     ORDER BY id DESC LIMIT 1;
    IF NEW.id <= last_id THEN
        -- Its id was taken before the lock, while another event of the call went first.
        NEW.id := nextval('tool_call_events_id_seq');
    END IF;
    NEW.prev_sha256 := coalesce(last_sha256, genesis);
    NEW.sha256 := encode(sha256(convert_to(toolledger_trail_text(
        NEW.prev_sha256, NEW.session_id, NEW.turn_id, NEW.call_id, NEW.at, NEW.actor, NEW.kind,
        NEW.from_status, NEW.to_status, NEW.lease_token, NEW.reason, NEW.detail
    ), 'UTF8')), 'hex');
    RETURN NEW;
END
$$"""

PG_DROP_TEXT_FUNCTION_V2 = (
    "DROP FUNCTION IF EXISTS toolledger_trail_text_v2("
    "text, text, text, text, timestamptz, text, text, text, text, bigint, text, text, text, text)"
)

SQLITE_TRIGGER_V2 = """CREATE TRIGGER tool_call_events_trail AFTER INSERT ON tool_call_events
BEGIN
    UPDATE tool_call_events
       SET (prev_sha256, sha256) = (
           SELECT previous, toolledger_event_sha256(
               previous, NEW.session_id, NEW.turn_id, NEW.call_id, NEW.at, NEW.actor, NEW.kind,
               NEW.from_status, NEW.to_status, NEW.lease_token, NEW.reason, NEW.detail,
               NEW.content_sha256, NEW.trail_mac
           )
             FROM (SELECT coalesce((
                      SELECT sha256 FROM tool_call_events
                       WHERE session_id = NEW.session_id
                         AND turn_id = NEW.turn_id
                         AND call_id = NEW.call_id
                         AND id < NEW.id
                       ORDER BY id DESC LIMIT 1
                  ),
                  '0000000000000000000000000000000000000000000000000000000000000000'
             ) AS previous)
       )
     WHERE id = NEW.id;
END"""

# Revision 0008's, put back by the downgrade.
SQLITE_TRIGGER_V1 = """CREATE TRIGGER tool_call_events_trail AFTER INSERT ON tool_call_events
BEGIN
    UPDATE tool_call_events
       SET (prev_sha256, sha256) = (
           SELECT previous, toolledger_event_sha256(
               previous, NEW.session_id, NEW.turn_id, NEW.call_id, NEW.at, NEW.actor, NEW.kind,
               NEW.from_status, NEW.to_status, NEW.lease_token, NEW.reason, NEW.detail
           )
             FROM (SELECT coalesce((
                      SELECT sha256 FROM tool_call_events
                       WHERE session_id = NEW.session_id
                         AND turn_id = NEW.turn_id
                         AND call_id = NEW.call_id
                         AND id < NEW.id
                       ORDER BY id DESC LIMIT 1
                  ),
                  '0000000000000000000000000000000000000000000000000000000000000000'
             ) AS previous)
       )
     WHERE id = NEW.id;
END"""

SQLITE_DROP_TRIGGER = "DROP TRIGGER IF EXISTS tool_call_events_trail"

BATCH = 5000

V1_FIELDS = (
    "prev_sha256",
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
)

events = sa.table(
    "tool_call_events",
    sa.column("id", sa.BigInteger()),
    sa.column("session_id", sa.String()),
    sa.column("turn_id", sa.String()),
    sa.column("call_id", sa.String()),
    sa.column("at", sa.DateTime(timezone=True)),
    sa.column("actor", sa.String()),
    sa.column("kind", sa.String()),
    sa.column("from_status", sa.String()),
    sa.column("to_status", sa.String()),
    sa.column("lease_token", sa.BigInteger()),
    sa.column("reason", sa.Text()),
    sa.column("detail", sa.Text()),
    sa.column("prev_sha256", sa.String()),
    sa.column("sha256", sa.String()),
    sa.column("content_sha256", sa.String()),
    sa.column("trail_mac", sa.String()),
)
_KEY = (events.c.session_id, events.c.turn_id, events.c.call_id)
_ORDER = (*_KEY, events.c.id)


def upgrade() -> None:
    op.add_column("tool_call_events", sa.Column("content_sha256", sa.String(length=64), nullable=True))
    op.add_column("tool_call_events", sa.Column("trail_mac", sa.String(length=100), nullable=True))
    if op.get_bind().dialect.name == "postgresql":
        op.execute(PG_TEXT_FUNCTION_V2)
        op.execute(PG_TRIGGER_FUNCTION_V2)
    else:
        op.execute(SQLITE_DROP_TRIGGER)
        op.execute(SQLITE_TRIGGER_V2)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(PG_TRIGGER_FUNCTION_V1)
        op.execute(PG_DROP_TEXT_FUNCTION_V2)
    else:
        op.execute(SQLITE_DROP_TRIGGER)
        op.execute(SQLITE_TRIGGER_V1)
    _rechain_as_v1()
    # Native on both (SQLite since 3.35): a batch copy of the table would lose its trigger.
    op.execute("ALTER TABLE tool_call_events DROP COLUMN trail_mac")
    op.execute("ALTER TABLE tool_call_events DROP COLUMN content_sha256")


def _rechain_as_v1() -> None:
    """The events of every call whose trail holds a version 2 event, chained again call by
    call in id order as version 1 (revision 0008's text), a batch at a time."""
    if trail.TRAIL_FORMAT != "toolledger-trail-v1" or trail.FIELDS != V1_FIELDS:
        raise RuntimeError("migration 0011's downgrade chains events as toolledger-trail-v1")
    bind = op.get_bind()
    previous: tuple[tuple[str, str, str], str] | None = None
    for rows in _batches(bind):
        links = []
        for row in rows:
            key = (row.session_id, row.turn_id, row.call_id)
            prev = previous[1] if previous is not None and previous[0] == key else trail.GENESIS_SHA256
            values = {name: getattr(row, name) for name in V1_FIELDS if name != "prev_sha256"}
            sha256 = trail.event_sha256({**values, "prev_sha256": prev})
            links.append((row.id, prev, sha256))
            previous = (key, sha256)
        _store(bind, links)


def _store(bind: Any, links: list[tuple[int, str, str]]) -> None:
    if bind.dialect.name == "postgresql":
        ids, prevs, hashes = (list(column) for column in zip(*links, strict=True))
        bind.execute(
            sa.text(
                "UPDATE tool_call_events AS e SET prev_sha256 = v.prev, sha256 = v.sha256 "
                "FROM unnest(CAST(:ids AS bigint[]), CAST(:prevs AS text[]), CAST(:hashes AS text[])) "
                "AS v(id, prev, sha256) WHERE e.id = v.id"
            ),
            {"ids": ids, "prevs": prevs, "hashes": hashes},
        )
        return
    update = (
        events.update()
        .where(events.c.id == sa.bindparam("e_id"))
        .values(prev_sha256=sa.bindparam("e_prev"), sha256=sa.bindparam("e_sha256"))
    )
    bind.execute(update, [{"e_id": i, "e_prev": p, "e_sha256": h} for i, p, h in links])


def _batches(bind: Any) -> Iterator[list[Any]]:
    """The events of the calls with a version 2 event, in (call, id) order, ``BATCH`` rows at
    a time (keyset paging)."""
    v2 = sa.or_(events.c.content_sha256.is_not(None), events.c.trail_mac.is_not(None))
    rechained = sa.tuple_(*_KEY).in_(sa.select(*_KEY).where(v2).distinct())
    after: tuple[Any, ...] | None = None
    while True:
        query = sa.select(events).where(rechained).order_by(*_ORDER).limit(BATCH)
        if after is not None:
            query = query.where(sa.tuple_(*_ORDER) > sa.tuple_(*after))
        rows = list(bind.execute(query))
        if not rows:
            return
        yield rows
        last = rows[-1]
        after = (last.session_id, last.turn_id, last.call_id, last.id)
