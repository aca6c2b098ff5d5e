"""Approval gates: a tool declared ``approval=...`` runs a call only once a person approves it,
once, with the arguments they approved; a denial or an expired wait answers the model instead.
Real ledgers (SQLite and PostgreSQL), the emulator over HTTP, the real SDK."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from sqlalchemy import select

from tests.support.executor_harness import current_actions, pending_actions, running_ledger
from tests.support.polling import eventually
from toolledger.audit.service import (
    AuditService,
    Decision,
    NotApprovedInTimeError,
    NotAwaitingApprovalError,
    ResolveAction,
)
from toolledger.domain.keys import CallKey, arguments_fingerprint
from toolledger.domain.queries import CallReference, QueryError
from toolledger.domain.records import CallRecord
from toolledger.domain.results import DENIED_PREFIX, NOT_APPROVED_IN_TIME_MESSAGE
from toolledger.domain.states import CallStatus
from toolledger.emulator import EmulatorServer
from toolledger.errors import RegistryError
from toolledger.runtime.context import ToolContext
from toolledger.runtime.registry import ToolRegistry
from toolledger.runtime.service import Service
from toolledger.runtime.tool_ledger import ToolLedger
from toolledger.settings import Settings
from toolledger.store.engine import seconds_until
from toolledger.store.schema import tool_calls

from .test_executor import accepted_payloads


def payments(runs: list[dict[str, Any]], **gate: Any) -> ToolRegistry:
    registry = ToolRegistry()

    @registry.tool(**gate)
    async def refund(order_id: str, cents: int, ctx: ToolContext) -> str:
        runs.append({"order_id": order_id, "cents": cents, "key": ctx.idempotency_key})
        return f"refunded {cents}"

    return registry


def audit(ledger: ToolLedger, registry: ToolRegistry | None) -> AuditService:
    return AuditService(ledger.runtime, registry=registry)


def decision(reason: str = "checked with the customer", **fields: Any) -> Decision:
    return Decision(operator="ana", reason=reason, **fields)


SEEN = arguments_fingerprint({"order_id": "A1", "cents": 900})
"""The fingerprint of the arguments most tests' refund is delivered with, as a person saw them."""


async def test_a_gated_call__waits_unrun_until_approved__then_runs_once_and_is_answered(
    database_url: str, emulator: EmulatorServer
) -> None:
    runs: list[dict[str, Any]] = []
    registry = payments(runs, approval=True)
    session_id, [action] = await pending_actions(emulator, [("refund", {"order_id": "A1", "cents": 900})])
    key = CallKey(session_id, action.turn_id, action.call_id)
    async with running_ledger(registry, database_url, emulator) as ledger:
        first = await ledger.handle(session_id, action)
        again = await ledger.handle(session_id, action)  # redelivered: still waits
        waiting = await ledger.store.get(key)
        report = await audit(ledger, registry).approve(str(key), decision(arguments_sha256=SEEN))
        repeated = await ledger.handle(session_id, action)
        timeline = await ledger.store.events(key)

    assert (first.action, again.action) == ("waiting_for_approval", "waiting_for_approval")
    assert waiting is not None
    assert waiting.status is CallStatus.AWAITING_APPROVAL
    assert waiting.lease_token == 0
    assert report.action is ResolveAction.RAN
    assert report.call.status == "submitted"
    assert report.call.approval_decided_by == "ana"
    assert runs == [{"order_id": "A1", "cents": 900, "key": key.idempotency_key}]
    assert repeated.action in ("already_submitted", "resubmitted")
    assert [p["output"] for p in accepted_payloads(emulator, session_id)] == ["refunded 900"]
    assert await current_actions(emulator, session_id) == []
    steps = [(e.kind, e.from_status, e.to_status, e.actor) for e in timeline]
    assert steps[:3] == [
        ("transition", None, "awaiting_approval", "test-worker"),
        ("approval", "awaiting_approval", "pending", "operator:ana"),
        ("transition", "pending", "running", "operator:ana"),
    ]
    assert "approved by ana: checked with the customer" in (timeline[1].reason or "")


