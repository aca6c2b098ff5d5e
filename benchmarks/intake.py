"""The intake: sessions nobody registered, served by agent through signed webhooks, against
today's watched streams; N sessions x 1 call each, every mode in the same run, on PostgreSQL.

Modes:

- ``webhook, 1 replica``: `toolledger serve` with ``TOOLLEDGER_AGENT_IDS`` (``--agent``),
  ``TOOLLEDGER_LISTEN`` (``--listen``) and ``TOOLLEDGER_WEBHOOK_SECRET``, watching nothing.
- ``webhook, 2 replicas``: two such serve processes on the same PostgreSQL database; the
  sender posts webhooks to them in turn (round robin: webhook i goes to replica i mod 2). Any
  replica may then claim any look: the webhooks are split evenly, the work as the claims fall.
- ``streams, 1 replica``: every session registered with ``SessionStore.watch_new`` (what
  `toolledger sessions watch` does) before serve starts, serve following each one's stream.

The webhooks are posted by this benchmark (``WebhookSender``), signed as the Agents API signs
them (Standard Webhooks, the emulator's own ``sign``), ``SENDERS`` in flight at once: the
emulator's sender makes first attempts one at a time (docs/emulator.md "Webhooks"), so with it
the throughput would be the emulator's round trip, not the intake's. One
``agent.session.action_required`` per session, once the session is waiting on its call (the
emulator's own webhooks are off). The ack is timed by the sender around each POST (a loopback
round trip, this process's event loop included): serve's ``toolledger_webhook_ack_seconds``
histogram is not exposed without the audit API. Webhook to result: from the wall-clock time just
before the POST to the emulator's ``received_at`` (``time.time()`` in the emulator process, on
the same machine) of the call's accepted ``tool_result``. The webhooks go out as one burst of N,
so that latency includes waiting behind the looks asked for before (throughput is the point).

In stream mode the clock starts with the first session's input (the sessions wait idle, each
stream open): the emulator starting each turn is inside that mode's time, not inside the
webhook modes' (their sessions wait at ``requires_action`` before the first webhook).

Calls/s: N over the time from the first webhook (input) sent to the last result received.
RSS per replica (``/proc/<pid>/status``): before the first webhook, once N/5 calls are
submitted, at the end, and the peak (VmHWM).
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import secrets
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path

import httpx2
from openai import AsyncOpenAI, omit
from sqlalchemy import func, select

from benchmarks.ledger_path import fresh_ledger
from benchmarks.report import Figure, percentile
from benchmarks.service import API_KEY, emulator_process, serve_process
from toolledger.domain.states import CallStatus
from toolledger.emulator import EmulatorControl, Script
from toolledger.emulator.webhooks import decode_secret, sign
from toolledger.runtime.webhook_intake import PATH
from toolledger.store.engine import create_engine
from toolledger.store.schema import sessions as sessions_table
from toolledger.store.schema import tool_calls
from toolledger.store.sessions import SessionStore

Progress = Callable[[str], None]
SECRET = "whsec_" + base64.b64encode(b"toolledger-bench-intake-secret!!").decode()
SENDERS = 32
"""Webhooks in flight at once from the sender (and inputs, in stream mode)."""
CREATORS = 32
QUICK_SESSIONS = 50
FULL_SESSIONS = int(os.environ.get("BENCH_INTAKE_SESSIONS", "10000"))
SCRIPT = Script.of_calls([("noop", {})])
ACK_P99_MS = 50.0
RSS_LIMIT_MB = 250.0


@dataclass
class ModeResult:
    name: str
    replicas: int
    sessions: int
    calls_per_second: float
    ack_ms: list[float] = field(default_factory=list)
    to_result_ms: list[float] = field(default_factory=list)
    rss_mb: list[dict[str, float]] = field(default_factory=list)
    """Per replica: ``before``, ``at_fifth``, ``end``, ``peak``."""
    cpu_ms_per_call: float = float("nan")
    """serve's CPU time (user + system, every replica) over the timed window, per call: what
    the machine's other load changes least."""


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _memory(pid: int) -> tuple[float, float]:
    """VmRSS and VmHWM (the peak) in MB."""
    status = Path(f"/proc/{pid}/status").read_text()
    found = {
        name: int(match.group(1)) / 1024
        for name in ("VmRSS", "VmHWM")
        if (match := re.search(rf"{name}:\s+(\d+) kB", status))
    }
    return found.get("VmRSS", float("nan")), found.get("VmHWM", float("nan"))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class WebhookSender:
    """Posts signed ``agent.session.action_required`` webhooks, as the Agents API would."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self.key = decode_secret(SECRET)
        self.http = httpx2.AsyncClient(
            timeout=30.0, limits=httpx2.Limits(max_connections=SENDERS, max_keepalive_connections=SENDERS)
        )
        self.acks: list[float] = []
        self.sent_at: dict[str, float] = {}

    async def close(self) -> None:
        await self.http.aclose()

    async def send(self, index: int, session_id: str) -> None:
        event = {
            "id": f"evt_{secrets.token_hex(12)}",
            "object": "event",
            "created_at": int(time.time()),
            "type": "agent.session.action_required",
            "data": {"id": session_id, "required_action": {"type": "function_call"}},
        }
        body = json.dumps(event, separators=(",", ":")).encode()
        webhook_id = f"wh_{secrets.token_hex(16)}"
        stamp = int(time.time())
        headers = {
            "content-type": "application/json",
            "webhook-id": webhook_id,
            "webhook-timestamp": str(stamp),
            "webhook-signature": sign(self.key, webhook_id, stamp, body),
        }
        url = self.urls[index % len(self.urls)]
        self.sent_at[session_id] = time.time()
        started = time.perf_counter()
        answer = await self.http.post(url, content=body, headers=headers)
        self.acks.append((time.perf_counter() - started) * 1000)
        if answer.status_code != 200 or answer.json() != {"taken": True}:
            raise RuntimeError(f"webhook for {session_id} answered {answer.status_code}: {answer.text}")

    async def send_all(self, session_ids: list[str]) -> None:
        gate = asyncio.Semaphore(SENDERS)

        async def one(index: int, session_id: str) -> None:
            async with gate:
                await self.send(index, session_id)

        await asyncio.gather(*(one(index, session_id) for index, session_id in enumerate(session_ids)))


async def _new_agent(client: AsyncOpenAI) -> str:
    return str((await client.beta.agents.create(model="emulated")).id)


async def _new_sessions(client: AsyncOpenAI, agent_id: str, count: int, *, start: bool) -> list[str]:
    encoded = SCRIPT.model_dump_json()
    gate = asyncio.Semaphore(CREATORS)

    async def one() -> str:
        async with gate:
            created = await client.beta.agents.sessions.create(
                agent_id=agent_id,
                environment={"type": "none"},
                metadata={"emulator_script": encoded},
                input="go" if start else omit,
            )
            return str(created.id)

    return list(await asyncio.gather(*(one() for _ in range(count))))


async def _all_waiting(client: AsyncOpenAI, agent_id: str, count: int) -> None:
    """Until every session of the agent waits on its call (listed, 100 a page)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        waiting = 0
        async for session in client.beta.agents.sessions.list(agent_id=agent_id, limit=100):
            waiting += session.status == "requires_action"
        if waiting >= count:
            return
        await asyncio.sleep(0.5)
    raise TimeoutError("the sessions did not all reach requires_action")


