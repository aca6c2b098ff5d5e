"""The `toolledger` command as users run it: the installed console script, in a subprocess."""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from tests.support.polling import eventually_sync
from toolledger.emulator import Script
from toolledger.store import migrate as migrations

TOOLLEDGER = Path(sys.executable).with_name("toolledger")
"""The console script `pip install` made from [project.scripts]."""

LEDGER_TABLES = {"tool_calls", "tool_call_events", "sessions", "replicas", "alembic_version"}


def environment() -> dict[str, str]:
    """This environment without TOOLLEDGER_* settings, so only the command line configures."""
    return {key: value for key, value in os.environ.items() if not key.startswith("TOOLLEDGER_")}


def toolledger(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    assert TOOLLEDGER.exists(), f"console script missing at {TOOLLEDGER}"
    return subprocess.run(
        [str(TOOLLEDGER), *args], capture_output=True, text=True, timeout=60, cwd=cwd, env=environment()
    )


def accepts_connections(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def can_listen_on(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
            probe.listen()
        except OSError:
            return False
        return True


# ---------------------------------------------------------------- emulator


@dataclass
class EmulatorProcess:
    process: subprocess.Popen[str]
    base_url: str
    port: int
    stderr: str = ""

    def signal_and_wait(self, signum: int, timeout: float = 10.0) -> float:
        """Send ``signum``; the seconds until the process was gone."""
        started = time.monotonic()
        self.process.send_signal(signum)
        _, self.stderr = self.process.communicate(timeout=timeout)
        return time.monotonic() - started


def first_line(process: subprocess.Popen[str], timeout: float) -> str:
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    if not ready:
        raise AssertionError(f"`toolledger emulator` printed nothing within {timeout} s")
    return process.stdout.readline()


def wait_serving(base_url: str, timeout: float = 15.0) -> None:
    """Until the app answers: the URL is printed before the server (and its signal handling) starts."""
    health = base_url.removesuffix("/v1") + "/_emulator/health"

    def serving() -> bool:
        try:
            return bool(httpx.get(health, timeout=1).json() == {"status": "ok"})
        except httpx.TransportError:
            return False

    eventually_sync(serving, within=timeout, what=f"{health} answered ok", interval=0.02)


@contextlib.contextmanager
def emulator_process(cwd: Path, *args: str) -> Iterator[EmulatorProcess]:
    assert TOOLLEDGER.exists(), f"console script missing at {TOOLLEDGER}"
    process = subprocess.Popen(
        [str(TOOLLEDGER), "emulator", "--port", "0", "--log-level", "info", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env=environment(),
    )
    try:
        line = first_line(process, timeout=15).strip()
        match = re.fullmatch(r"http://127\.0\.0\.1:(\d+)/v1", line)
        assert match, f"the first line is not a base URL: {line!r}"
        wait_serving(line)
        yield EmulatorProcess(process, line, int(match[1]))
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate(timeout=10)


def sdk(base_url: str, api_key: str = "sk-anything") -> OpenAI:
    return OpenAI(
        base_url=base_url, api_key=api_key, max_retries=0, timeout=5, _strict_response_validation=True
    )


def test_emulator_command__serves_the_sdk_and_stops_promptly_on_sigterm(tmp_path: Path) -> None:
    with emulator_process(tmp_path) as emulator, sdk(emulator.base_url) as client:
        assert accepts_connections(emulator.port)
        assert not can_listen_on(emulator.port)
        session = client.beta.agents.sessions.create(
            environment={"type": "none"}, agent={"model": "emulated"}, metadata={"from": "cli"}
        )
        assert client.beta.agents.sessions.retrieve(session.id) == session
        assert [s.id for s in client.beta.agents.sessions.list(metadata={"from": "cli"}).data] == [session.id]
        with client.beta.agents.sessions.stream(session.id, input="hello") as turn:
            result = turn.get_final_result()
        assert result.turn.status == "completed"
        assert result.messages[-1].output_text == "You said: hello"

        # An open event stream must not hold the shutdown up.
        with client.beta.agents.sessions.events.stream(session.id) as events:
            received = iter(events)
            assert next(received).type == "agent.session.idle"
            took = emulator.signal_and_wait(signal.SIGTERM)
            rest = list(received)

    assert took < 3.0, f"took {took:.1f} s to stop"
    assert rest == []
    assert "Application shutdown complete." in emulator.stderr
    assert "Traceback" not in emulator.stderr
    assert not accepts_connections(emulator.port)
    assert can_listen_on(emulator.port)


@pytest.mark.parametrize(
    "signum",
    [
        pytest.param(
            signal.SIGTERM,
            id="SIGTERM",
        ),
        pytest.param(
            signal.SIGINT,
            id="SIGINT",
        ),
    ],
)
def test_emulator_command__stopped_by_a_signal__exits_with_status_0(tmp_path: Path, signum: int) -> None:
    with emulator_process(tmp_path) as emulator:
        took = emulator.signal_and_wait(signum)

    assert took < 3.0
    assert "Application shutdown complete." in emulator.stderr
    assert emulator.process.returncode == 0, emulator.stderr


def test_emulator_command__with_api_key_and_script__refuses_other_keys_and_runs_the_script(
    tmp_path: Path,
) -> None:
    script_file = tmp_path / "script.json"
    script_file.write_text(Script.of_calls([("lookup_order", {"order_id": "A1"})]).model_dump_json())
    calls: list[dict[str, Any]] = []

    def lookup_order(arguments: dict[str, Any]) -> str:
        calls.append(arguments)
        return "found"

    with emulator_process(tmp_path, "--api-key", "sk-right", "--script", str(script_file)) as emulator:
        with (
            sdk(emulator.base_url, api_key="sk-wrong") as intruder,
            pytest.raises(openai.AuthenticationError) as refused,
        ):
            intruder.beta.agents.sessions.list()
        with sdk(emulator.base_url, api_key="sk-right") as client:
            session = client.beta.agents.sessions.create(environment={"type": "none"}, agent={"model": "m"})
            with client.beta.agents.sessions.stream(
                session.id, input="find A1", tool_handlers={"lookup_order": lookup_order}
            ) as turn:
                result = turn.get_final_result()
        emulator.signal_and_wait(signal.SIGTERM)

    assert refused.value.status_code == 401
    assert refused.value.code == "invalid_api_key"
    assert calls == [{"order_id": "A1"}]
    assert result.turn.status == "completed"
    assert "lookup_order: ok found" in result.messages[-1].output_text


def test_emulator_command__with_an_invalid_script_file__exits_2_naming_the_option(tmp_path: Path) -> None:
    script_file = tmp_path / "script.json"
    script_file.write_text('{"steps": "not a list"}')

    result = toolledger("emulator", "--port", "0", "--script", str(script_file), cwd=tmp_path)

    assert result.returncode == 2
    assert result.stdout == ""
    assert "--script" in result.stderr
    assert "is not a valid script" in result.stderr
    assert "Traceback" not in result.stderr


# -------------------------------------------------------------------- help


def test_help__lists_every_command(tmp_path: Path) -> None:
    result = toolledger("--help", cwd=tmp_path)

    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Usage: toolledger ")
    section = result.stdout.split("Commands:", 1)[1]
    listed = {line.split()[0] for line in section.splitlines() if line.startswith("  ")}
    assert listed >= {"emulator", "migrate", "serve", "sessions", "reconcile", "status"}


def test_help__of_the_emulator__documents_its_options(tmp_path: Path) -> None:
    result = toolledger("emulator", "--help", cwd=tmp_path)

    assert result.returncode == 0, result.stderr
    for option in ("--host", "--port", "--api-key", "--script", "--log-level"):
        assert option in result.stdout


# ----------------------------------------------------------------- migrate


def sqlite_schema(path: Path) -> tuple[set[str], list[tuple[str, ...]], list[tuple[str, ...]]]:
    """Table names, every schema entry, and the Alembic revision rows."""
    with contextlib.closing(sqlite3.connect(path)) as db:
        entries = db.execute("SELECT type, name, tbl_name, sql FROM sqlite_master ORDER BY name").fetchall()
        revisions = db.execute("SELECT version_num FROM alembic_version").fetchall()
    return {name for kind, name, _, _ in entries if kind == "table"}, entries, revisions


def test_migrate__run_twice_on_a_new_sqlite_file__creates_the_ledger_schema_once(tmp_path: Path) -> None:
    database = tmp_path / "ledger" / "x.sqlite3"
    database.parent.mkdir()
    url = f"sqlite+aiosqlite:///{database}"
    head = migrations.head_revision(url)

    first = toolledger("migrate", "--database-url", url, cwd=tmp_path)
    tables, schema, revisions = sqlite_schema(database)
    second = toolledger("migrate", "--database-url", url, cwd=tmp_path)
    _, schema_again, revisions_again = sqlite_schema(database)

    assert first.returncode == 0, first.stderr
    assert first.stdout.strip() == f"ledger schema: empty -> {head}"
    assert tables >= LEDGER_TABLES
    assert revisions == [(head,)]
    assert second.returncode == 0, second.stderr
    assert second.stdout.strip() == f"ledger schema: {head} -> {head}"
    assert schema_again == schema
    assert revisions_again == [(head,)]
    assert not (tmp_path / "toolledger.sqlite3").exists()  # the flag, not the default, was used


BAD_URLS = {
    "unparseable": "not a database url",
    "missing-directory": "sqlite+aiosqlite:///{tmp}/no/such/dir/x.sqlite3",
}


@pytest.fixture(scope="module", params=list(BAD_URLS.values()), ids=list(BAD_URLS))
def bad_url_migration(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    tmp = tmp_path_factory.mktemp("bad-url")
    url = str(request.param).format(tmp=tmp)
    return tmp, toolledger("migrate", "--database-url", url, cwd=tmp)


def test_migrate__bad_database_url__fails_and_creates_nothing(
    bad_url_migration: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    tmp, result = bad_url_migration

    assert result.returncode != 0
    assert "ledger schema:" not in result.stdout
    assert list(tmp.iterdir()) == []


def test_migrate__bad_database_url__says_why_without_a_traceback(
    bad_url_migration: tuple[Path, subprocess.CompletedProcess[str]],
) -> None:
    _, result = bad_url_migration

    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("Error: ") or "\nError: " in result.stderr
