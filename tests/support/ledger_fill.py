"""A ledger filled by real executions through the emulator, for every audit face's tests:
calls of every status the audit views must show, including an ``unknown`` call left by a
real SIGKILL of `toolledger serve` in the middle of an at_most_once handler."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.support.paths import ROOT
from tests.support.polling import eventually
from tests.support.shop_tools import CANARY
from tests.support.workload import start_sessions, wait_until_idle
from toolledger.domain.keys import CallKey
from toolledger.domain.states import CallStatus
from toolledger.emulator import EmulatorServer, Script
from toolledger.store.engine import create_engine
from toolledger.store.ledger import LedgerStore
from toolledger.store.schema import tool_calls

TOOLS = "tests.support.shop_tools:registry"
SERVE_ENVIRONMENT = {
    "TOOLLEDGER_LEASE_SECONDS": "1.0",
    "TOOLLEDGER_SESSION_LEASE_SECONDS": "2.0",
    "TOOLLEDGER_RECONCILE_INTERVAL_SECONDS": "1.0",
    "TOOLLEDGER_STREAM_BACKOFF_MAX_SECONDS": "0.3",
    "TOOLLEDGER_SHUTDOWN_GRACE_SECONDS": "2.0",
}


def shop_script() -> Script:
    return Script.of_calls(
        [
            ("charge_card", {"amount": 12, "card_number": f"4111{CANARY}"}),
            ("lookup_order", {"order_id": "A1"}),
        ],
        [("send_receipt", {"email": "ann@example.com"}), ("lookup_order", {"order_id": "missing"})],
        [("lookup_order", {"order_id": "refused"})],
    )


def charge_only_script() -> Script:
    return Script.of_calls([("charge_card", {"amount": 99, "card_number": f"5500{CANARY}"})])


CALLS_PER_SHOP_SESSION = 5


@dataclass(frozen=True)
class FilledLedger:
    database_url: str
    session_ids: list[str]
    """Sessions whose every call was answered (5 calls each)."""
    unknown: CallKey
    """The at_most_once call cut off by SIGKILL; its session still awaits it."""
    unknown_session: str


def run_serve(
    database_url: str, base_url: str, log: Path, *, crash_at: str | None = None
) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        **SERVE_ENVIRONMENT,
        "TOOLLEDGER_DATABASE_URL": database_url,
        "TOOLLEDGER_OPENAI_BASE_URL": base_url,
        "PYTHONPATH": str(ROOT),
    }
    env.pop("TOOLLEDGER_CRASH_AT", None)
    if crash_at is not None:
        env["TOOLLEDGER_CRASH_AT"] = crash_at
    sink = log.open("ab")
    return subprocess.Popen(
        [sys.executable, "-m", "toolledger.cli", "serve", "--tools", TOOLS],
        cwd=ROOT,
        env=env,
        stdout=sink,
        stderr=subprocess.STDOUT,
    )


async def fill_ledger(
    database_url: str, emulator: EmulatorServer, workdir: Path, *, sessions: int = 3
) -> FilledLedger:
    """Runs ``sessions`` shop sessions to the end through `toolledger serve`, then one charge
    whose serve process is SIGKILLed inside the handler; waits until that call is `unknown`."""
    from toolledger.store.sessions import SessionStore

    engine = create_engine(database_url)
    try:
        store = SessionStore(engine)
        session_ids = await start_sessions(emulator, sessions, shop_script())
        for session_id in session_ids:
            await store.watch(session_id)
        serve = run_serve(database_url, emulator.base_url, workdir / "serve-fill.log")
        try:
            await wait_until_idle(emulator, session_ids, within=60.0)
            await _wait_submitted(engine, session_ids, CALLS_PER_SHOP_SESSION * sessions)
        finally:
            serve.terminate()
            await asyncio.to_thread(serve.wait, 20)
        for session_id in session_ids:
            await store.unwatch(session_id, "finished")

        (doomed,) = await start_sessions(emulator, 1, charge_only_script())
        await store.watch(doomed)
        killed = run_serve(
            database_url, emulator.base_url, workdir / "serve-killed.log", crash_at="inside_handler"
        )
        code = await asyncio.to_thread(killed.wait, 60)
        assert code == -9, f"serve should have been SIGKILLed inside the handler, exited {code}"
        await store.unwatch(doomed, "left for an operator")
        ledger = LedgerStore(engine, actor="audit-test")
        (key,) = [c.key for c in await ledger.for_session(doomed) if c.tool_name == "charge_card"]

        async def unknown() -> bool:
            await ledger.expire_leases(key)
            call = await ledger.get(key)
            return call is not None and call.status is CallStatus.UNKNOWN

        await eventually(unknown, within=10, what=f"{key} never became unknown", interval=0.2)
        return FilledLedger(database_url, session_ids, key, doomed)
    finally:
        await engine.dispose()


async def _wait_submitted(engine: object, session_ids: list[str], expected: int) -> None:
    from sqlalchemy import func, select
    from sqlalchemy.ext.asyncio import AsyncEngine

    assert isinstance(engine, AsyncEngine)

    async def all_submitted() -> bool:
        async with engine.connect() as conn:
            done = (
                await conn.execute(
                    select(func.count()).where(
                        tool_calls.c.session_id.in_(session_ids),
                        tool_calls.c.status == CallStatus.SUBMITTED.value,
                    )
                )
            ).scalar_one()
        return bool(done == expected)

    await eventually(
        all_submitted, within=30, what=f"not every call was submitted ({expected} expected)", interval=0.2
    )
