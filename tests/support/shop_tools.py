"""A small shop's tools for the audit tests: arguments and outputs carry secret-named fields
and canaries, so every view can be checked for masking."""

from __future__ import annotations

import json

from toolledger.crashpoints import CP_INSIDE_HANDLER, crash_point
from toolledger.domain.results import ToolError
from toolledger.runtime.context import ToolContext
from toolledger.runtime.registry import ToolRegistry

registry = ToolRegistry()

CANARY = "CANARY7f3a9"
"""Planted as the value of secret fields and inside error text: must never be shown."""


@registry.tool(name="charge_card")
def charge_card(amount: int, card_number: str, ctx: ToolContext) -> str:
    """Charge a card: at most once."""
    crash_point(CP_INSIDE_HANDLER)
    return json.dumps({"charged": amount, "token": f"tok_{CANARY}", "receipt": ctx.key.call_id})


@registry.tool(name="send_receipt", effect="idempotent")
async def send_receipt(email: str, ctx: ToolContext) -> str:
    """Send a receipt: idempotent by key."""
    return f"receipt sent to {email}"


@registry.tool(name="lookup_order", effect="read_only")
async def lookup_order(order_id: str, ctx: ToolContext) -> str:
    """Look an order up; a missing order raises with a password in the text."""
    if order_id == "missing":
        raise RuntimeError(f"db down: postgresql://shop:{CANARY}@db/shop password={CANARY}")
    if order_id == "refused":
        raise ToolError("order is locked")
    return f"order {order_id}: shipped"