async def test_a_rule__gates_only_the_calls_it_names__and_a_rule_that_raises_gates_the_call(
    database_url: str, emulator: EmulatorServer
) -> None:
    runs: list[dict[str, Any]] = []

    def large(arguments: dict[str, Any], ctx: ToolContext) -> bool:
        if arguments["order_id"] == "broken":
            raise KeyError("the rule's own bug")
        assert ctx.tool_name == "refund"
        return bool(arguments["cents"] > 10_000)

    registry = payments(runs, approval=large)
    session_id, actions = await pending_actions(
        emulator,
        [
            ("refund", {"order_id": "small", "cents": 500}),
            ("refund", {"order_id": "large", "cents": 50_000}),
            ("refund", {"order_id": "broken", "cents": 1}),
        ],
    )
    async with running_ledger(registry, database_url, emulator) as ledger:
        reports = await asyncio.gather(*(ledger.handle(session_id, a) for a in actions))

    assert [r.action for r in reports] == ["executed", "waiting_for_approval", "waiting_for_approval"]
    assert [r["order_id"] for r in runs] == ["small"]


async def test_amended_arguments__are_what_the_handler_receives__and_both_are_kept(
    database_url: str, emulator: EmulatorServer
) -> None:
    runs: list[dict[str, Any]] = []
    registry = payments(runs, approval=True)
    session_id, [action] = await pending_actions(emulator, [("refund", {"order_id": "A1", "cents": 90_000})])
    key = CallKey(session_id, action.turn_id, action.call_id)
    async with running_ledger(registry, database_url, emulator) as ledger:
        await ledger.handle(session_id, action)
        service = audit(ledger, registry)
        seen = arguments_fingerprint({"order_id": "A1", "cents": 90_000})
        with pytest.raises(QueryError, match="amended arguments refused"):
            await service.approve(str(key), decision(arguments_sha256=seen, amended_arguments="[not json"))
        report = await service.approve(
            str(key),
            decision(
                arguments_sha256=seen,
                amended_arguments='{"order_id": "A1", "cents": 9000}',
                reason="cap at 90",
            ),
        )
        call = await ledger.store.get(key)
        timeline = await ledger.store.events(key)

    assert runs == [{"order_id": "A1", "cents": 9000, "key": key.idempotency_key}]
    assert call is not None
    assert call.arguments_sha256 == arguments_fingerprint({"order_id": "A1", "cents": 90_000})
    assert call.approved_arguments_sha256 == arguments_fingerprint({"order_id": "A1", "cents": 9000})
    assert report.call.arguments == {"order_id": "A1", "cents": 90_000}
    assert report.call.approved_arguments == {"order_id": "A1", "cents": 9000}
    approval = next(e for e in timeline if e.kind == "approval")
    assert approval.detail == f"amended arguments sha256={call.approved_arguments_sha256}"


async def test_an_approval__names_the_arguments_seen__and_is_used_once(
    database_url: str, emulator: EmulatorServer
) -> None:
    runs: list[dict[str, Any]] = []
    registry = payments(runs, approval=True)
    session_id, [action] = await pending_actions(emulator, [("refund", {"order_id": "A1", "cents": 900})])
    key = CallKey(session_id, action.turn_id, action.call_id)
    async with running_ledger(registry, database_url, emulator) as ledger:
        await ledger.handle(session_id, action)
        service = audit(ledger, registry)
        # Not bound to what anyone saw: refused, whoever asks (CLI, HTTP API, Python).
        with pytest.raises(QueryError, match="an approval names the arguments the person saw"):
            await service.approve(str(key), decision())
        with pytest.raises(QueryError, match="an approval names the arguments the person saw"):
            await service.approve(str(key), decision(amended_arguments='{"order_id": "A1", "cents": 9}'))
        with pytest.raises(NotAwaitingApprovalError, match="are not those approved"):
            await service.approve(str(key), decision(arguments_sha256="0" * 64))
        waiting = await ledger.store.get(key)
        seen = arguments_fingerprint({"order_id": "A1", "cents": 900})
        await service.approve(str(key), decision(arguments_sha256=seen))
        with pytest.raises(NotAwaitingApprovalError, match="is submitted: only a call awaiting approval"):
            await service.approve(str(key), decision(arguments_sha256=seen))
        with pytest.raises(NotAwaitingApprovalError, match="can be denied"):
            await service.deny(str(key), decision())
        # A redelivery, a recovery pass and a reconcile-like re-handling find nothing to run.
        await ledger.handle(session_id, action)
        await ledger.recover()

    assert waiting is not None
    assert (waiting.status, waiting.approval_decided_by) == (CallStatus.AWAITING_APPROVAL, None)
    assert len(runs) == 1


