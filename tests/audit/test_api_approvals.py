"""Approving and denying calls through the audit HTTP API (``POST /api/calls/{ref}/approve``
and ``.../deny``): real requests to the app (in process, ASGI), on SQLite and PostgreSQL,
against calls recorded awaiting approval by real executions through the emulator (the real
SDK over HTTP). Where the API's process has no tools, the approved call is run by a `Service`
following the session, as `serve` would.
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from tests.support.api_server import FULL, READ, api_settings, serving
from tests.support.calls_cli import add_unknown_call
from tests.support.executor_harness import pending_actions, running_ledger
from tests.support.polling import eventually
from toolledger.audit.api import DENIAL_MAX_CHARS, create_app
from toolledger.domain.keys import CallKey, arguments_fingerprint
from toolledger.domain.results import DENIED_PREFIX, NOT_APPROVED_IN_TIME_MESSAGE
from toolledger.emulator import EmulatorServer
from toolledger.runtime.context import ToolContext
from toolledger.runtime.registry import ToolRegistry
from toolledger.runtime.service import Service
from toolledger.settings import Settings

REFUND = {"order_id": "A1", "cents": 90_000}
SEEN = arguments_fingerprint(REFUND)


def payments(runs: list[dict[str, Any]], approval_timeout: float | None = None) -> ToolRegistry:
    registry = ToolRegistry()

    @registry.tool(approval=True, approval_timeout=approval_timeout)
    async def refund(order_id: str, cents: int, ctx: ToolContext) -> str:
        runs.append({"order_id": order_id, "cents": cents, "key": ctx.idempotency_key})
        return f"refunded {cents}"

    return registry


async def awaiting_calls(
    database_url: str, emulator: EmulatorServer, registry: ToolRegistry, *arguments: dict[str, Any]
) -> tuple[str, list[CallKey]]:
    """A session whose refund calls the ledger recorded awaiting approval (delivered once)."""
    session_id, actions = await pending_actions(emulator, [("refund", a) for a in arguments])
    async with running_ledger(registry, database_url, emulator) as ledger:
        for action in actions:
            report = await ledger.handle(session_id, action)
            assert report.action == "waiting_for_approval"
    return session_id, [CallKey(session_id, a.turn_id, a.call_id) for a in actions]


def path(key: CallKey, action: str) -> str:
    return f"/api/calls/{quote(str(key), safe='/')}/{action}"


async def shown(client: httpx.AsyncClient, key: CallKey) -> dict[str, Any]:
    response = await client.get(f"/api/calls/{key}", headers=READ)
    assert response.status_code == 200, response.text
    detail: dict[str, Any] = response.json()
    return detail


def approvals(detail: dict[str, Any]) -> list[dict[str, Any]]:
    return [event for event in detail["timeline"] if event["kind"] == "approval"]


# ------------------------------------------------------------------------- refusals


async def test_decisions__refused_without_the_right__with_a_bad_body__or_other_arguments(
    database_url: str, emulator: EmulatorServer
) -> None:
    runs: list[dict[str, Any]] = []
    session_id, [key] = await awaiting_calls(database_url, emulator, payments(runs), REFUND)
    app = create_app(api_settings(database_url, emulator.base_url))
    seen = arguments_fingerprint(REFUND)
    async with serving(app) as client:
        for action in ("approve", "deny"):
            read_only = await client.post(path(key, action), json={"reason": "ok"}, headers=READ)
            assert read_only.status_code == 403, action
            assert "may only read" in read_only.json()["detail"]

        bad_approvals: list[dict[str, Any] | bytes] = [
            {},
            {"reason": " \t"},
            {"reason": "ok", "arguments": [1, 2]},
            {"reason": "ok", "arguments": '{"cents": 1}'},
            {"reason": "ok", "arguments_sha256": "not-a-sha"},
            {"reason": "ok", "arguments_sha256": seen.upper()},
            {"reason": "ok", "operator": "mallory"},  # with tokens the token names the operator
            {"reason": "ok", "kind": "rerun"},
            # Not bound to what anyone saw: an approval names the arguments' sha256.
            {"reason": "ok"},
            {"reason": "ok", "arguments": {"order_id": "A1", "cents": 9_000}},
            # Numbers JSON cannot carry: Python's parser takes them, the ledger must not.
            b'{"reason": "ok", "arguments": {"order_id": "A1", "cents": NaN}}',
            b'{"reason": "ok", "arguments": {"order_id": "A1", "cents": 1e999}}',
            # Which amount was meant? A JSON parser would keep the last one, silently.
            b'{"reason": "ok", "arguments": {"order_id": "A1", "cents": 1, "cents": 90000}}',
        ]
        for body in bad_approvals:
            raw = body if isinstance(body, bytes) else json.dumps(body).encode()
            response = await client.post(
                path(key, "approve"), content=raw, headers={**FULL, "Content-Type": "application/json"}
            )
            assert response.status_code == 400, (body, response.text)
            assert isinstance(response.json()["detail"], str)
        for body in ({"reason": "ok"}, {"reason": "ok", "arguments": {"order_id": "A1", "cents": 9_000}}):
            unbound = await client.post(path(key, "approve"), json=body, headers=FULL)
            assert unbound.json()["detail"] == "arguments_sha256: Field required"
        for body in (
            {"reason": "x" * (DENIAL_MAX_CHARS + 1)},  # the model gets it: a tool error's length
            {"reason": "no", "arguments": {"cents": 1}},  # a denial takes no arguments
            {"reason": ""},
        ):
            response = await client.post(path(key, "deny"), json=body, headers=FULL)
            assert response.status_code == 400, (body, response.text)

        # A stale page (or a mistaken id): arguments other than those seen are not decided on.
        # The refusal shows them to be read again, never their fingerprint to be copied back.
        for action in ("approve", "deny"):
            other = await client.post(
                path(key, action), json={"reason": "ok", "arguments_sha256": "0" * 64}, headers=FULL
            )
            assert other.status_code == 409, action
            assert "its arguments differ" in other.json()["detail"]
            assert '{"cents": 90000, "order_id": "A1"}' in other.json()["detail"]
            assert seen not in other.json()["detail"]
            nobody = await client.post(
                f"/api/calls/tl_00000000deadbeef/{action}",
                json={"reason": "ok", "arguments_sha256": seen},
                headers=FULL,
            )
            assert nobody.status_code == 404
            wrong_method = await client.get(path(key, action), headers=READ)
            assert wrong_method.status_code == 405, action
            assert wrong_method.headers["allow"] == "POST"

        detail = await shown(client, key)

    call = detail["call"]
    assert (call["status"], call["needs_approval"], call["arguments_sha256"]) == (
        "awaiting_approval",
        True,
        seen,
    )
    assert approvals(detail) == []
    assert runs == []
    assert emulator.control.tool_results(session_id) == []


# ------------------------------------------------------------------------ approving


async def test_approve__an_api_without_the_tools__refuses_amendments__serve_runs_the_approved_call_once(
    database_url: str, emulator: EmulatorServer
) -> None:
    """The stand-alone API has no tools to check amended arguments against: refused (400),
    nothing stored, the approval not used up. Approved as the model asked, `serve` runs it."""
    runs: list[dict[str, Any]] = []
    registry = payments(runs)
    settings = Settings(
        database_url=database_url,
        openai_base_url=emulator.base_url,
        worker_id="approvals-serve",
        reconcile_interval_seconds=300.0,
        decision_poll_seconds=0.2,
    )
    session_id, [action] = await pending_actions(emulator, [("refund", REFUND)])
    key = CallKey(session_id, action.turn_id, action.call_id)
    amended = {"order_id": "A1", "cents": 9_000}
    # The API in a process of its own, without the tools: `serve` (here, a Service) runs it.
    app = create_app(api_settings(database_url, emulator.base_url))
    async with Service(registry, settings, auto_migrate=False) as service, serving(app) as client:
        await service.watch(session_id)

        async def awaiting() -> dict[str, Any] | None:
            response = await client.get(f"/api/calls/{key}", headers=READ)
            call: dict[str, Any] = response.json()["call"] if response.status_code == 200 else {}
            return call if call.get("status") == "awaiting_approval" else None

        seen = (await eventually(awaiting, 10.0, "the call awaits approval"))["arguments_sha256"]
        refused = await client.post(
            path(key, "approve"),
            json={"reason": "cap at 90 euros", "arguments_sha256": seen, "arguments": amended},
            headers=FULL,
        )
        assert refused.status_code == 400, refused.text
        assert "this process was not given the tools" in refused.json()["detail"]
        assert "serve --api" in refused.json()["detail"]
        masked = await client.post(
            path(key, "approve"),
            json={
                "reason": "r",
                "arguments_sha256": seen,
                "arguments": {**amended, "order_id": "[REDACTED]"},
            },
            headers=FULL,
        )
        assert masked.status_code == 400, masked.text
        assert "arguments.order_id holds [REDACTED]" in masked.json()["detail"]
        untouched = await shown(client, key)
        assert (untouched["call"]["status"], approvals(untouched)) == ("awaiting_approval", [])

        approved = await client.post(
            path(key, "approve"), json={"reason": "as asked", "arguments_sha256": seen}, headers=FULL
        )
        assert approved.status_code == 200, approved.text
        answer = approved.json()
        assert answer["action"] == "left_for_service"
        assert answer["call"]["status"] == "pending"
        assert answer["call"]["approval_decided_by"] == "alice"
        assert answer["call"]["approved_arguments"] is None

        # Used once: a second approval, or a denial after it, is a conflict.
        again = await client.post(
            path(key, "approve"), json={"reason": "twice", "arguments_sha256": seen}, headers=FULL
        )
        assert again.status_code == 409
        assert "only a call awaiting approval can be approved" in again.json()["detail"]
        assert (
            await client.post(path(key, "deny"), json={"reason": "late"}, headers=FULL)
        ).status_code == 409

        async def submitted() -> dict[str, Any] | None:
            detail = await shown(client, key)
            return detail if detail["call"]["status"] == "submitted" else None

        detail = await eventually(submitted, 10.0, "serve ran the approved call and answered")

    assert runs == [{**REFUND, "key": key.idempotency_key}]
    accepted = [r.payload for r in emulator.control.tool_results(session_id) if r.outcome == "accepted"]
    assert [payload["output"] for payload in accepted] == ["refunded 90000"]
    [approval] = approvals(detail)
    assert (approval["actor"], approval["from_status"], approval["to_status"]) == (
        "operator:alice",
        "awaiting_approval",
        "pending",
    )
    assert approval["reason"] == "approved by alice: as asked"
    claims = [e for e in detail["timeline"] if e["from_status"] == "pending" and e["to_status"] == "running"]
    assert [e["actor"] for e in claims] == ["approvals-serve"]


async def test_approve__an_api_with_the_tools__checks_amended_arguments_before_storing_them__then_runs_them(
    database_url: str, emulator: EmulatorServer
) -> None:
    """`serve --api` shares its tools with the API: amended arguments that do not fit the tool
    (or carry the mask) are 400 with the reason, nothing stored, the approval not used up;
    fitting ones run at once, and both sets of arguments are kept."""
    runs: list[dict[str, Any]] = []
    registry = payments(runs)
    session_id, [key] = await awaiting_calls(database_url, emulator, registry, REFUND)
    app = create_app(api_settings(database_url, emulator.base_url), registry=registry)
    async with serving(app) as client:
        for amended, problem in (
            ({"order_id": "A1", "cents": "lots"}, "cents: Input should be a valid integer"),
            ({"order_id": "A1", "cents": "9000"}, "cents: Input should be a valid integer"),
            ({"order_id": "A1"}, "cents: Field required"),
            ({"order_id": "A1", "cents": 9_000, "iban": "DE89"}, "iban: Extra inputs are not permitted"),
            ({"order_id": {"x": ["[REDACTED]"]}, "cents": 9_000}, "arguments.order_id.x[0] holds [REDACTED]"),
        ):
            response = await client.post(
                path(key, "approve"),
                json={"reason": "cap", "arguments_sha256": SEEN, "arguments": amended},
                headers=FULL,
            )
            assert response.status_code == 400, (amended, response.text)
            assert "amended arguments refused" in response.json()["detail"]
            assert problem in response.json()["detail"], response.text
        untouched = await shown(client, key)
        assert (untouched["call"]["status"], untouched["call"]["approved_arguments"]) == (
            "awaiting_approval",
            None,
        )
        assert approvals(untouched) == []

        amended = {"order_id": "A1", "cents": 9_000}
        approved = await client.post(
            path(key, "approve"),
            json={"reason": "cap at 90 euros", "arguments_sha256": SEEN, "arguments": amended},
            headers=FULL,
        )
        assert approved.status_code == 200, approved.text
        detail = await shown(client, key)

    assert approved.json()["action"] == "ran"
    assert (detail["call"]["arguments"], detail["call"]["approved_arguments"]) == (REFUND, amended)
    assert runs == [{**amended, "key": key.idempotency_key}]
    [received] = emulator.control.tool_results(session_id)
    assert received.payload["output"] == "refunded 9000"
    [approval] = approvals(detail)
    assert approval["detail"] == f"amended arguments sha256={arguments_fingerprint(amended)}"


async def test_approve__after_the_deadline__409_not_approved_in_time__never_runs__serve_answers_it(
    database_url: str, emulator: EmulatorServer
) -> None:
    """The security probe's finding: an approval 0.27 s late was answered 200 "ran" (`serve
    --api`, which had not yet woken to write the expiry). The deadline is the database
    clock's, in the approval's own compare-and-set."""
    runs: list[dict[str, Any]] = []
    registry = payments(runs, approval_timeout=0.5)
    session_id, [key] = await awaiting_calls(database_url, emulator, registry, REFUND)
    app = create_app(api_settings(database_url, emulator.base_url), registry=registry)
    async with serving(app) as client:
        deadline = datetime.fromisoformat((await shown(client, key))["call"]["approval_expires_at"])
        await asyncio.sleep(max((deadline - datetime.now(UTC)).total_seconds(), 0.0) + 0.3)
        late = await client.post(
            path(key, "approve"), json={"reason": "sorry, late", "arguments_sha256": SEEN}, headers=FULL
        )
        waiting = await shown(client, key)

    assert late.status_code == 409, late.text
    assert "was not approved in time" in late.json()["detail"]
    assert (waiting["call"]["status"], approvals(waiting)) == ("awaiting_approval", [])
    assert runs == []

    settings = Settings(
        database_url=database_url,
        openai_base_url=emulator.base_url,
        worker_id="approvals-serve",
        reconcile_interval_seconds=300.0,
        decision_poll_seconds=0.2,
    )
    async with Service(registry, settings, auto_migrate=False) as service:
        await service.watch(session_id)

        async def answered() -> list[Any]:
            return [r for r in emulator.control.tool_results(session_id) if r.outcome == "accepted"]

        [received] = await eventually(answered, 10.0, "serve answered the call")
    assert runs == []
    assert received.payload["error"] == NOT_APPROVED_IN_TIME_MESSAGE


async def test_approve__where_the_api_has_the_tools__runs_the_call_there(
    database_url: str, emulator: EmulatorServer
) -> None:
    """`serve --api` shares its registry with the API: the approval runs the call at once."""
    runs: list[dict[str, Any]] = []
    registry = payments(runs)
    session_id, [key] = await awaiting_calls(database_url, emulator, registry, REFUND)
    app = create_app(api_settings(database_url, emulator.base_url), registry=registry)
    async with serving(app) as client:
        response = await client.post(
            path(key, "approve"), json={"reason": "as asked", "arguments_sha256": SEEN}, headers=FULL
        )
    assert response.status_code == 200, response.text
    assert response.json()["action"] == "ran"
    assert response.json()["call"]["status"] == "submitted"
    assert runs == [{**REFUND, "key": key.idempotency_key}]
    assert len(emulator.control.tool_results(session_id)) == 1


# -------------------------------------------------------------------------- denying


async def test_deny__the_model_gets_the_reason__the_call_never_runs_nor_can_be_approved(
    database_url: str, emulator: EmulatorServer
) -> None:
    runs: list[dict[str, Any]] = []
    session_id, [key] = await awaiting_calls(database_url, emulator, payments(runs), REFUND)
    app = create_app(api_settings(database_url, emulator.base_url))
    reason = "refunds over 500 euros need a manager"
    async with serving(app) as client:
        denied = await client.post(
            path(key, "deny"),
            json={"reason": reason, "arguments_sha256": arguments_fingerprint(REFUND)},
            headers=FULL,
        )
        assert denied.status_code == 200, denied.text
        assert denied.json()["action"] == "submitted"
        assert denied.json()["call"]["error_stage"] == "approval"
        for action in ("approve", "deny"):
            after = await client.post(
                path(key, action), json={"reason": "changed my mind", "arguments_sha256": SEEN}, headers=FULL
            )
            assert after.status_code == 409, action
            assert "is submitted" in after.json()["detail"]
        detail = await shown(client, key)

    assert runs == []
    [received] = emulator.control.tool_results(session_id)
    assert received.outcome == "accepted"
    assert received.payload["success"] is False
    assert received.payload["error"] == DENIED_PREFIX + reason
    [denial] = approvals(detail)
    assert (denial["actor"], denial["from_status"], denial["to_status"]) == (
        "operator:alice",
        "awaiting_approval",
        "failed",
    )
    assert denial["reason"] == f"denied by alice: {reason}"
    assert detail["call"]["approval_decided_by"] == "alice"


async def test_decisions__without_tokens__the_operator_names_themselves(
    database_url: str, emulator: EmulatorServer
) -> None:
    """No token configured (loopback only): whoever decides may say who they are, else 'local';
    with no Agents API configured here, a denial is stored for `serve` to send."""
    runs: list[dict[str, Any]] = []
    session_id, [denied_key, approved_key] = await awaiting_calls(
        database_url, emulator, payments(runs), REFUND, {"order_id": "B2", "cents": 100}
    )
    app = create_app(Settings(database_url=database_url, openai_api_key="", openai_base_url=""))
    async with serving(app, base_url="http://127.0.0.1:8700") as client:
        denied = await client.post(
            path(denied_key, "deny"), json={"reason": "duplicate", "operator": "carol"}
        )
        approved = await client.post(
            path(approved_key, "approve"),
            json={
                "reason": "small",
                "arguments_sha256": arguments_fingerprint({"order_id": "B2", "cents": 100}),
            },
        )
        assert (denied.status_code, approved.status_code) == (200, 200), (denied.text, approved.text)
        assert (denied.json()["action"], denied.json()["call"]["status"]) == ("not_sent", "failed")
        assert approved.json()["action"] == "left_for_service"
        actors = [
            [event["actor"] for event in approvals((await client.get(f"/api/calls/{key}")).json())]
            for key in (denied_key, approved_key)
        ]
    assert actors == [["operator:carol"], ["operator:local"]]
    assert runs == []
    assert emulator.control.tool_results(session_id) == []


@pytest.mark.parametrize("action", ["approve", "deny"])
async def test_decisions__a_call_that_does_not_await_approval__409(sqlite_url: str, action: str) -> None:
    key = CallKey("sess_unknown", "turn_1", "call_1")
    await add_unknown_call(sqlite_url, key, "charge_card", {"amount": 1})
    async with serving(create_app(api_settings(sqlite_url))) as client:
        body = {"reason": "ok", "arguments_sha256": arguments_fingerprint({"amount": 1})}
        response = await client.post(path(key, action), json=body, headers=FULL)
    assert response.status_code == 409
    assert "is unknown: only a call awaiting approval" in response.json()["detail"]
