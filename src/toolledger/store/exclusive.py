"""One `serve` process per SQLite ledger: SQLite has no row locks to share sessions with."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO

from sqlalchemy.engine import make_url

from toolledger.errors import ToolLedgerError


class LedgerInUseError(ToolLedgerError):
    code = "ledger_in_use"


class SQLiteServiceLock:
    """An advisory lock on ``<database>.serve.lock``, held while the service runs.

    The kernel drops it when the holder dies, even by SIGKILL, so a crash never leaves the
    ledger locked.
    """

    def __init__(self, database_url: str) -> None:
        url = make_url(database_url)
        database = url.database
        self.database = database
        # PostgreSQL shares sessions between processes through leases: nothing to lock.
        on_file = url.get_backend_name() == "sqlite" and database not in (None, "", ":memory:")
        # The file's real path: two spellings of one ledger (a symlinked directory, "./")
        # must meet at one lock, or two serves would each think the other gone.
        self.path = Path(f"{Path(database).resolve()}.serve.lock") if on_file and database else None
        self._file: IO[str] | None = None

    def acquire(self) -> None:
        if self.path is None:
            return
        handle = self.path.open("a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            raise LedgerInUseError(
                f"the SQLite ledger {self.database} is already served by {holder}: "
                "one `toolledger serve` per SQLite file; for replicas use PostgreSQL "
                "(TOOLLEDGER_DATABASE_URL=postgresql+psycopg://...)"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()}\n")
        handle.flush()
        self._file = handle

    @property
    def held(self) -> bool:
        """This process holds the lock: no other `serve` runs on this file."""
        return self._file is not None

    def release(self) -> None:
        if self._file is not None:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None
