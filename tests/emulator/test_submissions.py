"""Tool-result submissions: idempotency, refusals, and the record of what was received."""

from __future__ import annotations

import httpx2
import openai
import pytest
from openai import OpenAI

from tests.emulator.session_driver import first_pending_call, new_session, start_turn, submit, tool_result
from toolledger.emulator import AlreadyAnswered, ApiBehaviour, EmulatorServer, Script

ONE_CALL = Script.of_calls([("charge_card", {"cents": 100})])


def test_idempotent_repeat__applies_once_and_replays_the_answer(
    client: OpenAI, emulator: EmulatorServer
) -> None:
    session_id = new_session(client, ONE_CALL)
    start_turn(client, session_id)
    action = first_pending_call(client, session_id)

    for _ in range(3):
        submit(client, session_id, action, output="charged", key="key-1")

    receipts = emulator.control.tool_results(session_id)
    assert [r.outcome for r in receipts] == ["accepted", "replayed", "replayed"]
    assert {r.idempotency_key for r in receipts} == {"key-1"}
    assert receipts[0].payload == {
        "type": "agent.session.input.tool_result",
        "turn_id": action.turn_id,
        "call_id": action.call_id,
        "success": True,
        "output": "charged",
    }
    assert emulator.control.accepted_results(session_id) == {
        (session_id, action.turn_id, action.call_id): [receipts[0].payload]
    }


def test_idempotency_key__reused_with_another_body_is_refused(
    client: OpenAI, emulator: EmulatorServer
) -> None:
    session_id = new_session(client, ONE_CALL)
    start_turn(client, session_id)
    action = first_pending_call(client, session_id)
    submit(client, session_id, action, output="first", key="key-2")

    with pytest.raises(openai.BadRequestError) as caught:
        submit(client, session_id, action, output="second", key="key-2")

    assert isinstance(caught.value.body, dict)
    assert caught.value.body["code"] == "idempotency_key_reused"
    assert [r.outcome for r in emulator.control.tool_results(session_id)] == ["accepted", "rejected"]


def test_second_result__for_an_answered_call_is_a_clear_4xx(client: OpenAI, emulator: EmulatorServer) -> None:
    session_id = new_session(client, Script.of_calls([("charge_card", {}), ("send_receipt", {})]))
    start_turn(client, session_id)
    action = first_pending_call(client, session_id)
    submit(client, session_id, action, output="once")

    with pytest.raises(openai.BadRequestError) as caught:
        submit(client, session_id, action, output="twice")

    assert isinstance(caught.value.body, dict)
    assert caught.value.body["code"] == "tool_result_already_submitted"
    assert action.call_id in caught.value.body["message"]
    receipts = emulator.control.tool_results(session_id)
    assert [r.outcome for r in receipts] == ["accepted", "rejected"]
    assert receipts[1].reason is not None
    assert "already has a result" in receipts[1].reason


@pytest.mark.parametrize("wrong", ["call_id", "turn_id"])
def test_result__for_a_call_that_is_not_pending_gets_the_race_error(client: OpenAI, wrong: str) -> None:
    session_id = new_session(client, ONE_CALL)
    start_turn(client, session_id)
    action = first_pending_call(client, session_id)
    stranger = action.model_copy(update={wrong: f"{wrong}_unknown"})

    with pytest.raises(openai.BadRequestError) as caught:
        submit(client, session_id, stranger, output="x")

    # Exactly what the SDK's helper matches to recognise the registration race.
    assert caught.value.body == {
        "message": f"Unknown pending tool call: {stranger.call_id}",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_request_error",
    }


def test_batch__with_one_bad_result_applies_nothing(client: OpenAI, emulator: EmulatorServer) -> None:
    session_id = new_session(client, Script.of_calls([("charge_card", {}), ("send_receipt", {})]))
    start_turn(client, session_id)
    action = first_pending_call(client, session_id)

    with pytest.raises(openai.BadRequestError):
        client.beta.agents.sessions.events.create(
            session_id,
            events=[
                tool_result(action, output="good"),
                tool_result(action, output="bad", call_id="call_nobody"),
            ],
        )

    pending = client.beta.agents.sessions.retrieve(session_id).required_actions
    assert action.call_id in [a.call_id for a in pending if a.type == "function_call"]
    assert emulator.control.accepted_results(session_id) == {}


def test_failure_result__is_recorded_with_its_error(client: OpenAI, emulator: EmulatorServer) -> None:
    session_id = new_session(client, ONE_CALL)
    start_turn(client, session_id)
    action = first_pending_call(client, session_id)

    client.beta.agents.sessions.events.create(
        session_id,
        events=[tool_result(action, error="card declined")],
    )

    [receipt] = emulator.control.tool_results(session_id)
    assert receipt.outcome == "accepted"
    assert receipt.payload["success"] is False
    assert receipt.payload["error"] == "card declined"


