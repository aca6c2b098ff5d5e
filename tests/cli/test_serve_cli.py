"""The operator's side of `toolledger`, run as real subprocesses on real ledgers: `serve` (one
per SQLite file, a clean SIGTERM, a wrong --tools), `reconcile` after a crash, `status`, and
`sessions watch / unwatch / list`."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path
from subprocess import CompletedProcess
from typing import Any, TypeVar

import httpx
import pytest
from sqlalchemy import select
from sqlalchemy.engine import make_url

from tests.support.polling import eventually
from tests.support.serve_process import FAST_ENVIRONMENT, TOOLS, ServeProcess, run_cli
from tests.support.workload import read_effects, start_sessions, wait_until_idle
from toolledger.domain.states import CallStatus
from toolledger.emulator import EmulatorServer, Script
from toolledger.settings import Settings
from toolledger.store import migrate
from toolledger.store.engine import create_engine
from toolledger.store.ledger import LedgerStore
from toolledger.store.schema import replicas
from toolledger.store.sessions import SessionStore

T = TypeVar("T")

GRACE = float(FAST_ENVIRONMENT["TOOLLEDGER_SHUTDOWN_GRACE_SECONDS"])

StartServe = Callable[..., ServeProcess]


# ----------------------------------------------------------------------- helpers


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[StartServe]:
    """Starts `serve` subprocesses; every one is SIGKILLed at teardown if still running."""
    with ExitStack() as stack:
        count = 0

        def start(database_url: str, base_url: str, **options: Any) -> ServeProcess:
            nonlocal count
            count += 1
            return stack.enter_context(
                ServeProcess(database_url, base_url, tmp_path / f"serve-{count}.log", **options)
            )

        yield start


@pytest.fixture
async def store(database_url: str) -> AsyncIterator[SessionStore]:
    engine = create_engine(database_url)
    yield SessionStore(engine)
    await engine.dispose()


async def owned_by(store: SessionStore, session_ids: list[str]) -> set[str | None]:
    """The replicas holding an unexpired lease on these sessions (None: not held)."""
    now = datetime.now(UTC)
    records = {r.session_id: r for r in await store.find(watched=True)}
    return {
        r.owner if r.owner and r.lease_expires_at and r.lease_expires_at > now else None
        for r in (records[s] for s in session_ids)
    }


async def watch(store: SessionStore, session_ids: list[str]) -> None:
    for session_id in session_ids:
        assert await store.watch(session_id)


async def replica_rows(store: SessionStore) -> list[str]:
    """Every row of the `replicas` table, expired or not."""
    async with store.engine.connect() as conn:
        return [row.replica_id for row in await conn.execute(select(replicas))]


async def run_all(*commands: tuple[str, ...], database_url: str) -> list[CompletedProcess[str]]:
    """Several read-only commands at once (each one's start-up is most of its time)."""
    return list(
        await asyncio.gather(
            *(asyncio.to_thread(run_cli, *args, database_url=database_url, timeout=30) for args in commands)
        )
    )


def json_of(result: CompletedProcess[str]) -> Any:
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout)


def logged_at(log: str, message: str) -> float:
    """When `serve` logged a line with this message (seconds since the epoch)."""
    [line] = [line for line in log.splitlines() if message in line]
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def database_file(database_url: str) -> str:
    database = make_url(database_url).database
    assert database
    return database


# -------------------------------------------------------------------- serve


