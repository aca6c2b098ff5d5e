"""`toolledger serve` as a real subprocess (the console script's code path), for SIGKILL,
SIGTERM and replica tests. Its tools are tests.support.service_tools; its log goes to a file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tests.support.paths import ROOT
from tests.support.polling import eventually_sync

TOOLS = "tests.support.service_tools:registry"

# Short leases and timers, so that take-overs and expiries happen within a test's patience.
FAST_ENVIRONMENT = {
    "TOOLLEDGER_LEASE_SECONDS": "1.0",
    "TOOLLEDGER_SESSION_LEASE_SECONDS": "2.0",
    "TOOLLEDGER_RECONCILE_INTERVAL_SECONDS": "1.0",
    "TOOLLEDGER_STREAM_BACKOFF_MAX_SECONDS": "0.3",
    "TOOLLEDGER_SHUTDOWN_GRACE_SECONDS": "3.0",
}


class ServeProcess:
    def __init__(
        self,
        database_url: str,
        base_url: str,
        log_path: Path,
        *,
        crash_at: str | None = None,
        extra_args: tuple[str, ...] = (),
        settings: Mapping[str, str] | None = None,
        base_url_variable: str = "TOOLLEDGER_OPENAI_BASE_URL",
        **environment: str,
    ) -> None:
        """``settings`` and ``environment``: variables over the fast timers (a mapping, or
        keywords). ``base_url_variable``: the variable that names the Agents API (the SDK's
        own ``OPENAI_BASE_URL``, say)."""
        env = {
            **os.environ,
            **FAST_ENVIRONMENT,
            "TOOLLEDGER_DATABASE_URL": database_url,
            base_url_variable: base_url,
            "PYTHONPATH": str(ROOT),
            **(settings or {}),
            **environment,
        }
        env.pop("TOOLLEDGER_CRASH_AT", None)
        if crash_at is not None:
            env["TOOLLEDGER_CRASH_AT"] = crash_at
        self.log_path = log_path
        self._log = log_path.open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "toolledger.cli", "serve", "--tools", TOOLS, *extra_args],
            cwd=ROOT,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def wait_serving(self, timeout: float = 30.0) -> None:
        """Until the process logged that it serves (or died)."""

        def serving() -> bool:
            if "serving:" in self.log():
                return True
            if self.process.poll() is not None:
                raise RuntimeError(f"serve exited with {self.process.returncode}:\n{self.log()}")
            return False

        eventually_sync(
            serving, within=timeout, what=lambda: f"serve did not start:\n{self.log()}", interval=0.05
        )

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)
        self._log.close()

    def terminate(self, timeout: float = 20.0) -> int:
        self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout=timeout)
        self._log.close()
        return code

    def wait_exit(self, timeout: float = 30.0) -> int:
        code = self.process.wait(timeout=timeout)
        self._log.close()
        return code

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *_: Any) -> None:
        self.kill()


def run_cli(
    *args: str,
    database_url: str,
    base_url: str | None = None,
    timeout: float = 60.0,
    python_path: tuple[Path, ...] = (),
) -> subprocess.CompletedProcess[str]:
    """``python_path``: directories put ahead of the project's (a ``sitecustomize`` there
    changes the process before toolledger loads)."""
    env = {
        **os.environ,
        "TOOLLEDGER_DATABASE_URL": database_url,
        "PYTHONPATH": os.pathsep.join(str(p) for p in (*python_path, ROOT)),
    }
    env.pop("TOOLLEDGER_CRASH_AT", None)
    if base_url is not None:
        env["TOOLLEDGER_OPENAI_BASE_URL"] = base_url
    return subprocess.run(
        [sys.executable, "-m", "toolledger.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
