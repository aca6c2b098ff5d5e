"""Hostile inputs at the executor (RELIABILITY.md R11 and R12): malformed and oversized tool
arguments, and oversized outputs, handled by a real ToolLedger on real SQLite and PostgreSQL,
with calls delivered by the emulator over HTTP and read with the real SDK.

For every malformed call: the handler never runs, the call ends ``submitted`` with a failure
result at stage ``arguments`` that does not echo the argument values, the stored row reads back,
and the same ToolLedger then handles a normal call of the same session.

Cases whose correct behaviour the code does not have yet are marked ``xfail(strict=True)`` with
the cause; a fix turns them into XPASS, which fails the run until the mark is removed.
"""

from __future__ import annotations

import hashlib
import json
import re
import resource
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pydantic
import pytest
from openai import AsyncOpenAI
from openai.lib.beta.agents import FunctionTool

from tests.support.executor_harness import FunctionCallAction, running_ledger, wait_for_actions
from toolledger.domain.results import OUTPUT_TOO_LARGE_MESSAGE, TOOL_ERROR_MAX_CHARS
from toolledger.domain.states import CallStatus
from toolledger.emulator import EmulatorServer, Script
from toolledger.emulator.app import MAX_BODY_BYTES
from toolledger.runtime.registry import ToolRegistry
from toolledger.runtime.tool_ledger import ToolLedger

CANARY = "zebra-CANARY-4711-quokka"
"""Placed in the arguments (or outputs) of every case: it must never come back in a result.
Not shaped like a credential, so redaction cannot be what hides it."""

KIB = 1024
MIB = 1024 * KIB
ARGUMENTS_LIMIT = 256 * KIB
"""R12: arguments larger than this are refused before the handler runs."""
DEFAULT_OUTPUT_LIMIT = 1 * MIB
"""R12, and Settings.max_output_bytes by default."""
VALID = {"cents": 1, "currency": "EUR"}


# ----------------------------------------------------------------------------- tools


