"""`toolledger calls show / approve / deny` on a call awaiting approval, in process, against a
real ledger (SQLite and PostgreSQL) and the emulator."""

from __future__ import annotations

import asyncio
import json
import os
import pty
import select
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from tests.support.executor_harness import pending_actions, running_ledger
from tests.support.paths import ROOT
from tests.support.polling import eventually
from toolledger.cli import main
from toolledger.domain.keys import CallKey, arguments_fingerprint
from toolledger.domain.records import CallRecord
from toolledger.domain.results import DENIED_PREFIX, NOT_APPROVED_IN_TIME_MESSAGE
from toolledger.domain.states import CallStatus
from toolledger.emulator import EmulatorServer
from toolledger.runtime.registry import ToolRegistry
from toolledger.runtime.service import Service
from toolledger.settings import Settings

from ..runtime.test_executor import accepted_payloads


def gated() -> ToolRegistry:
    registry = ToolRegistry()

    @registry.tool(approval=True)
    def wire_money(iban: str, cents: int) -> str:
        raise AssertionError("a denied call never runs")

    return registry


def cli(*arguments: str) -> Any:
    return CliRunner().invoke(main, list(arguments), catch_exceptions=False)


async def test_show_names_the_commands__deny_answers_the_model__a_second_decision_is_refused(
    database_url: str, emulator: EmulatorServer
) -> None:
    session_id, [action] = await pending_actions(emulator, [("wire_money", {"iban": "DE89", "cents": 10})])
    key = CallKey(session_id, action.turn_id, action.call_id)
    async with running_ledger(gated(), database_url, emulator) as ledger:
        await ledger.handle(session_id, action)
        call = await ledger.store.get(key)
    assert call is not None
    where = ("--database-url", database_url)

    shown = await asyncio.to_thread(cli, "calls", "show", str(key), *where)
    seen = ("--sha256", call.arguments_sha256)
    bad_json = await asyncio.to_thread(
        cli,
        "calls",
        "approve",
        str(key),
        *seen,
        "--arguments",
        "{oops",
        "--reason",
        "r",
        "--operator",
        "bo",
        *where,
    )
    stale = await asyncio.to_thread(
        cli, "calls", "deny", str(key), "--sha256", "f" * 64, "--reason", "r", "--operator", "bo", *where
    )
    denied = await asyncio.to_thread(
        cli,
        "calls",
        "deny",
        str(key),
        "--sha256",
        call.arguments_sha256,
        "--reason",
        "wires go through the bank's portal",
        "--operator",
        "bo",
        "--base-url",
        emulator.base_url,
        *where,
    )
    again = await asyncio.to_thread(
        cli, "calls", "approve", str(key), *seen, "--reason", "r", "--operator", "bo", *where
    )

    assert shown.exit_code == 0
    assert "awaiting_approval: approve it with `toolledger calls approve" in " ".join(shown.output.split())
    assert call.arguments_sha256 in "".join(shown.output.split())
    assert bad_json.exit_code == 2
    assert "amended arguments refused" in bad_json.output
    assert stale.exit_code == 1
    assert "its arguments differ" in stale.output
    assert '{"cents": 10, "iban": "DE89"}' in stale.output, "shown, to be read again"
    assert call.arguments_sha256 not in stale.output, "not offered to be copied back unread"
    assert denied.exit_code == 0, denied.output
    assert "denied, and its result was submitted" in denied.output
    [payload] = accepted_payloads(emulator, session_id)
    assert payload["error"] == DENIED_PREFIX + "wires go through the bank's portal"
    assert again.exit_code == 1
    assert "is submitted: only a call awaiting approval can be approved" in " ".join(again.output.split())


# ------------------------------------------------- an approval is bound to what was seen


def wires(runs: list[dict[str, Any]], approval_timeout: float | None = None) -> ToolRegistry:
    registry = ToolRegistry()

    @registry.tool(approval=True, approval_timeout=approval_timeout)
    def wire(iban: str, cents: int, api_key: str) -> str:
        runs.append({"iban": iban, "cents": cents})
        return f"wired {cents}"

    return registry


