"""Crash to answer: how long the model waits for its calls when `serve` is SIGKILLed and
started again at once, with its default settings.

    .venv/bin/python -m benchmarks --only crash [--quick]

Per database (the PostgreSQL bench database, then a SQLite file in a temporary directory),
one `serve` follows sessions whose scripted model calls the tools of benchmarks/crash_tools.py,
one per effect class, until it holds, at the moment of the kill:

- N stored results not submitted: sessions of five parallel calls, one per effect class,
  whose results were committed while the emulator refused every tool result (its
  ``fail_submissions`` fault, 503, armed before and cleared after the kill);
- N calls mid-handler: one-call sessions (N/5 per effect class) whose handler noted its entry
  in a marks file and waits to be killed.

As under steady load, the held calls do not all start at once: their turns start one after
another over ten seconds (a lease renewal period), then after five more seconds the
transactional ones, and the kill comes as soon as the last handler is entered. So at the kill
their leases were last renewed at different moments, some after the sessions' own leases were.
(Starting them all at once, just before the kill, would make every call lease run out before
the session leases do, which today hides the slowest path.)

Then: SIGKILL, the fault cleared, `serve` started again at once with its default settings
(30 s call and session leases, a reconcile every 60 s; not shortened, that is what is
measured), and each call the sessions awaited at the kill is timed from that restart until
the emulator accepted its result (the emulator's own receipt time, same machine clock).

**at_most_once.** A mid-handler kill leaves such a call ``unknown``: toolledger will not
guess whether its side effect happened, and by default the call waits for an operator, a
wait no recovery mechanism may shorten. The benchmark's at_most_once tool therefore has
``unknown_deadline=0``: the fixed "outcome unknown" failure is sent as soon as toolledger
has declared the call unknown. That moment (today: the lease has run out and a reconcile
looks at the call) is exactly what recovery decides, so these calls are counted with the
others; the per-class maxima printed under the table show them apart.

**Transactional calls held.** On SQLite a transactional handler runs holding the process's
SQLite writer lock (its writes commit with its result), so a held one stops every other
write of the process, lease renewals included: only one is held there, and the kill follows
its start at once. On PostgreSQL each held one keeps one of serve's ten pooled connections:
at most four are held.

Figures per database: p50, p99 and max of the per-call times; the target is a max of 5 s.
The baseline is the same restart's own start-up (until serve logs "serving"), the floor no
recovery can beat. A call still unanswered after the timeout counts as the timeout and the
figure is printed as a lower bound (">150"), with how many calls went unanswered.

Environment: ``BENCH_CRASH_CALLS`` (N, default 20; --quick 5), ``BENCH_CRASH_TIMEOUT``
(seconds per run, default 150; --quick 90), ``BENCH_CRASH_SPREAD`` and ``BENCH_CRASH_DWELL``
(seconds, 10 and 5; --quick 0: the held calls start together), ``BENCH_CRASH_LOGS`` (a
directory to keep serve's logs in; they are at info level).
"""

from __future__ import annotations

import asyncio
import os
import signal
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from openai import AsyncOpenAI
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from benchmarks.crash_tools import EFFECT_CLASSES, ENTERED, HOLD_VARIABLE, MARKS_VARIABLE
from benchmarks.report import Figure, percentile
from benchmarks.service import (
    API_KEY,
    _fresh,
    _wait_followed,
    _watch,
    create_sessions,
    emulator_process,
    serve_process,
)
from toolledger.domain.states import RESULT_STATUSES
from toolledger.emulator import EmulatorControl, Script
from toolledger.emulator.faults import FailSubmissions
from toolledger.gateway.agents import FunctionCallAction
from toolledger.store.engine import create_engine
from toolledger.store.schema import tool_calls

