"""The check's side of a forkserver (``toolledger.testing.forkserver``): starts one, hands it
jobs, and says how each job's process ended (an exit code, or minus the signal that killed it).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from toolledger.domain.keys import CallKey
from toolledger.errors import ToolLedgerError

API_KEY = "sk-toolledger-check"  # the emulator takes any key
START_SECONDS = 120.0
"""How long the forkserver may take to import toolledger and the application's tools."""


@dataclass(frozen=True)
class Job:
    kind: str
    """``prepare``, ``run`` or ``recover``."""
    database_url: str
    out: str
    """Where the job writes what it found (JSON)."""
    log: str
    """Where the process's output and logs go."""
    base_url: str = ""
    session_id: str = ""
    turn_id: str = ""
    call_id: str = ""
    world: str = ""
    crash_at: str | None = None

    def as_json(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def key(self) -> CallKey:
        return CallKey(self.session_id, self.turn_id, self.call_id)


class CheckError(ToolLedgerError):
    """The check could not be carried out as asked (its input, or its own processes)."""

    code = "check_failed"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        """The input at fault (``--tools``, ``--examples``, ...), if one is."""


CHECKING_VARIABLE = "TOOLLEDGER_CHECKING"
"""Set to ``1`` in the check's worker processes (``toolledger.testing.checking()``)."""


class JobTimeout(Exception):
    """A job's process did not end in time; it was killed."""


class Workers:
    """A forkserver of the application's tools (``reference``), for one thread at a time."""

    def __init__(self, reference: str, log: Path) -> None:
        self.reference = reference
        self.log = log
        self._log = log.open("ab")
        environment = {k: v for k, v in os.environ.items() if k != "TOOLLEDGER_CRASH_AT"}
        # The check's own import path (a test suite's rootdir, say), so the tools import
        # there as they do here; the current directory is added by the tools' loading.
        environment["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        # The handlers are called for real: this tells the tools to use their fakes.
        environment[CHECKING_VARIABLE] = "1"
        self._process = subprocess.Popen(  # noqa: S603 - our own module, fixed arguments
            [sys.executable, "-P", "-m", "toolledger.testing.forkserver", reference],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=environment,
        )
        self._buffer = b""
        self.tools: list[dict[str, Any]] | None = None

    def ready(self) -> list[dict[str, Any]]:
        """The tools the forkserver loaded (name, effect, parameters), once it has."""
        if self.tools is None:
            hello = self._read(START_SECONDS)
            if hello is None:
                raise CheckError(f"loading the tools {self.reference} failed:\n{self._tail()}")
            if "error" in hello:
                raise CheckError(str(hello["error"]), param="--tools")
            self.tools = list(hello["tools"])
        return self.tools

    def do(self, job: dict[str, Any], timeout: float) -> int:
        """Run one job in a forked child; its exit code (negative: the signal that ended it).
        Raises JobTimeout when it ran longer than ``timeout`` seconds (it is killed)."""
        assert self._process.stdin is not None
        self._process.stdin.write((json.dumps(job) + "\n").encode())
        self._process.stdin.flush()
        started = self._read(10.0)
        if started is None or "started" not in started:
            raise CheckError(f"the check's forkserver stopped:\n{self._tail()}")
        pid = int(started["started"])
        ended = self._read(timeout)
        if ended is None:
            os.kill(pid, signal.SIGKILL)  # our own child (the forkserver's), by its id
            if self._read(10.0) is None:
                raise CheckError(f"the check's forkserver stopped:\n{self._tail()}")
            raise JobTimeout(f"did not finish within {timeout:g}s (killed)")
        return int(ended["exit"])

    def _read(self, timeout: float) -> dict[str, Any] | None:
        """The forkserver's next message; None if it ended or said nothing in time."""
        assert self._process.stdout is not None
        descriptor = self._process.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            readable, _, _ = select.select([descriptor], [], [], remaining)
            if not readable:
                return None
            chunk = os.read(descriptor, 65536)
            if not chunk:
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        message: dict[str, Any] = json.loads(line)
        return message

    def _tail(self, lines: int = 20) -> str:
        self._log.flush()
        text = self.log.read_text(encoding="utf-8", errors="replace").splitlines()
        return "\n".join(text[-lines:]) or "(nothing on its stderr)"

    def close(self) -> None:
        if self._process.stdin is not None:
            self._process.stdin.close()
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        if self._process.stdout is not None:
            self._process.stdout.close()
        self._log.close()

    def __enter__(self) -> Workers:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
