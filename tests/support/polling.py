"""Waiting for another process (or the database it writes) to get somewhere."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def eventually(check: Callable[[], Awaitable[T | None]], within: float, what: str) -> T:
    """The first truthy value of ``check``, polled until ``within`` seconds have passed."""
    deadline = time.monotonic() + within
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {within:.1f}s: {what}")
        await asyncio.sleep(0.05)