async def test_serve__second_serve_on_one_sqlite_file__exits_non_zero_naming_the_file_first_keeps_serving(
    sqlite_url: str, emulator: EmulatorServer, effects_file: Path, serve: StartServe
) -> None:
    first = serve(sqlite_url, emulator.base_url)
    await asyncio.to_thread(first.wait_serving)

    started = time.monotonic()
    second = serve(sqlite_url, emulator.base_url)
    code = await asyncio.to_thread(second.wait_exit, 20.0)
    took = time.monotonic() - started

    refusal = second.log()
    assert code == 1, refusal
    assert took < 10.0, f"took {took:.1f}s to refuse"
    assert f"the SQLite ledger {database_file(sqlite_url)} is already served by pid {first.pid}" in refusal
    assert "for replicas use PostgreSQL" in refusal
    assert "serving:" not in refusal
    assert "Traceback" not in refusal

    # The first is unharmed: it still follows new sessions and runs their calls.
    assert first.process.poll() is None
    engine = create_engine(sqlite_url)
    try:
        [session_id] = await start_sessions(emulator, 1, Script.of_calls([("lookup", {"order_id": "B2"})]))
        await watch(SessionStore(engine), [session_id])
        await wait_until_idle(emulator, [session_id], within=10.0)
    finally:
        await engine.dispose()
    assert [(e.tool, e.pid) for e in read_effects(effects_file)] == [("lookup", first.pid)]
    assert len(emulator.control.accepted_results(session_id)) == 1


async def test_serve__sigterm_while_a_call_runs__finishes_it_exits_0_within_grace_and_leaves_no_lease(
    database_url: str,
    emulator: EmulatorServer,
    effects_file: Path,
    store: SessionStore,
    serve: StartServe,
) -> None:
    server = serve(database_url, emulator.base_url)
    await asyncio.to_thread(server.wait_serving)
    [busy] = await start_sessions(emulator, 1, Script.of_calls([("charge", {"amount": 3, "pause_ms": 700})]))
    idle = await start_sessions(emulator, 2, Script())
    session_ids = [busy, *idle]
    await watch(store, session_ids)

    async def charging() -> bool:
        return any(e.tool == "charge" for e in read_effects(effects_file))

    await eventually(charging, within=10.0, what="the charge handler runs")
    [replica] = await store.live_replicas()
    assert replica.pid == server.pid
    assert await owned_by(store, session_ids) == {replica.replica_id}

    started = time.monotonic()
    code = await asyncio.to_thread(server.terminate, 20.0)
    took = time.monotonic() - started

    log = server.log()
    assert code == 0, log
    assert took < 15.0, f"took {took:.1f}s to exit"
    # The running call needed well under the grace period, and the service stopped as soon as
    # it was done (the interpreter's own exit after that is not the service's to bound).
    stopping = logged_at(log, "shutting down (signal received)")
    stopped = logged_at(log, f"replica {replica.replica_id} stopped")
    assert stopped - stopping < GRACE, f"stopping took {stopped - stopping:.1f}s"
    assert "cut off" not in log
    assert "Traceback" not in log
    # The running call was let finish and was answered, once.
    assert [e.tool for e in read_effects(effects_file)] == ["charge"]
    assert [r.outcome for r in emulator.control.tool_results(busy)] == ["accepted"]
    await wait_until_idle(emulator, [busy], within=5.0)
    # Its leases were given back and its replica row removed: nothing waits for an expiry.
    records = await store.find(watched=True)
    assert sorted(r.session_id for r in records) == sorted(session_ids)
    assert [(r.owner, r.lease_expires_at) for r in records] == [(None, None)] * 3
    assert await replica_rows(store) == []
    report = json_of(run_cli("status", "--json", database_url=database_url))
    assert report["replicas"] == []
    assert (report["watched_sessions"], report["unowned_sessions"]) == (3, 3)
    assert report["calls"] == {"submitted": 1}


@pytest.mark.parametrize(
    ("reference", "complaint"),
    [
        ("no.such:thing", "no module named 'no.such' (from 'no.such:thing')"),
        (
            "tests.support.service_tools:nothing",
            "module 'tests.support.service_tools' has no attribute 'nothing'",
        ),
        (
            "./tests/support/service_tools.py:registry",
            "names a file: use a module name, as for `python -m` (tests.support.service_tools:registry",
        ),
    ],
)
def test_serve__tools_that_cannot_be_loaded__exits_2_saying_why(
    reference: str, complaint: str, sqlite_url: str
) -> None:
    result = run_cli("serve", "--tools", reference, database_url=sqlite_url, timeout=20)

    assert result.returncode == 2, result.stderr
    assert "Invalid value for --tools" in result.stderr
    assert complaint in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


