"""The executor against the emulator (real SDK over HTTP) and real databases."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import Any

import pydantic
import pytest
from sqlalchemy import Column, Integer, MetaData, String, Table, event, func, select, text

from tests.support.executor_harness import current_actions, pending_actions, running_ledger
from toolledger.domain import delivered as delivered_module
from toolledger.domain import keys
from toolledger.domain.keys import CallKey
from toolledger.domain.records import Recorded
from toolledger.domain.results import (
    FAILED_MESSAGE,
    OUTPUT_FAILED_MESSAGE,
    OUTPUT_TOO_LARGE_MESSAGE,
    TIMEOUT_MESSAGE,
    UNKNOWN_OUTCOME_MESSAGE,
    ToolError,
    succeeded,
)
from toolledger.domain.states import CallStatus, EffectClass
from toolledger.emulator import EmulatorServer
from toolledger.errors import TransactionLostError
from toolledger.runtime import executor as executor_module
from toolledger.runtime.call_runner import CallRunner
from toolledger.runtime.context import ToolContext, Verification
from toolledger.runtime.registry import ToolRegistry
from toolledger.runtime.tool_ledger import ToolLedger
from toolledger.store import ledger as ledger_module
from toolledger.store.engine import create_engine

SECRET = "sk-proj-CANARYCANARYCANARY"  # noqa: S105 - a canary, not a credential


def accepted_payloads(emulator: EmulatorServer, session_id: str) -> list[dict[str, Any]]:
    return [r.payload for r in emulator.control.tool_results(session_id) if r.outcome == "accepted"]


async def test_handle__runs_once_and_gets_exactly_one_accepted_result(
    database_url: str, emulator: EmulatorServer
) -> None:
    registry = ToolRegistry()
    runs: list[str] = []

    @registry.tool(effect="idempotent")
    async def charge_card(cents: int, ctx: ToolContext) -> dict[str, Any]:
        runs.append(ctx.idempotency_key)
        return {"charged": cents}

    session_id, [action] = await pending_actions(emulator, [("charge_card", {"cents": 250})])
    async with running_ledger(registry, database_url, emulator) as ledger:
        report = await ledger.handle(session_id, action)
        call = await ledger.store.get(report.key)

    assert report.action == "executed"
    assert report.submitted
    assert runs == [CallKey(session_id, action.turn_id, action.call_id).idempotency_key]
    assert call is not None
    assert call.status is CallStatus.SUBMITTED
    assert accepted_payloads(emulator, session_id) == [call.payload]
    assert call.payload == {
        "type": "agent.session.input.tool_result",
        "turn_id": action.turn_id,
        "call_id": action.call_id,
        "success": True,
        "output": '{"charged":250}',
    }
    assert await current_actions(emulator, session_id) == []


async def test_handle__repeated_action_resubmits_without_running_again(
    database_url: str, emulator: EmulatorServer
) -> None:
    registry = ToolRegistry()
    side_effects: list[int] = []

    @registry.tool
    def send_mail(to: str) -> str:
        side_effects.append(1)
        return f"sent to {to}"

    session_id, [action] = await pending_actions(emulator, [("send_mail", {"to": "a@example.com"})])
    async with running_ledger(registry, database_url, emulator, resubmit_after_seconds=0) as ledger:
        first = await ledger.handle(session_id, action)
        again = [await ledger.handle(session_id, action) for _ in range(3)]

    assert first.action == "executed"
    assert [r.action for r in again] == ["resubmitted"] * 3
    assert side_effects == [1]
    outcomes = [r.outcome for r in emulator.control.tool_results(session_id)]
    assert outcomes == ["accepted", "replayed", "replayed", "replayed"]
    bodies = {json.dumps(r.payload, sort_keys=True) for r in emulator.control.tool_results(session_id)}
    assert len(bodies) == 1
    assert {r.idempotency_key for r in emulator.control.tool_results(session_id)} == {
        CallKey(session_id, action.turn_id, action.call_id).idempotency_key
    }


async def test_handle__reads_the_delivered_arguments_once(
    sqlite_url: str, emulator: EmulatorServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """They were decoded for the refusal check, and again from the stored text for the run."""
    registry = ToolRegistry()

    @registry.tool
    def send_mail(to: str) -> str:
        return f"sent to {to}"

    decoded: list[str] = []

    def counting(text: str, max_bytes: int) -> dict[str, Any]:
        decoded.append(text)
        return keys.parse_arguments(text, max_bytes)

    def fingerprint_again(arguments: Any) -> str:
        decoded.append(f"fingerprinted again: {arguments}")
        return keys.arguments_fingerprint(arguments)

    for module in (delivered_module, executor_module):
        monkeypatch.setattr(module, "parse_arguments", counting)
    # The ledger is given the delivered call's fingerprint: it must not decode to make its own.
    monkeypatch.setattr(ledger_module, "arguments_fingerprint", fingerprint_again)
    session_id, [action] = await pending_actions(emulator, [("send_mail", {"to": "a@example.com"})])
    async with running_ledger(registry, sqlite_url, emulator) as ledger:
        report = await ledger.handle(session_id, action)

    assert report.action == "executed"
    assert report.submitted
    assert len(decoded) == 1, decoded


async def test_handle__repeated_right_after_submission__is_taken_as_a_stale_listing(
    sqlite_url: str, emulator: EmulatorServer
) -> None:
    registry = ToolRegistry()

    @registry.tool
    def send_mail(to: str) -> str:
        return f"sent to {to}"

    session_id, [action] = await pending_actions(emulator, [("send_mail", {"to": "a@example.com"})])
    async with running_ledger(registry, sqlite_url, emulator, resubmit_after_seconds=60) as ledger:
        await ledger.handle(session_id, action)
        again = await ledger.handle(session_id, action)

    assert again.action == "already_submitted"
    assert [r.outcome for r in emulator.control.tool_results(session_id)] == ["accepted"]


async def test_call_runner__a_submitted_call_listed_by_an_event__is_not_sent_again_but_looked_at(
    sqlite_url: str, emulator: EmulatorServer
) -> None:
    """Past the resubmission window (0 here) a read of the session would send it again; an
    event's listing, which may be any age, only asks for such a read (retry_in=0)."""
    registry, runs = mail_registry()
    session_id, [action] = await pending_actions(emulator, [("send_mail", {"to": "a@example.com"})])
    async with running_ledger(registry, sqlite_url, emulator, resubmit_after_seconds=0) as ledger:
        runner = CallRunner(ledger.executor)
        first = await runner.run(session_id, action)
        dispatched = runner.dispatch(session_id, action, listing_may_be_stale=True)  # as serve's events do
        assert dispatched is not None
        from_event = await dispatched
        from_read = await runner.run(session_id, action)

    assert first is not None
    assert first.action == "executed"
    assert (from_event.action, from_event.submitted, from_event.retry_in) == ("already_submitted", True, 0.0)
    assert from_read is not None
    assert from_read.action == "resubmitted"
    assert runs == ["a@example.com"]
    assert [r.outcome for r in emulator.control.tool_results(session_id)] == ["accepted", "replayed"]


