"""Tools whose side effects are counted outside the ledger, for the SIGKILL tests.

Every invocation appends a line to the file named by CRASH_EFFECTS_FILE (flushed and
fsynced before anything else happens, so a kill right after still leaves it); the
transactional tool writes a row through the ledger's own transaction instead.
"""

from __future__ import annotations

import os

from sqlalchemy import Column, Integer, MetaData, String, Table

from toolledger.crashpoints import CP_INSIDE_HANDLER, crash_point
from toolledger.domain.results import MaybeExecuted
from toolledger.runtime.context import ToolContext
from toolledger.runtime.registry import ToolRegistry

effects = Table(
    "crash_effects",
    MetaData(),
    Column("id", Integer, primary_key=True),
    Column("idempotency_key", String(64), nullable=False),
)

registry = ToolRegistry()


def _append_effect(tool: str, ctx: ToolContext) -> None:
    with open(os.environ["CRASH_EFFECTS_FILE"], "a", encoding="utf-8") as sink:
        sink.write(f"{tool} {ctx.idempotency_key} {ctx.attempt}\n")
        sink.flush()
        os.fsync(sink.fileno())


@registry.tool(name="at_most_once_tool")
def at_most_once_tool(amount: int, ctx: ToolContext) -> str:
    _append_effect("at_most_once_tool", ctx)
    crash_point(CP_INSIDE_HANDLER)
    return f"charged {amount}"


@registry.tool(name="maybe_executed_tool")
def maybe_executed_tool(amount: int, ctx: ToolContext) -> str:
    """An at_most_once tool whose downstream answer timed out: it cannot tell."""
    _append_effect("maybe_executed_tool", ctx)
    raise MaybeExecuted(f"the answer to charging {amount} timed out")


@registry.tool(name="idempotent_tool", effect="idempotent")
def idempotent_tool(amount: int, ctx: ToolContext) -> str:
    _append_effect("idempotent_tool", ctx)
    crash_point(CP_INSIDE_HANDLER)
    return f"sent {amount}"


@registry.tool(name="transactional_tool", effect="transactional")
async def transactional_tool(amount: int, ctx: ToolContext) -> str:
    await ctx.db.execute(effects.insert().values(idempotency_key=ctx.idempotency_key))
    crash_point(CP_INSIDE_HANDLER)
    return f"recorded {amount}"
