"""Malformed requests the SDK cannot send, sent raw with httpx: each gets a 4xx in the API's
error envelope, never a 500, and nothing of it is applied."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI
from openai.types.beta.agent_session import AgentSession

from tests.emulator.session_driver import first_pending_call, new_session, start_turn, tool_result
from toolledger.emulator import EmulatorServer, Script
from toolledger.emulator.app import MAX_BODY_BYTES

EVENTS = "/v1/agents/sessions/{session}/events"
SESSIONS = "/v1/agents/sessions"
SESSION = "/v1/agents/sessions/{session}"
CONTROL = "/_emulator"

NONE_ENV = {"type": "none"}
MESSAGE: dict[str, Any] = {
    "type": "agent.session.input.message",
    "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
}
TOOL_RESULT: dict[str, Any] = {
    "type": "agent.session.input.tool_result",
    "turn_id": "turn_unknown",
    "call_id": "call_unknown",
    "success": True,
    "output": "done",
}
CANCEL: dict[str, Any] = {"type": "agent.session.input.cancel"}


def j(value: Any) -> bytes:
    return json.dumps(value).encode()


def events(*items: Any) -> bytes:
    return j({"events": list(items)})


def message_with(**changes: Any) -> dict[str, Any]:
    """The message event with its single message changed."""
    return {**MESSAGE, "input": [{**MESSAGE["input"][0], **changes}]}


def tool_result_with(**changes: Any) -> dict[str, Any]:
    return {key: value for key, value in {**TOOL_RESULT, **changes}.items() if value is not ...}


def create_body(**changes: Any) -> bytes:
    body = {"environment": NONE_ENV, "agent": {"model": "m"}, **changes}
    return j({key: value for key, value in body.items() if value is not ...})


@dataclass(frozen=True)
class Bad:
    """One malformed request and the refusal it must get."""

    method: str
    path: str
    body: bytes = field(default=b"", repr=False)
    status: int | tuple[int, ...] = 400
    """The status it must get, or the statuses it may get."""
    code: str | None = None
    param: str | None = None
    content_type: str | None = "application/json"
    oversize: int = 0
    """Send this many bytes of filler instead of ``body``."""
    chunked: bool = False
    """Send the body without a Content-Length, in pieces."""

    def content(self) -> bytes | Iterator[bytes] | None:
        if self.oversize and self.chunked:
            return _pieces(self.oversize)
        if self.oversize:
            return b" " * self.oversize
        return self.body or None


def _pieces(total: int) -> Iterator[bytes]:
    while total > 0:
        size = min(total, 1024 * 1024)
        yield b" " * size
        total -= size


def raw_client(base_url: str) -> httpx.Client:
    """Plain HTTP to the emulator's root; every request on a connection of its own, so a
    connection the server drops harms no other request."""
    return httpx.Client(
        base_url=base_url.removesuffix("/v1"), timeout=10, limits=httpx.Limits(max_keepalive_connections=0)
    )


def send(http: httpx.Client, bad: Bad, session_id: str) -> httpx.Response:
    headers = {"content-type": bad.content_type} if bad.content_type else {}
    return http.request(
        bad.method, bad.path.format(session=session_id), content=bad.content(), headers=headers
    )


def assert_refused(response: httpx.Response, bad: Bad) -> None:
    assert response.status_code < 500, f"{response.status_code}: {response.text}"
    assert response.status_code in (bad.status if isinstance(bad.status, tuple) else (bad.status,)), (
        response.text
    )
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert isinstance(error["message"], str)
    assert error["message"]
    assert error["type"] == "invalid_request_error"
    if bad.code is not None:
        assert error["code"] == bad.code
    if bad.param is not None:
        assert error["param"] == bad.param


TOO_LARGE = MAX_BODY_BYTES + 1

BAD_REQUESTS: dict[str, Bad] = {
    # ------------------------------------------------------------ event submissions
    "events-invalid-json": Bad("POST", EVENTS, b'{"events": [', code="invalid_value"),
    "events-empty-body": Bad("POST", EVENTS, b""),
    "events-json-array": Bad("POST", EVENTS, j([MESSAGE])),
    "events-json-null": Bad("POST", EVENTS, b"null"),
    "events-invalid-utf8": Bad("POST", EVENTS, b'{"events": "\xff\xfe"}'),
    "events-nested-too-deep": Bad("POST", EVENTS, b"[" * 50_000 + b"]" * 50_000),
    "events-missing": Bad("POST", EVENTS, j({}), param="events"),
    "events-not-a-list": Bad("POST", EVENTS, j({"events": MESSAGE}), param="events"),
    "events-empty-list": Bad("POST", EVENTS, events(), param="events"),
    "events-over-100": Bad("POST", EVENTS, events(*[CANCEL] * 101), param="events"),
    "event-null": Bad("POST", EVENTS, events(None)),
    "event-missing-type": Bad("POST", EVENTS, events({"input": MESSAGE["input"]})),
    "event-unknown-type": Bad("POST", EVENTS, events({**MESSAGE, "type": "agent.session.input.telepathy"})),
    "event-type-not-a-string": Bad("POST", EVENTS, events({**MESSAGE, "type": 5})),
    "event-unknown-field": Bad("POST", EVENTS, events({**MESSAGE, "priority": "high"})),
    "message-input-a-string": Bad("POST", EVENTS, events({**MESSAGE, "input": "hi"})),
    "message-not-from-user": Bad("POST", EVENTS, events(message_with(role="assistant"))),
    "message-without-content": Bad("POST", EVENTS, events(message_with(content=[]))),
    "message-unknown-content-type": Bad(
        "POST", EVENTS, events(message_with(content=[{"type": "input_audio", "data": "x"}]))
    ),
    "message-text-not-a-string": Bad(
        "POST", EVENTS, events(message_with(content=[{"type": "input_text", "text": 5}]))
    ),
    "tool-result-missing-call-id": Bad("POST", EVENTS, events(tool_result_with(call_id=...))),
    "tool-result-empty-call-id": Bad("POST", EVENTS, events(tool_result_with(call_id=""))),
    "tool-result-success-a-string": Bad("POST", EVENTS, events(tool_result_with(success="yes"))),
    "tool-result-output-a-number": Bad("POST", EVENTS, events(tool_result_with(output=5))),
    "tool-result-for-unknown-call": Bad("POST", EVENTS, events(TOOL_RESULT), code="invalid_request_error"),
    "cancel-without-a-turn": Bad("POST", EVENTS, events(CANCEL), code="no_active_turn"),
    "approval-result-without-a-request": Bad(
        "POST",
        EVENTS,
        events({"type": "agent.session.input.mcp_approval_request_result", "request_id": "mcpr_x"}),
        param="request_id",
    ),
    "events-form-encoded": Bad(
        "POST", EVENTS, b"events=cancel", content_type="application/x-www-form-urlencoded", status=415
    ),
    "events-unknown-session": Bad(
        "POST", "/v1/agents/sessions/sess_unknown/events", events(CANCEL), status=404, code="not_found"
    ),
    "events-over-8mib": Bad("POST", EVENTS, status=413, code="body_too_large", oversize=TOO_LARGE),
    "events-over-8mib-chunked": Bad(
        "POST", EVENTS, status=413, code="body_too_large", oversize=TOO_LARGE, chunked=True
    ),
    # ------------------------------------------------------------ session creation
    "create-invalid-json": Bad("POST", SESSIONS, b'{"environment": '),
    "create-json-array": Bad("POST", SESSIONS, j([{"environment": NONE_ENV}])),
    "create-without-environment": Bad("POST", SESSIONS, create_body(environment=...), param="environment"),
    "create-unknown-environment": Bad("POST", SESSIONS, create_body(environment={"type": "mars"})),
    "create-environment-a-string": Bad("POST", SESSIONS, create_body(environment="none")),
    "create-without-model": Bad(
        "POST", SESSIONS, create_body(agent=...), code="missing_required_parameter", param="agent.model"
    ),
    "create-stream-without-input": Bad(
        "POST", SESSIONS, create_body(stream=True), code="missing_required_parameter", param="input"
    ),
    "create-metadata-value-a-number": Bad("POST", SESSIONS, create_body(metadata={"k": 1})),
    "create-metadata-a-list": Bad("POST", SESSIONS, create_body(metadata=["k"]), param="metadata"),
    "create-metadata-17-pairs": Bad(
        "POST", SESSIONS, create_body(metadata={f"k{n}": "v" for n in range(17)}), param="metadata"
    ),
    "create-unknown-field": Bad("POST", SESSIONS, create_body(temperature=0.2)),
    "create-unusable-script": Bad(
        "POST",
        SESSIONS,
        create_body(metadata={"emulator_script": "{not a script"}),
        param="metadata.emulator_script",
    ),
    "create-input-empty-message": Bad("POST", SESSIONS, create_body(input=[{"role": "user", "content": []}])),
    "create-over-8mib": Bad("POST", SESSIONS, status=413, code="body_too_large", oversize=TOO_LARGE),
    # ------------------------------------------------------------ session update
    "update-invalid-json": Bad("POST", SESSION, b"{"),
    "update-unknown-field": Bad("POST", SESSION, j({"name": "x"})),
    "update-metadata-a-string": Bad("POST", SESSION, j({"metadata": "k=v"}), param="metadata"),
    "update-unknown-review": Bad("POST", SESSION, j({"review": "sometimes"}), param="review"),
    "update-unknown-session": Bad(
        "POST", "/v1/agents/sessions/sess_unknown", j({"metadata": {}}), status=404, code="not_found"
    ),
    # ------------------------------------------------------------ queries and routes
    "list-limit-negative": Bad("GET", SESSIONS + "?limit=-1", param="limit"),
    "list-limit-zero": Bad("GET", SESSIONS + "?limit=0", param="limit"),
    "list-limit-over-100": Bad("GET", SESSIONS + "?limit=101", param="limit"),
    "list-limit-not-a-number": Bad("GET", SESSIONS + "?limit=abc", param="limit"),
    "list-limit-fractional": Bad("GET", SESSIONS + "?limit=1.5", param="limit"),
    "list-order-unknown": Bad("GET", SESSIONS + "?order=sideways", param="order"),
    "list-after-unknown": Bad("GET", SESSIONS + "?after=sess_unknown", param="after"),
    "list-metadata-empty-key": Bad("GET", SESSIONS + "?metadata[]=x", param="metadata"),
    "list-metadata-long-value": Bad("GET", SESSIONS + "?metadata[k]=" + "v" * 513, param="metadata"),
    "stream-bad-flag": Bad("GET", EVENTS + "?include_obfuscation=maybe", param="include_obfuscation"),
    "stream-unknown-session": Bad("GET", "/v1/agents/sessions/sess_unknown/events", status=404),
    "retrieve-unknown": Bad("GET", "/v1/agents/sessions/sess_unknown", status=404, code="not_found"),
    "delete-unknown": Bad("DELETE", "/v1/agents/sessions/sess_unknown", status=404, code="not_found"),
    "unknown-route": Bad("GET", "/v1/agents/nothing-here", status=404),
    "wrong-method": Bad("PUT", SESSIONS, j({}), status=405),
    # ------------------------------------------------------------ control API
    "fault-invalid-json": Bad("POST", CONTROL + "/faults", b"{kind: close_streams}"),
    "fault-without-kind": Bad("POST", CONTROL + "/faults", j({"count": 1})),
    "fault-unknown-kind": Bad("POST", CONTROL + "/faults", j({"kind": "meteor_strike"})),
    "fault-2xx-status": Bad("POST", CONTROL + "/faults", j({"kind": "fail_submissions", "status": 200})),
    "fault-count-zero": Bad("POST", CONTROL + "/faults", j({"kind": "close_streams", "count": 0})),
    "fault-unknown-field": Bad("POST", CONTROL + "/faults", j({"kind": "duplicate_events", "often": True})),
    "fault-over-8mib": Bad(
        "POST", CONTROL + "/faults", status=413, code="body_too_large", oversize=TOO_LARGE
    ),
    "script-empty-step": Bad("PUT", CONTROL + "/scripts/empty-step", j({"steps": [{"calls": []}]})),
    "default-script-a-list": Bad("PUT", CONTROL + "/default-script", j([])),
    "session-script-too-slow": Bad("PUT", CONTROL + "/sessions/{session}/script", j({"think_seconds": 61})),
    "session-script-unknown-session": Bad(
        "PUT", CONTROL + "/sessions/sess_unknown/script", j({}), status=404, code="not_found"
    ),
    "fail-message-a-number": Bad("POST", CONTROL + "/sessions/{session}/fail", j({"message": 5})),
    "fail-message-too-long": Bad("POST", CONTROL + "/sessions/{session}/fail", j({"message": "x" * 2001})),
    "fail-unknown-session": Bad(
        "POST", CONTROL + "/sessions/sess_unknown/fail", status=404, code="not_found"
    ),
    "cancel-without-a-turn-control": Bad(
        "POST", CONTROL + "/sessions/{session}/cancel", code="no_active_turn"
    ),
    "control-unknown-route": Bad("GET", CONTROL + "/nothing-here", status=404),
}

AGENT_AND_CONTENT_TYPE_CASES = [
    pytest.param(
        Bad("POST", SESSIONS, create_body(agent={"model": "m", "reasoning": "high"})),
        id="create-agent-reasoning-a-string",
    ),
    pytest.param(
        Bad("POST", SESSIONS, create_body(agent={"model": "m", "tools": 5})),
        id="create-agent-tools-a-number",
    ),
    pytest.param(
        Bad("POST", SESSION, j({"agent": {"reasoning": "high"}})),
        id="update-agent-reasoning-a-string",
    ),
    pytest.param(
        Bad("POST", SESSIONS, create_body(agent={"model": 5})),
        id="create-agent-model-a-number",
    ),
    pytest.param(
        Bad("POST", SESSIONS, create_body(agent={"model": "m", "service_tier": "cheapest"})),
        id="create-agent-unknown-service-tier",
    ),
    pytest.param(
        Bad("POST", EVENTS, events(MESSAGE), content_type="text/plain", status=(400, 415)),
        id="events-json-sent-as-text-plain",
    ),
]


@dataclass
class World:
    """The shared emulator with one idle session, as every malformed request must leave it."""

    http: httpx.Client
    session: AgentSession


@pytest.fixture(scope="module")
def world(emulator_server: EmulatorServer) -> Iterator[World]:
    emulator_server.control.reset()
    with (
        OpenAI(
            base_url=emulator_server.base_url,
            api_key="sk-test",
            max_retries=0,
            _strict_response_validation=True,
        ) as sdk,
        raw_client(emulator_server.base_url) as http,
    ):
        session = sdk.beta.agents.sessions.create(
            environment={"type": "none"}, agent={"model": "emulated"}, metadata={"role": "target"}
        )
        yield World(http, session)
    emulator_server.control.reset()


@pytest.mark.parametrize("bad", list(BAD_REQUESTS.values()), ids=list(BAD_REQUESTS))
def test_malformed_request__sent_raw__is_refused_with_a_4xx_error_envelope(world: World, bad: Bad) -> None:
    response = send(world.http, bad, world.session.id)

    assert_refused(response, bad)


@pytest.mark.parametrize("bad", AGENT_AND_CONTENT_TYPE_CASES)
def test_malformed_agent_or_content_type__is_refused_and_applies_nothing(
    client: OpenAI, emulator: EmulatorServer, bad: Bad
) -> None:
    session = client.beta.agents.sessions.create(environment={"type": "none"}, agent={"model": "emulated"})

    with raw_client(emulator.base_url) as http:
        response = send(http, bad, session.id)

    assert_refused(response, bad)
    assert client.beta.agents.sessions.retrieve(session.id) == session
    assert [s.id for s in client.beta.agents.sessions.list().data] == [session.id]


def test_every_malformed_request__in_a_burst__applies_nothing_and_the_emulator_still_works(
    client: OpenAI, emulator: EmulatorServer
) -> None:
    session = client.beta.agents.sessions.create(
        environment={"type": "none"}, agent={"model": "emulated"}, metadata={"role": "target"}
    )
    cases = list(BAD_REQUESTS.values())

    with raw_client(emulator.base_url) as http, ThreadPoolExecutor(max_workers=8) as pool:
        responses = list(pool.map(lambda bad: send(http, bad, session.id), cases))

    assert [r.status_code for r in responses] == [bad.status for bad in cases]
    assert client.beta.agents.sessions.list().data == [session]
    assert emulator.control.faults() == []
    assert emulator.control.accepted_results() == {}
    assert [r.outcome for r in emulator.control.tool_results()] == ["rejected"]
    # The emulator still runs a whole turn, tool call included, for the same session.
    emulator.control.set_script(session.id, Script.of_calls([("lookup_order", {"order_id": "A1"})]))
    with client.beta.agents.sessions.stream(
        session.id, input="go", tool_handlers={"lookup_order": lambda arguments: {"found": arguments}}
    ) as stream:
        result = stream.get_final_result()
    assert result.turn.status == "completed"
    assert "lookup_order: ok" in result.messages[-1].output_text
    assert len(emulator.control.accepted_results(session.id)) == 1


def test_tool_result__for_a_call_of_another_session__is_refused_as_unknown(client: OpenAI) -> None:
    owner = new_session(client, Script.of_calls([("charge_card", {"cents": 1})]))
    start_turn(client, owner)
    action = first_pending_call(client, owner)
    stranger = new_session(client)

    with pytest.raises(openai.BadRequestError) as caught:
        client.beta.agents.sessions.events.create(
            stranger,
            events=[tool_result(action, output="charged")],
        )

    assert caught.value.message.endswith(f"Unknown pending tool call: {action.call_id}")
    assert client.beta.agents.sessions.retrieve(owner).status == "requires_action"
