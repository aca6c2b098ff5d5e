"""The composition root: the one place that builds what a process runs on from its settings.

    async with Runtime.from_settings(settings) as runtime:
        store = runtime.ledger_store(actor="me")
        gateway = runtime.gateway()            # the Agents API, built (and openai imported) now

``ToolLedger`` and ``Service`` (the runtime), ``AuditService`` and the HTTP API (audit), and
every ``toolledger`` command get their database engine, Agents API gateway, redactor and
stores here, and nowhere else. Nothing is built before it is asked for: a command that only
reads the ledger never imports the openai SDK, and one that never touches the database opens
no connection. What the caller passed in (an engine, a gateway shared with others) is used
as it is and left open by ``aclose``; what the runtime built, it closes.
"""

from __future__ import annotations

import asyncio
import logging
from functools import cached_property
from types import TracebackType
from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import make_url

from toolledger.domain.trail import TrailKey
from toolledger.errors import SchemaNotCurrentError
from toolledger.settings import Settings
from toolledger.store.alerts import AlertStore
from toolledger.store.audit import AuditStore
from toolledger.store.engine import create_engine, missing_sqlite_file
from toolledger.store.intake import IntakeStore
from toolledger.store.ledger import LedgerStore
from toolledger.store.liveness import Liveness, liveness_for
from toolledger.store.operator_views import OperatorViews
from toolledger.store.sessions import SessionStore

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

    # The SDK comes with the gateway: imported when a gateway is built, not with this module.
    from toolledger.gateway.agents import AgentsGateway
    from toolledger.runtime.handler_threads import HandlerThreads
    from toolledger.store.exclusive import SQLiteServiceLock

log = logging.getLogger("toolledger.runtime")


class Runtime:
    """A process's engine, Agents API gateway, redactor and stores, built from its settings."""

    def __init__(
        self,
        settings: Settings,
        *,
        engine: AsyncEngine | None = None,
        gateway: AgentsGateway | None = None,
    ) -> None:
        self.settings = settings
        self.redactor = settings.redactor()
        self._engine = engine
        self._own_engine = engine is None
        self._gateway = gateway
        self._own_gateway = gateway is None
        self._handler_threads: HandlerThreads | None = None

    @classmethod
    def from_settings(
        cls,
        settings: Settings | None = None,
        *,
        engine: AsyncEngine | None = None,
        gateway: AgentsGateway | None = None,
    ) -> Runtime:
        """The runtime of ``settings`` (default: from the environment); ``engine`` and
        ``gateway``, when given, are used instead of building them (and are not closed)."""
        return cls(settings or Settings(), engine=engine, gateway=gateway)

    # ------------------------------------------------------------------ database

    @property
    def is_sqlite(self) -> bool:
        return make_url(self.settings.database_url).get_backend_name() == "sqlite"

    @property
    def engine(self) -> AsyncEngine:
        """The ledger database's engine, created on first use (no connection until a query)."""
        if self._engine is None:
            self._engine = create_engine(self.settings.database_url, **self._pool_options())
        return self._engine

    def _pool_options(self) -> dict[str, Any]:
        if self.is_sqlite:
            return {}
        return {
            "pool_size": self.settings.database_pool_size,
            "max_overflow": self.settings.database_max_overflow,
        }

    async def ensure_schema(self, *, migrate: bool | None = None) -> None:
        """Bring the schema to the current revision (``migrate``; default: on SQLite only), or
        refuse (SchemaNotCurrentError) a database that is not at it (PostgreSQL, where
        ``toolledger migrate`` runs once per release)."""
        from toolledger.store import migrate as migrations

        url = self.settings.database_url
        if self.is_sqlite if migrate is None else migrate:
            new_file = missing_sqlite_file(url)
            if new_file is None and await asyncio.to_thread(migrations.is_current, url):
                return  # the common case, answered without loading Alembic
            await asyncio.to_thread(migrations.upgrade, url)
            if new_file is not None:
                # Said, so that a mistyped path is seen for the new, empty ledger it made.
                log.info("created a new SQLite ledger at %s", new_file)
        elif not await asyncio.to_thread(migrations.is_current, url):
            raise SchemaNotCurrentError(
                "the ledger database is not at the current schema revision: run `toolledger migrate`"
            )

    # --------------------------------------------------------------- Agents API

    @property
    def agents_api_configured(self) -> bool:
        """A gateway was given, or the settings name an Agents API (a key or a base URL)."""
        return self._gateway is not None or self.settings.agents_api_configured

    def gateway(self) -> AgentsGateway:
        """The Agents API gateway, built on first use from the settings' key, base URL and
        submission attempts (the SDK's defaults fill what they leave unset)."""
        if self._gateway is None:
            from toolledger.gateway.agents import AgentsGateway

            key = self.settings.openai_api_key
            self._gateway = AgentsGateway.connect(
                api_key=(key.get_secret_value() if key is not None else "") or None,
                base_url=self.settings.openai_base_url or None,
                attempts=self.settings.submit_attempts,
            )
        return self._gateway

    def configured_gateway(self) -> AgentsGateway | None:
        """The gateway only when an Agents API is configured (``agents_api_configured``):
        the SDK's defaults (its public address, a placeholder key) must not become a
        destination nobody chose. None otherwise."""
        return self.gateway() if self.agents_api_configured else None

    # ----------------------------------------------------------------- handlers

    def handler_threads(self) -> HandlerThreads:
        """The threads sync handlers run in (``handler_threads`` of them at once), built on first
        use and shared by every executor of this runtime: apart from the event loop's default
        executor, where asyncio resolves host names for the SDK's connections."""
        if self._handler_threads is None:
            from toolledger.runtime.handler_threads import HandlerThreads

            self._handler_threads = HandlerThreads(self.settings.handler_threads)
        return self._handler_threads

    # ------------------------------------------------------------------- stores

    def ledger_store(self, actor: str, *, owner: str | None = None) -> LedgerStore:
        """The ledger's transitions, recorded as done by ``actor`` (leases held by ``owner``)."""
        return LedgerStore(
            self.engine,
            actor=actor,
            owner=owner,
            redactor=self.redactor,
            batching=self.settings.batching,
            trail_key=self.trail_key,
        )

    @cached_property
    def trail_key(self) -> TrailKey | None:
        """The audit trail's key (``TOOLLEDGER_TRAIL_KEY``): every event this runtime's stores
        write carries its keyed MAC. None when unset."""
        return self.settings.trail_key_value

    def session_store(self) -> SessionStore:
        return SessionStore(self.engine)

    def intake_store(self) -> IntakeStore:
        return IntakeStore(self.engine)

    def audit_store(self) -> AuditStore:
        return AuditStore(self.engine)

    def alert_store(self, destination: str, *, actor: str) -> AlertStore:
        """The cursor of one alert destination, and the notes of its alerts (by ``actor``)."""
        return AlertStore(
            self.engine,
            destination=destination,
            actor=actor,
            redactor=self.redactor,
            trail_key=self.trail_key,
        )

    def operator_views(self) -> OperatorViews:
        return OperatorViews(self.engine)

    def liveness(self, owner: str, lock: SQLiteServiceLock) -> Liveness:
        """How this process (``owner``) shows it is alive, and tells whether others are."""
        return liveness_for(self.engine, owner, lock)

    # --------------------------------------------------------------------- life

    async def aclose(self) -> None:
        """Close what this runtime built; what it was given stays open."""
        if self._gateway is not None and self._own_gateway:
            await self._gateway.close()
        if self._engine is not None and self._own_engine:
            await self._engine.dispose()

    async def __aenter__(self) -> Runtime:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


__all__ = ["Runtime"]
