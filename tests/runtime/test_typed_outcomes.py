"""Handlers that say what happened to their side effect (``NotExecuted``, ``MaybeExecuted``),
run through a real ToolLedger against the emulator (the real SDK over HTTP) on SQLite and
PostgreSQL, and settled by an operator with the real CLI."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from sqlalchemy import Column, Integer, MetaData, String, Table, func, select

from tests.support.calls_cli import cli
from tests.support.executor_harness import pending_actions, running_ledger
from tests.support.http_faults import faulty_server, never_answers, refusing_port
from toolledger import (
    MaybeExecuted,
    NotExecuted,
    ToolContext,
    ToolRegistry,
    Verification,
    classified_http_errors,
)
from toolledger.domain.keys import CallKey
from toolledger.domain.records import CallEvent
from toolledger.domain.results import NOT_EXECUTED_MESSAGE, POISON_MESSAGE, UNKNOWN_OUTCOME_MESSAGE
from toolledger.domain.states import CallStatus
from toolledger.emulator import EmulatorServer
from toolledger.store.engine import create_engine
from toolledger.store.ledger import LedgerStore

SECRET = "sk-proj-CANARYCANARYCANARY"  # noqa: S105 - a canary, not a credential


def accepted_payloads(emulator: EmulatorServer, session_id: str) -> list[dict[str, Any]]:
    return [r.payload for r in emulator.control.tool_results(session_id) if r.outcome == "accepted"]


def moves(events: list[CallEvent]) -> list[tuple[str | None, str | None, int | None]]:
    """The status changes of a call's audit trail, with the lease token of each."""
    return [
        (e.from_status, e.to_status, e.lease_token) for e in events if e.kind in ("transition", "submission")
    ]


def reason_of(events: list[CallEvent], from_status: str, to_status: str) -> str:
    [event] = [e for e in events if (e.from_status, e.to_status) == (from_status, to_status)]
    assert event.reason is not None
    return event.reason


# ------------------------------------------------------------------------------ NotExecuted


async def test_not_executed_once__an_at_most_once_tool_runs_twice_and_answers_once(
    database_url: str, emulator: EmulatorServer
) -> None:
    registry = ToolRegistry()
    runs: list[int] = []

    @registry.tool(retries=2)
    def charge_card(cents: int, ctx: ToolContext) -> dict[str, int]:
        runs.append(ctx.attempt)
        if len(runs) == 1:
            raise NotExecuted("the payment service refused the connection")
        return {"charged": cents}

    session_id, [action] = await pending_actions(emulator, [("charge_card", {"cents": 250})])
    async with running_ledger(registry, database_url, emulator) as ledger:
        report = await ledger.handle(session_id, action)
        call = await ledger.store.get(report.key)
        events = await ledger.store.events(report.key)

    assert (report.action, report.submitted) == ("executed", True)
    assert runs == [1, 1], "run again within its one claim"
    assert call is not None
    assert (call.status, call.attempt_count) == (CallStatus.SUBMITTED, 1)
    assert accepted_payloads(emulator, session_id) == [call.payload]
    assert call.payload is not None
    assert call.payload["output"] == '{"charged":250}'
    assert moves(events) == [(None, "running", 1), ("running", "succeeded", 1), ("succeeded", "submitted", 1)]
    assert reason_of(events, "running", "succeeded") == (
        "handler returned (run 2 times within its claim; again after NotExecuted)"
    )