def mail_registry() -> tuple[ToolRegistry, list[str]]:
    """An at_most_once ``send_mail`` tool, and the addresses it really mailed."""
    registry = ToolRegistry()
    runs: list[str] = []

    @registry.tool(effect="at_most_once")
    def send_mail(to: str) -> str:
        runs.append(to)
        return f"sent to {to}"

    return registry, runs


@pytest.mark.parametrize(("window", "asks_the_ledger"), [(60.0, False), (0.0, True)])
async def test_call_runner__a_call_it_saw_accepted_is_not_looked_up_within_the_window(
    window: float, asks_the_ledger: bool, sqlite_url: str, emulator: EmulatorServer
) -> None:
    registry, runs = mail_registry()
    session_id, [action] = await pending_actions(emulator, [("send_mail", {"to": "a@example.com"})])
    async with running_ledger(registry, sqlite_url, emulator, resubmit_after_seconds=window) as ledger:
        runner = CallRunner(ledger.executor)
        first = await runner.run(session_id, action)
        statements: list[str] = []
        event.listen(ledger.engine.sync_engine, "before_cursor_execute", lambda *a: statements.append(a[2]))
        again = await runner.run(session_id, action)

    assert first is not None
    assert first.action == "executed"
    assert first.submitted
    assert again is not None
    assert again.submitted
    assert runs == ["a@example.com"]
    assert bool(statements) is asks_the_ledger
    assert again.action == ("resubmitted" if asks_the_ledger else "already_submitted")
    # Sent again past the window: the same Idempotency-Key, answered from the API's record.
    outcomes = [r.outcome for r in emulator.control.tool_results(session_id)]
    assert outcomes == (["accepted", "replayed"] if asks_the_ledger else ["accepted"])