BROKEN_TOOLS = {
    "raises_at_import": ('raise RuntimeError("boom at import")\n', "registry"),
    "syntax_error": ("def f(:\n", "registry"),
    "missing_dependency": ("import a_module_nobody_installed\n", "registry"),
    "factory_raises": ('def make():\n    raise ValueError("factory failed")\n', "make"),
}


@pytest.mark.parametrize(
    ("module", "complaint"),
    [
        ("raises_at_import", "importing 'raises_at_import' raised RuntimeError: boom at import"),
        ("syntax_error", "importing 'syntax_error' failed: invalid syntax"),
        ("missing_dependency", "it needs the module 'a_module_nobody_installed', which is not installed"),
        ("factory_raises", "calling factory_raises:make() raised ValueError: factory failed"),
    ],
)
def test_serve__tools_module_that_breaks__exits_2_with_one_line_saying_what_and_where(
    module: str, complaint: str, sqlite_url: str, tmp_path: Path
) -> None:
    source, attribute = BROKEN_TOOLS[module]
    (tmp_path / f"{module}.py").write_text(source, encoding="utf-8")
    result = run_cli(
        "serve",
        "--tools",
        f"{module}:{attribute}",
        database_url=sqlite_url,
        timeout=20,
        python_path=(tmp_path,),
    )

    assert result.returncode == 2, result.stderr
    assert complaint in result.stderr
    assert f"{tmp_path / module}.py, line" in result.stderr, "where, in the application's code"
    assert "Traceback" not in result.stderr
    # Click's usage lines, then the reason on one line.
    assert [line for line in result.stderr.splitlines() if line.startswith("Error:")] == [
        result.stderr.strip().splitlines()[-1]
    ], result.stderr


# ---------------------------------------------------------------- reconcile


@pytest.mark.parametrize(
    ("backend", "with_tools"),
    [
        pytest.param("postgres", True, id="postgresql-with-tools"),
        pytest.param("sqlite", False, id="sqlite-without-tools"),
    ],
)
async def test_reconcile__result_stored_but_not_submitted_before_a_crash__resubmitted_once_not_rerun(
    backend: str,
    with_tools: bool,
    request: pytest.FixtureRequest,
    emulator: EmulatorServer,
    effects_file: Path,
    serve: StartServe,
) -> None:
    database_url: str = request.getfixturevalue(f"{backend}_url")
    engine = create_engine(database_url)
    try:
        await reconcile_after_crash(
            database_url, with_tools, SessionStore(engine), emulator, effects_file, serve
        )
    finally:
        await engine.dispose()


async def reconcile_after_crash(
    database_url: str,
    with_tools: bool,
    store: SessionStore,
    emulator: EmulatorServer,
    effects_file: Path,
    serve: StartServe,
) -> None:
    [session_id] = await start_sessions(emulator, 1, Script.of_calls([("charge", {"amount": 42})]))
    await watch(store, [session_id])
    crashing = serve(database_url, emulator.base_url, crash_at="after_result_commit")
    code = await asyncio.to_thread(crashing.wait_exit, 30.0)
    assert code == -signal.SIGKILL, crashing.log()
    assert "crash point after_result_commit reached" in crashing.log()
    ledger = LedgerStore(store.engine, actor="test")
    [stored] = await ledger.for_session(session_id)
    assert stored.status is CallStatus.SUCCEEDED
    assert emulator.control.tool_results(session_id) == []

    tools = ("--tools", TOOLS) if with_tools else ()
    result = run_cli(
        "reconcile", *tools, "--json", database_url=database_url, base_url=emulator.base_url, timeout=30
    )

    summary = json_of(result)  # stdout is the JSON summary and nothing else
    assert summary == {"sessions": 1, "stopped": 0, "errors": 0, "actions": {"resubmitted": 1}}
    assert "reconciling" in result.stderr, "the progress bar goes to stderr"
    assert "Traceback" not in result.stderr
    [received] = emulator.control.tool_results(session_id)
    assert (received.outcome, received.call_id, received.payload) == (
        "accepted",
        stored.key.call_id,
        stored.payload,
    )
    assert [e.tool for e in read_effects(effects_file)] == ["charge"], "the handler did not run again"
    [submitted] = await ledger.for_session(session_id)
    assert submitted.status is CallStatus.SUBMITTED
    await wait_until_idle(emulator, [session_id], within=5.0)

    # A second pass finds the call answered: it only confirms it, and submits nothing.
    again = json_of(
        run_cli(
            "reconcile", *tools, "--json", database_url=database_url, base_url=emulator.base_url, timeout=30
        )
    )
    assert again["actions"] == {"confirmed": 1}
    assert len(emulator.control.tool_results(session_id)) == 1


