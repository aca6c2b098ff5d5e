"""Which `serve` replicas are provably gone, so their leases can be taken without waiting
for them to run out.

A lease's expiry is the slow, always-true proof that its owner stopped: a worker that was
merely paused loses the lease too, and its token fences it when it wakes. A replica that
died can be known dead much sooner, by a lock the operating system or the database server
drops with the process. What "provably" means per database:

- PostgreSQL: each replica holds a session-level advisory lock, keyed by its replica id, on
  a connection of its own, taken before it registers in ``replicas`` and so before it claims
  anything. The server drops the lock when that connection ends: the process exited (even
  by SIGKILL: the kernel closes its socket) or its connection was cut. A registered replica
  whose lock can be taken (a shared, transaction-scoped try in an autocommit statement,
  released as it ends) is gone. A paused replica keeps its connection, so it is not gone.
  A server restart drops every replica's connection at once: for ``RESTART_GRACE_SECONDS``
  after the server (re)started nobody is called gone, while the live ones take their locks
  again (each within a second). A connection cut while the process and the server live (a
  network cut of one replica) still reads as gone: its calls are then handled exactly as at
  lease expiry (fenced by token, ``at_most_once`` calls become ``unknown``, never re-run),
  only sooner.
- SQLite: one `serve` per file holds an exclusive ``flock`` on ``<database>.serve.lock``,
  which the kernel drops when the process dies. A process holding that lock knows every
  other registered replica is gone; a process without it proves nothing.

Calls claimed by processes that never register (``toolledger reconcile --tools``, an
application's own ``ToolLedger``) are taken over at lease expiry only.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from contextlib import suppress

from sqlalchemy import bindparam, func, select, text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.pool import NullPool

from toolledger.store.exclusive import SQLiteServiceLock
from toolledger.store.schema import replicas

log = logging.getLogger("toolledger.liveness")

RESTART_GRACE_SECONDS = 10.0
"""After a PostgreSQL (re)start, how long every free lock is taken for a connection still
being re-made, not for a death."""
LOCK_CLASS = 0x746C6C76
"""The first key of toolledger's advisory locks ("tllv"): apps' own advisory locks on the
same database use other keys."""


class Liveness:
    """Holds this process's liveness lock and tells which registered replicas are gone."""

    def __init__(self, engine: AsyncEngine, holder: str) -> None:
        self.engine = engine
        self.holder = holder

    async def hold(self) -> None:
        """Take this process's lock: before it registers as a replica or claims anything."""

    async def ensure_held(self) -> None:
        """Take the lock again if it was lost (a connection cut); called on a timer."""

    async def release(self) -> None:
        """Give the lock back (a stopping service, after its calls are drained)."""

    async def gone(self, owners: Collection[str]) -> frozenset[str]:
        """Those of ``owners`` that are registered replicas provably no longer running."""
        return frozenset()


class PostgresLiveness(Liveness):
    def __init__(self, engine: AsyncEngine, holder: str) -> None:
        super().__init__(engine, holder)
        self._lock_engine: AsyncEngine | None = None
        self._connection: AsyncConnection | None = None
        self._wanted = False

    async def hold(self) -> None:
        self._wanted = True
        if self._connection is not None:
            return
        if self._lock_engine is None:
            # Its own connection, outside the pool: a pooled one would be recycled or
            # invalidated with the pool, and the lock would go with it.
            self._lock_engine = create_async_engine(
                self.engine.url, poolclass=NullPool, hide_parameters=True
            ).execution_options(isolation_level="AUTOCOMMIT")
        connection = await self._lock_engine.connect()
        try:
            taken = (
                await connection.execute(
                    select(func.pg_try_advisory_lock(LOCK_CLASS, func.hashtext(bindparam("holder")))),
                    {"holder": self.holder},
                )
            ).scalar_one()
        except BaseException:
            await connection.close()
            raise
        if not taken:
            await connection.close()
            # Two live replica ids hashing alike: vanishingly rare, and never silently shared.
            raise RuntimeError(f"the liveness lock of {self.holder} is held by another process")
        self._connection = connection

    async def ensure_held(self) -> None:
        if not self._wanted:
            return
        connection = self._connection
        if connection is not None:
            try:
                await connection.execute(text("SELECT 1"))
                return
            except Exception:
                log.warning("liveness lock of %s lost with its connection; taking it again", self.holder)
            self._connection = None
            with suppress(Exception):  # broken already: nothing to give back
                await connection.close()
        # Raises while the database is away; the caller's timer tries again.
        await self.hold()

    async def release(self) -> None:
        self._wanted = False
        connection, self._connection = self._connection, None
        try:
            if connection is not None:
                await connection.close()
        finally:
            if self._lock_engine is not None:
                await self._lock_engine.dispose()
                self._lock_engine = None

    async def gone(self, owners: Collection[str]) -> frozenset[str]:
        candidates = sorted(set(owners) - {self.holder})
        if not candidates:
            return frozenset()
        # The try-lock is shared and transaction-scoped: two checkers never block each other,
        # and the lock is given back as this autocommit statement ends.
        server_up = func.extract("epoch", func.clock_timestamp() - func.pg_postmaster_start_time())
        query = select(replicas.c.replica_id).where(
            replicas.c.replica_id.in_(candidates),
            server_up > RESTART_GRACE_SECONDS,
            func.pg_try_advisory_xact_lock_shared(LOCK_CLASS, func.hashtext(replicas.c.replica_id)),
        )
        async with self.engine.execution_options(isolation_level="AUTOCOMMIT").connect() as conn:
            return frozenset((await conn.execute(query)).scalars())


class SqliteLiveness(Liveness):
    def __init__(self, engine: AsyncEngine, holder: str, serve_lock: SQLiteServiceLock) -> None:
        super().__init__(engine, holder)
        self.serve_lock = serve_lock

    async def gone(self, owners: Collection[str]) -> frozenset[str]:
        candidates = sorted(set(owners) - {self.holder})
        if not candidates or not self.serve_lock.held:
            return frozenset()
        async with self.engine.connect() as conn:
            registered = await conn.execute(
                select(replicas.c.replica_id).where(replicas.c.replica_id.in_(candidates))
            )
            return frozenset(registered.scalars())


def liveness_for(engine: AsyncEngine, holder: str, serve_lock: SQLiteServiceLock) -> Liveness:
    if engine.dialect.name == "postgresql":
        return PostgresLiveness(engine, holder)
    if engine.dialect.name == "sqlite":
        return SqliteLiveness(engine, holder, serve_lock)
    return Liveness(engine, holder)


__all__ = ["Liveness", "PostgresLiveness", "SqliteLiveness", "liveness_for"]
