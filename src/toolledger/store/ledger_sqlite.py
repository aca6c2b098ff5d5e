"""The ledger on SQLite: each write a transaction of separate statements (the change, then its
audit event), queued behind this process's other writers (``store.engine.write_lock``).

SQLite has no data-modifying CTEs, and no network between the statements to save. Every
public operation runs to completion even if its caller is cancelled (``uninterrupted``):
aiosqlite can otherwise drop a connection with its write lock held.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from functools import cached_property
from typing import Any

from sqlalchemy import String, bindparam, select
from sqlalchemy.dialects import sqlite
from sqlalchemy.ext.asyncio import AsyncConnection

from toolledger.domain.keys import CallKey
from toolledger.domain.records import CallRecord, Recorded
from toolledger.domain.states import RECORD, CallStatus, Transition
from toolledger.store.engine import uninterrupted, write_lock
from toolledger.store.ledger import RECORDED_REASON, LedgerStore, NewCall
from toolledger.store.rows import call_record
from toolledger.store.schema import tool_calls
from toolledger.store.transitions import (
    KEY_MATCH,
    Note,
    changes,
    content_written,
    fenced,
    key_params,
    record_insert,
)


@uninterrupted
class SqliteLedger(LedgerStore):
    @cached_property
    def _write_lock(self) -> AbstractAsyncContextManager[Any]:
        return write_lock(self.engine)

    async def mark_confirmed_many(self, keys: Sequence[CallKey]) -> set[CallKey]:
        return {key for key in keys if await self.mark_confirmed(key)}

    def _writing(self, *, durable: bool = True) -> AbstractAsyncContextManager[AsyncConnection]:
        return self._transaction(durable=durable)

    @asynccontextmanager
    async def _transaction(self, *, durable: bool = True) -> AsyncIterator[AsyncConnection]:
        if durable:
            async with self._write_lock, self.engine.begin() as conn:
                yield conn
            return
        # WAL with synchronous=NORMAL: the commit survives the process being killed, not the
        # machine losing power, and skips the fsync. SQLite refuses to change it inside a
        # transaction, so it is set around one, under the write lock (no other write of this
        # process meets the connection meanwhile), and FULL is back before it returns to the pool.
        async with self._write_lock, self.engine.connect() as conn:
            await _synchronous(conn, "NORMAL")
            try:
                async with conn.begin():
                    yield conn
            finally:
                try:
                    await _synchronous(conn, "FULL")
                except BaseException:
                    # Never back in the pool less durable than every other connection.
                    await conn.invalidate()
                    raise

    async def _record_new(self, new: NewCall) -> Recorded:
        async with self._transaction() as conn:
            return await self._record_in(conn, new)

    async def _record_batch(self, news: Sequence[NewCall]) -> Sequence[Recorded | BaseException]:
        # Group commit: one transaction, one fsync, for the calls delivered together.
        return await self._together(news, self._record_in)

    async def _record_in(self, conn: AsyncConnection, new: NewCall) -> Recorded:
        insert = self._statement((RECORD.name,), lambda: record_insert(sqlite.insert))
        row = (await conn.execute(insert, new.params)).first()
        if row is None:
            return await self._already_recorded(conn, new.key, new.fingerprint)
        call = call_record(row)
        await self._event(
            conn,
            new.key,
            RECORD.event,
            None,
            RECORD.target,
            call.lease_token,
            RECORDED_REASON,
            detail=new.detail,
            written=content_written(RECORD, new.params),
        )
        return Recorded(call=call, claimed=True)

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
        if len(sources) == 1:
            # One source: the compare-and-set alone decides, and the event names it.
            (source,) = sources
        else:
            # Read first, so the event names the state the row really left (the write lock
            # is held: nobody changes it in between).
            found = await conn.execute(select(tool_calls.c.status).where(KEY_MATCH), key_params(key))
            current = found.scalar()
            if current is None or current not in sources:
                return None
            source = CallStatus(current)
        update = self._statement((transition.name, transition.target), lambda: _build_change(transition))
        values = {**params, **key_params(key), "p_from_status": source.value}
        row = (await conn.execute(update, values)).first()
        if row is None:
            return None
        call = call_record(row)
        await self._event(
            conn,
            key,
            transition.event,
            source,
            transition.target,
            call.lease_token,
            reason,
            detail=detail,
            written=content_written(transition, params),
        )
        return call

    async def _note(
        self, note: Note, key: CallKey, params: dict[str, Any], reason: str
    ) -> Mapping[str, Any] | None:
        update = self._statement((note.name,), lambda: note.update(KEY_MATCH))
        async with self._transaction() as conn:
            row = (await conn.execute(update, {**params, **key_params(key)})).first()
            if row is not None:
                await self._event(conn, key, note.event, note.status, note.status, None, reason)
            return None if row is None else dict(row._mapping)


async def _synchronous(conn: AsyncConnection, level: str) -> None:
    await conn.exec_driver_sql(f"PRAGMA synchronous={level}")
    await conn.commit()  # the pragma ran outside any SQLite transaction; end SQLAlchemy's


def _build_change(transition: Transition) -> Any:
    return (
        tool_calls.update()
        .where(
            KEY_MATCH,
            tool_calls.c.status == bindparam("p_from_status", type_=String),
            *fenced(transition),
        )
        .values(**changes(transition))
        .returning(tool_calls)
    )


__all__ = ["SqliteLedger"]
