"""The ledger's own path, with the Agents API out of the way: what record+claim, store result
and mark submitted (three commits per call) cost, against the database doing the same three
commits itself (pgbench), against no ledger at all, against a peer (DBOS), and as the ledger
grows."""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import re
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks.audit import connect, libpq_url, recreate_database, seed
from benchmarks.report import Figure, median, percentile
from toolledger.domain.keys import CallKey
from toolledger.gateway.agents import AgentsGateway
from toolledger.runtime.registry import ToolRegistry
from toolledger.runtime.tool_ledger import ToolLedger
from toolledger.settings import Settings
from toolledger.store import migrate

Progress = Callable[[str], None]

registry = ToolRegistry()


@registry.tool(effect="at_most_once")
def noop() -> str:
    """Does nothing: the benchmark measures what surrounds a handler."""
    return "ok"


class NoNetworkGateway(AgentsGateway):
    """The Agents API taken out of the measurement: every submission is accepted at once."""

    def __init__(self) -> None:
        pass

    async def close(self) -> None:
        return None

    async def submit_tool_results(self, *args: Any, **kwargs: Any) -> None:
        return None


def _settings(url: str, concurrency: int, batching: bool = True) -> Settings:
    return Settings(
        database_url=url,
        batching=batching,
        worker_id="bench",
        database_pool_size=max(5, concurrency),
        database_max_overflow=4,
        max_concurrent_calls=max(64, concurrency),
    )


def fresh_ledger(url: str) -> None:
    recreate_database(url)
    migrate.upgrade(url)


async def ledger_calls_per_second(
    url: str, concurrency: int, seconds: float, *, batching: bool = True
) -> tuple[float, list[float]]:
    """Calls through ``ToolLedger.handle`` (record+claim, run, store, submit, mark submitted)
    by ``concurrency`` tasks for ``seconds``; with each call's latency. ``batching``: writes
    made at the same moment share commits (the default), or each is a commit of its own."""
    latencies: list[float] = []
    run = uuid.uuid4().hex[:8]
    async with ToolLedger(
        registry, _settings(url, concurrency, batching), gateway=NoNetworkGateway(), auto_migrate=False
    ) as ledger:
        # Warm the pool and the statement caches before the clock starts.
        await asyncio.gather(
            *(_one(ledger, f"warm{w}", run, i) for w in range(concurrency) for i in range(3))
        )
        deadline = time.perf_counter() + seconds

        async def worker(number: int) -> int:
            done = 0
            while time.perf_counter() < deadline:
                started = time.perf_counter()
                await _one(ledger, f"s{number}", run, done)
                latencies.append(time.perf_counter() - started)
                done += 1
            return done

        started = time.perf_counter()
        counts = await asyncio.gather(*(worker(w) for w in range(concurrency)))
        elapsed = time.perf_counter() - started
    return sum(counts) / elapsed, latencies


async def _one(ledger: ToolLedger, session: str, run: str, index: int) -> None:
    report = await ledger.handle(
        f"sess_{run}_{session}",
        {"turn_id": "turn_1", "call_id": f"call_{index}", "name": "noop", "arguments": "{}"},
    )
    if not report.submitted:
        raise RuntimeError(f"a benchmark call was not submitted: {report}")


PGBENCH_SCHEMA = """
DROP TABLE IF EXISTS pgb_events; DROP TABLE IF EXISTS pgb_calls;
CREATE TABLE pgb_calls (
  id bigserial PRIMARY KEY, session_id text NOT NULL, turn_id text NOT NULL, call_id text NOT NULL,
  tool_name text NOT NULL, effect_class text NOT NULL, status text NOT NULL, arguments text NOT NULL,
  arguments_sha256 text NOT NULL, result text, lease_owner text, lease_token integer,
  lease_expires_at timestamptz, attempt_count integer NOT NULL DEFAULT 1,
  created_at timestamptz NOT NULL DEFAULT now(), finished_at timestamptz, submitted_at timestamptz,
  UNIQUE (session_id, turn_id, call_id));
CREATE INDEX ON pgb_calls (status);
CREATE TABLE pgb_events (
  id bigserial PRIMARY KEY, call_ref bigint NOT NULL REFERENCES pgb_calls (id),
  at timestamptz NOT NULL DEFAULT now(), actor text NOT NULL, kind text NOT NULL,
  from_status text, to_status text, reason text);
CREATE INDEX ON pgb_events (call_ref, id);
"""

