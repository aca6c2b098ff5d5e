"""Session resources (create, retrieve, update, delete, list), driven only through the real SDK."""

from __future__ import annotations

import statistics
import time
from typing import Any, Literal, cast
from urllib.parse import parse_qsl

import openai
import pytest
from openai import AsyncOpenAI, OpenAI
from openai.pagination import SyncCursorPage
from openai.types.beta.agent_session import AgentSession
from openai.types.beta.agent_session_deleted import AgentSessionDeleted
from openai.types.beta.agent_tool_param import AgentToolConfigParamFunction

from toolledger.emulator import EmulatorServer

Order = Literal["asc", "desc"]

LOOKUP_TOOL: AgentToolConfigParamFunction = {
    "type": "function",
    "name": "lookup_order",
    "description": "Find an order.",
    "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}},
}


def create(client: OpenAI, metadata: dict[str, str] | None = None) -> AgentSession:
    return client.beta.agents.sessions.create(
        environment={"type": "none"},
        agent={"model": "emulated"},
        metadata=metadata if metadata is not None else openai.omit,
    )


def create_many(client: OpenAI, count: int) -> list[str]:
    """Session ids in creation order."""
    return [create(client, {"n": str(n)}).id for n in range(count)]


def listed_ids(client: OpenAI, order: Order | openai.Omit = openai.omit) -> list[str]:
    return [session.id for session in client.beta.agents.sessions.list(limit=100, order=order).data]


# ------------------------------------------------------------------ create


def test_create__with_agent_and_metadata__returns_a_typed_session_as_created(client: OpenAI) -> None:
    before = int(time.time())
    session = client.beta.agents.sessions.create(
        environment={"type": "none"},
        agent={
            "model": "emulated-large",
            "instructions": "Be brief.",
            "tools": [LOOKUP_TOOL],
            "reasoning": {"effort": "low"},
            "service_tier": "flex",
        },
        metadata={"team": "blue", "ticket": "T-1"},
    )
    after = int(time.time())

    assert isinstance(session, AgentSession)
    assert session.id.startswith("sess_")
    assert session.object == "agent.session"
    assert session.status == "idle"
    assert session.required_actions == []
    assert session.error is None
    assert session.environment.type == "none"
    assert session.metadata == {"team": "blue", "ticket": "T-1"}
    assert session.vault_ids == []
    assert before <= session.created_at <= after
    assert session.last_active_at >= session.created_at
    assert session.agent.id.startswith("agent_")
    assert session.agent.model == "emulated-large"
    assert session.agent.instructions == "Be brief."
    assert session.agent.reasoning.effort == "low"
    assert session.agent.service_tier == "flex"
    [tool] = session.agent.tools
    assert tool.type == "function"
    assert tool.name == "lookup_order"
    assert tool.parameters == LOOKUP_TOOL["parameters"]


@pytest.mark.parametrize("metadata", [openai.omit, None], ids=["omitted", "null"])
def test_create__without_metadata__has_an_empty_map(client: OpenAI, metadata: openai.Omit | None) -> None:
    session = client.beta.agents.sessions.create(
        environment={"type": "none"}, agent={"model": "emulated"}, metadata=metadata
    )

    assert session.metadata == {}
    assert client.beta.agents.sessions.retrieve(session.id).metadata == {}


def test_create__with_an_agent_id_and_no_agent__runs_that_agent(client: OpenAI) -> None:
    saved = client.beta.agents.create(model="emulated-saved")

    session = client.beta.agents.sessions.create(environment={"type": "none"}, agent_id=saved.id)

    assert session.agent.id == saved.id
    assert session.agent.model == "emulated-saved"
    assert client.beta.agents.sessions.retrieve(session.id).agent.id == saved.id


# ---------------------------------------------------------------- retrieve


def test_retrieve__a_created_session__returns_the_same_session(client: OpenAI) -> None:
    created = create(client, {"customer": "c-42", "empty": ""})
    other = create(client, {"customer": "c-43"})

    retrieved = client.beta.agents.sessions.retrieve(created.id)

    assert isinstance(retrieved, AgentSession)
    assert retrieved == created
    assert retrieved.metadata == {"customer": "c-42", "empty": ""}
    assert other.id != created.id