# ------------------------------------------------------------------- status


async def test_status__while_serve_runs__database_reachable_schema_current_one_replica_with_its_sessions(
    database_url: str, emulator: EmulatorServer, store: SessionStore, serve: StartServe
) -> None:
    server = serve(database_url, emulator.base_url)
    await asyncio.to_thread(server.wait_serving)
    session_ids = await start_sessions(emulator, 2, Script())
    await watch(store, session_ids)

    async def followed() -> bool:
        return None not in await owned_by(store, session_ids)

    await eventually(followed, within=5.0, what="the sessions followed")

    as_json, text = await run_all(("status", "--json"), ("status",), database_url=database_url)

    report = json_of(as_json)
    assert report["database_reachable"] is True
    assert report["schema_current"] is True
    assert report["schema_revision"] == migrate.head_revision(database_url)
    [replica] = report["replicas"]
    assert (replica["pid"], replica["sessions"]) == (server.pid, 2)
    # Recent. (It can come out a few ms below 0: `status` reads its clock before the
    # replicas table, and the replica may heartbeat in between.)
    assert (
        -0.5 < replica["heartbeat_age_seconds"] < float(FAST_ENVIRONMENT["TOOLLEDGER_SESSION_LEASE_SECONDS"])
    )
    assert (report["watched_sessions"], report["unowned_sessions"]) == (2, 0)
    assert text.returncode == 0, text.stderr
    assert "database:   reachable" in text.stdout
    assert f"{report['schema_revision']} (current)" in text.stdout
    assert f"replica:    {replica['replica_id']} (pid {server.pid} on " in text.stdout
    assert "2 session(s)" in text.stdout
    assert "sessions:   2 watched, 0 unfollowed" in text.stdout


@pytest.mark.parametrize(
    ("bad_url", "reason"),
    [
        pytest.param(
            "postgresql+psycopg://postgres:s3cret@127.0.0.1:1/nowhere",
            "OperationalError: ",
            id="postgresql-refused",
        ),
        pytest.param(
            "sqlite+aiosqlite:////nonexistent/directory/ledger.sqlite3",
            "no ledger file at /nonexistent/directory/ledger.sqlite3",
            id="sqlite-no-directory",
        ),
    ],
)
async def test_status__database_unreachable__exits_1_with_the_reason_and_no_traceback(
    bad_url: str, reason: str
) -> None:
    text, as_json = await run_all(("status",), ("status", "--json"), database_url=bad_url)

    assert text.returncode == 1
    assert "database:   UNREACHABLE" in text.stdout
    assert f"error:      {reason}" in text.stdout
    assert as_json.returncode == 1
    report = json.loads(as_json.stdout)
    assert (report["database_reachable"], report["schema_current"], report["replicas"]) == (False, False, [])
    assert report["error"].startswith(reason)
    for result in (text, as_json):
        assert "Traceback" not in result.stderr + result.stdout
        assert "s3cret" not in result.stderr + result.stdout


