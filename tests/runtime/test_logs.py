"""Log lines: redacted whole (message and traceback, whichever logger wrote them), with the
session, turn and call ids of the work they are about, as JSON lines off a terminal."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.runtime import approval_tools
from tests.support.history import wait_quiescent
from tests.support.polling import eventually
from tests.support.serve_process import ServeProcess, run_cli
from tests.support.service_harness import running_service, service_settings
from tests.support.workload import every_class_script, start_sessions, wait_until_idle
from toolledger.domain.redaction import MASK, Redactor
from toolledger.emulator import EmulatorServer, Script
from toolledger.logs import configure_logging, log_fields
from toolledger.runtime.service import Service

CONFIGURED_SECRET = "hunter2-very-own-secret-value"  # noqa: S105 - a canary
SHAPED_KEY = "sk-proj-CANARYabcdef0123456789"


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)


def _route(log_format: str, stream: io.StringIO) -> None:
    configure_logging(
        "debug",
        redactor=Redactor(secrets=[CONFIGURED_SECRET]),
        log_format=log_format,  # type: ignore[arg-type]
        stream=stream,
    )


def _fail_with_secrets() -> None:
    try:
        raise RuntimeError(f"card_number=4111111111111111 key {SHAPED_KEY}")
    except RuntimeError as cause:
        raise ValueError(f"login with {CONFIGURED_SECRET} refused") from cause


@pytest.mark.usefixtures("restore_logging")
def test_json_lines__carry_the_call_ids_and_mask_secrets_in_message_and_traceback() -> None:
    stream = io.StringIO()
    _route("json", stream)
    log = logging.getLogger("anything.at.all")
    with log_fields(session_id="sess_1", turn_id="turn_1"), log_fields(call_id="call_1"):
        try:
            _fail_with_secrets()
        except ValueError:
            log.exception("tool failed for password=%s", "opensesame")
    log.warning("outside any call")

    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert len(lines) == 2
    inside, outside = lines
    assert (inside["session_id"], inside["turn_id"], inside["call_id"]) == ("sess_1", "turn_1", "call_1")
    assert inside["level"] == "error"
    assert inside["logger"] == "anything.at.all"
    assert inside["message"] == f"tool failed for password={MASK}"
    assert "Traceback" in inside["exception"]
    assert "ValueError" in inside["exception"]
    assert MASK in inside["exception"]
    assert "session_id" not in outside
    assert outside["message"] == "outside any call"
    for secret in (CONFIGURED_SECRET, SHAPED_KEY, "4111111111111111", "opensesame"):
        assert secret not in stream.getvalue()


@pytest.mark.usefixtures("restore_logging")
def test_text_lines__name_the_call_on_the_first_line_and_mask_the_traceback() -> None:
    stream = io.StringIO()
    _route("text", stream)
    with log_fields(session_id="sess_2", call_id="call_2"):
        try:
            _fail_with_secrets()
        except ValueError:
            logging.getLogger("toolledger.executor").exception("handler failed")

    text = stream.getvalue()
    first, *rest = text.splitlines()
    assert first.endswith("handler failed [session_id=sess_2 call_id=call_2]")
    assert any("RuntimeError" in line for line in rest)
    for secret in (CONFIGURED_SECRET, SHAPED_KEY, "4111111111111111"):
        assert secret not in text


@pytest.mark.usefixtures("restore_logging")
def test_auto__off_a_terminal__writes_json_lines() -> None:
    stream = io.StringIO()
    _route("auto", stream)
    logging.getLogger("toolledger").warning("hello")
    assert json.loads(stream.getvalue())["message"] == "hello"


async def test_serve__json_logs__every_line_parses_and_call_lines_name_their_call(
    emulator: EmulatorServer, sqlite_url: str, effects_file: Path, tmp_path: Path
) -> None:
    session_ids = await start_sessions(emulator, 1, every_class_script())
    assert run_cli("sessions", "watch", *session_ids, database_url=sqlite_url).returncode == 0
    api_key = "sk-live-CANARY0000111122223333"
    with ServeProcess(
        sqlite_url,
        emulator.base_url,
        tmp_path / "serve.log",
        extra_args=("--log-level", "debug"),
        TOOLLEDGER_LOG_FORMAT="json",
        TOOLLEDGER_OPENAI_API_KEY=api_key,
    ) as serve:
        await asyncio.to_thread(serve.wait_serving)
        await wait_quiescent(emulator, sqlite_url, session_ids)
        log_text = serve.log()

    entries = [json.loads(line) for line in log_text.splitlines() if line.strip()]
    calls = [entry for entry in entries if "call_id" in entry]
    called = {action.call_id for action in emulator.control.tool_results(session_ids[0])}
    assert called
    assert {entry["call_id"] for entry in calls} >= called
    assert all(entry["session_id"] == session_ids[0] for entry in calls)
    reconciled = [entry for entry in entries if "reconciled" in entry["message"]]
    assert reconciled
    assert all(entry.get("session_id") == session_ids[0] for entry in reconciled)
    assert api_key not in log_text


async def test_serve__a_session_that_only_waits__reconciles_at_debug_and_says_actions_as_words(
    sqlite_url: str, emulator: EmulatorServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Looked at every interval while its call waits for a person: said at info only when
    something moved, and as "action count" words, not a Python dict."""
    script = Script.of_calls([("approved_refund", {"amount": 1})])
    [session_id] = await start_sessions(emulator, 1, script)
    settings = service_settings(sqlite_url, emulator, reconcile_interval_seconds=0.3)
    with caplog.at_level(logging.DEBUG, logger="toolledger.service"):
        async with Service(approval_tools.registry, settings, auto_migrate=False) as service:
            await service.watch(session_id)
            await eventually(lambda: len(_reconciled(caplog, logging.DEBUG)) >= 3, within=20.0)

    said = _reconciled(caplog, logging.INFO)
    quiet = _reconciled(caplog, logging.DEBUG)
    assert all(set(_actions(m)) == {"waiting_for_approval"} for m in quiet), quiet
    assert len(said) == 1, "said once, when the call began to wait; repeats of the wait at debug"
    assert _actions(said[0]) == ["waiting_for_approval"]
    assert not any("{" in m for m in said + quiet), "a dict's repr in a log line"


async def test_serve__a_flapping_stream__says_reconnecting_once_a_minute_per_session(
    sqlite_url: str, emulator: EmulatorServer, caplog: pytest.LogCaptureFixture
) -> None:
    [session_id] = await start_sessions(emulator, 1, Script())  # a turn with no call: idle at once
    await wait_until_idle(emulator, [session_id])
    emulator.control.close_streams(count=8, session_id=session_id)
    with caplog.at_level(logging.DEBUG, logger="toolledger.service"):
        async with running_service(sqlite_url, emulator) as service:
            await service.watch(session_id)

            def reconnects() -> list[logging.LogRecord]:
                return [r for r in caplog.records if "reconnecting" in r.getMessage()]

            await eventually(lambda: len(reconnects()) >= 6, within=30.0)
            loud = [r for r in reconnects() if r.levelno >= logging.INFO]
            quiet = [r for r in reconnects() if r.levelno == logging.DEBUG]
    assert len(loud) == 1, [r.getMessage() for r in loud]
    assert len(quiet) >= 5


def _reconciled(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.levelno == level and " reconciled: " in r.getMessage()
    ]


def _actions(message: str) -> list[str]:
    said = message.split(" reconciled: ", 1)[1].split(";")[0]
    return [part.rsplit(" ", 1)[0] for part in said.split(", ")]
