"""`toolledger calls resolve --filter ...`: every unknown call a filter selects, resolved call by
call on the record, verified tools' hooks asked first, at a bounded rate, with a dry run, a
confirmation and a summary. Real ledgers (SQLite and PostgreSQL), the emulator, the real SDK."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
from click.testing import CliRunner

from tests.audit import bulk_tools
from tests.support.executor_harness import pending_actions, running_ledger
from tests.support.paths import ROOT
from toolledger.cli import main
from toolledger.domain.keys import CallKey
from toolledger.domain.states import CallStatus, EffectClass
from toolledger.emulator import EmulatorServer
from toolledger.runtime.tool_ledger import ToolLedger

from ..runtime.test_executor import accepted_payloads

TOOLS = "tests.audit.bulk_tools:registry"


async def unknown_calls(
    ledger: ToolLedger, emulator: EmulatorServer, steps: list[tuple[str, dict[str, Any]]]
) -> tuple[str, list[CallKey]]:
    """One session whose calls a dead worker left unknown."""
    session_id, actions = await pending_actions(emulator, steps)
    keys = []
    for action in actions:
        key = CallKey(session_id, action.turn_id, action.call_id)
        effect = EffectClass.VERIFIED if action.name in ("pay", "slow_pay") else EffectClass.AT_MOST_ONCE
        await ledger.store.record(
            key, tool_name=action.name, arguments=action.arguments, effect_class=effect, lease_seconds=0.05
        )
        keys.append(key)
    await asyncio.sleep(0.15)
    await ledger.store.expire_leases()
    return session_id, keys


def cli(*arguments: str) -> Any:
    return CliRunner().invoke(main, list(arguments), catch_exceptions=False)


async def test_bulk_resolve__dry_run_then_each_selected_call_once__hooks_first__a_summary(
    database_url: str, emulator: EmulatorServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bulk_tools, "PROVIDER", set())
    async with running_ledger(bulk_tools.registry, database_url, emulator) as ledger:
        session_id, keys = await unknown_calls(
            ledger,
            emulator,
            [
                ("charge", {"cents": 1}),
                ("charge", {"cents": 2}),
                ("pay", {"cents": 3}),
                ("pay", {"cents": 4}),
                ("ship", {"order": "A1"}),
            ],
        )
        charge_1, charge_2, pay_found, pay_missing, ship = keys
        bulk_tools.PROVIDER.add(pay_found.idempotency_key)
        where = ("--database-url", database_url, "--base-url", emulator.base_url)
        selected = ("--session", session_id, "--tool", "charge", "--tool", "pay")
        error = ("--error", "the provider was down: not charged", "--reason", "incident 42")

        planned = await asyncio.to_thread(
            cli,
            "calls",
            "resolve",
            "--filter",
            *selected,
            *error,
            "--tools",
            TOOLS,
            "--dry-run",
            "--json",
            *where,
        )
        unchanged = {k: (await ledger.store.get(k)) for k in keys}
        unconfirmed = await asyncio.to_thread(cli, "calls", "resolve", "--filter", *selected, *error, *where)
        started = time.monotonic()
        done = await asyncio.to_thread(
            cli,
            "calls",
            "resolve",
            "--filter",
            *selected,
            *error,
            "--tools",
            TOOLS,
            "--rate",
            "10",
            "--yes",
            "--operator",
            "ops",
            *where,
        )
        took = time.monotonic() - started
        calls = {k: (await ledger.store.get(k)) for k in keys}
        trails = {k: await ledger.store.events(k) for k in keys}

    document = json.loads(planned.output)
    assert planned.exit_code == 0, planned.output
    assert document["matched"] == 4
    assert document["counts"] == {"would_resolve": 2, "would_ask_verify_hook": 2}
    assert all(call is not None and call.status is CallStatus.UNKNOWN for call in unchanged.values())
    assert unconfirmed.exit_code == 2
    assert "resolving 4 call(s) needs confirmation: pass --yes" in unconfirmed.output

    assert done.exit_code == 0, done.output
    assert "4 unknown call(s) matched; resolved (bulk " in done.output
    assert "submitted: 3" in done.output  # two charges, and the pay the provider has not seen
    assert "settled_by_verify_hook: 1" in done.output
    assert "[4/4]" in done.output  # progress, a line per call
    assert took >= 0.3, "four calls at 10 per second take at least 0.3 s"
    statuses = {k: c.status if c else None for k, c in calls.items()}
    assert statuses == {
        charge_1: CallStatus.SUBMITTED,
        charge_2: CallStatus.SUBMITTED,
        pay_found: CallStatus.SUBMITTED,
        pay_missing: CallStatus.SUBMITTED,
        ship: CallStatus.UNKNOWN,
    }
    payloads = {p["call_id"]: p for p in accepted_payloads(emulator, session_id)}
    assert payloads[pay_found.call_id]["output"] == "charged (found at the provider)"
    assert payloads[pay_missing.call_id]["error"] == "the provider was down: not charged"
    assert payloads[charge_1.call_id]["error"] == "the provider was down: not charged"
    for key in (charge_1, charge_2, pay_found, pay_missing):
        settles = [e for e in trails[key] if e.to_status in ("succeeded", "failed")]
        assert len(settles) == 1, trails[key]
        assert settles[0].actor == "operator:ops"
        assert "incident 42 (bulk " in (settles[0].reason or "")
    assert "verify hook asked first" in (
        next(e.reason for e in trails[pay_found] if e.to_status == "succeeded") or ""
    )


async def test_bulk_resolve__guards(database_url: str, emulator: EmulatorServer) -> None:
    async with running_ledger(bulk_tools.registry, database_url, emulator) as ledger:
        session_id, [pay] = await unknown_calls(ledger, emulator, [("pay", {"cents": 3})])
        where = ("--database-url", database_url, "--base-url", emulator.base_url)
        happened = ("--output", "charged", "--reason", "r", "--yes")
        no_filter = await asyncio.to_thread(
            cli, "calls", "resolve", "--filter", "--error", "x", "--reason", "r"
        )
        both = await asyncio.to_thread(
            cli, "calls", "resolve", "ref", "--filter", "--tool", "pay", "--error", "x", "--reason", "r"
        )
        bad_status = await asyncio.to_thread(
            cli,
            "calls",
            "resolve",
            "--filter",
            "--status",
            "failed",
            "--error",
            "x",
            "--reason",
            "r",
            "--yes",
            *where,
        )
        bad_rate = await asyncio.to_thread(
            cli, "calls", "resolve", "--filter", "--tool", "pay", *happened, "--rate", "0", *where
        )
        no_hook_planned = await asyncio.to_thread(
            cli, "calls", "resolve", "--filter", "--session", session_id, *happened, "--dry-run", *where
        )
        no_hook = await asyncio.to_thread(
            cli, "calls", "resolve", "--filter", "--session", session_id, *happened, *where
        )
        contradicted = await asyncio.to_thread(
            cli, "calls", "resolve", "--filter", "--session", session_id, *happened, "--tools", TOOLS, *where
        )
        call = await ledger.store.get(pay)

    assert no_filter.exit_code == 2
    assert "at least one filter flag" in no_filter.output
    assert both.exit_code == 2
    assert bad_status.exit_code == 2
    assert "filter on status unknown" in bad_status.output
    assert bad_rate.exit_code == 2
    assert "rate must be more than 0" in bad_rate.output
    # The dry run says what the run would do: without --tools the hook cannot be asked.
    assert no_hook_planned.exit_code == 0
    assert "would_skip_verify_hook_unavailable: 1" in no_hook_planned.output
    assert no_hook.exit_code == 0
    assert "skipped_verify_hook_unavailable: 1" in no_hook.output
    # The operator says "it happened"; the provider has no such charge: not told to the model.
    assert contradicted.exit_code == 0
    assert "skipped_hook_says_not_executed: 1" in contradicted.output
    assert call is not None
    assert call.status is CallStatus.UNKNOWN
    assert accepted_payloads(emulator, session_id) == []


# ------------------------------------------------------------- Ctrl-C (issue 31)

INTERRUPTED = re.compile(r"^interrupted: (\d+) resolved, (\d+) left \(bulk ([0-9a-f]{12})[,)]", re.MULTILINE)


def interrupted_cli(arguments: list[str], after: str, within: float = 60) -> tuple[int, str, str]:
    """`toolledger ARGUMENTS` as a real process, sent SIGINT (Ctrl-C) once its stderr says
    ``after``: its exit code, stdout and stderr."""
    process = subprocess.Popen(
        [sys.executable, "-m", "toolledger.cli", *arguments],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    seen = threading.Event()

    def read_until_seen() -> None:  # readline blocks: a thread of its own
        assert process.stderr is not None
        for line in process.stderr:
            lines.append(line)
            if after in line:
                seen.set()
                return

    try:
        threading.Thread(target=read_until_seen, daemon=True).start()
        assert seen.wait(within), f"no {after!r} on stderr within {within} s: {''.join(lines)[-2000:]}"
        process.send_signal(signal.SIGINT)
        stdout, rest = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return process.returncode, stdout, "".join(lines) + rest


async def test_bulk_resolve__ctrl_c__says_how_many_resolved_and_left_and_the_run_id(
    database_url: str, emulator: EmulatorServer
) -> None:
    """A real `toolledger calls resolve --filter` process, SIGINTed in the middle of its run:
    it says how far it went (each call it reports resolved is resolved in the ledger, the call
    under way finished first, never cut between its record and its submission) and the run's
    id, and exits 130 without a traceback."""
    async with running_ledger(bulk_tools.registry, database_url, emulator) as ledger:
        session_id, keys = await unknown_calls(
            ledger, emulator, [("charge", {"cents": n}) for n in range(10)]
        )
        arguments = [
            "calls",
            "resolve",
            "--filter",
            "--session",
            session_id,
            "--error",
            "the provider was down: not charged",
            "--reason",
            "incident 43",
            "--rate",
            "2",
            "--yes",
            "--database-url",
            database_url,
            "--base-url",
            emulator.base_url,
        ]
        code, stdout, stderr = await asyncio.to_thread(interrupted_cli, arguments, after="[3/10]")
        calls = {key: await ledger.store.get(key) for key in keys}
        trails = {key: await ledger.store.events(key) for key in keys}

    assert code == 130, (code, stderr[-2000:])
    assert "Traceback" not in stderr, stderr
    found = INTERRUPTED.search(stderr)
    assert found is not None, stderr
    resolved, left, run_id = int(found[1]), int(found[2]), found[3]
    assert resolved >= 3
    assert resolved + left == 10
    assert "run the same command again" in stderr
    assert stdout == ""
    settled = [
        key for key, call in calls.items() if call is not None and call.status is not CallStatus.UNKNOWN
    ]
    assert len(settled) == resolved, "what it says it resolved is what the ledger holds"
    for key in settled:
        reasons = [e.reason or "" for e in trails[key] if e.to_status == "failed"]
        assert len(reasons) == 1
        assert f"incident 43 (bulk {run_id}, " in reasons[0]
    payloads = accepted_payloads(emulator, session_id)
    assert sorted(p["call_id"] for p in payloads) == sorted(key.call_id for key in settled), (
        "each call resolved was submitted whole, once"
    )