Progress = Callable[[str], None]
TOOLS = "benchmarks.crash_tools:registry"
TOOL_ORDER = ("look_up", "notify", "record", "ship", "charge")
TRANSACTIONAL = "record"
TARGET_SECONDS = 5.0
CALLS = int(os.environ.get("BENCH_CRASH_CALLS", "20"))
TIMEOUT = float(os.environ.get("BENCH_CRASH_TIMEOUT", "150"))
SPREAD_SECONDS = float(os.environ.get("BENCH_CRASH_SPREAD", "10"))
DWELL_SECONDS = float(os.environ.get("BENCH_CRASH_DWELL", "5"))
QUICK_CALLS = 5
QUICK_TIMEOUT = 90.0
POSTGRES_TRANSACTIONAL_HELD = 4
SET_UP_SECONDS = 120.0
"""For serve to reach the state to kill it in; longer is an error, not a figure."""
POLL_SECONDS = 0.2

CallId = tuple[str, str, str]


@dataclass(frozen=True)
class OpenCall:
    key: CallId
    tool: str
    held: bool
    """Mid-handler at the kill; otherwise its result was stored and not submitted."""


@dataclass
class CrashRun:
    database: str
    calls: list[OpenCall]
    answered: dict[CallId, float]
    """Seconds from the restart until the emulator accepted the call's result."""
    startup: float | None
    timeout: float

    def seconds(self) -> list[float]:
        return [self.answered.get(call.key, self.timeout) for call in self.calls]

    @property
    def unanswered(self) -> int:
        return sum(call.key not in self.answered for call in self.calls)

    @property
    def held(self) -> int:
        return sum(call.held for call in self.calls)

    def breakdown(self) -> str:
        """The slowest answer of each group: the held calls by effect class, the stored ones."""
        parts = []
        for tool in TOOL_ORDER:
            times = [self.answered.get(c.key, self.timeout) for c in self.calls if c.held and c.tool == tool]
            if times:
                parts.append(f"{EFFECT_CLASSES[tool]} {max(times):.1f}")
        stored = [self.answered.get(c.key, self.timeout) for c in self.calls if not c.held]
        text = f"max s, mid-handler: {', '.join(parts)}; stored: {max(stored, default=0.0):.1f}"
        if self.answered:
            text += f"; first answer at {min(self.answered.values()):.1f} s"
        if self.unanswered:
            text += (
                f"; >{self.timeout:.0f} s, {self.unanswered} of {len(self.calls)} calls unanswered "
                f"(counted as {self.timeout:.0f} s)"
            )
        return text


def held_phases(per_class: int, sqlite: bool) -> list[list[str]]:
    """The tools of the held one-call sessions, in the order they are started (the classes
    interleaved, so each has calls early and late in the spread)."""
    others = [tool for _ in range(per_class) for tool in TOOL_ORDER if tool != TRANSACTIONAL]
    transactional = min(per_class, 1 if sqlite else POSTGRES_TRANSACTIONAL_HELD)
    return [others, [TRANSACTIONAL] * transactional]


