from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.audit.ledger_fill import FilledLedger, fill_ledger
from tests.databases import PostgresTemplate
from toolledger.emulator import EmulatorServer
from toolledger.store import migrate


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