@pytest.mark.parametrize("snapshot_matches", [True, False], ids=["same-arguments", "other-arguments"])
async def test_handle__a_stored_result_in_the_reconcilers_snapshot__is_sent_without_recording_again(
    snapshot_matches: bool, database_url: str, emulator: EmulatorServer
) -> None:
    registry, runs = mail_registry()
    session_id, [action] = await pending_actions(emulator, [("send_mail", {"to": "a@example.com"})])
    key = CallKey(session_id, action.turn_id, action.call_id)
    async with running_ledger(registry, database_url, emulator) as ledger:
        # What a worker killed between its result's commit and the submission leaves.
        recorded = await ledger.store.record(
            key,
            tool_name="send_mail",
            arguments=action.arguments,
            effect_class=EffectClass.AT_MOST_ONCE,
            lease_seconds=30,
        )
        stored = await ledger.store.complete(key, recorded.call.lease_token, succeeded(key, "sent earlier"))
        known = stored if snapshot_matches else replace(stored, arguments_sha256="0" * 64)
        # The store's own record(), watched (it still writes): on PostgreSQL the hot statements
        # run on psycopg directly, out of SQLAlchemy's statement events.
        recording = ledger.store.record
        records: list[CallKey] = []

        async def watched_record(key: CallKey, **given: Any) -> Recorded:
            records.append(key)
            return await recording(key, **given)

        ledger.store.record = watched_record  # type: ignore[method-assign]
        report = await ledger.executor.handle(session_id, action, known)
        after = await ledger.store.get(key)

    assert report.action == "resubmitted"
    assert runs == [], "a stored result is never re-run"
    assert [p["output"] for p in accepted_payloads(emulator, session_id)] == ["sent earlier"]
    assert after is not None
    assert after.status is CallStatus.SUBMITTED
    recorded_again = records == [key]
    # A snapshot whose arguments differ from the delivery proves nothing: the call is recorded
    # (and its arguments compared) as usual.
    assert recorded_again is not snapshot_matches


class Receipt(pydantic.BaseModel):
    order_id: str
    total: int


@pytest.mark.parametrize(
    ("returned", "expected_output"),
    [
        ("plain text", "plain text"),
        ({"a": 1}, '{"a":1}'),
        ([1, 2, 3], "[1,2,3]"),
        (7, "7"),
        (Receipt(order_id="A1", total=3), '{"order_id":"A1","total":3}'),
        ([{"type": "input_text", "text": "hi"}], [{"type": "input_text", "text": "hi"}]),
    ],
)
async def test_outputs__are_sent_as_the_api_takes_them(
    sqlite_url: str, emulator: EmulatorServer, returned: Any, expected_output: Any
) -> None:
    registry = ToolRegistry()
    registry.tool(name="produce")(lambda: returned)  # a sync lambda with no parameters

    session_id, [action] = await pending_actions(emulator, [("produce", {})])
    async with running_ledger(registry, sqlite_url, emulator) as ledger:
        await ledger.handle(session_id, action)

    [payload] = accepted_payloads(emulator, session_id)
    assert payload["success"] is True
    assert payload["output"] == expected_output


def _registry_of_failures() -> ToolRegistry:
    registry = ToolRegistry()

    @registry.tool
    def declined(cents: int) -> str:
        raise ToolError(f"card declined for {cents} cents")

    @registry.tool
    def crashes(cents: int) -> str:
        raise RuntimeError(f"database password {SECRET} rejected")

    @registry.tool(timeout=0.2)
    async def hangs() -> str:
        await asyncio.sleep(30)
        return "never"

    @registry.tool
    def unserializable() -> object:
        return {"when": object()}

    @registry.tool
    def huge() -> str:
        return "x" * 5000

    @registry.tool
    def typed(cents: int, currency: str) -> str:
        return "never reached"

    return registry


