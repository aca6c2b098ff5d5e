"""Tools for the conformance check's tests: one that keeps its word per effect class, and some
that break it on purpose. Their side effects are reported with ``toolledger.testing``."""

from __future__ import annotations

import os
import time
import uuid

from sqlalchemy import Column, Integer, MetaData, Table

from toolledger import ToolContext, ToolError, ToolRegistry, Verification, testing

registry = ToolRegistry()
"""Every tool below."""

correct = ToolRegistry()
"""The tools that keep their word only."""

refunds = Table(
    "conformance_refunds",
    MetaData(),
    Column("id", Integer, primary_key=True),
    Column("cents", Integer, nullable=False),
)


def _charged(ctx: ToolContext) -> Verification:
    """The fake payment system, asked whether this call's charge exists."""
    if testing.seen("charge", key=ctx.idempotency_key):
        return Verification.executed("charged (found by the hook)")
    return Verification.not_executed()


# ---------------------------------------------------------------------- correct


def lookup(order_id: str) -> dict[str, str]:
    """No side effect at all."""
    return {"order_id": order_id, "state": "paid"}


def send_mail(order_id: str, ctx: ToolContext) -> str:
    """The mailer drops a second mail with a key it has seen."""
    testing.effect("mail", key=ctx.idempotency_key)
    return f"mailed {order_id}"


async def charge(cents: int, ctx: ToolContext) -> str:
    testing.effect("charge", key=ctx.idempotency_key)
    return f"charged {cents}"


async def refund(cents: int, ctx: ToolContext) -> str:
    """Written through the ledger's transaction: rolled back with a crash."""
    await ctx.db.run_sync(lambda connection: refunds.create(connection, checkfirst=True))
    await ctx.db.execute(refunds.insert().values(cents=cents))
    await testing.effect_in(ctx.db, "refund")
    return f"refunded {cents}"


def ship(order_id: str) -> str:
    testing.effect("ship")
    return f"shipped {order_id}"


def refund_large(cents: int, ctx: ToolContext) -> str:
    """Waits for a person's approval (the check approves it, as an operator would)."""
    testing.effect("refund", key=ctx.idempotency_key)
    return f"refunded {cents}"


for target in (registry, correct):
    target.tool(effect="read_only")(lookup)
    target.tool(effect="idempotent")(send_mail)
    target.tool(effect="verified", verify=_charged)(charge)
    target.tool(effect="transactional")(refund)
    target.tool(effect="at_most_once")(ship)
    target.tool(effect="idempotent", approval=True)(refund_large)


# ---------------------------------------------------------------------- wrong


@registry.tool(effect="idempotent")
def double_charge(cents: int) -> str:
    """Makes up a key of its own on every run, so the payment system takes both."""
    testing.effect("charge", key=uuid.uuid4().hex)
    return f"charged {cents}"


def _never_charged(ctx: ToolContext) -> Verification:
    return Verification.not_executed()


@registry.tool(effect="verified", verify=_never_charged)
def blind_charge(cents: int, ctx: ToolContext) -> str:
    testing.effect("charge", key=ctx.idempotency_key)
    return f"charged {cents}"


def _always_charged(ctx: ToolContext) -> Verification:
    return Verification.executed("charged (the hook says)")


@registry.tool(effect="verified", verify=_always_charged)
def eager_charge(cents: int, ctx: ToolContext) -> str:
    testing.effect("charge", key=ctx.idempotency_key)
    return f"charged {cents}"


@registry.tool(effect="transactional")
def leaky_refund(cents: int, ctx: ToolContext) -> str:
    """Declared transactional, but its refund goes to the outside world, not through ctx.db:
    committed at once, whatever becomes of the ledger's transaction."""
    testing.effect("refund")
    return f"refunded {cents}"


@registry.tool(effect="read_only")
def noisy_lookup(order_id: str) -> str:
    """Declared read_only, but it writes an audit record downstream."""
    testing.effect("audit record")
    return order_id


@registry.tool(effect="idempotent")
def picky(order_id: str) -> str:
    """Refuses anything but a real order: the schema's arguments are not enough."""
    if order_id != "A1":
        raise ToolError(f"No order {order_id}.")
    testing.effect("mail", key=order_id)
    return "ok"


stalled = ToolRegistry()
"""A tool that never returns: the check must kill it at its timeout, not wait for ever."""


@stalled.tool(effect="idempotent", timeout=600)
def stuck(order_id: str) -> str:
    time.sleep(600)
    return order_id


uninstrumented = ToolRegistry()
"""Tools with side effects that never tell the check about them (no ``testing.effect``): what a
tools module is before it is instrumented. Each writes a line to ``CHECKED_WRITES`` only when
the check says it is running (``testing.checking()``), as a tool pointed at a fake would."""


@uninstrumented.tool(effect="idempotent")
def write_row(order_id: str) -> str:
    target = os.environ.get("CHECKED_WRITES")
    if target and testing.checking():
        with open(target, "a", encoding="utf-8") as written:
            written.write(f"{order_id}\n")
    return "written"


@uninstrumented.tool(effect="read_only")
def peek(order_id: str) -> str:
    return order_id
