"""Secret canaries (RELIABILITY.md R13) and no error text to the model (R14).

Unique secrets of every shape the redactor promises to mask (``sk-proj-`` keys, bearer
tokens, AWS access keys, database-URL passwords, HTTP Basic credentials, the configured OpenAI
API key and the ledger database's own password, and the values of every configured secret
field) are planted in tool arguments, exception messages (their ``__cause__``,
``__context__``, notes, ExceptionGroups, arguments that are objects), ToolError messages, tool
outputs, a database error, HTTP errors and a failed session's message. Then every place
toolledger writes to is searched for them: what the emulator received (bodies, and headers
other than the configured Authorization, recorded by a front in canaries.py: the emulator
itself keeps only tool-result payloads), the log at DEBUG (every logger, ``openai`` and
``httpx``/``httpx2`` included, but aiosqlite: see ``capture_logs``), a ``toolledger serve``
subprocess's stdout and stderr (at ``--log-level debug``), every column of every ledger table,
and ``toolledger status|reconcile|sessions list --json``.

R14 (Hypothesis): random exceptions (types, nesting, canaries) raised while validating the
arguments, running the handler and converting its output: the model gets exactly the fixed
message for the stage, or a ToolError's redacted message capped at 500 characters.

What the design keeps whole, on purpose, is asserted as kept whole: valid arguments (a re-run
needs them) in ``tool_calls.arguments``, and a successful output (the model's answer) in the
submitted payload and ``tool_calls.result``, byte for byte.

Log lines are masked whole by the CLI's formatter (toolledger.logs; tests/runtime/test_logs.py
covers it with tracebacks and every logger).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import signal
import traceback
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import pydantic
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai import AsyncOpenAI
from pydantic import SecretStr

from tests.chaos import canaries
from tests.chaos.canaries import (
    CANARIES,
    LONG_TOOL_ERROR_PREFIX,
    PLANT_VARIABLE,
    SECRET_FIELDS,
    SEED_VARIABLE,
    Canary,
    Leaky,
    RecordingFront,
    Refusal,
    benign_strings,
    hits,
    ledger_values,
    recording_emulator,
)
from tests.support.api_server import FULL as API_FULL
from tests.support.api_server import READ as API_READ
from tests.support.api_server import api_settings, serving
from tests.support.executor_harness import FunctionCallAction, wait_for_actions
from tests.support.polling import eventually
from tests.support.serve_process import ServeProcess, run_cli
from toolledger.audit.api import create_app
from toolledger.domain.redaction import DEFAULT_REDACTOR, MASK, Redactor
from toolledger.domain.results import (
    FAILED_MESSAGE,
    NOT_EXECUTED_MESSAGE,
    OUTPUT_FAILED_MESSAGE,
    POISON_MESSAGE,
    TOOL_ERROR_MAX_CHARS,
    MaybeExecuted,
    NotExecuted,
    ToolError,
)
from toolledger.domain.states import CallStatus
from toolledger.emulator import EmulatorServer, Script
from toolledger.runtime.reconciler import Reconciler
from toolledger.runtime.registry import ToolRegistry
from toolledger.runtime.tool_ledger import ToolLedger
from toolledger.settings import Settings
from toolledger.store.sessions import SessionStore

DRIVER_KEY = "test-driver"
"""The API key of the test's own client (creating sessions): its requests are not toolledger's."""
AUTHORIZATION = f"Bearer {CANARIES.api_key}"
"""The one header allowed to carry a canary: the configured key, sent to the configured API."""
CAPTURED_LOGGERS = ("toolledger", "openai", "httpx", "httpx2", "httpcore", "httpcore2", "uvicorn")
"""At DEBUG even where an earlier test in this process (a CLI run in it) set them higher."""


def everything(*, db_password: bool) -> list[Canary]:
    return CANARIES.canaries(db_password=db_password)


def configured_settings(database_url: str, base_url: str | None = None, **options: Any) -> Settings:
    """Settings holding the API-key canary and the custom secret field."""
    return Settings(
        database_url=database_url,
        openai_base_url=base_url,
        openai_api_key=SecretStr(CANARIES.api_key),
        secret_fields=SECRET_FIELDS,
        worker_id="canary-worker",
        **options,
    )


def capped(text: str) -> str:
    """The model-facing limit on a ToolError's message (RELIABILITY.md R14: <= 500 chars)."""
    return text if len(text) <= TOOL_ERROR_MAX_CHARS else text[: TOOL_ERROR_MAX_CHARS - 1] + "…"


def capture_logs(caplog: pytest.LogCaptureFixture) -> None:
    """Every logger at DEBUG (toolledger, openai, httpx/httpx2, httpcore, uvicorn, asyncio...),
    but aiosqlite, whose DEBUG lines quote every statement's parameters (the arguments and
    outputs the ledger stores whole, by design): `toolledger serve` keeps it at WARNING too."""
    caplog.set_level(logging.INFO, logger="aiosqlite")
    # Last: each call sets the capturing handler's level too.
    for name in (*CAPTURED_LOGGERS, None):
        caplog.set_level(logging.DEBUG, logger=name)


def logged(caplog: pytest.LogCaptureFixture) -> str:
    """Every captured record, formatted as a handler would (with tracebacks)."""
    formatter = logging.Formatter("%(name)s %(levelname)s %(message)s")
    return "\n".join(formatter.format(record) for record in caplog.records)


# --------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def fronted() -> Iterator[tuple[EmulatorServer, RecordingFront]]:
    with recording_emulator() as pair:
        yield pair


@pytest.fixture
def recorded(
    fronted: tuple[EmulatorServer, RecordingFront],
) -> Iterator[tuple[EmulatorServer, RecordingFront]]:
    """The recorded emulator, emptied: no sessions, scripts, faults, refusals or requests."""
    emulator, front = fronted
    emulator.control.reset()
    front.clear()
    yield emulator, front
    emulator.control.reset()
    front.clear()


@pytest.fixture
def ledger_url(database_url: str) -> str:
    """The test's ledger; on PostgreSQL its URL carries the database-password canary."""
    return CANARIES.postgres_url(database_url) if database_url.startswith("postgresql") else database_url


@pytest.fixture
def planting(ledger_url: str) -> Iterator[list[Canary]]:
    """The canaries this process's tools plant: all of them (the database password where the
    ledger's URL holds it)."""
    chosen = everything(db_password=ledger_url.startswith("postgresql"))
    canaries.plant(chosen)
    yield chosen
    canaries.plant(everything(db_password=False))