# pgbench reads ':name' as a variable anywhere, quotes included: the stored payload's colons
# are made by chr(58).
PGBENCH_SCRIPT = r"""
\set n random(1, 9000000000000000000)
BEGIN;
INSERT INTO pgb_calls (session_id, turn_id, call_id, tool_name, effect_class, status, arguments,
  arguments_sha256, lease_owner, lease_token, lease_expires_at)
  VALUES ('sess_' || :client_id::text, 'turn_1', 'call_' || :n::text, 'noop', 'at_most_once', 'running', '{}',
  md5(:n::text), 'bench', 1, now() + interval '30 seconds') RETURNING id \gset
INSERT INTO pgb_events (call_ref, actor, kind, to_status, reason)
  VALUES (:id::bigint, 'bench', 'transition', 'running', 'recorded and claimed');
COMMIT;
BEGIN;
UPDATE pgb_calls SET status = 'succeeded', finished_at = now(), lease_token = NULL,
  result = replace('{"type"=>"agent.session.input.tool_result","success"=>true,"output"=>"ok"}',
    '=>', chr(58))
  WHERE id = :id::bigint AND lease_token = 1 AND status = 'running';
INSERT INTO pgb_events (call_ref, actor, kind, from_status, to_status, reason)
  VALUES (:id::bigint, 'bench', 'transition', 'running', 'succeeded', 'handler returned');
COMMIT;
BEGIN;
UPDATE pgb_calls SET status = 'submitted', submitted_at = now()
  WHERE id = :id::bigint AND status = 'succeeded';
INSERT INTO pgb_events (call_ref, actor, kind, from_status, to_status, reason)
  VALUES (:id::bigint, 'bench', 'submission', 'succeeded', 'submitted', 'result accepted');
COMMIT;
"""


def pgbench_calls_per_second(url: str, concurrency: int, seconds: float) -> float:
    """The same three commits per call, written by pgbench itself: the database's ceiling."""
    with connect(url) as conn:
        conn.execute(PGBENCH_SCHEMA)
    with tempfile.TemporaryDirectory() as workdir:
        script = Path(workdir) / "call.sql"
        script.write_text(PGBENCH_SCRIPT, encoding="utf-8")
        done = subprocess.run(
            [
                "pgbench",
                "-n",
                "-c",
                str(concurrency),
                "-j",
                str(concurrency),
                "-T",
                str(max(1, round(seconds))),
                "-M",
                "extended",
                "-f",
                str(script),
                libpq_url(url),
            ],
            capture_output=True,
            text=True,
            timeout=seconds * 4 + 60,
            check=False,
        )
    match = re.search(r"tps = ([\d.]+) \(without initial connection time\)", done.stdout)
    if done.returncode != 0 or match is None:
        raise RuntimeError(f"pgbench failed: {done.stdout[-500:]} {done.stderr[-1000:]}")
    return float(match.group(1))


async def direct_latencies(calls: int) -> list[float]:
    """The same no-op tool called as the SDK's runner calls it: no ledger around it."""
    tool = registry.get("noop")
    assert tool is not None
    latencies = []
    for _ in range(calls):
        started = time.perf_counter()
        await asyncio.to_thread(tool.function_tool._call, {}, lambda _stage: None)
        latencies.append(time.perf_counter() - started)
    return latencies


def dbos_calls_per_second(url: str, concurrency: int, seconds: float) -> float:
    """DBOS Transact: one workflow of one step per call, on the same PostgreSQL."""
    # An optional peer, not a dependency: typed as Any so the project type-checks without it.
    DBOS: Any = importlib.import_module("dbos").DBOS
    DBOS(config={"name": "toolledger-bench", "system_database_url": libpq_url(url)})

    def noop(value: int) -> int:
        return value

    noop_step = DBOS.step()(noop)

    def workflow(value: int) -> int:
        return int(noop_step(value))

    one_step = DBOS.workflow()(workflow)

    DBOS.launch()
    try:
        for warm in range(3 * concurrency):
            one_step(warm)
        deadline = time.perf_counter() + seconds
        counts = [0] * concurrency

        def worker(number: int) -> None:
            while time.perf_counter() < deadline:
                one_step(number)
                counts[number] += 1

        threads = [threading.Thread(target=worker, args=(n,)) for n in range(concurrency)]
        started = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return sum(counts) / (time.perf_counter() - started)
    finally:
        DBOS.destroy()


async def growth_costs(url: str, calls: int, samples: int) -> tuple[float, float]:
    """Median ms of a new call's whole ledger path, and of a lookup by key, with ``calls``
    finished calls already in the ledger."""
    run = uuid.uuid4().hex[:8]
    async with ToolLedger(
        registry, _settings(url, 1), gateway=NoNetworkGateway(), auto_migrate=False
    ) as ledger:
        for index in range(20):
            await _one(ledger, "warm", run, index)
        writes = []
        for index in range(samples):
            started = time.perf_counter()
            await _one(ledger, "grow", run, index)
            writes.append(time.perf_counter() - started)
        keys = [CallKey(f"sess_{run}_grow", "turn_1", f"call_{index}") for index in range(samples)]
        reads = []
        for key in keys:
            started = time.perf_counter()
            found = await ledger.store.get(key)
            reads.append(time.perf_counter() - started)
            assert found is not None
    return median(writes) * 1000, median(reads) * 1000