def test_retrieve__unknown_session__raises_not_found(client: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.beta.agents.sessions.retrieve("sess_does_not_exist")

    assert caught.value.status_code == 404
    assert caught.value.code == "not_found"
    assert caught.value.type == "invalid_request_error"
    assert "sess_does_not_exist" in caught.value.message


def test_retrieve__repeated_on_one_connection__answers_within_milliseconds(client: OpenAI) -> None:
    session = create(client)
    durations = []
    for _ in range(8):
        started = time.perf_counter()
        client.beta.agents.sessions.retrieve(session.id)
        durations.append(time.perf_counter() - started)

    assert statistics.median(durations) < 0.02


# ------------------------------------------------------------------ delete


def test_delete__a_session__confirms_and_the_session_is_gone(client: OpenAI) -> None:
    doomed = create(client, {"fate": "deleted"})
    kept = create(client, {"fate": "kept"})

    deleted = client.beta.agents.sessions.delete(doomed.id)

    assert isinstance(deleted, AgentSessionDeleted)
    assert (deleted.id, deleted.deleted, deleted.object) == (doomed.id, True, "agent.session.deleted")
    with pytest.raises(openai.NotFoundError):
        client.beta.agents.sessions.retrieve(doomed.id)
    with pytest.raises(openai.NotFoundError):
        client.beta.agents.sessions.delete(doomed.id)
    with pytest.raises(openai.NotFoundError):
        client.beta.agents.sessions.update(doomed.id, metadata={"back": "again"})
    assert listed_ids(client) == [kept.id]
    assert client.beta.agents.sessions.retrieve(kept.id) == kept


def test_delete__unknown_session__raises_not_found(client: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.beta.agents.sessions.delete("sess_never_was")

    assert caught.value.code == "not_found"


# ------------------------------------------------------------------ update


def test_update__metadata__replaces_every_pair(client: OpenAI) -> None:
    session = create(client, {"a": "1", "b": "2"})

    updated = client.beta.agents.sessions.update(session.id, metadata={"c": "3"})

    assert updated.metadata == {"c": "3"}
    assert client.beta.agents.sessions.retrieve(session.id).metadata == {"c": "3"}


def test_update__empty_metadata__clears_it(client: OpenAI) -> None:
    session = create(client, {"a": "1"})

    updated = client.beta.agents.sessions.update(session.id, metadata={})

    assert updated.metadata == {}
    assert client.beta.agents.sessions.retrieve(session.id).metadata == {}


def test_update__null_metadata__clears_it(client: OpenAI) -> None:
    session = create(client, {"a": "1"})

    updated = client.beta.agents.sessions.update(session.id, metadata=None)

    assert updated.metadata == {}
    assert client.beta.agents.sessions.retrieve(session.id).metadata == {}


def test_update__agent_settings__change_only_what_is_given(client: OpenAI) -> None:
    session = client.beta.agents.sessions.create(
        environment={"type": "none"},
        agent={
            "model": "emulated",
            "instructions": "Be brief.",
            "tools": [LOOKUP_TOOL],
            "reasoning": {"effort": "low"},
            "service_tier": "flex",
        },
        metadata={"keep": "me"},
    )

    updated = client.beta.agents.sessions.update(
        session.id, agent={"model": "emulated-2", "reasoning": {"effort": "high"}}
    )

    assert updated.id == session.id
    assert updated.agent.id == session.agent.id
    assert updated.agent.model == "emulated-2"
    assert updated.agent.reasoning.effort == "high"
    assert updated.agent.instructions == "Be brief."
    assert updated.agent.service_tier == "flex"
    assert [tool.name for tool in updated.agent.tools if tool.type == "function"] == ["lookup_order"]
    assert updated.metadata == {"keep": "me"}
    assert client.beta.agents.sessions.retrieve(session.id) == updated


def test_update__null_service_tier_and_tools__reset_them(client: OpenAI) -> None:
    session = client.beta.agents.sessions.create(
        environment={"type": "none"},
        agent={"model": "emulated", "tools": [LOOKUP_TOOL], "service_tier": "priority"},
    )
    assert session.agent.tools
    assert session.agent.service_tier == "priority"

    updated = client.beta.agents.sessions.update(session.id, agent={"service_tier": None, "tools": None})

    assert updated.agent.service_tier == "auto"
    assert updated.agent.tools == []
    assert updated.agent.model == "emulated"


def test_spend_control__limit_on_create__is_echoed_changed_and_removed_by_update(client: OpenAI) -> None:
    # The SDK (3.60) requires spend_control on every session: without it no session parses.
    unlimited = create(client)
    assert (unlimited.spend_control.limit, unlimited.spend_control.consumed) == (None, 0)
    limited = client.beta.agents.sessions.create(
        environment={"type": "none"}, agent={"model": "emulated"}, spend_control={"limit": 500}
    )
    assert limited.spend_control.limit == 500
    raised = client.beta.agents.sessions.update(
        limited.id, spend_control={"limit": 900}, vault_ids=["vault_a"]
    )
    assert (raised.spend_control.limit, raised.vault_ids) == (900, ["vault_a"])
    removed = client.beta.agents.sessions.update(limited.id, spend_control=None, vault_ids=None)
    assert (removed.spend_control.limit, removed.vault_ids) == (None, [])
    assert client.beta.agents.sessions.retrieve(limited.id).spend_control.limit is None


@pytest.mark.parametrize("limit", [0, -5, "ten"])
def test_spend_control__a_limit_that_is_not_positive_cents__is_refused(client: OpenAI, limit: object) -> None:
    with pytest.raises(openai.BadRequestError):
        client.beta.agents.sessions.create(
            environment={"type": "none"},
            agent={"model": "emulated"},
            spend_control=cast(Any, {"limit": limit}),
        )


def test_update__unknown_session__raises_not_found(client: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.beta.agents.sessions.update("sess_nope", metadata={"a": "b"})


# ---------------------------------------------------------- metadata limits


@pytest.mark.parametrize(
    "metadata",
    [
        pytest.param({f"k{n}": "v" for n in range(16)}, id="16-pairs"),
        pytest.param(
            {"k" * 64: "v", "one-char-key": "v" * 512, "empty": ""}, id="64-char-key-512-char-value"
        ),
    ],
)
def test_metadata__at_the_limits__is_stored_and_filtered_on(client: OpenAI, metadata: dict[str, str]) -> None:
    session = create(client, metadata)

    assert session.metadata == metadata
    assert client.beta.agents.sessions.retrieve(session.id).metadata == metadata
    assert client.beta.agents.sessions.update(session.id, metadata=metadata).metadata == metadata
    assert [s.id for s in client.beta.agents.sessions.list(metadata=metadata).data] == [session.id]


@pytest.mark.parametrize(
    "metadata",
    [
        pytest.param({f"k{n}": "v" for n in range(17)}, id="17-pairs"),
        pytest.param({"k" * 65: "v"}, id="65-char-key"),
        pytest.param({"k": "v" * 513}, id="513-char-value"),
        pytest.param({"": "v"}, id="empty-key"),
    ],
)
def test_metadata__over_the_limits__is_refused_on_create_update_and_list(
    client: OpenAI, metadata: dict[str, str]
) -> None:
    session = create(client, {"original": "yes"})

    with pytest.raises(openai.BadRequestError) as on_create:
        create(client, metadata)
    with pytest.raises(openai.BadRequestError) as on_update:
        client.beta.agents.sessions.update(session.id, metadata=metadata)
    with pytest.raises(openai.BadRequestError) as on_list:
        client.beta.agents.sessions.list(metadata=metadata)

    for caught in (on_create, on_update, on_list):
        assert caught.value.status_code == 400
        assert caught.value.param == "metadata"
        assert "metadata" in caught.value.message
    assert listed_ids(client) == [session.id]
    assert client.beta.agents.sessions.retrieve(session.id).metadata == {"original": "yes"}


# -------------------------------------------------------------------- list


def test_list__default__is_a_cursor_page_of_typed_sessions_newest_first(client: OpenAI) -> None:
    ids = create_many(client, 3)

    raw = client.beta.agents.sessions.with_raw_response.list()
    page = raw.parse()
    body = raw.http_response.json()

    assert isinstance(page, SyncCursorPage)
    assert all(isinstance(session, AgentSession) for session in page.data)
    assert [session.id for session in page.data] == ids[::-1]
    assert page.has_more is False
    assert not page.has_next_page()
    assert body["object"] == "list"
    assert (body["first_id"], body["last_id"]) == (ids[-1], ids[0])


def test_list__no_sessions__is_an_empty_page(client: OpenAI) -> None:
    page = client.beta.agents.sessions.list()

    assert page.data == []
    assert page.has_more is False
    assert list(page) == []


def test_list__limit__caps_the_page_and_reports_whether_more_remain(client: OpenAI) -> None:
    ids = create_many(client, 3)

    one = client.beta.agents.sessions.list(limit=1, order="asc")
    two = client.beta.agents.sessions.list(limit=2, order="asc")
    exact = client.beta.agents.sessions.list(limit=3, order="asc")
    largest = client.beta.agents.sessions.list(limit=100, order="asc")

    assert ([s.id for s in one.data], one.has_more) == (ids[:1], True)
    assert ([s.id for s in two.data], two.has_more) == (ids[:2], True)
    assert ([s.id for s in exact.data], exact.has_more) == (ids, False)
    assert ([s.id for s in largest.data], largest.has_more) == (ids, False)


@pytest.mark.parametrize("order", ["asc", "desc"])
def test_list__after_cursor__walks_every_session_once_in_order(client: OpenAI, order: Order) -> None:
    created = create_many(client, 5)
    expected = created if order == "asc" else created[::-1]

    seen: list[str] = []
    sizes: list[int] = []
    page = client.beta.agents.sessions.list(limit=2, order=order)
    while True:
        sizes.append(len(page.data))
        seen.extend(session.id for session in page.data)
        if not page.has_more:
            break
        page = client.beta.agents.sessions.list(limit=2, order=order, after=page.data[-1].id)
    auto = [session.id for session in client.beta.agents.sessions.list(limit=2, order=order)]

    assert sizes == [2, 2, 1]
    assert seen == expected
    assert len(set(seen)) == len(seen)
    assert auto == expected


async def test_list__async_auto_pagination__yields_every_session_once(async_client: AsyncOpenAI) -> None:
    sessions = async_client.beta.agents.sessions
    created = []
    for _ in range(3):
        created.append((await sessions.create(environment={"type": "none"}, agent={"model": "m"})).id)

    seen = [session.id async for session in sessions.list(limit=2, order="asc")]

    assert seen == created


def test_list__order__asc_is_creation_order_and_desc_its_reverse(client: OpenAI) -> None:
    created = create_many(client, 3)

    assert listed_ids(client, order="asc") == created
    assert listed_ids(client, order="desc") == created[::-1]
    assert listed_ids(client) == created[::-1]


def test_list__after_an_unknown_session__is_refused(client: OpenAI) -> None:
    create(client)

    with pytest.raises(openai.BadRequestError) as caught:
        client.beta.agents.sessions.list(after="sess_unknown")

    assert caught.value.param == "after"


def test_list__metadata_filter__is_sent_as_bracketed_query_pairs(client: OpenAI) -> None:
    raw = client.beta.agents.sessions.with_raw_response.list(metadata={"team": "blue", "a b": "c&d"})

    query = parse_qsl(raw.http_request.url.query.decode())

    assert ("metadata[team]", "blue") in query
    assert ("metadata[a b]", "c&d") in query
    assert raw.parse().data == []


def test_list__metadata_filter__returns_sessions_matching_every_pair(client: OpenAI) -> None:
    blue_prod = create(client, {"team": "blue", "env": "prod"}).id
    blue_dev = create(client, {"team": "blue", "env": "dev"}).id
    red_prod = create(client, {"team": "red", "env": "prod"}).id
    odd = create(client, {"a b": "c&d=e", "team": "blue-ish"}).id
    create(client)

    def matching(metadata: dict[str, str]) -> list[str]:
        return [s.id for s in client.beta.agents.sessions.list(metadata=metadata, order="asc").data]

    assert matching({"team": "blue"}) == [blue_prod, blue_dev]
    assert matching({"team": "blue", "env": "prod"}) == [blue_prod]
    assert matching({"env": "prod"}) == [blue_prod, red_prod]
    assert matching({"team": "blue", "env": "qa"}) == []
    assert matching({"a b": "c&d=e"}) == [odd]
    assert matching({"a b": "c&d"}) == []


def test_list__metadata_filter_with_after__pages_through_the_matches_only(client: OpenAI) -> None:
    wanted = [create(client, {"batch": "x", "n": str(n)}).id for n in range(3)]
    create(client, {"batch": "y"})

    first = client.beta.agents.sessions.list(metadata={"batch": "x"}, limit=2, order="asc")
    second = client.beta.agents.sessions.list(
        metadata={"batch": "x"}, limit=2, order="asc", after=first.data[-1].id
    )

    assert ([s.id for s in first.data], first.has_more) == (wanted[:2], True)
    assert ([s.id for s in second.data], second.has_more) == (wanted[2:], False)


def test_list__agent_id_filter__returns_that_agents_sessions(client: OpenAI) -> None:
    agent_id = client.beta.agents.create(model="emulated").id
    mine = [
        client.beta.agents.sessions.create(environment={"type": "none"}, agent_id=agent_id).id
        for _ in range(2)
    ]
    create(client)

    found = [s.id for s in client.beta.agents.sessions.list(agent_id=agent_id, order="asc").data]

    assert found == mine
    assert client.beta.agents.sessions.list(agent_id="agent_nobody").data == []


def test_list__after_a_reset__forgets_every_session(client: OpenAI, emulator: EmulatorServer) -> None:
    session = create(client)

    emulator.control.reset()

    assert listed_ids(client) == []
    with pytest.raises(openai.NotFoundError):
        client.beta.agents.sessions.retrieve(session.id)


async def _interleaved_sessions(sessions: Any, mine: str, other: str) -> list[str]:
    """Sessions of ``mine`` (returned, in creation order) between sessions of ``other`` and
    sessions without a saved agent, so a page of one agent skips the others'."""
    created: list[str] = []
    for n in range(5):
        created.append((await sessions.create(environment={"type": "none"}, agent_id=mine)).id)
        await sessions.create(environment={"type": "none"}, agent_id=other)
        if n % 2:
            await sessions.create(environment={"type": "none"}, agent={"model": "m"})
    return created


@pytest.mark.parametrize("order", ["asc", "desc"])
async def test_list__by_agent_id__auto_paginates_over_that_agents_sessions_only(
    async_client: AsyncOpenAI, order: Order
) -> None:
    agents = async_client.beta.agents
    mine, other = (await agents.create(model="emulated")).id, (await agents.create(model="emulated")).id
    created = await _interleaved_sessions(agents.sessions, mine, other)
    expected = created if order == "asc" else created[::-1]

    first = await agents.sessions.list(agent_id=mine, order=order, limit=2)
    pages = [[s.id for s in first.data]]
    page = first
    while page.has_next_page():
        page = await page.get_next_page()
        pages.append([s.id for s in page.data])
    walked = [s.id async for s in agents.sessions.list(agent_id=mine, order=order, limit=2)]

    assert pages == [expected[0:2], expected[2:4], expected[4:5]]
    assert walked == expected
    assert all(s.agent.id == mine for s in first.data)


@pytest.mark.parametrize("order", ["asc", "desc"])
async def test_list__by_agent_id_after_a_cursor__continues_after_it(
    async_client: AsyncOpenAI, order: Order
) -> None:
    agents = async_client.beta.agents
    mine, other = (await agents.create(model="emulated")).id, (await agents.create(model="emulated")).id
    created = await _interleaved_sessions(agents.sessions, mine, other)
    expected = created if order == "asc" else created[::-1]

    rest = await agents.sessions.list(agent_id=mine, order=order, after=expected[1], limit=100)
    one_by_one = agents.sessions.list(agent_id=mine, order=order, after=expected[1], limit=1)
    walked = [s.id async for s in one_by_one]

    assert [s.id for s in rest.data] == expected[2:]
    assert rest.has_more is False
    assert walked == expected[2:]