# ----------------------------------------------- where real APIs answer their own way


@pytest.mark.parametrize(
    ("style", "status", "code", "words"),
    [
        ("coded", 400, "tool_result_already_submitted", "already has a result"),
        ("worded", 400, None, "has already been answered"),
        ("conflict", 409, None, "was already received"),
        ("unknown_pending", 400, "invalid_request_error", "Unknown pending tool call: "),
    ],
)
def test_an_answered_call__is_refused_in_the_wording_the_behaviour_names(
    client: OpenAI,
    emulator: EmulatorServer,
    style: AlreadyAnswered,
    status: int,
    code: str | None,
    words: str,
) -> None:
    emulator.control.set_behaviour(already_answered=style)
    session_id = new_session(client, Script.of_calls([("charge_card", {}), ("send_receipt", {})]))
    start_turn(client, session_id)
    action = first_pending_call(client, session_id)
    submit(client, session_id, action, output="once")

    with pytest.raises(openai.APIStatusError) as caught:
        submit(client, session_id, action, output="twice")

    assert caught.value.status_code == status
    assert isinstance(caught.value.body, dict)
    assert caught.value.body.get("code") == code
    assert words in caught.value.body["message"]
    assert [r.outcome for r in emulator.control.tool_results(session_id)] == ["accepted", "rejected"]


def test_a_scripts_wording__wins_over_the_emulators_for_its_sessions(
    client: OpenAI, emulator: EmulatorServer
) -> None:
    emulator.control.set_behaviour(already_answered="conflict")
    script = Script.of_calls([("charge_card", {}), ("send_receipt", {})]).model_copy(
        update={"already_answered": "worded"}
    )
    session_id = new_session(client, script)
    start_turn(client, session_id)
    action = first_pending_call(client, session_id)
    submit(client, session_id, action, output="once")

    with pytest.raises(openai.BadRequestError) as caught:
        submit(client, session_id, action, output="twice")

    assert isinstance(caught.value.body, dict)
    assert "has already been answered" in caught.value.body["message"]
    assert emulator.control.behaviour() == ApiBehaviour(already_answered="conflict")


def test_idempotency_keys_ignored__a_repeat_is_applied_anew_and_refused_once_answered(
    client: OpenAI, emulator: EmulatorServer
) -> None:
    """As an API that keeps no keys: the same request twice is two requests to it."""
    emulator.control.set_behaviour(idempotency_keys="ignored")
    session_id = new_session(client, ONE_CALL)
    start_turn(client, session_id)
    action = first_pending_call(client, session_id)
    submit(client, session_id, action, output="charged", key="key-1")

    with pytest.raises(openai.BadRequestError):
        submit(client, session_id, action, output="charged", key="key-1")

    receipts = emulator.control.tool_results(session_id)
    assert [r.outcome for r in receipts] == ["accepted", "rejected"]
    assert receipts[0].request_sha256 == receipts[1].request_sha256, "one request, posted twice"


def test_request_hash__the_same_for_a_replay_and_another_for_another_body(
    client: OpenAI, emulator: EmulatorServer
) -> None:
    session_id = new_session(client, Script.of_calls([("charge_card", {}), ("send_receipt", {})]))
    start_turn(client, session_id)
    action = first_pending_call(client, session_id)
    submit(client, session_id, action, output="once", key="key-a")
    submit(client, session_id, action, output="once", key="key-a")
    with pytest.raises(openai.BadRequestError):
        submit(client, session_id, action, output="other", key="key-b")

    first, replay, other = emulator.control.tool_results(session_id)
    assert (first.outcome, replay.outcome, other.outcome) == ("accepted", "replayed", "rejected")
    assert first.request_sha256 == replay.request_sha256 != other.request_sha256
    assert len(first.request_sha256) == 64


def test_behaviour__refuses_what_it_does_not_know_and_a_reset_restores_it(emulator: EmulatorServer) -> None:
    with httpx2.Client() as http:
        url = emulator.base_url.removesuffix("/v1") + "/_emulator/behaviour"
        refused = http.put(url, json={"already_answered": "shrug"})
        assert refused.status_code == 400
        assert http.put(url, json={"idempotency_keys": "ignored"}).status_code == 200
    assert emulator.control.behaviour() == ApiBehaviour(idempotency_keys="ignored")
    emulator.control.reset()
    assert emulator.control.behaviour() == ApiBehaviour()
