"""An operator's re-run through the HTTP API is answered at once (202), while its handler
still runs, and the call is followed to its end: on SQLite and PostgreSQL, against the
emulator with the real SDK. The handler hangs until the test creates a file."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from tests.support.api_server import FULL, READ, api_settings, serving
from tests.support.calls_cli import add_unknown_call
from tests.support.polling import eventually
from tests.support.serve_process import run_cli
from tests.support.service_tools import registry as service_tools
from tests.support.workload import read_effects, start_sessions
from toolledger.audit.api import create_app
from toolledger.domain.keys import CallKey
from toolledger.emulator import EmulatorServer, Script
from toolledger.gateway.agents import AgentsGateway

ANSWERED_WITHIN = 10.0
"""The 202, however long the handler runs (it used to be held for the whole run: up to the
300 s handler timeout)."""


def let_go(release: Path) -> None:
    release.touch()


async def awaited_call(base_url: str, session_id: str) -> Any:
    """The function call the session awaits (its arguments, ids)."""
    gateway = AgentsGateway.connect(api_key=None, base_url=base_url)
    try:
        (action,) = await eventually(
            lambda: gateway.pending_function_calls(session_id), within=10, what="the session's call"
        )
        return action
    finally:
        await gateway.close()


async def test_http_rerun__answered_202_at_once_while_the_handler_runs__then_followed_to_its_end(
    database_url: str, emulator: EmulatorServer, effects_file: Path, tmp_path: Path
) -> None:
    release = tmp_path / "release"
    [session_id] = await start_sessions(
        emulator, 1, Script.of_calls([("hang_again", {"until_file": str(release)})])
    )
    action = await awaited_call(emulator.base_url, session_id)
    key = CallKey(session_id, action.turn_id, action.call_id)
    arguments = json.loads(action.arguments) if isinstance(action.arguments, str) else action.arguments
    await add_unknown_call(database_url, key, action.name, arguments)
    reference = quote(str(key), safe="")
    # This API has the tools (as `serve --api` does): it runs the call again itself.
    app = create_app(api_settings(database_url, emulator.base_url), registry=service_tools)
    try:
        async with serving(app) as client:
            started = time.monotonic()
            response = await asyncio.wait_for(
                client.post(
                    f"/api/calls/{reference}/resolve",
                    json={"kind": "rerun", "reason": "the mail server has no record of it"},
                    headers=FULL,
                ),
                ANSWERED_WITHIN,
            )
            took = time.monotonic() - started
            assert response.status_code == 202, response.text
            answer = response.json()
            assert answer["action"] == "rerunning"
            assert (answer["call"]["status"], answer["call"]["needs_operator"]) == ("pending", False)

            async def call_now() -> dict[str, Any]:
                detail = await client.get(f"/api/calls/{reference}", headers=READ)
                assert detail.status_code == 200, detail.text
                call: dict[str, Any] = detail.json()["call"]
                return call

            # The handler runs (its effect is on record), and hangs: the call is followed.
            await eventually(
                lambda: [e for e in read_effects(effects_file) if e.tool == "hang_again"],
                within=ANSWERED_WITHIN,
                what="the re-run's handler started",
            )
            running = await call_now()
            assert (running["status"], running["attempts"]) == ("running", 2)
            assert emulator.control.tool_results(session_id) == [], "not answered yet"

            let_go(release)

            async def ended() -> dict[str, Any] | None:
                call = await call_now()
                return call if call["status"] in ("submitted", "abandoned", "unknown") else None

            final = await eventually(ended, within=30, what="the re-run call ended")
            timeline = (await client.get(f"/api/calls/{reference}", headers=READ)).json()["timeline"]
    finally:
        let_go(release)

    assert took < ANSWERED_WITHIN
    assert (final["status"], final["attempts"]) == ("submitted", 2)
    by_operator = [e for e in timeline if e["actor"] == "operator:alice"]
    assert [(e["from_status"], e["to_status"]) for e in by_operator][:1] == [("unknown", "pending")]
    assert "the mail server has no record of it" in (by_operator[0]["reason"] or "")
    [payloads] = emulator.control.accepted_results(session_id).values()
    assert [p["output"] for p in payloads] == ["released again"]
    assert [e.tool for e in read_effects(effects_file)] == ["hang_again"], "run once here"


CLI_TIMEOUT = 6.0
"""The handler timeout the CLI's re-run is bounded by here (TOOLLEDGER_HANDLER_TIMEOUT_SECONDS)."""


async def test_cli_rerun_with_tools__says_how_long_it_has_run_and_ends_at_the_handlers_timeout(
    database_url: str,
    emulator: EmulatorServer,
    effects_file: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`toolledger calls resolve --rerun --tools` runs the call in its own process and waits:
    it prints progress on stderr, and a handler that hangs ends it at the handler's timeout
    (the model told it timed out), not when the handler returns: the process exits with the
    hung thread (it used to wait for it at exit, for ever)."""
    release = tmp_path / "release"
    [session_id] = await start_sessions(
        emulator, 1, Script.of_calls([("hang_again", {"until_file": str(release)})])
    )
    action = await awaited_call(emulator.base_url, session_id)
    key = CallKey(session_id, action.turn_id, action.call_id)
    arguments = json.loads(action.arguments) if isinstance(action.arguments, str) else action.arguments
    await add_unknown_call(database_url, key, action.name, arguments)
    monkeypatch.setenv("TOOLLEDGER_HANDLER_TIMEOUT_SECONDS", str(CLI_TIMEOUT))
    try:
        started = time.monotonic()
        result = await asyncio.to_thread(
            run_cli,
            "calls", "resolve", str(key), "--rerun", "--tools", "tests.support.service_tools:registry",
            "--reason", "never arrived", "--operator", "dana", "--json",
            database_url=database_url, base_url=emulator.base_url, timeout=CLI_TIMEOUT + 40,
        )  # fmt: skip
        took = time.monotonic() - started
    finally:
        let_go(release)

    assert result.returncode == 0, result.stdout + result.stderr
    assert f"re-running {key} (hang_again): running for" in result.stderr, result.stderr
    assert f"it times out after {CLI_TIMEOUT:g}s" in result.stderr
    report = json.loads(result.stdout)
    call = report["call"]
    assert (report["action"], call["status"], call["attempts"]) == ("rerun", "submitted", 2)
    assert took < CLI_TIMEOUT + 30, f"took {took:.1f}s"
    [payloads] = emulator.control.accepted_results(session_id).values()
    assert [p["success"] for p in payloads] == [False], "the model was told it timed out"
    assert [e.tool for e in read_effects(effects_file)] == ["hang_again"]
