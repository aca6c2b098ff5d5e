"""A small ledger of whole call lives for the trail's tests, and tampering with it the way
someone with the database's credentials would: direct SQL, past the ledger's code."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import Connection, Engine, select, text
from sqlalchemy import create_engine as create_sync_engine
from sqlalchemy.pool import NullPool

from toolledger.domain.keys import CallKey
from toolledger.domain.records import CallEvent
from toolledger.domain.results import succeeded
from toolledger.domain.states import EffectClass
from toolledger.domain.trail import TrailKey, content_of, content_sha256, event_sha256, event_values
from toolledger.store.chain import SQLITE_DROP_SQL, SQLITE_TRIGGER_SQL
from toolledger.store.engine import create_engine, sync_url
from toolledger.store.ledger import LedgerStore
from toolledger.store.rows import call_event, call_events_query, call_record
from toolledger.store.schema import tool_call_events, tool_calls


@dataclass(frozen=True)
class TrailLedger:
    url: str
    keys: list[CallKey]
    """Calls of session ``sess_trail``, each recorded, completed, submitted and confirmed."""
    apart: CallKey
    """A call of its own session, ``sess_apart``, never tampered with."""

    def engine(self) -> Engine:
        return create_sync_engine(sync_url(self.url), poolclass=NullPool)

    def events(self, key: CallKey) -> list[CallEvent]:
        engine = self.engine()
        try:
            with engine.connect() as conn:
                return [call_event(row) for row in conn.execute(call_events_query(key))]
        finally:
            engine.dispose()

    @contextmanager
    def tampering(self) -> Iterator[Connection]:
        """A transaction of direct SQL on the ledger."""
        engine = self.engine()
        try:
            with engine.begin() as conn:
                yield conn
        finally:
            engine.dispose()


def build_trail_ledger(url: str, calls: int = 6, *, trail_key: TrailKey | None = None) -> TrailLedger:
    """``calls`` whole lives written together (batched), with events of a throwaway call
    between their steps, deleted at the end: each call's events are ids apart, with free ids
    between them, as a ledger that has been pruned has. ``trail_key``: written keyed."""

    async def build() -> TrailLedger:
        engine = create_engine(url)
        try:
            store = LedgerStore(engine, actor="worker-1", trail_key=trail_key)
            keys = [CallKey("sess_trail", "turn_1", f"call_{n}") for n in range(calls)]
            apart = CallKey("sess_apart", "turn_1", "call_apart")
            every = [*keys, apart]
            filler = CallKey("sess_filler", "turn_1", "call_filler")

            async def fill() -> None:
                for n in range(2):
                    await store.flag(filler, "note", f"filler {n}")

            recorded = await asyncio.gather(
                *(
                    store.record(
                        key,
                        tool_name="charge_card",
                        arguments={"amount": n},
                        effect_class=EffectClass.AT_MOST_ONCE,
                        lease_seconds=30,
                    )
                    for n, key in enumerate([filler, *every])
                )
            )
            await fill()
            await asyncio.gather(
                *(
                    store.complete(r.call.key, r.call.lease_token, succeeded(r.call.key, "ok"))
                    for r in recorded
                )
            )
            await fill()
            await asyncio.gather(*(store.mark_submitted(key) for key in every))
            await fill()
            assert await store.mark_confirmed_many(every) == set(every)
            async with engine.begin() as conn:
                await conn.execute(text("DELETE FROM tool_calls WHERE session_id = 'sess_filler'"))
            return TrailLedger(url, keys, apart)
        finally:
            await engine.dispose()

    return asyncio.run(build())


def forge_after(conn: Connection, ledger: TrailLedger, predecessor: CallEvent, **changes: Any) -> CallEvent:
    """An event inserted right after ``predecessor`` (at the first free id after it) by someone
    who knows how the chain is hashed and chains it properly, past the trail's trigger."""
    taken = {row[0] for row in conn.execute(select(tool_call_events.c.id))}
    free = next(candidate for candidate in itertools.count(predecessor.id + 1) if candidate not in taken)
    forged = dataclasses.replace(
        predecessor,
        id=free,
        at=predecessor.at + timedelta(milliseconds=1),
        prev_sha256=predecessor.sha256,
        **changes,
    )
    forged = dataclasses.replace(forged, sha256=event_sha256(event_values(forged, forged.prev_sha256)))
    row = {
        "id": forged.id,
        "session_id": forged.key.session_id,
        "turn_id": forged.key.turn_id,
        "call_id": forged.key.call_id,
        **{name: getattr(forged, name) for name in ("at", "actor", "kind", "from_status", "to_status")},
        **{
            name: getattr(forged, name)
            for name in (
                "lease_token",
                "reason",
                "detail",
                "prev_sha256",
                "sha256",
                "content_sha256",
                "trail_mac",
            )
        },
    }
    with triggers_off(conn):
        conn.execute(tool_call_events.insert().values(**row))
    return forged


@contextmanager
def triggers_off(conn: Connection) -> Iterator[None]:
    """What a forger does to insert the hashes of their choosing: on PostgreSQL a superuser's
    session_replication_role (triggers and foreign keys off for the transaction); SQLite has
    no such switch, so the trigger is dropped and put back in the same transaction."""
    if conn.dialect.name == "postgresql":
        conn.execute(text("SET LOCAL session_replication_role = replica"))
        yield
        conn.execute(text("SET LOCAL session_replication_role = DEFAULT"))
        return
    for statement in SQLITE_DROP_SQL:
        conn.execute(text(statement))
    yield
    conn.execute(text(SQLITE_TRIGGER_SQL))


def rehash_from(conn: Connection, events: list[CallEvent], index: int, **changes: Any) -> None:
    """Event ``index`` changed, and its hash and every later one's recomputed: a rewrite by
    someone who knows the algorithm. The chain verifies again; only an anchor kept elsewhere
    (an export's chain head) can tell."""
    previous = events[index - 1].sha256 if index else None
    assert previous is not None
    for position in range(index, len(events)):
        event = events[position]
        if position == index:
            event = dataclasses.replace(event, **changes)
        sha256 = event_sha256(event_values(event, previous))
        conn.execute(
            tool_call_events.update()
            .where(tool_call_events.c.id == event.id)
            .values(prev_sha256=previous, sha256=sha256, **changes if position == index else {})
        )
        previous = sha256


def forge_content(conn: Connection, events: list[CallEvent], **columns: Any) -> None:
    """The call's row changed (``columns`` of ``tool_calls``), and then, as someone who knows
    the algorithm would, every event that carried the content digest it replaced given the
    new one, and the chain rehashed from the first of them: the unkeyed trail verifies again;
    only the keyed MACs (and an export's anchor) can tell."""
    key = events[0].key
    where = (
        (tool_calls.c.session_id == key.session_id)
        & (tool_calls.c.turn_id == key.turn_id)
        & (tool_calls.c.call_id == key.call_id)
    )
    conn.execute(tool_calls.update().where(where).values(**columns))
    forged = content_sha256(content_of(call_record(conn.execute(tool_calls.select().where(where)).one())))
    replaced = events[-1].content_sha256
    first = next(n for n, event in enumerate(events) if event.content_sha256 == replaced)
    previous = events[first - 1].sha256 if first else None
    assert previous is not None
    for event in events[first:]:
        if event.content_sha256 == replaced:
            event = dataclasses.replace(event, content_sha256=forged)
        sha256 = event_sha256(event_values(event, previous))
        conn.execute(
            tool_call_events.update()
            .where(tool_call_events.c.id == event.id)
            .values(prev_sha256=previous, sha256=sha256, content_sha256=event.content_sha256)
        )
        previous = sha256
