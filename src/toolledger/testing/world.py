"""The outside world of one conformance-check run: what the tool's side effects did, and what
its verify hook answered, kept where a SIGKILL cannot undo it.

A small SQLite file per run (the standard library's driver: the check's worker processes
write it, the check itself reads it between them). Each write commits before the tool
carries on, so an effect reported just before the process is killed is still there.
"""

from __future__ import annotations

import os
import sqlite3
from collections import Counter
from contextlib import closing
from pathlib import Path

_SCHEMA = (
    # key: what the tool gave the downstream system to dedupe on; NULL never conflicts, so
    # an effect reported without one always counts.
    "CREATE TABLE IF NOT EXISTS effects (seq INTEGER PRIMARY KEY, name TEXT NOT NULL, key TEXT,"
    " idempotency_key TEXT, attempt INTEGER, pid INTEGER NOT NULL, UNIQUE (name, key))",
    "CREATE TABLE IF NOT EXISTS answers (seq INTEGER PRIMARY KEY, tool TEXT NOT NULL,"
    " idempotency_key TEXT, answer TEXT NOT NULL, pid INTEGER NOT NULL)",
)


class World:
    """One run's record of side effects and verify-hook answers (``path``: its file)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _connect(self) -> sqlite3.Connection:
        connection = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        connection.execute("PRAGMA synchronous=FULL")
        return connection

    def create(self) -> World:
        with closing(self._connect()) as connection:
            for statement in _SCHEMA:
                connection.execute(statement)
        return self

    def record_effect(
        self, name: str, *, key: str | None, idempotency_key: str | None, attempt: int | None
    ) -> bool:
        """True: a new effect; False: one of this name and ``key`` was made already (the
        downstream system dropped the repeat)."""
        with closing(self._connect()) as connection:
            cursor = connection.execute(
                "INSERT OR IGNORE INTO effects (name, key, idempotency_key, attempt, pid)"
                " VALUES (?, ?, ?, ?, ?)",
                (name, key, idempotency_key, attempt, os.getpid()),
            )
            return cursor.rowcount == 1

    def seen(self, name: str, key: str) -> bool:
        with closing(self._connect()) as connection:
            found = connection.execute(
                "SELECT 1 FROM effects WHERE name = ? AND key = ?", (name, key)
            ).fetchone()
            return found is not None

    def record_answer(self, tool: str, idempotency_key: str | None, answer: str) -> None:
        with closing(self._connect()) as connection:
            connection.execute(
                "INSERT INTO answers (tool, idempotency_key, answer, pid) VALUES (?, ?, ?, ?)",
                (tool, idempotency_key, answer, os.getpid()),
            )

    def effects(self) -> Counter[str]:
        """Effects by name."""
        with closing(self._connect()) as connection:
            rows = connection.execute("SELECT name, count(*) FROM effects GROUP BY name").fetchall()
            return Counter({str(name): int(count) for name, count in rows})

    def answers(self) -> list[str]:
        """The verify hook's answers, in order."""
        with closing(self._connect()) as connection:
            return [str(a) for (a,) in connection.execute("SELECT answer FROM answers ORDER BY seq")]