async def crash_to_answer(
    name: str,
    database_url: str,
    base_url: str,
    per_class: int,
    patience: float,
    spread: float,
    dwell: float,
    workdir: Path,
    progress: Progress,
) -> CrashRun:
    await asyncio.to_thread(_fresh, database_url)
    slug = f"{name.lower()}-{time.monotonic_ns()}"
    marks = workdir / f"marks-{slug}.txt"
    control = EmulatorControl(base_url)
    engine = create_engine(database_url)
    try:
        async with AsyncOpenAI(base_url=base_url, api_key=API_KEY, max_retries=5) as client:
            await asyncio.to_thread(control.arm, FailSubmissions(count=None, status=503))
            killed_log = workdir / f"serve-crash-{slug}-killed.log"
            async with serve_process(
                database_url,
                base_url,
                killed_log,
                tools=TOOLS,
                log_level="info",
                defaults_only=True,
                **{HOLD_VARIABLE: "1", MARKS_VARIABLE: str(marks)},
            ) as first:

                async def until(what: str, done: Callable[[], Awaitable[bool]]) -> None:
                    deadline = time.monotonic() + SET_UP_SECONDS
                    while not await done():
                        if first.poll() is not None or time.monotonic() > deadline:
                            tail = killed_log.read_text(errors="replace")[-3000:]
                            raise RuntimeError(f"serve did not get to {what}:\n{tail}")
                        await asyncio.sleep(POLL_SECONDS)

                stored_script = Script.of_calls([(tool, {}) for tool in TOOL_ORDER])
                stored_ids = await create_sessions(client, per_class, stored_script, start=True)
                phases = held_phases(per_class, database_url.startswith("sqlite"))
                # Created idle and watched with the rest, so that starting their turns later
                # takes no session over: a take-over renews every session lease of serve.
                held = [[await _idle_session(client, tool) for tool in phase] for phase in phases]
                held_ids = [session_id for phase in held for session_id in phase]
                await _watch(database_url, stored_ids + held_ids)
                await _wait_followed(database_url, stored_ids + held_ids, first, killed_log)
                stored_total = per_class * len(TOOL_ORDER)

                async def all_stored() -> bool:
                    return await _results_stored(engine) >= stored_total

                await until(f"{stored_total} stored results", all_stored)
                others, transactional = held
                for session_id in others:
                    await _start_turn(client, session_id)
                    await asyncio.sleep(spread / max(1, len(others)))

                async def entered(expected: int) -> bool:
                    return _entered(marks) >= expected

                await until(f"{len(others)} calls mid-handler", partial(entered, len(others)))
                await asyncio.sleep(dwell)
                # Last, and the kill at once after: on SQLite a held transactional call holds
                # back every other write of serve, its leases' renewals included.
                for session_id in transactional:
                    await _start_turn(client, session_id)
                await until(f"{len(held_ids)} calls mid-handler", partial(entered, len(held_ids)))
                # Read before the kill: nothing moves meanwhile (submissions refused, handlers
                # waiting), and the restart comes at once after it.
                calls = await _awaited(client, stored_ids, set(held_ids))
                first.send_signal(signal.SIGKILL)
                await asyncio.to_thread(first.wait)
            await asyncio.to_thread(control.clear_faults)
            progress(
                f"{name}: serve killed holding {sum(c.held for c in calls)} calls mid-handler and "
                f"{sum(not c.held for c in calls)} stored results; restarted"
            )
            restarted = time.time()
            log = workdir / f"serve-crash-{slug}-restarted.log"
            async with serve_process(
                database_url,
                base_url,
                log,
                tools=TOOLS,
                log_level="info",
                defaults_only=True,
                **{MARKS_VARIABLE: str(marks)},
            ) as second:
                answered, startup = await _wait_answered(
                    control, calls, restarted, patience, second.poll, log, progress, name
                )
        return CrashRun(name, calls, answered, startup, patience)
    finally:
        await engine.dispose()
        await asyncio.to_thread(control.clear_faults)
        control.close()


async def _results_stored(engine: AsyncEngine) -> int:
    async with engine.connect() as conn:
        stored = tool_calls.c.status.in_([status.value for status in RESULT_STATUSES])
        query = select(func.count()).select_from(tool_calls).where(stored)
        return int((await conn.execute(query)).scalar_one())


async def _idle_session(client: AsyncOpenAI, tool: str) -> str:
    """A session whose turn, once started, makes one held call of ``tool``."""
    (session_id,) = await create_sessions(client, 1, Script.of_calls([(tool, {"hold": True})]), start=False)
    return session_id


async def _start_turn(client: AsyncOpenAI, session_id: str) -> None:
    await client.beta.agents.sessions.events.create(
        session_id,
        events=[
            {
                "type": "agent.session.input.message",
                "input": [{"role": "user", "content": [{"type": "input_text", "text": "go"}]}],
            }
        ],
    )


def _entered(marks: Path) -> int:
    if not marks.exists():
        return 0
    return sum(line.startswith(f"{ENTERED} ") for line in marks.read_text().splitlines())


