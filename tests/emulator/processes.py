"""The installed `toolledger` console script as a user runs it: subprocesses, in a clean
environment, stopped with SIGTERM when the test is done."""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx

from tests.support.polling import eventually_sync

TOOLLEDGER = Path(sys.executable).with_name("toolledger")
"""The console script `pip install` made from [project.scripts]."""


def clean_environment() -> dict[str, str]:
    """This environment without settings for toolledger or the openai client, and without
    a terminal's width (the test runner may set one): output is read as a pipe's."""
    return {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("TOOLLEDGER_", "OPENAI_")) and key not in ("PYTHONPATH", "COLUMNS", "LINES")
    }


def wait_healthy(base_url: str, timeout: float = 15.0) -> None:
    health = base_url.removesuffix("/v1") + "/_emulator/health"

    def healthy() -> bool:
        try:
            return httpx.get(health, timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    eventually_sync(healthy, within=timeout, what=f"{health} answered 200", interval=0.05)


@contextlib.contextmanager
def running(argv: list[str], *, cwd: Path, env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[str]]:
    """``argv`` in the background, its stdout a pipe and its stderr in ``log``."""
    with log.open("w") as output:
        process = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=output, text=True)
        try:
            yield process
        finally:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.communicate(timeout=15)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.communicate(timeout=5)


def first_line(process: subprocess.Popen[str], timeout: float = 15.0) -> str:
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    assert ready, "the process printed nothing"
    return process.stdout.readline().strip()


@contextlib.contextmanager
def emulator_command(cwd: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """`toolledger emulator ARGS` serving; its base URL. Its stderr is in cwd/emulator.log."""
    with running(
        [str(TOOLLEDGER), "emulator", *args],
        cwd=cwd,
        env=env if env is not None else clean_environment(),
        log=cwd / "emulator.log",
    ) as process:
        base_url = first_line(process)
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/v1", base_url), base_url
        wait_healthy(base_url)
        yield base_url


def toolledger(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(TOOLLEDGER), *args],
        cwd=cwd,
        env=env if env is not None else clean_environment(),
        capture_output=True,
        text=True,
        timeout=60,
    )
