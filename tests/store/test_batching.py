"""The write batcher on its own (``store.batching``): every write queued is flushed, whatever
the moment it is queued at. Its flush here is a plain coroutine; the database side of
batching is in ``test_write_batches.py``."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from toolledger.store.batching import WriteBatcher

WAIT = 2.0


class Flushes:
    """A flush that takes a moment, as a database round trip does, and records each batch."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    async def __call__(self, items: Sequence[int]) -> Sequence[int]:
        await asyncio.sleep(0.001)
        self.batches.append(list(items))
        return [item * 10 for item in items]


@pytest.mark.parametrize("flushes", [1, 2])
async def test_a_write_made_as_soon_as_the_last_one_returns_is_flushed(flushes: int) -> None:
    # The caller is woken by its first result before the flush that answered it is done
    # with: its second write must start a flush, not queue behind the finished one.
    flush = Flushes()
    batcher: WriteBatcher[int, int] = WriteBatcher(flush, flushes=flushes)

    async def write_twice(first: int) -> tuple[int, int]:
        return await batcher.add(first), await batcher.add(first + 1)

    results = await asyncio.wait_for(asyncio.gather(*(write_twice(n * 100) for n in range(flushes))), WAIT)

    assert results == [(n * 1000, n * 1000 + 10) for n in range(flushes)]


async def test_writes_queued_while_a_flush_runs_go_out_together_next() -> None:
    flush = Flushes()
    batcher: WriteBatcher[int, int] = WriteBatcher(flush, flushes=1)

    results = await asyncio.wait_for(asyncio.gather(*(batcher.add(n) for n in range(5))), WAIT)

    assert results == [0, 10, 20, 30, 40]
    assert flush.batches == [[0, 1, 2, 3, 4]]


async def test_writes_added_as_many__go_in_one_flush_with_the_others_and_each_gets_its_own_result() -> None:
    batches: list[list[int]] = []

    async def flush(items: Sequence[int]) -> Sequence[int | BaseException]:
        await asyncio.sleep(0.001)
        batches.append(list(items))
        return [ValueError(item) if item == 13 else item * 10 for item in items]

    batcher: WriteBatcher[int, int] = WriteBatcher(flush, flushes=1)
    busy = asyncio.ensure_future(batcher.add(1))
    await asyncio.sleep(0)  # the first flush is running: what follows queues

    many, other = await asyncio.wait_for(asyncio.gather(batcher.add_many([11, 12, 13]), batcher.add(2)), WAIT)

    assert await busy == 10
    assert many[:2] == [110, 120]
    assert isinstance(many[2], ValueError)
    assert other == 20
    assert batches == [[1], [11, 12, 13, 2]]


async def test_a_long_chain_of_writes_each_made_after_the_last_never_stalls() -> None:
    flush = Flushes()
    batcher: WriteBatcher[int, int] = WriteBatcher(flush, flushes=1)

    async def chain() -> int:
        total = 0
        for n in range(200):
            total += await batcher.add(n)
        return total

    assert await asyncio.wait_for(chain(), WAIT * 5) == sum(range(200)) * 10


async def test_a_caller_that_gives_up_does_not_take_the_others_writes_with_it() -> None:
    flush = Flushes()
    batcher: WriteBatcher[int, int] = WriteBatcher(flush, flushes=1)

    first = asyncio.ensure_future(batcher.add(1))
    second = asyncio.ensure_future(batcher.add(2))
    await asyncio.sleep(0)
    first.cancel()

    assert await asyncio.wait_for(second, WAIT) == 20
    assert [2] in flush.batches or [1, 2] in flush.batches
