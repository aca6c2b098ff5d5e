"""The database's clock, as the leases, sweeps and clean-ups read it: times before now too.

On SQLite a time in the past was NULL ('+-3600 seconds' is no modifier), so a comparison with
it was never true: a sweep was never due again, dead replicas' rows were never cleaned up."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy import Float, bindparam, select

from toolledger.store.engine import create_engine, utc_after, utc_now, write_transaction
from toolledger.store.schema import replicas
from toolledger.store.sessions import SessionStore


async def test_utc_after__past_and_future__bracket_now(database_url: str) -> None:
    engine = create_engine(database_url)
    try:
        async with engine.connect() as conn:
            before, now, after = (
                await conn.execute(select(utc_after(-3600.0), utc_now(), utc_after(0.5)))
            ).one()
    finally:
        await engine.dispose()

    assert before is not None
    assert after is not None
    assert timedelta(seconds=3599) < now - before < timedelta(seconds=3601)
    assert timedelta(seconds=0.4) < after - now < timedelta(seconds=0.6)


async def test_utc_after__no_seconds__is_no_time(database_url: str) -> None:
    """A call recorded for approval without a timeout has no deadline (NULL), not one now."""
    engine = create_engine(database_url)
    try:
        async with engine.connect() as conn:
            none = (await conn.execute(select(utc_after(bindparam("s", None, type_=Float))))).scalar_one()
    finally:
        await engine.dispose()

    assert none is None


async def test_heartbeat__a_replica_dead_for_over_an_hour__is_cleaned_up(database_url: str) -> None:
    engine = create_engine(database_url)
    try:
        long_ago = datetime.now(UTC) - timedelta(hours=2)
        async with write_transaction(engine) as conn:
            await conn.execute(
                replicas.insert().values(
                    replica_id="dead",
                    hostname="h",
                    pid=1,
                    started_at=long_ago,
                    heartbeat_at=long_ago,
                    expires_at=long_ago,
                )
            )
        await SessionStore(engine).heartbeat_replica("alive", hostname="h", pid=2, lease_seconds=30)
        async with engine.connect() as conn:
            left = set((await conn.execute(select(replicas.c.replica_id))).scalars())
    finally:
        await engine.dispose()

    assert left == {"alive"}
