"""What the ledger tests share."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from toolledger.store.engine import create_engine


@pytest.fixture
async def engine(database_url: str) -> AsyncIterator[AsyncEngine]:
    """An engine on this test's ledger (each test runs on SQLite and on PostgreSQL)."""
    engine = create_engine(database_url)
    try:
        yield engine
    finally:
        await engine.dispose()