def test_status__missing_sqlite_file__is_reported_not_created(tmp_path: Path) -> None:
    path = tmp_path / "typo.sqlite3"
    result = run_cli("status", database_url=f"sqlite+aiosqlite:///{path}")

    assert result.returncode == 1
    assert f"no ledger file at {path}" in result.stdout
    assert not path.exists()


# ----------------------------------------------------------------- sessions


async def test_sessions__watch_unwatch_list__round_trip_in_text_and_json(database_url: str) -> None:
    watched = run_cli("sessions", "watch", "sess_a", "sess_b", "sess_a", database_url=database_url)
    unwatched = run_cli(
        "sessions", "unwatch", "sess_a", "sess_a", "--reason", "order closed", database_url=database_url
    )
    listed, everything = await run_all(
        ("sessions", "list"), ("sessions", "list", "--all", "--json"), database_url=database_url
    )

    assert watched.returncode == 0, watched.stderr
    assert watched.stdout.splitlines() == ["sess_a: watched", "sess_b: watched", "sess_a: already watched"]
    assert unwatched.returncode == 0, unwatched.stderr
    assert unwatched.stdout.splitlines() == ["sess_a: unwatched", "sess_a: was not watched"]
    assert listed.returncode == 0, listed.stderr
    header, *rows = listed.stdout.splitlines()
    assert header.split() == ["SESSION", "WATCHED", "STATUS", "OWNER", "REASON"]
    assert [row.split() for row in rows] == [["sess_b", "yes", "-", "-"]]
    assert everything.returncode == 0, everything.stderr
    records = {r["session_id"]: r for r in map(json.loads, everything.stdout.splitlines())}
    assert set(records) == {"sess_a", "sess_b"}
    assert (records["sess_a"]["watched"], records["sess_a"]["reason"]) == (False, "order closed")
    assert (records["sess_b"]["watched"], records["sess_b"]["reason"]) == (True, None)
    assert records["sess_b"]["owner"] is None


def test_sessions__database_unreachable__exits_1_with_the_reason_and_no_traceback() -> None:
    result = run_cli(
        "sessions",
        "list",
        database_url="postgresql+psycopg://postgres:s3cret@127.0.0.1:1/nowhere",
        timeout=30,
    )

    assert result.returncode == 1
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("Error: "), result.stderr
    assert "Connection refused" in result.stderr
    assert "s3cret" not in result.stderr


# ------------------------------------------------------------------- serve --api


async def test_serve_api__serves_the_audit_api_beside_the_service_and_stops_with_it(
    serve: StartServe, sqlite_url: str, emulator: EmulatorServer
) -> None:
    process = serve(
        sqlite_url,
        emulator.base_url,
        extra_args=("--api", "--api-port", "0"),
        TOOLLEDGER_API_TOKENS='{"ops": "tok-serve-api-7Q"}',
    )
    await asyncio.to_thread(process.wait_serving)
    base = await eventually(lambda: _audit_api_address(process), 20, "the audit API's address")
    async with httpx.AsyncClient(base_url=base, timeout=10) as client:
        assert (await client.get("/healthz")).status_code == 200
        assert (await client.get("/api/calls")).status_code == 401
        listed = await client.get("/api/calls", headers={"Authorization": "Bearer tok-serve-api-7Q"})
        assert listed.status_code == 200, listed.text
        assert listed.json()["calls"] == []
    process.process.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(process.process.wait, 15) == 0
    with pytest.raises(httpx.TransportError):
        async with httpx.AsyncClient(base_url=base, timeout=2) as client:
            await client.get("/healthz")
    assert "tok-serve-api-7Q" not in process.log()


def test_serve_api__non_loopback_address_without_a_token__exits_2_before_serving(sqlite_url: str) -> None:
    result = run_cli(
        "serve", "--tools", TOOLS, "--api", "--api-host", "0.0.0.0", database_url=sqlite_url, timeout=30
    )

    assert result.returncode == 2, result.stderr
    assert "token" in result.stderr.lower()
    assert "Traceback" not in result.stderr
    assert "serving:" not in result.stdout + result.stderr