class Address(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    street: str
    zip_code: int


class Shipment(pydantic.BaseModel):
    """Ship an order. The model's author forbids extra fields, so they are an error here."""

    model_config = pydantic.ConfigDict(extra="forbid")

    order_id: str
    weight_kg: float
    address: Address


class NoArguments(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")


def hostile_registry(invocations: list[str]) -> ToolRegistry:
    """A typed tool and a pydantic-model tool; each run is appended to ``invocations``."""
    registry = ToolRegistry()

    @registry.tool(effect="idempotent")
    def transfer(cents: int, currency: str, note: str = "", rate: float = 1.0) -> str:
        invocations.append("transfer")
        return f"transferred {cents} {currency}"

    def ship(shipment: Shipment) -> str:
        invocations.append("ship")
        return "shipped"

    registry.add_model(Shipment, ship, name="ship", effect="idempotent")
    return registry


# ------------------------------------------------------------------------- emulator


def place_script(emulator: EmulatorServer, script: Script) -> str:
    """Register the script under a fresh name and return the name.

    The control API answers 413 to bodies over MAX_BODY_BYTES, as a front proxy would; a
    model may still produce a larger call, so such a script is put into the emulator's state
    directly. Either way the call then reaches the ledger over HTTP, read by the real SDK.
    """
    name = f"hostile-{uuid.uuid4().hex}"
    if len(script.model_dump_json()) < MAX_BODY_BYTES - 64 * KIB:
        emulator.control.register_script(name, script)
    else:
        emulator._server._state.scripts[name] = script
    return name


async def start_session(
    emulator: EmulatorServer, *steps: list[tuple[str, Any]]
) -> tuple[str, FunctionCallAction]:
    """A session whose first step's (single) call is pending; later steps follow its result."""
    name = place_script(emulator, Script.of_calls(*steps))
    async with AsyncOpenAI(base_url=emulator.base_url, api_key="sk-test", max_retries=0) as client:
        session = await client.beta.agents.sessions.create(
            environment={"type": "none"},
            agent={"model": "emulated"},
            metadata={"emulator_script": name},
            input="go",
        )
        [action] = await wait_for_actions(client, session.id)
        return session.id, action


async def next_action(emulator: EmulatorServer, session_id: str) -> FunctionCallAction:
    async with AsyncOpenAI(base_url=emulator.base_url, api_key="sk-test", max_retries=0) as client:
        [action] = await wait_for_actions(client, session_id)
        return action


def accepted(emulator: EmulatorServer, session_id: str, call_id: str) -> list[dict[str, Any]]:
    return [
        r.payload
        for r in emulator.control.tool_results(session_id)
        if r.outcome == "accepted" and r.call_id == call_id
    ]


def peak_rss_mib() -> float:
    """The process's peak resident set so far (ru_maxrss is in KiB on Linux). A growth of this
    peak understates a test's use when an earlier test of the run peaked higher; run alone, the
    decorated-tool generator test below shows ~535 MiB, the plain FunctionTool one ~8 MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ------------------------------------------------------------------- R11: the cases


@dataclass(frozen=True)
class Hostile:
    id: str
    tool: str
    arguments: Any
    """A str is delivered as it is (it need not be JSON); anything else as that JSON value."""
    bug: str | None = None
    """Why the code gets this case wrong today: the case is then a strict xfail."""
    raises: type[BaseException] = AssertionError


def t(fields: str) -> str:
    """Arguments text for ``transfer``: valid cents and currency, plus ``fields``."""
    return '{"cents":1,"currency":"EUR",' + fields + "}"


NOTE = f'"note":"{CANARY}"'
SHIP_OK: dict[str, Any] = {
    "order_id": "A1",
    "weight_kg": 2.5,
    "address": {"street": "Main St", "zip_code": 1},
}


R11_CASES: list[Hostile] = [
    # Not JSON at all.
    Hostile("not_json", "transfer", f"cents=1&currency=EUR&note={CANARY}"),
    Hostile("truncated_json", "transfer", '{"cents":1,"currency":"EUR","note":"' + CANARY),
    Hostile("single_quotes", "transfer", "{'cents': 1, 'currency': 'EUR', 'note': '" + CANARY + "'}"),
    Hostile("trailing_comma", "transfer", t(NOTE + ",")),
    Hostile("empty_string", "transfer", ""),
    Hostile("whitespace_only", "transfer", " \t\r\n "),
    # RFC 8259 lets a parser ignore a BOM that starts a JSON document read from bytes; this
    # BOM is a character inside the arguments string, which is then not a JSON text: refused
    # (json.loads agrees), rather than guessing what the model meant.
    Hostile("bom_prefix", "transfer", "\ufeff" + t(NOTE)),
    Hostile("invalid_escape", "transfer", t(f'"note":"\\x41 {CANARY}"')),
    Hostile("invalid_unicode_escape", "transfer", t(f'"note":"\\uZZZZ {CANARY}"')),
    Hostile("raw_newline_in_string", "transfer", t(f'"note":"{CANARY}\nline two"')),
    Hostile(
        "raw_nul_in_string",
        "transfer",
        t(f'"note":"{CANARY}\x00"'),
    ),
    # JSON, but not an object.
    Hostile("array_text", "transfer", f'["{CANARY}", 1]'),
    Hostile("string_text", "transfer", f'"{CANARY}"'),
    Hostile("double_encoded_object", "transfer", json.dumps(json.dumps({**VALID, "note": CANARY}))),
    Hostile("number_text", "transfer", "42"),
    Hostile("null_text", "transfer", "null"),
    Hostile("true_text", "transfer", "true"),
    Hostile("array_value", "transfer", [CANARY, 1]),
    Hostile("number_value", "transfer", 42),
    Hostile("null_value", "transfer", None),
    Hostile("true_value", "transfer", True),
    # Numbers JSON cannot hold.
    Hostile("nan_literal", "transfer", t('"rate":NaN,' + NOTE)),
    Hostile("infinity_literal", "transfer", t('"rate":Infinity,' + NOTE)),
    Hostile("negative_infinity_literal", "transfer", t('"rate":-Infinity,' + NOTE)),
    # Valid JSON grammar, but no finite double holds it: a demanding user wants it refused like
    # Infinity rather than handed to the handler as inf.
    Hostile("number_overflowing_to_infinity", "transfer", t('"rate":1e999,' + NOTE)),
    Hostile(
        "nan_in_model_field",
        "ship",
        '{"order_id":"A1","weight_kg":NaN,"address":{"street":"' + CANARY + '","zip_code":1}}',
    ),
    Hostile(
        "integer_of_5000_digits", "transfer", '{"cents":' + "9" * 5000 + ',"currency":"EUR",' + NOTE + "}"
    ),
    # Duplicate keys: RFC 8259 leaves their meaning undefined and parsers differ (first wins,
    # last wins, error), so a check upstream and the handler may see different values. A
    # demanding user wants them refused, not silently resolved.
    Hostile(
        "duplicate_keys",
        "transfer",
        '{"cents":1,"cents":2,"currency":"EUR",' + NOTE + "}",
    ),
    # Depth 10,000, far past the interpreter's recursion limit.
    Hostile(
        "nesting_depth_10000",
        "transfer",
        t(NOTE + ',"deep":' + "[" * 10_000 + "]" * 10_000),
    ),
    Hostile(
        "nesting_depth_500_in_a_str_field", "transfer", t('"note":' + "[" * 500 + f'"{CANARY}"' + "]" * 500)
    ),
    # ~10 MiB: refused because the field is not declared (stresses storage on both databases).
    Hostile("ten_mib_string_in_extra_field", "transfer", t(NOTE + ',"blob":"' + "x" * (10 * MIB) + '"')),
    # ~10 MiB in a declared str field: only a size limit (R12) can refuse it.
    Hostile("ten_mib_string_value", "transfer", t(f'"note":"{CANARY}' + "x" * (10 * MIB) + '"')),
    # Surrogates: \ud800 alone, and \udcff, which is how undecodable bytes (invalid UTF-8) look
    # once decoded with surrogateescape; a str cannot carry invalid UTF-8 any other way.
    Hostile("lone_high_surrogate_value", "transfer", t(f'"note":"{CANARY}\\ud800"')),
    Hostile("lone_low_surrogate_value", "transfer", t(f'"note":"{CANARY}\\udcff"')),
    Hostile("reversed_surrogate_pair_value", "transfer", t(f'"note":"{CANARY}\\udc00\\ud800"')),
    Hostile("lone_surrogate_key", "transfer", t(f'"\\ud800":"{CANARY}"')),
    # \u0000: PostgreSQL text and jsonb refuse NUL, so the insert must not crash; and R11 counts
    # it as malformed: no model-written text argument means a NUL, and few stores downstream
    # accept one, so a demanding user wants it refused at the boundary.
    Hostile("nul_escape_in_key", "transfer", t(f'"no\\u0000te":"{CANARY}"')),
    Hostile(
        "nul_escape_in_value",
        "transfer",
        t(f'"note":"{CANARY}\\u0000"'),
    ),
    # A key name is echoed in the error (it tells the model which field to drop), but the
    # error must stay as small as any other model-facing error.
    Hostile(
        "very_long_key_name",
        "transfer",
        t(f'"{"k" * 100_000}":"{CANARY}"'),
    ),
    Hostile("many_extra_keys", "transfer", t(",".join(f'"x{i}":"{CANARY}"' for i in range(1000)))),
    # Wrong, missing and extra fields against the typed tool.
    Hostile("wrong_type", "transfer", {"cents": CANARY, "currency": "EUR"}),
    Hostile("fractional_int", "transfer", {"cents": 1.5, "currency": "EUR", "note": CANARY}),
    Hostile("null_for_required", "transfer", {"cents": None, "currency": "EUR", "note": CANARY}),
    Hostile("object_for_str", "transfer", {"cents": 1, "currency": {"code": CANARY}}),
    Hostile("missing_field", "transfer", {"cents": 1, "note": CANARY}),
    Hostile("empty_object", "transfer", {}),
    Hostile("extra_field", "transfer", {**VALID, "note": "ok", "admin": CANARY}),
    # ... and against the pydantic-model tool.
    Hostile("model_wrong_type", "ship", {**SHIP_OK, "weight_kg": CANARY}),
    Hostile("model_missing_field", "ship", {"order_id": CANARY, "weight_kg": 1.0}),
    Hostile("model_extra_field", "ship", {**SHIP_OK, "coupon": CANARY}),
    Hostile(
        "model_nested_wrong_type", "ship", {**SHIP_OK, "address": {"street": CANARY, "zip_code": CANARY}}
    ),
    Hostile(
        "model_nested_extra_field",
        "ship",
        {**SHIP_OK, "address": {"street": "x", "zip_code": 1, "x": CANARY}},
    ),
    Hostile("model_array_text", "ship", f'["{CANARY}"]'),
]


def r11_params() -> list[Any]:
    params = []
    for case in R11_CASES:
        marks = (
            [pytest.mark.xfail(strict=True, reason=case.bug, raises=case.raises)]
            if case.bug is not None
            else []
        )
        params.append(pytest.param(case, id=case.id, marks=marks))
    return params


@pytest.mark.parametrize("case", r11_params())
async def test_malformed_arguments__each_hostile_shape__refused_at_stage_arguments_and_worker_stays_up(
    database_url: str, emulator: EmulatorServer, case: Hostile
) -> None:
    invocations: list[str] = []
    session_id, action = await start_session(emulator, [(case.tool, case.arguments)], [("transfer", VALID)])
    async with running_ledger(
        hostile_registry(invocations), database_url, emulator, resubmit_after_seconds=600
    ) as ledger:
        report = await ledger.handle(session_id, action)
        ran_for_malformed = list(invocations)
        redelivered = await ledger.handle(session_id, action)
        call = await ledger.store.get(report.key)
        normal_action = await next_action(emulator, session_id)
        normal = await ledger.handle(session_id, normal_action)

    # The worker stays up: the same ToolLedger runs the session's next, valid call.
    assert normal.action == "executed"
    assert [p["success"] for p in accepted(emulator, session_id, normal_action.call_id)] == [True]
    # The stored row reads back, as exactly what the session accepted.
    assert call is not None
    [payload] = accepted(emulator, session_id, action.call_id)
    assert call.payload == payload
    assert call.status is CallStatus.SUBMITTED
    # A redelivery of the same call is recognised (a stable fingerprint), not run or refused.
    assert redelivered.action == "already_submitted"
    # Refused before the handler, at stage arguments, with a clear error that echoes nothing.
    assert ran_for_malformed == []
    assert invocations == ["transfer"]
    assert report.action == "executed"
    assert report.submitted
    assert call.error_stage == "arguments"
    assert payload["success"] is False
    assert payload["error"].startswith("Invalid arguments")
    assert len(payload["error"]) <= TOOL_ERROR_MAX_CHARS
    assert CANARY not in json.dumps(payload)
    assert call.result is not None
    assert CANARY not in call.result
    assert CANARY not in (call.error_detail or "")


async def test_duplicate_keys__redelivered__fingerprinted_consistently(
    database_url: str, emulator: EmulatorServer
) -> None:
    """Whatever duplicate keys mean, the same text is the same call and swapped values are not."""
    invocations: list[str] = []
    text = '{"cents":1,"cents":2,"currency":"EUR"}'
    session_id, action = await start_session(emulator, [("transfer", text)])
    async with running_ledger(
        hostile_registry(invocations), database_url, emulator, resubmit_after_seconds=600
    ) as ledger:
        await ledger.handle(session_id, action)
        same = await ledger.handle(session_id, action.model_copy(update={"arguments": text}))
        swapped = await ledger.handle(
            session_id, action.model_copy(update={"arguments": '{"cents":2,"cents":1,"currency":"EUR"}'})
        )
        events = await ledger.store.events(same.key)

    assert same.action == "already_submitted"
    assert swapped.action == "refused_arguments_mismatch"
    assert [e.kind for e in events].count("arguments_mismatch") == 1
    assert len(invocations) <= 1
    assert len(accepted(emulator, session_id, action.call_id)) == 1


SECRET = "sk-proj-CANARYCANARYCANARY"  # noqa: S105 - a canary, not a credential


async def test_malformed_arguments__stored__as_sha256_and_a_bounded_redacted_preview_only(
    database_url: str, emulator: EmulatorServer
) -> None:
    text = f"api_key={SECRET}&padding=" + "x" * MIB  # not JSON
    session_id, action = await start_session(emulator, [("transfer", text)])
    async with running_ledger(hostile_registry([]), database_url, emulator) as ledger:
        report = await ledger.handle(session_id, action)
        call = await ledger.store.get(report.key)

    assert call is not None
    assert call.error_stage == "arguments"
    assert call.arguments_sha256 == hashlib.sha256(text.encode()).hexdigest()
    assert len(call.arguments) < 64 * KIB
    assert SECRET not in call.arguments


# --------------------------------------------------------------- R12: argument size


async def _run_one(
    ledger: ToolLedger, emulator: EmulatorServer, session_id: str, action: FunctionCallAction
) -> dict[str, Any]:
    report = await ledger.handle(session_id, action)
    call = await ledger.store.get(report.key)
    [payload] = accepted(emulator, session_id, action.call_id)
    assert call is not None
    assert call.status is CallStatus.SUBMITTED
    assert call.payload == payload
    return {"payload": payload, "stage": call.error_stage, "result": call.result}


async def test_arguments__over_256_kib__refused_before_the_handler_runs_with_a_clear_message(
    database_url: str, emulator: EmulatorServer
) -> None:
    invocations: list[str] = []
    arguments = t(f'"note":"{CANARY}' + "x" * ARGUMENTS_LIMIT + '"')
    assert len(arguments.encode()) > ARGUMENTS_LIMIT
    session_id, action = await start_session(emulator, [("transfer", arguments)])
    async with running_ledger(hostile_registry(invocations), database_url, emulator) as ledger:
        done = await _run_one(ledger, emulator, session_id, action)

    assert invocations == []
    assert done["stage"] == "arguments"
    error = done["payload"]["error"]
    assert error.startswith("Invalid arguments")
    assert re.search(r"too large|size|limit|KiB|bytes", error, re.IGNORECASE), error
    assert CANARY not in json.dumps(done["payload"])


async def test_arguments__just_under_256_kib__are_run(database_url: str, emulator: EmulatorServer) -> None:
    """The other side of the limit: large but allowed arguments still reach the handler."""
    invocations: list[str] = []
    arguments = t('"note":"' + "x" * (ARGUMENTS_LIMIT - 100) + '"')
    assert len(arguments.encode()) < ARGUMENTS_LIMIT
    session_id, action = await start_session(emulator, [("transfer", arguments)])
    async with running_ledger(hostile_registry(invocations), database_url, emulator) as ledger:
        done = await _run_one(ledger, emulator, session_id, action)

    assert invocations == ["transfer"]
    assert done["payload"] == {**done["payload"], "success": True, "output": "transferred 1 EUR"}


# ----------------------------------------------------------------- R12: output size


class Bulky(pydantic.BaseModel):
    blob: str


ENV_OUTPUT_LIMIT = 64 * KIB


def _oversized_outputs() -> dict[str, Any]:
    over = ENV_OUTPUT_LIMIT + 1
    return {
        "ascii_str": CANARY + "x" * over,
        # Fewer characters than the limit, more bytes: the limit counts UTF-8 bytes.
        "multibyte_str": CANARY + "é" * (ENV_OUTPUT_LIMIT // 2 + 1),
        "dict": {"rows": [CANARY] * (over // len(CANARY))},
        "list": [CANARY] * (over // len(CANARY)),
        "pydantic_model": Bulky(blob=CANARY + "x" * over),
        "content_array": [{"type": "input_text", "text": CANARY + "x" * over}],
        "iterator": iter([CANARY] * (over // len(CANARY))),
    }


@pytest.mark.parametrize("shape", list(_oversized_outputs()))
async def test_output__over_toolledger_max_output_bytes__fails_at_stage_output(
    sqlite_url: str, emulator: EmulatorServer, monkeypatch: pytest.MonkeyPatch, shape: str
) -> None:
    """The cap does not depend on the database (the 1 MiB boundary below runs on both)."""
    monkeypatch.setenv("TOOLLEDGER_MAX_OUTPUT_BYTES", str(ENV_OUTPUT_LIMIT))
    registry = ToolRegistry()
    runs: list[str] = []

    @registry.tool(effect="idempotent")
    def report() -> Any:
        runs.append(shape)
        return _oversized_outputs()[shape]

    session_id, action = await start_session(emulator, [("report", {})], [("report", {})])
    async with running_ledger(registry, sqlite_url, emulator, resubmit_after_seconds=600) as ledger:
        assert ledger.settings.max_output_bytes == ENV_OUTPUT_LIMIT
        done = await _run_one(ledger, emulator, session_id, action)
        # The worker stays up: it handles the session's next call.
        follow_up = await ledger.handle(session_id, await next_action(emulator, session_id))

    assert runs == [shape, shape]
    assert done["stage"] == "output"
    assert done["payload"]["success"] is False
    assert done["payload"]["error"] == OUTPUT_TOO_LARGE_MESSAGE
    assert CANARY not in done["result"]
    assert follow_up.action == "executed"


@pytest.mark.parametrize(
    ("size", "success"), [(DEFAULT_OUTPUT_LIMIT, True), (DEFAULT_OUTPUT_LIMIT + 1, False)]
)
async def test_output__at_or_one_byte_over_the_default_1_mib__sent_or_refused_at_stage_output(
    database_url: str, emulator: EmulatorServer, size: int, success: bool
) -> None:
    registry = ToolRegistry()
    registry.tool(name="report", effect="idempotent")(lambda: "x" * size)
    session_id, action = await start_session(emulator, [("report", {})])
    async with running_ledger(registry, database_url, emulator) as ledger:
        assert ledger.settings.max_output_bytes == DEFAULT_OUTPUT_LIMIT
        done = await _run_one(ledger, emulator, session_id, action)

    assert done["payload"]["success"] is success
    if success:
        assert done["payload"]["output"] == "x" * size
        assert done["stage"] is None
    else:
        assert done["payload"]["error"] == OUTPUT_TOO_LARGE_MESSAGE
        assert done["stage"] == "output"


TEN_MILLION = 10**7
RSS_GROWTH_LIMIT_MIB = 200


class Counted:
    """A generator of 10^7 items that counts how many were pulled from it."""

    def __init__(self) -> None:
        self.pulled = 0

    def items(self) -> Iterator[int]:
        for i in range(TEN_MILLION):
            self.pulled += 1
            yield i


async def test_output__generator_of_10_million_items_from_a_plain_function_tool__cut_off_at_the_cap(
    sqlite_url: str, emulator: EmulatorServer
) -> None:
    """An SDK FunctionTool registered as it is returns its handler's value unconverted:
    normalize_output's bounded read stops pulling soon after the cap."""
    source = Counted()
    registry = ToolRegistry()
    registry.add(
        FunctionTool(NoArguments, lambda _: source.items(), name="stream", description="Stream rows."),
        effect="idempotent",
    )
    session_id, action = await start_session(emulator, [("stream", {})])
    before = peak_rss_mib()
    async with running_ledger(registry, sqlite_url, emulator) as ledger:
        done = await _run_one(ledger, emulator, session_id, action)
    growth = peak_rss_mib() - before

    assert done["stage"] == "output"
    assert done["payload"]["error"] == OUTPUT_TOO_LARGE_MESSAGE
    assert 0 < source.pulled <= DEFAULT_OUTPUT_LIMIT + 1
    assert growth < RSS_GROWTH_LIMIT_MIB, f"peak RSS grew by {growth:.0f} MiB"


async def test_output__generator_of_10_million_items_from_a_decorated_tool__cut_off_without_materialising(
    sqlite_url: str, emulator: EmulatorServer
) -> None:
    source = Counted()
    registry = ToolRegistry()

    @registry.tool(effect="idempotent")
    def stream() -> Iterator[int]:
        return source.items()

    session_id, action = await start_session(emulator, [("stream", {})])
    before = peak_rss_mib()
    async with running_ledger(registry, sqlite_url, emulator) as ledger:
        done = await _run_one(ledger, emulator, session_id, action)
    growth = peak_rss_mib() - before

    # Refused, in any case: the result is small and the worker survives.
    assert done["stage"] == "output"
    assert done["payload"]["error"] == OUTPUT_TOO_LARGE_MESSAGE
    # ... but the cap must apply while reading, not after everything was pulled.
    assert source.pulled <= DEFAULT_OUTPUT_LIMIT + 1, (
        f"pulled {source.pulled:,} items; peak RSS grew by {growth:.0f} MiB"
    )
    assert growth < RSS_GROWTH_LIMIT_MIB, f"peak RSS grew by {growth:.0f} MiB"
