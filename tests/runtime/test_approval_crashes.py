"""Approval gates under SIGKILL: an operator's `toolledger calls approve --tools ...` process
killed between its approval and the claim, or during the approved run; and two approver
processes racing. The side effect happens at most once, and an approved call is answered."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.runtime.approval_tools import registry
from tests.support.executor_harness import current_actions, pending_actions, running_ledger
from tests.support.paths import ROOT
from toolledger import crashpoints as cp
from toolledger.domain.keys import CallKey, arguments_fingerprint
from toolledger.domain.states import CallStatus
from toolledger.emulator import EmulatorServer

from .test_executor import accepted_payloads

LEASE_SECONDS = 0.5
TOOLS = "tests.runtime.approval_tools:registry"
ARGUMENTS = {"amount": 7}
SEEN = arguments_fingerprint(ARGUMENTS)
"""The fingerprint the approver saw the arguments by (`calls approve --sha256`)."""


def approve(
    database_url: str, base_url: str, key: CallKey, effects: Path, *, crash_at: str | None = None
) -> subprocess.CompletedProcess[str]:
    """`toolledger calls approve KEY --tools ...` in a process of its own."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "CRASH_EFFECTS_FILE": str(effects),
        "TOOLLEDGER_DATABASE_URL": database_url,
        "TOOLLEDGER_OPENAI_BASE_URL": base_url,
        "TOOLLEDGER_LEASE_SECONDS": str(LEASE_SECONDS),
    }
    env.pop("TOOLLEDGER_CRASH_AT", None)
    if crash_at:
        env["TOOLLEDGER_CRASH_AT"] = crash_at
    command = [sys.executable, "-m", "toolledger", "calls", "approve", str(key), "--tools", TOOLS]
    command += ["--sha256", SEEN, "--reason", "checked", "--operator", "ana"]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False)


def effect_lines(effects: Path) -> list[str]:
    return effects.read_text(encoding="utf-8").splitlines()


async def awaiting_call(database_url: str, emulator: EmulatorServer) -> tuple[str, CallKey]:
    session_id, [action] = await pending_actions(emulator, [("approved_refund", ARGUMENTS)])
    async with running_ledger(registry, database_url, emulator) as ledger:
        report = await ledger.handle(session_id, action)
    assert report.action == "waiting_for_approval"
    return session_id, CallKey(session_id, action.turn_id, action.call_id)


async def test_killed_between_approval_and_claim__the_approved_call_runs_once_on_recovery(
    database_url: str, emulator: EmulatorServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    effects = tmp_path / "effects.log"
    effects.touch()
    monkeypatch.setenv("CRASH_EFFECTS_FILE", str(effects))
    session_id, key = await awaiting_call(database_url, emulator)

    killed = await asyncio.to_thread(
        approve, database_url, emulator.base_url, key, effects, crash_at=cp.CP_AFTER_APPROVAL
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    async with running_ledger(registry, database_url, emulator, lease_seconds=LEASE_SECONDS) as ledger:
        between = await ledger.store.get(key)
        first = await ledger.recover()
        second = await ledger.recover()
        after = await ledger.store.get(key)

    assert between is not None
    assert between.status is CallStatus.PENDING
    assert between.approval_decided_by == "ana"
    assert first.actions["executed"] == 1
    assert sum(second.actions.values()) == 0
    assert after is not None
    assert after.status is CallStatus.SUBMITTED
    assert effect_lines(effects) == [f"approved_refund {key.idempotency_key} 7"]
    assert [p["output"] for p in accepted_payloads(emulator, session_id)] == ["refunded 7"]


async def test_killed_during_the_approved_run__it_is_never_run_again_on_that_approval(
    database_url: str, emulator: EmulatorServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    effects = tmp_path / "effects.log"
    effects.touch()
    monkeypatch.setenv("CRASH_EFFECTS_FILE", str(effects))
    session_id, key = await awaiting_call(database_url, emulator)

    killed = await asyncio.to_thread(
        approve, database_url, emulator.base_url, key, effects, crash_at=cp.CP_INSIDE_HANDLER
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    await asyncio.sleep(LEASE_SECONDS + 0.3)
    async with running_ledger(registry, database_url, emulator, lease_seconds=LEASE_SECONDS) as ledger:
        report = await ledger.recover()
        again = await ledger.recover()
        call = await ledger.store.get(key)
    # The approver's second try finds nothing to approve: the approval was used by the run.
    retried = await asyncio.to_thread(approve, database_url, emulator.base_url, key, effects)

    assert report.expired == 1
    assert report.actions["waiting_for_operator"] == 1
    assert again.actions["waiting_for_operator"] == 1
    assert call is not None
    assert call.status is CallStatus.UNKNOWN
    assert retried.returncode == 1
    assert "only a call awaiting approval can be approved" in retried.stderr
    assert effect_lines(effects) == [f"approved_refund {key.idempotency_key} 7"]
    assert accepted_payloads(emulator, session_id) == []


@pytest.mark.parametrize("approvers", [3])
async def test_approver_processes_racing__one_approval_wins_and_the_call_runs_once(
    database_url: str, emulator: EmulatorServer, tmp_path: Path, approvers: int
) -> None:
    effects = tmp_path / "effects.log"
    effects.touch()
    session_id, key = await awaiting_call(database_url, emulator)

    results = await asyncio.gather(
        *(asyncio.to_thread(approve, database_url, emulator.base_url, key, effects) for _ in range(approvers))
    )

    won = [r for r in results if r.returncode == 0]
    lost = [r for r in results if r.returncode != 0]
    assert len(won) == 1, [r.stderr for r in results]
    assert "approved, run here, and its result submitted" in won[0].stdout
    assert all(r.returncode == 1 for r in lost), [r.stderr for r in lost]
    assert all("awaiting approval" in r.stderr or "decided by someone else" in r.stderr for r in lost)
    assert effect_lines(effects) == [f"approved_refund {key.idempotency_key} 7"]
    assert len(accepted_payloads(emulator, session_id)) == 1
    assert await current_actions(emulator, session_id) == []