@pytest.mark.parametrize("retries", [0, 2])
async def test_not_executed_always__fails_cleanly_with_its_message(
    database_url: str, emulator: EmulatorServer, retries: int
) -> None:
    registry = ToolRegistry()
    runs: list[int] = []

    @registry.tool(retries=retries)
    def charge_card(cents: int) -> str:
        runs.append(cents)
        try:
            raise ConnectionRefusedError(f"refused by payments.internal (api key {SECRET})")
        except ConnectionRefusedError as error:
            raise NotExecuted(
                f"The payment service is unreachable; nothing was charged ({SECRET})."
            ) from error

    session_id, [action] = await pending_actions(emulator, [("charge_card", {"cents": 250})])
    async with running_ledger(registry, database_url, emulator) as ledger:
        report = await ledger.handle(session_id, action)
        call = await ledger.store.get(report.key)
        events = await ledger.store.events(report.key)

    assert runs == [250] * (retries + 1)
    assert call is not None
    assert (call.status, call.error_stage) == (CallStatus.SUBMITTED, "not_executed")
    [payload] = accepted_payloads(emulator, session_id)
    assert payload["success"] is False
    assert payload["error"].startswith("The payment service is unreachable; nothing was charged (")
    assert "payments.internal" not in json.dumps(payload), "the cause's text never reaches the model"
    assert SECRET not in json.dumps(payload)
    assert call.error_detail is not None
    assert "ConnectionRefusedError" in call.error_detail, "the audit trail keeps what it was raised from"
    assert SECRET not in call.error_detail
    failed_reason = reason_of(events, "running", "failed")
    if retries:
        assert (
            failed_reason
            == "not_executed (run 3 times within its claim; again after NotExecuted, NotExecuted)"
        )
    else:
        assert failed_reason == "not_executed"


async def test_not_executed_without_a_message__tells_the_model_the_fixed_one(
    sqlite_url: str, emulator: EmulatorServer
) -> None:
    registry = ToolRegistry()

    @registry.tool
    def charge_card(cents: int) -> str:
        raise NotExecuted("")

    session_id, [action] = await pending_actions(emulator, [("charge_card", {"cents": 1})])
    async with running_ledger(registry, sqlite_url, emulator) as ledger:
        await ledger.handle(session_id, action)

    [payload] = accepted_payloads(emulator, session_id)
    assert payload["error"] == NOT_EXECUTED_MESSAGE


# ---------------------------------------------------------------------------- MaybeExecuted


async def test_maybe_executed__at_most_once_becomes_unknown_waits_for_the_operator_who_settles_it(
    database_url: str, emulator: EmulatorServer
) -> None:
    registry = ToolRegistry()
    runs: list[int] = []

    @registry.tool(retries=3)  # counts NotExecuted alone: a doubt is never run again
    def charge_card(cents: int) -> str:
        runs.append(cents)
        raise MaybeExecuted(f"the charge request was sent, then the answer timed out (key {SECRET})")

    session_id, [action] = await pending_actions(emulator, [("charge_card", {"cents": 250})])
    key = CallKey(session_id, action.turn_id, action.call_id)
    async with running_ledger(registry, database_url, emulator) as ledger:
        first = await ledger.handle(session_id, action)
        redelivered = await ledger.handle(session_id, action)
        recovered = await ledger.recover()
        waiting = await ledger.store.get(key)
        events = await ledger.store.events(key)

    assert (first.action, first.status, first.submitted) == (
        "waiting_for_operator",
        CallStatus.UNKNOWN,
        False,
    )
    assert redelivered.action == "waiting_for_operator"
    assert recovered.actions["waiting_for_operator"] == 1
    assert runs == [250], "an at_most_once call in doubt is never run again"
    assert waiting is not None
    assert (waiting.status, waiting.lease_token, waiting.result) == (CallStatus.UNKNOWN, 1, None)
    assert accepted_payloads(emulator, session_id) == [], "the model is never told it failed"
    assert moves(events) == [(None, "running", 1), ("running", "unknown", 1)]
    [doubt] = [e for e in events if e.to_status == "unknown"]
    assert doubt.reason is not None
    assert doubt.reason.startswith(
        "handler raised MaybeExecuted: the charge request was sent, then the answer"
    )
    assert doubt.detail is not None
    assert "MaybeExecuted" in doubt.detail
    assert SECRET not in doubt.reason + doubt.detail

    settled = await asyncio.to_thread(
        cli,
        database_url,
        "resolve",
        str(key),
        "--output",
        '{"charged": 250, "checked": "with the bank"}',
        "--reason",
        "the bank shows the charge",
        "--operator",
        "alice",
        base_url=emulator.base_url,
    )

    assert settled.exit_code == 0, settled.output
    [payload] = accepted_payloads(emulator, session_id)
    assert payload["output"] == '{"charged": 250, "checked": "with the bank"}'
    engine = create_engine(database_url)
    try:
        store = LedgerStore(engine, actor="test")
        final = await store.get(key)
        trail = await store.events(key)
    finally:
        await engine.dispose()
    assert final is not None
    assert final.status is CallStatus.SUBMITTED
    assert moves(trail)[-2:] == [("unknown", "succeeded", 1), ("succeeded", "submitted", 1)]
    assert "the bank shows the charge" in reason_of(trail, "unknown", "succeeded")
    assert runs == [250]