@pytest.mark.parametrize(
    ("name", "arguments", "error", "stage"),
    [
        ("typed", "{not json", "Invalid arguments: expected a JSON object.", "arguments"),
        ("typed", "[1, 2]", "Invalid arguments: expected a JSON object.", "arguments"),
        (
            "typed",
            {"cents": "lots"},
            "Invalid arguments: cents: Input should be a valid integer",
            "arguments",
        ),
        ("typed", {"cents": 1}, "Invalid arguments: currency: Field required", "arguments"),
        (
            "typed",
            {"cents": 1, "currency": "EUR", "extra": 1},
            "Invalid arguments: extra: Extra inputs",
            "arguments",
        ),
        ("no_such_tool", {}, "Unknown tool: no_such_tool", "lookup"),
        ("declined", {"cents": 5}, "card declined for 5 cents", "execution"),
        ("crashes", {"cents": 5}, FAILED_MESSAGE, "execution"),
        ("hangs", {}, TIMEOUT_MESSAGE, "timeout"),
        ("unserializable", {}, OUTPUT_FAILED_MESSAGE, "output"),
        ("huge", {}, OUTPUT_TOO_LARGE_MESSAGE, "output"),
    ],
)
async def test_bad_input_and_failures__each_give_a_clear_failure_result(
    sqlite_url: str, emulator: EmulatorServer, name: str, arguments: Any, error: str, stage: str
) -> None:
    session_id, [action] = await pending_actions(emulator, [(name, arguments)])
    async with running_ledger(_registry_of_failures(), sqlite_url, emulator, max_output_bytes=1000) as ledger:
        report = await ledger.handle(session_id, action)
        call = await ledger.store.get(report.key)

    assert call is not None
    assert call.status is CallStatus.SUBMITTED
    assert call.error_stage == stage
    [payload] = accepted_payloads(emulator, session_id)
    assert payload["success"] is False
    assert payload["error"].startswith(error)
    assert SECRET not in json.dumps(payload)


async def test_unexpected_exception__traceback_is_audited_redacted_and_never_sent(
    sqlite_url: str, emulator: EmulatorServer
) -> None:
    session_id, [action] = await pending_actions(emulator, [("crashes", {"cents": 1})])
    async with running_ledger(_registry_of_failures(), sqlite_url, emulator) as ledger:
        report = await ledger.handle(session_id, action)
        call = await ledger.store.get(report.key)

    assert call is not None
    assert call.error_detail is not None
    assert "RuntimeError" in call.error_detail
    assert "rejected" in call.error_detail
    assert SECRET not in call.error_detail
    assert [r.payload["error"] for r in emulator.control.tool_results(session_id)] == [FAILED_MESSAGE]


async def test_redelivery_with_other_arguments__is_refused_and_flagged(
    sqlite_url: str, emulator: EmulatorServer
) -> None:
    registry = ToolRegistry()
    runs: list[int] = []

    @registry.tool
    def charge_card(cents: int) -> str:
        runs.append(cents)
        return "ok"

    session_id, [action] = await pending_actions(emulator, [("charge_card", {"cents": 1})])
    tampered = action.model_copy(update={"arguments": {"cents": 1_000_000}})
    async with running_ledger(registry, sqlite_url, emulator) as ledger:
        await ledger.handle(session_id, action)
        report = await ledger.handle(session_id, tampered)
        events = await ledger.store.events(report.key)

    assert report.action == "refused_arguments_mismatch"
    assert runs == [1]
    assert "arguments_mismatch" in [e.kind for e in events]
    assert len(accepted_payloads(emulator, session_id)) == 1


