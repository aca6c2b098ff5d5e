"""Reusable agents (client.beta.agents create, retrieve, update, list, delete) and sessions
created from them, driven only through the real SDK with strict response validation."""

from __future__ import annotations

import json
import time
from typing import Any, cast

import openai
import pytest
from openai import AsyncOpenAI, OpenAI
from openai.types.beta.agent import Agent
from openai.types.beta.agent_deleted import AgentDeleted
from openai.types.beta.agent_tool_param import AgentToolConfigParamFunction
from openai.types.beta.persisted_agent_tool_param import (
    PersistedAgentToolConfigParamFunction,
    PersistedAgentToolParam,
)

from tests.emulator.session_driver import new_session
from toolledger import ToolRegistry
from toolledger.emulator import EmulatorServer, Script

SEND_RECEIPT: PersistedAgentToolConfigParamFunction = {
    "type": "function",
    "name": "send_receipt",
    "description": "Email the receipt of an order.",
    "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}},
}
LOOKUP_ORDER: PersistedAgentToolConfigParamFunction = {
    "type": "function",
    "name": "lookup_order",
    "description": "Find an order.",
    "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}},
}


def raw_create(client: OpenAI, body: dict[str, Any]) -> Agent:
    """A create with a body the typed method would not build."""
    return client.post("/agents", body=body, cast_to=Agent)


def agent_ids(client: OpenAI, **params: Any) -> list[str]:
    return [agent.id for agent in client.beta.agents.list(**params).data]


def inline(script: Script) -> str:
    return script.model_dump_json(exclude_defaults=True)


# ------------------------------------------------------------------ create


def test_create__with_only_a_model__returns_an_agent_with_every_default(client: OpenAI) -> None:
    before = int(time.time())
    agent = client.beta.agents.create(model="gpt-5")
    after = int(time.time())

    assert isinstance(agent, Agent)
    assert agent.id.startswith("agent_")
    assert agent.object == "agent"
    assert agent.model == "gpt-5"
    assert before <= agent.created_at == agent.updated_at <= after
    assert (agent.name, agent.instructions) == (None, None)
    assert agent.metadata == {}
    assert agent.tools == []
    assert (agent.multi_agent.enabled, agent.multi_agent.max_concurrent_subagents) == (False, None)
    assert (agent.reasoning.effort, agent.reasoning.summary) == (None, None)
    assert agent.service_tier == "auto"
    assert agent.text.format.type == "text"
    assert agent.text.verbosity == "medium"
    assert agent.compaction is not None
    assert agent.compaction.async_ is False
    assert agent.experimental is not None
    assert agent.experimental.time_awareness is False


def test_create__with_every_setting__echoes_each_resolved(client: OpenAI) -> None:
    agent = client.beta.agents.create(
        model="gpt-5",
        name="shop",
        instructions="Help customers with orders.",
        metadata={"team": "blue"},
        reasoning={"effort": "max", "summary": "concise"},
        service_tier="flex",
        text={"format": {"type": "json_schema", "schema": {"type": "object"}}, "verbosity": "low"},
        multi_agent={"enabled": True},
        compaction={"async_": True},
        experimental={"time_awareness": True},
        tools=[
            SEND_RECEIPT,
            {"type": "tool_search"},
            {"type": "programmatic_tool_calling"},
            {
                "type": "mcp",
                "server_label": "crm",
                "transport": {"type": "http", "server_url": "https://crm"},
            },
            {"type": "web_search", "allowed_domains": ["example.com"]},
            {"type": "computer_use"},
            {"type": "automations"},
        ],
    )

    assert (agent.name, agent.instructions, agent.metadata) == (
        "shop",
        "Help customers with orders.",
        {"team": "blue"},
    )
    assert (agent.reasoning.effort, agent.reasoning.summary) == ("max", "concise")
    assert agent.service_tier == "flex"
    assert agent.text.model_dump(by_alias=True) == {
        "format": {"type": "json_schema", "schema": {"type": "object"}},
        "verbosity": "low",
    }
    assert (agent.multi_agent.enabled, agent.multi_agent.max_concurrent_subagents) == (True, 6)
    assert agent.compaction is not None
    assert agent.compaction.async_ is True
    assert agent.experimental is not None
    assert agent.experimental.time_awareness is True
    assert [tool.model_dump(by_alias=True) for tool in agent.tools] == [
        {
            "type": "function",
            "name": "send_receipt",
            "description": "Email the receipt of an order.",
            "parameters": SEND_RECEIPT["parameters"],
            "defer_loading": False,
            "async": False,
        },
        {"type": "tool_search"},
        {"type": "programmatic_tool_calling", "enabled": True},
        {
            "type": "mcp",
            "server_label": "crm",
            "transport": {"type": "http", "server_url": "https://crm", "headers": {}},
            "allowed_tools": None,
            "connection_origin": "service",
            "credential_id": None,
            "request_metadata": {},
            "required": False,
        },
        {
            "type": "web_search",
            "allowed_domains": ["example.com"],
            "context_size": "medium",
            "location": None,
            "mode": "live",
        },
        {"type": "computer_use", "include_screenshots": False},
        {"type": "automations"},
    ]