WIRE = {"iban": "DE89", "cents": 1_500, "api_key": "sk-live-0123456789abcdef"}


async def awaiting_wire(
    database_url: str, emulator: EmulatorServer, registry: ToolRegistry, count: int = 1
) -> tuple[str, list[CallKey]]:
    session_id, actions = await pending_actions(emulator, [("wire", WIRE)] * count)
    async with running_ledger(registry, database_url, emulator) as ledger:
        for action in actions:
            assert (await ledger.handle(session_id, action)).action == "waiting_for_approval"
    return session_id, [CallKey(session_id, a.turn_id, a.call_id) for a in actions]


async def status_of(database_url: str, emulator: EmulatorServer, key: CallKey) -> CallRecord:
    async with running_ledger(ToolRegistry(), database_url, emulator) as ledger:
        call = await ledger.store.get(key)
    assert call is not None
    return call


async def test_approve_without_sha256__off_a_terminal_or_with_yes__is_a_usage_error_and_changes_nothing(
    database_url: str, emulator: EmulatorServer
) -> None:
    """`calls approve REF --reason x` used to run the call: bound to nothing anyone saw."""
    _, [key] = await awaiting_wire(database_url, emulator, wires([]))
    where = ("--reason", "ok", "--operator", "bo", "--database-url", database_url)
    amended = ("--arguments", json.dumps({**WIRE, "cents": 10}))
    answers = {
        "unbound": await asyncio.to_thread(cli, "calls", "approve", str(key), *where),
        "unbound, amended": await asyncio.to_thread(cli, "calls", "approve", str(key), *amended, *where),
        "--yes": await asyncio.to_thread(cli, "calls", "approve", str(key), "--yes", *where),
    }

    for name, answer in answers.items():
        assert answer.exit_code == 2, (name, answer.output)
        [error] = [line for line in answer.output.splitlines() if line.startswith("Error:")]
        assert "--sha256" in error, name
    assert "--yes approves without showing the arguments" in answers["--yes"].output
    assert "an approval is bound to the arguments you saw" in answers["unbound"].output
    call = await status_of(database_url, emulator, key)
    assert (call.status, call.approval_decided_by) == (CallStatus.AWAITING_APPROVAL, None)


async def test_approve_on_a_terminal__shows_the_masked_arguments__and_approves_by_what_it_showed(
    database_url: str, emulator: EmulatorServer, tmp_path: Path
) -> None:
    """Without --sha256 on a terminal (a real pseudo-terminal, a process of its own): the
    arguments are shown as the views show them, and a yes approves by the fingerprint of what
    was shown; a no changes nothing."""
    _, [yes_key, no_key] = await awaiting_wire(database_url, emulator, wires([]), count=2)

    said_yes = await asyncio.to_thread(on_terminal, database_url, yes_key, "y")
    said_no = await asyncio.to_thread(on_terminal, database_url, no_key, "n")

    approved = await status_of(database_url, emulator, yes_key)
    untouched = await status_of(database_url, emulator, no_key)
    for transcript in (said_yes, said_no):
        assert "with these arguments?" in transcript.text
        assert '"iban": "DE89"' in transcript.text
        assert '"api_key": "[REDACTED]"' in transcript.text
        assert "sk-live" not in transcript.text
        assert "deadline: none" in transcript.text
    assert said_yes.returncode == 0, said_yes.text
    assert "action: left_for_service; status: pending" in said_yes.text
    assert (approved.status, approved.approval_decided_by) == (CallStatus.PENDING, "bo")
    assert said_no.returncode == 1, said_no.text
    assert "not approved: nothing changed" in said_no.text
    assert (untouched.status, untouched.approval_decided_by) == (CallStatus.AWAITING_APPROVAL, None)