async def test_parallel_calls__of_a_step_run_concurrently(sqlite_url: str, emulator: EmulatorServer) -> None:
    registry = ToolRegistry()

    @registry.tool(effect="read_only")
    async def slow_lookup(n: int) -> int:
        await asyncio.sleep(0.3)
        return n

    session_id, actions = await pending_actions(emulator, [("slow_lookup", {"n": i}) for i in range(5)])
    async with running_ledger(registry, sqlite_url, emulator) as ledger:
        started = asyncio.get_running_loop().time()
        reports = await asyncio.gather(*(ledger.handle(session_id, a) for a in actions))
        elapsed = asyncio.get_running_loop().time() - started

    assert {r.action for r in reports} == {"executed"}
    assert sorted(p["output"] for p in accepted_payloads(emulator, session_id)) == ["0", "1", "2", "3", "4"]
    assert elapsed < 1.2, "five 0.3 s calls ran one after another"


# ---------------------------------------------------------------- transactional


effects = Table("effects", MetaData(), Column("id", Integer, primary_key=True), Column("note", String(50)))


async def _create_effects_table(url: str) -> None:
    engine = create_engine(url)
    async with engine.begin() as conn:
        await conn.run_sync(effects.metadata.create_all)
    await engine.dispose()


async def _count_effects(url: str) -> int:
    engine = create_engine(url)
    async with engine.connect() as conn:
        count = (await conn.execute(select(func.count()).select_from(effects))).scalar_one()
    await engine.dispose()
    return int(count)


@pytest.mark.parametrize("style", ["async", "sync"])
async def test_transactional_tool__writes_and_result_commit_together(
    database_url: str, emulator: EmulatorServer, style: str
) -> None:
    await _create_effects_table(database_url)
    registry = ToolRegistry()
    if style == "async":

        @registry.tool(effect="transactional")
        async def record_refund(cents: int, ctx: ToolContext) -> str:
            await ctx.db.execute(effects.insert().values(note=f"refund {cents}"))
            return "refunded"

    else:

        @registry.tool(effect="transactional")
        def record_refund(cents: int, ctx: ToolContext) -> str:
            ctx.db.execute(effects.insert().values(note=f"refund {cents}"))
            return "refunded"

    session_id, [action] = await pending_actions(emulator, [("record_refund", {"cents": 9})])
    async with running_ledger(registry, database_url, emulator) as ledger:
        report = await ledger.handle(session_id, action)

    assert report.status is CallStatus.SUCCEEDED
    assert report.submitted
    assert await _count_effects(database_url) == 1


async def test_transactional_tool__failure_rolls_back_its_writes_but_keeps_the_failure(
    sqlite_url: str, emulator: EmulatorServer
) -> None:
    await _create_effects_table(sqlite_url)
    registry = ToolRegistry()

    @registry.tool(effect="transactional")
    async def record_refund(cents: int, ctx: ToolContext) -> str:
        await ctx.db.execute(effects.insert().values(note="half done"))
        raise ToolError("refund limit exceeded")

    session_id, [action] = await pending_actions(emulator, [("record_refund", {"cents": 9})])
    async with running_ledger(registry, sqlite_url, emulator) as ledger:
        report = await ledger.handle(session_id, action)

    assert report.status is CallStatus.FAILED
    assert await _count_effects(sqlite_url) == 0
    assert accepted_payloads(emulator, session_id)[0]["error"] == "refund limit exceeded"


async def test_transactional_tool__database_connection_lost_under_it__is_not_answered_as_its_failure(
    postgres_url: str, emulator: EmulatorServer
) -> None:
    """A database restart under a transactional handler loses its writes: that is an outage,
    not the tool failing. The call is run again once taken over; the model never hears of it."""
    await _create_effects_table(postgres_url)
    registry = ToolRegistry()

    @registry.tool(effect="transactional")
    async def record_refund(cents: int, ctx: ToolContext) -> str:
        await ctx.db.execute(effects.insert().values(note=f"refund {cents}"))
        if ctx.attempt == 1:  # the server drops this connection, as a restart would
            await ctx.db.execute(text("SELECT pg_terminate_backend(pg_backend_pid())"))
        return "refunded"

    session_id, [action] = await pending_actions(emulator, [("record_refund", {"cents": 9})])
    async with running_ledger(registry, postgres_url, emulator, lease_seconds=0.5) as ledger:
        with pytest.raises(TransactionLostError):
            await ledger.handle(session_id, action)
        await asyncio.sleep(0.7)
        report = await ledger.recover()
        key = CallKey(session_id, action.turn_id, action.call_id)
        call = await ledger.store.get(key)

    assert report.actions["rerun"] == 1
    assert call is not None
    assert (call.status, call.attempt_count) == (CallStatus.SUBMITTED, 2)
    assert [p.get("output") for p in accepted_payloads(emulator, session_id)] == ["refunded"]
    assert await _count_effects(postgres_url) == 1


