"""The audit API keeps to its OpenAPI document: schemathesis generates requests from
/openapi.json (valid ones, and ones that break the schema) and sends them to the app in
process (ASGI), on a SQLite and a PostgreSQL ledger with calls in every state an operator
meets. Every answer must be declared (its status, its body's schema, its media type), none
may be a 500, a request that breaks the schema must be refused, credentials must be asked
for where the document says so, and an undeclared method must be 405.

Bounded: a few examples per operation, no deadline (a database answers when it answers).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from fastapi import FastAPI
from hypothesis import HealthCheck, settings
from psycopg import sql
from schemathesis.python.asgi import shutdown_lifespans
from sqlalchemy.engine import make_url

from tests.support.api_server import ALICE, FULL, READ, api_settings, serving
from tests.support.databases import PostgresTemplate, server_url
from tests.support.polling import eventually
from toolledger.audit.api import create_app
from toolledger.domain.keys import CallKey
from toolledger.domain.results import succeeded
from toolledger.domain.states import EffectClass
from toolledger.settings import Settings
from toolledger.store import migrate
from toolledger.store.engine import create_engine
from toolledger.store.ledger import LedgerStore

SCRAPER = "contract-metrics-scraper-0123456789"
EXAMPLES_PER_OPERATION = 12


async def _calls_in_every_state(url: str) -> None:
    """A finished call with its result, one still running, one whose outcome is unknown, one
    awaiting approval."""
    engine = create_engine(url)
    try:
        store = LedgerStore(engine, actor="contract-test")
        done = CallKey("sess_contract", "turn_1", "call_done")
        recorded = await store.record(
            done,
            tool_name="lookup_order",
            arguments={"order_id": "A1", "password": "hunter2"},
            effect_class=EffectClass.READ_ONLY,
            lease_seconds=30,
        )
        await store.complete(done, recorded.call.lease_token, succeeded(done, '{"shipped": true}'))
        await store.record(
            CallKey("sess_contract", "turn_1", "call_running"),
            tool_name="send_receipt",
            arguments={"email": "ann@example.com"},
            effect_class=EffectClass.IDEMPOTENT,
            lease_seconds=300,
        )
        unknown = CallKey("sess_contract", "turn_2", "call_unknown")
        await store.record(
            unknown,
            tool_name="charge_card",
            arguments={"amount": 3},
            effect_class=EffectClass.AT_MOST_ONCE,
            lease_seconds=0.05,
        )
        await eventually(lambda: store.expire_leases(unknown), within=10, what=f"{unknown} expired")
        await store.record_for_approval(
            CallKey("sess_contract", "turn_2", "call_gated"),
            tool_name="refund",
            arguments={"order_id": "A1", "cents": 900},
            effect_class=EffectClass.AT_MOST_ONCE,
            approval_seconds=None,
        )
    finally:
        await engine.dispose()


def _settings(database_url: str) -> Settings:
    # A metrics token, so that /metrics asks for credentials as the document says it does.
    return api_settings(database_url, metrics_token=SCRAPER)


CONFIG = schemathesis.Config.from_dict(
    {
        "headers": {"Authorization": f"Bearer {ALICE}"},
        "generation": {"max-examples": EXAMPLES_PER_OPERATION},
        "phases": {"stateful": {"enabled": False}},
        "operations": [
            {
                # Times, durations, cursors, statuses and call references have grammars JSON
                # Schema does not state: a value that parses as none of them is 400, as the
                # document declares, schema-valid or not (the counts, the export and a bulk
                # resolution take the same filters; a bulk resolution also refuses a run over its
                # time limit; the trail takes a reference, and exactly one of its scopes).
                "include-path-regex": "^/api/(calls|counts|export|trail|bulk)",
                "checks": {
                    "positive_data_acceptance": {
                        "expected-statuses": ["2xx", "400", "401", "403", "404", "409"]
                    }
                },
            }
        ],
    }
)
# schemathesis loads the document from the app when this module is imported; building an
# app opens no database, so each ledger is made by its fixture, before the first request.
SQLITE_FILE = (
    Path(tempfile.gettempdir()) / f"toolledger-contract-{os.getpid()}-{uuid.uuid4().hex[:8]}.sqlite3"
)
SQLITE_APP = create_app(_settings(f"sqlite+aiosqlite:///{SQLITE_FILE}"))
POSTGRES_DATABASE = f"toolledger_contract_{os.getpid()}_{uuid.uuid4().hex[:8]}"
POSTGRES_APP = create_app(
    _settings(make_url(server_url()).set(database=POSTGRES_DATABASE).render_as_string(hide_password=False))
)
on_sqlite = schemathesis.openapi.from_asgi("/openapi.json", SQLITE_APP, config=CONFIG)
on_postgresql = schemathesis.openapi.from_asgi("/openapi.json", POSTGRES_APP, config=CONFIG)


def _url(app: FastAPI) -> str:
    url: str = app.state.api.service.settings.database_url
    return url


@pytest.fixture(scope="module")
def sqlite_ledger() -> Iterator[None]:
    migrate.upgrade(_url(SQLITE_APP))
    asyncio.run(_calls_in_every_state(_url(SQLITE_APP)))
    yield
    # The app, and so its lifespan (which closes its engine), runs in schemathesis' own
    # event loop: it is stopped before the file goes.
    shutdown_lifespans()
    for suffix in ("", "-wal", "-shm"):
        SQLITE_FILE.with_name(SQLITE_FILE.name + suffix).unlink(missing_ok=True)


@pytest.fixture(scope="module")
def postgresql_ledger(postgres_template: PostgresTemplate) -> Iterator[None]:
    with postgres_template.admin() as conn:
        conn.execute(
            sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(POSTGRES_DATABASE), sql.Identifier(postgres_template.name)
            )
        )
    try:
        asyncio.run(_calls_in_every_state(_url(POSTGRES_APP)))
        yield
    finally:
        shutdown_lifespans()
        with postgres_template.admin() as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(POSTGRES_DATABASE))
            )


@on_sqlite.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_sqlite__every_operation_keeps_to_the_document(
    case: schemathesis.Case[Any], sqlite_ledger: None
) -> None:
    case.call_and_validate()


@on_postgresql.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck), database=None)
def test_postgresql__every_operation_keeps_to_the_document(
    case: schemathesis.Case[Any], postgresql_ledger: None
) -> None:
    case.call_and_validate()


# ------------------------------------------------------------ what the document says


async def test_document__declares_what_the_api_answers(sqlite_url: str) -> None:
    async with serving(create_app(api_settings(sqlite_url))) as client:
        document = (await client.get("/openapi.json")).json()
        undeclared = []
        for path, operations in document["paths"].items():
            for method, operation in operations.items():
                declared = set(operation["responses"])
                assert "422" not in declared, (method, path)
                if path.startswith("/api/"):
                    undeclared += [
                        (method, path, code) for code in ("400", "401", "403", "503") if code not in declared
                    ]
                    for code in declared - {"200", "202"}:
                        body = operation["responses"][code]["content"]["application/json"]["schema"]
                        assert body == {"$ref": "#/components/schemas/ErrorDetail"}, (method, path, code)
                    # 202: an accepted re-run, answered before its handler runs; nothing else.
                    assert ("202" in declared) is (path == "/api/calls/{ref}/resolve"), (method, path)
                    if method == "post" and path != "/api/sessions/{session_id}/watch":
                        assert "413" in declared, (method, path)
        assert undeclared == []
        assert "HTTPValidationError" not in document["components"]["schemas"]
        calls = document["paths"]["/api/calls"]["get"]["parameters"]
        limit = next(p for p in calls if p["name"] == "limit")["schema"]
        assert (limit["minimum"], limit["maximum"]) == (1, 500)
        # Not "array or null": schemathesis would send a tool named "false" as another type.
        tool = next(p for p in calls if p["name"] == "tool")["schema"]
        assert (tool["type"], "anyOf" in tool) == ("array", False)
        assert "405" in document["paths"]["/api/calls/{ref}"]["get"]["responses"]
        resolve = document["paths"]["/api/calls/{ref}/resolve"]["post"]
        for code in ("200", "202"):  # settled and submitted; or a re-run, accepted
            schema = resolve["responses"][code]["content"]["application/json"]["schema"]
            assert schema == {"$ref": "#/components/schemas/ResolveResponse"}, code
        assert "GET /api/calls/{ref}" in resolve["description"]
        body = resolve["requestBody"]["content"]
        variants = body["application/json"]["schema"]["oneOf"]
        for variant in variants:
            reason = document["components"]["schemas"][variant["$ref"].rsplit("/", 1)[1]]["properties"][
                "reason"
            ]
            assert reason["minLength"] == 1
            assert "pattern" in reason

        for action in ("approve", "deny"):
            decision = document["paths"][f"/api/calls/{{ref}}/{action}"]["post"]
            assert {"404", "409", "413"} <= set(decision["responses"]), action
            schema = decision["requestBody"]["content"]["application/json"]["schema"]["$ref"]
            fields = document["components"]["schemas"][schema.rsplit("/", 1)[1]]["properties"]
            assert fields["reason"]["minLength"] == 1
            assert "pattern" in fields["reason"]
            assert "arguments_sha256" in fields
            assert ("arguments" in fields) is (action == "approve")

        bulk = document["paths"]["/api/bulk/resolve"]["post"]
        assert {"409", "413"} <= set(bulk["responses"])
        assert {p["name"] for p in bulk["parameters"]} >= {"session_id", "tool", "status", "since", "q"}
        for variant in bulk["requestBody"]["content"]["application/json"]["schema"]["oneOf"]:
            schema = document["components"]["schemas"][variant["$ref"].rsplit("/", 1)[1]]
            assert "dry_run" in schema["required"]
            assert (
                schema["properties"]["rate"]["exclusiveMinimum"],
                schema["properties"]["rate"]["maximum"],
            ) == (
                0,
                1000,
            )

        # Each status the document declares is one the API really gives.
        for action in ("resolve", "approve", "deny"):
            wrong_method = await client.get(f"/api/calls/tl_0123456789abcdef/{action}", headers=READ)
            assert wrong_method.status_code == 405, action
            assert wrong_method.headers["allow"] == "POST"
        for params in ({"limit": "0"}, {"limit": "501"}, {"limit": "x"}, {"since": "soon"}):
            refused = await client.get("/api/calls", params=params, headers=READ)
            assert refused.status_code == 400, params
            assert isinstance(refused.json()["detail"], str)
        blank = await client.post(
            "/api/calls/sess/turn/call/resolve", json={"kind": "rerun", "reason": " \t"}, headers=FULL
        )
        assert blank.status_code == 400
        assert "reason" in blank.json()["detail"]


async def test_document__asks_for_credentials_only_where_they_are_enforced(sqlite_url: str) -> None:
    async def document_of(settings: Settings) -> dict[str, Any]:
        async with serving(create_app(settings)) as client:
            response: httpx.Response = await client.get("/openapi.json")
            document: dict[str, Any] = response.json()
            return document

    closed = await document_of(api_settings(sqlite_url, metrics_token=SCRAPER))
    assert closed["paths"]["/api/calls"]["get"]["security"]
    assert closed["paths"]["/metrics"]["get"]["security"]
    assert "401" in closed["paths"]["/metrics"]["get"]["responses"]
    # No token configured: loopback only, and nothing asks for a bearer token.
    open_ = await document_of(Settings(database_url=sqlite_url))
    assert "security" not in open_["paths"]["/api/calls"]["get"]
    assert "401" not in open_["paths"]["/api/calls"]["get"]["responses"]
    assert "security" not in open_["paths"]["/metrics"]["get"]
