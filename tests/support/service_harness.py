"""A `Service` in the test's own process, on short leases and timers so that takeovers and
reconciles happen within a test's seconds."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from tests.support.service_tools import registry
from toolledger.emulator import EmulatorServer
from toolledger.runtime.service import Service
from toolledger.settings import Settings

FAST: dict[str, Any] = {
    "lease_seconds": 1.0,
    "session_lease_seconds": 2.0,
    "reconcile_interval_seconds": 1.0,
    "stream_backoff_max_seconds": 0.3,
    "shutdown_grace_seconds": 2.0,
}


def service_settings(database_url: str, emulator: EmulatorServer, **overrides: Any) -> Settings:
    return Settings(
        database_url=database_url,
        openai_base_url=emulator.base_url,
        worker_id="service-test",
        **{**FAST, **overrides},
    )


@asynccontextmanager
async def running_service(
    database_url: str, emulator: EmulatorServer, **overrides: Any
) -> AsyncIterator[Service]:
    async with Service(
        registry, service_settings(database_url, emulator, **overrides), auto_migrate=False
    ) as service:
        yield service
