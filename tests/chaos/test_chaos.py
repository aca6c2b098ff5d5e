"""Random kills of `toolledger serve` under load, checked as one history at the end.

Each trial starts new sessions (every effect class, with think time), starts `serve`, and
kills it: half the trials by SIGKILL from outside at a random moment, half at a random
crash point inside. A last `serve` then runs to quiescence and the whole history is checked:
every call answered exactly once with one unchanging payload, or `unknown` (at_most_once
only, never answered); no at_most_once or verified handler ran twice; transactional rows
exactly once; audit trails complete and ordered.

Each trial also draws how the API answers where real ones differ (``emulator.behaviour``):
the refusal of a result for an answered call in one of its four wordings, and Idempotency-Keys
kept or ignored; and, half the time, submissions whose answers are lost (accepted, then the
connection dropped) so that their retries meet that refusal. The history then also fails any
second, non-replayed submission of an answered call.

It also reports, per trial, the longest wait from the restart after the kill until the calls
open at the kill were answered, and the max, p50 and p99 of those over the trials (a figure,
not asserted; see tests/chaos/waits.py for what is counted).

CI runs a few trials on each database; the long run is by hand, one database at a time:

    .venv/bin/pytest -m chaos --trials 1000 --chaos-report chaos.json --timeout 0 -s -k postgresql
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import subprocess
import time
from collections import Counter
from contextlib import suppress
from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI

from tests.chaos.trials import INSIDE_POINTS, draw_api_behaviour, refused_replays
from tests.chaos.waits import KillWaits
from tests.support.history import assert_history, create_refunds_table, ledger_calls, wait_quiescent
from tests.support.serve_process import ServeProcess
from tests.support.workload import EVERY_CLASS_CALLS, every_class_script, start_sessions
from toolledger.domain.states import CallStatus
from toolledger.emulator import EmulatorServer
from toolledger.store.engine import create_engine
from toolledger.store.sessions import SessionStore

SESSIONS_PER_TRIAL = 2


async def run_trials(
    trials: int, seed: int, database_url: str, emulator: EmulatorServer, effects_file: Path, logs: Path
) -> dict[str, Any]:
    chance = random.Random(seed)
    await create_refunds_table(database_url)
    started = time.monotonic()
    session_ids: list[str] = []
    kills = crash_points = 0
    behaviours: Counter[str] = Counter()
    waits = KillWaits()
    engine = create_engine(database_url)
    try:
        sessions = SessionStore(engine)
        for trial in range(trials):
            script = every_class_script().model_copy(update={"think_seconds": 0.1})
            fresh = await start_sessions(emulator, SESSIONS_PER_TRIAL, script)
            for session_id in fresh:
                await sessions.watch(session_id)
            session_ids += fresh
            waits.add_sessions(fresh)
            if trial % 25 == 24:
                # As an application would: stop watching sessions whose work is done, so the
                # service follows what is live, not the whole history.
                await unwatch_finished(emulator, database_url, sessions, session_ids)
            behaviours[draw_api_behaviour(chance, emulator)] += 1
            inside = chance.random() < 0.5
            crash_at = f"{chance.choice(INSIDE_POINTS)}@{chance.randint(1, 4)}" if inside else None
            killed = False
            waits.restarting()
            with ServeProcess(
                database_url, emulator.base_url, logs / f"trial-{trial}.log", crash_at=crash_at
            ) as serve:
                await asyncio.to_thread(serve.wait_serving)
                with suppress(subprocess.TimeoutExpired):  # still running: killed from outside below
                    await asyncio.to_thread(serve.process.wait, chance.uniform(0.1, 1.5))
                if serve.process.poll() is None:
                    serve.kill()
                    kills += 1
                    killed = True
                elif serve.process.returncode == -signal.SIGKILL:
                    crash_points += 1
                    kills += 1
                    killed = True
            if killed:
                await waits.killed(trial, emulator, database_url)
        waits.restarting()
        with ServeProcess(database_url, emulator.base_url, logs / "final.log") as final:
            await asyncio.to_thread(final.wait_serving)
            states = await wait_quiescent(emulator, database_url, session_ids, within=120.0 + trials)
    finally:
        await engine.dispose()
    figures = await assert_history(emulator, database_url, session_ids, states, effects_file)
    return {
        "trials": trials,
        "seed": seed,
        "database": "sqlite" if database_url.startswith("sqlite") else "postgresql",
        "kills": kills,
        "kills_at_crash_points": crash_points,
        "sessions": len(session_ids),
        **figures,
        "trials_by_api_behaviour": dict(sorted(behaviours.items())),
        "replays_of_answered_refused": refused_replays(emulator, session_ids),
        "seconds": round(time.monotonic() - started, 1),
        **waits.figures(emulator),
    }


async def unwatch_finished(
    emulator: EmulatorServer, database_url: str, sessions: SessionStore, session_ids: list[str]
) -> None:
    """Unwatch sessions whose turn is over with every call answered."""
    watched = {r.session_id for r in await sessions.find(watched=True)}
    calls = await ledger_calls(database_url, [s for s in session_ids if s in watched])
    answered = Counter(k.session_id for k, c in calls.items() if c.status is CallStatus.SUBMITTED)
    async with AsyncOpenAI(base_url=emulator.base_url, api_key="sk-test") as client:
        for session_id, count in answered.items():
            if count == EVERY_CLASS_CALLS:
                session = await client.beta.agents.sessions.retrieve(session_id)
                if session.status == "idle":
                    await sessions.unwatch(session_id, "finished")


async def test_chaos__a_few_random_kills__history_holds(
    database_url: str, emulator: EmulatorServer, effects_file: Path, tmp_path: Path
) -> None:
    figures = await run_trials(4, 7, database_url, emulator, effects_file, tmp_path)
    assert figures["kills"] >= 1
    assert figures["lost"] == 0
    assert figures["at_most_once_duplicates"] == 0
    assert figures["answered_then_sent_again"] == 0


@pytest.mark.chaos
async def test_chaos__many_random_kills__history_holds(
    database_url: str,
    emulator: EmulatorServer,
    effects_file: Path,
    tmp_path: Path,
    pytestconfig: pytest.Config,
) -> None:
    trials: int = pytestconfig.getoption("--trials")
    seed = random.SystemRandom().randint(0, 2**31)
    figures = await run_trials(trials, seed, database_url, emulator, effects_file, tmp_path)
    summary = {k: v for k, v in figures.items() if k != "longest_wait_per_trial"}
    print("chaos figures:", json.dumps(summary))
    longest = [t["longest_wait"] for t in figures["longest_wait_per_trial"]]
    print("longest wait per trial (s, restart to the last answer of the calls open at the kill):", longest)
    report = pytestconfig.getoption("--chaos-report")
    if report:
        await asyncio.to_thread(Path(report).write_text, json.dumps(figures, indent=2) + "\n", "utf-8")
