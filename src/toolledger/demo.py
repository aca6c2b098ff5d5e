"""`toolledger demo`: a shop's session served through the ledger while its worker is really
killed (SIGKILL) twice, then what happened, from the ledger, the emulator and the "outside
world" the tools changed.

Three `toolledger serve` child processes run one after the other against an in-process
emulator and a SQLite ledger in a temporary directory:

1. armed to die right after the first result is committed (before it is submitted);
2. armed to die inside `charge_card`, after the card is charged, before a result is stored;
3. unarmed: it resubmits, settles the charge through its verify hook, and finishes; the
   refund (over the shop's limit) waits for a person's approval, which the demo gives
   through the CLI (`toolledger calls approve`), as an operator would.

The verdict checks what toolledger promises: every call answered exactly once, no
at-most-once side effect twice, no result lost.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import closing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from openai import AsyncOpenAI
from rich.console import Console
from rich.table import Table

from toolledger.crashpoints import CP_AFTER_RESULT_COMMIT, CP_INSIDE_HANDLER
from toolledger.domain.records import CallEvent, CallRecord
from toolledger.domain.states import CallStatus
from toolledger.emulator import EmulatorServer, Script
from toolledger.runtime.composition import Runtime
from toolledger.settings import Settings
from toolledger.store.ledger import LedgerStore

TOOLS = "toolledger.examples.shop:registry"
SCRIPT = Script.of_calls(
    [("lookup_order", {"order_id": "A1"})],
    [("charge_card", {"order_id": "A1", "cents": 24900}), ("send_receipt", {"order_id": "A1"})],
    [("lookup_order", {"order_id": "B2"}), ("record_refund", {"order_id": "B2", "cents": 8900})],
)
CALLS = 5
# Short leases, so a dead worker's claims and sessions are taken over within the demo.
FAST = {
    "TOOLLEDGER_LEASE_SECONDS": "1.5",
    "TOOLLEDGER_SESSION_LEASE_SECONDS": "1.5",
    "TOOLLEDGER_RECONCILE_INTERVAL_SECONDS": "0.5",
    "TOOLLEDGER_STREAM_BACKOFF_MAX_SECONDS": "0.3",
    "TOOLLEDGER_SHUTDOWN_GRACE_SECONDS": "5",
    "TOOLLEDGER_LOG_FORMAT": "text",
    "TOOLLEDGER_DECISION_POLL_SECONDS": "0.3",
}
APPROVER = "demo"
RUNS = (
    (f"{CP_AFTER_RESULT_COMMIT}@1", "dies right after the first result is stored, before submitting it"),
    (f"{CP_INSIDE_HANDLER}@1", "dies inside charge_card: card charged, no result stored"),
    (None, "runs to the end"),
)
AT_MOST_ONCE = {"at_most_once", "verified"}


class DemoError(Exception):
    """The demo could not run (not: it ran and found a broken promise)."""


@dataclass
class Worker:
    run: int
    crash_at: str | None
    pid: int
    exit_code: int
    killed: bool


@dataclass
class CallSummary:
    tool: str
    arguments: dict[str, Any]
    effect_class: str
    status: str
    side_effects: int
    accepted_results: int
    attempts: int
    story: str
    timeline: list[str] = field(default_factory=list)


@dataclass
class DemoSummary:
    session_id: str
    workers: list[Worker]
    calls: list[CallSummary]
    seconds: float
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


class Progress:
    def __init__(self, console: Console, quiet: bool) -> None:
        self.console = console
        self.quiet = quiet
        self.started = time.monotonic()

    def step(self, text: str) -> None:
        if not self.quiet:
            self.console.print(f"[dim]{time.monotonic() - self.started:5.1f}s[/dim] {text}")


def run_demo(console: Console, *, quiet: bool = False, keep: Path | None = None) -> DemoSummary:
    progress = Progress(console, quiet)
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        return asyncio.run(_demo(keep, progress))
    with tempfile.TemporaryDirectory(prefix="toolledger-demo-") as workdir:
        return asyncio.run(_demo(Path(workdir), progress))


async def _demo(workdir: Path, progress: Progress) -> DemoSummary:
    # examples/ ships as toolledger.examples (see pyproject): not a source folder of its own.
    shop: Any = importlib.import_module("toolledger.examples.shop")

    started = time.monotonic()
    ledger_path = workdir / "ledger.sqlite3"
    database_url = f"sqlite+aiosqlite:///{ledger_path}"
    runtime = Runtime.from_settings(Settings(database_url=database_url))
    await runtime.ensure_schema(migrate=True)
    world = workdir / "world.sqlite3"
    shop.create_world(str(world))
    progress.step(f"ledger: SQLite at {ledger_path}; the shop's outside world: {world.name}")

    with EmulatorServer() as emulator:
        progress.step(f"Agents API emulator at {emulator.base_url}")
        session_id = await _start_session(emulator.base_url)
        async with runtime:
            await runtime.session_store().watch(session_id)
            progress.step(
                f"session {session_id}: 3 steps, 5 calls (lookup_order; charge_card + send_receipt "
                "in parallel; lookup_order + record_refund in parallel); watched"
            )
            environment = {
                **os.environ,
                **FAST,
                "TOOLLEDGER_DATABASE_URL": database_url,
                "TOOLLEDGER_OPENAI_BASE_URL": emulator.base_url,
                "TOOLLEDGER_OPENAI_API_KEY": "sk-demo-not-a-real-key",
                "TOOLLEDGER_DEMO_WORLD": str(world),
            }
            store = runtime.ledger_store(actor="demo")
            workers = []
            for number, (crash_at, meaning) in enumerate(RUNS, start=1):
                workers.append(
                    await _run_worker(
                        number, crash_at, meaning, environment, workdir, store, session_id, progress
                    )
                )
            calls = await store.for_session(session_id)
            events = {call.key: await store.events(call.key) for call in calls}
        received = emulator.control.tool_results(session_id)

    accepted = Counter(r.call_id for r in received if r.outcome == "accepted")
    effects = _effects(world, ledger_path)
    summaries = [
        _summarize(call, events[call.key], effects.get(call.key.call_id, 0), accepted[call.key.call_id])
        for call in sorted(calls, key=lambda c: c.created_at)
    ]
    problems = _problems(summaries, workers)
    return DemoSummary(session_id, workers, summaries, round(time.monotonic() - started, 1), problems)


async def _start_session(base_url: str) -> str:
    async with AsyncOpenAI(base_url=base_url, api_key="sk-demo-not-a-real-key") as client:
        session = await client.beta.agents.sessions.create(
            environment={"type": "none"},
            agent={"model": "emulated"},
            metadata={"emulator_script": SCRIPT.model_dump_json()},
            input="I'd like to pay for order A1 and get B2 refunded, please.",
        )
        return session.id


async def _run_worker(
    number: int,
    crash_at: str | None,
    meaning: str,
    environment: dict[str, str],
    workdir: Path,
    store: LedgerStore,
    session_id: str,
    progress: Progress,
) -> Worker:
    env = dict(environment)
    env.pop("TOOLLEDGER_CRASH_AT", None)
    if crash_at is not None:
        env["TOOLLEDGER_CRASH_AT"] = crash_at
    log = (workdir / f"serve-{number}.log").open("wb")
    # Starting a process takes milliseconds; waiting for it is done off the loop.
    process = subprocess.Popen(  # noqa: ASYNC220, S603 - our own CLI, fixed arguments
        # -P: the current directory is not put on the path, so a `toolledger/` folder there
        # (a clone, say) is not imported instead of the installed package.
        [sys.executable, "-P", "-m", "toolledger.cli", "serve", "--tools", TOOLS],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    progress.step(f"worker {number} (pid {process.pid}): `toolledger serve`, {meaning}")
    try:
        if crash_at is not None:
            code = await asyncio.to_thread(_wait, process, 60.0)
            if code != -signal.SIGKILL:
                raise DemoError(
                    f"worker {number} should have been SIGKILLed, exited {code}: {_tail(log.name)}"
                )
            progress.step(f"[red]worker {number} killed by SIGKILL[/red] (its log: {_last_line(log.name)})")
            return Worker(number, crash_at, process.pid, code, killed=True)
        await _wait_answered(store, session_id, process, log.name, environment, progress)
        progress.step(f"worker {number}: every call answered; stopping it with SIGTERM")
        process.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(_wait, process, 30.0)
        return Worker(number, crash_at, process.pid, code, killed=False)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        log.close()


def _wait(process: subprocess.Popen[bytes], timeout: float) -> int:
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise DemoError(f"`toolledger serve` (pid {process.pid}) did not finish in {timeout:.0f}s") from None


async def _wait_answered(
    store: LedgerStore,
    session_id: str,
    process: subprocess.Popen[bytes],
    log: str,
    environment: dict[str, str],
    progress: Progress,
) -> None:
    deadline = time.monotonic() + 45
    done = {CallStatus.SUBMITTED, CallStatus.ABANDONED}
    while time.monotonic() < deadline:
        calls = await store.for_session(session_id)
        if len(calls) == CALLS and all(call.status in done for call in calls):
            return
        for call in calls:
            if call.status is CallStatus.AWAITING_APPROVAL:
                await asyncio.to_thread(_approve, call, environment, progress)
        if process.poll() is not None:
            raise DemoError(f"`toolledger serve` exited with {process.returncode}: {_tail(log)}")
        await asyncio.sleep(0.1)
    raise DemoError(f"the session was not answered within 45 s: {_tail(log)}")


def _approve(call: CallRecord, environment: dict[str, str], progress: Progress) -> None:
    """What an operator does for a call awaiting approval, unattended: the CLI, by its key and
    the fingerprint of the arguments looked at."""
    progress.step(
        f"{call.tool_name} {call.arguments} awaits approval; the demo approves it: "
        f"`toolledger calls approve {call.key} --sha256 {call.arguments_sha256[:12]}...`"
    )
    command = [sys.executable, "-P", "-m", "toolledger.cli", "calls", "approve", str(call.key)]
    command += ["--sha256", call.arguments_sha256, "--operator", APPROVER]
    command += ["--reason", "approved by the demo script (unattended)"]
    answered = subprocess.run(  # noqa: S603 - our own CLI, fixed arguments
        command, env=environment, capture_output=True, text=True, timeout=30, check=False
    )
    if answered.returncode != 0:
        raise DemoError(f"`toolledger calls approve` failed ({answered.returncode}): {answered.stderr}")
    progress.step(f"approved {call.tool_name} ({APPROVER}): `toolledger serve` runs it now, once")


def _tail(path: str, lines: int = 15) -> str:
    return "\n".join(Path(path).read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])


def _last_line(path: str) -> str:
    return _tail(path, 1).strip()


def _effects(world: Path, ledger_path: Path) -> Counter[str]:
    """How many times each call's side effect really happened, by call id."""
    counts: Counter[str] = Counter()
    with closing(sqlite3.connect(world)) as connection:
        for (call_id,) in connection.execute("SELECT call_id FROM effects"):
            counts[call_id] += 1
    with closing(sqlite3.connect(ledger_path)) as connection:
        try:
            refunds = connection.execute("SELECT call_id FROM shop_refunds").fetchall()
        except sqlite3.OperationalError:  # no refund was ever written: no table either
            refunds = []
    for (call_id,) in refunds:
        counts[call_id] += 1
    return counts