async def start_session(emulator: EmulatorServer, *steps: list[tuple[str, Any]]) -> str:
    name = f"canary-{uuid.uuid4().hex}"
    emulator.control.register_script(name, Script.of_calls(*steps))
    async with AsyncOpenAI(base_url=emulator.base_url, api_key=DRIVER_KEY, max_retries=0) as client:
        session = await client.beta.agents.sessions.create(
            environment={"type": "none"},
            agent={"model": "emulated"},
            metadata={"emulator_script": name},
            input="go",
        )
    return session.id


async def pending(emulator: EmulatorServer, session_id: str) -> list[FunctionCallAction]:
    async with AsyncOpenAI(base_url=emulator.base_url, api_key=DRIVER_KEY, max_retries=0) as client:
        return await wait_for_actions(client, session_id)


def accepted(emulator: EmulatorServer, session_id: str) -> list[dict[str, Any]]:
    return [r.payload for r in emulator.control.tool_results(session_id) if r.outcome == "accepted"]


def scan_requests(
    front: RecordingFront, found: list[Canary], allowed_outputs: dict[str, str] | None = None
) -> int:
    """Every request toolledger sent (known by its Authorization) is searched: the path, every
    header but Authorization, the body. A tool_result whose ``output`` is listed in
    ``allowed_outputs`` (call id -> output) must carry exactly that output, which is then left
    out of the search. Returns how many requests were searched."""
    allowed_outputs = allowed_outputs or {}
    sent = front.sent_with(AUTHORIZATION)
    for request in sent:
        headers = [f"{k}: {v}" for k, v in request.headers if k != "authorization"]
        body = request.body.decode("utf-8", "replace")
        if request.method == "POST" and request.body:
            parsed = json.loads(request.body)
            for event in parsed.get("events", []):
                expected = allowed_outputs.get(event.get("call_id"))
                if expected is not None:
                    assert event["output"] == expected, "an output is sent byte for byte"
                    event["output"] = ""
            body = json.dumps(parsed)
        where = f"{request.method} {request.path}"
        assert hits(" ".join([request.path, *headers, body]), found) == [], f"canary sent in {where}"
    # Everything toolledger sent carried the configured key, and only in Authorization.
    assert all(r.header("authorization") == AUTHORIZATION for r in sent)
    return len(sent)


def results_sent(front: RecordingFront) -> int:
    """The tool results in every request toolledger sent."""
    return sum(
        len(json.loads(r.body).get("events", []))
        for r in front.sent_with(AUTHORIZATION)
        if r.method == "POST" and r.body
    )


async def scan_ledger(
    ledger_url: str,
    found: list[Canary],
    *,
    whole_arguments: dict[str, str],
    whole_results: dict[str, str],
) -> int:
    """Every non-null value of every column of every table. ``whole_arguments`` and
    ``whole_results`` (call id -> text) are what the design keeps byte for byte: asserted
    equal, and left out of the search. Returns how many values were searched."""
    values = await ledger_values(ledger_url)
    for stored in values:
        call_id = stored.row.get("call_id")
        if stored.table == "tool_calls" and stored.column == "arguments" and call_id in whole_arguments:
            assert stored.value == whole_arguments[call_id], "valid arguments are stored whole"
            continue
        if stored.table == "tool_calls" and stored.column == "result" and call_id in whole_results:
            assert stored.value == whole_results[call_id], "a result is stored byte for byte"
            continue
        assert hits(stored.value, found) == [], f"canary stored in {stored.table}.{stored.column}"
    return len(values)


# ------------------------------------------------------------ the redactor, alone


def _every_canary() -> list[Canary]:
    return everything(db_password=True)


def _full_redactor() -> Redactor:
    """As a ledger on PostgreSQL with the canary key, password and custom field configures it."""
    return configured_settings(
        CANARIES.postgres_url("postgresql+psycopg://shop@127.0.0.1:5432/shop")
    ).redactor()


@pytest.mark.parametrize("canary", _every_canary(), ids=lambda c: c.name)
def test_redactor__each_canary_in_each_of_its_shapes__masked_exactly_and_only_the_secret(
    canary: Canary,
) -> None:
    redactor = _full_redactor()
    for planted, masked in canary.plantings:
        assert redactor.text(planted) == masked
        if not canary.configured:
            # Paths without the configuration (a refused-arguments preview, a validation
            # message, a one-line log of a failure) use the default redactor: it must do as well.
            assert DEFAULT_REDACTOR.text(planted) == masked
        # Inside structures: a value is masked by its key, or as text.
        nested = redactor.value({"detail": planted, "items": [planted, {"note": planted}]})
        assert hits(json.dumps(nested), [canary]) == []
    if canary.name.startswith("field_"):
        name = canary.name.removeprefix("field_")
        value = CANARIES.fields[name]
        for key in (name, name.upper(), f"x-{name.replace('_', '-')}", f"customer_{name}"):
            assert redactor.value({key: value}) == {key: MASK}


def _wrappings() -> dict[str, Any]:
    """The forms text takes on its way into a log line or an audit detail."""

    def traceback_of(text: str) -> str:
        try:
            try:
                raise KeyError(text)
            except KeyError as inner:
                raise RuntimeError(text) from inner
        except RuntimeError as error:
            error.add_note(text)
            return "".join(traceback.format_exception(error))

    return {
        "plain": lambda t: t,
        "one_line": lambda t: t.replace("\n", " "),
        "comma_separated": lambda t: t.replace("\n", ", "),
        "tab_separated": lambda t: t.replace("\n", "\t"),
        "repr": repr,
        "repr_of_repr": lambda t: repr(repr(t)),
        "repr_of_list": lambda t: repr([t, t]),
        "repr_of_dict": lambda t: repr({"detail": t}),
        "repr_of_bytes": lambda t: repr(t.encode()),
        "json_string": json.dumps,
        "json_object": lambda t: json.dumps({"detail": t}),
        "json_in_json": lambda t: json.dumps({"body": json.dumps({"detail": t})}),
        "exception_with_many_args": lambda t: str(ValueError("failed", t, {"detail": t}, [Leaky("X", t)])),
        "traceback_with_cause_and_note": traceback_of,
    }