class Progression:
    """Submitted calls in the ledger, polled over one connection; RSS sampled at N/5."""

    def __init__(self, database_url: str) -> None:
        self.engine = create_engine(database_url)

    async def submitted(self) -> int:
        async with self.engine.connect() as conn:
            query = (
                select(func.count())
                .select_from(tool_calls)
                .where(tool_calls.c.status == CallStatus.SUBMITTED.value)
            )
            return int((await conn.execute(query)).scalar_one())

    async def owned(self) -> int:
        async with self.engine.connect() as conn:
            query = (
                select(func.count()).select_from(sessions_table).where(sessions_table.c.owner.is_not(None))
            )
            return int((await conn.execute(query)).scalar_one())

    async def wait(
        self,
        total: int,
        replicas: list[subprocess.Popen[bytes]],
        logs: list[Path],
        rss: list[dict[str, float]],
        within: float,
    ) -> None:
        deadline = time.monotonic() + within
        fifth = max(1, total // 5)
        while True:
            done = await self.submitted()
            if done >= fifth and "at_fifth" not in rss[0]:
                for process, sample in zip(replicas, rss, strict=True):
                    sample["at_fifth"] = _memory(process.pid)[0]
            if done >= total:
                return
            for process, log in zip(replicas, logs, strict=True):
                if process.poll() is not None:
                    raise RuntimeError(f"serve exited: {log.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{done} of {total} calls submitted after {within:.0f}s: {logs[0].read_text()[-2000:]}"
                )
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        await self.engine.dispose()


async def _to_result(control: EmulatorControl, sent_at: dict[str, float]) -> tuple[list[float], float]:
    """Per session, ms from ``sent_at`` to its accepted result; and the last result's time."""
    receipts = await asyncio.to_thread(control.tool_results)
    received = {r.session_id: r.received_at for r in receipts if r.outcome == "accepted"}
    missing = set(sent_at) - set(received)
    if missing:
        raise RuntimeError(f"{len(missing)} session(s) without an accepted result")
    latencies = [(received[session_id] - at) * 1000 for session_id, at in sent_at.items()]
    return latencies, max(received[session_id] for session_id in sent_at)


async def _ready(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    """Until the intake answers (a GET: 405)."""
    deadline = time.monotonic() + 60
    async with httpx2.AsyncClient(timeout=2.0) as http:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"serve exited: {log.read_text()[-2000:]}")
            try:
                await http.get(url)
                return
            except httpx2.HTTPError:
                await asyncio.sleep(0.1)
    raise TimeoutError(f"the intake at {url} did not answer")


async def webhook_mode(
    database_url: str, base_url: str, count: int, replicas: int, workdir: Path, progress: Progress
) -> ModeResult:
    await asyncio.to_thread(fresh_ledger, database_url)
    control = EmulatorControl(base_url)
    await asyncio.to_thread(control.reset)
    name = f"webhook, {replicas} replica{'s' if replicas > 1 else ''}"
    async with (
        AsyncOpenAI(base_url=base_url, api_key=API_KEY, max_retries=5) as client,
        AsyncExitStack() as stack,
    ):
        agent_id = await _new_agent(client)
        processes: list[subprocess.Popen[bytes]] = []
        logs: list[Path] = []
        urls: list[str] = []
        for number in range(replicas):
            port = _free_port()
            log = workdir / f"serve-intake-{replicas}r-{number}.log"
            process = await stack.enter_async_context(
                serve_process(
                    database_url,
                    base_url,
                    log,
                    TOOLLEDGER_AGENT_IDS=agent_id,
                    TOOLLEDGER_LISTEN=f"127.0.0.1:{port}",
                    TOOLLEDGER_WEBHOOK_SECRET=SECRET,
                    # The sweep runs at start-up (the agent has no session yet) and not again:
                    # every look measured here is a webhook's.
                    TOOLLEDGER_SWEEP_SECONDS="3600",
                )
            )
            url = f"http://127.0.0.1:{port}{PATH}"
            await _ready(url, process, log)
            processes.append(process)
            logs.append(log)
            urls.append(url)
        await asyncio.sleep(1.0)  # the start-up sweep of the (still empty) agent done
        created = time.perf_counter()
        ids = await _new_sessions(client, agent_id, count, start=True)
        await _all_waiting(client, agent_id, count)
        progress(f"{name}: {count:,} sessions created and waiting ({time.perf_counter() - created:.1f}s)")
        rss = [{"before": _memory(process.pid)[0]} for process in processes]
        sender = WebhookSender(urls)
        progression = Progression(database_url)
        cpu = sum(_cpu_seconds(process.pid) for process in processes)
        started = time.time()
        try:
            sending = asyncio.create_task(sender.send_all(ids))
            await progression.wait(count, processes, logs, rss, within=max(120.0, count / 5))
            await sending
        finally:
            await sender.close()
            await progression.close()
        cpu = sum(_cpu_seconds(process.pid) for process in processes) - cpu
        for process, sample in zip(processes, rss, strict=True):
            sample["end"], sample["peak"] = _memory(process.pid)
        latencies, last = await _to_result(control, sender.sent_at)
    await asyncio.to_thread(control.close)
    rate = count / (last - started)
    return ModeResult(name, replicas, count, rate, sender.acks, latencies, rss, cpu * 1000 / count)


async def stream_mode(
    database_url: str, base_url: str, count: int, workdir: Path, progress: Progress
) -> ModeResult:
    await asyncio.to_thread(fresh_ledger, database_url)
    control = EmulatorControl(base_url)
    await asyncio.to_thread(control.reset)
    async with AsyncOpenAI(base_url=base_url, api_key=API_KEY, max_retries=5) as client:
        agent_id = await _new_agent(client)
        ids = await _new_sessions(client, agent_id, count, start=False)
        engine = create_engine(database_url)
        try:
            await SessionStore(engine).watch_new(ids)
        finally:
            await engine.dispose()
        log = workdir / "serve-intake-streams.log"
        async with serve_process(database_url, base_url, log) as process:
            progression = Progression(database_url)
            try:
                following = time.perf_counter()
                deadline = time.monotonic() + max(120.0, count / 20)
                while await progression.owned() < count:
                    if process.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"serve did not take every session: {log.read_text()[-2000:]}")
                    await asyncio.sleep(0.2)
                await asyncio.sleep(1.0)  # the last streams opening
                progress(
                    f"streams: serve follows {count:,} sessions ({time.perf_counter() - following:.1f}s)"
                )
                rss = [{"before": _memory(process.pid)[0]}]
                sent_at: dict[str, float] = {}
                gate = asyncio.Semaphore(SENDERS)

                async def start(session_id: str) -> None:
                    async with gate:
                        sent_at[session_id] = time.time()
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

                cpu = _cpu_seconds(process.pid)
                started = time.time()
                starting = asyncio.gather(*(start(session_id) for session_id in ids))
                await progression.wait(count, [process], [log], rss, within=max(120.0, count / 5))
                await starting
                cpu = _cpu_seconds(process.pid) - cpu
            finally:
                await progression.close()
            rss[0]["end"], rss[0]["peak"] = _memory(process.pid)
        latencies, last = await _to_result(control, sent_at)
    await asyncio.to_thread(control.close)
    rate = count / (last - started)
    return ModeResult("streams, 1 replica", 1, count, rate, [], latencies, rss, cpu * 1000 / count)


