"""Audit reads over the ledger: filtered, ordered, paged by keyset; streamed exports; pruning.

Every value a user typed reaches the database as a bound parameter; sort columns come from
an enum. Pages are keyset-paged (the sort value and the call's key of the last row), so a
page deep in a million calls costs what the first one does.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Select, String, and_, delete, func, literal, or_, select, tuple_
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.functions import FunctionElement

from toolledger.domain.keys import CallKey
from toolledger.domain.queries import (
    CallQuery,
    CallReference,
    Cursor,
    Outcome,
    QueryError,
    SortKey,
    outcome_of,
)
from toolledger.domain.records import CallEvent, CallRecord
from toolledger.domain.states import CallStatus
from toolledger.store.engine import SQLITE_LOWER, uninterrupted_on_sqlite, utc_now, write_transaction
from toolledger.store.rows import call_events, call_record
from toolledger.store.schema import alert_cursors, sessions, tool_call_events, tool_calls

_KEY = (tool_calls.c.session_id, tool_calls.c.turn_id, tool_calls.c.call_id)
_SORT_COLUMNS: dict[SortKey, Any] = {
    SortKey.CREATED: tool_calls.c.created_at,
    SortKey.FINISHED: tool_calls.c.finished_at,
    SortKey.TOOL: tool_calls.c.tool_name,
    SortKey.STATUS: tool_calls.c.status,
}
_TIME_SORTS = frozenset({SortKey.CREATED, SortKey.FINISHED})
PRUNABLE = (CallStatus.SUBMITTED, CallStatus.ABANDONED)
"""Finished calls: their result was accepted, or nobody awaits them any more."""


@dataclass(frozen=True)
class Page:
    calls: list[CallRecord]
    next_cursor: Cursor | None
    """Pass it back for the next page; None on the last one."""


@dataclass(frozen=True)
class CallCounts:
    """The calls a query matches, counted by status and by outcome (its sort, page and cursor
    play no part)."""

    total: int
    by_status: dict[str, int]
    by_outcome: dict[str, int]
    """``succeeded``, ``failed`` and ``none`` (no result yet)."""
    failed_by_stage: dict[str, int]


@dataclass(frozen=True)
class Change:
    """One event of the ledger seen by a follower, with the call as it is now."""

    event_id: int
    at: datetime
    kind: str
    matches: bool
    """The query's filters match the call."""
    call: CallRecord


@dataclass(frozen=True)
class SessionSummary:
    session_id: str
    watched: bool | None
    """None: the ledger has calls of this session but it was never watched."""
    owner: str | None
    lease_expires_at: datetime | None
    status: str | None
    reason: str | None
    last_polled_at: datetime | None
    calls: dict[str, int]
    intake: str | None
    """How it came without registration (``webhook``, ``sweep``); None: registered (watched)."""
    agent_id: str | None
    looking: bool
    """A replica holds a look at it now (its look lease runs on the database's clock)."""