# --------------------------------------------------------------- unknown outcomes


async def _interrupted(ledger: ToolLedger, session_id: str, action: Any, effect: EffectClass) -> CallKey:
    """The ledger as a worker leaves it when it dies mid-call: claimed, lease running out."""
    key = CallKey(session_id, action.turn_id, action.call_id)
    await ledger.store.record(
        key, tool_name=action.name, arguments=action.arguments, effect_class=effect, lease_seconds=0.05
    )
    await asyncio.sleep(0.15)
    return key


async def test_unknown_idempotent_call__is_run_again_with_the_same_key(
    database_url: str, emulator: EmulatorServer
) -> None:
    registry = ToolRegistry()
    seen: list[tuple[str, int]] = []

    @registry.tool(effect="idempotent")
    def send_receipt(to: str, ctx: ToolContext) -> str:
        seen.append((ctx.idempotency_key, ctx.attempt))
        return "sent"

    session_id, [action] = await pending_actions(emulator, [("send_receipt", {"to": "x"})])
    async with running_ledger(registry, database_url, emulator) as ledger:
        key = await _interrupted(ledger, session_id, action, EffectClass.IDEMPOTENT)
        report = await ledger.recover()
        call = await ledger.store.get(key)

    assert report.expired == 1
    assert report.actions["rerun"] == 1
    assert seen == [(key.idempotency_key, 2)]
    assert call is not None
    assert call.status is CallStatus.SUBMITTED
    assert len(accepted_payloads(emulator, session_id)) == 1


async def test_call_for_an_unregistered_tool__is_stored_as_unregistered_and_answered_with_a_lookup_failure(
    database_url: str, emulator: EmulatorServer
) -> None:
    session_id, [action] = await pending_actions(emulator, [("no_such_tool", {"cents": 1})])
    async with running_ledger(ToolRegistry(), database_url, emulator) as ledger:
        report = await ledger.handle(session_id, action)
        call = await ledger.store.get(report.key)

    assert call is not None
    assert call.effect_class is EffectClass.UNREGISTERED
    assert (call.status, call.error_stage) == (CallStatus.SUBMITTED, "lookup")


async def test_unregistered_call_cut_off_by_a_crash__keeps_its_lookup_failure_once_the_tool_is_registered(
    database_url: str, emulator: EmulatorServer
) -> None:
    """A deployment that adds the tool must not change the answer to a call that arrived
    before it: the call was recorded unregistered, so no handler ever runs for it."""
    registry = ToolRegistry()
    runs: list[int] = []

    @registry.tool(effect="idempotent")
    def late_tool(cents: int) -> str:
        runs.append(cents)
        return "ran"

    session_id, [action] = await pending_actions(emulator, [("late_tool", {"cents": 1})])
    async with running_ledger(registry, database_url, emulator) as ledger:
        key = await _interrupted(ledger, session_id, action, EffectClass.UNREGISTERED)
        report = await ledger.recover()
        call = await ledger.store.get(key)

    assert report.actions["rerun"] == 1
    assert runs == []
    assert call is not None
    assert (call.status, call.error_stage) == (CallStatus.SUBMITTED, "lookup")
    [payload] = accepted_payloads(emulator, session_id)
    assert payload["error"] == "Unknown tool: late_tool"


async def test_unknown_at_most_once_call__waits_for_an_operator(
    sqlite_url: str, emulator: EmulatorServer
) -> None:
    registry = ToolRegistry()
    runs: list[int] = []

    @registry.tool
    def charge_card(cents: int) -> str:
        runs.append(cents)
        return "charged"

    session_id, [action] = await pending_actions(emulator, [("charge_card", {"cents": 1})])
    async with running_ledger(registry, sqlite_url, emulator) as ledger:
        key = await _interrupted(ledger, session_id, action, EffectClass.AT_MOST_ONCE)
        first = await ledger.recover()
        second = await ledger.handle(session_id, action)  # redelivered: still not re-run
        call = await ledger.store.get(key)

    assert first.actions["waiting_for_operator"] == 1
    assert second.action == "waiting_for_operator"
    assert runs == []
    assert call is not None
    assert call.status is CallStatus.UNKNOWN
    assert accepted_payloads(emulator, session_id) == []


