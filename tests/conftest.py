from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
from openai import AsyncOpenAI, OpenAI

from tests.support.calls_cli import Ledger
from tests.support.databases import NewDatabase, PostgresTemplate, require_postgres, server_url
from tests.support.ledger_fill import FilledLedger, fill_ledger
from toolledger.emulator import EmulatorServer
from toolledger.store import migrate

# Subprocesses' logs are read as text by the tests that grep them; the JSON lines a log
# shipper gets (the default off a terminal) have their own tests (tests/runtime/test_logs.py).
os.environ.setdefault("TOOLLEDGER_LOG_FORMAT", "text")


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: two workers per CPU. A worker spends much of a test waiting on the
    processes it started, leases and sockets: on 2 CPUs, 4 workers kept both busy and ran
    the suite in 622 s against 722 s with 2 (measured 2026-12-07)."""
    return 2 * (os.cpu_count() or 1)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--trials", type=int, default=50, help="Trials of the chaos run (-m chaos).")
    parser.addoption("--chaos-report", default=None, help="Write the chaos run's figures to this JSON file.")


@pytest.fixture(scope="session")
def emulator_server() -> Iterator[EmulatorServer]:
    with EmulatorServer() as server:
        yield server


@pytest.fixture
def emulator(emulator_server: EmulatorServer) -> Iterator[EmulatorServer]:
    """A running emulator with no sessions, scripts or faults left from another test."""
    emulator_server.control.reset()
    yield emulator_server
    emulator_server.control.reset()


@pytest.fixture
def client(emulator: EmulatorServer) -> Iterator[OpenAI]:
    """The real SDK, validating every response strictly, retrying nothing unless asked."""
    with OpenAI(
        base_url=emulator.base_url, api_key="sk-test", max_retries=0, _strict_response_validation=True
    ) as sdk:
        yield sdk


@pytest.fixture
async def async_client(emulator: EmulatorServer) -> AsyncIterator[AsyncOpenAI]:
    async with AsyncOpenAI(
        base_url=emulator.base_url, api_key="sk-test", max_retries=0, _strict_response_validation=True
    ) as sdk:
        yield sdk


@pytest.fixture(scope="session")
def postgres_template() -> Iterator[PostgresTemplate]:
    url = server_url()
    require_postgres(url)
    template = PostgresTemplate(url)
    template.create()
    yield template
    template.drop()


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """A migrated SQLite ledger file."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'ledger.sqlite3'}"
    migrate.upgrade(url)
    return url


@pytest.fixture
def postgres_url(postgres_template: PostgresTemplate) -> Iterator[str]:
    """A migrated PostgreSQL database of this test's own."""
    with postgres_template.clone() as url:
        yield url


@pytest.fixture(params=["sqlite", "postgresql"])
def new_database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[NewDatabase]:
    """Makes empty databases (no tables at all) of this test's own; PostgreSQL ones are dropped after."""
    with ExitStack() as stack:
        if request.param == "sqlite":
            numbers = itertools.count()

            def make() -> str:
                return f"sqlite+aiosqlite:///{tmp_path / f'ledger_{next(numbers)}.sqlite3'}"

        else:
            template: PostgresTemplate = request.getfixturevalue("postgres_template")

            def make() -> str:
                return stack.enter_context(template.clone(migrated=False))

        yield make


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest) -> str:
    """Each test using it runs on a real SQLite file and on a real PostgreSQL database."""
    fixture = "sqlite_url" if request.param == "sqlite" else "postgres_url"
    url: str = request.getfixturevalue(fixture)
    return url


@pytest.fixture
def effects_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where the service tests' tools record their side effects (inherited by `serve`
    subprocesses)."""
    path = tmp_path / "effects.log"
    monkeypatch.setenv("SERVICE_EFFECTS_FILE", str(path))
    return path


# ------------------------------------------------- a ledger filled by real executions


@pytest.fixture
async def filled_ledger(database_url: str, emulator: EmulatorServer, tmp_path: Path) -> FilledLedger:
    """A ledger of real executions on SQLite and on PostgreSQL (see ledger_fill)."""
    return await fill_ledger(database_url, emulator, tmp_path)


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def shared_ledger(
    request: pytest.FixtureRequest, emulator_server: EmulatorServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FilledLedger]:
    """One filled ledger per database for a whole test module (its tests only read it)."""
    workdir = tmp_path_factory.mktemp(f"filled-{request.param}")
    if request.param == "sqlite":
        url = f"sqlite+aiosqlite:///{workdir / 'ledger.sqlite3'}"
        migrate.upgrade(url)
        yield asyncio.run(fill_ledger(url, emulator_server, workdir))
        return
    template: PostgresTemplate = request.getfixturevalue("postgres_template")
    with template.clone() as url:
        yield asyncio.run(fill_ledger(url, emulator_server, workdir))


@pytest.fixture
def ledger(shared_ledger: FilledLedger, emulator_server: EmulatorServer) -> Ledger:
    """The module's filled ledger as the calls CLI and the operator views read it."""
    # emulator_server, not the `emulator` fixture: its reset would forget the session that
    # still awaits the unknown call.
    return Ledger(shared_ledger, emulator_server, shared_ledger.database_url)
