"""The whole service against the emulator (its own process, so neither side shares its CPU
time with it): `toolledger serve` vs the SDK's own tool runner, recovery after a crash, and
the memory of a service watching many sessions."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx2
from openai import AsyncOpenAI, DefaultAsyncHttpxClient, omit
from sqlalchemy import func, select

from benchmarks.ledger_path import fresh_ledger
from benchmarks.report import Figure
from benchmarks.service_tools import SLOW_SECONDS
from toolledger.domain.keys import CallKey
from toolledger.domain.results import succeeded
from toolledger.domain.states import CallStatus, EffectClass
from toolledger.emulator import Script
from toolledger.gateway.agents import KeepAliveTolerantClient
from toolledger.store import migrate
from toolledger.store.engine import create_engine
from toolledger.store.ledger import LedgerStore
from toolledger.store.schema import sessions as sessions_table
from toolledger.store.schema import tool_calls
from toolledger.store.sessions import SessionStore

Progress = Callable[[str], None]
TOOLS = "benchmarks.service_tools:registry"
API_KEY = "sk-bench-not-a-real-key"
ROOT = Path(__file__).resolve().parents[1]
SERVE_LOG_LEVEL = os.environ.get("BENCH_SERVE_LOG", "warning")
"""`debug` shows each call's moments in serve's logs (kept in the run's temporary directory)."""
SERVE_PROFILE = os.environ.get("BENCH_SERVE_PROFILE")
"""A directory: each `serve` runs under `py-spy record` and leaves a flame graph there."""


@asynccontextmanager
async def emulator_process() -> AsyncIterator[str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "toolledger.cli", "emulator", "--port", "0", "--log-level", "error"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        line = await asyncio.to_thread(process.stdout.readline)
        if not line.startswith("http"):
            raise RuntimeError(f"the emulator did not start: {line!r}")
        yield line.strip()
    finally:
        process.terminate()
        process.wait(timeout=20)


@asynccontextmanager
async def serve_process(
    database_url: str,
    base_url: str,
    log: Path,
    *,
    tools: str = TOOLS,
    log_level: str = SERVE_LOG_LEVEL,
    defaults_only: bool = False,
    **environment: str,
) -> AsyncIterator[subprocess.Popen[bytes]]:
    """``defaults_only``: every setting not given here at its default, whatever the caller's
    environment or a ``.env`` file in its directory says (serve then runs in the log's)."""
    inherited = {
        name: value
        for name, value in os.environ.items()
        if not (defaults_only and name.startswith("TOOLLEDGER_"))
    }
    env = {
        **inherited,
        "TOOLLEDGER_DATABASE_URL": database_url,
        "TOOLLEDGER_OPENAI_BASE_URL": base_url,
        "TOOLLEDGER_OPENAI_API_KEY": API_KEY,
        "TOOLLEDGER_LOG_FORMAT": "text",
        # The caller's path after ours: a checkout measured from elsewhere (PYTHONPATH=its src)
        # must run its own toolledger, not the one installed in the virtual environment.
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        **environment,
    }
    env.pop("TOOLLEDGER_CRASH_AT", None)
    sink = log.open("wb")
    command = [
        sys.executable,
        "-m",
        "toolledger.cli",
        "serve",
        "--tools",
        tools,
        "--log-level",
        log_level,
    ]
    process = subprocess.Popen(
        command,
        env=env,
        cwd=log.parent if defaults_only else None,
        stdout=sink,
        stderr=subprocess.STDOUT,
    )
    profiler = None
    try:
        # Inside the try: a profiler that fails to start must not leave serve running (an
        # orphan replica would compete for the next runs' sessions in the same database).
        profiler = _profile(process.pid, log.stem)
        yield process
    finally:
        if process.poll() is None:
            process.terminate()
        try:
            process.wait(timeout=40)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        sink.close()
        if profiler is not None:
            profiler.wait(timeout=60)  # it writes its flame graph once serve has exited


def _profile(pid: int, name: str) -> subprocess.Popen[bytes] | None:
    if not SERVE_PROFILE:
        return None
    output = Path(SERVE_PROFILE) / f"{name}.txt"
    return subprocess.Popen(
        ["py-spy", "record", "--pid", str(pid), "--rate", "200", "--format", "raw", "-o", str(output)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def workload(quick: bool, tool: str = "noop") -> tuple[int, Script, int]:
    """Sessions, their script (steps of parallel calls), calls per session. ``slow``: the
    realistic variant, each tool taking 50 ms, over many more sessions."""
    script = Script.of_calls([(tool, {}), (tool, {})], [(tool, {}), (tool, {})], [(tool, {})])
    if tool == "slow":
        return (10 if quick else 1000), script, 5
    return (5 if quick else 200), script, 5


async def create_sessions(client: AsyncOpenAI, count: int, script: Script, *, start: bool) -> list[str]:
    encoded = script.model_dump_json()
    gate = asyncio.Semaphore(32)

    async def one() -> str:
        async with gate:
            created = await client.beta.agents.sessions.create(
                environment={"type": "none"},
                agent={"model": "emulated"},
                metadata={"emulator_script": encoded},
                input="go" if start else omit,
            )
            return str(created.id)

    return list(await asyncio.gather(*(one() for _ in range(count))))


async def sdk_calls_per_second(base_url: str, count: int, script: Script, calls: int) -> float:
    """The best a user does without toolledger: the SDK's `sessions.stream(tool_handlers=...)`
    per session, every session at once, with AsyncOpenAI (the same tools as serve's)."""

    async def noop(_arguments: dict[str, Any]) -> str:
        return "ok"

    async def slow(_arguments: dict[str, Any]) -> str:
        await asyncio.sleep(SLOW_SECONDS)
        return "ok"

    # The SDK's default pool (1,000 connections) deadlocks with 1,000 sessions streaming at
    # once: every connection holds a stream and no submission gets one. Unbounded, as serve's.
    unbounded = DefaultAsyncHttpxClient(
        limits=httpx2.Limits(max_connections=None, max_keepalive_connections=200)
    )
    # And serve's SSE decoder: the SDK's own turns a keep-alive comment (sent on a stream
    # silent for 15 s, as 1,000 sessions' of 50 ms tools are) into an event with empty data
    # and the turn fails with observation_failed.
    async with KeepAliveTolerantClient(
        base_url=base_url, api_key=API_KEY, max_retries=5, http_client=unbounded
    ) as client:
        ids = await create_sessions(client, count, script, start=False)

        async def one(session_id: str) -> None:
            async with client.beta.agents.sessions.stream(
                session_id, input="go", tool_handlers={"noop": noop, "slow": slow}
            ) as stream:
                await stream.get_final_result()

        started = time.perf_counter()
        await asyncio.gather(*(one(session_id) for session_id in ids))
        return count * calls / (time.perf_counter() - started)


class SubmittedCounter:
    """Counts submitted calls over one open connection: polling must not cost a connect."""

    def __init__(self, database_url: str) -> None:
        self.engine = create_engine(database_url)

    async def count(self) -> int:
        async with self.engine.connect() as conn:
            submitted = tool_calls.c.status == CallStatus.SUBMITTED.value
            query = select(func.count()).select_from(tool_calls).where(submitted)
            return int((await conn.execute(query)).scalar_one())

    async def wait_for(self, total: int, process: subprocess.Popen[bytes], log: Path, within: float) -> None:
        deadline = time.monotonic() + within
        try:
            while await self.count() < total:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"serve did not finish the work: {log.read_text()[-2000:]}")
                await asyncio.sleep(0.01)
        finally:
            await self.engine.dispose()


async def _wait_followed(
    database_url: str, ids: list[str], process: subprocess.Popen[bytes], log: Path
) -> None:
    """Until serve owns every session (it then has each one's event stream open)."""
    engine = create_engine(database_url)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            async with engine.connect() as conn:
                owned = (
                    await conn.execute(
                        select(func.count())
                        .select_from(sessions_table)
                        .where(sessions_table.c.owner.is_not(None))
                    )
                ).scalar_one()
            if owned >= len(ids):
                await asyncio.sleep(1.0)  # the last streams opening
                return
            if process.poll() is not None:
                raise RuntimeError(f"serve exited: {log.read_text()[-2000:]}")
            await asyncio.sleep(0.2)
        raise TimeoutError("serve did not take every session")
    finally:
        await engine.dispose()


async def toolledger_calls_per_second(
    database_url: str,
    base_url: str,
    count: int,
    script: Script,
    calls: int,
    workdir: Path,
    *,
    batching: bool,
    processes: int = 1,
) -> float:
    """`toolledger serve` doing the same work, every call through the ledger."""
    await asyncio.to_thread(_fresh, database_url)
    async with AsyncOpenAI(base_url=base_url, api_key=API_KEY, max_retries=5) as client:
        ids = await create_sessions(client, count, script, start=False)
        await _watch(database_url, ids)
        log = workdir / f"serve-e2e-{time.monotonic_ns()}.log"
        async with serve_process(
            database_url,
            base_url,
            log,
            TOOLLEDGER_BATCHING=_batching(batching),
            TOOLLEDGER_PROCESSES=str(processes),
        ) as process:
            await _wait_followed(database_url, ids, process, log)
            counter = SubmittedCounter(database_url)
            await counter.count()
            started = time.perf_counter()
            gate = asyncio.Semaphore(64)

            async def start(session_id: str) -> None:
                async with gate:
                    await client.beta.agents.sessions.events.create(
                        session_id,
                        events=[
                            {
                                "type": "agent.session.input.message",
                                "input": [
                                    {"role": "user", "content": [{"type": "input_text", "text": "go"}]}
                                ],
                            }
                        ],
                    )

            await asyncio.gather(*(start(session_id) for session_id in ids))
            await counter.wait_for(count * calls, process, log, 300)
            return count * calls / (time.perf_counter() - started)


async def _watch(database_url: str, session_ids: list[str]) -> None:
    engine = create_engine(database_url)
    try:
        await SessionStore(engine).watch_new(session_ids)
    finally:
        await engine.dispose()


def _fresh(database_url: str) -> None:
    if database_url.startswith("sqlite"):
        path = Path(database_url.split("///", 1)[1])
        for suffix in ("", "-wal", "-shm"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)
        migrate.upgrade(database_url)
    else:
        fresh_ledger(database_url)


def _batching(on: bool) -> str:
    """TOOLLEDGER_BATCHING for serve."""
    return "true" if on else "false"


async def recovery(
    database_url: str, base_url: str, quick: bool, workdir: Path, *, batching: bool
) -> tuple[float, float, int]:
    """Stored-but-unsubmitted results (what a SIGKILL between commit and submission leaves),
    resubmitted by a starting `serve`; against the SDK submitting as many results directly."""
    per_session = 10
    count = 10 if quick else int(os.environ.get("BENCH_RECOVERY_SESSIONS", "1000"))
    script = Script.of_calls([("noop", {"n": n}) for n in range(per_session)])
    await asyncio.to_thread(fresh_ledger, database_url)
    async with AsyncOpenAI(base_url=base_url, api_key=API_KEY, max_retries=5) as client:
        ids = await create_sessions(client, count, script, start=True)
        direct_ids = await create_sessions(client, count, script, start=True)
        pending = await _pending(client, ids + direct_ids, per_session)
        engine = create_engine(database_url, pool_size=16)
        try:
            store = LedgerStore(engine, actor="crashed-worker")
            gate = asyncio.Semaphore(16)

            async def stored(session_id: str, action: Any) -> None:
                key = CallKey(session_id, action.turn_id, action.call_id)
                async with gate:
                    recorded = await store.record(
                        key,
                        tool_name="noop",
                        arguments=action.arguments,
                        effect_class=EffectClass.AT_MOST_ONCE,
                        lease_seconds=30,
                    )
                    await store.complete(key, recorded.call.lease_token, succeeded(key, "ok"))

            await asyncio.gather(*(stored(s, a) for s in ids for a in pending[s]))
            await SessionStore(engine).watch_new(ids)
        finally:
            await engine.dispose()

        # The baseline: the same number of results, submitted straight to the API.
        gate = asyncio.Semaphore(64)

        async def submit(session_id: str, action: Any) -> None:
            async with gate:
                await client.beta.agents.sessions.events.create(
                    session_id,
                    events=[
                        {
                            "type": "agent.session.input.tool_result",
                            "turn_id": action.turn_id,
                            "call_id": action.call_id,
                            "success": True,
                            "output": "ok",
                        }
                    ],
                )

        started = time.perf_counter()
        await asyncio.gather(*(submit(s, a) for s in direct_ids for a in pending[s]))
        direct_rate = count * per_session / (time.perf_counter() - started)

    total = count * per_session
    log = workdir / f"serve-recovery-{'batched' if batching else 'one-by-one'}.log"
    counter = SubmittedCounter(database_url)
    await counter.count()
    started = time.perf_counter()
    async with serve_process(database_url, base_url, log, TOOLLEDGER_BATCHING=_batching(batching)) as process:
        await counter.wait_for(total, process, log, 600)
        recovered_rate = total / (time.perf_counter() - started)
    return recovered_rate, direct_rate, total


async def _pending(client: AsyncOpenAI, ids: list[str], per_session: int) -> dict[str, list[Any]]:
    gate = asyncio.Semaphore(32)
    pending: dict[str, list[Any]] = {}

    async def wait(session_id: str) -> None:
        while True:
            async with gate:
                session = await client.beta.agents.sessions.retrieve(session_id)
            actions = [a for a in session.required_actions if a.type == "function_call"]
            if len(actions) == per_session:
                pending[session_id] = actions
                return
            await asyncio.sleep(0.05)

    await asyncio.gather(*(wait(session_id) for session_id in ids))
    return pending


def _rss_megabytes(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    match = re.search(r"VmRSS:\s+(\d+) kB", status)
    return int(match.group(1)) / 1024 if match else float("nan")


async def memory(database_url: str, base_url: str, count: int, workdir: Path) -> float:
    """Resident memory of `serve` following ``count`` idle sessions (0: the baseline)."""
    await asyncio.to_thread(fresh_ledger, database_url)
    async with AsyncOpenAI(base_url=base_url, api_key=API_KEY, max_retries=5) as client:
        ids = await create_sessions(client, count, Script.of_calls(), start=False) if count else []
    await _watch(database_url, ids)
    log = workdir / f"serve-memory-{count}.log"
    async with serve_process(database_url, base_url, log) as process:
        deadline = time.monotonic() + 60
        while "serving" not in log.read_text() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if ids:
            await _wait_followed(database_url, ids, process, log)
        await asyncio.sleep(0.5)
        return _rss_megabytes(process.pid)


def _mode(batching: bool) -> str:
    return "batched" if batching else "unbatched (a commit per write, a request per result)"


async def _end_to_end(
    database_url: str, base_url: str, quick: bool, workdir: Path, progress: Progress
) -> list[Figure]:
    """serve against the SDK's own runner on the same sessions' work: no-op tools (what
    everything around a handler costs), every way of running serve; then the realistic
    variant (tools taking 50 ms, many more sessions) on PostgreSQL, batching on and off."""
    figures: list[Figure] = []
    pg, lite = ("PostgreSQL", database_url), ("SQLite", f"sqlite+aiosqlite:///{workdir / 'e2e.sqlite3'}")
    variants: tuple[tuple[str, tuple[tuple[tuple[str, str], bool, int], ...]], ...] = (
        ("noop", ((pg, True, 1), (pg, False, 1), (pg, True, 2), (lite, True, 1), (lite, False, 1))),
        ("slow", ((pg, True, 1), (pg, False, 1))),
    )
    for tool, runs in variants:
        count, script, calls = workload(quick, tool)
        sdk = await sdk_calls_per_second(base_url, count, script, calls)
        shape = f"{count} sessions x {calls} calls" + (", tools taking 50 ms" if tool == "slow" else "")
        progress(f"SDK runner: {sdk:,.0f} calls/s ({shape})")
        for (name, url), batching, processes in runs:
            ours = await toolledger_calls_per_second(
                url, base_url, count, script, calls, workdir, batching=batching, processes=processes
            )
            mode = _mode(batching) + (f", {processes} processes" if processes > 1 else "")
            progress(f"toolledger serve on {name}, {mode}: {ours:,.0f} calls/s ({shape})")
            floor = 1.0 if name == "PostgreSQL" else 0.8
            figures.append(
                Figure(
                    "e2e",
                    f"serve on {name}, {mode}, {shape}",
                    "calls/s",
                    ours,
                    sdk,
                    "SDK runner",
                    f">= {floor}x" if batching else "(baseline of batching)",
                    ours >= floor * sdk if batching else None,
                )
            )
    return figures


async def run(
    database_url: str, quick: bool, progress: Progress, skip: dict[str, str], parts: set[str]
) -> list[Figure]:
    figures: list[Figure] = []
    with tempfile.TemporaryDirectory(prefix="toolledger-bench-") as directory:
        # Profiling keeps serve's logs beside the profiles.
        workdir = Path(SERVE_PROFILE or directory)
        async with emulator_process() as base_url:
            if "e2e" in parts:
                figures += await _end_to_end(database_url, base_url, quick, workdir, progress)
            if "recovery" in parts:
                for batching in (True, False):
                    recovered, direct, total = await recovery(
                        database_url, base_url, quick, workdir, batching=batching
                    )
                    mode = _mode(batching)
                    progress(
                        f"recovery, {mode}: {total:,} results at {recovered:,.0f}/s "
                        f"(direct SDK: {direct:,.0f}/s)"
                    )
                    figures.append(
                        Figure(
                            "recovery",
                            f"{total:,} stored results resubmitted after a crash, {mode}",
                            "results/s",
                            recovered,
                            direct,
                            "SDK submitting directly",
                            ">= 1.0x" if batching else "(baseline of batching)",
                            recovered >= direct if batching else None,
                            note="timed from the new serve process's start, its start-up included",
                        )
                    )
            if "memory" in parts:
                watched = 20 if quick else 1000
                idle = await memory(database_url, base_url, 0, workdir)
                busy = await memory(database_url, base_url, watched, workdir)
                progress(f"memory: {busy:.0f} MB watching {watched} sessions, {idle:.0f} MB watching none")
                figures.append(
                    Figure(
                        "memory",
                        f"serve RSS watching {watched} sessions",
                        "MB",
                        busy,
                        idle,
                        "MB watching none",
                        "<= 300 MB",
                        busy <= 300,
                    )
                )
    return figures
