"""Tools for the bulk-resolution tests: `pay` is verified by a hook that asks a fake payment
provider (``PROVIDER``: the idempotency keys it charged); `slow_pay`'s hook takes
``SLOW_HOOK_SECONDS`` to answer that it happened, and notes each call it was asked about
(``ASKED``)."""

from __future__ import annotations

import asyncio
import time

from toolledger.runtime.context import ToolContext, Verification
from toolledger.runtime.registry import ToolRegistry

PROVIDER: set[str] = set()
"""Idempotency keys the payment provider holds a charge for."""

SLOW_HOOK_SECONDS = 0.3
ASKED: list[str] = []
"""Idempotency keys `slow_pay`'s hook was asked about, in order."""
ASKED_AT: list[float] = []
"""When (``time.monotonic()``) each of those asks began."""

registry = ToolRegistry()


def _charged(ctx: ToolContext) -> Verification:
    if ctx.idempotency_key in PROVIDER:
        return Verification.executed("charged (found at the provider)")
    return Verification.not_executed()


@registry.tool
def charge(cents: int) -> str:
    raise AssertionError("an unknown at_most_once call is never run again")


@registry.tool(effect="verified", verify=_charged)
def pay(cents: int) -> str:
    raise AssertionError("bulk resolution never re-runs a verified call")


async def _slowly_found(ctx: ToolContext) -> Verification:
    ASKED.append(ctx.idempotency_key)
    ASKED_AT.append(time.monotonic())
    await asyncio.sleep(SLOW_HOOK_SECONDS)
    return Verification.executed("charged (found at the provider, slowly)")


@registry.tool(effect="verified", verify=_slowly_found)
def slow_pay(cents: int) -> str:
    raise AssertionError("bulk resolution never re-runs a verified call")


@registry.tool
def ship(order: str) -> str:
    raise AssertionError("not selected by the filter")