def _summarize(call: CallRecord, events: list[CallEvent], effects: int, accepted: int) -> CallSummary:
    stored_by = next((e.actor for e in events if e.to_status in ("succeeded", "failed")), None)
    submitted_by = next((e.actor for e in events if e.kind == "submission"), None)
    reasons = " ".join(e.reason or "" for e in events)
    approval = next((e for e in events if e.kind == "approval"), None)
    if approval is not None:
        story = f"waited for approval ({approval.actor} approved it through the CLI); ran once"
    elif "verify hook" in reasons:
        story = "killed mid-charge; the verify hook found the charge: not charged again"
    elif stored_by is not None and submitted_by is not None and stored_by != submitted_by:
        story = "stored, then the worker was killed; resubmitted, not re-run"
    elif call.attempt_count > 1:
        story = f"cut off by a kill; re-run ({call.effect_class.value}: safe)"
    else:
        story = "ran once, answered"
    timeline = [
        f"{e.at:%H:%M:%S.%f}"[:12]
        + f"  {e.kind:<11} {(e.from_status or '-') + ' -> ' + (e.to_status or '-'):<24} {e.actor}"
        + (f": {e.reason}" if e.reason else "")
        for e in events
    ]
    return CallSummary(
        tool=call.tool_name,
        arguments=json.loads(call.arguments),
        effect_class=call.effect_class.value,
        status=call.status.value,
        side_effects=effects,
        accepted_results=accepted,
        attempts=call.attempt_count,
        story=story,
        timeline=timeline,
    )


