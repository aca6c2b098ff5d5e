"""OpenTelemetry spans per call (the optional extra), recorded by the SDK's in-memory exporter
while real calls run through the ledger against the emulator: one call span with a handler
span and a submit span under it, named by their ids; no argument, output or exception text."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.support.executor_harness import pending_actions, running_ledger
from toolledger import ToolContext
from toolledger.emulator import EmulatorServer
from toolledger.runtime.registry import ToolRegistry

trace = pytest.importorskip("opentelemetry.trace")
sdk_trace = pytest.importorskip("opentelemetry.sdk.trace")
in_memory = pytest.importorskip("opentelemetry.sdk.trace.export.in_memory_span_exporter")
export = pytest.importorskip("opentelemetry.sdk.trace.export")

CANARY = "card_number=4000-trace-canary-0001"

_EXPORTER = in_memory.InMemorySpanExporter()


@pytest.fixture(scope="module", autouse=True)
def _provider() -> None:
    # The global provider can be set once per process: one exporter, cleared per test.
    provider = sdk_trace.TracerProvider()
    provider.add_span_processor(export.SimpleSpanProcessor(_EXPORTER))
    trace.set_tracer_provider(provider)


@pytest.fixture
def exporter() -> Iterator[object]:
    _EXPORTER.clear()
    yield _EXPORTER
    _EXPORTER.clear()


registry = ToolRegistry()


@registry.tool(effect="idempotent")
def lookup(order_id: str, ctx: ToolContext) -> str:
    """Look up an order."""
    return f"order {order_id}: {CANARY}"


@registry.tool(effect="at_most_once")
def charge(cents: int, ctx: ToolContext) -> str:
    """Charge a card."""
    raise RuntimeError(f"gateway said {CANARY}")


async def test_call_spans__nest_and_name_the_call_without_its_data(
    emulator: EmulatorServer, sqlite_url: str, exporter: object
) -> None:
    session_id, actions = await pending_actions(
        emulator, [("lookup", {"order_id": CANARY}), ("charge", {"cents": 5})]
    )
    async with running_ledger(registry, sqlite_url, emulator) as ledger:
        for action in actions:
            await ledger.handle(session_id, action)

    # FastAPI (the emulator) traces its requests too: only ours are looked at.
    spans = [span for span in _EXPORTER.get_finished_spans() if span.name.startswith("toolledger.")]
    by_call: dict[str, dict[str, object]] = {}
    for span in spans:
        attributes = dict(span.attributes or {})
        by_call.setdefault(str(attributes["toolledger.call_id"]), {})[span.name] = span
        status = str(span.status.description)
        dumped = json.dumps({"name": span.name, "attributes": attributes, "status": status})
        assert "4000-trace-canary" not in dumped, dumped
        assert "gateway said" not in dumped

    assert set(by_call) == {action.call_id for action in actions}
    for action in actions:
        mine = by_call[action.call_id]
        assert set(mine) == {"toolledger.call", "toolledger.handler", "toolledger.submit"}
        call, handler, submit = (mine[f"toolledger.{part}"] for part in ("call", "handler", "submit"))
        assert handler.parent.span_id == call.context.span_id  # type: ignore[attr-defined]
        assert submit.parent.span_id == call.context.span_id  # type: ignore[attr-defined]
        assert call.attributes["toolledger.session_id"] == session_id  # type: ignore[attr-defined]
        assert call.attributes["toolledger.tool"] == action.name  # type: ignore[attr-defined]
        assert call.attributes["toolledger.action"] == "executed"  # type: ignore[attr-defined]
        assert submit.attributes["toolledger.outcome"] == "submitted"  # type: ignore[attr-defined]

    lookup_handler = by_call[actions[0].call_id]["toolledger.handler"]
    assert lookup_handler.attributes["toolledger.outcome"] == "succeeded"  # type: ignore[attr-defined]
    assert lookup_handler.attributes["toolledger.effect_class"] == "idempotent"  # type: ignore[attr-defined]
    charge_handler = by_call[actions[1].call_id]["toolledger.handler"]
    assert charge_handler.attributes["toolledger.outcome"] == "failed"  # type: ignore[attr-defined]
    assert charge_handler.status.status_code == trace.StatusCode.ERROR  # type: ignore[attr-defined]