@pytest.mark.parametrize("wrapping", list(_wrappings()))
def test_redactor__every_canary_wrapped_in_reprs_json_and_tracebacks__none_survives(wrapping: str) -> None:
    found = _every_canary()
    canaries.plant(found)
    try:
        text = _wrappings()[wrapping](canaries.leaky_text())
        assert len(hits(text, found)) == len(found), "every canary is planted"
        assert hits(_full_redactor().text(text), found) == []
        # The shaped canaries and default fields survive no better the default redactor.
        default = [c for c in found if not c.configured]
        assert hits(DEFAULT_REDACTOR.text(text), default) == []
    finally:
        canaries.plant(everything(db_password=False))


def test_redactor__1000_benign_strings__pass_through_unchanged() -> None:
    strings = benign_strings(1000)
    assert len(strings) == 1000
    assert len(set(strings)) >= 950, "(nearly) all different"
    assert strings == benign_strings(1000), "deterministic"
    for prefix in ("call_", "sess_", "tl_", "data:image/png;base64,", "task-"):
        assert sum(s.startswith(prefix) for s in strings) >= 40, prefix
    assert sum("://" in s for s in strings) >= 40, "URLs"
    assert sum(bool(re.search(r"(?i)\b(token|password)", s)) for s in strings) >= 40
    redactors = {"configured": _full_redactor(), "default": DEFAULT_REDACTOR}
    for label, redactor in redactors.items():
        changed = [s for s in strings if redactor.text(s) != s]
        assert changed == [], f"{label}: {len(changed)} false positive(s), e.g. {changed[:3]}"
        assert redactor.text("\n".join(strings)) == "\n".join(strings)
        keys = ("call_id", "session_id", "turn_id", "idempotency_key", "image_url", "url", "note", "digest")
        record = {key: strings[i :: len(keys)] for i, key in enumerate(keys)}
        assert redactor.value(record) == record


# --------------------------------------- the redactor for one call's own values (issue 31)


def test_for_call__the_calls_secret_values__masked_bare_as_json_and_repr_spell_them() -> None:
    redactor = _full_redactor()
    pin, key = 'CANARYpin-ö"q8Zx', CANARIES.fields[canaries.CUSTOM_FIELD]
    arguments = {
        "amount": 1200,
        "password": pin,
        "nested": [{canaries.CUSTOM_FIELD: key}],
        "authorization": {"scheme": "custom", "parts": ["CANARYpart0123", 987654]},
    }
    call = redactor.for_call(arguments)
    # Everything a secret-named field holds is secret, as the views mask it whole.
    assert set(redactor.secret_values(arguments)) == {pin, key, "custom", "CANARYpart0123", "987654"}
    for spelled in (pin, json.dumps(pin)[1:-1], repr(pin)[1:-1]):
        assert call.text(f"declined for {spelled}.") == f"declined for {MASK}."
    assert call.text(f"ValueError('{key}', 987654)") == f"ValueError('{MASK}', {MASK})"
    assert call.text("CANARYpart0123 and 1200") == f"{MASK} and 1200", "only the secret fields' values"
    # Only this call's: the redactor it came from is unchanged, and so are other calls'.
    assert redactor.text(f"declined for {pin}") == f"declined for {pin}"
    assert redactor.for_call({"amount": 1}) is redactor


def test_for_call__short_values__masked_as_whole_words_only() -> None:
    """A cvv's 3 digits, a PIN's 4: masked where they stand alone, not inside a longer number
    or word (a line number that happens to equal a cvv is masked: a secret outranks it)."""
    call = DEFAULT_REDACTOR.for_call({"cvv": "123", "password": "4821", "token": "ab", "ssn": True})
    assert call.text("cvv 123 refused; pin 4821.") == f"cvv {MASK} refused; pin {MASK}."
    assert call.text("order 51234, 48210 items, x123") == "order 51234, 48210 items, x123"
    assert call.text('File "h.py", line 123') == f'File "h.py", line {MASK}'
    assert call.text("ab True about") == "ab True about", "under 3 characters, and booleans: not searched"


@given(
    value=st.text(st.characters(codec="utf-8", exclude_categories=("Cc", "Cs")), min_size=6, max_size=40),
    before=st.text(max_size=30),
    after=st.text(max_size=30),
)
@settings(max_examples=300, deadline=None)
def test_for_call__any_value_of_six_characters_or_more__never_left_in_text(
    value: str, before: str, after: str
) -> None:
    call = DEFAULT_REDACTOR.for_call({"api_key": value})
    for spelled in (value, json.dumps(value)[1:-1], repr(value)[1:-1]):
        masked = call.text(before + spelled + after)
        assert spelled not in masked or spelled in MASK


def test_for_call__1000_benign_strings__untouched_by_a_calls_values() -> None:
    """The values themselves are masked, nothing else: text that does not hold them passes."""
    call = _full_redactor().for_call(canaries.quoted_arguments() | {"cvv": "731", "password": "4821"})
    strings = benign_strings(1000)
    assert [s for s in strings if call.text(s) != s] == []


# ------------------------------------------------------- R13: an in-process ledger


@dataclass
class Scenario:
    tool: str
    arguments: Any
    session_id: str = ""
    call_id: str = ""
    payload: dict[str, Any] = field(default_factory=dict)


def _scenarios(found: list[Canary]) -> dict[str, Scenario]:
    shaped = [c for c in found if not c.configured]
    refused_text = "fields=" + "&".join(p for c in shaped for p, _ in c.plantings[:2])
    return {
        "arguments": Scenario("store_credentials", canaries.leaky_arguments()),
        "invalid_arguments": Scenario(
            "store_credentials",
            {"fields": canaries.leaky_text(every_shape=False), **CANARIES.fields, "note": "n"},
        ),
        # Not JSON: a redacted preview is kept, not the text. (Only shaped canaries and the
        # default fields here: the preview does not use the configured redactor; see the report.)
        "refused_arguments": Scenario("store_credentials", refused_text),
        "exception": Scenario("raise_plain", {}),
        "cause_context_notes": Scenario("raise_chained", {}),
        "exception_group": Scenario("raise_group", {}),
        "object_arguments": Scenario("raise_objects", {}),
        "tool_error": Scenario("raise_tool_error", {}),
        "long_tool_error": Scenario("raise_long_tool_error", {}),
        "output": Scenario("return_secrets", {}),
        "database_error": Scenario("database_error", {}),
    }