def _problems(calls: list[CallSummary], workers: list[Worker]) -> list[str]:
    problems = []
    if len(calls) != CALLS:
        problems.append(f"{len(calls)} calls in the ledger, expected {CALLS}")
    if [w.killed for w in workers] != [True, True, False]:
        problems.append("the workers were not killed as planned")
    for call in calls:
        name = f"{call.tool}({json.dumps(call.arguments)})"
        if call.status != "submitted":
            problems.append(f"{name} ended {call.status}: its result was lost")
        if call.accepted_results != 1:
            problems.append(f"{name}: {call.accepted_results} results accepted by the API, expected 1")
        if call.effect_class in AT_MOST_ONCE and call.side_effects != 1:
            problems.append(f"{name}: its side effect happened {call.side_effects} times")
    if not any("waited for approval" in call.story for call in calls):
        problems.append("no call waited for a person's approval")
    if not any("verify hook" in call.story for call in calls):
        problems.append("no call was settled by its verify hook")
    if not any("resubmitted" in call.story for call in calls):
        problems.append("no stored result was resubmitted")
    return problems


def print_summary(console: Console, summary: DemoSummary) -> None:
    table = Table(title=f"session {summary.session_id}", show_lines=False)
    for column in ("call", "effect class", "status", "runs", "answers", "what happened"):
        table.add_column(column)
    for call in summary.calls:
        once = call.effect_class in AT_MOST_ONCE
        effects = (
            f"[green]{call.side_effects}[/green]"
            if not once or call.side_effects == 1
            else f"[red]{call.side_effects}[/red]"
        )
        table.add_row(
            f"{call.tool} {' '.join(str(v) for v in call.arguments.values())}",
            call.effect_class,
            call.status,
            effects,
            str(call.accepted_results),
            call.story,
        )
    console.print(table)
    console.print(
        "runs: times the handler really ran (the outside world's count; an idempotent re-run is "
        "absorbed by its key); answers: results the Agents API accepted"
    )
    for call in summary.calls:
        if call.story.startswith(("killed", "stored", "waited for approval")):
            console.print(f"\n[bold]audit timeline of {call.tool}[/bold] (toolledger calls show ...):")
            for line in call.timeline:
                console.print(f"  {line}", markup=False, highlight=False)
    console.print()
    killed = sum(w.killed for w in summary.workers)
    if summary.ok:
        console.print(
            f"[bold green]nothing ran twice, nothing lost[/bold green]: {killed} workers SIGKILLed, "
            f"{len(summary.calls)} calls each answered once, in {summary.seconds:.1f}s"
        )
    else:
        console.print("[bold red]broken promises:[/bold red]")
        for problem in summary.problems:
            console.print(f"  - {problem}", markup=False)
