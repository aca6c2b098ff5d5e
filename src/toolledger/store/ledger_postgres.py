"""The ledger on PostgreSQL: each write and its audit event as ONE statement in autocommit.

A data-modifying CTE (``WITH changed AS (UPDATE ... RETURNING ...) INSERT INTO events SELECT
... FROM changed``) is one round trip and one commit instead of BEGIN, a read, the write, the
event and COMMIT: that is most of the ledger's cost per call (DESIGN.md, "Performance
facts"). Each statement is built once per shape (building a CTE costs more than running it).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from functools import cached_property
from typing import Any

from sqlalchemy import CTE, Row, Select, String, bindparam, literal, null, select, tuple_
from sqlalchemy.dialects import postgresql
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.sql.elements import ColumnElement

from toolledger.domain.keys import CallKey
from toolledger.domain.records import CallRecord, Recorded
from toolledger.domain.states import RECORD, CallStatus, Transition
from toolledger.store.engine import utc_now
from toolledger.store.ledger import LedgerStore
from toolledger.store.rows import call_record
from toolledger.store.schema import StorableText, tool_call_events, tool_calls
from toolledger.store.transitions import (
    CONFIRM,
    KEY_COLUMNS,
    KEY_MATCH,
    Note,
    changes,
    fenced,
    key_params,
    record_insert,
)

_EVENT_COLUMNS = (
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


class PostgresLedger(LedgerStore):
    @cached_property
    def _autocommit(self) -> AsyncEngine:
        """Same pool; each single-statement write commits by itself (no BEGIN/COMMIT trips)."""
        return self.engine.execution_options(isolation_level="AUTOCOMMIT")

    async def mark_confirmed_many(self, keys: Sequence[CallKey]) -> set[CallKey]:
        if not keys:
            return set()
        statement = self._statement(("mark_confirmed_many",), self._build_confirm_many)
        params = {
            "p_keys": [(k.session_id, k.turn_id, k.call_id) for k in keys],
            **self._event_params("left required_actions"),
        }
        async with self._autocommit.connect() as conn:
            rows = (await conn.execute(statement, params)).all()
        return {CallKey(r.session_id, r.turn_id, r.call_id) for r in rows}

    def _writing(self) -> AbstractAsyncContextManager[AsyncConnection]:
        return self._autocommit.connect()

    def _transaction(self) -> AbstractAsyncContextManager[AsyncConnection]:
        return self.engine.begin()

    async def _record_new(
        self, key: CallKey, params: dict[str, Any], fingerprint: str, reason: str, detail: str | None
    ) -> Recorded:
        statement = self._statement((RECORD.name,), self._build_record)
        async with self._autocommit.connect() as conn:
            row = (await conn.execute(statement, {**params, **self._event_params(reason, detail)})).first()
        if row is not None:
            return Recorded(call=call_record(row), claimed=True)
        async with self.engine.begin() as conn:
            return await self._already_recorded(conn, key, fingerprint)

    async def _change(
        self,
        conn: AsyncConnection,
        transition: Transition,
        sources: frozenset[CallStatus],
        key: CallKey,
        params: dict[str, Any],
        reason: str,
        detail: str | None = None,
    ) -> CallRecord | None:
        allowed = tuple(sorted(s.value for s in sources))
        statement = self._statement(
            (transition.name, transition.target, allowed), lambda: self._build_change(transition, allowed)
        )
        values = {**params, **key_params(key), **self._event_params(reason, detail)}
        row = (await conn.execute(statement, values)).first()
        return None if row is None else call_record(row)

    async def _note(self, note: Note, key: CallKey, params: dict[str, Any], reason: str) -> Row[Any] | None:
        statement = self._statement(
            (note.name,),
            lambda: self._with_event(
                note.update(KEY_MATCH).cte("changed"), note.event, note.status, note.status, with_token=False
            ),
        )
        async with self._autocommit.connect() as conn:
            values = {**params, **key_params(key), **self._event_params(reason)}
            noted: Row[Any] | None = (await conn.execute(statement, values)).first()
            return noted

    # -------------------------------------------------------------- statements

    def _build_record(self) -> Select[Any]:
        return self._with_event(
            record_insert(postgresql.insert).cte("recorded"), RECORD.event, None, RECORD.target
        )

    def _build_change(self, transition: Transition, allowed: tuple[str, ...]) -> Select[Any]:
        if len(allowed) == 1:
            # One source: the event names it; the compare-and-set alone decides.
            (source,) = allowed
            changed = (
                tool_calls.update()
                .where(KEY_MATCH, tool_calls.c.status == source, *fenced(transition))
                .values(**changes(transition))
                .returning(tool_calls)
                .cte("changed")
            )
            return self._with_event(changed, transition.event, CallStatus(source), transition.target)
        # Locked first, so the event names the state the row really left (a concurrent
        # writer's commit is waited for and re-read, as the UPDATE itself would).
        locked = (
            select(tool_calls.c.status.label("from_status"))
            .where(KEY_MATCH)
            .with_for_update()
            .cte("current_state")
        )
        changed = (
            tool_calls.update()
            .where(
                KEY_MATCH,
                tool_calls.c.status == locked.c.from_status,
                locked.c.from_status.in_(allowed),
                *fenced(transition),
            )
            .values(**changes(transition))
            .returning(*tool_calls.c, locked.c.from_status)
            .cte("changed")
        )
        return self._with_event(changed, transition.event, changed.c.from_status, transition.target)

    def _build_confirm_many(self) -> Select[Any]:
        confirmed = CONFIRM.update(tuple_(*KEY_COLUMNS).in_(bindparam("p_keys", expanding=True)))
        return self._with_event(
            confirmed.cte("changed"), CONFIRM.event, CONFIRM.status, CONFIRM.status, with_token=False
        )

    def _with_event(
        self,
        changed: CTE,
        kind: str,
        from_status: ColumnElement[Any] | CallStatus | None,
        to_status: CallStatus | None,
        *,
        with_token: bool = True,
    ) -> Select[Any]:
        """The rows ``changed`` returns, each with its audit event inserted by the same statement
        (actor, reason and detail are the parameters ``e_actor``, ``e_reason`` and ``e_detail``)."""
        rows = select(
            changed.c.session_id,
            changed.c.turn_id,
            changed.c.call_id,
            utc_now(),
            bindparam("e_actor", type_=String),
            literal(kind, String),
            _status_sql(from_status),
            _status_sql(to_status),
            changed.c.lease_token if with_token else null(),
            bindparam("e_reason", type_=StorableText),
            bindparam("e_detail", type_=StorableText),
        )
        logged = tool_call_events.insert().from_select(_EVENT_COLUMNS, rows).cte("logged")
        return select(changed).add_cte(logged)


def _status_sql(status: ColumnElement[Any] | CallStatus | None) -> ColumnElement[Any]:
    if status is None:
        return null()
    if isinstance(status, CallStatus):
        return literal(status.value, String)
    return status


__all__ = ["PostgresLedger"]
