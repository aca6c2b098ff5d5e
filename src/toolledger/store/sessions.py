"""Watched sessions and the replicas that share them: the only writer of ``sessions`` and
``replicas``.

A replica owns a session through a lease (owner, token, expiry on the database clock). Each
live replica takes a fair share of the watched sessions; a dead replica's leases run out and
the others take its sessions over. On PostgreSQL the candidates are picked with
``FOR UPDATE SKIP LOCKED`` so racing replicas never pick the same session.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import and_, case, func, or_, select
from sqlalchemy.engine import Row
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.sql.elements import ColumnElement

from toolledger.domain.records import LookClaim, ReplicaRecord, SessionRecord
from toolledger.domain.redaction import redact_text
from toolledger.domain.states import CallStatus, EffectClass
from toolledger.store.engine import (
    dialect_insert,
    single_write,
    uninterrupted_on_sqlite,
    utc_after,
    utc_now,
    write_transaction,
)
from toolledger.store.schema import open_call_clause, replicas, sessions, tool_calls

LOOK_NOW = case(
    (or_(sessions.c.look_requested_at.is_(None), sessions.c.look_requested_at > utc_now()), utc_now()),
    else_=sessions.c.look_requested_at,
)
"""A look asked for now: an earlier request still waiting keeps its place, a later one
(a known wait's end) is brought forward."""


def look_request(
    insert: Callable[..., Any], session_id: str, *, intake: str, agent_id: str | None = None
) -> Any:
    """The statement that asks for a look at ``session_id`` (its row made if new): also run
    by the intake's own transaction, with the delivery it records."""
    values: dict[str, Any] = {
        "session_id": session_id,
        "watched": False,
        "intake": intake,
        "agent_id": agent_id,
        "look_requested_at": utc_now(),
        "look_seq": 1,
        "created_at": utc_now(),
        "updated_at": utc_now(),
    }
    statement = insert(sessions).values(**values)
    return statement.on_conflict_do_update(
        index_elements=[sessions.c.session_id],
        set_={
            "intake": func.coalesce(sessions.c.intake, statement.excluded.intake),
            "agent_id": func.coalesce(sessions.c.agent_id, statement.excluded.agent_id),
            "look_requested_at": LOOK_NOW,
            "look_seq": sessions.c.look_seq + 1,
            "updated_at": utc_now(),
        },
    )


@uninterrupted_on_sqlite
class SessionStore:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self._insert = dialect_insert(engine)

    # ---------------------------------------------------------------- watching

    async def watch(self, session_id: str) -> bool:
        """Watch a session (again, if it was unwatched). True if it was not watched before."""
        insert = self._insert(sessions).values(
            session_id=session_id, watched=True, created_at=utc_now(), updated_at=utc_now()
        )
        upsert = insert.on_conflict_do_update(
            index_elements=[sessions.c.session_id],
            set_={"watched": True, "reason": None, "updated_at": utc_now()},
            where=sessions.c.watched.is_(False),
        ).returning(sessions.c.session_id)
        async with write_transaction(self.engine) as conn:
            return (await conn.execute(upsert)).first() is not None

    async def watch_new(self, session_ids: Iterable[str]) -> int:
        """Watch sessions never seen before; one unwatched on purpose stays unwatched."""
        rows = [{"session_id": s} for s in dict.fromkeys(session_ids)]
        if not rows:
            return 0
        insert = (
            self._insert(sessions)
            .values(watched=True, created_at=utc_now(), updated_at=utc_now())
            .on_conflict_do_nothing()
            .returning(sessions.c.session_id)
        )
        async with write_transaction(self.engine) as conn:
            added = 0
            for row in rows:
                added += len((await conn.execute(insert.values(**row))).all())
            return added

    async def unwatch(self, session_id: str, reason: str, *, status: str | None = None) -> bool:
        """Stop watching; the lease is dropped so no replica follows it any longer."""
        values: dict[str, Any] = {
            "watched": False,
            "reason": redact_text(reason),
            "owner": None,
            "lease_expires_at": None,
            "updated_at": utc_now(),
        }
        if status is not None:
            values["status"] = status
        async with write_transaction(self.engine) as conn:
            result = await conn.execute(
                sessions.update()
                .where(sessions.c.session_id == session_id, sessions.c.watched.is_(True))
                .values(**values)
            )
            return result.rowcount == 1

    async def mark_polled(
        self, session_id: str, *, status: str | None, last_event_id: str | None = None
    ) -> None:
        values: dict[str, Any] = {"last_polled_at": utc_now(), "status": status, "updated_at": utc_now()}
        if last_event_id is not None:
            values["last_event_id"] = last_event_id
        # After every reconcile: one statement, committed by itself.
        async with single_write(self.engine) as conn:
            await conn.execute(sessions.update().where(sessions.c.session_id == session_id).values(**values))

    # ------------------------------------------------------------------ leases

    async def acquire(self, owner: str, limit: int, lease_seconds: float) -> dict[str, int]:
        """Take up to ``limit`` watched sessions nobody holds; returns session id -> lease token."""
        if limit <= 0:
            return {}
        free = and_(
            sessions.c.watched.is_(True),
            or_(sessions.c.lease_expires_at.is_(None), sessions.c.lease_expires_at < utc_now()),
        )
        candidates = (
            select(sessions.c.session_id)
            .where(free)
            .order_by(sessions.c.created_at, sessions.c.session_id)
            .limit(limit)
            .with_for_update(skip_locked=True)
        )
        statement = (
            sessions.update()
            .where(sessions.c.session_id.in_(candidates.scalar_subquery()), free)
            .values(
                owner=owner,
                lease_token=sessions.c.lease_token + 1,
                lease_expires_at=utc_after(float(lease_seconds)),
                updated_at=utc_now(),
            )
            .returning(sessions.c.session_id, sessions.c.lease_token)
        )
        async with write_transaction(self.engine) as conn:
            return {row.session_id: row.lease_token for row in await conn.execute(statement)}

    async def renew(self, owner: str, leases: Mapping[str, int], lease_seconds: float) -> set[str]:
        """Extend the leases still ours; returns the session ids renewed (the rest are lost)."""
        if not leases:
            return set()
        statement = (
            sessions.update()
            .where(
                sessions.c.owner == owner,
                sessions.c.watched.is_(True),
                sessions.c.session_id.in_(list(leases)),
            )
            .values(lease_expires_at=utc_after(float(lease_seconds)), updated_at=utc_now())
            .returning(sessions.c.session_id, sessions.c.lease_token)
        )
        async with write_transaction(self.engine) as conn:
            rows = (await conn.execute(statement)).all()
        return {row.session_id for row in rows if leases.get(row.session_id) == row.lease_token}

    async def has_unowned(self) -> bool:
        """Is some watched session followed by nobody (just watched, or its owner died)?"""
        async with self.engine.connect() as conn:
            row = (
                await conn.execute(
                    select(sessions.c.session_id)
                    .where(
                        sessions.c.watched.is_(True),
                        or_(sessions.c.lease_expires_at.is_(None), sessions.c.lease_expires_at < utc_now()),
                    )
                    .limit(1)
                )
            ).first()
            return row is not None

    async def release(self, owner: str, session_ids: Sequence[str] | None = None) -> int:
        """Give leases back at once (graceful shutdown, rebalancing), so others need not wait."""
        statement = sessions.update().where(sessions.c.owner == owner)
        if session_ids is not None:
            if not session_ids:
                return 0
            statement = statement.where(sessions.c.session_id.in_(list(session_ids)))
        async with write_transaction(self.engine) as conn:
            result = await conn.execute(
                statement.values(owner=None, lease_expires_at=None, updated_at=utc_now())
            )
            return result.rowcount

    # ------------------------------------------------------------------- looks

    async def request_looks(
        self, session_ids: Iterable[str], *, intake: str, agent_id: str | None = None
    ) -> int:
        """Ask for a look at each session (made an intake session if new); how many asked."""
        ids = list(dict.fromkeys(session_ids))
        if not ids:
            return 0
        async with write_transaction(self.engine) as conn:
            for session_id in ids:
                await conn.execute(look_request(self._insert, session_id, intake=intake, agent_id=agent_id))
        return len(ids)

    async def nudge_looks(self, session_ids: Iterable[str]) -> int:
        """Ask for a look at those of ``session_ids`` that are intake sessions (an operator's
        decision, a dead replica's calls taken over): they have no stream to hear it on."""
        ids = sorted(set(session_ids))
        if not ids:
            return 0
        statement = (
            sessions.update()
            .where(sessions.c.session_id.in_(ids), sessions.c.intake.is_not(None))
            .values(look_requested_at=LOOK_NOW, look_seq=sessions.c.look_seq + 1, updated_at=utc_now())
        )
        async with write_transaction(self.engine) as conn:
            return (await conn.execute(statement)).rowcount

    async def request_looks_at_open_calls(self) -> int:
        """Ask for a look at every intake session with an open call and no look asked for:
        what no webhook will come for (a result left to confirm, a crash's leftovers)."""
        with_open = select(tool_calls.c.session_id).where(open_call_clause()).distinct()
        statement = (
            sessions.update()
            .where(
                sessions.c.intake.is_not(None),
                sessions.c.look_requested_at.is_(None),
                sessions.c.session_id.in_(with_open.scalar_subquery()),
            )
            .values(look_requested_at=utc_now(), look_seq=sessions.c.look_seq + 1, updated_at=utc_now())
        )
        async with write_transaction(self.engine) as conn:
            return (await conn.execute(statement)).rowcount

    async def claim_looks(self, owner: str, limit: int, lease_seconds: float) -> list[LookClaim]:
        """Take up to ``limit`` looks that are due and held by nobody, oldest asked first (on
        PostgreSQL, SKIP LOCKED: racing replicas never take the same one)."""
        if limit <= 0:
            return []
        due = and_(
            sessions.c.look_requested_at <= utc_now(),
            or_(sessions.c.look_expires_at.is_(None), sessions.c.look_expires_at < utc_now()),
        )
        candidates = (
            select(sessions.c.session_id)
            .where(due)
            .order_by(sessions.c.look_requested_at, sessions.c.session_id)
            .limit(limit)
            .with_for_update(skip_locked=True)
        )
        # Polled every quarter second by every replica: a read first, so that an idle poll
        # takes no lock (on SQLite, the one write lock the process's calls need).
        async with self.engine.connect() as conn:
            if (await conn.execute(select(sessions.c.session_id).where(due).limit(1))).first() is None:
                return []
        statement = (
            sessions.update()
            .where(sessions.c.session_id.in_(candidates.scalar_subquery()), due)
            .values(look_owner=owner, look_expires_at=utc_after(float(lease_seconds)))
            .returning(sessions.c.session_id, sessions.c.look_seq, sessions.c.agent_id)
        )
        async with write_transaction(self.engine) as conn:
            rows = (await conn.execute(statement)).all()
        claims = [LookClaim(row.session_id, row.look_seq, row.agent_id) for row in rows]
        return sorted(claims, key=lambda claim: claim.session_id)

    async def finish_look(
        self, claim: LookClaim, owner: str, *, again_in: float | None, agent_id: str | None = None
    ) -> bool:
        """Give the look back: done (nothing asked), or due again in ``again_in`` seconds (a
        wait with a known end). Asked for again while it ran (``look_seq`` moved on), it stays
        due now. False if the look was no longer ours (its lease ran out and another took it)."""
        if again_in is not None:
            after: Any = utc_after(max(float(again_in), 0.0))
        else:
            after = None
        next_look = case(
            (sessions.c.look_seq != claim.seq, sessions.c.look_requested_at),
            else_=after,
        )
        statement = (
            sessions.update()
            .where(sessions.c.session_id == claim.session_id, sessions.c.look_owner == owner)
            .values(
                look_owner=None,
                look_expires_at=None,
                look_requested_at=next_look,
                agent_id=func.coalesce(sessions.c.agent_id, agent_id),
                updated_at=utc_now(),
            )
        )
        async with write_transaction(self.engine) as conn:
            return (await conn.execute(statement)).rowcount == 1

    async def release_looks(self, owner: str) -> int:
        """Give back every look ``owner`` holds (still due): a stopping replica's, at once."""
        statement = (
            sessions.update()
            .where(sessions.c.look_owner == owner)
            .values(look_owner=None, look_expires_at=None)
        )
        async with write_transaction(self.engine) as conn:
            return (await conn.execute(statement)).rowcount

    async def look_backlog(self) -> tuple[int, int]:
        """Looks due now and not taken, and intake sessions in all."""
        async with self.engine.connect() as conn:
            due = (
                await conn.execute(
                    select(func.count()).where(
                        sessions.c.look_requested_at <= utc_now(), sessions.c.look_owner.is_(None)
                    )
                )
            ).scalar_one()
            intake = (
                await conn.execute(select(func.count()).where(sessions.c.intake.is_not(None)))
            ).scalar_one()
        return int(due), int(intake)

    # ---------------------------------------------------------------- replicas

    async def heartbeat_replica(
        self,
        replica_id: str,
        *,
        hostname: str,
        pid: int,
        lease_seconds: float,
        handler_load: Mapping[str, int] | None = None,
        intake_counts: Mapping[str, int] | None = None,
    ) -> None:
        """Register the replica, or renew it; ``handler_load``: how its handlers stand now,
        ``intake_counts``: its webhook intake's counts (both shown by `toolledger status`)."""
        load = None if handler_load is None else json.dumps(dict(handler_load), sort_keys=True)
        counts = None if intake_counts is None else json.dumps(dict(intake_counts), sort_keys=True)
        insert = self._insert(replicas).values(
            replica_id=replica_id,
            hostname=hostname,
            pid=pid,
            started_at=utc_now(),
            heartbeat_at=utc_now(),
            expires_at=utc_after(float(lease_seconds)),
            handler_load=load,
            intake_counts=counts,
        )
        upsert = insert.on_conflict_do_update(
            index_elements=[replicas.c.replica_id],
            set_={
                "heartbeat_at": utc_now(),
                "expires_at": utc_after(float(lease_seconds)),
                "handler_load": load,
                "intake_counts": counts,
            },
        )
        async with write_transaction(self.engine) as conn:
            await conn.execute(upsert)
            # Rows of replicas long dead are noise in `toolledger status`.
            await conn.execute(replicas.delete().where(replicas.c.expires_at < utc_after(-3600.0)))

    async def remove_replica(self, replica_id: str) -> None:
        async with write_transaction(self.engine) as conn:
            await conn.execute(replicas.delete().where(replicas.c.replica_id == replica_id))

    async def retire_replicas(self, replica_ids: Collection[str]) -> int:
        """Replicas known to be gone: no longer counted live, their session leases freed at
        once. Their rows stay (until the hourly clean-up) so that leases still naming them
        can be proven gone too. Returns how many session leases were freed."""
        if not replica_ids:
            return 0
        ids = sorted(replica_ids)
        async with write_transaction(self.engine) as conn:
            await conn.execute(
                replicas.update()
                .where(replicas.c.replica_id.in_(ids), replicas.c.expires_at > utc_now())
                .values(expires_at=utc_now())
            )
            freed = await conn.execute(
                sessions.update()
                .where(sessions.c.owner.in_(ids))
                .values(owner=None, lease_expires_at=None, updated_at=utc_now())
            )
            # Their looks are due again at once, not when the looks' leases run out.
            await conn.execute(
                sessions.update()
                .where(sessions.c.look_owner.in_(ids))
                .values(look_owner=None, look_expires_at=None)
            )
            return freed.rowcount

    async def holders(self) -> set[str]:
        """Replicas that may hold something: counted live, or owning a session lease or a
        look's lease still running (an intake-only replica may hold nothing else once its own
        registration ran out). (A replica already retired holds nothing here; its call leases
        are the ledger's to list, its sweeps the intake store's.)"""
        async with self.engine.connect() as conn:
            live = select(replicas.c.replica_id).where(replicas.c.expires_at >= utc_now())
            leasing = select(sessions.c.owner).where(
                sessions.c.owner.is_not(None), sessions.c.lease_expires_at >= utc_now()
            )
            looking = select(sessions.c.look_owner).where(
                sessions.c.look_owner.is_not(None), sessions.c.look_expires_at >= utc_now()
            )
            held = live.union(leasing, looking)
            return {owner for owner in (await conn.execute(held)).scalars() if owner}

    async def fair_share(self) -> int:
        """How many watched sessions each live replica should own."""
        async with self.engine.connect() as conn:
            live = (
                await conn.execute(select(func.count()).where(replicas.c.expires_at >= utc_now()))
            ).scalar_one()
            watched = (
                await conn.execute(select(func.count()).where(sessions.c.watched.is_(True)))
            ).scalar_one()
        return math.ceil(watched / max(live, 1))

    async def live_replicas(self) -> list[ReplicaRecord]:
        async with self.engine.connect() as conn:
            rows = await conn.execute(
                select(replicas).where(replicas.c.expires_at >= utc_now()).order_by(replicas.c.started_at)
            )
            return [_replica(row) for row in rows]

    # ------------------------------------------------------------------- reads

    async def get(self, session_id: str) -> SessionRecord | None:
        async with self.engine.connect() as conn:
            row = (await conn.execute(select(sessions).where(sessions.c.session_id == session_id))).first()
            return None if row is None else _session(row)

    async def find(
        self, *, watched: bool | None = True, owner: str | None = None, limit: int | None = None
    ) -> list[SessionRecord]:
        query = select(sessions).order_by(sessions.c.created_at, sessions.c.session_id)
        if watched is not None:
            query = query.where(sessions.c.watched.is_(watched))
        if owner is not None:
            query = query.where(sessions.c.owner == owner)
        if limit is not None:
            query = query.limit(limit)
        async with self.engine.connect() as conn:
            return [_session(row) for row in await conn.execute(query)]

    async def with_open_calls(self) -> list[str]:
        """Sessions with a call the session may still be waiting on (the recovery scan)."""
        return await self._sessions_with_calls(open_call_clause())

    async def with_work(self) -> list[str]:
        """Sessions with an open call toolledger can move on now: ``with_open_calls`` less the
        sessions whose only open calls are at_most_once calls left ``unknown``, which wait for
        an operator (or for their deadline, which wakes them). A restart reconciles these
        first; the ones waiting for an operator, piling up over time, would otherwise come
        ahead of every session with a result to deliver, on every restart."""
        waits_for_operator = and_(
            tool_calls.c.status == CallStatus.UNKNOWN.value,
            tool_calls.c.effect_class == EffectClass.AT_MOST_ONCE.value,
        )
        return await self._sessions_with_calls(and_(open_call_clause(), ~waits_for_operator))

    async def _sessions_with_calls(self, matching: ColumnElement[bool]) -> list[str]:
        async with self.engine.connect() as conn:
            rows = await conn.execute(select(tool_calls.c.session_id).where(matching).distinct())
            return [row.session_id for row in rows]


def _session(row: Row[Any]) -> SessionRecord:
    return SessionRecord(**row._mapping)


def _replica(row: Row[Any]) -> ReplicaRecord:
    fields = dict(row._mapping)
    load = _counts(fields.pop("handler_load", None))
    intake = _counts(fields.pop("intake_counts", None))
    return ReplicaRecord(**fields, handler_load=load, intake_counts=intake)


def _counts(stored: str | None) -> dict[str, int] | None:
    try:
        parsed = json.loads(stored) if stored else None
    except ValueError:
        parsed = None  # written by no toolledger: shown as unknown, not trusted
    if not isinstance(parsed, dict):
        return None
    return {str(k): v for k, v in parsed.items() if isinstance(v, int)}


__all__ = ["SessionStore"]
