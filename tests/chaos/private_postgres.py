"""A PostgreSQL server of the test's own (initdb in a temporary directory, its own port),
so a test can stop and restart it without disturbing the shared server other tests use."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import psycopg

BIN = Path("/usr/lib/postgresql/15/bin")


def _as_postgres(*command: str) -> list[str]:
    # initdb and postgres refuse to run as root.
    return ["runuser", "-u", "postgres", "--", *command] if os.geteuid() == 0 else list(command)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class PrivatePostgres:
    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="toolledger-pg-"))
        self.data = self.root / "data"
        self.port = _free_port()
        if os.geteuid() == 0:
            shutil.chown(self.root, "postgres")

    @staticmethod
    def available() -> bool:
        return (BIN / "initdb").exists() and (os.geteuid() != 0 or shutil.which("runuser") is not None)

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def init(self) -> None:
        subprocess.run(
            _as_postgres(
                str(BIN / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync"
            ),
            check=True,
            capture_output=True,
        )

    def start(self) -> None:
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1"
        subprocess.run(
            _as_postgres(
                str(BIN / "pg_ctl"),
                "-D",
                str(self.data),
                "-o",
                options,
                "-l",
                str(self.root / "log"),
                "-w",
                "start",
            ),
            check=True,
            capture_output=True,
        )

    def stop(self, mode: str = "immediate") -> None:
        """``immediate``: as a crash (no checkpoint, every connection cut)."""
        subprocess.run(
            _as_postgres(str(BIN / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop"),
            check=True,
            capture_output=True,
        )

    def is_running(self) -> bool:
        try:
            with psycopg.connect(
                f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres", connect_timeout=2
            ):
                return True
        except psycopg.OperationalError:
            return False

    def destroy(self) -> None:
        if self.is_running():
            self.stop("fast")
        shutil.rmtree(self.root, ignore_errors=True)
