"""Tools behind approval gates for the SIGKILL tests: each invocation appends a line to the
file named by CRASH_EFFECTS_FILE (fsynced first, so a kill right after still leaves it)."""

from __future__ import annotations

import os

from toolledger.crashpoints import CP_INSIDE_HANDLER, crash_point
from toolledger.runtime.context import ToolContext
from toolledger.runtime.registry import ToolRegistry

registry = ToolRegistry()


def _append_effect(tool: str, ctx: ToolContext, amount: int) -> None:
    with open(os.environ["CRASH_EFFECTS_FILE"], "a", encoding="utf-8") as sink:
        sink.write(f"{tool} {ctx.idempotency_key} {amount}\n")
        sink.flush()
        os.fsync(sink.fileno())


@registry.tool(name="approved_refund", approval=True)
def approved_refund(amount: int, ctx: ToolContext) -> str:
    _append_effect("approved_refund", ctx, amount)
    crash_point(CP_INSIDE_HANDLER)
    return f"refunded {amount}"