async def test_a_wrong_fingerprint__is_refused_showing_the_masked_arguments__never_the_right_fingerprint(
    database_url: str, emulator: EmulatorServer
) -> None:
    """The refusal says the arguments differ and shows them (masked as every view masks them),
    to be read again: the call's own fingerprint, quoted, would be copied back unread."""
    registry = ToolRegistry()

    @registry.tool(approval=True)
    def rotate_key(account: str, password: str) -> str:
        raise AssertionError("never approved: never run")

    arguments = {"account": "ops-7", "password": "hunter2-correct-horse"}
    session_id, [action] = await pending_actions(emulator, [("rotate_key", arguments)])
    key = CallKey(session_id, action.turn_id, action.call_id)
    async with running_ledger(registry, database_url, emulator) as ledger:
        await ledger.handle(session_id, action)
        service = audit(ledger, registry)
        refusals = []
        for verb in (service.approve, service.deny):
            with pytest.raises(NotAwaitingApprovalError) as refused:
                await verb(str(key), decision(arguments_sha256="0" * 64))
            refusals.append(str(refused.value))
        call = await ledger.store.get(key)

    assert call is not None
    assert call.status is CallStatus.AWAITING_APPROVAL
    for message in refusals:
        assert "differ" in message
        assert call.arguments_sha256 not in message
        assert '"account": "ops-7"' in message
        assert '"password": "[REDACTED]"' in message
        assert "hunter2" not in message


async def test_two_approvers_racing__one_approval_wins__the_call_runs_once(
    database_url: str, emulator: EmulatorServer
) -> None:
    runs: list[dict[str, Any]] = []
    registry = payments(runs, approval=True)
    session_id, [action] = await pending_actions(emulator, [("refund", {"order_id": "A1", "cents": 900})])
    key = CallKey(session_id, action.turn_id, action.call_id)
    async with running_ledger(registry, database_url, emulator) as ledger:
        await ledger.handle(session_id, action)
        outcomes = await asyncio.gather(
            *(
                audit(ledger, registry).approve(
                    str(key), decision(reason=f"approver {n}", arguments_sha256=SEEN)
                )
                for n in range(4)
            ),
            return_exceptions=True,
        )
        timeline = await ledger.store.events(key)

    won = [o for o in outcomes if not isinstance(o, BaseException)]
    lost = [o for o in outcomes if isinstance(o, BaseException)]
    assert len(won) == 1
    assert all(isinstance(o, NotAwaitingApprovalError) for o in lost)
    assert len(runs) == 1
    assert sum(e.kind == "approval" for e in timeline) == 1
    assert len(accepted_payloads(emulator, session_id)) == 1


async def test_a_denial__never_runs__and_sends_the_model_the_reason(
    database_url: str, emulator: EmulatorServer
) -> None:
    runs: list[dict[str, Any]] = []
    registry = payments(runs, approval=True)
    session_id, [action] = await pending_actions(emulator, [("refund", {"order_id": "A1", "cents": 900})])
    key = CallKey(session_id, action.turn_id, action.call_id)
    async with running_ledger(registry, database_url, emulator) as ledger:
        await ledger.handle(session_id, action)
        service = audit(ledger, registry)
        with pytest.raises(QueryError, match="sent to the model: at most"):
            await service.deny(str(key), decision(reason="x" * 600))
        report = await service.deny(str(key), decision(reason="refunds over 500 need a manager"))
        await ledger.handle(session_id, action)
        timeline = await ledger.store.events(key)

    assert report.action is ResolveAction.SUBMITTED
    assert runs == []
    [payload] = accepted_payloads(emulator, session_id)
    assert payload["success"] is False
    assert payload["error"] == DENIED_PREFIX + "refunds over 500 need a manager"
    assert report.call.error_stage == "approval"
    denial = next(e for e in timeline if e.kind == "approval")
    assert (denial.from_status, denial.to_status, denial.actor) == (
        "awaiting_approval",
        "failed",
        "operator:ana",
    )


async def test_a_call_not_approved_in_time__gets_a_fixed_failure_and_never_runs(
    database_url: str, emulator: EmulatorServer
) -> None:
    runs: list[dict[str, Any]] = []
    registry = payments(runs, approval=True, approval_timeout=0.5)
    session_id, [action] = await pending_actions(emulator, [("refund", {"order_id": "A1", "cents": 900})])
    key = CallKey(session_id, action.turn_id, action.call_id)
    async with running_ledger(registry, database_url, emulator) as ledger:
        first = await ledger.handle(session_id, action)
        assert first.retry_in is not None
        assert 0.25 < first.retry_in <= 0.75
        await asyncio.sleep(first.retry_in)
        expired = await ledger.handle(session_id, action)
        with pytest.raises(NotApprovedInTimeError, match="was not approved in time"):
            await audit(ledger, registry).approve(str(key), decision(arguments_sha256=SEEN))

    assert expired.action == "approval_expired"
    assert runs == []
    [payload] = accepted_payloads(emulator, session_id)
    assert payload["error"] == NOT_APPROVED_IN_TIME_MESSAGE


