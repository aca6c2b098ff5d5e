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

An event that carries the digest of its call's content (or a keyed MAC) is hashed as the
text's version 2, which covers both; one without either, as version 1 (the events written
before content digests were kept, and what an INSERT from outside toolledger leaves).

The content digest is not the trigger's: in a one-statement CTE the trigger would read the
call's row as it was before the statement. Whoever inserts an event computes it from the row
as it is after its own write (``content_sha256_sql``: from the row a CTE's UPDATE or INSERT
returns, or from the row read in the event's INSERT ... SELECT).

The SQL here is the schema's (``store.schema`` creates it with the tables); migration 0011
holds a copy as it was written (0008 the version before), and a test checks that the
migrations and the schema build the same objects.
"""

from __future__ import annotations

import textwrap
from datetime import datetime
from typing import Any

from sqlalchemy import String, Text, cast, func, literal_column
from sqlalchemy.sql.base import ReadOnlyColumnCollection
from sqlalchemy.sql.elements import ColumnElement

from toolledger.domain.trail import (
    CONTENT_FIELDS,
    CONTENT_FORMAT,
    FIELDS,
    FIELDS_V2,
    GENESIS_SHA256,
    NULL,
    TRAIL_FORMAT,
    TRAIL_FORMAT_V2,
    content_sha256,
    event_sha256,
)

PG_TEXT_FUNCTION = "toolledger_trail_text"
PG_TEXT_FUNCTION_V2 = "toolledger_trail_text_v2"
PG_TRIGGER_FUNCTION = "toolledger_chain_event"
TRIGGER = "tool_call_events_trail"
SQLITE_FUNCTION = "toolledger_event_sha256"
SQLITE_CONTENT_FUNCTION = "toolledger_content_sha256"

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


def _pg_text_function(name: str, version: str, fields: tuple[str, ...]) -> str:
    return (
        f"CREATE FUNCTION {name}(\n"
        + ",\n".join(f"    e_{field} {_PG_TYPES.get(field, 'text')}" for field in fields)
        + "\n) RETURNS text LANGUAGE sql STABLE PARALLEL SAFE AS $$\n"
        + f"SELECT '{version}' || chr(10)\n"
        + "\n".join(_pg_line(field) for field in fields)
        + "\n$$"
    )


PG_TEXT_FUNCTION_SQL = _pg_text_function(PG_TEXT_FUNCTION, TRAIL_FORMAT, FIELDS)
"""``domain.trail.event_text`` of a version 1 event in SQL (one SELECT of expressions:
PostgreSQL inlines it)."""

PG_TEXT_FUNCTION_V2_SQL = _pg_text_function(PG_TEXT_FUNCTION_V2, TRAIL_FORMAT_V2, FIELDS_V2)
"""``domain.trail.event_text`` of a version 2 event in SQL."""

_KEY_MATCH = "session_id = NEW.session_id AND turn_id = NEW.turn_id AND call_id = NEW.call_id"
_NEW_FIELDS = [f"NEW.{name}" for name in FIELDS_V2]

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
    IF NEW.content_sha256 IS NULL AND NEW.trail_mac IS NULL THEN
        NEW.sha256 := encode(sha256(convert_to({PG_TEXT_FUNCTION}(
{_wrapped(_NEW_FIELDS[: len(FIELDS)], " " * 12)}
        ), 'UTF8')), 'hex');
    ELSE
        NEW.sha256 := encode(sha256(convert_to({PG_TEXT_FUNCTION_V2}(
{_wrapped(_NEW_FIELDS, " " * 12)}
        ), 'UTF8')), 'hex');
    END IF;
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
    f"DROP FUNCTION IF EXISTS {PG_TEXT_FUNCTION_V2}("
    + ", ".join(_PG_TYPES.get(name, "text") for name in FIELDS_V2)
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
    """``toolledger_event_sha256`` on SQLite: the fields of ``FIELDS_V2`` as SQLite holds them
    (``at`` as its stored text, UTC digits), hashed by the one definition (as version 1 when
    the last two are NULL; the trigger of migration 0008 passes only ``FIELDS``)."""
    fields: dict[str, Any] = dict(zip(FIELDS_V2[: len(values)], values, strict=True))
    fields["at"] = datetime.fromisoformat(fields["at"])
    return event_sha256(fields)


def sqlite_content_sha256(*values: Any) -> str:
    """``toolledger_content_sha256`` on SQLite: the call's content, ``CONTENT_FIELDS`` in order."""
    return content_sha256(dict(zip(CONTENT_FIELDS, values, strict=True)))


def _sql_text(text: str) -> ColumnElement[str]:
    # This module's constants only: never a value from outside.
    return literal_column("'" + text.replace("'", "''") + "'", Text)


def content_sha256_sql(dialect: str, columns: ReadOnlyColumnCollection[str, Any]) -> ColumnElement[str]:
    """The digest of a call's content (``domain.trail.content_sha256``) over ``columns`` (a row
    of ``tool_calls``, or a CTE returning its columns), computed by the database in the
    statement that writes the event: on PostgreSQL in SQL (no function of the schema needed),
    on SQLite by the function every connection of the engine registers."""
    if dialect == "sqlite":
        values = [columns[name] for name in CONTENT_FIELDS]
        return getattr(func, SQLITE_CONTENT_FUNCTION)(*values, type_=String)  # type: ignore[no-any-return]
    newline = literal_column("chr(10)", Text)
    text: ColumnElement[Any] = _sql_text(CONTENT_FORMAT) + newline
    for name in CONTENT_FIELDS:
        value = cast(columns[name], Text)
        spelled = func.coalesce(cast(func.length(value), Text) + _sql_text(":") + value, _sql_text(NULL))
        text = text + _sql_text(f"{name} ") + spelled + newline
    return func.encode(func.sha256(func.convert_to(text, _sql_text("UTF8"))), _sql_text("hex"), type_=String)


__all__ = [
    "PG_DROP_SQL",
    "PG_TEXT_FUNCTION",
    "PG_TEXT_FUNCTION_SQL",
    "PG_TEXT_FUNCTION_V2",
    "PG_TEXT_FUNCTION_V2_SQL",
    "PG_TRIGGER_FUNCTION_SQL",
    "PG_TRIGGER_SQL",
    "SQLITE_CONTENT_FUNCTION",
    "SQLITE_DROP_SQL",
    "SQLITE_FUNCTION",
    "SQLITE_TRIGGER_SQL",
    "TRIGGER",
    "content_sha256_sql",
    "sqlite_content_sha256",
    "sqlite_event_sha256",
]
