"""R17, migrations under load: the newest index migration runs on a PostgreSQL ledger of
100,000 calls, under ``lock_timeout=2s``, while a worker keeps recording, finishing and
submitting calls. The upgrade succeeds and the worker is never held up for long: the
indexes are built CONCURRENTLY, so no write waits for a whole index build.

The worker is today's code, so the ledger starts at the newest revision it can write to
(``BEFORE_INDEXES``): first 0002 (0003's audit indexes), now 0005 (0006's open-calls index;
0005 builds its own indexes again the same way)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from urllib.parse import quote

import pytest
from sqlalchemy import create_engine as create_sync_engine
from sqlalchemy import pool, text

from tests.support.databases import PostgresTemplate, with_later_columns, without_later_columns
from toolledger.domain.keys import CallKey
from toolledger.domain.results import succeeded
from toolledger.domain.states import CallStatus, EffectClass
from toolledger.store import migrate
from toolledger.store.engine import create_engine, sync_url
from toolledger.store.ledger import LedgerStore

SEEDED = 100_000
BEFORE_INDEXES = "0005"
UNDER_LOAD_TO = "0008"
"""The last revision before those that add a column today's store writes."""
# A plain CREATE INDEX (in the migration's transaction) holds writes back for the whole build:
# measured, one call's writes waited 0.78 s of a 0.80 s upgrade; built CONCURRENTLY the slowest
# took 0.026 s of 1.37 s. A share of the upgrade's time tells them apart on any machine.
SLOWEST_WRITE_SHARE = 0.5

SEED_SQL = """
INSERT INTO tool_calls (
    session_id, turn_id, call_id, tool_name, arguments, arguments_sha256, status, effect_class,
    idempotency_key, attempt_count, lease_token, result, created_at, finished_at, submitted_at,
    confirmed_at, updated_at, submission_count
)
SELECT
    'sess_seed_' || (i / 10), 'turn_' || (i % 3), 'call_' || i, 'tool_' || (i % 30),
    '{"n": ' || i || '}', md5(i::text) || md5(i::text), 'submitted', 'idempotent',
    md5('key' || i), 1, 1, '{"success": true, "output": "ok"}',
    now() - interval '1 day', now() - interval '1 day', now() - interval '1 day',
    now() - interval '1 day', now() - interval '1 day', 1
FROM generate_series(1, :count) AS i
"""


@pytest.fixture
def ledger_at_0002(postgres_template: PostgresTemplate) -> Iterator[str]:
    with postgres_template.clone(migrated=False) as url:
        migrate.upgrade(url, BEFORE_INDEXES)
        engine = create_sync_engine(sync_url(url), poolclass=pool.NullPool)
        try:
            with engine.begin() as conn:
                conn.execute(text(SEED_SQL), {"count": SEEDED})
        finally:
            engine.dispose()
        # The busy worker is today's store: it needs what later revisions add. The upgrade
        # under test stops before those (UNDER_LOAD_TO), then they go the way they came.
        with_later_columns(url)
        yield url


def with_lock_timeout(url: str) -> str:
    separator = "&" if "?" in url else "?"
    return f"{url}{separator}options={quote('-c lock_timeout=2s')}"


async def test_audit_index_migration__100k_calls_and_a_busy_worker__succeeds_without_blocking_writes(
    ledger_at_0002: str,
) -> None:
    engine = create_engine(ledger_at_0002)
    store = LedgerStore(engine, actor="busy-worker")
    upgrading = asyncio.Event()
    done = asyncio.Event()
    write_times: list[float] = []
    during_upgrade = 0

    async def worker() -> None:
        nonlocal during_upgrade
        n = 0
        while not done.is_set():
            key = CallKey("sess_live", "turn_1", f"call_{n}")
            started = time.perf_counter()
            recorded = await store.record(
                key,
                tool_name="noop",
                arguments={"n": n},
                effect_class=EffectClass.IDEMPOTENT,
                lease_seconds=30,
            )
            await store.complete(key, recorded.call.lease_token, succeeded(key, "ok"))
            await store.mark_submitted(key)
            write_times.append(time.perf_counter() - started)
            during_upgrade += upgrading.is_set()
            n += 1

    try:
        working = asyncio.create_task(worker())
        await asyncio.sleep(0.5)
        upgrading.set()
        upgraded_at = time.perf_counter()
        await asyncio.to_thread(migrate.upgrade, with_lock_timeout(ledger_at_0002), UNDER_LOAD_TO)
        upgrade_seconds = time.perf_counter() - upgraded_at
        upgrading.clear()
        await asyncio.sleep(0.3)
        done.set()
        await working

        assert migrate.current_revision(ledger_at_0002) == UNDER_LOAD_TO
        assert during_upgrade > 0, "the worker wrote nothing while the migration ran"
        slowest = max(write_times)
        assert slowest < SLOWEST_WRITE_SHARE * upgrade_seconds, (
            f"a call's writes took {slowest:.2f} s during a {upgrade_seconds:.2f} s upgrade"
        )
        live = await store.for_session("sess_live")
        assert live
        assert all(c.status is CallStatus.SUBMITTED for c in live)
        async with engine.connect() as conn:
            invalid = (
                await conn.execute(text("SELECT count(*) FROM pg_index WHERE NOT indisvalid"))
            ).scalar_one()
        assert invalid == 0, "an index was left invalid"
    finally:
        done.set()
        await engine.dispose()
    without_later_columns(ledger_at_0002)
    migrate.upgrade(ledger_at_0002)
    assert migrate.current_revision(ledger_at_0002) == migrate.head_revision(ledger_at_0002)