def test_create__with_a_registrys_definitions__stores_its_functions_and_tool_search(client: OpenAI) -> None:
    registry = ToolRegistry()

    @registry.tool(effect="idempotent")
    def send_receipt(order_id: str) -> str:
        """Email the receipt of an order."""
        return "sent"

    @registry.tool(effect="read_only", defer_loading=True)
    def lookup_order(order_id: str) -> str:
        """Find an order."""
        return "found"

    definitions = cast(list[PersistedAgentToolParam], registry.definitions())
    agent = client.beta.agents.create(model="gpt-5", tools=definitions)

    assert [(tool.type, getattr(tool, "name", None)) for tool in agent.tools] == [
        ("function", "send_receipt"),
        ("function", "lookup_order"),
        ("tool_search", None),
    ]
    deferred = {tool.name: tool.defer_loading for tool in agent.tools if tool.type == "function"}
    assert deferred == {"send_receipt": False, "lookup_order": True}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        pytest.param({}, "model", id="no model"),
        pytest.param({"model": ""}, "model", id="empty model"),
        pytest.param({"model": 5}, "model", id="model not a string"),
        pytest.param({"model": "m", "colour": "blue"}, "colour", id="unknown field"),
        pytest.param(
            {"model": "m", "tools": [{"type": "function", "name": "f"}]},
            "tools[0].description",
            id="function without description",
        ),
        pytest.param({"model": "m", "tools": [{"type": "shell"}]}, "tools[0]", id="unknown tool type"),
        pytest.param(
            {"model": "m", "tools": [{**SEND_RECEIPT, "name": "send receipt"}]},
            "tools[0].name",
            id="function name with a space",
        ),
        pytest.param({"model": "m", "tools": [SEND_RECEIPT, SEND_RECEIPT]}, "tools", id="repeated function"),
        pytest.param(
            {"model": "m", "tools": [{**SEND_RECEIPT, "defer_loading": True}]},
            "tools",
            id="deferred function without tool_search",
        ),
        pytest.param(
            {"model": "m", "tools": [{"type": "mcp", "server_label": "crm", "transport": {"type": "http"}}]},
            "tools[0].transport.server_url",
            id="mcp without a server url",
        ),
        pytest.param(
            {"model": "m", "metadata": {str(n): "v" for n in range(17)}}, "metadata", id="17 metadata pairs"
        ),
        pytest.param({"model": "m", "metadata": {"k" * 65: "v"}}, "metadata", id="metadata key too long"),
        pytest.param({"model": "m", "reasoning": {"effort": "extreme"}}, "reasoning.effort", id="effort"),
        pytest.param({"model": "m", "service_tier": "turbo"}, "service_tier", id="service tier"),
        pytest.param({"model": "m", "experimental": None}, "experimental", id="null experimental"),
        pytest.param(
            {"model": "m", "text": {"format": {"type": "json_schema"}}},
            "text.format.schema",
            id="json_schema without schema",
        ),
        pytest.param(
            {"model": "m", "multi_agent": {"enabled": True, "max_concurrent_subagents": 0}},
            "multi_agent.max_concurrent_subagents",
            id="no subagents",
        ),
        pytest.param(
            {"model": "m", "metadata": {"emulator_script": '{"steps": [{"calls": []}]}'}},
            "metadata.emulator_script",
            id="invalid inline script",
        ),
    ],
)
def test_create__with_an_invalid_body__is_refused_naming_the_parameter(
    client: OpenAI, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        raw_create(client, body)

    assert refused.value.status_code == 400
    assert refused.value.type == "invalid_request_error"
    assert refused.value.param == param
    assert agent_ids(client) == []


def test_create__with_tools_over_3_mib__is_refused(client: OpenAI) -> None:
    huge: PersistedAgentToolConfigParamFunction = {**SEND_RECEIPT, "description": "x" * (3 * 1024 * 1024)}

    with pytest.raises(openai.BadRequestError) as refused:
        client.beta.agents.create(model="m", tools=[huge])

    assert refused.value.param == "tools"
    assert "3145728" in refused.value.message


# ---------------------------------------------------------------- retrieve


def test_retrieve__returns_the_agent_as_created(client: OpenAI) -> None:
    created = client.beta.agents.create(model="gpt-5", name="shop", tools=[SEND_RECEIPT], metadata={"a": "1"})
    client.beta.agents.create(model="gpt-5", name="other")

    assert client.beta.agents.retrieve(created.id) == created


@pytest.mark.parametrize("agent_id", ["agent_never_was", "environments"])
def test_retrieve__unknown_agent__raises_not_found(client: OpenAI, agent_id: str) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.beta.agents.retrieve(agent_id)

    assert caught.value.status_code == 404
    assert caught.value.code == "not_found"
    assert agent_id in caught.value.message


# ------------------------------------------------------------------ update


def test_update__replaces_the_fields_given_and_keeps_the_rest(client: OpenAI) -> None:
    agent = client.beta.agents.create(
        model="gpt-5", name="shop", instructions="Be brief.", tools=[SEND_RECEIPT], metadata={"a": "1"}
    )
    time.sleep(1.05)  # updated_at counts seconds

    updated = client.beta.agents.update(
        agent.id, model="gpt-5-mini", tools=[LOOKUP_ORDER], metadata={"b": "2"}
    )

    assert updated.id == agent.id
    assert (updated.model, updated.name, updated.instructions) == ("gpt-5-mini", "shop", "Be brief.")
    assert [tool.name for tool in updated.tools if tool.type == "function"] == ["lookup_order"]
    assert updated.metadata == {"b": "2"}
    assert updated.created_at == agent.created_at
    assert updated.updated_at > agent.updated_at
    assert client.beta.agents.retrieve(agent.id) == updated


def test_update__with_nulls__clears_those_fields(client: OpenAI) -> None:
    agent = client.beta.agents.create(
        model="gpt-5",
        name="shop",
        instructions="Be brief.",
        tools=[SEND_RECEIPT],
        metadata={"a": "1"},
        reasoning={"effort": "low"},
        service_tier="flex",
    )

    updated = client.beta.agents.update(
        agent.id, name=None, instructions=None, tools=None, metadata=None, reasoning=None, service_tier=None
    )

    assert (updated.name, updated.instructions, updated.tools, updated.metadata) == (None, None, [], {})
    assert updated.reasoning.effort is None
    assert updated.service_tier == "auto"
    assert updated.model == "gpt-5"


def test_update__experimental__merges_by_key(client: OpenAI) -> None:
    agent = client.beta.agents.create(model="gpt-5", experimental={"time_awareness": True})

    updated = client.beta.agents.update(agent.id, experimental={}, name="kept on")

    assert updated.experimental is not None
    assert updated.experimental.time_awareness is True


def test_update__a_null_model__is_refused_and_changes_nothing(client: OpenAI) -> None:
    agent = client.beta.agents.create(model="gpt-5", name="shop")

    with pytest.raises(openai.BadRequestError) as refused:
        client.beta.agents.update(agent.id, name="renamed", extra_body={"model": None})

    assert refused.value.param == "model"
    assert client.beta.agents.retrieve(agent.id) == agent


def test_update__unknown_agent__raises_not_found(client: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.beta.agents.update("agent_never_was", name="x")

    assert caught.value.code == "not_found"


# -------------------------------------------------------------------- list


def test_list__is_newest_first_by_default_and_oldest_first_asked(client: OpenAI) -> None:
    created = [client.beta.agents.create(model="m", name=str(n)).id for n in range(3)]

    assert agent_ids(client) == created[::-1]
    assert agent_ids(client, order="asc") == created
    page = client.beta.agents.list()
    assert all(isinstance(agent, Agent) for agent in page.data)
    assert page.has_more is False


def test_list__pages_with_limit_and_after__and_the_sdk_iterates_every_page(client: OpenAI) -> None:
    created = [client.beta.agents.create(model="m").id for _ in range(5)]

    first = client.beta.agents.list(limit=2, order="asc")
    second = client.beta.agents.list(limit=2, order="asc", after=first.data[-1].id)

    assert ([a.id for a in first.data], first.has_more) == (created[:2], True)
    assert ([a.id for a in second.data], second.has_more) == (created[2:4], True)
    assert [agent.id for agent in client.beta.agents.list(limit=2, order="asc")] == created


@pytest.mark.parametrize(
    ("params", "param"),
    [({"limit": 0}, "limit"), ({"limit": 101}, "limit"), ({"after": "agent_never_was"}, "after")],
)
def test_list__with_bad_paging__is_refused(client: OpenAI, params: dict[str, Any], param: str) -> None:
    client.beta.agents.create(model="m")

    with pytest.raises(openai.BadRequestError) as refused:
        client.beta.agents.list(**params)

    assert refused.value.param == param


def test_list__bad_order__is_refused(client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError):
        client.beta.agents.list(order=cast(Any, "sideways"))


# ------------------------------------------------------------------ delete


def test_delete__confirms_and_the_agent_is_gone(client: OpenAI) -> None:
    doomed = client.beta.agents.create(model="m", name="doomed")
    kept = client.beta.agents.create(model="m", name="kept")

    deleted = client.beta.agents.delete(doomed.id)

    assert isinstance(deleted, AgentDeleted)
    assert (deleted.id, deleted.deleted, deleted.object) == (doomed.id, True, "agent.deleted")
    with pytest.raises(openai.NotFoundError):
        client.beta.agents.retrieve(doomed.id)
    with pytest.raises(openai.NotFoundError):
        client.beta.agents.delete(doomed.id)
    with pytest.raises(openai.NotFoundError):
        client.beta.agents.update(doomed.id, name="back")
    assert agent_ids(client) == [kept.id]


def test_delete__leaves_its_sessions_running_and_no_new_one_can_start(client: OpenAI) -> None:
    agent = client.beta.agents.create(model="m", tools=[SEND_RECEIPT])
    session = client.beta.agents.sessions.create(agent_id=agent.id, environment={"type": "none"})

    client.beta.agents.delete(agent.id)

    with client.beta.agents.sessions.stream(session.id, input="still there?") as stream:
        result = stream.get_final_result()
    assert result.turn.status == "completed"
    assert [s.id for s in client.beta.agents.sessions.list(agent_id=agent.id).data] == [session.id]
    with pytest.raises(openai.NotFoundError):
        client.beta.agents.sessions.create(agent_id=agent.id, environment={"type": "none"})


async def test_async_client__creates_lists_retrieves_and_deletes(async_client: AsyncOpenAI) -> None:
    agent = await async_client.beta.agents.create(model="m", tools=[SEND_RECEIPT])

    assert [a.id async for a in async_client.beta.agents.list()] == [agent.id]
    assert await async_client.beta.agents.retrieve(agent.id) == agent
    assert (await async_client.beta.agents.delete(agent.id)).deleted is True
    with pytest.raises(openai.NotFoundError):
        await async_client.beta.agents.retrieve(agent.id)


# ------------------------------------------------- sessions from an agent


def test_session_from_an_agent__runs_its_settings_and_function_tools(client: OpenAI) -> None:
    agent = client.beta.agents.create(
        model="gpt-5",
        name="shop",
        instructions="Help customers with orders.",
        reasoning={"effort": "low"},
        service_tier="priority",
        text={"verbosity": "high"},
        tools=[SEND_RECEIPT, {"type": "tool_search"}, {"type": "web_search"}],
    )

    session = client.beta.agents.sessions.create(agent_id=agent.id, environment={"type": "none"})

    assert session.agent.id == agent.id
    assert (session.agent.model, session.agent.name, session.agent.instructions) == (
        "gpt-5",
        "shop",
        "Help customers with orders.",
    )
    assert session.agent.reasoning.effort == "low"
    assert session.agent.service_tier == "priority"
    assert session.agent.text.verbosity == "high"
    assert [(tool.type, getattr(tool, "name", None)) for tool in session.agent.tools] == [
        ("function", "send_receipt")
    ]
    assert client.beta.agents.sessions.retrieve(session.id) == session


def test_session_from_an_agent__with_agent_fields__overrides_them_for_that_session(client: OpenAI) -> None:
    agent = client.beta.agents.create(model="gpt-5", instructions="Be brief.", tools=[SEND_RECEIPT])
    lookup: AgentToolConfigParamFunction = {
        "type": "function",
        "name": "lookup_order",
        "description": "Find an order.",
        "parameters": LOOKUP_ORDER["parameters"],
    }

    session = client.beta.agents.sessions.create(
        agent_id=agent.id,
        agent={"model": "gpt-5-mini", "tools": [lookup]},
        environment={"type": "none"},
    )

    assert session.agent.id == agent.id
    assert (session.agent.model, session.agent.instructions) == ("gpt-5-mini", "Be brief.")
    assert [tool.name for tool in session.agent.tools if tool.type == "function"] == ["lookup_order"]
    assert client.beta.agents.retrieve(agent.id).model == "gpt-5"


def test_session_from_an_agent__keeps_the_agent_as_it_was_at_creation(client: OpenAI) -> None:
    agent = client.beta.agents.create(model="gpt-5", name="shop", tools=[SEND_RECEIPT])
    session = client.beta.agents.sessions.create(agent_id=agent.id, environment={"type": "none"})

    client.beta.agents.update(agent.id, name="renamed", tools=[LOOKUP_ORDER])
    later = client.beta.agents.sessions.create(agent_id=agent.id, environment={"type": "none"})

    kept = client.beta.agents.sessions.retrieve(session.id).agent
    assert (kept.name, [t.name for t in kept.tools if t.type == "function"]) == ("shop", ["send_receipt"])
    assert (later.agent.name, [t.name for t in later.agent.tools if t.type == "function"]) == (
        "renamed",
        ["lookup_order"],
    )


def test_session_from_an_unknown_agent__is_not_found_and_creates_nothing(client: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.beta.agents.sessions.create(
            agent_id="agent_never_was", environment={"type": "none"}, input="hello"
        )

    assert caught.value.code == "not_found"
    assert caught.value.param == "agent_id"
    assert "agent_never_was" in caught.value.message
    assert client.beta.agents.sessions.list().data == []


def test_sessions_list__by_agent_id__lists_that_agents_sessions_only(client: OpenAI) -> None:
    mine = client.beta.agents.create(model="m")
    other = client.beta.agents.create(model="m")
    ours = [
        client.beta.agents.sessions.create(agent_id=mine.id, environment={"type": "none"}).id
        for _ in range(2)
    ]
    client.beta.agents.sessions.create(agent_id=other.id, environment={"type": "none"})
    new_session(client)

    listed = client.beta.agents.sessions.list(agent_id=mine.id, order="asc").data

    assert [s.id for s in listed] == ours
    assert {s.agent.id for s in listed} == {mine.id}


# ------------------------------------------------------------------ scripts


def run_turn(client: OpenAI, session_id: str, text: str = "go") -> tuple[list[tuple[str, Any]], str]:
    """One turn, answering every call; the calls made and the final answer."""
    calls: list[tuple[str, Any]] = []

    def handler(name: str) -> Any:
        def answer(arguments: Any) -> str:
            calls.append((name, arguments))
            return f"{name} done"

        return answer

    names = ["send_receipt", "lookup_order", "record_refund"]
    with client.beta.agents.sessions.stream(
        session_id, input=text, tool_handlers={name: handler(name) for name in names}
    ) as stream:
        result = stream.get_final_result()
    assert result.turn.status == "completed"
    return calls, result.messages[-1].output_text


def test_agent_metadata_script__inline__drives_its_sessions(client: OpenAI) -> None:
    script = Script.of_calls([("send_receipt", {"order_id": "A1"})])
    agent = client.beta.agents.create(
        model="m", tools=[SEND_RECEIPT], metadata={"emulator_script": inline(script)}
    )
    session = client.beta.agents.sessions.create(agent_id=agent.id, environment={"type": "none"})

    calls, answer = run_turn(client, session.id)

    assert calls == [("send_receipt", {"order_id": "A1"})]
    assert answer == "Results:\n- send_receipt: ok send_receipt done"


def test_agent_metadata_script__by_name__drives_its_sessions(
    client: OpenAI, emulator: EmulatorServer
) -> None:
    emulator.control.register_script("lookup", Script.of_calls([("lookup_order", {"order_id": "B2"})]))
    agent = client.beta.agents.create(model="m", tools=[LOOKUP_ORDER], metadata={"emulator_script": "lookup"})
    session = client.beta.agents.sessions.create(agent_id=agent.id, environment={"type": "none"})

    calls, _ = run_turn(client, session.id)

    assert calls == [("lookup_order", {"order_id": "B2"})]


def test_session_metadata_script__wins_over_its_agents(client: OpenAI) -> None:
    agent = client.beta.agents.create(
        model="m", metadata={"emulator_script": inline(Script.of_calls([("send_receipt", {})]))}
    )
    session = client.beta.agents.sessions.create(
        agent_id=agent.id,
        environment={"type": "none"},
        metadata={"emulator_script": inline(Script.of_calls([("record_refund", {"cents": 3})]))},
    )

    calls, _ = run_turn(client, session.id)

    assert calls == [("record_refund", {"cents": 3})]


def test_agent_metadata_naming_no_registered_script__refuses_its_sessions(client: OpenAI) -> None:
    agent = client.beta.agents.create(model="m", metadata={"emulator_script": "nobody-registered-me"})

    with pytest.raises(openai.BadRequestError) as refused:
        client.beta.agents.sessions.create(agent_id=agent.id, environment={"type": "none"})

    assert refused.value.param == "agent_id"
    assert agent.id in refused.value.message
    assert client.beta.agents.sessions.list().data == []


def test_no_script__an_agent_with_tools__answers_that_it_called_none_and_why(client: OpenAI) -> None:
    agent = client.beta.agents.create(model="m", tools=[SEND_RECEIPT, LOOKUP_ORDER])
    session = client.beta.agents.sessions.create(agent_id=agent.id, environment={"type": "none"})

    calls, answer = run_turn(client, session.id, "hello")

    assert calls == []
    assert answer.startswith("You said: hello\n")
    assert "send_receipt, lookup_order" in answer
    assert "docs/emulator.md" in answer


def test_start_up_scripts__default_and_named__survive_a_reset() -> None:
    default = Script.of_calls([("send_receipt", {"order_id": "D"})])
    named = Script.of_calls([("lookup_order", {"order_id": "N"})])
    with (
        EmulatorServer(default_script=default, scripts={"named": named}) as server,
        OpenAI(
            base_url=server.base_url, api_key="sk-test", max_retries=0, _strict_response_validation=True
        ) as sdk,
    ):
        server.control.set_default_script(Script())
        server.control.register_script("named", Script())
        server.control.reset()
        by_default = sdk.beta.agents.create(model="m")
        by_name = sdk.beta.agents.create(model="m", metadata={"emulator_script": "named"})

        default_calls, _ = run_turn(
            sdk, sdk.beta.agents.sessions.create(agent_id=by_default.id, environment={"type": "none"}).id
        )
        named_calls, _ = run_turn(
            sdk, sdk.beta.agents.sessions.create(agent_id=by_name.id, environment={"type": "none"}).id
        )

    assert default_calls == [("send_receipt", {"order_id": "D"})]
    assert named_calls == [("lookup_order", {"order_id": "N"})]


def test_reset__forgets_every_agent(client: OpenAI, emulator: EmulatorServer) -> None:
    agent = client.beta.agents.create(model="m")

    emulator.control.reset()

    assert agent_ids(client) == []
    with pytest.raises(openai.NotFoundError):
        client.beta.agents.retrieve(agent.id)


def test_inline_script_in_metadata__fits_the_512_character_limit_for_a_small_script() -> None:
    script = Script.of_calls(
        [("lookup_order", {"order_id": "A1"})],
        [("charge_card", {"order_id": "A1", "cents": 500}), ("send_receipt", {"order_id": "A1"})],
    )

    assert len(inline(script)) <= 512
    assert Script.model_validate(json.loads(inline(script))) == script
