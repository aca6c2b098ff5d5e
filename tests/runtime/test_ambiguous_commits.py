"""R4, ambiguous commits: a ledger write commits, then its connection breaks before the answer
comes back (the client sees an OperationalError with ``connection_invalidated``). The executor
must recognise its own committed write and carry on: the handler runs once, exactly one result
is accepted, no extra lease token is taken, and the call ends submitted. On both databases,
through the emulator with the real SDK."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from sqlalchemy.exc import OperationalError

from tests.support.executor_harness import pending_actions, running_ledger
from toolledger.domain.keys import CallKey
from toolledger.domain.states import CallStatus, EffectClass
from toolledger.emulator import EmulatorServer
from toolledger.runtime.context import ToolContext
from toolledger.runtime.registry import ToolRegistry
from toolledger.runtime.tool_ledger import ToolLedger
from toolledger.store.ledger import LedgerStore

TRIES = 20


def answer_lost_once(store: LedgerStore, write: str) -> list[str]:
    """After the first call of ``write`` commits, raise as if the connection had broken."""
    original: Callable[..., Awaitable[Any]] = getattr(store, write)
    lost: list[str] = []

    async def committed_then_broken(*args: Any, **kwargs: Any) -> Any:
        done = await original(*args, **kwargs)
        if not lost:
            lost.append(write)
            raise OperationalError(
                "injected: the answer to a committed write was lost",
                None,
                ConnectionResetError("connection reset by peer"),
                connection_invalidated=True,
            )
        return done

    setattr(store, write, committed_then_broken)
    return lost


async def _interrupted(ledger: ToolLedger, key: CallKey, action: Any) -> None:
    """As a worker that died mid-call leaves it: claimed, its lease running out."""
    await ledger.store.record(
        key,
        tool_name=action.name,
        arguments=action.arguments,
        effect_class=EffectClass.IDEMPOTENT,
        lease_seconds=0.05,
    )
    await asyncio.sleep(0.15)


@pytest.mark.parametrize("write", ["record", "claim", "complete", "mark_submitted"])
async def test_a_write_whose_answer_was_lost__is_recognised_and_the_call_carries_on(
    write: str, database_url: str, emulator: EmulatorServer
) -> None:
    registry = ToolRegistry()
    runs: list[tuple[str, int]] = []
    # A claim is only retaken on a call whose re-run is safe; the others run at most once.
    effect = "idempotent" if write == "claim" else "at_most_once"

    @registry.tool(effect=effect)
    async def charge(cents: int, ctx: ToolContext) -> str:
        runs.append((ctx.idempotency_key, ctx.attempt))
        return f"charged {cents}"

    async with running_ledger(registry, database_url, emulator) as ledger:
        for n in range(TRIES):
            runs.clear()
            session_id, [action] = await pending_actions(emulator, [("charge", {"cents": n})])
            key = CallKey(session_id, action.turn_id, action.call_id)
            if write == "claim":
                await _interrupted(ledger, key, action)
            store = ledger.store
            lost = answer_lost_once(store, write)
            try:
                report = await ledger.handle(session_id, action)
            finally:
                del store.__dict__[write]  # the store's own method again
            call = await store.get(key)
            trail = await store.events(key)

            assert lost == [write], "the fault was injected"
            assert report.submitted, f"try {n}: {report}"
            assert call is not None
            assert call.status is CallStatus.SUBMITTED
            first_token = 2 if write == "claim" else 1
            assert call.lease_token == first_token, "no extra lease was taken"
            assert runs == [(key.idempotency_key, first_token)], "the handler ran exactly once"
            accepted = [r for r in emulator.control.tool_results(session_id) if r.outcome == "accepted"]
            assert len(accepted) == 1
            assert accepted[0].payload == call.payload
            claims = [e for e in trail if e.to_status == "running"]
            assert len(claims) == first_token, "one claim per lease, none repeated"
            assert [e.id for e in trail] == sorted(e.id for e in trail)