@uninterrupted_on_sqlite
class AuditStore:
    """Read-only queries for audit views, and the pruning of finished calls."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def list_calls(self, query: CallQuery) -> Page:
        rows = await self._fetch(query, query.limit + 1)
        more = len(rows) > query.limit
        calls = rows[: query.limit]
        cursor = _cursor_after(calls[-1], query.sort) if more and calls else None
        return Page(calls, cursor)

    async def iter_calls(self, query: CallQuery, *, batch: int = 1000) -> AsyncIterator[CallRecord]:
        """Every call the query matches, ``batch`` rows per round trip: memory stays flat."""
        cursor = query.cursor
        while True:
            rows = await self._fetch(query.next_page(cursor) if cursor else query, batch)
            for row in rows:
                yield row
            if len(rows) < batch:
                return
            cursor = _cursor_after(rows[-1], query.sort)

    async def count_calls(self, query: CallQuery) -> int:
        statement = select(func.count()).select_from(tool_calls).where(*_filters(query))
        async with self.engine.connect() as conn:
            return int((await conn.execute(statement)).scalar_one())

    async def count_by(self, query: CallQuery) -> CallCounts:
        """One GROUP BY over the matching calls: status, and whether a result and an error
        stage are stored (from which the outcome follows, as ``outcome_of`` says)."""
        has_result = tool_calls.c.result.is_not(None)
        statement = (
            select(tool_calls.c.status, has_result, tool_calls.c.error_stage, func.count())
            .where(*_filters(query))
            .group_by(tool_calls.c.status, has_result, tool_calls.c.error_stage)
        )
        by_status: dict[str, int] = {}
        by_outcome: dict[str, int] = {}
        stages: dict[str, int] = {}
        async with self.engine.connect() as conn:
            rows = list(await conn.execute(statement))
        for status, with_result, stage, count in rows:
            by_status[status] = by_status.get(status, 0) + int(count)
            outcome = outcome_of("" if with_result else None, stage)
            name = outcome.value if outcome is not None else "none"
            by_outcome[name] = by_outcome.get(name, 0) + int(count)
            if outcome is Outcome.FAILED:
                stages[stage] = stages.get(stage, 0) + int(count)
        return CallCounts(sum(by_status.values()), by_status, by_outcome, stages)

    async def last_event_id(self) -> int:
        async with self.engine.connect() as conn:
            found = (await conn.execute(select(func.max(tool_call_events.c.id)))).scalar_one()
        return int(found or 0)

    async def changes_after(self, query: CallQuery, event_id: int, *, limit: int = 500) -> list[Change]:
        """The events after ``event_id`` (oldest first, at most ``limit``), each with its call
        as it is now and whether the query's filters match it: a primary-key range of the
        events, so a follower polling a large ledger reads only what is new. Every event is
        returned, matching or not, so the follower knows how far it has read."""
        events = (
            select(
                tool_call_events.c.id,
                tool_call_events.c.at,
                tool_call_events.c.kind,
                tool_call_events.c.session_id,
                tool_call_events.c.turn_id,
                tool_call_events.c.call_id,
            )
            .where(tool_call_events.c.id > event_id)
            .order_by(tool_call_events.c.id)
            .limit(limit)
            .subquery()
        )
        filters = _filters(query)
        matches = and_(*filters) if filters else literal(True)
        statement = (
            select(
                events.c.id.label("event_id"),
                events.c.at.label("event_at"),
                events.c.kind.label("event_kind"),
                matches.label("event_matches"),
                tool_calls,
            )
            .join(
                tool_calls,
                and_(
                    tool_calls.c.session_id == events.c.session_id,
                    tool_calls.c.turn_id == events.c.turn_id,
                    tool_calls.c.call_id == events.c.call_id,
                ),
            )
            .order_by(events.c.id)
        )
        async with self.engine.connect() as conn:
            rows = list(await conn.execute(statement))
        return [
            Change(
                event_id=int(row.event_id),
                at=row.event_at,
                kind=str(row.event_kind),
                matches=bool(row.event_matches),
                call=call_record(row),
            )
            for row in rows
        ]

    async def find(self, reference: CallReference) -> list[CallRecord]:
        """The calls a reference names (more than one: it is ambiguous)."""
        statement = select(tool_calls)
        if reference.key is not None:
            statement = statement.where(
                *(c == v for c, v in zip(_KEY, _key_values(reference.key), strict=True))
            )
        elif reference.idempotency_prefix is not None:
            prefix = reference.idempotency_prefix
            statement = statement.where(
                tool_calls.c.idempotency_key >= prefix,
                tool_calls.c.idempotency_key < prefix + "\U0010ffff",
            )
        elif reference.call_id is not None:
            statement = statement.where(tool_calls.c.call_id == reference.call_id)
        else:
            raise QueryError("empty call reference")
        async with self.engine.connect() as conn:
            return [call_record(row) for row in await conn.execute(statement.limit(10))]

    async def events(self, key: CallKey) -> list[CallEvent]:
        async with self.engine.connect() as conn:
            return await call_events(conn, key)

    async def session_summaries(
        self, session_ids: Sequence[str] | None = None, *, watched: bool | None = None, limit: int = 100
    ) -> list[SessionSummary]:
        """Watched (or once watched) sessions with their calls counted by status."""
        # Judged by the database's clock, as the look's lease was taken (claim_looks): the
        # reader's clock may be off from the replicas'.
        looking = and_(sessions.c.look_owner.is_not(None), sessions.c.look_expires_at > utc_now())
        statement = (
            select(sessions, looking.label("looking_now"))
            .order_by(sessions.c.created_at.desc(), sessions.c.session_id)
            .limit(limit)
        )
        if session_ids is not None:
            statement = statement.where(sessions.c.session_id.in_(list(session_ids)))
        if watched is not None:
            statement = statement.where(sessions.c.watched.is_(watched))
        async with self.engine.connect() as conn:
            rows = list(await conn.execute(statement))
            found = {row.session_id: row for row in rows}
            wanted = list(session_ids) if session_ids is not None else list(found)
            counts: dict[str, dict[str, int]] = {s: {} for s in wanted}
            if wanted:
                tallies = await conn.execute(
                    select(tool_calls.c.session_id, tool_calls.c.status, func.count())
                    .where(tool_calls.c.session_id.in_(wanted))
                    .group_by(tool_calls.c.session_id, tool_calls.c.status)
                )
                for session_id, status, count in tallies:
                    counts[session_id][status] = int(count)
        summaries = []
        for session_id in wanted:
            row = found.get(session_id)
            if row is None and not counts[session_id]:
                continue
            summaries.append(
                SessionSummary(
                    session_id=session_id,
                    watched=row.watched if row is not None else None,
                    owner=row.owner if row is not None else None,
                    lease_expires_at=row.lease_expires_at if row is not None else None,
                    status=row.status if row is not None else None,
                    reason=row.reason if row is not None else None,
                    last_polled_at=row.last_polled_at if row is not None else None,
                    calls=counts[session_id],
                    intake=row.intake if row is not None else None,
                    agent_id=row.agent_id if row is not None else None,
                    looking=bool(row.looking_now) if row is not None else False,
                )
            )
        return summaries

    async def prune(
        self,
        before: datetime,
        *,
        dry_run: bool = False,
        batch: int = 1000,
        progress: Callable[[int], None] | None = None,
    ) -> int:
        """Delete finished calls (and their audit trails) last changed before ``before``.

        In batches, each its own transaction, so a large prune never holds long locks.
        """
        finished = and_(
            tool_calls.c.status.in_([s.value for s in PRUNABLE]), tool_calls.c.updated_at < before
        )
        if dry_run:
            async with self.engine.connect() as conn:
                return int(
                    (
                        await conn.execute(select(func.count()).select_from(tool_calls).where(finished))
                    ).scalar_one()
                )
        removed = 0
        while True:
            async with write_transaction(self.engine) as conn:
                keys = [tuple(row) for row in await conn.execute(select(*_KEY).where(finished).limit(batch))]
                if not keys:
                    return removed
                # Re-checked under the delete: a call that changed since the select stays, and
                # so does every event of its trail. The calls deleted decide whose events go.
                deleted = [
                    tuple(row)
                    for row in await conn.execute(
                        delete(tool_calls).where(tuple_(*_KEY).in_(keys), finished).returning(*_KEY)
                    )
                ]
                if deleted:
                    # The foreign key cascades these already; said here as well, so that a
                    # connection without SQLite's foreign_keys pragma leaves no orphans.
                    event_key = tuple_(
                        tool_call_events.c.session_id, tool_call_events.c.turn_id, tool_call_events.c.call_id
                    )
                    await conn.execute(delete(tool_call_events).where(event_key.in_(deleted)))
                    if conn.dialect.name == "sqlite":
                        await conn.execute(_cursors_within_trail())
                removed += len(deleted)
            if progress is not None:
                progress(removed)

    async def _fetch(self, query: CallQuery, limit: int) -> list[CallRecord]:
        statement = _select(query).limit(limit)
        async with self.engine.connect() as conn:
            return [call_record(row) for row in await conn.execute(statement)]


def _cursors_within_trail() -> Any:
    """Alert cursors brought down to the newest event left. SQLite numbers a new row one past
    the highest id in the table (no AUTOINCREMENT): once the newest events are pruned, the
    next ones take ids again that a cursor had passed, and would never raise their alerts."""
    newest = select(func.coalesce(func.max(tool_call_events.c.id), 0)).scalar_subquery()
    return (
        alert_cursors.update()
        .where(alert_cursors.c.last_event_id > newest)
        .values(last_event_id=newest, updated_at=utc_now())
    )


def _select(query: CallQuery) -> Select[Any]:
    column = _SORT_COLUMNS[query.sort]
    statement = select(tool_calls).where(*_filters(query))
    if query.sort is SortKey.FINISHED:
        statement = statement.where(tool_calls.c.finished_at.is_not(None))
    if query.cursor is not None:
        statement = statement.where(_after(query, column, query.cursor))
    order = [column, *_KEY]
    return statement.order_by(*(c.desc() if query.descending else c.asc() for c in order))


def _filters(query: CallQuery) -> list[ColumnElement[bool]]:
    clauses: list[ColumnElement[bool]] = []
    if query.session_id is not None:
        clauses.append(tool_calls.c.session_id == query.session_id)
    if query.turn_id is not None:
        clauses.append(tool_calls.c.turn_id == query.turn_id)
    if query.tool_names:
        clauses.append(tool_calls.c.tool_name.in_(query.tool_names))
    if query.statuses:
        clauses.append(tool_calls.c.status.in_([s.value for s in query.statuses]))
    if query.outcomes and len(set(query.outcomes)) < len(Outcome):
        # Bare column tests (no CASE, no COALESCE), the same on both databases: the planner
        # may combine them with any index on the other filters.
        (wanted,) = set(query.outcomes)
        stage = tool_calls.c.error_stage
        clauses.append(tool_calls.c.result.is_not(None))
        clauses.append(stage.is_not(None) if wanted is Outcome.FAILED else stage.is_(None))
    elif query.outcomes:
        clauses.append(tool_calls.c.result.is_not(None))
    if query.effect_classes:
        clauses.append(tool_calls.c.effect_class.in_([e.value for e in query.effect_classes]))
    if query.since is not None:
        clauses.append(tool_calls.c.created_at >= query.since)
    if query.until is not None:
        clauses.append(tool_calls.c.created_at < query.until)
    if query.text is not None:
        # Both sides folded by the same function in the database (not the pattern in Python):
        # PostgreSQL's lower() and Python's differ (a final sigma), and the trigram index is
        # on lower(column).
        pattern = lowered(literal("%" + _escape_like(query.text) + "%"))
        clauses.append(
            or_(*(lowered(column).like(pattern, escape="\\") for column in (tool_calls.c.tool_name, *_KEY)))
        )
    return clauses


class lowered(FunctionElement[str]):
    """lower(): PostgreSQL's own; on SQLite a registered function that folds every letter
    as PostgreSQL does (SQLite's lower() leaves all but ASCII alone: café would miss CAFÉ)."""

    type = String()
    inherit_cache = True


@compiles(lowered, "postgresql")
def _pg_lowered(element: lowered, compiler: SQLCompiler, **kw: Any) -> str:
    return f"lower({compiler.process(element.clauses, **kw)})"


@compiles(lowered, "sqlite")
def _sqlite_lowered(element: lowered, compiler: SQLCompiler, **kw: Any) -> str:
    return f"{SQLITE_LOWER}({compiler.process(element.clauses, **kw)})"


def _after(query: CallQuery, column: Any, cursor: Cursor) -> ColumnElement[bool]:
    value: Any = cursor.value
    if query.sort in _TIME_SORTS:
        if value is None:
            raise QueryError("invalid cursor for this sort order")
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            raise QueryError("invalid cursor for this sort order") from None
    left = tuple_(column, *_KEY)
    right = tuple_(value, *_key_values(cursor.key))
    return left < right if query.descending else left > right


def _cursor_after(call: CallRecord, sort: SortKey) -> Cursor:
    value: Any = {
        SortKey.CREATED: call.created_at,
        SortKey.FINISHED: call.finished_at,
        SortKey.TOOL: call.tool_name,
        SortKey.STATUS: call.status.value,
    }[sort]
    return Cursor(value.isoformat() if isinstance(value, datetime) else value, call.key)


def _key_values(key: CallKey) -> tuple[str, str, str]:
    return key.session_id, key.turn_id, key.call_id


def _escape_like(text: str) -> str:
    """``%`` and ``_`` typed by a user are literal characters, not wildcards."""
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


__all__ = ["PRUNABLE", "AuditStore", "CallCounts", "Change", "Page", "SessionSummary"]
