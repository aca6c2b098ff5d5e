"""The tools the service tests run: every side effect is appended (and fsynced) to the file
named by SERVICE_EFFECTS_FILE before the handler returns, so a SIGKILL cannot hide one."""

from __future__ import annotations

import asyncio
import os
import signal
import time

from sqlalchemy import Column, Integer, MetaData, String, Table

from toolledger.crashpoints import CP_INSIDE_HANDLER, crash_point
from toolledger.runtime.context import ToolContext, Verification
from toolledger.runtime.registry import ToolRegistry

registry = ToolRegistry()

refunds = Table(
    "test_refunds",
    MetaData(),
    Column("id", Integer, primary_key=True),
    Column("call_id", String(255), nullable=False),
)
"""Written by the transactional tool through the ledger's own transaction."""


def effects_path() -> str:
    return os.environ["SERVICE_EFFECTS_FILE"]


def _effect(tool: str, ctx: ToolContext) -> None:
    with open(effects_path(), "a", encoding="utf-8") as sink:
        sink.write(
            f"{tool} {ctx.key.session_id} {ctx.key.turn_id} {ctx.key.call_id} {ctx.attempt} {os.getpid()}\n"
        )
        sink.flush()
        os.fsync(sink.fileno())


def _pause(pause_ms: int, until_file: str) -> None:
    """``pause_ms``; with ``until_file``, only until the test creates that file (its cue that
    what had to happen during the call has happened), at most ``pause_ms``."""
    deadline = time.monotonic() + pause_ms / 1000
    while time.monotonic() < deadline:
        if until_file and os.path.exists(until_file):
            return
        time.sleep(min(0.02, max(0.0, deadline - time.monotonic())))


@registry.tool(name="charge")
def charge(amount: int, ctx: ToolContext, pause_ms: int = 0, until_file: str = "") -> str:
    """Charge a card: at most once."""
    _effect("charge", ctx)
    crash_point(CP_INSIDE_HANDLER)
    _pause(pause_ms, until_file)
    return f"charged {amount}"


@registry.tool(name="notify", effect="idempotent")
async def notify(message: str, ctx: ToolContext, pause_ms: int = 0) -> str:
    """Send a notification: idempotent by key."""
    _effect("notify", ctx)
    crash_point(CP_INSIDE_HANDLER)
    await asyncio.sleep(pause_ms / 1000)
    return f"sent {message}"


@registry.tool(name="lookup", effect="read_only")
async def lookup(order_id: str, ctx: ToolContext) -> str:
    """Look an order up."""
    _effect("lookup", ctx)
    return f"order {order_id}: shipped"


@registry.tool(name="record_refund", effect="transactional")
async def record_refund(cents: int, ctx: ToolContext) -> str:
    """Record a refund: the row and the result commit together."""
    await ctx.db.execute(refunds.insert().values(call_id=ctx.key.call_id))
    crash_point(CP_INSIDE_HANDLER)
    return f"refunded {cents}"


def _shipped(ctx: ToolContext) -> Verification:
    """Ask "downstream" (the effects file) whether this call's shipment happened."""
    try:
        with open(effects_path(), encoding="utf-8") as source:
            lines = source.read().splitlines()
    except FileNotFoundError:
        return Verification.not_executed()
    if any(
        line.startswith(f"ship {ctx.key.session_id} {ctx.key.turn_id} {ctx.key.call_id} ") for line in lines
    ):
        return Verification.executed("shipped (verified)")
    return Verification.not_executed()


@registry.tool(name="ship", effect="verified", verify=_shipped)
def ship(parcel: str, ctx: ToolContext) -> str:
    """Ship a parcel: verified downstream after a crash."""
    _effect("ship", ctx)
    crash_point(CP_INSIDE_HANDLER)
    return f"shipped {parcel}"


@registry.tool(name="explode", effect="idempotent")
def explode(ctx: ToolContext) -> str:
    """A poison call: it takes its process down every time."""
    _effect("explode", ctx)
    os.kill(os.getpid(), signal.SIGKILL)
    return "unreachable"


@registry.tool(name="explode_once")
def explode_once(ctx: ToolContext) -> str:
    """A poison call of an at_most_once tool."""
    _effect("explode_once", ctx)
    os.kill(os.getpid(), signal.SIGKILL)
    return "unreachable"


@registry.tool(name="hold_funds", unknown_deadline=2.0)
def hold_funds(cents: int, ctx: ToolContext) -> str:
    """Hold funds: at most once; an unknown outcome is given up after 2 s with a fixed failure."""
    _effect("hold_funds", ctx)
    crash_point(CP_INSIDE_HANDLER)
    return f"held {cents}"


def _hang_until(until_file: str) -> None:
    """Block until the test creates ``until_file``: a handler stuck on something outside it (a
    socket read with no timeout, a lock), as long as the test wants."""
    while not os.path.exists(until_file):
        time.sleep(0.02)


@registry.tool(name="hang")
def hang(until_file: str, ctx: ToolContext) -> str:
    """A sync handler that hangs until released: at most once."""
    _effect("hang", ctx)
    _hang_until(until_file)
    return "released"


@registry.tool(name="hang_again", effect="idempotent")
def hang_again(until_file: str, ctx: ToolContext) -> str:
    """A sync handler that hangs until released: idempotent, so run again after a crash."""
    _effect("hang_again", ctx)
    _hang_until(until_file)
    return "released again"


@registry.tool(name="tick", effect="read_only")
def tick(n: int, ctx: ToolContext) -> str:
    """A quick sync handler."""
    _effect("tick", ctx)
    return f"tick {n}"
