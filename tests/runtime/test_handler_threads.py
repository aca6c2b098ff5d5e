"""The pool sync handlers run in: bounded, apart from the event loop's default executor, a
timed-out thread keeping its slot until it returns, never two threads for one call, a tool's
own cap, its timeout counted from the thread's start. Threads block on ``threading.Event``s
the test sets (always, at the end), never on sleeps."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from tests.support.polling import eventually
from toolledger.domain.keys import CallKey
from toolledger.runtime.handler_threads import HandlerThreads, ThreadTimeout, running_handler_threads

WAIT = 10.0
"""Seconds any expected event may take on a loaded machine."""


def key(n: int) -> CallKey:
    return CallKey("sess_threads", "turn_1", f"call_{n}")


@pytest.fixture
def gates() -> Iterator[list[threading.Event]]:
    """Events the threads wait on: all set at the end, so no thread outlives the test."""
    made: list[threading.Event] = []
    yield made
    for gate in made:
        gate.set()


def blocked(gates: list[threading.Event], n: int = 0) -> tuple[threading.Event, Callable[[], str]]:
    """A handler blocked until its gate is set (the gate is also set at the test's end)."""
    gate = threading.Event()
    gates.append(gate)

    def work() -> str:
        gate.wait(60)
        return f"released {n}"

    return gate, work


def noting(ran: list[str], value: str) -> Callable[[], str]:
    def work() -> str:
        ran.append(value)
        return value

    return work


async def test_a_run_waits_for_a_free_thread__and_a_timed_out_thread_keeps_its_slot(
    gates: list[threading.Event],
) -> None:
    pool = HandlerThreads(2)
    first_gate, first = blocked(gates, n=1)
    second_gate, second = blocked(gates, n=2)
    hung = asyncio.create_task(pool.run(first, tool="hang", key=key(1), time_limit=0.2))
    held = asyncio.create_task(pool.run(second, tool="hang", key=key(2)))
    with pytest.raises(ThreadTimeout):
        await asyncio.wait_for(hung, WAIT)
    # Timed out, its thread still runs and keeps its slot: both threads are taken.
    snapshot = pool.snapshot()
    assert (snapshot.size, snapshot.busy, snapshot.timed_out, snapshot.waiting) == (2, 2, 1, 0)
    assert [(r.tool, r.key, r.timed_out) for r in running_handler_threads() if r.key in (key(1), key(2))] == [
        ("hang", key(1), True),
        ("hang", key(2), False),
    ]

    ran: list[str] = []
    third = asyncio.create_task(pool.run(noting(ran, "third"), tool="tick", key=key(3)))
    await eventually(lambda: pool.snapshot().waiting == 1, within=WAIT, what="the third run waits")
    assert ran == [], "no thread was free: it did not start"

    first_gate.set()  # the timed-out handler returns at last: its slot goes to the waiting run
    assert await asyncio.wait_for(third, WAIT) == "third"
    assert ran == ["third"]
    second_gate.set()
    assert await asyncio.wait_for(held, WAIT) == "released 2"
    await eventually(lambda: pool.snapshot().busy == 0, within=WAIT, what="every slot given back")


async def test_the_timeout_counts_from_the_threads_start_not_from_the_wait(
    gates: list[threading.Event],
) -> None:
    pool = HandlerThreads(1)
    gate, holder = blocked(gates)
    holding = asyncio.create_task(pool.run(holder, tool="hang", key=key(1)))
    await eventually(lambda: pool.snapshot().busy == 1, within=WAIT, what="the holder runs")

    waited = asyncio.create_task(pool.run(lambda: "done", tool="tick", key=key(2), time_limit=0.3))
    await eventually(lambda: pool.snapshot().waiting == 1, within=WAIT, what="the second run waits")
    queued_at = time.monotonic()
    # Wait well past its time limit (an event: the clock, not a sleep of fixed length).
    await eventually(lambda: time.monotonic() - queued_at > 1.0, within=WAIT, interval=0.1)
    assert not waited.done()
    gate.set()
    assert await asyncio.wait_for(waited, WAIT) == "done", "it ran, and within its time limit"
    await asyncio.wait_for(holding, WAIT)


async def test_one_call_never_has_two_threads_at_once(gates: list[threading.Event]) -> None:
    pool = HandlerThreads(4)
    gate, first = blocked(gates)
    timed_out = asyncio.create_task(pool.run(first, tool="hang", key=key(1), time_limit=0.1))
    with pytest.raises(ThreadTimeout):
        await asyncio.wait_for(timed_out, WAIT)

    again: list[str] = []
    second = asyncio.create_task(pool.run(noting(again, "second"), tool="hang", key=key(1)))
    other = await asyncio.wait_for(pool.run(lambda: "other call", tool="hang", key=key(2)), WAIT)
    assert other == "other call", "threads were free for other calls"
    await eventually(lambda: pool.snapshot().waiting == 1, within=WAIT, what="the same call waits")
    assert again == [], "not started while its timed-out thread still runs"
    gate.set()
    assert await asyncio.wait_for(second, WAIT) == "second"


async def test_a_tools_cap_leaves_the_other_threads_to_other_tools(gates: list[threading.Event]) -> None:
    pool = HandlerThreads(3)
    held: list[asyncio.Task[str]] = []
    for n in (1, 2):
        _, work = blocked(gates, n=n)
        held.append(asyncio.create_task(pool.run(work, tool="flaky", key=key(n), limit=2)))
    await eventually(lambda: pool.snapshot().busy == 2, within=WAIT, what="two flaky runs")
    capped = asyncio.create_task(pool.run(lambda: "third flaky", tool="flaky", key=key(3), limit=2))
    await eventually(lambda: pool.snapshot().waiting == 1, within=WAIT, what="the third flaky run waits")
    # A run of another tool goes first: the free thread is not held for the capped tool.
    assert await asyncio.wait_for(pool.run(lambda: "tick", tool="tick", key=key(4)), WAIT) == "tick"
    assert not capped.done()
    gates[0].set()
    assert await asyncio.wait_for(capped, WAIT) == "third flaky"
    for gate in gates:
        gate.set()
    await asyncio.wait_for(asyncio.gather(*held), WAIT)


async def test_a_cancelled_wait_gives_its_place_up_and_the_default_executor_stays_free(
    gates: list[threading.Event],
) -> None:
    pool = HandlerThreads(1)
    gate, holder = blocked(gates)
    holding = asyncio.create_task(pool.run(holder, tool="hang", key=key(1)))
    await eventually(lambda: pool.snapshot().busy == 1, within=WAIT, what="the holder runs")
    waiting = asyncio.create_task(pool.run(lambda: "never", tool="tick", key=key(2)))
    await eventually(lambda: pool.snapshot().waiting == 1, within=WAIT, what="a run waits")
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert pool.snapshot().waiting == 0
    # The handler's thread is not the loop's: name resolution and to_thread still answer.
    loop = asyncio.get_running_loop()
    await asyncio.wait_for(loop.getaddrinfo("localhost", 80), WAIT)
    assert await asyncio.wait_for(asyncio.to_thread(lambda: "default executor"), WAIT) == "default executor"
    gate.set()
    await asyncio.wait_for(holding, WAIT)
    assert pool.snapshot().busy == 0


def test_handler_threads_are_daemon_threads(gates: list[threading.Event]) -> None:
    """The interpreter does not wait for them at exit (it joins the default executor's)."""
    pool = HandlerThreads(1)
    seen: list[bool] = []
    asyncio.run(pool.run(lambda: seen.append(threading.current_thread().daemon), tool="t", key=key(1)))
    assert seen == [True]
