from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from openai import AsyncOpenAI, OpenAI

from tests.databases import PostgresTemplate, require_postgres, server_url
from toolledger.emulator import EmulatorServer
from toolledger.store import migrate

# Subprocesses' logs are read as text by the tests that grep them; the JSON lines a log
# shipper gets (the default off a terminal) have their own tests (tests/service/test_logs.py).
os.environ.setdefault("TOOLLEDGER_LOG_FORMAT", "text")


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