async def test_unknown_at_most_once_call__past_its_deadline_gets_a_fixed_failure(
    sqlite_url: str, emulator: EmulatorServer
) -> None:
    registry = ToolRegistry()

    @registry.tool(unknown_deadline=0)
    def charge_card(cents: int) -> str:
        raise AssertionError("must not run")

    session_id, [action] = await pending_actions(emulator, [("charge_card", {"cents": 1})])
    async with running_ledger(registry, sqlite_url, emulator) as ledger:
        await _interrupted(ledger, session_id, action, EffectClass.AT_MOST_ONCE)
        report = await ledger.recover()

    assert report.actions["settled"] == 1
    [payload] = accepted_payloads(emulator, session_id)
    assert payload == {
        "type": "agent.session.input.tool_result",
        "turn_id": action.turn_id,
        "call_id": action.call_id,
        "success": False,
        "error": UNKNOWN_OUTCOME_MESSAGE,
    }


@pytest.mark.parametrize("answer", ["executed", "not_executed", "unknown"])
async def test_unknown_verified_call__is_settled_by_its_verify_hook(
    sqlite_url: str, emulator: EmulatorServer, answer: str
) -> None:
    runs: list[str] = []
    asked: list[str] = []

    def verify(ctx: ToolContext) -> Verification:
        asked.append(ctx.idempotency_key)
        if answer == "executed":
            return Verification.executed({"charge": "ch_1"})
        return Verification.not_executed() if answer == "not_executed" else Verification.unknown()

    registry = ToolRegistry()

    @registry.tool(effect="verified", verify=verify)
    def charge_card(cents: int, ctx: ToolContext) -> dict[str, str]:
        runs.append(ctx.idempotency_key)
        return {"charge": "ch_2"}

    session_id, [action] = await pending_actions(emulator, [("charge_card", {"cents": 1})])
    async with running_ledger(registry, sqlite_url, emulator) as ledger:
        key = await _interrupted(ledger, session_id, action, EffectClass.VERIFIED)
        await ledger.recover()
        call = await ledger.store.get(key)

    assert asked == [key.idempotency_key]
    assert call is not None
    payloads = accepted_payloads(emulator, session_id)
    if answer == "executed":
        assert runs == []
        assert [p["output"] for p in payloads] == ['{"charge":"ch_1"}']
    elif answer == "not_executed":
        assert runs == [key.idempotency_key]
        assert [p["output"] for p in payloads] == ['{"charge":"ch_2"}']
    else:
        assert runs == []
        assert payloads == []
        assert call.status is CallStatus.UNKNOWN


async def test_poison_call__is_given_up_after_max_attempts(sqlite_url: str, emulator: EmulatorServer) -> None:
    registry = ToolRegistry()

    @registry.tool(effect="idempotent", max_attempts=1)
    def flaky() -> str:
        raise AssertionError("must not run again")

    session_id, [action] = await pending_actions(emulator, [("flaky", {})])
    async with running_ledger(registry, sqlite_url, emulator) as ledger:
        await _interrupted(ledger, session_id, action, EffectClass.IDEMPOTENT)
        report = await ledger.recover()

    assert report.actions["settled"] == 1
    assert accepted_payloads(emulator, session_id)[0]["success"] is False


async def test_transient_errors__are_retried_for_idempotent_tools(
    sqlite_url: str, emulator: EmulatorServer
) -> None:
    registry = ToolRegistry()
    attempts: list[int] = []

    @registry.tool(effect="idempotent", retries=2)
    def flaky_lookup() -> str:
        attempts.append(1)
        if len(attempts) < 3:
            raise ConnectionError("downstream reset")
        return "found"

    session_id, [action] = await pending_actions(emulator, [("flaky_lookup", {})])
    async with running_ledger(registry, sqlite_url, emulator) as ledger:
        await ledger.handle(session_id, action)

    assert len(attempts) == 3
    assert accepted_payloads(emulator, session_id)[0]["output"] == "found"


