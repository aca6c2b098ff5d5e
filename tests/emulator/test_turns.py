"""Turns of the scripted model, driven only through the real SDK over HTTP."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pytest
from openai import AsyncOpenAI, OpenAI
from openai.types.beta.agent_session_event import AgentSessionEvent

from tests.emulator.session_driver import (
    first_pending_call,
    new_session,
    pending_calls,
    start_turn,
    submit,
    tool_result,
    wait_for_status,
)
from toolledger.emulator import EmulatorServer, Script

THREE_STEPS = Script.of_calls(
    [("lookup_order", {"order_id": "A1"})],
    [("charge_card", {"cents": 500}), ("send_receipt", {"to": "a@example.com"})],
    [("record_sale", {"order_id": "A1"})],
)
TOOLS = ["lookup_order", "charge_card", "send_receipt", "record_sale"]


def recording_handlers(calls: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    def handler_for(name: str) -> Any:
        def handle(arguments: dict[str, Any]) -> dict[str, Any]:
            calls.append((name, arguments))
            return {"tool": name, "ok": True}

        return handle

    return {name: handler_for(name) for name in TOOLS}


def test_sdk_stream_helper__completes_a_three_step_script(client: OpenAI, emulator: EmulatorServer) -> None:
    session_id = new_session(client, THREE_STEPS)
    calls: list[tuple[str, dict[str, Any]]] = []

    with client.beta.agents.sessions.stream(
        session_id, input="buy order A1", tool_handlers=recording_handlers(calls)
    ) as stream:
        result = stream.get_final_result()

    assert [name for name, _ in calls] == TOOLS
    assert calls[1] == ("charge_card", {"cents": 500})
    assert result.turn.status == "completed"
    final_text = result.messages[-1].output_text
    for name in TOOLS:
        assert f"{name}: ok" in final_text
    accepted = emulator.control.accepted_results(session_id)
    assert len(accepted) == 4
    assert all(len(payloads) == 1 for payloads in accepted.values())
    assert client.beta.agents.sessions.retrieve(session_id).status == "idle"


async def test_async_stream_helper__runs_sessions_concurrently(
    async_client: AsyncOpenAI, emulator: EmulatorServer
) -> None:
    script = Script.of_calls([("lookup_order", {"order_id": "B"}), ("charge_card", {"cents": 1})])
    sessions = [
        (
            await async_client.beta.agents.sessions.create(
                environment={"type": "none"},
                agent={"model": "emulated"},
                metadata={"emulator_script": script.model_dump_json()},
            )
        ).id
        for _ in range(8)
    ]

    async def run(session_id: str) -> str:
        async def handle(arguments: dict[str, Any]) -> str:
            await asyncio.sleep(0.01)
            return f"done {arguments}"

        async with async_client.beta.agents.sessions.stream(
            session_id, input="go", tool_handlers={"lookup_order": handle, "charge_card": handle}
        ) as stream:
            result = await stream.get_final_result()
        return result.turn.status

    statuses = await asyncio.gather(*(run(s) for s in sessions))

    assert statuses == ["completed"] * 8
    accepted = emulator.control.accepted_results()
    assert len(accepted) == 16
    assert {key[0] for key in accepted} == set(sessions)


def test_event_stream__sends_the_turns_events_in_order_with_unique_ids(client: OpenAI) -> None:
    session_id = new_session(client, Script.of_calls([("lookup_order", {"order_id": "C"})]))
    events: list[AgentSessionEvent] = []
    with client.beta.agents.sessions.events.stream(session_id) as stream:
        first = next(iter(stream))
        assert first.type == "agent.session.idle"  # the snapshot of the session on connect
        start_turn(client, session_id, "hi")
        for event in stream:
            events.append(event)
            if event.type == "agent.session.requires_action":
                action = event.session.required_actions[0]
                assert action.type == "function_call"
                assert action.name == "lookup_order"
                assert action.arguments == {"order_id": "C"}
                client.beta.agents.sessions.events.create(
                    session_id,
                    events=[tool_result(action, output="order C: shipped")],
                )
            if event.type == "agent.session.idle":
                break

    types = [e.type for e in events]
    assert types == [
        "agent.session.turn.created",
        "agent.session.turn.item.added",  # the user's message
        "agent.session.in_progress",
        "agent.session.turn.in_progress",
        "agent.session.turn.item.added",  # the function call
        "agent.session.turn.item.done",
        "agent.session.requires_action",
        "agent.session.turn.item.added",  # its output
        "agent.session.in_progress",
        "agent.session.turn.item.added",  # the final message
        "agent.session.turn.item.done",
        "agent.session.turn.completed",
        "agent.session.idle",
    ]
    assert len({e.event_id for e in events}) == len(events)
    requires_action = events[6]
    assert requires_action.type == "agent.session.requires_action"
    assert requires_action.session.status == "requires_action"
    assert requires_action.session.id == session_id
    output_item = events[7]
    assert output_item.type == "agent.session.turn.item.added"
    assert output_item.item.type == "function_call_output"
    assert output_item.item.output == "order C: shipped"
    completed = events[11]
    assert completed.type == "agent.session.turn.completed"
    assert completed.turn.status == "completed"
    assert completed.turn.completed_at is not None
    final = events[10]
    assert final.type == "agent.session.turn.item.done"
    assert final.item.type == "message"
    assert "order C: shipped" in final.item.content[0].text


def test_required_actions__list_only_pending_calls_of_the_step(client: OpenAI) -> None:
    script = Script.of_calls([("charge_card", {"cents": 1}), ("send_receipt", {"to": "x"})])
    session_id = new_session(client, script)
    start_turn(client, session_id)
    both = pending_calls(wait_for_status(client, session_id, "requires_action"))
    assert sorted(a.name for a in both) == ["charge_card", "send_receipt"]

    submit(client, session_id, both[0], output="ok")

    session = client.beta.agents.sessions.retrieve(session_id)
    assert session.status == "requires_action"
    assert [a.call_id for a in pending_calls(session)] == [both[1].call_id]


def test_failed_tool_result__is_reported_in_the_final_message(client: OpenAI) -> None:
    session_id = new_session(client, Script.of_calls([("charge_card", {"cents": 1})]))

    def declined(_arguments: dict[str, Any]) -> str:
        raise RuntimeError("card declined: secret detail")

    with client.beta.agents.sessions.stream(
        session_id, input="pay", tool_handlers={"charge_card": declined}
    ) as stream:
        result = stream.get_final_result()
    assert "charge_card: failed Tool handler failed." in result.messages[-1].output_text


def test_input_message__is_refused_while_a_turn_is_active(client: OpenAI) -> None:
    session_id = new_session(client, Script.of_calls([("lookup_order", {})]))
    start_turn(client, session_id)
    wait_for_status(client, session_id, "requires_action")
    with pytest.raises(openai.BadRequestError) as caught:
        start_turn(client, session_id)
    assert isinstance(caught.value.body, dict)
    assert caught.value.body["code"] == "active_turn_not_steerable"


def test_input_cancel__cancels_the_active_turn(client: OpenAI) -> None:
    session_id = new_session(client, Script.of_calls([("lookup_order", {})]))
    start_turn(client, session_id)
    pending = first_pending_call(client, session_id)

    client.beta.agents.sessions.events.create(session_id, events=[{"type": "agent.session.input.cancel"}])

    session = client.beta.agents.sessions.retrieve(session_id)
    assert session.status == "idle"
    assert session.required_actions == []
    with pytest.raises(openai.BadRequestError, match="Unknown pending tool call"):
        submit(client, session_id, pending, output="late")


def test_session_create_with_stream__runs_the_first_turn_with_handlers(
    client: OpenAI, emulator: EmulatorServer
) -> None:
    calls: list[tuple[str, dict[str, Any]]] = []
    stream = client.beta.agents.sessions.create(
        environment={"type": "none"},
        agent={"model": "emulated"},
        input="buy",
        metadata={"emulator_script": THREE_STEPS.model_dump_json()},
        stream=True,
        tool_handlers=recording_handlers(calls),
    )
    result = stream.get_final_result()
    assert result.turn.status == "completed"
    assert [name for name, _ in calls] == TOOLS
    assert len(emulator.control.accepted_results()) == 4


def test_arguments__that_are_not_json_reach_the_client_as_given(client: OpenAI) -> None:
    session_id = new_session(client, Script.of_calls([("lookup_order", "{not json")]))
    start_turn(client, session_id)
    action = first_pending_call(client, session_id)
    assert action.arguments == "{not json"
    with pytest.raises(json.JSONDecodeError):
        json.loads(str(action.arguments))


def test_registered_script__is_selected_by_name(client: OpenAI, emulator: EmulatorServer) -> None:
    emulator.control.register_script("refund", Script.of_calls([("record_refund", {"cents": 3})]))
    session_id = new_session(client, emulator_script="refund")
    start_turn(client, session_id)
    action = first_pending_call(client, session_id)
    assert action.name == "record_refund"


def test_default_script__answers_without_tool_calls(client: OpenAI) -> None:
    session_id = new_session(client)
    with client.beta.agents.sessions.stream(session_id, input="hello there") as stream:
        result = stream.get_final_result()
    assert result.messages[-1].output_text == "You said: hello there"
