from __future__ import annotations

from pathlib import Path

import pytest

from tests.audit.ledger_fill import FilledLedger, fill_ledger
from toolledger.emulator import EmulatorServer


@pytest.fixture
async def filled_ledger(database_url: str, emulator: EmulatorServer, tmp_path: Path) -> FilledLedger:
    """A ledger of real executions on SQLite and on PostgreSQL (see ledger_fill)."""
    return await fill_ledger(database_url, emulator, tmp_path)