async def _run_scenarios(
    emulator: EmulatorServer, ledger: ToolLedger, scenarios: dict[str, Scenario]
) -> None:
    for scenario in scenarios.values():
        scenario.session_id = await start_session(emulator, [(scenario.tool, scenario.arguments)])
    for scenario in scenarios.values():
        [action] = await pending(emulator, scenario.session_id)
        scenario.call_id = action.call_id
        report = await ledger.handle(scenario.session_id, action)
        assert report.submitted, scenario
        [scenario.payload] = accepted(emulator, scenario.session_id)


async def test_in_process_ledger__canaries_in_arguments_errors_outputs_and_a_database_error__none_leak(
    ledger_url: str,
    planting: list[Canary],
    recorded: tuple[EmulatorServer, RecordingFront],
    caplog: pytest.LogCaptureFixture,
) -> None:
    emulator, front = recorded
    capture_logs(caplog)
    scenarios = _scenarios(planting)
    settings_ = configured_settings(ledger_url, emulator.base_url)
    async with ToolLedger(canaries.registry, settings_, auto_migrate=False) as ledger:
        await _run_scenarios(emulator, ledger, scenarios)
        stored = {
            name: await ledger.store.for_session(scenario.session_id) for name, scenario in scenarios.items()
        }

    # What the model got.
    errors = {name: s.payload.get("error") for name, s in scenarios.items()}
    for generic in (
        "exception",
        "cause_context_notes",
        "exception_group",
        "object_arguments",
        "database_error",
    ):
        assert errors[generic] == FAILED_MESSAGE, generic
    short = canaries.redacted_text(every_shape=False).replace("\n", " | ")
    assert errors["tool_error"] == capped(short)
    assert len(short) <= TOOL_ERROR_MAX_CHARS, "the short ToolError is sent whole"
    long_error = errors["long_tool_error"]
    assert long_error == capped(LONG_TOOL_ERROR_PREFIX + canaries.redacted_text())
    assert len(long_error) == TOOL_ERROR_MAX_CHARS
    assert str(errors["invalid_arguments"]).startswith("Invalid arguments: ")
    assert errors["refused_arguments"] == "Invalid arguments: expected a JSON object."
    assert scenarios["arguments"].payload["success"] is True
    output = json.dumps({"echo": canaries.leaky_text()}, separators=(",", ":"))
    assert scenarios["output"].payload["output"] == output
    for name, scenario in scenarios.items():
        if name != "output":
            assert hits(json.dumps(scenario.payload), planting) == [], name

    # The audit trail has what happened, redacted: the traceback, the driver's error.
    [db_call] = stored["database_error"]
    assert db_call.error_detail is not None
    assert "no_such_table_of_canaries" in db_call.error_detail
    # The statement's parameters (tool data) are not in the driver's error text at all.
    assert "[SQL parameters hidden due to hide_parameters=True]" in db_call.error_detail
    [chained] = stored["cause_context_notes"]
    assert chained.error_detail is not None
    for part in ("ConnectionError", "KeyError", "OSError", "RuntimeError: the charge failed"):
        assert part in chained.error_detail

    # Every request body and header toolledger sent; every column of every table; the log.
    assert scan_requests(front, planting, {scenarios["output"].call_id: output}) >= len(scenarios)
    arguments = scenarios["arguments"]
    invalid = scenarios["invalid_arguments"]
    whole_arguments = {
        s.call_id: json.dumps(s.arguments, sort_keys=True, separators=(",", ":"))
        for s in (arguments, invalid)
    }
    whole_results = {
        s.call_id: json.dumps(s.payload, separators=(",", ":"))
        for s in scenarios.values()
        if s.tool == "return_secrets"
    }
    assert await scan_ledger(
        ledger_url, planting, whole_arguments=whole_arguments, whole_results=whole_results
    )
    text = logged(caplog)
    assert any(r.name.startswith(("openai", "httpx")) and r.levelno == logging.DEBUG for r in caplog.records)
    assert hits(text, planting) == []


async def test_in_process_ledger__http_errors_quoting_canaries_and_a_failed_session__masked_in_the_ledger(
    ledger_url: str, planting: list[Canary], recorded: tuple[EmulatorServer, RecordingFront]
) -> None:
    """An API (or a proxy) refusing a result with an error that quotes secrets (the
    Authorization header it got, a DSN, field values), then the session failing with such a
    message: the ledger keeps the errors and reasons redacted. (The log is not searched here:
    the executor logs a refused submission's text unredacted; see the report.)"""
    emulator, front = recorded
    quoted = canaries.leaky_text(every_shape=False).replace("\n", "; ")
    message = f"Refused: {quoted}"
    refused = await start_session(emulator, [("store_credentials", {"fields": {}})])
    unavailable = await start_session(emulator, [("store_credentials", {"fields": {}})])
    front.refuse_submissions[refused] = Refusal(400, message)
    front.refuse_submissions[unavailable] = Refusal(503, message)
    settings_ = configured_settings(ledger_url, emulator.base_url, submit_attempts=2)
    async with ToolLedger(canaries.registry, settings_, auto_migrate=False) as ledger:
        for session_id in (refused, unavailable):
            [action] = await pending(emulator, session_id)
            report = await ledger.handle(session_id, action)
            assert not report.submitted
        failed = [(await ledger.store.for_session(s))[0] for s in (refused, unavailable)]
        for session_id in (refused, unavailable):
            emulator.control.fail_session(session_id, f"The session failed: {quoted}")
        sessions = SessionStore(ledger.engine)
        reconciler = Reconciler(ledger.executor, ledger.gateway, sessions)
        for session_id in (refused, unavailable):
            await sessions.watch(session_id)
            result = await reconciler.reconcile_session(session_id)
            assert result.stopped is not None
        abandoned = [(await ledger.store.for_session(s))[0] for s in (refused, unavailable)]
        events = [await ledger.store.events(call.key) for call in abandoned]
        watched = await sessions.find(watched=None)

    for call in failed:
        assert call.last_submission_error is not None
        assert call.last_submission_error.startswith(("HTTP 400: Refused: ", "HTTP 503: Refused: "))
        assert MASK in call.last_submission_error
    for call, trail in zip(abandoned, events, strict=True):
        assert call.status is CallStatus.ABANDONED
        assert call.abandoned_reason is not None
        assert call.abandoned_reason.startswith("session failed: The session failed: ")
        assert [e.kind for e in trail].count("submission_failed") == 1
    assert {r.session_id for r in watched if not r.watched} == {refused, unavailable}
    assert all(r.reason and MASK in r.reason for r in watched)
    assert scan_requests(front, planting) >= 4
    assert await scan_ledger(ledger_url, planting, whole_arguments={}, whole_results={})