def _rss_text(result: ModeResult) -> str:
    fifth = max(1, result.sessions // 5)
    return "; ".join(
        f"replica {number + 1}: {sample['before']:.0f} MB before, "
        f"{sample.get('at_fifth', float('nan')):.0f} at {fifth:,} calls, "
        f"{sample['end']:.0f} at {result.sessions:,}, peak {sample['peak']:.0f}"
        for number, sample in enumerate(result.rss_mb)
    )


def figures(results: list[ModeResult]) -> list[Figure]:
    """Every figure beside its target; the ratios are between modes of this one run."""
    by_name = {result.name: result for result in results}
    one, two, streams = (
        by_name["webhook, 1 replica"],
        by_name["webhook, 2 replicas"],
        by_name["streams, 1 replica"],
    )
    count = one.sessions
    shape = f"{count:,} sessions x 1 call"
    cores = os.cpu_count() or 1
    shared = f"{cores} cores shared by the emulator, PostgreSQL, the sender and serve"
    out: list[Figure] = []
    for result in (one, two):
        p50, p99 = percentile(result.ack_ms, 0.5), percentile(result.ack_ms, 0.99)
        out.append(
            Figure(
                "intake",
                f"{result.name}: webhook ack p99, {shape}",
                "ms",
                p99,
                p50,
                "p50",
                f"<= {ACK_P99_MS:.0f} ms",
                p99 <= ACK_P99_MS,
                note=f"timed by the sender around each POST, {SENDERS} in flight; {shared}",
            )
        )
    for result in (one, two, streams):
        p50, p99 = percentile(result.to_result_ms, 0.5), percentile(result.to_result_ms, 0.99)
        start = "webhook" if result.ack_ms else "input"
        out.append(
            Figure(
                "intake",
                f"{result.name}: {start} to result p99, {shape}",
                "ms",
                p99,
                p50,
                "p50",
                "(informational)",
                None,
                note=f"one burst of {count:,}: includes waiting behind earlier sessions; "
                "the emulator's received_at (wall clock) minus the sender's",
            )
        )
    out.append(
        Figure(
            "intake",
            f"webhook vs streams, 1 replica each, {shape}",
            "calls/s",
            one.calls_per_second,
            streams.calls_per_second,
            "streams, 1 replica",
            ">= 1.0x",
            one.calls_per_second >= streams.calls_per_second,
            note="streams: the clock starts at the first input (turn start inside it); webhooks: at the "
            f"first webhook (sessions already waiting); {shared}",
        )
    )
    out.append(
        Figure(
            "intake",
            f"webhook, 2 replicas vs 1, PostgreSQL, {shape}",
            "calls/s",
            two.calls_per_second,
            one.calls_per_second,
            "1 replica",
            ">= 1.6x" if cores >= 4 else ">= 1.6x (needs the cores)",
            two.calls_per_second >= 1.6 * one.calls_per_second if cores >= 4 else None,
            note=f"webhooks sent to the replicas in turn; {shared}: a second replica has no core of its own",
        )
    )
    for result in (one, two):
        out.append(
            Figure(
                "intake",
                f"{result.name}: serve CPU per call, {shape}",
                "ms",
                result.cpu_ms_per_call,
                streams.cpu_ms_per_call,
                "streams, 1 replica",
                "(informational)",
                None,
                note="user + system time of every replica over the timed window, per call: "
                "less sensitive than calls/s to the machine's other load",
            )
        )
    for result in (one, two, streams):
        peak = max(sample["peak"] for sample in result.rss_mb)
        fifth = max(sample.get("at_fifth", float("nan")) for sample in result.rss_mb)
        end = max(sample["end"] for sample in result.rss_mb)
        webhook = bool(result.ack_ms)
        out.append(
            Figure(
                "intake",
                f"{result.name}: RSS per replica, peak, {shape}",
                "MB",
                peak,
                fifth,
                f"MB at {max(1, count // 5):,} calls",
                f"<= {RSS_LIMIT_MB:.0f} MB, flat" if webhook else "(baseline: streams)",
                (peak <= RSS_LIMIT_MB and end <= 1.1 * fifth + 10) if webhook else None,
                note=_rss_text(result),
            )
        )
    return out


async def run(database_url: str, quick: bool, progress: Progress) -> list[Figure]:
    count = QUICK_SESSIONS if quick else FULL_SESSIONS
    results: list[ModeResult] = []
    with tempfile.TemporaryDirectory(prefix="toolledger-bench-intake-") as directory:
        workdir = Path(os.environ.get("BENCH_INTAKE_LOGS") or directory)
        async with emulator_process() as base_url:
            for replicas in (1, 2):
                result = await webhook_mode(database_url, base_url, count, replicas, workdir, progress)
                progress(_said(result))
                results.append(result)
            result = await stream_mode(database_url, base_url, count, workdir, progress)
            progress(_said(result))
            results.append(result)
    return figures(results)


def _said(result: ModeResult) -> str:
    ack = (
        f", ack p50/p99 {percentile(result.ack_ms, 0.5):.1f}/{percentile(result.ack_ms, 0.99):.1f} ms"
        if result.ack_ms
        else ""
    )
    return (
        f"{result.name}: {result.calls_per_second:,.0f} calls/s{ack}, "
        f"serve CPU {result.cpu_ms_per_call:.1f} ms/call, to result p50/p99 "
        f"{percentile(result.to_result_ms, 0.5):,.0f}/{percentile(result.to_result_ms, 0.99):,.0f} ms; "
        + _rss_text(result)
    )
