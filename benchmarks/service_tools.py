"""The tools `toolledger serve` runs in the service benchmarks: a no-op, so what is measured
is everything around a handler, and one that takes 50 ms, as a tool calling a service would
(the realistic variant)."""

from __future__ import annotations

import asyncio

from toolledger import ToolContext, ToolRegistry

SLOW_SECONDS = 0.05

registry = ToolRegistry()


@registry.tool(effect="at_most_once")
def noop(ctx: ToolContext, n: int = 0) -> str:
    """Does nothing."""
    return "ok"


@registry.tool(effect="at_most_once")
async def slow(ctx: ToolContext, n: int = 0) -> str:
    """Waits 50 ms, as a call to another service would."""
    await asyncio.sleep(SLOW_SECONDS)
    return "ok"
