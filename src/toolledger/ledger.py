"""``ToolLedger``: the parts put together, for applications and for the service.

async with ToolLedger(registry, Settings()) as ledger:
    report = await ledger.handle(session_id, required_action)
    await ledger.recover()
"""

from __future__ import annotations

import asyncio
import os
import socket
import uuid
from types import TracebackType
from typing import Any

from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from toolledger.errors import SchemaNotCurrentError
from toolledger.gateway.agents import AgentsGateway
from toolledger.runtime.executor import Executor, HandleReport, RecoveryReport
from toolledger.runtime.registry import ToolRegistry
from toolledger.settings import Settings
from toolledger.store import migrate
from toolledger.store.engine import create_engine
from toolledger.store.exclusive import SQLiteServiceLock
from toolledger.store.ledger import LedgerStore
from toolledger.store.liveness import Liveness, liveness_for


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
    ) -> None:
        self.registry = registry
        self.run_handlers = run_handlers
        self.settings = settings or Settings()
        self.worker_id = self.settings.worker_id or default_worker_id()
        # Unique per process even when replicas share a configured worker id: leases name
        # processes, so that one known to be gone can have its leases taken (store.liveness).
        self.instance_id = f"{self.worker_id}/{uuid.uuid4().hex[:8]}"
        self.serve_lock = SQLiteServiceLock(self.settings.database_url)
        self._liveness: Liveness | None = None
        self._engine = engine
        self._own_engine = engine is None
        self._gateway = gateway
        self._own_gateway = gateway is None
        backend = make_url(self.settings.database_url).get_backend_name()
        self._auto_migrate = auto_migrate if auto_migrate is not None else backend == "sqlite"
        self._executor: Executor | None = None
        self.redactor = self.settings.redactor()

    async def start(self) -> ToolLedger:
        url = self.settings.database_url
        if self._auto_migrate:
            await asyncio.to_thread(migrate.upgrade, url)
        elif not await asyncio.to_thread(migrate.is_current, url):
            raise SchemaNotCurrentError(
                "the ledger database is not at the current schema revision: run `toolledger migrate`"
            )
        if self._engine is None:
            options = (
                {}
                if self.engine_is_sqlite
                else {
                    "pool_size": self.settings.database_pool_size,
                    "max_overflow": self.settings.database_max_overflow,
                }
            )
            self._engine = create_engine(url, **options)
        if self._gateway is None:
            key = self.settings.openai_api_key
            self._gateway = AgentsGateway.connect(
                api_key=key.get_secret_value() if key else None,
                base_url=self.settings.openai_base_url,
                attempts=self.settings.submit_attempts,
            )
        store = LedgerStore(
            self._engine, actor=self.worker_id, owner=self.instance_id, redactor=self.redactor
        )
        self._liveness = liveness_for(self._engine, self.instance_id, self.serve_lock)
        self._executor = Executor(
            self.registry,
            store,
            self._gateway,
            self.settings,
            run_handlers=self.run_handlers,
            liveness=self._liveness,
        )
        return self

    async def close(self) -> None:
        if self._gateway is not None and self._own_gateway:
            await self._gateway.close()
        if self._engine is not None and self._own_engine:
            await self._engine.dispose()

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
        if self._engine is None:
            raise RuntimeError("ToolLedger is not started: use `async with ToolLedger(...)`")
        return self._engine

    @property
    def gateway(self) -> AgentsGateway:
        if self._gateway is None:
            raise RuntimeError("ToolLedger is not started: use `async with ToolLedger(...)`")
        return self._gateway

    @property
    def engine_is_sqlite(self) -> bool:
        return make_url(self.settings.database_url).get_backend_name() == "sqlite"

    @property
    def store(self) -> LedgerStore:
        return self.executor.store

    async def handle(self, session_id: str, required_action: Any) -> HandleReport:
        """Run (or recover) one ``function_call`` entry of ``session.required_actions``."""
        return await self.executor.handle(session_id, required_action)

    async def recover(self) -> RecoveryReport:
        """Settle what crashes left: expired leases, unknown outcomes, unsubmitted results."""
        return await self.executor.recover()