async def test_heartbeats__keep_a_long_handler_from_becoming_unknown(
    sqlite_url: str, emulator: EmulatorServer
) -> None:
    registry = ToolRegistry()

    @registry.tool
    async def long_job() -> str:
        await asyncio.sleep(0.8)
        return "done"

    session_id, [action] = await pending_actions(emulator, [("long_job", {})])
    async with running_ledger(registry, sqlite_url, emulator, lease_seconds=0.3) as ledger:
        handling = asyncio.create_task(ledger.handle(session_id, action))
        await asyncio.sleep(0.5)
        expired = await ledger.store.expire_leases()  # another replica's recovery pass
        report = await handling

    assert expired == []
    assert report.status is CallStatus.SUCCEEDED


async def test_submission_faults__are_retried_with_the_same_key_and_body(
    sqlite_url: str, emulator: EmulatorServer
) -> None:
    registry = ToolRegistry()
    registry.tool(name="ping", effect="read_only")(lambda: "pong")
    session_id, [action] = await pending_actions(emulator, [("ping", {})])
    emulator.control.fail_submissions(2, status=503)
    emulator.control.accept_then_drop(session_id=session_id)

    async with running_ledger(registry, sqlite_url, emulator) as ledger:
        report = await ledger.handle(session_id, action)

    assert report.submitted
    receipts = emulator.control.tool_results(session_id)
    assert [r.outcome for r in receipts] == ["rejected", "rejected", "accepted", "replayed"]
    assert len({r.idempotency_key for r in receipts}) == 1
    assert len({json.dumps(r.payload, sort_keys=True) for r in receipts}) == 1


async def test_pending_call_race__is_retried_inline(sqlite_url: str, emulator: EmulatorServer) -> None:
    registry = ToolRegistry()
    registry.tool(name="ping", effect="read_only")(lambda: "pong")
    session_id, [action] = await pending_actions(emulator, [("ping", {})])
    emulator.control.unknown_pending(3, session_id=session_id)

    async with running_ledger(registry, sqlite_url, emulator) as ledger:
        report = await ledger.handle(session_id, action)

    assert report.submitted
    assert [r.outcome for r in emulator.control.tool_results(session_id)][-1] == "accepted"


async def test_unsubmittable_result__stays_stored_for_the_reconciler(
    sqlite_url: str, emulator: EmulatorServer
) -> None:
    registry = ToolRegistry()
    registry.tool(name="ping", effect="read_only")(lambda: "pong")
    session_id, [action] = await pending_actions(emulator, [("ping", {})])
    emulator.control.fail_submissions(50, status=500)

    async with running_ledger(registry, sqlite_url, emulator, submit_attempts=2) as ledger:
        report = await ledger.handle(session_id, action)
        call = await ledger.store.get(report.key)
        emulator.control.clear_faults()
        recovered = await ledger.recover()
        after = await ledger.store.get(report.key)

    assert not report.submitted
    assert call is not None
    assert call.status is CallStatus.SUCCEEDED
    assert call.submission_count == 1
    assert call.last_submission_error is not None
    assert recovered.actions["resubmitted"] == 1
    assert after is not None
    assert after.status is CallStatus.SUBMITTED


async def test_deleted_session__abandons_its_stored_result(sqlite_url: str, emulator: EmulatorServer) -> None:
    registry = ToolRegistry()
    registry.tool(name="ping", effect="read_only")(lambda: "pong")
    session_id, [action] = await pending_actions(emulator, [("ping", {})])
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=emulator.base_url, api_key="x") as client:
        await client.beta.agents.sessions.delete(session_id)
    async with running_ledger(registry, sqlite_url, emulator) as ledger:
        report = await ledger.handle(session_id, action)
        call = await ledger.store.get(report.key)

    assert call is not None
    assert call.status is CallStatus.ABANDONED
    assert call.abandoned_reason is not None
    assert call.abandoned_reason == "session deleted"
