"""The tools of the crash-to-answer benchmark (benchmarks/crash.py): one per effect class.

A call with ``hold=true`` run by a `serve` started with ``BENCH_CRASH_HOLD=1`` notes that
its handler was entered (a line in ``BENCH_CRASH_MARKS``), then waits for the SIGKILL: the
benchmark kills `serve` once every held call is known to be mid-handler. Any other run
returns at once, so after the restart a re-run answers without delay and what is measured
is recovery, not the tools.
"""

from __future__ import annotations

import asyncio
import os

from sqlalchemy import text

from toolledger import ToolContext, ToolRegistry, Verification

registry = ToolRegistry()

HOLD_VARIABLE = "BENCH_CRASH_HOLD"
MARKS_VARIABLE = "BENCH_CRASH_MARKS"
ENTERED = "entered"
EFFECT = "effect"


def _mark(what: str, ctx: ToolContext) -> None:
    path = os.environ.get(MARKS_VARIABLE)
    if path:
        with open(path, "a", encoding="utf-8") as sink:
            sink.write(f"{what} {ctx.key.session_id} {ctx.key.call_id}\n")


async def _run(ctx: ToolContext, hold: bool) -> str:
    if hold and os.environ.get(HOLD_VARIABLE) == "1":
        _mark(ENTERED, ctx)
        # Before the side effect: the verify hook can then truthfully answer "not executed".
        await asyncio.Event().wait()
    _mark(EFFECT, ctx)
    return f"done ({ctx.tool_name}, attempt {ctx.attempt})"


@registry.tool(effect="read_only")
async def look_up(ctx: ToolContext, hold: bool = False) -> str:
    """Read something."""
    return await _run(ctx, hold)


@registry.tool(effect="idempotent")
async def notify(ctx: ToolContext, hold: bool = False) -> str:
    """Send a notification, idempotent by key."""
    return await _run(ctx, hold)


@registry.tool(effect="transactional")
async def record(ctx: ToolContext, hold: bool = False) -> str:
    """Write through the ledger's transaction."""
    await ctx.db.execute(text("SELECT 1"))
    return await _run(ctx, hold)


def _shipped(ctx: ToolContext) -> Verification:
    """Downstream is the marks file: a held run was killed before its effect line."""
    path = os.environ.get(MARKS_VARIABLE)
    if path and os.path.exists(path):
        with open(path, encoding="utf-8") as source:
            if f"{EFFECT} {ctx.key.session_id} {ctx.key.call_id}\n" in source.read():
                return Verification.executed(f"done ({ctx.tool_name}, verified)")
    return Verification.not_executed()


@registry.tool(effect="verified", verify=_shipped)
async def ship(ctx: ToolContext, hold: bool = False) -> str:
    """Ship a parcel; after a crash the hook asks downstream whether it happened."""
    return await _run(ctx, hold)


# unknown_deadline=0: once its lease has expired, a call cut off mid-handler is answered with
# the fixed "outcome unknown" failure instead of waiting for an operator (see benchmarks/crash.py).
@registry.tool(effect="at_most_once", unknown_deadline=0)
async def charge(ctx: ToolContext, hold: bool = False) -> str:
    """Charge a card, at most once."""
    return await _run(ctx, hold)


EFFECT_CLASSES = {
    "look_up": "read_only",
    "notify": "idempotent",
    "record": "transactional",
    "ship": "verified",
    "charge": "at_most_once",
}
