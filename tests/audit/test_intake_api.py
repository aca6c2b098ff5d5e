"""The intake in the audit API: `GET /api/intake` reports what the intake's own stores wrote
(looks asked for and held, webhooks taken, sweeps run, the live replicas' counts), and a
session's view says how it came, for which agent, and whether a replica looks at it now; on
SQLite and PostgreSQL, behind the read token like every data route."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.support.api_server import FULL, READ, api_settings, serving
from toolledger.audit.api import create_app
from toolledger.store.intake import IntakeStore
from toolledger.store.sessions import SessionStore

AGENTS = ("agent_billing", "agent_support")
WATERMARK = 1_767_225_600
"""2026-01-01 00:00:00 UTC, as a sweep stores it (Unix seconds of the newest session seen)."""
LOOK_LEASE = 0.5
"""Seconds: a look's lease short enough to watch it run out."""


@dataclass
class IntakeApi:
    client: httpx.AsyncClient
    sessions: SessionStore
    intake: IntakeStore


@pytest.fixture
async def intake_api(database_url: str) -> AsyncIterator[IntakeApi]:
    """The audit app configured with two agents and a webhook address (as `serve` would be),
    and the intake's stores over the same ledger."""
    app = create_app(api_settings(database_url, agent_ids=AGENTS, listen="127.0.0.1:8780"))
    async with serving(app) as client:
        engine = app.state.api.engine
        yield IntakeApi(client, SessionStore(engine), IntakeStore(engine))


async def _get(client: httpx.AsyncClient, path: str) -> Any:
    response = await client.get(path, headers=READ)
    assert response.status_code == 200, response.text
    return response.json()


async def test_intake__reports_what_the_intake_stores_wrote(intake_api: IntakeApi) -> None:
    sessions, intake = intake_api.sessions, intake_api.intake
    # The sweep found two sessions of one agent; a webhook brought a third (and came twice);
    # another webhook asked for no look; one session was registered the old way.
    assert (
        await sessions.request_looks(["sess_swept_1", "sess_swept_2"], intake="sweep", agent_id=AGENTS[0])
        == 2
    )
    assert await intake.take_webhook("wh_1", "agent.session.requires_action", "sess_hooked", look=True)
    assert not await intake.take_webhook("wh_1", "agent.session.requires_action", "sess_hooked", look=True)
    assert await intake.take_webhook("wh_2", "agent.session.completed", "sess_hooked", look=False)
    assert await sessions.watch("sess_registered")
    # One look is held by a replica now.
    (held,) = await sessions.claim_looks("replica_a", 1, lease_seconds=60)
    # Each agent's sweep ran once: one found both sessions, the other failed.
    billing = await intake.claim_sweep(AGENTS[0], "replica_a", every_seconds=0, lease_seconds=60)
    support = await intake.claim_sweep(AGENTS[1], "replica_b", every_seconds=0, lease_seconds=60)
    assert billing is not None
    assert support is not None
    await intake.finish_sweep(billing, "replica_a", watermark=WATERMARK, found=2)
    await intake.finish_sweep(support, "replica_b", watermark=None, found=0, error="APIConnectionError")
    # Two live replicas report their counts; a third, retired since, is not counted.
    await sessions.heartbeat_replica(
        "replica_a",
        hostname="host-a",
        pid=1,
        lease_seconds=60,
        intake_counts={"webhook_accepted": 3, "webhook_duplicate": 1, "webhook_refused_bad_signature": 2},
    )
    await sessions.heartbeat_replica(
        "replica_b",
        hostname="host-b",
        pid=2,
        lease_seconds=60,
        intake_counts={"webhook_accepted": 1, "look_reconciled": 4, "look_other_agent": 1},
    )
    await sessions.heartbeat_replica(
        "replica_gone", hostname="host-c", pid=3, lease_seconds=60, intake_counts={"webhook_accepted": 100}
    )
    await sessions.retire_replicas(["replica_gone"])

    report = await _get(intake_api.client, "/api/intake")
    sweeps = report.pop("sweeps")
    assert report == {
        "modes": ["watch", "agents", "webhooks"],
        "agent_ids": list(AGENTS),
        "intake_sessions": 3,
        "looks_due": 2,  # three asked for, one of them held
        "webhooks_taken": 2,
        "counts": {
            "look_other_agent": 1,
            "look_reconciled": 4,
            "webhook_accepted": 4,
            "webhook_duplicate": 1,
            "webhook_refused_bad_signature": 2,
        },
    }
    assert [sweep["agent_id"] for sweep in sweeps] == list(AGENTS)
    for sweep in sweeps:
        assert 0 <= sweep.pop("last_run_age_seconds") < 60
    assert sweeps == [
        {"agent_id": AGENTS[0], "runs": 1, "last_found": 2, "watermark": WATERMARK, "last_error": None},
        {
            "agent_id": AGENTS[1],
            "runs": 1,
            "last_found": 0,
            "watermark": None,
            "last_error": "APIConnectionError",
        },
    ]

    # Each session says how it came, for which agent, and whether it is being looked at.
    listed = {view["session_id"]: view for view in await _get(intake_api.client, "/api/sessions")}
    came = {
        session_id: (view["intake"], view["agent_id"], view["looking"], view["watched"])
        for session_id, view in listed.items()
    }
    looking_at = {session_id for session_id, view in listed.items() if view["looking"]}
    assert looking_at == {held.session_id}
    assert came == {
        "sess_swept_1": ("sweep", AGENTS[0], held.session_id == "sess_swept_1", False),
        "sess_swept_2": ("sweep", AGENTS[0], held.session_id == "sess_swept_2", False),
        # A webhook names no agent: the look learns it.
        "sess_hooked": ("webhook", None, held.session_id == "sess_hooked", False),
        "sess_registered": (None, None, False, True),
    }

    # The look ends: nobody looks any more, nothing is due for it, the agent is learned.
    assert await sessions.finish_look(held, "replica_a", again_in=None, agent_id=AGENTS[1])
    one = await _get(intake_api.client, f"/api/sessions/{held.session_id}")
    assert one["looking"] is False
    assert one["agent_id"] == (AGENTS[1] if held.session_id == "sess_hooked" else AGENTS[0])
    assert (await _get(intake_api.client, "/api/intake"))["looks_due"] == 2


