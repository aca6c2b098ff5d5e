"""A loop's wait between rounds keeps a cancellation that arrives as it is woken: with
``asyncio.wait_for`` on Python 3.11 it was swallowed, and a `serve` stopping as a webhook woke
its looks loop waited for that loop for ever."""

from __future__ import annotations

import asyncio

import pytest

from toolledger.runtime.wakeups import woken_within


async def test_woken_within__cancelled_as_the_event_is_set__stays_cancelled() -> None:
    event = asyncio.Event()
    waiting = asyncio.create_task(woken_within(event, 10.0))
    await asyncio.sleep(0)  # now waiting on the event
    event.set()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting


async def test_woken_within__set__true_and_timed_out__false() -> None:
    event = asyncio.Event()
    assert await woken_within(event, 0.01) is False
    event.set()
    assert await woken_within(event, 10.0) is True
