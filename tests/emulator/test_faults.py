"""Each injected fault, seen by the real SDK as it would see it from the real service."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any, Literal

import openai
import pytest
from openai import OpenAI
from openai.types.beta.agent_session_event import AgentSessionEvent

from tests.emulator.session_driver import (
    first_pending_call,
    new_session,
    pending_calls,
    start_turn,
    submit,
    wait_for_status,
)
from toolledger.emulator import EmulatorServer, Script

ONE_CALL = Script.of_calls([("charge_card", {"cents": 100})])


@pytest.fixture
def retrying_client(emulator: EmulatorServer) -> Iterator[OpenAI]:
    """The SDK with its default transport retries, as applications run it."""
    with OpenAI(base_url=emulator.base_url, api_key="sk-test", max_retries=2) as sdk:
        yield sdk


def pending_session(client: OpenAI, script: Script = ONE_CALL) -> tuple[str, Any]:
    session_id = new_session(client, script)
    start_turn(client, session_id)
    return session_id, first_pending_call(client, session_id)


# ------------------------------------------------------------------------ streams


@pytest.mark.parametrize(("mode", "error"), [("drop", openai.APIConnectionError), ("end", None)])
def test_close_streams__after_n_events(
    client: OpenAI, emulator: EmulatorServer, mode: Literal["drop", "end"], error: type[Exception] | None
) -> None:
    session_id = new_session(client, ONE_CALL)
    received: list[AgentSessionEvent] = []
    with client.beta.agents.sessions.events.stream(session_id) as stream:
        events = iter(stream)
        assert next(events).type == "agent.session.idle"
        emulator.control.close_streams(after_events=3, mode=mode, session_id=session_id)
        start_turn(client, session_id)
        if error is None:
            received.extend(events)
        else:
            with pytest.raises(error):
                received.extend(events)
    assert [e.type for e in received] == [
        "agent.session.turn.created",
        "agent.session.turn.item.added",
        "agent.session.in_progress",
    ]
    assert emulator.control.faults() == []  # spent

    with client.beta.agents.sessions.events.stream(session_id) as again:
        assert next(iter(again)).type == "agent.session.requires_action"


def test_close_streams__cuts_an_open_stream_at_once(client: OpenAI, emulator: EmulatorServer) -> None:
    session_id = new_session(client)
    with client.beta.agents.sessions.events.stream(session_id) as stream:
        events = iter(stream)
        next(events)
        emulator.control.close_streams(session_id=session_id)
        with pytest.raises(openai.APIConnectionError):
            next(events)


def test_close_streams__breaks_the_sdk_helper_mid_turn(client: OpenAI, emulator: EmulatorServer) -> None:
    session_id = new_session(client, Script.of_calls([("charge_card", {})], [("send_receipt", {})]))
    emulator.control.close_streams(after_events=8, session_id=session_id)
    handled: list[str] = []

    def handler(name: str) -> Any:
        def handle(_arguments: dict[str, Any]) -> str:
            handled.append(name)
            return "ok"

        return handle

    with (
        pytest.raises(openai.APIConnectionError),
        client.beta.agents.sessions.stream(
            session_id,
            input="go",
            tool_handlers={"charge_card": handler("charge"), "send_receipt": handler("receipt")},
        ) as stream,
    ):
        stream.until_done()
    # The first call ran and its result landed; the session now waits for the second,
    # which only a durable worker that reconciles would answer.
    assert handled == ["charge"]
    session = wait_for_status(client, session_id, "requires_action")
    assert [a.name for a in pending_calls(session)] == ["send_receipt"]


def test_duplicate_events__repeat_event_ids_and_the_sdk_helper_runs_each_call_once(
    client: OpenAI, emulator: EmulatorServer
) -> None:
    session_id = new_session(client, ONE_CALL)
    emulator.control.duplicate_events(count=None, session_id=session_id)
    seen: list[AgentSessionEvent] = []
    runs: list[dict[str, Any]] = []

    def charge(arguments: dict[str, Any]) -> str:
        runs.append(arguments)
        return "charged"

    with client.beta.agents.sessions.events.stream(session_id) as raw:
        raw_events = iter(raw)
        next(raw_events)  # snapshot
        with client.beta.agents.sessions.stream(
            session_id, input="go", tool_handlers={"charge_card": charge}
        ) as helper:
            result = helper.get_final_result()
        for event in raw_events:
            seen.append(event)
            if [e.type for e in seen].count("agent.session.idle") == 2:
                break

    assert result.turn.status == "completed"
    assert runs == [{"cents": 100}]
    assert len(emulator.control.accepted_results(session_id)) == 1
    ids = [e.event_id for e in seen]
    assert ids[0::2] == ids[1::2]  # every event twice, with one id
    assert len(set(ids)) == len(ids) // 2


# ------------------------------------------------------------------- submissions


@pytest.mark.parametrize(
    ("status", "exception"), [(500, openai.InternalServerError), (503, openai.InternalServerError)]
)
def test_fail_submissions__answers_errors_and_applies_nothing(
    client: OpenAI, emulator: EmulatorServer, status: int, exception: type[Exception]
) -> None:
    session_id, action = pending_session(client)
    emulator.control.fail_submissions(2, status=status)

    for _ in range(2):
        with pytest.raises(exception):
            submit(client, session_id, action, output="charged", key="k")
    assert pending_calls(client.beta.agents.sessions.retrieve(session_id))[0].call_id == action.call_id

    submit(client, session_id, action, output="charged", key="k")

    receipts = emulator.control.tool_results(session_id)
    assert [r.outcome for r in receipts] == ["rejected", "rejected", "accepted"]
    assert receipts[0].reason == f"injected HTTP {status}"


def test_fail_submissions__are_retried_by_the_sdk_with_the_same_key(
    retrying_client: OpenAI, emulator: EmulatorServer
) -> None:
    session_id, action = pending_session(retrying_client)
    emulator.control.fail_submissions(2, status=503, retry_after=0.01)

    submit(retrying_client, session_id, action, output="charged", key="stable-key")

    receipts = emulator.control.tool_results(session_id)
    assert [r.outcome for r in receipts] == ["rejected", "rejected", "accepted"]
    assert {r.idempotency_key for r in receipts} == {"stable-key"}


def test_accept_then_drop__lands_the_result_though_the_client_sees_a_transport_error(
    client: OpenAI, emulator: EmulatorServer
) -> None:
    session_id, action = pending_session(client)
    emulator.control.accept_then_drop(session_id=session_id)

    with pytest.raises(openai.APIConnectionError):
        submit(client, session_id, action, output="charged", key="k-drop")

    assert client.beta.agents.sessions.retrieve(session_id).required_actions == []
    submit(client, session_id, action, output="charged", key="k-drop")  # the resubmission after a crash
    assert [r.outcome for r in emulator.control.tool_results(session_id)] == ["accepted", "replayed"]
    assert len(emulator.control.accepted_results(session_id)) == 1


def test_accept_then_drop__sdk_retry_gets_the_replayed_answer(
    retrying_client: OpenAI, emulator: EmulatorServer
) -> None:
    session_id, action = pending_session(retrying_client)
    emulator.control.accept_then_drop(session_id=session_id)

    submit(retrying_client, session_id, action, output="charged", key="k-retry")

    assert [r.outcome for r in emulator.control.tool_results(session_id)] == ["accepted", "replayed"]


def test_drop_before_apply__loses_the_request(client: OpenAI, emulator: EmulatorServer) -> None:
    session_id, action = pending_session(client)
    emulator.control.drop_before_apply(session_id=session_id)

    with pytest.raises(openai.APIConnectionError):
        submit(client, session_id, action, output="charged", key="k-lost")

    assert [a.call_id for a in pending_calls(client.beta.agents.sessions.retrieve(session_id))] == [
        action.call_id
    ]
    submit(client, session_id, action, output="charged", key="k-lost")
    assert [r.outcome for r in emulator.control.tool_results(session_id)] == ["rejected", "accepted"]


def test_unknown_pending__is_the_race_the_sdk_recognises(client: OpenAI, emulator: EmulatorServer) -> None:
    session_id, action = pending_session(client)
    emulator.control.unknown_pending(2, session_id=session_id)

    for _ in range(2):
        with pytest.raises(openai.BadRequestError) as caught:
            submit(client, session_id, action, output="x", key="k-race")
        assert isinstance(caught.value.body, dict)
        assert caught.value.body["code"] == "invalid_request_error"
        assert caught.value.body["message"] == f"Unknown pending tool call: {action.call_id}"
    submit(client, session_id, action, output="x", key="k-race")

    assert [r.outcome for r in emulator.control.tool_results(session_id)] == [
        "rejected",
        "rejected",
        "accepted",
    ]


def test_delay_registration__the_sdk_helper_retries_the_race_and_succeeds(
    client: OpenAI, emulator: EmulatorServer
) -> None:
    session_id = new_session(client, ONE_CALL)
    emulator.control.delay_registration(0.35, session_id=session_id)

    with client.beta.agents.sessions.stream(
        session_id, input="go", tool_handlers={"charge_card": lambda _a: "charged"}
    ) as stream:
        result = stream.get_final_result()

    assert result.turn.status == "completed"
    receipts = emulator.control.tool_results(session_id)
    assert receipts[-1].outcome == "accepted"
    rejected = receipts[:-1]
    assert rejected, "the handler answered before registration, so at least one try hit the race"
    assert all(r.outcome == "rejected" and r.reason is not None for r in rejected)
    assert all(r.reason is not None and r.reason.startswith("Unknown pending tool call") for r in rejected)
    assert len({r.idempotency_key for r in receipts}) == 1


def test_delay_registration__keeps_the_session_in_progress_until_registered(
    client: OpenAI, emulator: EmulatorServer
) -> None:
    session_id = new_session(client, ONE_CALL)
    emulator.control.delay_registration(0.5, session_id=session_id)
    start_turn(client, session_id)
    time.sleep(0.1)
    early = client.beta.agents.sessions.retrieve(session_id)
    assert early.status == "in_progress"
    assert early.required_actions == []
    assert pending_calls(wait_for_status(client, session_id, "requires_action"))[0].name == "charge_card"


# ---------------------------------------------------------------------- sessions


def test_fail_session__fails_the_turn_and_refuses_results(client: OpenAI, emulator: EmulatorServer) -> None:
    session_id, action = pending_session(client)
    with client.beta.agents.sessions.events.stream(session_id) as stream:
        events = iter(stream)
        assert next(events).type == "agent.session.requires_action"
        emulator.control.fail_session(session_id, "backend on fire")
        turn_failed = next(events)
        session_failed = next(events)

    assert turn_failed.type == "agent.session.turn.failed"
    assert turn_failed.turn.error is not None
    assert turn_failed.turn.error.message == "backend on fire"
    assert session_failed.type == "agent.session.failed"
    assert session_failed.session.status == "failed"
    session = client.beta.agents.sessions.retrieve(session_id)
    assert (session.status, session.error, session.required_actions) == ("failed", "backend on fire", [])
    with pytest.raises(openai.BadRequestError) as caught:
        submit(client, session_id, action, output="late")
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["code"] == "session_failed"


def test_cancel_turn__ends_the_turn_as_cancelled(client: OpenAI, emulator: EmulatorServer) -> None:
    session_id, action = pending_session(client)
    with client.beta.agents.sessions.events.stream(session_id) as stream:
        events = iter(stream)
        next(events)
        emulator.control.cancel_turn(session_id)
        cancelled = next(events)
        idle = next(events)

    assert cancelled.type == "agent.session.turn.cancelled"
    assert cancelled.turn.id == action.turn_id
    assert cancelled.turn.status == "cancelled"
    assert idle.type == "agent.session.idle"
    assert idle.session.required_actions == []


def test_client_killed_mid_request__emulator_stays_quiet_and_serves_on(
    client: OpenAI, emulator: EmulatorServer, caplog: pytest.LogCaptureFixture
) -> None:
    host, port = emulator.base_url.split("//")[1].split("/")[0].split(":")
    caplog.set_level("ERROR")
    with socket.create_connection((host, int(port))) as half_sent:
        half_sent.sendall(
            b"POST /v1/agents/sessions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"environment":'
        )
        time.sleep(0.2)
    time.sleep(0.3)

    assert not [r for r in caplog.records if r.levelname == "ERROR"], "a dead client is not an error"
    assert new_session(client)
