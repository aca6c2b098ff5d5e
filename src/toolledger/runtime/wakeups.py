"""Waiting for a wake-up or a time-out, as the service's loops do between rounds.

Not ``asyncio.wait_for(event.wait(), timeout)``: on Python 3.11 it swallows a cancellation
that arrives as the event is set (gh-86296: it returns the inner result instead of raising),
and a loop woken at that moment (a webhook coming in as `serve` stops) ran on for ever, so
the stopping service waited for it for ever. ``asyncio.timeout`` keeps the cancellation.
"""

from __future__ import annotations

import asyncio


async def woken_within(event: asyncio.Event, seconds: float) -> bool:
    """Wait until ``event`` is set (True) or ``seconds`` have passed (False)."""
    try:
        async with asyncio.timeout(seconds):
            await event.wait()
    except TimeoutError:
        return False
    return True


__all__ = ["woken_within"]