async def test_intake__an_expired_look_is_not_looking(intake_api: IntakeApi) -> None:
    """A replica that died holding a look holds it no longer once its lease ran out."""
    await intake_api.sessions.request_looks(["sess_stale"], intake="webhook")
    (claim,) = await intake_api.sessions.claim_looks("replica_gone", 1, lease_seconds=LOOK_LEASE)
    assert claim.session_id == "sess_stale"
    assert (await _get(intake_api.client, "/api/sessions/sess_stale"))["looking"] is True
    await asyncio.sleep(LOOK_LEASE * 3)
    view = await _get(intake_api.client, "/api/sessions/sess_stale")
    assert (view["intake"], view["looking"]) == ("webhook", False)


async def test_intake__without_agents_or_webhooks__watch_only_and_empty(database_url: str) -> None:
    app = create_app(api_settings(database_url))
    async with serving(app) as client:
        assert await _get(client, "/api/intake") == {
            "modes": ["watch"],
            "agent_ids": [],
            "intake_sessions": 0,
            "looks_due": 0,
            "webhooks_taken": 0,
            "counts": {},
            "sweeps": [],
        }


async def test_intake__a_read_token_reads_it__none_or_a_wrong_one_is_401(sqlite_url: str) -> None:
    app = create_app(api_settings(sqlite_url, agent_ids=AGENTS))
    async with serving(app) as client:
        assert (await client.get("/api/intake", headers=READ)).status_code == 200
        assert (await client.get("/api/intake", headers=FULL)).status_code == 200
        for headers in ({}, {"Authorization": "Bearer not-a-configured-token-at-all"}):
            refused = await client.get("/api/intake", headers=headers)
            assert refused.status_code == 401, refused.text
            assert "agent_" not in refused.text
        assert (await client.post("/api/intake", headers=FULL)).status_code == 405


async def test_intake__documented_in_the_openapi_like_the_other_routes(sqlite_url: str) -> None:
    app = create_app(api_settings(sqlite_url))
    async with serving(app) as client:
        document = (await client.get("/openapi.json")).json()
    operation = document["paths"]["/api/intake"]["get"]
    assert operation["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/IntakeView"
    }
    assert {"400", "401", "403", "503"} <= set(operation["responses"])
    assert "422" not in operation["responses"]
    assert operation["security"]
    schemas = document["components"]["schemas"]
    assert schemas["IntakeView"]["properties"]["sweeps"]["items"] == {
        "$ref": "#/components/schemas/SweepView"
    }
    assert set(schemas["SweepView"]["required"]) == {
        "agent_id",
        "runs",
        "last_run_age_seconds",
        "last_found",
        "watermark",
        "last_error",
    }
    assert {"intake", "agent_id", "looking"} <= set(schemas["SessionView"]["required"])
