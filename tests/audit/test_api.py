"""The audit HTTP API end to end: real HTTP requests (in process through ASGI, and over TCP
to `toolledger api`), against a ledger filled by real executions on SQLite and PostgreSQL.

The ledger is filled once per database for this module (``fill_ledger``, what the
``filled_ledger`` fixture does): a fill runs `toolledger serve` twice, one SIGKILLed, and
that cannot be paid per test. Tests that change it (resolving the unknown call, watching a
session) compare with the database as it is when they run, never with a remembered picture.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from click.testing import CliRunner
from fastapi import FastAPI
from fastapi.routing import APIRoute
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import event, func, select
from sqlalchemy.engine import Row
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.routing import Mount

from tests.support.api_server import ALICE, FULL, READ, READER, api_settings, serving
from tests.support.databases import PostgresTemplate
from tests.support.ledger_fill import FilledLedger
from tests.support.ordering import listing_order
from tests.support.paths import ROOT
from tests.support.polling import eventually
from tests.support.shop_tools import CANARY
from tests.support.shop_tools import registry as shop_tools
from toolledger.audit import api as api_module
from toolledger.audit.api import OPEN_PATHS, api_server_task, create_app
from toolledger.audit.auth import ApiConfigurationError, authenticated, may_write
from toolledger.cli.api import api as api_command
from toolledger.domain.keys import CallKey
from toolledger.domain.queries import Cursor
from toolledger.domain.results import succeeded
from toolledger.domain.states import CallStatus, EffectClass
from toolledger.emulator import EmulatorServer
from toolledger.settings import Settings
from toolledger.store.engine import lower_like_postgresql as folded
from toolledger.store.ledger import LedgerStore
from toolledger.store.schema import sessions, tool_call_events, tool_calls

EVERY = "500"
"""Page size that holds the whole test ledger."""


# ---------------------------------------------------------------------------- fixtures


@dataclass
class Api:
    app: FastAPI
    client: httpx.AsyncClient
    ledger: FilledLedger
    emulator: EmulatorServer

    @property
    def engine(self) -> AsyncEngine:
        engine: AsyncEngine = self.app.state.api.engine
        return engine


@pytest.fixture
async def api(shared_ledger: FilledLedger, emulator_server: EmulatorServer) -> AsyncIterator[Api]:
    app = create_app(api_settings(shared_ledger.database_url, emulator_server.base_url), registry=shop_tools)
    async with serving(app) as client:
        yield Api(app, client, shared_ledger, emulator_server)


async def ledger_rows(engine: AsyncEngine) -> list[Row[Any]]:
    async with engine.connect() as conn:
        return list(await conn.execute(select(tool_calls)))


async def table_counts(engine: AsyncEngine) -> dict[str, int]:
    async with engine.connect() as conn:
        return {
            table.name: int((await conn.execute(select(func.count()).select_from(table))).scalar_one())
            for table in (tool_calls, tool_call_events, sessions)
        }


def ids(rows: list[Row[Any]]) -> set[str]:
    return {row.idempotency_key for row in rows}


async def listed(client: httpx.AsyncClient, **params: Any) -> list[dict[str, Any]]:
    response = await client.get("/api/calls", params={"limit": EVERY, **params}, headers=FULL)
    assert response.status_code == 200, response.text
    calls: list[dict[str, Any]] = response.json()["calls"]
    return calls


# ------------------------------------------------------------------------- list, page


async def test_list_calls__each_filter_matches_an_oracle(api: Api) -> None:
    rows = await ledger_rows(api.engine)
    assert len(rows) >= 16
    first_session = api.ledger.session_ids[0]
    created = sorted(r.created_at for r in rows)
    middle = created[len(created) // 2]
    # The same instant spelled in another zone: a filter must compare instants, not digits.
    middle_in_paris = middle.astimezone(timezone(timedelta(hours=2)))
    cases: list[tuple[dict[str, Any], set[str]]] = [
        ({}, ids(rows)),
        ({"session_id": first_session}, ids([r for r in rows if r.session_id == first_session])),
        ({"turn_id": rows[0].turn_id}, ids([r for r in rows if r.turn_id == rows[0].turn_id])),
        ({"tool": "lookup_order"}, ids([r for r in rows if r.tool_name == "lookup_order"])),
        (
            {"tool": ["charge_card", "send_receipt"]},
            ids([r for r in rows if r.tool_name in ("charge_card", "send_receipt")]),
        ),
        ({"status": "submitted,unknown"}, ids([r for r in rows if r.status in ("submitted", "unknown")])),
        ({"status": ["unknown", "running"]}, ids([r for r in rows if r.status in ("unknown", "running")])),
        ({"effect_class": "read_only"}, ids([r for r in rows if r.effect_class == "read_only"])),
        ({"unknown_only": "true"}, ids([r for r in rows if r.status == "unknown"])),
        ({"unknown_only": "true", "status": "submitted"}, set()),
        ({"q": "LOOKUP"}, ids([r for r in rows if "lookup" in r.tool_name])),
        ({"q": first_session[-10:].upper()}, ids([r for r in rows if r.session_id == first_session])),
        ({"q": "_order"}, ids([r for r in rows if "_order" in r.tool_name])),
        ({"q": "l%kup"}, set()),
        ({"since": "1h"}, ids(rows)),
        ({"until": "1h"}, set()),
        ({"since": middle.isoformat()}, ids([r for r in rows if r.created_at >= middle])),
        ({"until": middle.isoformat()}, ids([r for r in rows if r.created_at < middle])),
        ({"since": middle_in_paris.isoformat()}, ids([r for r in rows if r.created_at >= middle])),
        (
            {"session_id": first_session, "tool": "lookup_order", "effect_class": "read_only"},
            ids([r for r in rows if r.session_id == first_session and r.tool_name == "lookup_order"]),
        ),
        ({"session_id": "", "q": ""}, ids(rows)),  # empty form fields filter nothing
    ]
    for params, expected in cases:
        got = [c["id"] for c in await listed(api.client, **params)]
        assert len(got) == len(set(got)), params
        assert set(got) == expected, params


@pytest.mark.parametrize(
    ("sort", "column", "descending"),
    [
        ("-created", "created_at", True),
        ("created", "created_at", False),
        ("tool", "tool_name", False),
        ("-status", "status", True),
        ("finished", "finished_at", False),
    ],
)
async def test_list_calls__cursor_paging_visits_every_call_once_in_order(
    api: Api, sort: str, column: str, descending: bool
) -> None:
    rows = [r for r in await ledger_rows(api.engine) if getattr(r, column) is not None]

    expected = listing_order(rows, column, descending=descending)
    seen: list[str] = []
    cursor: str | None = None
    pages = 0
    while True:
        params = {"sort": sort, "limit": "3", **({"cursor": cursor} if cursor else {})}
        response = await api.client.get("/api/calls", params=params, headers=READ)
        assert response.status_code == 200, response.text
        page = response.json()
        assert len(page["calls"]) <= 3
        seen += [c["id"] for c in page["calls"]]
        pages += 1
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == expected
    assert pages == -(-len(expected) // 3)


async def test_list_calls__bad_input_is_400_with_a_message(api: Api) -> None:
    for params in (
        {"status": "exploded"},
        {"effect_class": "maybe"},
        {"sort": "-price"},
        {"limit": "0"},
        {"limit": "501"},
        {"limit": "many"},
        {"since": "yesterday-ish"},
        {"since": "2h", "until": "3h"},
        {"cursor": "not-a-cursor"},
        {"unknown_only": "perhaps"},
        {"q": "x" * 201},
        {"session_id": "s" * 256},
        # Hand-made cursors: a NUL PostgreSQL would refuse, a time that is not one.
        {"cursor": Cursor("2026-01-01T00:00:00", CallKey("sess\x00", "t", "c")).encode()},
        {"cursor": Cursor("yesterday", CallKey("s", "t", "c")).encode()},
        {"cursor": Cursor("x" * 300, CallKey("s", "t", "c")).encode(), "sort": "tool"},
    ):
        response = await api.client.get("/api/calls", params=params, headers=READ)
        assert response.status_code == 400, (params, response.text)
        detail = response.json()["detail"]
        assert isinstance(detail, str)
        assert detail


# ------------------------------------------------------------------------------- show


async def test_show__by_every_kind_of_reference(api: Api) -> None:
    rows = await ledger_rows(api.engine)
    row = next(r for r in rows if r.tool_name == "lookup_order" and r.status == "submitted")
    key = f"{row.session_id}/{row.turn_id}/{row.call_id}"
    references = [
        row.idempotency_key,
        row.idempotency_key[:14],  # a unique prefix
        row.call_id,
        quote(key, safe=""),
        key,
    ]
    for reference in references:
        response = await api.client.get(f"/api/calls/{reference}", headers=READ)
        assert response.status_code == 200, (reference, response.text)
        detail = response.json()
        assert detail["call"]["id"] == row.idempotency_key
        assert (detail["call"]["session_id"], detail["call"]["call_id"]) == (row.session_id, row.call_id)
        kinds = [e["kind"] for e in detail["timeline"]]
        assert kinds, "every call has a timeline"
        assert [e["id"] for e in detail["timeline"]] == sorted(e["id"] for e in detail["timeline"])
        assert detail["timeline"][-1]["to_status"] in ("submitted", None)

    missing = await api.client.get("/api/calls/tl_00000000deadbeef", headers=READ)
    assert missing.status_code == 404
    assert "no call matches" in missing.json()["detail"]
    malformed = await api.client.get(f"/api/calls/{quote('a/b', safe='')}", headers=READ)
    assert malformed.status_code == 400

    # Call ids are unique within a session only: another session's call of the same id
    # makes the bare id ambiguous (recorded through the ledger, as a delivery would).
    other = CallKey("sess_other_client", "turn_other", row.call_id)
    await LedgerStore(api.engine, actor="api-test").record(
        other,
        tool_name="lookup_order",
        arguments={"order_id": "B2"},
        effect_class=EffectClass.READ_ONLY,
        lease_seconds=1,
    )
    ambiguous = await api.client.get(f"/api/calls/{row.call_id}", headers=READ)
    assert ambiguous.status_code == 409
    assert "give SESSION/TURN/CALL" in ambiguous.json()["detail"]
    exact = await api.client.get(f"/api/calls/{quote(str(other), safe='')}", headers=READ)
    assert exact.status_code == 200
    assert exact.json()["call"]["session_id"] == "sess_other_client"


# ---------------------------------------------------------------------------- resolve


def submissions(outcome: str) -> float:
    return REGISTRY.get_sample_value("toolledger_submissions_total", {"outcome": outcome}) or 0.0


def handler_runs(tool: str) -> float:
    return REGISTRY.get_sample_value("toolledger_handler_duration_seconds_count", {"tool": tool}) or 0.0


async def test_resolve__the_unknown_call_is_answered_once_on_the_record(api: Api) -> None:
    unknown = api.ledger.unknown
    reference = quote(str(unknown), safe="")
    before = api.emulator.control.tool_results(api.ledger.unknown_session)
    assert before == [], "the SIGKILLed serve never answered it"
    # SQLite: the operator says what happened; PostgreSQL: the operator allows a re-run,
    # which runs the handler here (this app has the shop's tools).
    rerun = api.engine.dialect.name == "postgresql"
    body: dict[str, Any] = (
        {"kind": "rerun", "reason": "bank says it never arrived"}
        if rerun
        else {
            "kind": "output",
            "text": '{"charged": 99, "checked": "by phone"}',
            "reason": "bank confirmed it",
        }
    )

    refused = await api.client.post(f"/api/calls/{reference}/resolve", json=body, headers=READ)
    assert refused.status_code == 403
    assert api.emulator.control.tool_results(api.ledger.unknown_session) == []

    accepted_before, runs_before = submissions("submitted"), handler_runs("charge_card")
    response = await api.client.post(f"/api/calls/{reference}/resolve", json=body, headers=FULL)
    answer = response.json()
    if rerun:
        # Answered at once (the handler runs in the background): followed to its end.
        assert response.status_code == 202, response.text
        assert (answer["action"], answer["call"]["status"]) == ("rerunning", "pending")

        async def submitted() -> dict[str, Any] | None:
            detail = (await api.client.get(f"/api/calls/{reference}", headers=READ)).json()
            call: dict[str, Any] = detail["call"]
            return call if call["status"] == "submitted" else None

        answer = {"call": await eventually(submitted, within=30, what="the re-run call submitted")}
    else:
        assert response.status_code == 200, response.text
        assert answer["action"] == "submitted"
    assert answer["call"]["status"] == "submitted"
    assert answer["call"]["needs_operator"] is False

    received = api.emulator.control.tool_results(api.ledger.unknown_session)
    assert len(received) == 1
    assert received[0].outcome == "accepted"
    assert (received[0].turn_id, received[0].call_id) == (unknown.turn_id, unknown.call_id)
    assert received[0].idempotency_key == unknown.idempotency_key
    if not rerun:
        assert received[0].payload["output"] == body["text"]
    assert submissions("submitted") == accepted_before + 1
    assert handler_runs("charge_card") == runs_before + (1 if rerun else 0)

    timeline = (await api.client.get(f"/api/calls/{reference}", headers=READ)).json()["timeline"]
    by_operator = [e for e in timeline if e["actor"] == "operator:alice"]
    assert by_operator, timeline
    assert body["reason"] in (by_operator[0]["reason"] or "")
    assert by_operator[0]["from_status"] == "unknown"

    again = await api.client.post(f"/api/calls/{reference}/resolve", json=body, headers=FULL)
    assert again.status_code == 409
    assert "only an unknown outcome can be resolved" in again.json()["detail"]
    assert len(api.emulator.control.tool_results(api.ledger.unknown_session)) == 1


async def test_resolve__a_resolution_without_its_text_or_reason_is_400(api: Api) -> None:
    reference = quote(str(api.ledger.unknown), safe="")
    received = len(api.emulator.control.tool_results(api.ledger.unknown_session))
    for body in (
        {"kind": "output", "reason": "no text"},
        {"kind": "error", "text": "x", "reason": ""},
        {"kind": "rerun", "text": "no text for a rerun", "reason": "r"},
        {"kind": "guess", "reason": "r"},
        {"kind": "output", "text": "x", "reason": "r", "operator": "mallory"},
    ):
        response = await api.client.post(f"/api/calls/{reference}/resolve", json=body, headers=FULL)
        assert response.status_code == 400, (body, response.text)
        assert isinstance(response.json()["detail"], str)
    assert len(api.emulator.control.tool_results(api.ledger.unknown_session)) == received


# --------------------------------------------------------------------------- sessions


async def test_sessions__listed_counted_watched_and_unwatched(api: Api) -> None:
    rows = await ledger_rows(api.engine)
    response = await api.client.get("/api/sessions", params={"limit": "100"}, headers=READ)
    assert response.status_code == 200
    listing = {s["session_id"]: s for s in response.json()}
    for session_id in [*api.ledger.session_ids, api.ledger.unknown_session]:
        expected = Counter(r.status for r in rows if r.session_id == session_id)
        assert listing[session_id]["calls"] == dict(expected)
        assert listing[session_id]["watched"] is False

    target = api.ledger.session_ids[1]
    assert (await api.client.post(f"/api/sessions/{target}/watch", headers=READ)).status_code == 403
    watched = await api.client.post(f"/api/sessions/{target}/watch", headers=FULL)
    assert watched.status_code == 200
    assert watched.json()["watched"] is True
    only_watched = await api.client.get("/api/sessions", params={"watched": "true"}, headers=READ)
    assert [s["session_id"] for s in only_watched.json()] == [target]

    unwatched = await api.client.post(
        f"/api/sessions/{target}/unwatch", json={"reason": "audit finished"}, headers=FULL
    )
    assert unwatched.status_code == 200
    assert unwatched.json()["watched"] is False
    assert unwatched.json()["reason"] == "audit finished (by alice)"
    one = await api.client.get(f"/api/sessions/{target}", headers=READ)
    assert one.json()["watched"] is False
    assert (await api.client.get("/api/sessions/sess_nobody", headers=READ)).status_code == 404
    no_reason = await api.client.post(f"/api/sessions/{target}/unwatch", json={}, headers=FULL)
    assert no_reason.status_code == 400
    assert (await api.client.get("/api/sessions", params={"limit": "0"}, headers=READ)).status_code == 400


# ---------------------------------------------------------------------------- canary


async def test_canary__stored_in_the_ledger_but_in_no_answer(api: Api) -> None:
    async with api.engine.connect() as conn:
        stored = (
            await conn.execute(
                select(func.count()).where(
                    tool_calls.c.result.contains(CANARY) | tool_calls.c.arguments.contains(CANARY)
                )
            )
        ).scalar_one()
    assert stored >= 4, "the canary must be in the ledger for this test to mean anything"

    bodies: list[str] = []
    page = await api.client.get("/api/calls", params={"limit": EVERY}, headers=READ)
    bodies.append(page.text)
    for call in page.json()["calls"]:
        bodies.append((await api.client.get(f"/api/calls/{call['id']}", headers=READ)).text)
    for sort in ("tool", "-status", "finished"):
        bodies.append(
            (await api.client.get("/api/calls", params={"sort": sort, "limit": EVERY}, headers=READ)).text
        )
    sessions_page = await api.client.get("/api/sessions", headers=READ)
    bodies.append(sessions_page.text)
    for session in sessions_page.json():
        bodies.append((await api.client.get(f"/api/sessions/{session['session_id']}", headers=READ)).text)
    bodies.append((await api.client.get("/metrics")).text)
    assert len(bodies) > 20
    assert all(CANARY not in body for body in bodies)
    assert any("[REDACTED]" in body for body in bodies)


# ---------------------------------------------------------------------- probes, metrics


async def test_metrics__ledger_gauges_match_the_ledger(api: Api) -> None:
    rows = await ledger_rows(api.engine)
    response = await api.client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(response.text)}
    samples = {(s.labels["status"], s.labels["tool"]): s.value for s in families["toolledger_calls"].samples}
    assert samples == {key: float(n) for key, n in Counter((r.status, r.tool_name) for r in rows).items()}
    assert 'toolledger_calls{status="submitted",tool="lookup_order"}' in response.text
    assert families["toolledger_ledger_up"].samples[0].value == 1
    unknown = sum(1 for r in rows if r.status == "unknown")
    assert families["toolledger_unknown_calls"].samples[0].value == unknown
    async with api.engine.connect() as conn:
        watched = (await conn.execute(select(func.count()).where(sessions.c.watched.is_(True)))).scalar_one()
    assert families["toolledger_watched_sessions"].samples[0].value == watched
    waiting = [r.finished_at for r in rows if r.status in ("succeeded", "failed")]
    age = families["toolledger_oldest_unsubmitted_result_age_seconds"].samples[0].value
    if waiting:
        assert age >= (datetime.now(UTC) - min(waiting)).total_seconds() - 5
    else:
        assert age == 0
    for process_local in (
        "toolledger_handler_duration_seconds",
        "toolledger_submission_duration_seconds",
        "toolledger_submissions",
        "toolledger_retries",
    ):
        assert process_local in families


async def test_metrics__a_waiting_result_ages(sqlite_url: str) -> None:
    """A stored result nobody has submitted yet shows in the age gauge (and in the counts)."""
    app = create_app(api_settings(sqlite_url))
    engine: AsyncEngine = app.state.api.engine
    store = LedgerStore(engine, actor="api-test")
    key = CallKey("sess_m", "turn_m", "call_m")
    recorded = await store.record(
        key, tool_name="lookup_order", arguments={}, effect_class=EffectClass.READ_ONLY, lease_seconds=30
    )
    await store.complete(key, recorded.call.lease_token, succeeded(key, "done"))
    await asyncio.sleep(0.3)
    async with serving(app) as client:
        text = (await client.get("/metrics")).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["toolledger_oldest_unsubmitted_result_age_seconds"].samples[0].value >= 0.25
    assert 'toolledger_calls{status="succeeded",tool="lookup_order"} 1.0' in text


async def test_readyz__ready_on_a_current_schema(api: Api) -> None:
    assert (await api.client.get("/healthz")).json() == {"status": "ok"}
    ready = await api.client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["status"] == "ready"


@pytest.fixture(params=["sqlite", "postgresql"])
def unmigrated_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'empty.sqlite3'}"
        return
    template: PostgresTemplate = request.getfixturevalue("postgres_template")
    with template.clone(migrated=False) as url:
        yield url


async def test_readyz__unmigrated_database_is_503_and_data_errors_stay_generic(
    unmigrated_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    app = create_app(api_settings(unmigrated_url))
    async with serving(app) as client:
        assert (await client.get("/healthz")).status_code == 200
        ready = await client.get("/readyz")
        assert ready.status_code == 503
        assert "toolledger migrate" in ready.json()["detail"]
        # No table to read: a generic answer, never the exception or the statement.
        failed = await client.get("/api/calls", params={"q": "x"}, headers=READ)
    assert failed.status_code in (500, 503)
    assert failed.json() in (
        {"detail": "internal error"},
        {"detail": "the ledger database is unavailable: try again"},
    )
    for leak in ("Traceback", "tool_calls", "SELECT", "sqlite3", "psycopg"):
        assert leak not in failed.text
    assert any("tool_calls" in r.getMessage() for r in caplog.records if r.name == "toolledger.api")
    assert all(ALICE not in r.getMessage() and READER not in r.getMessage() for r in caplog.records)


async def test_readyz__unreachable_database_is_503() -> None:
    app = create_app(api_settings("postgresql+psycopg://nobody:secret-pw@127.0.0.1:9/none"))
    async with serving(app) as client:
        ready = await client.get("/readyz")
        assert ready.status_code == 503
        assert "unreachable" in ready.json()["detail"]
        assert "secret-pw" not in ready.text
        listing = await client.get("/api/calls", headers=READ)
        assert listing.status_code == 503
        assert "secret-pw" not in listing.text
        # The process's own metrics are still scraped; the ledger's say it is down.
        scraped = await client.get("/metrics")
        assert scraped.status_code == 200
        assert "toolledger_ledger_up 0.0" in scraped.text
        assert "toolledger_submissions_total" in scraped.text
        assert "toolledger_calls{" not in scraped.text


# ------------------------------------------------------------------------------- auth


def unguarded_routes(app: FastAPI) -> list[str]:
    """Every route that serves data without depending on ``authenticated``."""
    unguarded = []
    for route in app.routes:
        if isinstance(route, Mount):
            if route.path != "/ui":
                unguarded.append(route.path)
            continue
        path = str(getattr(route, "path", route))
        if path in OPEN_PATHS:
            continue
        if not isinstance(route, APIRoute) or authenticated not in _dependency_calls(route):
            unguarded.append(path)
    return unguarded


def _dependency_calls(route: APIRoute) -> set[Any]:
    calls: set[Any] = set()
    stack = [route.dependant]
    while stack:
        dependant = stack.pop()
        if dependant.call is not None:
            calls.add(dependant.call)
        stack.extend(dependant.dependencies)
    return calls


def concrete_requests(app: FastAPI) -> list[tuple[str, str, bool]]:
    """(method, path, writes) for every guarded route, path parameters filled in."""
    found = []
    for route in app.routes:
        if isinstance(route, APIRoute) and route.path not in OPEN_PATHS:
            path = route.path.replace("{ref:path}", "tl_0123456789abcdef").replace("{session_id}", "sess_x")
            writes = may_write in _dependency_calls(route)
            found += [(method, path, writes) for method in sorted(route.methods or ())]
    return found


async def test_auth__every_data_route_needs_a_token_and_writes_need_full_rights(sqlite_url: str) -> None:
    app = create_app(api_settings(sqlite_url))
    assert unguarded_routes(app) == []
    requests = concrete_requests(app)
    assert {path for _, path, writes in requests if writes} == {
        "/api/calls/tl_0123456789abcdef/resolve",
        "/api/calls/tl_0123456789abcdef/approve",
        "/api/calls/tl_0123456789abcdef/deny",
        "/api/bulk/resolve",
        "/api/sessions/sess_x/watch",
        "/api/sessions/sess_x/unwatch",
    }
    assert len(requests) >= 9

    wrong = [
        {},
        {"Authorization": "Bearer not-a-configured-token-at-all"},
        {"Authorization": f"Bearer {ALICE}x"},
        {"Authorization": f"Bearer {ALICE[:-1]}"},
        {"Authorization": f"Basic {ALICE}"},
        {"Authorization": ALICE},
        {"X-Api-Key": ALICE},
    ]
    body = {"kind": "rerun", "reason": "r"}
    async with serving(app) as client:
        for method, path, writes in requests:
            for headers in wrong:
                response = await client.request(method, path, headers=headers, json=body)
                assert response.status_code == 401, (method, path, headers, response.text)
                assert response.headers["www-authenticate"].startswith("Bearer")
                assert ALICE not in response.text
            with_read = await client.request(method, path, headers=READ, json={"reason": "r", **body})
            if writes:
                assert with_read.status_code == 403, (method, path)
                assert "may only read" in with_read.json()["detail"]
            else:
                assert with_read.status_code not in (401, 403), (method, path)
        for open_path in ("/healthz", "/readyz", "/metrics", "/openapi.json"):
            assert (await client.get(open_path)).status_code == 200, open_path
        home = await client.get("/")
        assert home.status_code in (302, 307)
        assert home.headers["location"] == "/ui/"
        assert "bearer" in (await client.get("/openapi.json")).text.lower()

    # The walk catches a route added without the dependency.
    @app.get("/api/forgotten")
    async def forgotten() -> dict[str, str]:
        return {}

    assert unguarded_routes(app) == ["/api/forgotten"]


async def test_auth__without_tokens_only_loopback_requests_are_served(sqlite_url: str) -> None:
    app = create_app(Settings(database_url=sqlite_url))
    async with serving(app, base_url="http://127.0.0.1:8700") as client:
        assert (await client.get("/api/calls")).status_code == 200
        rebound = await client.get("/api/calls", headers={"Host": "evil.example:8700"})
        assert rebound.status_code == 403
        cross_site = await client.post(
            "/api/sessions/sess_x/watch", headers={"Origin": "https://evil.example"}
        )
        assert cross_site.status_code == 403
        same_origin = await client.post(
            "/api/sessions/sess_x/watch", headers={"Origin": "http://127.0.0.1:8700"}
        )
        assert same_origin.status_code == 200
        assert same_origin.json()["watched"] is True


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.20", "api.example.com"])
def test_create_app__refuses_a_public_host_without_tokens(host: str, sqlite_url: str) -> None:
    with pytest.raises(ApiConfigurationError, match="without a token"):
        create_app(Settings(database_url=sqlite_url, api_host=host))
    create_app(api_settings(sqlite_url, api_host=host))  # with a token it may
    result = CliRunner().invoke(
        api_command, ["--host", host, "--port", "0", "--database-url", sqlite_url], env=_no_settings_env()
    )
    assert result.exit_code == 2, result.output
    assert "without a token" in result.output


def test_create_app__refuses_weak_or_duplicate_tokens(sqlite_url: str) -> None:
    with pytest.raises(ApiConfigurationError, match="shorter than"):
        create_app(Settings(database_url=sqlite_url, api_tokens={"bob": "short"}))
    with pytest.raises(ApiConfigurationError, match="same value"):
        create_app(Settings(database_url=sqlite_url, api_tokens={"a": ALICE}, api_read_tokens={"b": ALICE}))


async def test_body_over_64_kib__413(sqlite_url: str) -> None:
    app = create_app(api_settings(sqlite_url))
    huge = {"kind": "output", "text": "x" * (70 * 1024), "reason": "too long"}
    async with serving(app) as client:
        sized = await client.post("/api/calls/tl_0123456789abcdef/resolve", json=huge, headers=FULL)
        assert sized.status_code == 413

        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(70):
                yield b"x" * 1024

        streamed = await client.post(
            "/api/calls/tl_0123456789abcdef/resolve",
            content=chunks(),
            headers={**FULL, "Content-Type": "application/json"},
        )
        assert streamed.status_code == 413
        small = await client.post(
            "/api/calls/tl_0123456789abcdef/resolve", json={**huge, "text": "fits"}, headers=FULL
        )
        assert small.status_code == 404


# ------------------------------------------------------------------ R16: hostile input

INJECTIONS = [
    "' OR 1=1--",
    "' OR '1'='1",
    '" OR ""="',
    "'; DROP TABLE tool_calls;--",
    "'; DELETE FROM tool_call_events; --",
    "1; UPDATE tool_calls SET status='submitted'",
    "') OR ('a'='a",
    "admin'--",
    "' UNION SELECT * FROM tool_calls--",
    "' UNION SELECT null, version()--",
    "1' AND SLEEP(5)--",
    "'; SELECT pg_sleep(5);--",
    "1 OR 1=1",
    "' OR tool_name LIKE '%",
    "lookup_order' OR 'x'='x",
    "lookup_order'--",
    "%",
    "%%",
    "_",
    "__",
    "%_%",
    "_ookup_order",
    "%lookup%",
    "lookup%",
    "\\",
    "\\%",
    "\\_",
    "\\\\%",
    "\x00",
    "lookup\x00order",
    "'",
    '"',
    "`",
    ";",
    "--",
    "/*",
    "*/ OR 1=1 /*",
    "$1",
    "?",
    ":name",
    "%(session_id)s",
    "%s",
    "{0}",
    "${jndi:ldap://x/a}",
    "<script>alert(1)</script>",
    "../../etc/passwd",
    "\r\nX-Injected: 1",
    "\t",
    " ",
    "é",
    "日本語",
    "\U0001f642",
    "\u202e",
    "submitted",
    "SUBMITTED, unknown",
    "-created",
    "A" * 10_000,
    "%" * 10_000,
    "'" * 5_000,
    "0",
    "-1",
    "1e309",
    "9" * 40,
    "true",
    "null",
    "[]",
    "{}",
]
TEXT_FILTERS = ("session_id", "turn_id", "tool", "q")
ENUM_FILTERS = ("status", "effect_class", "sort", "unknown_only", "limit")
EVERY_FILTER = (*TEXT_FILTERS, *ENUM_FILTERS, "since", "until", "cursor")


def _unescape_like(pattern: str) -> str | None:
    """The literal text a LIKE pattern body matches, or None if it holds a bare wildcard."""
    text, escaped = [], False
    for char in pattern:
        if escaped:
            text.append(char)
            escaped = False
        elif char == "\\":
            escaped = True
        elif char in "%_":
            return None
        else:
            text.append(char)
    return None if escaped else "".join(text)


def _flat(parameters: Any) -> list[Any]:
    if isinstance(parameters, dict):
        return list(parameters.values())
    if isinstance(parameters, list | tuple):
        return (
            [value for item in parameters for value in _flat(item)]
            if parameters and isinstance(parameters[0], dict | list | tuple)
            else list(parameters)
        )
    return [parameters]


def _valid_spelling(name: str, value: str) -> bool:
    words = [part.strip().lower() for part in value.split(",") if part.strip()]
    if name == "status":
        return all(w in {s.value for s in CallStatus} for w in words)
    if name == "effect_class":
        return all(w in {e.value for e in EffectClass} for w in words)
    if name == "sort":
        return value.removeprefix("-").strip().lower() in ("created", "finished", "tool", "status")
    if name == "unknown_only":
        return value.strip().lower() in (
            "true",
            "false",
            "1",
            "0",
            "yes",
            "no",
            "on",
            "off",
            "t",
            "f",
            "y",
            "n",
        )
    if name == "limit":
        try:
            number = float(value.replace("_", ""))
        except ValueError:
            return False
        return number.is_integer() and 1 <= number <= 500
    raise AssertionError(name)


@dataclass
class HostileProbe:
    """Sends one value into one filter and checks what reached the database."""

    client: httpx.AsyncClient
    engine: AsyncEngine
    rows: list[Row[Any]]
    statements: list[tuple[str, list[Any]]] = field(default_factory=list)
    baseline: dict[str, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        event.listen(self.engine.sync_engine, "before_cursor_execute", self._record)

    def close(self) -> None:
        event.remove(self.engine.sync_engine, "before_cursor_execute", self._record)

    def _record(self, _conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        self.statements.append((statement, _flat(parameters)))

    async def _send(self, name: str, value: str) -> httpx.Response:
        self.statements.clear()
        params = {name: value} if name == "limit" else {name: value, "limit": EVERY}
        return await self.client.get("/api/calls", params=params, headers=READ)

    async def check(self, name: str, value: str) -> None:
        if name in TEXT_FILTERS and name not in self.baseline:
            await self._send(name, "benign")
            self.baseline[name] = [s for s, _ in self.statements]
        response = await self._send(name, value)
        assert response.status_code in (200, 400), (
            name,
            value[:80],
            response.status_code,
            response.text[:300],
        )
        assert isinstance(response.json(), dict)
        if response.status_code == 400:
            assert isinstance(response.json()["detail"], str)
            assert self.statements == [], "a refused filter must not reach the database"
            return
        got = {c["id"] for c in response.json()["calls"]}
        if name in TEXT_FILTERS:
            self._check_text_filter(name, value, got)
        elif name in ENUM_FILTERS:
            assert _valid_spelling(name, value), (name, value)
        else:
            assert got <= ids(self.rows)

    def _check_text_filter(self, name: str, value: str, got: set[str]) -> None:
        if value == "":
            assert got == ids(self.rows)
            return
        sql = [s for s, _ in self.statements]
        assert sql == self.baseline[name], "the value changed the SQL text"
        parameters = [p for _, flat in self.statements for p in flat if isinstance(p, str)]
        column = {"session_id": "session_id", "turn_id": "turn_id", "tool": "tool_name"}.get(name)
        if column is not None:
            assert value in parameters
            expected = ids([r for r in self.rows if getattr(r, column) == value])
        else:
            patterns = [p for p in parameters if p.startswith("%") and p.endswith("%") and len(p) >= 2]
            # The whole value with its wildcards escaped, folded by the database (both sides).
            assert patterns
            assert {_unescape_like(p[1:-1]) for p in patterns} == {value}
            needle = folded(value)
            expected = ids(
                [
                    r
                    for r in self.rows
                    if any(
                        needle in folded(part) for part in (r.tool_name, r.session_id, r.turn_id, r.call_id)
                    )
                ]
            )
        assert got == expected, (name, value[:80])


async def test_list_calls__injection_payloads_stay_parameters(api: Api) -> None:
    rows = await ledger_rows(api.engine)
    counts = await table_counts(api.engine)
    probe = HostileProbe(api.client, api.engine, rows)
    try:
        for payload in INJECTIONS:
            for name in EVERY_FILTER:
                await probe.check(name, payload)
    finally:
        probe.close()
    assert await table_counts(api.engine) == counts
    assert [r.status for r in await ledger_rows(api.engine)] == [r.status for r in rows]


def test_list_calls__hypothesis_text_in_any_filter(shared_ledger: FilledLedger) -> None:
    with asyncio.Runner() as runner:
        app = create_app(api_settings(shared_ledger.database_url))
        client_context = serving(app)
        client = runner.run(client_context.__aenter__())
        engine: AsyncEngine = app.state.api.engine
        rows = runner.run(ledger_rows(engine))
        counts = runner.run(table_counts(engine))
        probe = HostileProbe(client, engine, rows)
        tried: Counter[str] = Counter()
        try:

            @settings(max_examples=200, deadline=None, database=None)
            @given(
                name=st.sampled_from(EVERY_FILTER),
                value=st.text(alphabet=st.characters(codec="utf-8"), max_size=300),
            )
            def any_text(name: str, value: str) -> None:
                runner.run(probe.check(name, value))
                tried[name] += 1

            any_text()
        finally:
            probe.close()
            runner.run(client_context.__aexit__(None, None, None))
        assert runner.run(_counts_after(shared_ledger.database_url)) == counts
        assert sum(tried.values()) >= 200
        assert set(tried) == set(EVERY_FILTER)


async def _counts_after(url: str) -> dict[str, int]:
    from toolledger.store.engine import create_engine

    engine = create_engine(url)
    try:
        return await table_counts(engine)
    finally:
        await engine.dispose()


# -------------------------------------------------------------------- the real command


def _no_settings_env() -> dict[str, str | None]:
    return {key: None for key in os.environ if key.startswith("TOOLLEDGER_")}


def test_toolledger_api__serves_over_tcp_and_exits_0_on_sigterm(shared_ledger: FilledLedger) -> None:
    env = {key: value for key, value in os.environ.items() if not key.startswith("TOOLLEDGER_")}
    env.update(
        TOOLLEDGER_API_TOKENS=f'{{"alice": "{ALICE}"}}',
        TOOLLEDGER_API_READ_TOKENS=f'{{"auditor": "{READER}"}}',
        PYTHONPATH=str(ROOT),
    )
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "toolledger.cli",
            "api",
            "--port",
            "0",
            "--database-url",
            shared_ledger.database_url,
            "--log-level",
            "debug",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("audit API: http://127.0.0.1:"), line
        base_url = line.split(": ", 1)[1].strip()
        assert not base_url.endswith(":0")
        with httpx.Client(base_url=base_url, timeout=10) as http:
            assert http.get("/healthz").json() == {"status": "ok"}
            assert http.get("/readyz").status_code == 200
            denied = http.get("/api/calls")
            assert denied.status_code == 401
            assert denied.headers["www-authenticate"].startswith("Bearer")
            calls = http.get("/api/calls", params={"limit": EVERY}, headers=READ).json()["calls"]
            rows = asyncio.run(_rows_of(shared_ledger.database_url))
            assert {c["id"] for c in calls} == ids(rows)
            assert CANARY not in http.get("/api/calls", params={"limit": EVERY}, headers=READ).text
            assert "toolledger_calls{" in http.get("/metrics").text
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=15) == 0
        logged = process.stderr.read() if process.stderr is not None else ""
        assert "GET /api/calls" in logged
        for secret in (ALICE, READER, CANARY):
            assert secret not in logged
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


async def _rows_of(url: str) -> list[Row[Any]]:
    from toolledger.store.engine import create_engine

    engine = create_engine(url)
    try:
        return await ledger_rows(engine)
    finally:
        await engine.dispose()


async def test_api_server_task__serves_in_process_until_stopped(sqlite_url: str) -> None:
    """What `toolledger serve --api` runs beside the service: the same app, over TCP."""
    stop = asyncio.Event()
    listening: asyncio.Future[tuple[str, int]] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(
        api_server_task(
            api_settings(sqlite_url, api_port=0),
            stop=stop,
            on_listening=lambda host, port: listening.set_result((host, port)),
            log_level="warning",
        )
    )
    host, port = await asyncio.wait_for(listening, 10)
    async with httpx.AsyncClient(base_url=f"http://{host}:{port}", timeout=10) as http:
        assert (await http.get("/api/sessions", headers=READ)).json() == []
        assert (await http.get("/api/sessions")).status_code == 401
    stop.set()
    await asyncio.wait_for(task, 10)
    with pytest.raises(httpx.ConnectError):
        async with httpx.AsyncClient(base_url=f"http://{host}:{port}", timeout=2) as http:
            await http.get("/healthz")

    # Cancelled instead of stopped (the serve process's task group failing): it still closes.
    cancelled = asyncio.create_task(
        api_server_task(api_settings(sqlite_url, api_port=0), log_level="warning")
    )
    await asyncio.sleep(0.5)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(cancelled, 10)


async def test_web_view__static_files_without_a_token(
    sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    web = tmp_path / "web"
    web.mkdir()
    (web / "index.html").write_text("<!doctype html><title>toolledger</title>")
    monkeypatch.setattr(api_module, "WEB_DIRECTORY", web)
    app = create_app(api_settings(sqlite_url))
    assert unguarded_routes(app) == []
    async with serving(app) as client:
        page = await client.get("/ui/")
        assert page.status_code == 200
        assert "<title>toolledger</title>" in page.text
        assert page.headers["x-content-type-options"] == "nosniff"
        assert (await client.get("/ui/%2e%2e/%2e%2e/%2e%2e/etc/passwd")).status_code == 404
        assert (await client.get("/api/calls")).status_code == 401
