"""One composition root (``toolledger.runtime.composition.Runtime``): the service and its
ledger, the audit service and HTTP API, and every CLI command run on a Runtime, and nothing
else in the package builds an engine, an Agents API gateway or a store."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

import toolledger
from tests.support.service_harness import FAST
from tests.support.service_tools import registry
from tests.support.workload import CALLS_PER_SESSION, start_sessions, wait_until_idle
from toolledger.audit.api import create_app
from toolledger.audit.service import AuditService
from toolledger.cli import main
from toolledger.domain.queries import CallQuery
from toolledger.emulator import EmulatorServer
from toolledger.runtime.composition import Runtime
from toolledger.runtime.service import Service
from toolledger.settings import Settings

TOKEN = "composition-test-token-0123456"  # noqa: S105 - a test token


async def test_one_runtime__service_audit_service_and_api_all_run_on_it(
    sqlite_url: str, emulator: EmulatorServer, effects_file: Path
) -> None:
    settings = Settings(
        database_url=sqlite_url,
        openai_base_url=emulator.base_url,
        worker_id="composition",
        api_tokens={"alice": TOKEN},
        **FAST,
    )
    async with Runtime.from_settings(settings) as runtime:
        async with Service(registry, runtime=runtime, auto_migrate=False) as service:
            assert service.ledger.engine is runtime.engine
            assert service.ledger.gateway is runtime.gateway()
            (session_id,) = await start_sessions(emulator, 1)
            await service.watch(session_id)
            await wait_until_idle(emulator, [session_id])
        # Stopped, the service left open what it was given: the same engine reads on.
        assert await runtime.ledger_store(actor="test").count_by_status() == {"submitted": CALLS_PER_SESSION}

        page = await AuditService(runtime).list_calls(CallQuery(session_id=session_id))
        assert [view.status for view in page.calls] == ["submitted"] * CALLS_PER_SESSION

        app = create_app(settings, runtime=runtime)
        assert app.state.api.engine is runtime.engine
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app),
                base_url="http://testserver",
                headers={"Authorization": f"Bearer {TOKEN}"},
            ) as client,
        ):
            listed = (await client.get("/api/calls", params={"session_id": session_id})).json()
        assert [call["status"] for call in listed["calls"]] == ["submitted"] * CALLS_PER_SESSION
        # The app's shutdown closed nothing of the runtime's either.
        assert len((await AuditService(runtime).list_calls(CallQuery())).calls) == CALLS_PER_SESSION
        gateway = runtime.gateway()
        assert not gateway.client.is_closed()
    # What the runtime built, it closed.
    assert gateway.client.is_closed()


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        (["calls", "list", "--json"], ""),
        (["calls", "stats", "--json"], '"total": 0'),
        (["sessions", "list"], "no sessions watched"),
        (["status", "--json"], '"schema_current": true'),
    ],
)
def test_cli__each_command_runs_on_one_runtime_and_closes_it(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch, arguments: list[str], expected: str
) -> None:
    built: list[Runtime] = []
    closed: list[Runtime] = []
    original_init, original_close = Runtime.__init__, Runtime.aclose

    def init(self: Runtime, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        built.append(self)

    async def aclose(self: Runtime) -> None:
        closed.append(self)
        await original_close(self)

    monkeypatch.setattr(Runtime, "__init__", init)
    monkeypatch.setattr(Runtime, "aclose", aclose)
    monkeypatch.setenv("TOOLLEDGER_DATABASE_URL", sqlite_url)
    result = CliRunner().invoke(main, arguments, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert expected in result.output
    assert len(built) == 1
    assert closed == built
    if arguments[0] == "status":
        assert json.loads(result.output)["database_reachable"] is True


BUILDERS = frozenset(
    {
        "create_engine",
        "create_async_engine",
        "LedgerStore",
        "SessionStore",
        "AuditStore",
        "OperatorViews",
        "liveness_for",
        "connect",  # AgentsGateway.connect
    }
)
ALLOWED = {"runtime/composition.py"}
"""The composition root. Besides it, the store and the gateway build their own parts (the
engine factory, a migration's sync engine, the liveness lock's connection, the SDK client),
the emulator is a separate server, and the conformance kit (``toolledger.testing``) builds
throwaway ledgers of its own for each run."""
SKIPPED = ("store/", "gateway/", "emulator/", "testing/")


def test_only_the_composition_root_builds_engines_gateways_and_stores() -> None:
    package = Path(toolledger.__file__).parent
    offenders = []
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package).as_posix()
        if relative in ALLOWED or relative.startswith(SKIPPED):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            function = node.func
            name = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", None)
            owner = getattr(function, "value", None)
            if name == "connect" and getattr(owner, "id", None) != "AgentsGateway":
                continue  # engine.connect(), sqlite3.connect(): not a gateway
            if name in BUILDERS:
                offenders.append(f"{relative}:{node.lineno} {name}(...)")
    assert offenders == []
