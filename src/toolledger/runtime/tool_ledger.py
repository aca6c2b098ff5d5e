"""``ToolLedger``: the parts put together, for applications and for the service (its
engine, gateway and stores come from a ``composition.Runtime``).

async with ToolLedger(registry, Settings()) as ledger:
    report = await ledger.handle(session_id, required_action)
    await ledger.recover()
"""

from __future__ import annotations

import os
import socket
import uuid
from types import TracebackType
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from toolledger.gateway.agents import AgentsGateway
from toolledger.runtime.composition import Runtime
from toolledger.runtime.executor import Executor, HandleReport, RecoveryReport
from toolledger.runtime.registry import ToolRegistry
from toolledger.settings import Settings
from toolledger.store.exclusive import SQLiteServiceLock
from toolledger.store.ledger import LedgerStore
from toolledger.store.liveness import Liveness


def default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class ToolLedger:
    """Durable, idempotent execution of a registry's tools for Agents API sessions.

    ``auto_migrate`` (default: on for SQLite, off for PostgreSQL, where ``toolledger migrate``
    runs once per release) brings the schema to the current revision at start.
    """

    def __init__(
        self,
        registry: ToolRegistry,
        settings: Settings | None = None,
        *,
        gateway: AgentsGateway | None = None,
        engine: AsyncEngine | None = None,
        auto_migrate: bool | None = None,
        run_handlers: bool = True,
        runtime: Runtime | None = None,
    ) -> None:
        self.registry = registry
        self.run_handlers = run_handlers
        if runtime is not None and (engine is not None or gateway is not None):
            raise ValueError("give a runtime, or an engine and a gateway to build one with, not both")
        self.settings = settings or (runtime.settings if runtime is not None else Settings())
        # The engine, gateway and redactor: from the caller's runtime (left open by close()),
        # or from one built here (closed by close(); what was passed in to it stays open).
        self._own_runtime = runtime is None
        self.runtime = runtime or Runtime.from_settings(self.settings, engine=engine, gateway=gateway)
        self.worker_id = self.settings.worker_id or default_worker_id()
        # Unique per process even when replicas share a configured worker id: leases name
        # processes, so that one known to be gone can have its leases taken (store.liveness).
        self.instance_id = f"{self.worker_id}/{uuid.uuid4().hex[:8]}"
        self.serve_lock = SQLiteServiceLock(self.settings.database_url)
        self._liveness: Liveness | None = None
        self._auto_migrate = auto_migrate
        self._executor: Executor | None = None
        self.redactor = self.runtime.redactor

    async def start(self) -> ToolLedger:
        await self.runtime.ensure_schema(migrate=self._auto_migrate)
        store = self.runtime.ledger_store(actor=self.worker_id, owner=self.instance_id)
        self._liveness = self.runtime.liveness(self.instance_id, self.serve_lock)
        self._executor = Executor(
            self.registry,
            store,
            self.runtime.gateway(),
            self.settings,
            run_handlers=self.run_handlers,
            liveness=self._liveness,
            threads=self.runtime.handler_threads(),
        )
        return self

    async def close(self) -> None:
        if self._own_runtime:
            await self.runtime.aclose()

    async def __aenter__(self) -> ToolLedger:
        return await self.start()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    @property
    def executor(self) -> Executor:
        if self._executor is None:
            raise RuntimeError("ToolLedger is not started: use `async with ToolLedger(...)`")
        return self._executor

    @property
    def liveness(self) -> Liveness:
        if self._liveness is None:
            raise RuntimeError("ToolLedger is not started: use `async with ToolLedger(...)`")
        return self._liveness

    @property
    def engine(self) -> AsyncEngine:
        if self._executor is None:
            raise RuntimeError("ToolLedger is not started: use `async with ToolLedger(...)`")
        return self.runtime.engine

    @property
    def gateway(self) -> AgentsGateway:
        if self._executor is None:
            raise RuntimeError("ToolLedger is not started: use `async with ToolLedger(...)`")
        return self.runtime.gateway()

    @property
    def engine_is_sqlite(self) -> bool:
        return self.runtime.is_sqlite

    @property
    def store(self) -> LedgerStore:
        return self.executor.store

    async def handle(self, session_id: str, required_action: Any) -> HandleReport:
        """Run (or recover) one ``function_call`` entry of ``session.required_actions``."""
        return await self.executor.handle(session_id, required_action)

    async def recover(self) -> RecoveryReport:
        """Recover what crashes left: expired leases, unknown outcomes, unsubmitted results."""
        return await self.executor.recover()