async def test_serve__runs_a_call_approved_elsewhere_within_a_poll(
    database_url: str, emulator: EmulatorServer
) -> None:
    runs: list[dict[str, Any]] = []
    registry = payments(runs, approval=True)
    settings: dict[str, Any] = {
        "database_url": database_url,
        "openai_base_url": emulator.base_url,
        "worker_id": "approvals",
        "reconcile_interval_seconds": 300.0,
        "decision_poll_seconds": 0.2,
    }
    session_id, [action] = await pending_actions(emulator, [("refund", {"order_id": "A1", "cents": 900})])
    key = CallKey(session_id, action.turn_id, action.call_id)
    async with Service(registry, Settings(**settings), auto_migrate=False) as service:
        await service.watch(session_id)
        waiting = await eventually(
            lambda: _status_is(service, key, CallStatus.AWAITING_APPROVAL), 5.0, "the call awaits approval"
        )
        # An operator elsewhere: no tools in that process, so it only records the approval.
        report = await AuditService(service.ledger.runtime).approve(
            CallReference(key=key), decision(arguments_sha256=SEEN)
        )
        assert report.action is ResolveAction.LEFT_FOR_SERVICE
        done = await eventually(
            lambda: _status_is(service, key, CallStatus.SUBMITTED), 3.0, "the approved call answered"
        )

    assert (waiting, done) == (CallStatus.AWAITING_APPROVAL, CallStatus.SUBMITTED)
    assert len(runs) == 1


async def _status_is(service: Service, key: CallKey, status: CallStatus) -> CallStatus | None:
    call = await service.ledger.store.get(key)
    return status if call is not None and call.status is status else None


@pytest.mark.parametrize(
    ("gate", "message"),
    [
        ({"approval": "yes"}, "approval must be True, False or a rule"),
        ({"approval_timeout": 5}, "needs approval=True or a rule"),
        ({"approval": True, "approval_timeout": 0}, "approval_timeout must be positive"),
    ],
)
def test_a_bad_gate__is_refused_when_registered(gate: dict[str, Any], message: str) -> None:
    with pytest.raises(RegistryError, match=message):
        payments([], **gate)


# --------------------------------------------------------------- amended arguments


def shop(runs: list[dict[str, Any]]) -> ToolRegistry:
    registry = ToolRegistry()

    @registry.tool(approval=True)
    async def refund(order_id: str, cents: int, note: dict[str, Any], ctx: ToolContext) -> str:
        runs.append({"order_id": order_id, "cents": cents, "note": note})
        return f"refunded {cents}"

    return registry


MODEL_REFUND = {"order_id": "A1", "cents": 90_000, "note": {"by": "the model"}}