async def test_maybe_executed__at_most_once_with_a_deadline_of_0__gets_the_fixed_failure_at_once(
    sqlite_url: str, emulator: EmulatorServer
) -> None:
    registry = ToolRegistry()

    @registry.tool(unknown_deadline=0)
    def charge_card(cents: int) -> str:
        raise MaybeExecuted("answer timed out")

    session_id, [action] = await pending_actions(emulator, [("charge_card", {"cents": 1})])
    async with running_ledger(registry, sqlite_url, emulator) as ledger:
        report = await ledger.handle(session_id, action)

    assert (report.action, report.submitted) == ("settled", True)
    [payload] = accepted_payloads(emulator, session_id)
    assert payload["error"] == UNKNOWN_OUTCOME_MESSAGE


@pytest.mark.parametrize("answer", ["executed", "not_executed", "unknown"])
async def test_maybe_executed__a_verified_tool_is_settled_by_its_verify_hook(
    database_url: str, emulator: EmulatorServer, answer: str
) -> None:
    asked: list[int] = []
    runs: list[int] = []

    def verify(ctx: ToolContext) -> Verification:
        asked.append(ctx.attempt)
        if answer == "executed":
            return Verification.executed({"charge": "ch_1"})
        return Verification.not_executed() if answer == "not_executed" else Verification.unknown()

    registry = ToolRegistry()

    @registry.tool(effect="verified", verify=verify, retries=2)
    def charge_card(cents: int, ctx: ToolContext) -> dict[str, str]:
        runs.append(ctx.attempt)
        if ctx.attempt == 1:
            raise MaybeExecuted("the answer timed out")
        return {"charge": "ch_2"}

    session_id, [action] = await pending_actions(emulator, [("charge_card", {"cents": 1})])
    key = CallKey(session_id, action.turn_id, action.call_id)
    async with running_ledger(registry, database_url, emulator) as ledger:
        report = await ledger.handle(session_id, action)
        call = await ledger.store.get(key)
        events = await ledger.store.events(key)

    assert asked == [1], "asked at once, about the first run"
    assert call is not None
    assert moves(events)[:2] == [(None, "running", 1), ("running", "unknown", 1)]
    outputs = [p["output"] for p in accepted_payloads(emulator, session_id)]
    if answer == "executed":
        assert (report.action, runs, outputs) == ("settled", [1], ['{"charge":"ch_1"}'])
        assert reason_of(events, "unknown", "succeeded") == "verify hook: the first run happened"
    elif answer == "not_executed":
        assert (report.action, runs, outputs) == ("rerun", [1, 2], ['{"charge":"ch_2"}'])
        assert moves(events)[2:4] == [("unknown", "running", 2), ("running", "succeeded", 2)]
    else:
        assert (report.action, runs, outputs) == ("waiting_for_operator", [1], [])
        assert call.status is CallStatus.UNKNOWN
        assert report.retry_in is not None, "the hook is asked again later"


