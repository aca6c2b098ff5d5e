"""Waiting for another process (or the database it writes) to get somewhere.

``eventually`` for async tests, ``eventually_sync`` for synchronous ones (subprocesses, the
sync SDK client, code run in a thread): one contract. ``check`` is polled every ``interval``
seconds until it returns a truthy value, which is returned; once ``within`` seconds have
passed, TimeoutError names ``what`` (a string, or a callable giving one when the time is up,
for a message that shows how things stand then: a log, the last rows seen). An exception
raised by ``check`` ends the wait at once (a process that died is not waited for)."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, overload

T = TypeVar("T")

Described = str | Callable[[], str]
"""What is waited for: a description, or a callable giving one at the time of the timeout."""


def _timed_out(within: float, what: Described) -> TimeoutError:
    description = what() if callable(what) else what
    return TimeoutError(f"not within {within:.1f}s: {description}")


@overload
async def eventually(
    check: Callable[[], Awaitable[T | None]],
    within: float = ...,
    what: Described = ...,
    interval: float = ...,
) -> T: ...


@overload
async def eventually(
    check: Callable[[], T | None], within: float = ..., what: Described = ..., interval: float = ...
) -> T: ...


async def eventually(
    check: Callable[[], Any], within: float = 10.0, what: Described = "the condition", interval: float = 0.05
) -> Any:
    """The first truthy value of ``check`` (a plain or an async callable), polled until
    ``within`` seconds have passed."""
    deadline = time.monotonic() + within
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise _timed_out(within, what)
        await asyncio.sleep(interval)


def eventually_sync(
    check: Callable[[], T | None],
    within: float = 10.0,
    what: Described = "the condition",
    interval: float = 0.05,
) -> T:
    """The first truthy value of the plain callable ``check``, polled (blocking the thread)
    until ``within`` seconds have passed: ``eventually`` for synchronous code."""
    deadline = time.monotonic() + within
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise _timed_out(within, what)
        time.sleep(interval)