async def _awaited(client: AsyncOpenAI, stored_ids: list[str], held_ids: set[str]) -> list[OpenCall]:
    """What the sessions await (their function calls in required_actions)."""
    sessions = await asyncio.gather(
        *(client.beta.agents.sessions.retrieve(s) for s in [*stored_ids, *sorted(held_ids)])
    )
    return [
        OpenCall((session.id, action.turn_id, action.call_id), action.name, session.id in held_ids)
        for session in sessions
        for action in session.required_actions
        if isinstance(action, FunctionCallAction)
    ]


async def _wait_answered(
    control: EmulatorControl,
    calls: list[OpenCall],
    restarted: float,
    patience: float,
    exited: Callable[[], int | None],
    log: Path,
    progress: Progress,
    name: str,
) -> tuple[dict[CallId, float], float | None]:
    """Per call, seconds from the restart to its accepted result; and serve's start-up."""
    wanted = {call.key for call in calls}
    answered: dict[CallId, float] = {}
    startup: float | None = None
    reported = restarted
    while True:
        now = time.time()
        if startup is None and "serving:" in log.read_text(errors="replace"):
            startup = now - restarted
        for receipt in await asyncio.to_thread(control.tool_results):
            key = (receipt.session_id, receipt.turn_id, receipt.call_id)
            if receipt.outcome == "accepted" and key in wanted and key not in answered:
                answered[key] = max(0.0, receipt.received_at - restarted)
        if len(answered) == len(wanted) or now - restarted >= patience:
            return answered, startup
        if exited() is not None:
            raise RuntimeError(f"the restarted serve exited:\n{log.read_text(errors='replace')[-3000:]}")
        if now - reported >= 10:
            elapsed = now - restarted
            progress(f"{name}: {len(answered)} of {len(wanted)} answered {elapsed:.0f} s after the restart")
            reported = now
        await asyncio.sleep(POLL_SECONDS)


def figures_of(run: CrashRun) -> list[Figure]:
    seconds = run.seconds()
    shape = f"{run.held} mid-handler + {len(run.calls) - run.held} stored"
    figures = []
    for label, share in (("p50", 0.5), ("p99", 0.99), ("max", 1.0)):
        value = percentile(seconds, share)
        figures.append(
            Figure(
                "crash",
                f"{run.database}: answered after a restart, {shape}, {label}",
                "s",
                value,
                run.startup,
                "s serve start-up",
                f"<= {TARGET_SECONDS:g} s",
                value <= TARGET_SECONDS,
                note=run.breakdown() if label == "max" else "",
                lower_bound=run.unanswered > 0 and value >= run.timeout,
            )
        )
    return figures


async def run(
    database_url: str, quick: bool, progress: Progress, skip: dict[str, str], parts: set[str]
) -> list[Figure]:
    per_class = max(1, (QUICK_CALLS if quick else CALLS) // len(TOOL_ORDER))
    timeout = QUICK_TIMEOUT if quick else TIMEOUT
    spread, dwell = (0.0, 0.0) if quick else (SPREAD_SECONDS, DWELL_SECONDS)
    figures: list[Figure] = []
    kept = os.environ.get("BENCH_CRASH_LOGS")
    with tempfile.TemporaryDirectory(prefix="toolledger-bench-crash-") as directory:
        workdir = Path(kept or directory)
        workdir.mkdir(parents=True, exist_ok=True)
        async with emulator_process() as base_url:
            for name, url in (
                ("PostgreSQL", database_url),
                ("SQLite", f"sqlite+aiosqlite:///{workdir / f'crash-{time.monotonic_ns()}.sqlite3'}"),
            ):
                measured = await crash_to_answer(
                    name, url, base_url, per_class, timeout, spread, dwell, workdir, progress
                )
                seconds = measured.seconds()
                progress(
                    f"{name}: {len(seconds)} calls answered {percentile(seconds, 0.5):.1f} / "
                    f"{percentile(seconds, 0.99):.1f} / {max(seconds):.1f} s (p50 / p99 / max) after the "
                    f"restart, {measured.unanswered} unanswered; {measured.breakdown()}"
                )
                figures += figures_of(measured)
    return figures
