"""The tool `toolledger serve` runs in the service benchmarks: a no-op, so what is measured
is everything around a handler."""

from __future__ import annotations

from toolledger import ToolContext, ToolRegistry

registry = ToolRegistry()


@registry.tool(effect="at_most_once")
def noop(ctx: ToolContext, n: int = 0) -> str:
    """Does nothing."""
    return "ok"
