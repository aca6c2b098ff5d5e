"""Approval gates: a tool declared ``approval=...`` runs a call only once a person approves it,
once, with the arguments they approved; a denial or an expired wait answers the model instead.
Real ledgers (SQLite and PostgreSQL), the emulator over HTTP, the real SDK."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.support.executor_harness import current_actions, pending_actions, running_ledger
from tests.support.polling import eventually
from toolledger.audit.service import AuditService, Decision, NotAwaitingApprovalError, ResolveAction
from toolledger.domain.keys import CallKey, arguments_fingerprint
from toolledger.domain.queries import CallReference, QueryError
from toolledger.domain.results import DENIED_PREFIX, NOT_APPROVED_IN_TIME_MESSAGE
from toolledger.domain.states import CallStatus
from toolledger.emulator import EmulatorServer
from toolledger.errors import RegistryError
from toolledger.runtime.context import ToolContext
from toolledger.runtime.registry import ToolRegistry
from toolledger.runtime.service import Service
from toolledger.runtime.tool_ledger import ToolLedger
from toolledger.settings import Settings

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
        report = await audit(ledger, registry).approve(str(key), decision())
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
        with pytest.raises(QueryError, match="amended arguments refused"):
            await service.approve(str(key), decision(amended_arguments="[not json"))
        report = await service.approve(
            str(key), decision(amended_arguments='{"order_id": "A1", "cents": 9000}', reason="cap at 90")
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
        with pytest.raises(NotAwaitingApprovalError, match="are not those approved"):
            await service.approve(str(key), decision(arguments_sha256="0" * 64))
        seen = arguments_fingerprint({"order_id": "A1", "cents": 900})
        await service.approve(str(key), decision(arguments_sha256=seen))
        with pytest.raises(NotAwaitingApprovalError, match="is submitted: only a call awaiting approval"):
            await service.approve(str(key), decision())
        with pytest.raises(NotAwaitingApprovalError, match="can be denied"):
            await service.deny(str(key), decision())
        # A redelivery, a recovery pass and a reconcile-like re-handling find nothing to run.
        await ledger.handle(session_id, action)
        await ledger.recover()

    assert len(runs) == 1


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
            *(audit(ledger, registry).approve(str(key), decision(reason=f"approver {n}")) for n in range(4)),
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
        with pytest.raises(NotAwaitingApprovalError):
            await audit(ledger, registry).approve(str(key), decision())

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
        report = await AuditService(service.ledger.runtime).approve(CallReference(key=key), decision())
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
