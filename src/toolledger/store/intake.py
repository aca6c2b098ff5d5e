"""What the intake keeps: verified webhooks by id (``webhook_deliveries``) and each configured
agent's sweep (``agent_sweeps``); the only writer of both.

A webhook is taken in one transaction with the look it asks for, so that the 2xx that tells
the sender to stop retrying is answered only once the session is sure to be looked at.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, or_, select
from sqlalchemy.ext.asyncio import AsyncEngine

from toolledger.domain.redaction import redact_text
from toolledger.store.engine import (
    dialect_insert,
    uninterrupted_on_sqlite,
    utc_after,
    utc_now,
    write_transaction,
)
from toolledger.store.schema import agent_sweeps, webhook_deliveries
from toolledger.store.sessions import look_request

DELIVERIES_KEPT_SECONDS = 7 * 24 * 3600.0
"""How long a webhook's id is kept: far past the sender's retries (a redelivery later than
this is taken again, which costs one more look, never a second run)."""


@dataclass(frozen=True)
class SweepClaim:
    agent_id: str
    watermark: int | None
    runs: int
    resume_after: str | None = None


@dataclass(frozen=True)
class SweepRecord:
    agent_id: str
    watermark: int | None
    runs: int
    owner: str | None
    last_run_at: datetime | None
    last_found: int | None
    last_error: str | None
    resume_after: str | None = None


@uninterrupted_on_sqlite
class IntakeStore:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self._insert = dialect_insert(engine)

    # -------------------------------------------------------------- webhooks

    async def take_webhook(
        self, webhook_id: str, event_type: str, session_id: str | None, *, look: bool
    ) -> bool:
        """Record a verified webhook and, if ``look``, ask for a look at its session, in one
        commit. False: its id was taken before (a redelivery), nothing is done again."""
        insert = (
            self._insert(webhook_deliveries)
            .values(
                webhook_id=webhook_id[:255],
                event_type=event_type[:64],
                session_id=session_id,
                received_at=utc_now(),
            )
            .on_conflict_do_nothing()
            .returning(webhook_deliveries.c.webhook_id)
        )
        async with write_transaction(self.engine) as conn:
            if (await conn.execute(insert)).first() is None:
                return False
            if look and session_id is not None:
                await conn.execute(look_request(self._insert, session_id, intake="webhook"))
            return True

    async def prune_deliveries(self, older_than_seconds: float = DELIVERIES_KEPT_SECONDS) -> int:
        statement = webhook_deliveries.delete().where(
            webhook_deliveries.c.received_at < utc_after(-older_than_seconds)
        )
        async with write_transaction(self.engine) as conn:
            return (await conn.execute(statement)).rowcount

    async def deliveries_taken(self) -> int:
        async with self.engine.connect() as conn:
            return int(
                (await conn.execute(select(func.count()).select_from(webhook_deliveries))).scalar_one()
            )

    # ---------------------------------------------------------------- sweeps

    async def claim_sweep(
        self, agent_id: str, owner: str, *, every_seconds: float, lease_seconds: float
    ) -> SweepClaim | None:
        """Take the agent's sweep if it is due (its last run ``every_seconds`` ago or more) and
        nobody sweeps it now; None otherwise."""
        new_row = self._insert(agent_sweeps).values(agent_id=agent_id, runs=0).on_conflict_do_nothing()
        statement = (
            agent_sweeps.update()
            .where(
                agent_sweeps.c.agent_id == agent_id,
                or_(agent_sweeps.c.lease_expires_at.is_(None), agent_sweeps.c.lease_expires_at < utc_now()),
                or_(
                    agent_sweeps.c.last_run_at.is_(None),
                    agent_sweeps.c.last_run_at <= utc_after(-float(every_seconds)),
                ),
            )
            .values(owner=owner, lease_expires_at=utc_after(float(lease_seconds)))
            .returning(agent_sweeps.c.watermark, agent_sweeps.c.runs, agent_sweeps.c.resume_after)
        )
        async with write_transaction(self.engine) as conn:
            await conn.execute(new_row)
            row = (await conn.execute(statement)).first()
        return None if row is None else SweepClaim(agent_id, row.watermark, row.runs, row.resume_after)

    async def sweep_holders(self) -> set[str]:
        """Replicas holding an agent's sweep under a lease still running."""
        statement = select(agent_sweeps.c.owner).where(
            agent_sweeps.c.owner.is_not(None), agent_sweeps.c.lease_expires_at >= utc_now()
        )
        async with self.engine.connect() as conn:
            return {owner for owner in (await conn.execute(statement)).scalars() if owner}

    async def release_sweeps(self, owners: Collection[str]) -> int:
        """The sweeps of replicas known to be gone, given back at once (due as they were), not
        when their leases run out; how many."""
        if not owners:
            return 0
        statement = (
            agent_sweeps.update()
            .where(agent_sweeps.c.owner.in_(sorted(owners)))
            .values(owner=None, lease_expires_at=None)
        )
        async with write_transaction(self.engine) as conn:
            return (await conn.execute(statement)).rowcount

    async def finish_sweep(
        self,
        claim: SweepClaim,
        owner: str,
        *,
        watermark: int | None,
        found: int,
        resume_after: str | None = None,
        error: str | None = None,
    ) -> None:
        """The sweep ran (or failed, with ``error``, keeping where the rolling pass was): its
        watermark moves on, its lease is given back."""
        values: dict[str, object] = {
            "owner": None,
            "lease_expires_at": None,
            "last_run_at": utc_now(),
            "runs": agent_sweeps.c.runs + 1,
            "last_found": found,
            "last_error": None if error is None else redact_text(error)[:500],
        }
        if error is None:
            values["resume_after"] = resume_after
        if watermark is not None:
            values["watermark"] = func.coalesce(
                func.greatest(agent_sweeps.c.watermark, watermark)
                if self.engine.dialect.name == "postgresql"
                else func.max(agent_sweeps.c.watermark, watermark),
                watermark,
            )
        async with write_transaction(self.engine) as conn:
            await conn.execute(
                agent_sweeps.update()
                .where(agent_sweeps.c.agent_id == claim.agent_id, agent_sweeps.c.owner == owner)
                .values(**values)
            )

    async def sweeps(self) -> list[SweepRecord]:
        async with self.engine.connect() as conn:
            rows = await conn.execute(select(agent_sweeps).order_by(agent_sweeps.c.agent_id))
            return [
                SweepRecord(
                    agent_id=row.agent_id,
                    watermark=row.watermark,
                    runs=row.runs,
                    owner=row.owner if row.lease_expires_at is not None else None,
                    last_run_at=row.last_run_at,
                    last_found=row.last_found,
                    last_error=row.last_error,
                    resume_after=row.resume_after,
                )
                for row in rows
            ]


__all__ = ["DELIVERIES_KEPT_SECONDS", "IntakeStore", "SweepClaim", "SweepRecord"]