async def test_amended_arguments_from_the_cli__need_the_tools__and_never_the_mask(
    database_url: str, emulator: EmulatorServer
) -> None:
    _, [key] = await awaiting_wire(database_url, emulator, wires([]))
    seen = ("--sha256", arguments_fingerprint(WIRE))
    where = ("--reason", "ok", "--operator", "bo", "--database-url", database_url)
    no_tools = await asyncio.to_thread(
        cli, "calls", "approve", str(key), *seen, "--arguments", json.dumps({**WIRE, "cents": 10}), *where
    )
    masked = await asyncio.to_thread(
        cli,
        "calls",
        "approve",
        str(key),
        *seen,
        "--arguments",
        json.dumps({**WIRE, "api_key": "[REDACTED]"}),
        *where,
    )

    assert no_tools.exit_code == 2, no_tools.output
    assert "this process was not given the tools" in no_tools.output
    assert "--tools" in no_tools.output
    assert masked.exit_code == 2, masked.output
    assert "arguments.api_key holds [REDACTED]" in masked.output
    call = await status_of(database_url, emulator, key)
    assert (call.status, call.approved_arguments) == (CallStatus.AWAITING_APPROVAL, None)


async def test_approve_after_the_deadline__exit_3__never_runs__and_serve_answers_it(
    database_url: str, emulator: EmulatorServer
) -> None:
    """The security probe's finding: with `serve` stopped past the deadline, `calls approve
    ... --sha256 ...` answered left_for_service, and the handler ran when `serve` came back."""
    runs: list[dict[str, Any]] = []
    registry = wires(runs, approval_timeout=0.5)
    session_id, [key] = await awaiting_wire(database_url, emulator, registry)
    waiting = await status_of(database_url, emulator, key)
    assert waiting.approval_expires_at is not None
    await asyncio.sleep(max((waiting.approval_expires_at - datetime.now(UTC)).total_seconds(), 0.0) + 0.3)

    late = await asyncio.to_thread(
        cli,
        "calls",
        "approve",
        str(key),
        "--sha256",
        waiting.arguments_sha256,
        "--reason",
        "sorry, late",
        "--operator",
        "bo",
        "--database-url",
        database_url,
    )
    assert late.exit_code == 3, late.output
    assert "was not approved in time" in late.output
    assert (await status_of(database_url, emulator, key)).status is CallStatus.AWAITING_APPROVAL

    settings = Settings(
        database_url=database_url,
        openai_base_url=emulator.base_url,
        worker_id="approvals-serve",
        reconcile_interval_seconds=300.0,
        decision_poll_seconds=0.2,
    )
    async with Service(registry, settings, auto_migrate=False) as service:
        await service.watch(session_id)
        [payload] = await eventually(lambda: accepted_payloads(emulator, session_id), 10.0, "serve answered")
    assert runs == []
    assert payload["error"] == NOT_APPROVED_IN_TIME_MESSAGE


@dataclass(frozen=True)
class Transcript:
    returncode: int
    text: str


def on_terminal(database_url: str, key: CallKey, answer: str) -> Transcript:
    """`toolledger calls approve KEY` without --sha256 in a process whose standard streams are
    a pseudo-terminal; ``answer`` is typed once the question is asked."""
    primary, secondary = pty.openpty()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)])),
    }
    command = [sys.executable, "-m", "toolledger", "calls", "approve", str(key), "--reason", "looked"]
    command += ["--operator", "bo", "--database-url", database_url]
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdin=secondary, stdout=secondary, stderr=secondary, close_fds=True
    )
    os.close(secondary)
    seen = b""
    answered = False
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([primary], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(primary, 4096)
                except OSError:  # the process ended and closed the terminal
                    break
                if not chunk:
                    break
                seen += chunk
            if not answered and b"with these arguments?" in seen:
                os.write(primary, f"{answer}\n".encode())
                answered = True
            if process.poll() is not None and not ready:
                break
        returncode = process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        os.close(primary)
    return Transcript(returncode, seen.decode("utf-8", "replace").replace("\r\n", "\n"))
