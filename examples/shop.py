"""A small shop's tools, one of each effect class: the tool set `toolledger demo` runs, and a
template to copy for your own (`toolledger serve --tools examples.shop:registry` from a source
checkout, `toolledger.examples.shop:registry` from an installed package).

The "outside world" these tools change (a payment system, a mailer) is a SQLite file named by
TOOLLEDGER_DEMO_WORLD, so the demo can count how many times each side effect really happened.
Replace `_world()` and its tables with your real clients: the shape of each tool stays.
"""

from __future__ import annotations

import os
import sqlite3
import time
from contextlib import closing

from sqlalchemy import Column, Integer, MetaData, String, Table

from toolledger import ToolContext, ToolError, ToolRegistry, Verification
from toolledger.crashpoints import CP_INSIDE_HANDLER, crash_point

registry = ToolRegistry()

PAYMENT_CONFIRMED_AFTER = 0.3
"""Seconds the (pretend) payment system takes to confirm a charge it has made."""
MAIL_ACKNOWLEDGED_AFTER = 1.0
"""Seconds the (pretend) mail server takes to acknowledge a mail."""

ORDERS = {
    "A1": {"item": "espresso machine", "cents": 24900, "email": "ann@example.com"},
    "B2": {"item": "grinder", "cents": 8900, "email": "bob@example.com"},
}

refunds = Table(
    "shop_refunds",
    MetaData(),
    Column("id", Integer, primary_key=True),
    Column("order_id", String(64), nullable=False),
    Column("cents", Integer, nullable=False),
    Column("call_id", String(255), nullable=False, unique=True),
)
"""Refunds live in the ledger's own database: written in the transaction that stores the
tool's result, so a crash rolls back both and the re-run is the only write."""


REFUNDS_APPROVED_UP_TO = 5_000
"""Cents a refund may be without a person's approval."""


def _world() -> sqlite3.Connection:
    """The outside world: TOOLLEDGER_DEMO_WORLD, or shop-world.sqlite3 in the working directory."""
    path = os.environ.get("TOOLLEDGER_DEMO_WORLD", "shop-world.sqlite3")
    connection = sqlite3.connect(path, timeout=30, isolation_level=None)
    connection.execute("PRAGMA journal_mode=WAL")
    connection.execute("PRAGMA synchronous=FULL")
    # The payment system's and the mailer's tables, and a log of every handler run.
    connection.execute("CREATE TABLE IF NOT EXISTS charges (idempotency_key TEXT PRIMARY KEY, cents INTEGER)")
    connection.execute("CREATE TABLE IF NOT EXISTS mails (idempotency_key TEXT PRIMARY KEY, address TEXT)")
    connection.execute(
        "CREATE TABLE IF NOT EXISTS effects (tool TEXT, call_id TEXT, attempt INTEGER, pid INTEGER)"
    )
    return connection


def create_world(path: str) -> None:
    """Point the tools (and the workers started from here) at a world file, created now."""
    os.environ["TOOLLEDGER_DEMO_WORLD"] = path
    _world().close()


def _effect(world: sqlite3.Connection, tool: str, ctx: ToolContext) -> None:
    world.execute(
        "INSERT INTO effects VALUES (?, ?, ?, ?)", (tool, ctx.key.call_id, ctx.attempt, os.getpid())
    )


@registry.tool(effect="read_only")
def lookup_order(order_id: str, ctx: ToolContext) -> dict[str, object]:
    """Look an order up: its item, amount and customer email."""
    order = ORDERS.get(order_id)
    if order is None:
        raise ToolError(f"No order {order_id}.")
    with closing(_world()) as world:
        _effect(world, "lookup_order", ctx)  # not a side effect: counted to show what ran
    return {"order_id": order_id, **order}


def _charge_made(ctx: ToolContext) -> Verification:
    """After a crash mid-charge: ask the payment system whether this call's charge exists."""
    with closing(_world()) as world:
        row = world.execute(
            "SELECT cents FROM charges WHERE idempotency_key = ?", (ctx.idempotency_key,)
        ).fetchone()
    if row is None:
        return Verification.not_executed()
    return Verification.executed({"charged_cents": row[0], "settled_by": "verify hook"})


@registry.tool(effect="verified", verify=_charge_made)
def charge_card(order_id: str, cents: int, ctx: ToolContext) -> dict[str, object]:
    """Charge the customer's card for an order. Never twice: the payment system keeps the
    idempotency key, which the verify hook asks about after a crash."""
    with closing(_world()) as world:
        world.execute("INSERT INTO charges VALUES (?, ?)", (ctx.idempotency_key, cents))
        _effect(world, "charge_card", ctx)
    time.sleep(PAYMENT_CONFIRMED_AFTER)
    # Where the demo's worker dies: the card is charged, no result is stored yet (and the
    # receipt, asked for in the same turn, is being sent).
    crash_point(CP_INSIDE_HANDLER)
    return {"charged_cents": cents, "order_id": order_id}


@registry.tool(effect="idempotent", retries=2)
def send_receipt(order_id: str, ctx: ToolContext) -> str:
    """Email the receipt of an order. The mailer drops a second mail with the same key, so a
    re-run after a crash is safe."""
    address = ORDERS.get(order_id, {}).get("email", "unknown@example.com")
    with closing(_world()) as world:
        world.execute("INSERT OR IGNORE INTO mails VALUES (?, ?)", (ctx.idempotency_key, address))
        _effect(world, "send_receipt", ctx)
    # The mail server takes a moment to acknowledge: a worker dying meanwhile (the demo's
    # second one, inside charge_card) leaves this call cut off, and it is run again.
    time.sleep(MAIL_ACKNOWLEDGED_AFTER)
    return f"receipt for {order_id} sent to {address}"


def _large_refund(arguments: dict[str, object], ctx: ToolContext) -> bool:
    cents = arguments.get("cents")
    return not isinstance(cents, int) or cents > REFUNDS_APPROVED_UP_TO


@registry.tool(effect="transactional", approval=_large_refund, approval_timeout=3600)
async def record_refund(order_id: str, cents: int, ctx: ToolContext) -> str:
    """Record a refund in the shop's books (the ledger's database, same transaction). Refunds
    over 50.00 wait for a person's approval (`toolledger calls approve`)."""
    # Your books have their own migration; the example creates its table where it runs.
    await ctx.db.run_sync(lambda connection: refunds.create(connection, checkfirst=True))
    await ctx.db.execute(refunds.insert().values(order_id=order_id, cents=cents, call_id=ctx.key.call_id))
    return f"refund of {cents} cents recorded for {order_id}"
