"""Reads of the audit trail's hash chain: every call's events with its row (its status and
content: what ``domain.trail.check_trail`` verifies), and each call's chain head (what
exports carry).

Calls are read in key order a page at a time, each page with its events by one statement (one
snapshot; the events through ``ix_tool_call_events_call``): verifying the whole ledger keeps
memory flat at any size, and sees a call that changes meanwhile whole, before or after.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Select, and_, func, select, tuple_
from sqlalchemy.ext.asyncio import AsyncEngine

from toolledger.domain.keys import CallKey
from toolledger.domain.records import CallEvent, CallRecord
from toolledger.domain.trail import TrailHead, TrailScope, content_of
from toolledger.store.engine import uninterrupted_on_sqlite
from toolledger.store.rows import call_event, call_record
from toolledger.store.schema import tool_call_events, tool_calls

_CALL_KEY = (tool_calls.c.session_id, tool_calls.c.turn_id, tool_calls.c.call_id)
_EVENT_KEY = (tool_call_events.c.session_id, tool_call_events.c.turn_id, tool_call_events.c.call_id)


@dataclass(frozen=True)
class CallTrail:
    """A call's row and its events, oldest first, as stored (read together: one snapshot)."""

    call: CallRecord
    events: list[CallEvent]

    @property
    def key(self) -> CallKey:
        return self.call.key

    @property
    def status(self) -> str:
        return self.call.status.value

    @property
    def content(self) -> dict[str, str | None]:
        """What the call's content digest covers, as stored now (``domain.trail.content_of``)."""
        return content_of(self.call)


@uninterrupted_on_sqlite
class TrailStore:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def count_calls(self, scope: TrailScope) -> int:
        async with self.engine.connect() as conn:
            counted = select(func.count()).select_from(tool_calls).where(*_in_scope(scope))
            return int((await conn.execute(counted)).scalar_one())

    async def trails(self, scope: TrailScope, *, batch: int = 500) -> AsyncIterator[CallTrail]:
        """Every call of ``scope`` with its events, in key order, ``batch`` calls per read."""
        after: tuple[str, str, str] | None = None
        while True:
            page = select(tool_calls).where(*_in_scope(scope))
            if after is not None:
                page = page.where(tuple_(*_CALL_KEY) > tuple_(*after))
            trails = await self._read(page.order_by(*_CALL_KEY).limit(batch))
            for trail in trails:
                yield trail
            if len(trails) < batch:
                return
            last = trails[-1].key
            after = (last.session_id, last.turn_id, last.call_id)

    async def trails_of(self, keys: Sequence[CallKey]) -> list[CallTrail]:
        """The calls of ``keys`` still in the ledger, each with its events."""
        if not keys:
            return []
        wanted = tuple_(*_CALL_KEY).in_([(k.session_id, k.turn_id, k.call_id) for k in keys])
        return await self._read(select(tool_calls).where(wanted))

    async def _read(self, calls: Select[Any]) -> list[CallTrail]:
        """The calls ``calls`` selects (whole rows), each with its events, read by ONE
        statement: one snapshot, so a call that changes meanwhile is seen with its row and its
        events as they were together (two reads could pair a new event with an old status, or
        new content with an old event)."""
        page = calls.subquery("page")
        statement = (
            select(*(column.label(f"call_{column.name}") for column in page.c))
            .add_columns(*tool_call_events.c)
            .select_from(
                page.outerjoin(
                    tool_call_events,
                    and_(*(page.c[c.name] == e for c, e in zip(_CALL_KEY, _EVENT_KEY, strict=True))),
                )
            )
            .order_by(*(page.c[c.name] for c in _CALL_KEY), tool_call_events.c.id)
        )
        trails: list[CallTrail] = []
        names = [column.name for column in page.c]
        async with self.engine.connect() as conn:
            for row in await conn.execute(statement):
                key = CallKey(row.call_session_id, row.call_turn_id, row.call_call_id)
                if not trails or trails[-1].key != key:
                    call = call_record({name: row._mapping[f"call_{name}"] for name in names})
                    trails.append(CallTrail(call, []))
                if row.id is not None:
                    trails[-1].events.append(call_event(row))
        return trails

    async def heads(self, keys: Sequence[CallKey]) -> dict[CallKey, TrailHead]:
        """Each call's chain head as stored now: its events counted, and the hash of the last
        one (a call without events is absent)."""
        if not keys:
            return {}
        wanted = tuple_(*_EVENT_KEY).in_([(k.session_id, k.turn_id, k.call_id) for k in keys])
        async with self.engine.connect() as conn:
            counted = await conn.execute(
                select(*_EVENT_KEY, func.count(), func.max(tool_call_events.c.id))
                .where(wanted)
                .group_by(*_EVENT_KEY)
            )
            last: dict[int, tuple[CallKey, int]] = {
                int(top): (CallKey(session_id, turn_id, call_id), int(count))
                for session_id, turn_id, call_id, count, top in counted
            }
            if not last:
                return {}
            hashes = await conn.execute(
                select(tool_call_events.c.id, tool_call_events.c.sha256).where(
                    tool_call_events.c.id.in_(list(last))
                )
            )
            return {last[event_id][0]: TrailHead(last[event_id][1], sha256) for event_id, sha256 in hashes}


def _in_scope(scope: TrailScope) -> list[Any]:
    if scope.key is not None:
        return [c == v for c, v in zip(_CALL_KEY, _key_values(scope.key), strict=True)]
    if scope.session_id is not None:
        return [tool_calls.c.session_id == scope.session_id]
    return []


def _key_values(key: CallKey) -> tuple[str, str, str]:
    return key.session_id, key.turn_id, key.call_id


__all__ = ["CallTrail", "TrailStore"]
