"""Sessions nobody registered, served by agent: through a signed webhook, through the sweep
when no webhook comes, never when they belong to another agent; bad webhooks refused with
nothing stored. The service in this process, the emulator over HTTP with the real SDK, real
SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI
from sqlalchemy import func, select

from tests.support.polling import eventually
from tests.support.service_harness import running_service
from tests.support.webhooks import OTHER_SECRET, SECRET, event, send, signed_headers
from tests.support.workload import assert_exactly_once, read_effects, wait_until_idle
from toolledger.emulator import EmulatorServer, Script
from toolledger.runtime.service import Service
from toolledger.runtime.webhook_intake import PATH, WebhookIntake
from toolledger.settings import Settings
from toolledger.store.engine import create_engine
from toolledger.store.intake import IntakeStore
from toolledger.store.schema import sessions, webhook_deliveries

ONE_STEP = Script.of_calls([("charge", {"amount": 7}), ("lookup", {"order_id": "W1"})])
TWO_STEPS = Script.of_calls([("charge", {"amount": 3})], [("notify", {"message": "done"})])


async def new_agent(emulator: EmulatorServer) -> str:
    async with AsyncOpenAI(base_url=emulator.base_url, api_key="sk-test") as client:
        return (await client.beta.agents.create(model="emulated")).id


async def new_session(emulator: EmulatorServer, agent_id: str, script: Script = ONE_STEP) -> str:
    """A session of ``agent_id`` that toolledger is never told about."""
    async with AsyncOpenAI(base_url=emulator.base_url, api_key="sk-test") as client:
        session = await client.beta.agents.sessions.create(
            agent_id=agent_id,
            environment={"type": "none"},
            metadata={"emulator_script": script.model_dump_json()},
            input="go",
        )

        async def waiting() -> bool:
            return (await client.beta.agents.sessions.retrieve(session.id)).status == "requires_action"

        await eventually(waiting, within=10, what="the new session's first calls")
        return session.id


@asynccontextmanager
async def intake_service(
    database_url: str, emulator: EmulatorServer, agent_id: str, **overrides: Any
) -> AsyncIterator[Service]:
    settings: dict[str, Any] = {
        "agent_ids": agent_id,
        "listen": "127.0.0.1:0",
        "webhook_secret": SECRET,
        "sweep_seconds": 3600.0,
        **overrides,
    }
    async with running_service(database_url, emulator, **settings) as service:
        yield service


def webhook_url(service: Service) -> str:
    assert service.webhook_address is not None
    host, port = service.webhook_address
    return f"http://{host}:{port}{PATH}"


async def stored(database_url: str) -> tuple[int, list[str]]:
    """Webhooks recorded, and the sessions the ledger knows."""
    engine = create_engine(database_url)
    try:
        async with engine.connect() as conn:
            taken = (await conn.execute(select(func.count()).select_from(webhook_deliveries))).scalar_one()
            known = list((await conn.execute(select(sessions.c.session_id))).scalars())
        return int(taken), known
    finally:
        await engine.dispose()


async def test_webhook__a_session_nobody_registered__is_answered_once(
    database_url: str, emulator: EmulatorServer, effects_file: Path
) -> None:
    agent_id = await new_agent(emulator)
    async with intake_service(database_url, emulator, agent_id) as service:
        session_id = await new_session(emulator, agent_id, TWO_STEPS)
        answer = await send(webhook_url(service), event("agent.session.action_required", session_id))
        assert (answer.status_code, answer.json()) == (200, {"taken": True})

        async def second_step() -> bool:
            async with AsyncOpenAI(base_url=emulator.base_url, api_key="sk-test") as client:
                session = await client.beta.agents.sessions.retrieve(session_id)
            return session.status == "requires_action" and session.required_actions[0].name == "notify"  # type: ignore[union-attr]

        await eventually(second_step, within=20, what="the first step answered by the webhook's look")
        await send(webhook_url(service), event("agent.session.action_required", session_id))
        await wait_until_idle(emulator, [session_id])
        assert service.status().intake_counts is not None
        assert service.status().intake_counts["webhook_accepted"] == 2  # type: ignore[index]

    assert_exactly_once(emulator, [session_id], effects_file, 2)
    assert service.followed == frozenset(), "no event stream was opened for it"


async def test_webhook__redelivered_with_its_id__is_taken_once(
    database_url: str, emulator: EmulatorServer, effects_file: Path
) -> None:
    agent_id = await new_agent(emulator)
    async with intake_service(database_url, emulator, agent_id) as service:
        session_id = await new_session(emulator, agent_id)
        payload = event("agent.session.action_required", session_id)
        answers = [await send(webhook_url(service), payload, webhook_id="msg_same") for _ in range(3)]
        await wait_until_idle(emulator, [session_id])

    assert [a.status_code for a in answers] == [200, 200, 200]
    assert [a.json().get("duplicate", False) for a in answers] == [False, True, True]
    assert (await stored(database_url))[0] == 1
    assert_exactly_once(emulator, [session_id], effects_file, 2)


async def test_sweep__a_session_whose_webhook_never_came__is_answered(
    database_url: str, emulator: EmulatorServer, effects_file: Path
) -> None:
    agent_id = await new_agent(emulator)
    session_id = await new_session(emulator, agent_id, TWO_STEPS)
    # No --listen, no webhook: the sweep alone finds it, and its second step too.
    async with intake_service(
        database_url, emulator, agent_id, listen=None, webhook_secret=None, sweep_seconds=0.3
    ) as service:
        await wait_until_idle(emulator, [session_id], within=30)
        assert service.webhook_address is None

    assert_exactly_once(emulator, [session_id], effects_file, 2)


async def test_other_agent__its_session__is_never_answered(
    database_url: str, emulator: EmulatorServer, effects_file: Path
) -> None:
    mine, theirs = await new_agent(emulator), await new_agent(emulator)
    async with intake_service(database_url, emulator, mine, sweep_seconds=0.3) as service:
        foreign = await new_session(emulator, theirs)
        answer = await send(webhook_url(service), event("agent.session.action_required", foreign))
        assert answer.status_code == 200
        await eventually(
            lambda: (service.status().intake_counts or {}).get("look_other_agent", 0) >= 1,
            within=10,
            what="the foreign session looked at and left alone",
        )
        await asyncio.sleep(1.0)  # sweeps go on meanwhile: none of them answers it either

    assert read_effects(effects_file) == []
    assert [r for r in emulator.control.tool_results() if r.session_id == foreign] == []


@pytest.mark.parametrize(
    ("case", "status", "reason"),
    [
        ("bad_signature", 401, "webhook-signature does not match"),
        ("missing_signature", 400, "missing header webhook-signature"),
        ("stale_timestamp", 400, "more than 300 s from now"),
        ("not_json", 400, "not JSON"),
        ("too_large", 413, "body over"),
        ("no_session_id", 400, "without data.id"),
    ],
)
async def test_bad_webhook__refused_with_a_reason__nothing_stored(
    sqlite_url: str, emulator: EmulatorServer, case: str, status: int, reason: str
) -> None:
    agent_id = await new_agent(emulator)
    async with intake_service(sqlite_url, emulator, agent_id, webhook_max_bytes=4096) as service:
        body = json.dumps(event("agent.session.action_required", "sess_refused")).encode()
        headers = signed_headers(body)
        if case == "bad_signature":
            headers = signed_headers(body, secret=OTHER_SECRET)
        elif case == "missing_signature":
            del headers["webhook-signature"]
        elif case == "stale_timestamp":
            headers = signed_headers(body, timestamp=1_700_000_000)
        elif case == "not_json":
            body = b"{not json"
            headers = signed_headers(body)
        elif case == "too_large":
            body = json.dumps(event("agent.session.action_required", "sess_refused", pad="x" * 5000)).encode()
            headers = signed_headers(body)
        elif case == "no_session_id":
            body = json.dumps(
                {"id": "evt_1", "object": "event", "type": "agent.session.idle", "data": {}}
            ).encode()
            headers = signed_headers(body)
        async with httpx.AsyncClient() as client:
            answer = await client.post(webhook_url(service), content=body, headers=headers)
        counts = service.status().intake_counts or {}

    assert answer.status_code == status
    assert reason in answer.json()["error"]
    assert await stored(sqlite_url) == (0, [])
    assert sum(n for name, n in counts.items() if name.startswith("webhook_refused_")) == 1


async def test_webhook__signed_with_the_previous_secret__is_taken_during_rotation(
    sqlite_url: str, emulator: EmulatorServer, effects_file: Path
) -> None:
    agent_id = await new_agent(emulator)
    async with intake_service(
        sqlite_url, emulator, agent_id, webhook_previous_secret=OTHER_SECRET
    ) as service:
        session_id = await new_session(emulator, agent_id)
        old = await send(
            webhook_url(service), event("agent.session.action_required", session_id), secret=OTHER_SECRET
        )
        await wait_until_idle(emulator, [session_id])

    assert old.status_code == 200
    assert_exactly_once(emulator, [session_id], effects_file, 2)


async def test_webhook__unknown_event_type__acknowledged_and_ignored(
    sqlite_url: str, emulator: EmulatorServer
) -> None:
    agent_id = await new_agent(emulator)
    async with intake_service(sqlite_url, emulator, agent_id) as service:
        answer = await send(
            webhook_url(service), {"id": "evt_x", "type": "batch.completed", "data": {"id": "b"}}
        )

    assert (answer.status_code, answer.json()) == (200, {"ignored": "batch.completed"})
    assert await stored(sqlite_url) == (0, [])


async def test_webhook__ledger_unreachable__answers_503_so_the_sender_retries(
    emulator: EmulatorServer,
) -> None:
    """A real connection to a port where no PostgreSQL listens: the commit cannot happen, so
    the webhook must not be acknowledged."""
    from toolledger.gateway.agents import AgentsGateway

    engine = create_engine("postgresql+psycopg://postgres@127.0.0.1:1/nowhere")
    gateway = AgentsGateway.connect(api_key="sk-test", base_url=emulator.base_url)
    try:
        settings = Settings(webhook_secret=SECRET, agent_ids="agt_1", openai_base_url=emulator.base_url)
        intake = WebhookIntake(settings, IntakeStore(engine), gateway)
        body = json.dumps(event("agent.session.action_required", "sess_1")).encode()
        transport = httpx.ASGITransport(app=intake.app())
        async with httpx.AsyncClient(transport=transport, base_url="http://intake") as client:
            answer = await client.post(PATH, content=body, headers=signed_headers(body))
    finally:
        await gateway.close()
        await engine.dispose()

    assert answer.status_code == 503
    assert intake.counts == {"unavailable": 1}


def test_settings__listen_without_a_secret_or_an_agent__is_refused_with_the_reason() -> None:
    assert "TOOLLEDGER_WEBHOOK_SECRET" in (
        Settings(listen="127.0.0.1:0", agent_ids="agt_1").intake_problem() or ""
    )
    assert "TOOLLEDGER_AGENT_IDS" in (
        Settings(listen="127.0.0.1:0", webhook_secret=SECRET).intake_problem() or ""
    )
    assert Settings(agent_ids="agt_1").intake_problem() is None
    with pytest.raises(ValueError, match="not HOST:PORT"):
        Settings(listen="8080")
    with pytest.raises(ValueError, match="base64"):
        Settings(webhook_secret="whsec_!!!")  # noqa: S106 - a malformed secret, refused


async def test_status__shows_the_intake_modes_webhook_counts_and_sweeps(
    sqlite_url: str, emulator: EmulatorServer, effects_file: Path
) -> None:
    agent_id = await new_agent(emulator)
    async with intake_service(sqlite_url, emulator, agent_id, heartbeat_seconds=0.2) as service:
        session_id = await new_session(emulator, agent_id)
        await send(webhook_url(service), event("agent.session.action_required", session_id))
        await send(
            webhook_url(service), {"id": "e", "type": "agent.session.idle", "data": {}}, secret=OTHER_SECRET
        )
        await wait_until_idle(emulator, [session_id])
        await eventually(
            lambda: (service.status().intake_counts or {}).get("webhook_refused_bad_signature") == 1,
            within=5,
            what="the refusal counted",
        )
        await asyncio.sleep(
            service.settings.session_lease_seconds / 3 + 0.5
        )  # a heartbeat carries the counts
        shown = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "toolledger", "status", "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "TOOLLEDGER_DATABASE_URL": sqlite_url, "TOOLLEDGER_AGENT_IDS": agent_id},
        )
        text_form = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "toolledger", "status"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "TOOLLEDGER_DATABASE_URL": sqlite_url, "TOOLLEDGER_AGENT_IDS": agent_id},
        )

    intake = json.loads(shown.stdout)["intake"]
    assert intake["modes"] == ["watch", "agents"]
    assert intake["webhooks_taken"] == 1
    assert intake["counts"]["webhook_accepted"] == 1
    assert intake["counts"]["webhook_refused_bad_signature"] == 1
    assert intake["counts"]["look_reconciled"] >= 1
    assert [sweep["agent_id"] for sweep in intake["sweeps"]] == [agent_id]
    assert intake["sweeps"][0]["runs"] >= 1
    assert "webhooks:   1 kept" in text_form.stdout
    assert f"sweep:      {agent_id}: last" in text_form.stdout


async def test_emulator_webhooks__every_step_of_unregistered_sessions__answered_once(
    database_url: str, emulator: EmulatorServer, effects_file: Path
) -> None:
    """The emulator signs and sends every agent.session.* event as the API does, duplicating
    a fifth of them: each step of each session is answered once, through the webhooks alone
    (the sweep is an hour away)."""
    agent_id = await new_agent(emulator)
    async with intake_service(database_url, emulator, agent_id) as service:
        emulator.control.configure_webhooks(webhook_url(service), SECRET, duplicate=0.2, seed=11)
        session_ids = [await new_session(emulator, agent_id, TWO_STEPS) for _ in range(4)]
        await wait_until_idle(emulator, session_ids, within=30)
        # The idle events' webhooks may still be on their way: counted once all arrived.
        await eventually(
            lambda: emulator.control.webhook_counts().pending == 0, within=20, what="webhooks sent"
        )
        counts = service.status().intake_counts or {}

    assert_exactly_once(emulator, session_ids, effects_file, 2)
    assert counts.get("webhook_duplicate", 0) == emulator.control.webhook_counts().duplicated
    assert counts["webhook_accepted"] >= 4 * 2, "each step's action_required was taken"


async def test_emulator_webhooks__all_dropped__the_sweep_answers(
    sqlite_url: str, emulator: EmulatorServer, effects_file: Path
) -> None:
    agent_id = await new_agent(emulator)
    async with intake_service(sqlite_url, emulator, agent_id, sweep_seconds=0.5) as service:
        emulator.control.configure_webhooks(webhook_url(service), SECRET, drop=1.0, seed=3)
        session_id = await new_session(emulator, agent_id, TWO_STEPS)
        await wait_until_idle(emulator, [session_id], within=30)
        counts = service.status().intake_counts or {}

    assert_exactly_once(emulator, [session_id], effects_file, 2)
    assert "webhook_accepted" not in counts, "no webhook arrived: the sweep found both steps"


async def test_webhook_intake__serve_at_warning__writes_no_access_line_per_webhook(
    sqlite_url: str, emulator: EmulatorServer
) -> None:
    """uvicorn takes the process's level: `serve --log-level warning` with the intake wrote an
    info access line per webhook (uvicorn's default level overrode serve's)."""
    loggers = [logging.getLogger(), logging.getLogger("uvicorn.access"), logging.getLogger("uvicorn.error")]
    levels = [logger.level for logger in loggers]
    logging.getLogger().setLevel(logging.WARNING)
    try:
        agent_id = await new_agent(emulator)
        async with intake_service(sqlite_url, emulator, agent_id) as service:
            answer = await send(webhook_url(service), event("agent.session.created", "sess_quiet"))
            access_at_info = logging.getLogger("uvicorn.access").isEnabledFor(logging.INFO)
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)

    assert answer.status_code == 200
    assert not access_at_info


async def test_listen__two_replicas_on_one_port__both_take_webhooks(
    postgres_url: str, emulator: EmulatorServer, effects_file: Path
) -> None:
    """`serve --processes N --listen` starts N processes on one address: the port is shared
    (SO_REUSEPORT), not refused to all but the first."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    agent_id = await new_agent(emulator)
    listen = f"127.0.0.1:{port}"
    async with (
        intake_service(postgres_url, emulator, agent_id, listen=listen) as first,
        intake_service(postgres_url, emulator, agent_id, listen=listen) as second,
    ):
        assert first.webhook_address == second.webhook_address == ("127.0.0.1", port)
        session_ids = [await new_session(emulator, agent_id) for _ in range(3)]
        for session_id in session_ids:
            answer = await send(webhook_url(first), event("agent.session.action_required", session_id))
            assert answer.status_code == 200
        await wait_until_idle(emulator, session_ids)

    assert_exactly_once(emulator, session_ids, effects_file, 2)