@pytest.mark.parametrize(
    ("amended", "problem"),
    [
        # Against the tool's parameters, as the handler would check them (and stricter: JSON's
        # types, so no "9000" for an integer).
        ({"order_id": "A1", "cents": "lots", "note": {}}, "cents: Input should be a valid integer"),
        ({"order_id": "A1", "cents": "9000", "note": {}}, "cents: Input should be a valid integer"),
        ({"order_id": "A1", "note": {}}, "cents: Field required"),
        ({"order_id": "A1", "cents": 9000, "note": {}, "to": "me"}, "to: Extra inputs are not permitted"),
        ({"order_id": "A1", "cents": 9000.5, "note": {}}, "cents: Input should be a valid integer"),
        # The mask a view showed, copied back: anywhere, at any depth, in a key or within a text.
        ({"order_id": "[REDACTED]", "cents": 9000, "note": {}}, "arguments.order_id holds [REDACTED]"),
        (
            {"order_id": "A1", "cents": 9000, "note": {"card": {"cvv": "[REDACTED]"}}},
            "arguments.note.card.cvv holds [REDACTED]",
        ),
        (
            {"order_id": "A1", "cents": 9000, "note": {"url": "postgresql://u:[REDACTED]@db/x"}},
            "arguments.note.url holds [REDACTED]",
        ),
        ({"order_id": "A1", "cents": 9000, "note": {"[REDACTED]": 1}}, "arguments.note.[REDACTED] holds"),
        ({"order_id": "A1", "cents": 9000, "note": {"tags": ["a", "[REDACTED]"]}}, "note.tags[1] holds"),
    ],
)
async def test_amended_arguments__not_fitting_the_tool_or_holding_the_mask__refused_before_anything_is_stored(
    database_url: str, emulator: EmulatorServer, amended: dict[str, Any], problem: str
) -> None:
    """Refused (400 through the API, exit 2 through the CLI) before the approval is stored:
    the approval is not used up, the call waits on, and a good approval then runs it once."""
    runs: list[dict[str, Any]] = []
    registry = shop(runs)
    session_id, [action] = await pending_actions(emulator, [("refund", MODEL_REFUND)])
    key = CallKey(session_id, action.turn_id, action.call_id)
    seen = arguments_fingerprint(MODEL_REFUND)
    async with running_ledger(registry, database_url, emulator) as ledger:
        await ledger.handle(session_id, action)
        service = audit(ledger, registry)
        with pytest.raises(QueryError) as refused:
            await service.approve(
                str(key), decision(arguments_sha256=seen, amended_arguments=json.dumps(amended))
            )
        after = await ledger.store.get(key)
        events = await ledger.store.events(key)
        good = {"order_id": "A1", "cents": 9000, "note": {"by": "ana"}}
        report = await service.approve(
            str(key), decision(arguments_sha256=seen, amended_arguments=json.dumps(good))
        )

    assert "amended arguments refused" in str(refused.value)
    assert problem in str(refused.value)
    assert after is not None
    assert (after.status, after.approved_arguments, after.approval_decided_by) == (
        CallStatus.AWAITING_APPROVAL,
        None,
        None,
    )
    assert [e.kind for e in events] == ["transition"]
    assert report.action is ResolveAction.RAN
    assert runs == [good]
    [payload] = accepted_payloads(emulator, session_id)
    assert payload["output"] == "refunded 9000"


async def test_amended_arguments__refused_where_the_process_has_no_tools_to_check_them_against(
    database_url: str, emulator: EmulatorServer
) -> None:
    """Without the tools (no --tools, the stand-alone API) nothing can tell whether amended
    arguments fit the tool: refused, saying where they can be given; the approval is not used up."""
    runs: list[dict[str, Any]] = []
    registry = shop(runs)
    session_id, [action] = await pending_actions(emulator, [("refund", MODEL_REFUND)])
    key = CallKey(session_id, action.turn_id, action.call_id)
    seen = arguments_fingerprint(MODEL_REFUND)
    amended = json.dumps({"order_id": "A1", "cents": 9000, "note": {}})
    async with running_ledger(registry, database_url, emulator) as ledger:
        await ledger.handle(session_id, action)
        refusals = []
        for tools in (None, ToolRegistry()):
            with pytest.raises(QueryError) as refused:
                await audit(ledger, tools).approve(
                    str(key), decision(arguments_sha256=seen, amended_arguments=amended)
                )
            refusals.append(str(refused.value))
        after = await ledger.store.get(key)

    assert "this process was not given the tools" in refusals[0]
    assert "this process's tools have no 'refund'" in refusals[1]
    for message in refusals:
        assert "--tools" in message
        assert "serve --api" in message
    assert after is not None
    assert after.status is CallStatus.AWAITING_APPROVAL
    assert runs == []


# ----------------------------------------------------------------- the deadline


async def test_the_approve_transition__refuses_other_arguments__and_a_deadline_passed_on_the_database_clock(
    database_url: str, emulator: EmulatorServer
) -> None:
    """The store's compare-and-set itself: the deadline is the database clock's, whether or
    not anyone has written the expiry; nothing is approved, nothing noted in the trail."""
    registry = payments([], approval=True, approval_timeout=0.5)
    session_id, [action] = await pending_actions(emulator, [("refund", {"order_id": "A1", "cents": 900})])
    key = CallKey(session_id, action.turn_id, action.call_id)
    async with running_ledger(registry, database_url, emulator) as ledger:
        await ledger.handle(session_id, action)
        other = await ledger.store.approve(key, arguments_sha256="0" * 64, decided_by="ana", reason="r")
        await _past_deadline(ledger, key)
        late = await ledger.store.approve(key, arguments_sha256=SEEN, decided_by="ana", reason="r")
        call = await ledger.store.get(key)
        events = await ledger.store.events(key)

    assert (other, late) == (None, None)
    assert call is not None
    assert (call.status, call.approval_decided_by, call.lease_token) == (
        CallStatus.AWAITING_APPROVAL,
        None,
        0,
    )
    assert [e.kind for e in events] == ["transition"]


