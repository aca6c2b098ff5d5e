"""The gateway's connections against the emulator over HTTP: a stream that carries keep-alive
comments between events must stay open (a real service sends them on idle streams); each event
is built as the variant its type names, its calls as function calls; many sessions' streams
are spread over several connection pools."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from openai.types.beta import AgentSessionRequiresActionEvent

from tests.support.workload import start_sessions
from toolledger.emulator import EmulatorServer, Script
from toolledger.gateway.agents import AgentsGateway, FunctionCallAction


@pytest.fixture
def chatty_emulator() -> Iterator[EmulatorServer]:
    """An emulator that sends a keep-alive comment after 0.1 s of silence."""
    with EmulatorServer(keepalive_seconds=0.1) as server:
        yield server


async def test_stream__keep_alives_after_an_event__stream_stays_open(chatty_emulator: EmulatorServer) -> None:
    # The session asks for one call and then waits: its stream goes silent after the events.
    (session_id,) = await start_sessions(chatty_emulator, 1, Script.of_calls([("charge", {"amount": 1})]))
    gateway = AgentsGateway.connect(api_key=None, base_url=chatty_emulator.base_url)
    try:
        async with gateway.events(session_id, idle_timeout=10) as events:
            seen = []

            async def read() -> None:
                async for event in events:
                    seen.append(event.type)

            # Long enough for several keep-alives after the session's events: the stream
            # must still be open (no error, no end) when we stop reading.
            reader = asyncio.create_task(read())
            await asyncio.sleep(1.0)
            assert not reader.done(), (
                f"the stream ended or failed: {reader.exception() if reader.done() else ''}"
            )
            reader.cancel()
            with pytest.raises(asyncio.CancelledError):
                await reader
        assert seen, "events were delivered before the keep-alives"
    finally:
        await gateway.close()


async def test_stream__each_event_is_the_variant_its_type_names(emulator: EmulatorServer) -> None:
    """Built from its discriminator, not validated against every variant of the union: what
    the service reads (the type, the listed function calls, the turn, the event id) is there."""
    (session_id,) = await start_sessions(emulator, 1, Script.of_calls([("charge", {"amount": 1})]))
    gateway = AgentsGateway.connect(api_key=None, base_url=emulator.base_url)
    try:
        async with gateway.events(session_id, idle_timeout=10) as events:
            async for event in events:
                if event.type == "agent.session.requires_action":
                    break
    finally:
        await gateway.close()
    assert isinstance(event, AgentSessionRequiresActionEvent)
    assert event.event_id
    [action] = event.session.required_actions
    assert isinstance(action, FunctionCallAction)
    assert (action.name, action.arguments) == ("charge", {"amount": 1})


async def test_stream__asked_for_some_types__yields_only_those(emulator: EmulatorServer) -> None:
    """The others are dropped unbuilt: the session's turn carries items and status changes
    (and, from a real model, text deltas) that the service never reads."""
    script = Script.of_calls([("charge", {"amount": 1})], [("charge", {"amount": 2})])
    (session_id,) = await start_sessions(emulator, 1, script)
    gateway = AgentsGateway.connect(api_key=None, base_url=emulator.base_url)
    wanted = frozenset({"agent.session.requires_action", "agent.session.turn.completed"})
    seen: list[str] = []
    try:
        async with gateway.events(session_id, idle_timeout=10, types=wanted) as events:
            async for event in events:
                seen.append(event.type)
                if event.type == "agent.session.requires_action":
                    [action] = event.session.required_actions
                    assert isinstance(action, FunctionCallAction)
                    result = {
                        "type": "agent.session.input.tool_result",
                        "turn_id": action.turn_id,
                        "call_id": action.call_id,
                        "success": True,
                        "output": "charged",
                    }
                    await gateway.submit_tool_results(session_id, [result], f"key-{action.call_id}")
                if event.type == "agent.session.turn.completed":
                    break
    finally:
        await gateway.close()
    assert seen == [
        "agent.session.requires_action",
        "agent.session.requires_action",
        "agent.session.turn.completed",
    ]


async def test_streams_of_many_sessions__spread_over_the_pools_each_open_at_once(
    emulator: EmulatorServer,
) -> None:
    """Each followed session holds a connection: the streams are spread over several pools
    (a pool looks over all its connections for each stream it opens), a session's always in
    the same one, and every stream delivers its own session's events."""
    ids = await start_sessions(emulator, 40, Script.of_calls([("charge", {"amount": 1})]))
    gateway = AgentsGateway.connect(api_key=None, base_url=emulator.base_url)
    first_event: dict[str, str] = {}
    try:
        pools = {id(gateway.stream_client_for(s)) for s in ids}
        assert len(pools) > len(ids) // 8, "the streams share a few pools"
        assert all(gateway.stream_client_for(s) is gateway.stream_client_for(s) for s in ids)

        async def first(session_id: str) -> None:
            async with gateway.events(
                session_id, idle_timeout=10, types=frozenset({"agent.session.requires_action"})
            ) as events:
                async for event in events:
                    assert isinstance(event, AgentSessionRequiresActionEvent)
                    first_event[session_id] = event.session.id
                    return

        await asyncio.wait_for(asyncio.gather(*(first(s) for s in ids)), 30)
    finally:
        await gateway.close()
    assert first_event == {s: s for s in ids}