async def test_maybe_executed__an_idempotent_tool_is_run_again_as_an_unknown_call(
    database_url: str, emulator: EmulatorServer
) -> None:
    registry = ToolRegistry()
    seen: list[tuple[str, int]] = []

    @registry.tool(effect="idempotent")
    def send_receipt(to: str, ctx: ToolContext) -> str:
        seen.append((ctx.idempotency_key, ctx.attempt))
        if ctx.attempt == 1:
            raise MaybeExecuted("the mail server dropped the connection after DATA")
        return "sent"

    session_id, [action] = await pending_actions(emulator, [("send_receipt", {"to": "a@example.com"})])
    key = CallKey(session_id, action.turn_id, action.call_id)
    async with running_ledger(registry, database_url, emulator) as ledger:
        report = await ledger.handle(session_id, action)
        events = await ledger.store.events(key)

    assert (report.action, report.submitted) == ("rerun", True)
    assert seen == [(key.idempotency_key, 1), (key.idempotency_key, 2)], "the same key downstream"
    assert [p["output"] for p in accepted_payloads(emulator, session_id)] == ["sent"]
    assert moves(events) == [
        (None, "running", 1),
        ("running", "unknown", 1),
        ("unknown", "running", 2),
        ("running", "succeeded", 2),
        ("succeeded", "submitted", 2),
    ]
    assert reason_of(events, "unknown", "running") == "re-run after an unknown outcome (idempotent)"


async def test_maybe_executed__an_idempotent_tool_with_retries_runs_again_within_its_claim(
    sqlite_url: str, emulator: EmulatorServer
) -> None:
    registry = ToolRegistry()
    runs: list[int] = []

    @registry.tool(effect="idempotent", retries=1)
    def send_receipt(to: str, ctx: ToolContext) -> str:
        runs.append(ctx.attempt)
        if len(runs) == 1:
            raise MaybeExecuted("no answer")
        return "sent"

    session_id, [action] = await pending_actions(emulator, [("send_receipt", {"to": "a@example.com"})])
    async with running_ledger(registry, sqlite_url, emulator) as ledger:
        report = await ledger.handle(session_id, action)
        events = await ledger.store.events(report.key)

    assert (report.action, runs) == ("executed", [1, 1])
    assert [to for _, to, _ in moves(events)] == ["running", "succeeded", "submitted"]
    assert "again after MaybeExecuted" in reason_of(events, "running", "succeeded")


async def test_maybe_executed_always__an_idempotent_tool_is_given_up_after_max_attempts(
    sqlite_url: str, emulator: EmulatorServer
) -> None:
    registry = ToolRegistry()
    runs: list[int] = []

    @registry.tool(effect="idempotent", max_attempts=3)
    def send_receipt(to: str, ctx: ToolContext) -> str:
        runs.append(ctx.attempt)
        raise MaybeExecuted("no answer, ever")

    session_id, [action] = await pending_actions(emulator, [("send_receipt", {"to": "a@example.com"})])
    async with running_ledger(registry, sqlite_url, emulator) as ledger:
        report = await ledger.handle(session_id, action)

    assert (report.action, runs) == ("settled", [1, 2, 3])
    [payload] = accepted_payloads(emulator, session_id)
    assert payload["error"] == POISON_MESSAGE


effects = Table(
    "typed_outcome_effects",
    MetaData(),
    Column("id", Integer, primary_key=True),
    Column("note", String(100), nullable=False),
)


async def test_maybe_executed__a_transactional_tools_writes_are_rolled_back_and_it_runs_again(
    database_url: str, emulator: EmulatorServer
) -> None:
    engine = create_engine(database_url)
    async with engine.begin() as conn:
        await conn.run_sync(effects.metadata.create_all)
    registry = ToolRegistry()

    @registry.tool(effect="transactional")
    async def record_refund(cents: int, ctx: ToolContext) -> str:
        await ctx.db.execute(effects.insert().values(note=f"refund {cents}, run {ctx.attempt}"))
        if ctx.attempt == 1:
            raise MaybeExecuted("the card network did not answer")
        return "refunded"

    session_id, [action] = await pending_actions(emulator, [("record_refund", {"cents": 9})])
    async with running_ledger(registry, database_url, emulator) as ledger:
        report = await ledger.handle(session_id, action)
    try:
        async with engine.connect() as conn:
            notes = list((await conn.execute(select(effects.c.note))).scalars())
            count = (await conn.execute(select(func.count()).select_from(effects))).scalar_one()
    finally:
        await engine.dispose()

    assert (report.action, report.submitted) == ("rerun", True)
    assert (notes, count) == (["refund 9, run 2"], 1)