async def run(
    url: str, quick: bool, progress: Progress, skip: dict[str, str], parts: set[str]
) -> list[Figure]:
    figures: list[Figure] = []
    seconds = 1.0 if quick else 10.0
    concurrencies = (1, 4) if quick else (1, 4, 16)

    # 2. The ledger's ceiling against the database's, same server, same concurrency (the
    # ledger's rates are the peer comparison's too, and concurrency 1 gives the latencies).
    fresh_ledger(url)
    ledger_rates: dict[int, float] = {}
    latencies: list[float] = []
    unbatched_latencies: list[float] = []
    for concurrency in concurrencies:
        rate, measured = await ledger_calls_per_second(url, concurrency, seconds)
        ledger_rates[concurrency] = rate
        if concurrency == 1:
            latencies = measured
            # A lone call must not get slower for batching: the same path, each write alone.
            _rate, unbatched_latencies = await ledger_calls_per_second(url, 1, seconds, batching=False)
        if "ceiling" not in parts:
            continue
        unbatched, _ = await ledger_calls_per_second(url, concurrency, seconds, batching=False)
        database_rate = await asyncio.to_thread(pgbench_calls_per_second, url, concurrency, seconds)
        progress(
            f"ledger path at {concurrency}: {rate:,.0f} calls/s batched, {unbatched:,.0f} unbatched; "
            f"pgbench {database_rate:,.0f}"
        )
        figures.append(
            Figure(
                "ceiling",
                f"ledger path, {concurrency} at once, each write alone",
                "calls/s",
                unbatched,
                database_rate,
                "pgbench",
                "(baseline of batching)",
                None,
            )
        )
        figures.append(
            Figure(
                "ceiling",
                f"ledger path, {concurrency} at once",
                "calls/s",
                rate,
                database_rate,
                "pgbench",
                ">= 0.5x",
                rate >= 0.5 * database_rate,
            )
        )

    # 3. Added latency per call, against the same tool called without a ledger.
    direct = await direct_latencies(200 if quick else 2000)
    added_p50 = (median(latencies) - median(direct)) * 1000
    added_p99 = (percentile(latencies, 0.99) - percentile(direct, 0.99)) * 1000
    figures.append(
        Figure(
            "latency",
            "added p50",
            "ms",
            added_p50,
            median(direct) * 1000,
            "ms without",
            "<= 2 ms",
            added_p50 <= 2.0,
        )
    )
    figures.append(
        Figure(
            "latency",
            "added p99",
            "ms",
            added_p99,
            percentile(direct, 0.99) * 1000,
            "ms without",
            "<= 10 ms",
            added_p99 <= 10.0,
        )
    )
    for name, quantile in (("p50", 0.5), ("p99", 0.99)):
        figures.append(
            Figure(
                "latency",
                f"added {name}, each write alone",
                "ms",
                (percentile(unbatched_latencies, quantile) - percentile(direct, quantile)) * 1000,
                percentile(direct, quantile) * 1000,
                "ms without",
                "(baseline of batching)",
                None,
            )
        )

    # 7. A peer: DBOS, one workflow of one step per call, same concurrency, same server.
    if importlib.util.find_spec("dbos") is None:
        skip["peer"] = "DBOS Transact is not installed (pip install dbos)"
    else:
        for concurrency in concurrencies if "peer" in parts else ():
            recreate_database(url)
            peer = await asyncio.to_thread(dbos_calls_per_second, url, concurrency, seconds)
            progress(f"DBOS at {concurrency}: {peer:,.0f} workflows/s")
            figures.append(
                Figure(
                    "peer",
                    f"ledger path vs DBOS, {concurrency} at once",
                    "calls/s",
                    ledger_rates[concurrency],
                    peer,
                    "DBOS",
                    ">= 2.5x",
                    ledger_rates[concurrency] >= 2.5 * peer,
                )
            )

    # 5. Growth: the same costs with more and more finished calls in the ledger.
    if "growth" not in parts:
        return figures
    sizes = (1_000, 5_000) if quick else (10_000, 100_000, 1_000_000)
    samples = 50 if quick else 400
    costs: dict[int, tuple[float, float]] = {}
    for size in sizes:
        fresh_ledger(url)
        await asyncio.to_thread(seed, url, size, datetime.now(UTC), lambda _line: None)
        costs[size] = await growth_costs(url, size, samples)
        progress(
            f"growth at {size:,} calls: call path {costs[size][0]:.2f} ms, lookup {costs[size][1]:.2f} ms"
        )
    smallest, largest = sizes[0], sizes[-1]
    for index, what in ((0, "a call's path (record..submitted)"), (1, "lookup by key")):
        figures.append(
            Figure(
                "growth",
                f"{what} at {largest:,} vs {smallest:,} calls",
                "ms",
                costs[largest][index],
                costs[smallest][index],
                f"ms at {smallest:,}",
                "<= 1.2x",
                costs[largest][index] <= 1.2 * costs[smallest][index],
            )
        )
    return figures
