"""The tools the service tests run: every side effect is appended (and fsynced) to the file
named by SERVICE_EFFECTS_FILE before the handler returns, so a SIGKILL cannot hide one."""

from __future__ import annotations

import asyncio
import os
import time

from toolledger.crashpoints import CP_INSIDE_HANDLER, crash_point
from toolledger.runtime.context import ToolContext
from toolledger.runtime.registry import ToolRegistry

registry = ToolRegistry()


def _effect(tool: str, ctx: ToolContext) -> None:
    with open(os.environ["SERVICE_EFFECTS_FILE"], "a", encoding="utf-8") as sink:
        sink.write(f"{tool} {ctx.key.session_id} {ctx.key.turn_id} {ctx.key.call_id} {ctx.attempt}\n")
        sink.flush()
        os.fsync(sink.fileno())


@registry.tool(name="charge")
def charge(amount: int, ctx: ToolContext, pause_ms: int = 0) -> str:
    """Charge a card: at most once."""
    _effect("charge", ctx)
    crash_point(CP_INSIDE_HANDLER)
    time.sleep(pause_ms / 1000)
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
