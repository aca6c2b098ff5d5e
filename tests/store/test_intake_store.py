"""The database clock's offsets as the intake uses them, on SQLite and on PostgreSQL: a time
some seconds *ago* (an agent's sweep due again, old webhook ids pruned, long-dead replicas'
rows cleaned up), not only some seconds ahead (leases)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from toolledger.store.engine import utc_after, utc_now
from toolledger.store.intake import IntakeStore
from toolledger.store.schema import replicas
from toolledger.store.sessions import SessionStore


async def test_utc_after__a_negative_number_of_seconds__is_that_long_ago(engine: AsyncEngine) -> None:
    async with engine.connect() as conn:
        ago, now, ahead = (await conn.execute(select(utc_after(-2.5), utc_now(), utc_after(1.5)))).one()

    assert ago is not None
    assert ahead is not None
    assert abs((now - ago).total_seconds() - 2.5) < 0.5
    assert abs((ahead - now).total_seconds() - 1.5) < 0.5


async def test_claim_sweep__once_its_interval_is_over__is_due_again(engine: AsyncEngine) -> None:
    store = IntakeStore(engine)
    first = await store.claim_sweep("agent_a", "replica-1", every_seconds=0.3, lease_seconds=60)
    assert first is not None
    await store.finish_sweep(first, "replica-1", watermark=100, found=0)
    assert await store.claim_sweep("agent_a", "replica-1", every_seconds=0.3, lease_seconds=60) is None

    await asyncio.sleep(0.6)
    again = await store.claim_sweep("agent_a", "replica-2", every_seconds=0.3, lease_seconds=60)

    assert again is not None, (
        "the sweep never came due again: sessions whose webhook was dropped wait for ever"
    )
    assert (again.watermark, again.runs) == (100, 1)


async def test_prune_deliveries__drops_the_ids_older_than_asked_keeps_the_newer(engine: AsyncEngine) -> None:
    store = IntakeStore(engine)
    assert await store.take_webhook("msg_old", "agent.session.created", "sess_1", look=False)
    await asyncio.sleep(0.6)
    assert await store.take_webhook("msg_new", "agent.session.created", "sess_1", look=False)

    pruned = await store.prune_deliveries(older_than_seconds=0.3)

    assert pruned == 1
    assert await store.deliveries_taken() == 1


async def test_heartbeat__removes_the_rows_of_replicas_dead_for_an_hour(engine: AsyncEngine) -> None:
    now = datetime.now(UTC)
    async with engine.begin() as conn:
        for replica_id, dead_for in (("long-dead", timedelta(hours=2)), ("just-dead", timedelta(seconds=10))):
            await conn.execute(
                replicas.insert().values(
                    replica_id=replica_id,
                    hostname="h",
                    pid=1,
                    started_at=now - dead_for - timedelta(minutes=1),
                    heartbeat_at=now - dead_for,
                    expires_at=now - dead_for,
                )
            )

    await SessionStore(engine).heartbeat_replica("alive", hostname="h", pid=3, lease_seconds=5.0)

    async with engine.connect() as conn:
        left = set((await conn.execute(select(replicas.c.replica_id))).scalars())
    assert left == {"just-dead", "alive"}


async def test_holders__a_dead_replica_holding_only_looks__is_one_to_check(engine: AsyncEngine) -> None:
    """A replica that served only intake sessions holds no session lease and, between calls,
    no call: once its own registration ran out, its looks' leases (30 s) were all it held, and
    nobody asked whether it was gone: its looks waited them out."""
    sessions = SessionStore(engine)
    await sessions.heartbeat_replica("dead", hostname="h", pid=1, lease_seconds=0.3)
    await sessions.request_looks(["sess_1"], intake="webhook")
    assert [claim.session_id for claim in await sessions.claim_looks("dead", 10, 30.0)] == ["sess_1"]
    await asyncio.sleep(0.6)  # its registration ran out; its look's lease runs on

    assert "dead" in await sessions.holders()

    await sessions.retire_replicas({"dead"})
    assert [claim.session_id for claim in await sessions.claim_looks("alive", 10, 30.0)] == ["sess_1"]


async def test_sweep_of_a_replica_found_gone__is_released_at_once(engine: AsyncEngine) -> None:
    """A replica killed mid-sweep held the agent's sweep for its whole lease (60 s at least):
    no other replica swept meanwhile, and a dropped webhook's session waited as long."""
    store = IntakeStore(engine)
    assert await store.claim_sweep("agent_a", "dead", every_seconds=2.0, lease_seconds=60) is not None
    assert await store.sweep_holders() == {"dead"}

    assert await store.release_sweeps({"dead"}) == 1

    assert await store.sweep_holders() == set()
    assert await store.claim_sweep("agent_a", "alive", every_seconds=2.0, lease_seconds=60) is not None