@pytest.mark.parametrize("here", [True, False], ids=["with-the-tools", "serve-runs-it"])
async def test_an_approval_after_the_deadline__serve_stopped__is_refused__never_runs__and_serve_answers_it(
    database_url: str, emulator: EmulatorServer, here: bool
) -> None:
    """The security probe's finding: with `serve` stopped past the deadline (nobody wrote the
    expiry), an approval was taken, and the handler ran (here, or when `serve` came back).
    Now the approval is refused as not approved in time, and `serve` answers the model so."""
    runs: list[dict[str, Any]] = []
    registry = payments(runs, approval=True, approval_timeout=0.5)
    session_id, [action] = await pending_actions(emulator, [("refund", {"order_id": "A1", "cents": 900})])
    key = CallKey(session_id, action.turn_id, action.call_id)
    async with running_ledger(registry, database_url, emulator) as ledger:
        assert (await ledger.handle(session_id, action)).action == "waiting_for_approval"
        await _past_deadline(ledger, key)
        with pytest.raises(NotApprovedInTimeError, match="was not approved in time") as refused:
            await audit(ledger, registry if here else None).approve(str(key), decision(arguments_sha256=SEEN))
        waiting = await ledger.store.get(key)
    assert waiting is not None
    assert waiting.status is CallStatus.AWAITING_APPROVAL, "refused: nothing changed"

    # `serve` comes back: it answers the fixed failure, and never runs the handler.
    call = await _served_until_answered(registry, database_url, emulator, session_id, key)
    assert runs == []
    [payload] = accepted_payloads(emulator, session_id)
    assert (payload["success"], payload["error"]) == (False, NOT_APPROVED_IN_TIME_MESSAGE)
    assert call.approval_decided_by == "toolledger"
    assert "will not run" in str(refused.value)


async def test_an_approval_just_before_the_deadline__runs_once(
    database_url: str, emulator: EmulatorServer
) -> None:
    runs: list[dict[str, Any]] = []
    registry = payments(runs, approval=True, approval_timeout=2.0)
    session_id, [action] = await pending_actions(emulator, [("refund", {"order_id": "A1", "cents": 900})])
    key = CallKey(session_id, action.turn_id, action.call_id)
    async with running_ledger(registry, database_url, emulator) as ledger:
        await ledger.handle(session_id, action)
        left = await _seconds_left(ledger, key)
        await asyncio.sleep(max(left - 0.7, 0.0))
        before = await _seconds_left(ledger, key)
        report = await audit(ledger, registry).approve(str(key), decision(arguments_sha256=SEEN))

    assert 0.0 < before <= 0.8
    assert report.action is ResolveAction.RAN
    assert len(runs) == 1
    [payload] = accepted_payloads(emulator, session_id)
    assert payload["output"] == "refunded 900"


async def _seconds_left(ledger: ToolLedger, key: CallKey) -> float:
    """Until the call's approval deadline, on the database's clock."""
    async with ledger.engine.connect() as conn:
        left = (
            await conn.execute(
                select(seconds_until(tool_calls.c.approval_expires_at)).where(
                    tool_calls.c.session_id == key.session_id,
                    tool_calls.c.turn_id == key.turn_id,
                    tool_calls.c.call_id == key.call_id,
                )
            )
        ).scalar_one()
    return float(left)


async def _past_deadline(ledger: ToolLedger, key: CallKey) -> None:
    """Wait until the call's approval deadline has passed on the database's clock."""
    left = await _seconds_left(ledger, key)
    while left >= 0:
        await asyncio.sleep(left + 0.05)
        left = await _seconds_left(ledger, key)


async def _served_until_answered(
    registry: ToolRegistry, database_url: str, emulator: EmulatorServer, session_id: str, key: CallKey
) -> CallRecord:
    settings = Settings(
        database_url=database_url,
        openai_base_url=emulator.base_url,
        worker_id="approvals-serve",
        reconcile_interval_seconds=300.0,
        decision_poll_seconds=0.2,
    )
    async with Service(registry, settings, auto_migrate=False) as service:
        await service.watch(session_id)
        await eventually(
            lambda: _status_is(service, key, CallStatus.SUBMITTED), 10.0, "serve answered the call"
        )
        call = await service.ledger.store.get(key)
    assert call is not None
    return call