async def _audit_api_address(process: ServeProcess) -> str | None:
    for line in process.log().splitlines():
        assert not line.startswith("audit API: "), "a bare line among the log lines"
        found = re.search(r"toolledger\.api\W.*audit API: (http://[^\s\"]+)", line)
        if found:
            # A log line like the others around it (JSON off a terminal, text where asked).
            return found.group(1)
    return None


def test_serve__no_agents_api_configured__exits_1_naming_the_variables(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in AGENTS_API_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    done = run_cli("serve", "--tools", TOOLS, database_url=sqlite_url, timeout=30)
    assert done.returncode == 1
    assert "no Agents API configured" in done.stderr
    assert "TOOLLEDGER_OPENAI_API_KEY" in done.stderr
    assert "OPENAI_BASE_URL" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout


AGENTS_API_VARIABLES = (
    "TOOLLEDGER_OPENAI_API_KEY",
    "TOOLLEDGER_OPENAI_BASE_URL",
    "OPENAI_API_KEY",
    "OPENAI_BASE_URL",
)


async def test_serve__the_sdks_own_variables__honoured_when_toolledgers_are_unset_and_named_in_the_log(
    sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As every openai-based tool: OPENAI_API_KEY and OPENAI_BASE_URL, when toolledger's own
    variables are unset. The key is the emulator's: a wrong one would stop serve at start."""
    for name in AGENTS_API_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    with (
        EmulatorServer(api_key="sk-sdk-variable-canary") as keyed,
        ServeProcess(
            sqlite_url,
            keyed.base_url,
            tmp_path / "serve.log",
            base_url_variable="OPENAI_BASE_URL",
            OPENAI_API_KEY="sk-sdk-variable-canary",
        ) as serving,
    ):
        await asyncio.to_thread(serving.wait_serving)
    log = serving.log()
    assert f"Agents API at {keyed.base_url} (base URL: OPENAI_BASE_URL), a key (OPENAI_API_KEY)" in log
    assert "sk-sdk-variable-canary" not in log, "the key is never echoed"


def test_settings__toolledgers_variable_wins_over_the_sdks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOOLLEDGER_OPENAI_BASE_URL", "http://mine/v1")
    monkeypatch.setenv("OPENAI_BASE_URL", "http://sdk/v1")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-sdk")
    monkeypatch.delenv("TOOLLEDGER_OPENAI_API_KEY", raising=False)
    settings = Settings()
    assert settings.openai_base_url == "http://mine/v1"
    assert settings.openai_api_key is not None
    assert settings.openai_api_key.get_secret_value() == "sk-sdk"
    assert settings.agents_api_sources() == (
        "Agents API at http://mine/v1 (base URL: TOOLLEDGER_OPENAI_BASE_URL), a key (OPENAI_API_KEY)"
    )
    assert Settings(openai_base_url="http://code/v1").openai_base_url == "http://code/v1"


def test_serve__missing_sqlite_file__refused_saying_migrate_and_none_created(tmp_path: Path) -> None:
    path = tmp_path / "typo.sqlite3"
    done = run_cli(
        "serve",
        "--tools",
        TOOLS,
        database_url=f"sqlite+aiosqlite:///{path}",
        base_url="http://127.0.0.1:1/v1",
    )
    assert done.returncode == 1
    assert f"no ledger file at {path}: run `toolledger migrate` first" in done.stderr
    assert "Traceback" not in done.stderr
    assert not path.exists()


async def test_serve__credentials_refused__exits_1_at_start_with_the_reason_not_retrying(
    sqlite_url: str, tmp_path: Path
) -> None:
    with EmulatorServer(api_key="the-right-key") as keyed:
        started = time.monotonic()
        with ServeProcess(
            sqlite_url, keyed.base_url, tmp_path / "serve.log", TOOLLEDGER_OPENAI_API_KEY="sk-wrong"
        ) as refused:
            code = await asyncio.to_thread(refused.wait_exit, 30.0)
        took = time.monotonic() - started
    log = refused.log()
    assert code == 1, log
    assert "refused the credentials (HTTP 401" in log, log
    assert "sk-wrong" not in log, "the key is never echoed"
    assert "Traceback" not in log
    assert took < 15.0, f"took {took:.1f}s to give up"


async def test_sessions_watch__checks_each_session_with_the_agents_api(
    database_url: str, emulator: EmulatorServer
) -> None:
    (real,) = await start_sessions(emulator, 1, Script())
    done = run_cli(
        "sessions", "watch", real, "sess_fake", database_url=database_url, base_url=emulator.base_url
    )
    listed = run_cli("sessions", "list", "--json", database_url=database_url)

    assert done.returncode == 1, done.stderr
    assert done.stdout.splitlines() == [f"{real}: watched"]
    assert "sess_fake: no such session in the Agents API; not watched" in done.stderr
    assert [json.loads(line)["session_id"] for line in listed.stdout.splitlines()] == [real]


def test_sessions_watch__no_ledger_file_here__refused_and_none_created(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    url = f"sqlite+aiosqlite:///{elsewhere / 'toolledger.sqlite3'}"
    done = run_cli("sessions", "watch", "sess_1", database_url=url)

    assert done.returncode == 1
    assert f"no ledger file at {elsewhere / 'toolledger.sqlite3'}" in done.stderr
    assert "Traceback" not in done.stderr
    assert list(elsewhere.iterdir()) == [], "no new, empty ledger made"


async def test_reconcile__beside_a_running_sqlite_serve__runs(
    sqlite_url: str, emulator: EmulatorServer, serve: StartServe, effects_file: Path
) -> None:
    """Only `serve` is one per SQLite file: a reconcile pass decides nothing the ledger does not."""
    running = serve(sqlite_url, emulator.base_url)
    await asyncio.to_thread(running.wait_serving)
    done = run_cli("reconcile", "--tools", TOOLS, database_url=sqlite_url, base_url=emulator.base_url)

    assert done.returncode == 0, done.stderr
    assert "already served" not in done.stderr
    assert done.stdout.startswith("reconciled ")


async def test_status__lists_unknown_calls_with_the_resolve_command_and_results_on_their_way(
    database_url: str,
) -> None:
    from toolledger.domain.keys import CallKey
    from toolledger.domain.results import succeeded
    from toolledger.domain.states import EffectClass

    engine = create_engine(database_url)
    try:
        ledger = LedgerStore(engine, actor="test")
        unknown, stored = CallKey("sess_s", "turn_1", "call_u"), CallKey("sess_s", "turn_1", "call_s")
        for key, lease in ((unknown, 0.01), (stored, 30.0)):
            recorded = await ledger.record(
                key,
                tool_name="charge",
                arguments={},
                effect_class=EffectClass.AT_MOST_ONCE,
                lease_seconds=lease,
            )
            assert recorded.claimed
        await asyncio.sleep(0.05)
        assert [c.key for c in await ledger.expire_leases()] == [unknown]
        await ledger.complete(stored, 1, succeeded(stored, "done"))
    finally:
        await engine.dispose()

    as_json, text = await run_all(("status", "--json"), ("status",), database_url=database_url)

    report = json_of(as_json)
    assert [(c["key"], c["status"]) for c in report["unknown_calls"]] == [(str(unknown), "unknown")]
    assert [(c["key"], c["status"]) for c in report["awaiting_calls"]] == [(str(stored), "succeeded")]
    assert f"unknown:    {unknown} (charge, at_most_once)" in text.stdout
    assert f"toolledger calls resolve {unknown} --output TEXT" in text.stdout
    assert f"awaiting:   {stored} (charge) succeeded" in text.stdout