# -------------------------- R13: the bare values of a call's own secret fields (issue 31)


QUOTED_FIELDS = ("card_number", "cvv", canaries.CUSTOM_FIELD, "token")
"""The secret fields whose values the quoting tools are given (token: inside an object)."""


def quoting_scenarios() -> dict[str, Scenario]:
    quoted, nested = canaries.quoted_arguments(), canaries.nested_quoted_arguments()
    return {
        "value_error": Scenario("decline_quoting_values", quoted),
        "tool_error": Scenario("tool_error_quoting_values", quoted),
        "not_executed": Scenario("not_executed_quoting_values", quoted),
        "maybe_executed": Scenario("maybe_quoting_values", quoted),
        "verify_hook_failed": Scenario("verified_quoting_values", quoted),
        "nested": Scenario("nested_quoting_values", nested),
        "invalid": Scenario("invalid_quoting_values", {k: v for k, v in quoted.items() if k != "cvv"}),
    }


async def test_bare_values_of_the_calls_secret_fields__never_stored_sent_shown_or_exported(
    ledger_url: str,
    recorded: tuple[EmulatorServer, RecordingFront],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The probe's finding: ``ValueError(f"declined for {pin}")`` kept the bare value in
    ``error_detail`` (API, exports, ``calls list --json``), and ``ToolError(f"card {pin}
    declined")`` reached the model in clear: no shape, no field name beside the value. The
    call's own secret-field values are now masked as literals wherever its text is stored or
    sent. Tools run through the ledger against the emulator over HTTP with the real SDK; then
    every request the emulator received, every ledger column (but the arguments, kept whole
    for a re-run), the log, the audit API's list, detail and exports, and `toolledger calls
    list/show/export` are searched."""
    emulator, front = recorded
    capture_logs(caplog)
    monkeypatch.setenv("TOOLLEDGER_SECRET_FIELDS", json.dumps(sorted(SECRET_FIELDS)))
    quoted = [c for c in everything(db_password=False) if c.name in {f"field_{f}" for f in QUOTED_FIELDS}]
    assert len(quoted) == len(QUOTED_FIELDS)
    scenarios = quoting_scenarios()
    async with ToolLedger(
        canaries.registry, configured_settings(ledger_url, emulator.base_url), auto_migrate=False
    ) as ledger:
        for scenario in scenarios.values():
            scenario.session_id = await start_session(emulator, [(scenario.tool, scenario.arguments)])
        for name, scenario in scenarios.items():
            [action] = await pending(emulator, scenario.session_id)
            scenario.call_id = action.call_id
            report = await ledger.handle(scenario.session_id, action)
            if name in ("maybe_executed", "verify_hook_failed"):
                assert not report.submitted, "in doubt: nothing is sent, the call is unknown"
                continue
            assert report.submitted, name
            [scenario.payload] = accepted(emulator, scenario.session_id)
    # An operator settles the verified call in bulk, as `serve --api` would: its hook is asked
    # first, and fails.
    app = create_app(
        api_settings(
            ledger_url,
            emulator.base_url,
            secret_fields=SECRET_FIELDS,
            openai_api_key=SecretStr(CANARIES.api_key),
        ),
        registry=canaries.registry,
    )
    async with serving(app) as client:
        settled = await client.post(
            "/api/bulk/resolve",
            params={"session_id": scenarios["verify_hook_failed"].session_id},
            json={"kind": "error", "text": "not charged", "reason": "incident 5", "dry_run": False},
            headers=API_FULL,
        )
        assert settled.status_code == 200, settled.text
        assert settled.json()["counts"] == {"submitted": 1}
        [scenarios["verify_hook_failed"].payload] = accepted(
            emulator, scenarios["verify_hook_failed"].session_id
        )
    async with ToolLedger(
        canaries.registry, configured_settings(ledger_url, emulator.base_url), auto_migrate=False
    ) as ledger:
        stored = {n: (await ledger.store.for_session(s.session_id))[0] for n, s in scenarios.items()}
        trails = {n: await ledger.store.events(call.key) for n, call in stored.items()}

    app = create_app(api_settings(ledger_url, secret_fields=SECRET_FIELDS))
    async with serving(app) as client:
        listed = await client.get("/api/calls", params={"limit": 500}, headers=API_READ)
        details = [await client.get(f"/api/calls/{call.key}", headers=API_READ) for call in stored.values()]
        exports = [
            await client.get("/api/export", params={"format": fmt}, headers=API_READ)
            for fmt in ("jsonl", "csv")
        ]
    some = stored["value_error"].key
    commands = [
        ("calls", "list", "--json", "--limit", "500"),
        ("calls", "show", str(some), "--json"),
        ("calls", "export"),
    ]
    results = await asyncio.gather(
        *(asyncio.to_thread(run_cli, *command, database_url=ledger_url, timeout=60) for command in commands)
    )

    # What the model got: the ToolError's and NotExecuted's own words, the values masked.
    errors = {name: s.payload.get("error") for name, s in scenarios.items() if s.payload}
    assert errors["value_error"] == FAILED_MESSAGE
    assert errors["nested"] == FAILED_MESSAGE
    assert errors["tool_error"] == f"card {MASK} declined (cvv {MASK}, key {MASK})"
    assert errors["not_executed"] == f"card {MASK} was refused before anything was sent"
    assert errors["invalid"] == f"Invalid arguments: card_number: Value error, {MASK} is not a card number"
    # What the audit trail keeps: the traceback and the reason, the values masked.
    value_error = stored["value_error"].error_detail or ""
    assert f"ValueError: declined for {MASK}" in value_error
    assert f"ConnectionError: provider said no to '{MASK}' and '{MASK}'" in value_error
    assert stored["maybe_executed"].status is CallStatus.UNKNOWN
    [doubt] = [e.reason for e in trails["maybe_executed"] if e.to_status == CallStatus.UNKNOWN.value]
    assert doubt == f"handler raised MaybeExecuted: timed out charging {MASK} with {MASK}"
    # Its hook is asked when the run is in doubt, and again by the bulk resolution.
    hook_failures = [e.detail or "" for e in trails["verify_hook_failed"] if e.kind == "verify_failed"]
    assert len(hook_failures) == 2
    for detail in hook_failures:
        assert f"LookupError: the provider has no charge for {MASK}" in detail

    # The searches.
    assert scan_requests(front, quoted) >= len(scenarios) - 1
    assert results_sent(front) == len(scenarios) - 1, "every result but the unknown call's"
    whole_arguments = {
        s.call_id: json.dumps(s.arguments, sort_keys=True, separators=(",", ":")) for s in scenarios.values()
    }
    assert await scan_ledger(ledger_url, quoted, whole_arguments=whole_arguments, whole_results={})
    for answer in (listed, *details, *exports):
        assert answer.status_code == 200, answer.text
        assert hits(answer.text, quoted) == [], answer.request.url
    assert MASK in listed.text
    for command, result in zip(commands, results, strict=True):
        assert result.returncode == 0, (command, result.stderr)
        assert hits(result.stdout + result.stderr, quoted) == [], command
    assert hits(logged(caplog), quoted) == []


# ------------------------------------------------------- R13: `toolledger serve`


SERVE_TOOLS = [
    ("store_credentials", canaries.leaky_arguments()),
    ("raise_plain", {}),
    ("raise_chained", {}),
    ("raise_group", {}),
    ("raise_objects", {}),
    ("raise_tool_error", {}),
    ("raise_long_tool_error", {}),
    ("return_secrets", {}),
    ("database_error", {}),
    # The bare values of the call's own secret fields, quoted by the handler (issue 31).
    ("decline_quoting_values", canaries.quoted_arguments()),
    ("tool_error_quoting_values", canaries.quoted_arguments()),
    ("not_executed_quoting_values", canaries.quoted_arguments()),
    ("nested_quoting_values", canaries.nested_quoted_arguments()),
]


async def test_serve_subprocess__canaries_everywhere__none_in_its_output_the_ledger_the_requests_or_cli_json(
    postgres_url: str,
    recorded: tuple[EmulatorServer, RecordingFront],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`toolledger serve` (log level debug) with the API key, a database password and a custom
    secret field configured in its environment, then `status`, `reconcile` and
    `sessions list` with --json on the same ledger."""
    emulator, front = recorded
    found = everything(db_password=True)
    url = CANARIES.postgres_url(postgres_url)
    for name, value in {
        "TOOLLEDGER_OPENAI_API_KEY": CANARIES.api_key,
        "TOOLLEDGER_SECRET_FIELDS": json.dumps(sorted(SECRET_FIELDS)),
        SEED_VARIABLE: str(CANARIES.seed),
        PLANT_VARIABLE: "1",
    }.items():
        monkeypatch.setenv(name, value)
    canaries.plant(found)
    try:
        working = await start_session(emulator, SERVE_TOOLS)
        failing = await start_session(emulator, [("raise_plain", {})])
        emulator.control.fail_session(failing, f"Upstream failure: {canaries.leaky_text(every_shape=False)}")
        arguments_of = {name: arguments for name, arguments in SERVE_TOOLS}
    finally:
        canaries.plant(everything(db_password=False))

    serve = ServeProcess(
        url,
        emulator.base_url,
        tmp_path / "serve.log",
        extra_args=(
            *("--tools", "tests.chaos.canaries:registry", "--log-level", "debug"),
            *("--watch", working, "--watch", failing),
        ),
    )
    with serve:
        serve.wait_serving()

        async def answered() -> bool:
            return len(accepted(emulator, working)) == len(SERVE_TOOLS)

        await eventually(
            answered, within=30, what=lambda: f"serve did not answer every call:\n{serve.log()}", interval=0.1
        )

        async def stopped_following() -> bool:
            return "no longer watched" in serve.log()

        await eventually(
            stopped_following,
            within=30,
            what=lambda: f"serve did not stop following the failed session:\n{serve.log()}",
            interval=0.1,
        )
        serve.process.send_signal(signal.SIGTERM)
        assert serve.wait_exit(30) == 0
    log = serve.log()

    commands = [
        ("status", "--json"),
        ("reconcile", "--json"),
        ("sessions", "list", "--all", "--json"),
    ]
    results = await asyncio.gather(
        *(
            asyncio.to_thread(run_cli, *command, database_url=url, base_url=emulator.base_url, timeout=60)
            for command in commands
        )
    )
    for command, result in zip(commands, results, strict=True):
        assert result.returncode == 0, (command, result.stdout, result.stderr)
    status, summary = json.loads(results[0].stdout), json.loads(results[1].stdout)
    listed = [json.loads(line) for line in results[2].stdout.splitlines()]

    # It did the work: every call answered once, the failed session left with its reason.
    payloads = accepted(emulator, working)
    assert status["database_reachable"]
    assert status["calls"] == {"submitted": len(SERVE_TOOLS)}
    assert summary["errors"] == 0
    assert {row["session_id"]: row["watched"] for row in listed}[failing] is False
    [reason] = [row["reason"] for row in listed if row["session_id"] == failing]
    assert reason.startswith("session failed: Upstream failure: ")
    assert MASK in reason
    assert "serving:" in log
    assert "no longer watched" in log

    # The searches.
    for command, result in zip(commands, results, strict=True):
        assert hits(result.stdout + result.stderr, found) == [], command
    assert hits(log, found) == [], "serve's output (stdout and stderr)"
    calls = await _serve_calls(url, working)
    output_call = calls["return_secrets"]
    output = next(p["output"] for p in payloads if p["call_id"] == output_call)
    assert scan_requests(front, found, {output_call: output})
    # One result per tool was searched (serve sends a turn's results together, in fewer requests).
    assert results_sent(front) >= len(SERVE_TOOLS)
    whole_arguments = {
        calls[name]: json.dumps(arguments, sort_keys=True, separators=(",", ":"))
        for name, arguments in arguments_of.items()
    }
    whole_results = {
        output_call: json.dumps(
            next(p for p in payloads if p["call_id"] == output_call), separators=(",", ":")
        )
    }
    assert await scan_ledger(url, found, whole_arguments=whole_arguments, whole_results=whole_results)


async def _serve_calls(url: str, session_id: str) -> dict[str, str]:
    """Tool name -> call id, for the session's calls."""
    from toolledger.store.engine import create_engine
    from toolledger.store.ledger import LedgerStore

    engine = create_engine(url)
    try:
        return {
            c.tool_name: c.key.call_id for c in await LedgerStore(engine, actor="t").for_session(session_id)
        }
    finally:
        await engine.dispose()


# ------------------------------------------------- R14: random exceptions, Hypothesis


@dataclass(frozen=True)
class Raised:
    """An exception to raise, built afresh every time (an exception keeps its traceback)."""

    kind: str
    text: tuple[tuple[str, str], ...]
    """(planted, masked) pieces; the message is their join."""
    separator: str = " | "
    style: str = "text"
    """How the message is given: text, object (an argument whose repr carries it), mixed
    (several arguments), none."""
    cause: Raised | None = None
    context: Raised | None = None
    notes: tuple[str, ...] = ()
    members: tuple[Raised, ...] = ()

    @property
    def message(self) -> str:
        return self.separator.join(planted for planted, _ in self.text)

    @property
    def masked(self) -> str:
        return self.separator.join(masked for _, masked in self.text)


class CanaryError(Exception):
    """An application's own exception type."""


class EvilStr(Exception):
    """An exception whose text cannot be rendered: str() raises, quoting canaries."""

    def __str__(self) -> str:
        raise RuntimeError(self.args[0] if self.args else "no text")


class Refused(ToolError):
    """An application's ToolError subclass."""


class ToolErrorWithEvilStr(ToolError):
    def __str__(self) -> str:
        raise RuntimeError("str() of this ToolError fails")


class ToolErrorWithoutInit(ToolError):
    """A subclass that skipped ToolError.__init__: no ``message`` attribute."""

    def __init__(self, detail: str) -> None:
        Exception.__init__(self, detail)


class Probe(pydantic.BaseModel):
    value: int


PLAIN_KINDS: dict[str, type[Exception]] = {
    "ValueError": ValueError,
    "RuntimeError": RuntimeError,
    "KeyError": KeyError,
    "OSError": OSError,
    "TypeError": TypeError,
    "ConnectionError": ConnectionError,
    "TimeoutError": TimeoutError,
    "ZeroDivisionError": ZeroDivisionError,
    "AssertionError": AssertionError,
    "UnicodeError": UnicodeError,
    "NotImplementedError": NotImplementedError,
    "StopIteration": StopIteration,
    "CanaryError": CanaryError,
}
TOOL_ERROR_KINDS = ("ToolError", "Refused", "ToolErrorObject", "ToolErrorWithEvilStr", "ToolErrorWithoutInit")
VALUE_ERROR_KINDS = frozenset({"ValueError", "AssertionError", "UnicodeError", "ValidationError"})
"""Raised in a pydantic validator these become a ValidationError: a validation message."""
TYPED_OUTCOME_KINDS = ("NotExecuted", "MaybeExecuted")
"""NotExecuted's message goes to the model as a ToolError's; MaybeExecuted's to the audit
trail only (these idempotent tools then run again until given up)."""


def build(spec: Raised) -> Exception:
    message = spec.message
    error: Exception
    if spec.kind == "ToolError":
        error = ToolError(message)
    elif spec.kind == "Refused":
        error = Refused(message)
    elif spec.kind == "ToolErrorObject":
        error = ToolError(Leaky("Detail", message))  # type: ignore[arg-type]
    elif spec.kind == "ToolErrorWithEvilStr":
        error = ToolErrorWithEvilStr(message)
    elif spec.kind == "ToolErrorWithoutInit":
        error = ToolErrorWithoutInit(message)
    elif spec.kind == "NotExecuted":
        error = NotExecuted(message)
    elif spec.kind == "MaybeExecuted":
        error = MaybeExecuted(message)
    elif spec.kind == "EvilStr":
        error = EvilStr(message)
    elif spec.kind == "ValidationError":
        try:
            Probe.model_validate({"value": message})
        except pydantic.ValidationError as invalid:
            error = invalid
        else:  # pragma: no cover - a message is never an int
            raise AssertionError("expected a ValidationError")
    elif spec.kind == "Group":
        error = ExceptionGroup(message or "group", [build(member) for member in spec.members])
    else:
        kind = PLAIN_KINDS[spec.kind]
        if spec.style == "object":
            error = kind(Leaky("Secrets", message))
        elif spec.style == "mixed":
            error = kind(
                message, {"password": CANARIES.fields["password"], "detail": message}, [Leaky("X", message)]
            )
        elif spec.style == "none":
            error = kind()
        else:
            error = kind(message)
    for note in spec.notes:
        error.add_note(note)
    return error


def throw(spec: Raised) -> NoReturn:
    error = build(spec)
    cause = build(spec.cause) if spec.cause is not None else None
    if spec.context is not None:
        try:
            throw(spec.context)
        except BaseException:
            if cause is not None:
                raise error from cause
            raise error  # noqa: B904 - the context is the point
    if cause is not None:
        raise error from cause
    raise error


def expected_error(stage: str, spec: Raised) -> str | None:
    """What the model must get; None for a validation message (checked by its properties)."""
    if spec.kind in TOOL_ERROR_KINDS:
        message = f"Detail({spec.masked})" if spec.kind == "ToolErrorObject" else spec.masked
        return capped(message) if message else FAILED_MESSAGE
    if spec.kind == "NotExecuted":
        return capped(spec.masked) if spec.masked else NOT_EXECUTED_MESSAGE
    if spec.kind == "MaybeExecuted":
        return POISON_MESSAGE
    if stage == "arguments" and spec.kind in VALUE_ERROR_KINDS:
        return None
    return OUTPUT_FAILED_MESSAGE if stage == "output" else FAILED_MESSAGE


@dataclass
class Plan:
    spec: Raised | None = None


PLAN = Plan()


def _raise_planned() -> NoReturn:
    assert PLAN.spec is not None
    throw(PLAN.spec)


class UnreadableOutput(Mapping[str, Any]):
    """A handler's return value whose conversion to the tool's output raises the planned
    exception (the SDK reads a Mapping that is not a dict with ``dict()``)."""

    def __getitem__(self, key: str) -> Any:
        _raise_planned()

    def __iter__(self) -> Iterator[str]:
        _raise_planned()

    def __len__(self) -> int:
        return 1


STAGES = ("arguments", "execution", "output")
MODES = ("sync", "async")


def r14_registry() -> ToolRegistry:
    """For each stage, a sync and an async tool raising the planned exception there."""
    registry = ToolRegistry()

    class Arguments(pydantic.BaseModel):
        value: str

        @pydantic.field_validator("value")
        @classmethod
        def _check(cls, value: str) -> str:
            _raise_planned()

    def arguments_sync(arguments: Arguments) -> str:
        return "unreachable"

    async def arguments_async(arguments: Arguments) -> str:
        return "unreachable"

    registry.add_model(Arguments, arguments_sync, name="arguments_sync", effect="idempotent")
    registry.add_model(Arguments, arguments_async, name="arguments_async", effect="idempotent")

    @registry.tool(name="execution_sync", effect="idempotent")
    def execution_sync(value: str) -> str:
        _raise_planned()

    @registry.tool(name="execution_async", effect="idempotent")
    async def execution_async(value: str) -> str:
        _raise_planned()

    @registry.tool(name="output_sync", effect="idempotent")
    def output_sync(value: str) -> Any:
        return UnreadableOutput()

    @registry.tool(name="output_async", effect="idempotent")
    async def output_async(value: str) -> Any:
        return UnreadableOutput()

    return registry


R14_CANARIES = everything(db_password=False)
"""All of them but the database password (this ledger is a SQLite file)."""
ALL_PIECES = [planting for canary in R14_CANARIES for planting in canary.plantings]
UNCONFIGURED_PIECES = [
    planting for canary in R14_CANARIES if not canary.configured for planting in canary.plantings
]
"""For the text of a ValueError raised in a validator: the validation message is redacted
with the default redactor only (executor.py does not pass the configured one; see the report)."""
FIRST_PIECES = [canary.plantings[0] for canary in R14_CANARIES]
"""The input of a ValidationError: pydantic shows a long input cut in the middle, and only a
secret whose shape survives the cut can be recognised (a field name cut off cannot)."""
BENIGN_PIECES = [
    (text, text)
    for text in (
        "upstream refused the request",
        "order A1 for 5 EUR",
        "retry in 2s",
        "naïve café ☕",
        "call_abc123",
        "see https://status.example.com/incidents/42",
        "",
    )
]
SEPARATORS = (" | ", "\n", "; ", " -- ", "\t")


@st.composite
def raised(draw: st.DrawFn, depth: int = 0, *, validator: bool = False) -> Raised:
    kinds = [*PLAIN_KINDS, *TOOL_ERROR_KINDS, *TYPED_OUTCOME_KINDS, "EvilStr", "ValidationError"]
    if depth < 2:
        kinds.append("Group")
    kind = draw(st.sampled_from(kinds))
    text: tuple[tuple[str, str], ...]
    if kind == "ValidationError":
        pool = [p for p in FIRST_PIECES if p in UNCONFIGURED_PIECES] if validator else FIRST_PIECES
        text = (draw(st.sampled_from(pool)),)
    else:
        pool = UNCONFIGURED_PIECES if validator and kind in VALUE_ERROR_KINDS else ALL_PIECES
        text = tuple(draw(st.lists(st.sampled_from(pool + BENIGN_PIECES), max_size=5)))
    nested = depth < 2
    return Raised(
        kind=kind,
        text=text,
        separator=draw(st.sampled_from(SEPARATORS)),
        style=draw(st.sampled_from(["text", "object", "mixed", "none"])) if kind in PLAIN_KINDS else "text",
        cause=draw(st.none() | raised(depth + 1)) if nested else None,
        context=draw(st.none() | raised(depth + 1)) if nested else None,
        notes=tuple(draw(st.lists(st.sampled_from([p for p, _ in ALL_PIECES]), max_size=2))),
        members=tuple(draw(st.lists(raised(depth + 1), min_size=1, max_size=3))) if kind == "Group" else (),
    )


@dataclass(frozen=True)
class Case:
    stage: str
    mode: str
    spec: Raised


@st.composite
def cases(draw: st.DrawFn) -> Case:
    stage = draw(st.sampled_from(STAGES))
    return Case(stage, draw(st.sampled_from(MODES)), draw(raised(validator=stage == "arguments")))


R14_EXAMPLES = 120


def test_random_exceptions_at_each_stage__the_model_gets_the_fixed_message_or_a_redacted_capped_tool_error(
    sqlite_url: str, recorded: tuple[EmulatorServer, RecordingFront]
) -> None:
    """R14 over HTTP: each example is a new session whose one call raises a random exception
    (type, nesting, canaries) while validating arguments, running, or converting the output;
    the emulator's record of what it received is compared with what the model may get."""
    emulator, front = recorded
    for stage in STAGES:
        for mode in MODES:
            emulator.control.register_script(
                f"r14-{stage}-{mode}", Script.of_calls([(f"{stage}_{mode}", {"value": "x"})])
            )
    ran: list[Case] = []

    with asyncio.Runner() as runner:
        ledger = ToolLedger(
            r14_registry(), configured_settings(sqlite_url, emulator.base_url), auto_migrate=False
        )
        runner.run(ledger.start())
        driver = AsyncOpenAI(base_url=emulator.base_url, api_key=DRIVER_KEY, max_retries=0)

        async def one(case: Case) -> None:
            PLAN.spec = case.spec
            session = await driver.beta.agents.sessions.create(
                environment={"type": "none"},
                agent={"model": "emulated"},
                metadata={"emulator_script": f"r14-{case.stage}-{case.mode}"},
                input="go",
            )
            [action] = await wait_for_actions(driver, session.id)
            report = await ledger.handle(session.id, action)
            call = await ledger.store.get(report.key)
            trail = await ledger.store.events(report.key)
            [received] = [r for r in emulator.control.tool_results(session.id) if r.outcome == "accepted"]
            payload = received.payload

            assert payload["success"] is False
            error = payload["error"]
            expected = expected_error(case.stage, case.spec)
            if expected is None:
                assert error.startswith("Invalid arguments: ")
            else:
                assert error == expected
            assert len(error) <= TOOL_ERROR_MAX_CHARS
            assert hits(json.dumps(payload), R14_CANARIES) == []
            assert call is not None
            assert call.payload == payload, "stored and sent: the same bytes"
            kept = [
                call.error_detail or "",
                *(e.reason or "" for e in trail),
                *(e.detail or "" for e in trail),
            ]
            assert hits("\n".join(kept), R14_CANARIES) == []
            ran.append(case)

        @settings(
            max_examples=R14_EXAMPLES,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(case=cases())
        def check(case: Case) -> None:
            runner.run(one(case))

        try:
            check()
        finally:
            runner.run(driver.close())
            runner.run(ledger.close())

    assert len(ran) >= R14_EXAMPLES // 2
    assert {c.stage for c in ran} == set(STAGES)
    assert scan_requests(front, R14_CANARIES) >= len(ran)
