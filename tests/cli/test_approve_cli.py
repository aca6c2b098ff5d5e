"""`toolledger calls show / approve / deny` on a call awaiting approval, in process, against a
real ledger (SQLite and PostgreSQL) and the emulator."""

from __future__ import annotations

import asyncio
from typing import Any

from click.testing import CliRunner

from tests.support.executor_harness import pending_actions, running_ledger
from toolledger.cli import main
from toolledger.domain.keys import CallKey
from toolledger.domain.results import DENIED_PREFIX
from toolledger.emulator import EmulatorServer
from toolledger.runtime.registry import ToolRegistry

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
    bad_json = await asyncio.to_thread(
        cli, "calls", "approve", str(key), "--arguments", "{oops", "--reason", "r", "--operator", "bo", *where
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
        cli, "calls", "approve", str(key), "--reason", "r", "--operator", "bo", *where
    )

    assert shown.exit_code == 0
    assert "awaiting_approval: approve it with `toolledger calls approve" in " ".join(shown.output.split())
    assert call.arguments_sha256 in "".join(shown.output.split())
    assert bad_json.exit_code == 2
    assert "amended arguments refused" in bad_json.output
    assert stale.exit_code == 1
    assert "are not those denied" in stale.output
    assert denied.exit_code == 0, denied.output
    assert "denied, and its result was submitted" in denied.output
    [payload] = accepted_payloads(emulator, session_id)
    assert payload["error"] == DENIED_PREFIX + "wires go through the bank's portal"
    assert again.exit_code == 1
    assert "is submitted: only a call awaiting approval can be approved" in " ".join(again.output.split())
