"""The audit trail's hash chain, computed by the database as each event is inserted.

Every path that writes an event (a transition's one-statement CTE on PostgreSQL, the arrays of
a batch, a SQLite transaction, a flag, an operator's resolution) gets its chain link the same
way, with no extra round trip: a trigger on ``tool_call_events`` reads the hash of the call's
last event and hashes the new one over it (``domain.trail`` defines the text hashed).

- PostgreSQL: a BEFORE INSERT trigger. It first locks the call's row, so a call's events are
  chained one at a time even when two writers insert them at the same moment (a transition's
  UPDATE holds that lock already; a flag or a note-less event takes it here). An id taken
  before the lock that is lower than the call's last event's is taken again, so a call's
  events in id order are its chain's order.
- SQLite: an AFTER INSERT trigger (SQLite cannot change the row being inserted) sets both
  hashes through ``toolledger_event_sha256``, a function every connection of the ledger's
  engine registers (``store.engine``). SQLite has one writer at a time: nothing to lock.

The SQL here is the schema's (``store.schema`` creates it with the tables); migration 0008
holds a copy as it was written, and a test checks that the two build the same objects.
"""

from __future__ import annotations

import textwrap
from datetime import datetime
from typing import Any

from toolledger.domain.trail import FIELDS, GENESIS_SHA256, NULL, TRAIL_FORMAT, event_sha256

PG_TEXT_FUNCTION = "toolledger_trail_text"
PG_TRIGGER_FUNCTION = "toolledger_chain_event"
TRIGGER = "tool_call_events_trail"
SQLITE_FUNCTION = "toolledger_event_sha256"

_PG_TYPES = {"at": "timestamptz", "lease_token": "bigint"}
_PG_SPELLED = {
    # The trail's spelling of a moment (domain.trail.canonical_moment): UTC, microseconds, Z.
    "at": """to_char(e_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')""",
    "lease_token": "e_lease_token::text",
}


def _pg_line(name: str) -> str:
    value = _PG_SPELLED.get(name, f"e_{name}")
    # NULL propagates through ||: a missing value is spelled by the coalesce.
    line = f"    || '{name} ' || coalesce(length({value}) || ':' || {value}, '{NULL}') || chr(10)"
    if len(line) <= 100:
        return line
    return (
        f"    || '{name} ' || coalesce(\n        length({value}) || ':'\n"
        f"        || {value}, '{NULL}') || chr(10)"
    )


def _wrapped(items: list[str], indent: str) -> str:
    return "\n".join(textwrap.wrap(", ".join(items), 96, initial_indent=indent, subsequent_indent=indent))


PG_TEXT_FUNCTION_SQL = (
    f"CREATE FUNCTION {PG_TEXT_FUNCTION}(\n"
    + ",\n".join(f"    e_{name} {_PG_TYPES.get(name, 'text')}" for name in FIELDS)
    + "\n) RETURNS text LANGUAGE sql STABLE PARALLEL SAFE AS $$\n"
    + f"SELECT '{TRAIL_FORMAT}' || chr(10)\n"
    + "\n".join(_pg_line(name) for name in FIELDS)
    + "\n$$"
)
"""``domain.trail.event_text`` in SQL (one SELECT of expressions: PostgreSQL inlines it)."""

_KEY_MATCH = "session_id = NEW.session_id AND turn_id = NEW.turn_id AND call_id = NEW.call_id"
_NEW_FIELDS = [f"NEW.{name}" for name in FIELDS]

# Built from this module's constants only (ruff's S608 sees an UPDATE in an f-string).
PG_TRIGGER_FUNCTION_SQL = f"""CREATE FUNCTION {PG_TRIGGER_FUNCTION}() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    genesis CONSTANT text := '{GENESIS_SHA256}';
    last_id bigint;
    last_sha256 text;
BEGIN
    -- One link at a time per call: whoever holds the call's row writes the next link.
    PERFORM 1 FROM tool_calls
     WHERE {_KEY_MATCH}
       FOR NO KEY UPDATE;
    SELECT id, sha256 INTO last_id, last_sha256 FROM tool_call_events
     WHERE {_KEY_MATCH}
     ORDER BY id DESC LIMIT 1;
    IF NEW.id <= last_id THEN
        -- Its id was taken before the lock, while another event of the call went first.
        NEW.id := nextval('tool_call_events_id_seq');
    END IF;
    NEW.prev_sha256 := coalesce(last_sha256, genesis);
    NEW.sha256 := encode(sha256(convert_to({PG_TEXT_FUNCTION}(
{_wrapped(_NEW_FIELDS, " " * 8)}
    ), 'UTF8')), 'hex');
    RETURN NEW;
END
$$"""  # noqa: S608

PG_TRIGGER_SQL = (
    f"CREATE TRIGGER {TRIGGER} BEFORE INSERT ON tool_call_events\n"
    f"FOR EACH ROW EXECUTE FUNCTION {PG_TRIGGER_FUNCTION}()"
)

PG_DROP_SQL = (
    f"DROP TRIGGER IF EXISTS {TRIGGER} ON tool_call_events",
    f"DROP FUNCTION IF EXISTS {PG_TRIGGER_FUNCTION}()",
    f"DROP FUNCTION IF EXISTS {PG_TEXT_FUNCTION}("
    + ", ".join(_PG_TYPES.get(name, "text") for name in FIELDS)
    + ")",
)

SQLITE_TRIGGER_SQL = f"""CREATE TRIGGER {TRIGGER} AFTER INSERT ON tool_call_events
BEGIN
    UPDATE tool_call_events
       SET (prev_sha256, sha256) = (
           SELECT previous, {SQLITE_FUNCTION}(
{_wrapped(["previous", *_NEW_FIELDS[1:]], " " * 15)}
           )
             FROM (SELECT coalesce((
                      SELECT sha256 FROM tool_call_events
                       WHERE session_id = NEW.session_id
                         AND turn_id = NEW.turn_id
                         AND call_id = NEW.call_id
                         AND id < NEW.id
                       ORDER BY id DESC LIMIT 1
                  ),
                  '{GENESIS_SHA256}'
             ) AS previous)
       )
     WHERE id = NEW.id;
END"""  # noqa: S608

SQLITE_DROP_SQL = (f"DROP TRIGGER IF EXISTS {TRIGGER}",)


def sqlite_event_sha256(*values: Any) -> str:
    """``toolledger_event_sha256`` on SQLite: the fields as SQLite holds them (``at`` as its
    stored text, UTC digits), hashed by the one definition."""
    fields: dict[str, Any] = dict(zip(FIELDS, values, strict=True))
    fields["at"] = datetime.fromisoformat(fields["at"])
    return event_sha256(fields)


__all__ = [
    "PG_DROP_SQL",
    "PG_TEXT_FUNCTION",
    "PG_TEXT_FUNCTION_SQL",
    "PG_TRIGGER_FUNCTION_SQL",
    "PG_TRIGGER_SQL",
    "SQLITE_DROP_SQL",
    "SQLITE_FUNCTION",
    "SQLITE_TRIGGER_SQL",
    "TRIGGER",
    "sqlite_event_sha256",
]
