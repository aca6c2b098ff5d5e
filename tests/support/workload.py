"""A multi-session workload on the emulator, and the checks every service test makes.

Each session runs a script of parallel steps; the checks read the emulator's record of the
tool results it received and the tools' effects file, never the ledger alone.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from openai import AsyncOpenAI

from toolledger.emulator import EmulatorServer, Script

AT_MOST_ONCE_TOOLS = frozenset({"charge"})


def shop_script(pause_ms: int = 0) -> Script:
    """Three steps: two parallel calls, one call, then two more."""
    return Script.of_calls(
        [("charge", {"amount": 10, "pause_ms": pause_ms}), ("lookup", {"order_id": "A1"})],
        [("notify", {"message": "paid", "pause_ms": pause_ms})],
        [("charge", {"amount": 5, "pause_ms": pause_ms}), ("notify", {"message": "done"})],
    )


CALLS_PER_SESSION = 5


def every_class_script() -> Script:
    """One call of each effect class, in two parallel steps (whose results go out together),
    then a lone call (whose result goes out alone)."""
    return Script.of_calls(
        [("charge", {"amount": 10}), ("notify", {"message": "paid"}), ("lookup", {"order_id": "A1"})],
        [("record_refund", {"cents": 5}), ("ship", {"parcel": "P1"})],
        [("notify", {"message": "shipped"})],
    )


EVERY_CLASS_CALLS = 6


async def start_sessions(
    emulator: EmulatorServer,
    count: int,
    script: Script | None = None,
    *,
    agent_id: str | None = None,
    **metadata: str,
) -> list[str]:
    """``agent_id``: sessions of that saved agent (else each has an inline agent of its own)."""
    encoded = (script or shop_script()).model_dump_json()
    agent: dict[str, Any] = {"agent_id": agent_id} if agent_id else {"agent": {"model": "emulated"}}
    async with AsyncOpenAI(base_url=emulator.base_url, api_key="sk-test") as client:
        created = await asyncio.gather(
            *(
                client.beta.agents.sessions.create(
                    environment={"type": "none"},
                    metadata={"emulator_script": encoded, **metadata},
                    input="go",
                    **agent,
                )
                for _ in range(count)
            )
        )
    return [session.id for session in created]


async def wait_until_idle(emulator: EmulatorServer, session_ids: Sequence[str], within: float = 30.0) -> None:
    """Every session finished its turn (or failed); raises TimeoutError with the stragglers."""
    deadline = time.monotonic() + within
    async with AsyncOpenAI(base_url=emulator.base_url, api_key="sk-test") as client:
        while True:
            sessions = await asyncio.gather(*(client.beta.agents.sessions.retrieve(s) for s in session_ids))
            waiting = [s.id for s in sessions if s.status not in ("idle", "failed")]
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(waiting)} session(s) still busy: {waiting[:5]}")
            await asyncio.sleep(0.1)


@dataclass(frozen=True)
class Effect:
    tool: str
    session_id: str
    turn_id: str
    call_id: str
    attempt: int
    pid: int


def read_effects(path: Path) -> list[Effect]:
    if not path.exists():
        return []
    effects = []
    for line in path.read_text(encoding="utf-8").splitlines():
        tool, session_id, turn_id, call_id, attempt, pid = line.split()
        effects.append(Effect(tool, session_id, turn_id, call_id, int(attempt), int(pid)))
    return effects


def assert_exactly_once(
    emulator: EmulatorServer, session_ids: Sequence[str], effects_file: Path, calls_per_session: int
) -> dict[str, Any]:
    """Every call got exactly one accepted result; no at_most_once handler ran twice; each
    accepted result's call ran (or was settled) and nothing else was answered."""
    wanted = set(session_ids)
    received = [r for r in emulator.control.tool_results() if r.session_id in wanted]
    accepted = Counter((r.session_id, r.turn_id, r.call_id) for r in received if r.outcome == "accepted")
    assert len(accepted) == calls_per_session * len(session_ids), (
        f"{len(accepted)} calls answered, expected {calls_per_session * len(session_ids)}"
    )
    repeated = {k: n for k, n in accepted.items() if n > 1}
    assert not repeated, f"calls answered more than once: {repeated}"
    payloads: dict[tuple[str, str, str], set[str]] = {}
    for r in received:
        payloads.setdefault((r.session_id, r.turn_id, r.call_id), set()).add(
            json.dumps(r.payload, sort_keys=True)
        )
    changed = {k: v for k, v in payloads.items() if len(v) > 1}
    assert not changed, f"results changed between submissions: {changed}"
    effects = [e for e in read_effects(effects_file) if e.session_id in wanted]
    runs = Counter((e.session_id, e.turn_id, e.call_id) for e in effects if e.tool in AT_MOST_ONCE_TOOLS)
    twice = {k: n for k, n in runs.items() if n > 1}
    assert not twice, f"at_most_once handlers ran more than once: {twice}"
    return {"accepted": len(accepted), "effects": len(effects), "received": len(received)}