@pytest.mark.parametrize("style", ["async", "sync"])
async def test_not_executed__a_transactional_tools_retry_runs_in_a_new_transaction(
    database_url: str, emulator: EmulatorServer, style: str
) -> None:
    """The first run's write is rolled back before the second run: one row, not two."""
    engine = create_engine(database_url)
    async with engine.begin() as conn:
        await conn.run_sync(effects.metadata.create_all)
    registry = ToolRegistry()
    runs: list[int] = []
    if style == "async":

        @registry.tool(effect="transactional", retries=1)
        async def record_refund(cents: int, ctx: ToolContext) -> str:
            runs.append(cents)
            await ctx.db.execute(effects.insert().values(note=f"refund {cents}, run {len(runs)}"))
            if len(runs) == 1:
                raise NotExecuted("the card network refused the connection")
            return "refunded"

    else:

        @registry.tool(effect="transactional", retries=1)
        def record_refund(cents: int, ctx: ToolContext) -> str:
            runs.append(cents)
            ctx.db.execute(effects.insert().values(note=f"refund {cents}, run {len(runs)}"))
            if len(runs) == 1:
                raise NotExecuted("the card network refused the connection")
            return "refunded"

    session_id, [action] = await pending_actions(emulator, [("record_refund", {"cents": 9})])
    async with running_ledger(registry, database_url, emulator) as ledger:
        report = await ledger.handle(session_id, action)
        events = await ledger.store.events(report.key)
    try:
        async with engine.connect() as conn:
            notes = list((await conn.execute(select(effects.c.note))).scalars())
    finally:
        await engine.dispose()

    assert (report.action, report.submitted, runs) == ("executed", True, [9, 9])
    assert notes == ["refund 9, run 2"]
    assert [p["output"] for p in accepted_payloads(emulator, session_id)] == ["refunded"]
    assert reason_of(events, "running", "succeeded") == (
        "handler returned (run 2 times within its claim; again after NotExecuted)"
    )


# ---------------------------------------------------------------- through a real HTTP client


async def test_http_errors_classified__refused_is_retried_then_fails_cleanly_a_timeout_waits(
    database_url: str, emulator: EmulatorServer
) -> None:
    """A payment API called through httpx: refused connections are tried again and then
    answered "not sent"; a request whose answer timed out is never sent again."""
    registry = ToolRegistry()

    @registry.tool(retries=1)
    async def charge_card(url: str, cents: int, ctx: ToolContext) -> str:
        async with httpx.AsyncClient(timeout=0.5) as client, classified_http_errors():
            response = await client.post(
                url, json={"cents": cents}, headers={"Idempotency-Key": ctx.idempotency_key}
            )
        response.raise_for_status()
        return response.text

    with refusing_port() as port, faulty_server(never_answers) as silent:
        refused_url = f"http://127.0.0.1:{port}/charges"
        session_id, [refused, timed_out] = await pending_actions(
            emulator,
            [
                ("charge_card", {"url": refused_url, "cents": 1}),
                ("charge_card", {"url": silent.url(), "cents": 2}),
            ],
        )
        async with running_ledger(registry, database_url, emulator) as ledger:
            refused_report, timed_out_report = await asyncio.gather(
                ledger.handle(session_id, refused), ledger.handle(session_id, timed_out)
            )
            refused_events = await ledger.store.events(refused_report.key)
        requests_seen = len(silent.requests)

    assert (refused_report.action, refused_report.submitted) == ("executed", True)
    [payload] = accepted_payloads(emulator, session_id)
    assert payload["call_id"] == refused.call_id
    assert payload["error"] == (
        "The request could not be sent (the connection was refused); it did not take effect."
    )
    assert reason_of(refused_events, "running", "failed") == (
        "not_executed (run 2 times within its claim; again after NotExecuted)"
    )
    assert (timed_out_report.action, timed_out_report.status) == ("waiting_for_operator", CallStatus.UNKNOWN)
    assert requests_seen == 1, "the charge whose answer timed out was sent once, never again"
