"""Ledger writes made at the same moment share one commit (``store.batching``), on a real
SQLite file and a real PostgreSQL database: each call keeps its own result, fencing and
audit event, and one call that loses its race, or cannot be written at all, fails alone.

"One commit" is read from the database itself: on PostgreSQL the rows' ``xmin`` (the
transaction that wrote them), on SQLite the engine's commit count.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from sqlalchemy import event, text
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.pool import StaticPool

from toolledger.domain.keys import CallKey
from toolledger.domain.records import Recorded
from toolledger.domain.results import FailureStage, failed, succeeded
from toolledger.domain.states import CallStatus, EffectClass
from toolledger.errors import FencedError
from toolledger.store.engine import create_engine
from toolledger.store.ledger import LedgerStore
from toolledger.store.schema import storable_text

ACTOR = "worker-a"
LEASE_SECONDS = 30.0


def new_key(session_id: str = "sess_batch") -> CallKey:
    return CallKey(session_id, f"turn_{uuid.uuid4().hex[:8]}", f"call_{uuid.uuid4().hex[:8]}")


async def record(
    store: LedgerStore, key: CallKey, *, arguments: Any = None, effect: Any = EffectClass.IDEMPOTENT
) -> Recorded:
    return await store.record(
        key,
        tool_name="charge_card",
        arguments={"n": 1} if arguments is None else arguments,
        effect_class=effect,
        lease_seconds=LEASE_SECONDS,
        claim_id=f"claim-{key.call_id}",
    )


@dataclass
class Commits:
    """How many transactions wrote the given calls."""

    engine: AsyncEngine
    count: int = 0

    async def writers_of(self, keys: list[CallKey]) -> int:
        if self.engine.dialect.name != "postgresql":
            return self.count
        async with self.engine.connect() as conn:
            rows = await conn.execute(
                text("SELECT DISTINCT xmin::text FROM tool_calls WHERE call_id = ANY(:ids)"),
                {"ids": [key.call_id for key in keys]},
            )
            return len(rows.all())


@contextmanager
def commits(engine: AsyncEngine) -> Iterator[Commits]:
    counted = Commits(engine)

    def on_commit(_connection: Any) -> None:
        counted.count += 1

    event.listen(engine.sync_engine, "commit", on_commit)
    try:
        yield counted
    finally:
        event.remove(engine.sync_engine, "commit", on_commit)


async def test_calls_recorded_together__share_one_commit_and_each_has_its_own_claim(
    engine: AsyncEngine,
) -> None:
    store = LedgerStore(engine, actor=ACTOR)
    keys = [new_key() for _ in range(5)]
    with commits(engine) as counted:
        recorded = await asyncio.gather(*(record(store, key) for key in keys))
        assert await counted.writers_of(keys) == 1

    for key, one in zip(keys, recorded, strict=True):
        assert one.claimed
        assert one.call.key == key
        assert (one.call.status, one.call.lease_token, one.call.lease_owner) == (CallStatus.RUNNING, 1, ACTOR)
        # Each claim's event carries its own claim id: an ambiguous commit is told apart per call.
        assert await store.claimed_by(key, f"claim-{key.call_id}") == one.call
        (recorded_event,) = await store.events(key)
        assert (recorded_event.kind, recorded_event.to_status, recorded_event.actor) == (
            "transition",
            "running",
            ACTOR,
        )


async def test_without_batching__each_record_is_a_commit_of_its_own(engine: AsyncEngine) -> None:
    store = LedgerStore(engine, actor=ACTOR, batching=False)
    keys = [new_key() for _ in range(3)]
    with commits(engine) as counted:
        await asyncio.gather(*(record(store, key) for key in keys))
        assert await counted.writers_of(keys) == 3


async def test_a_batch_of_records__one_recorded_before_is_found_and_one_with_other_arguments_refused(
    engine: AsyncEngine,
) -> None:
    store = LedgerStore(engine, actor=ACTOR)
    before, mismatched, fresh = new_key(), new_key(), new_key()
    await record(store, before)
    await record(store, mismatched, arguments={"n": 1})

    again, refused, new, twice = await asyncio.gather(
        record(store, before),
        record(store, mismatched, arguments={"n": 2}),
        record(store, fresh),
        record(store, fresh),
    )

    assert (again.claimed, again.call.lease_token) == (False, 1)
    assert refused.arguments_mismatch
    assert not refused.claimed
    assert [e.kind for e in await store.events(mismatched)][-1] == "arguments_mismatch"
    # The same call delivered twice in one batch is recorded and claimed once.
    assert sorted([new.claimed, twice.claimed]) == [False, True]
    assert len(await store.events(fresh)) == 1


async def test_outcomes_stored_together__share_one_commit_and_a_stale_token_fails_alone(
    engine: AsyncEngine,
) -> None:
    store = LedgerStore(engine, actor=ACTOR)
    keys = [new_key() for _ in range(4)]
    await asyncio.gather(*(record(store, key) for key in keys))
    stale = keys[0]

    with commits(engine) as counted:
        outcomes = await asyncio.gather(
            *(
                store.complete(key, 2 if key == stale else 1, succeeded(key, f"done {key.call_id}"))
                for key in keys
            ),
            return_exceptions=True,
        )
        if engine.dialect.name == "postgresql":
            assert await counted.writers_of(keys[1:]) == 1
        else:
            assert counted.count == 1

    assert isinstance(outcomes[0], FencedError)
    assert (await store.get(stale)).status is CallStatus.RUNNING  # type: ignore[union-attr]
    for key, stored in zip(keys[1:], outcomes[1:], strict=True):
        assert not isinstance(stored, BaseException)
        assert (stored.status, stored.result) == (
            CallStatus.SUCCEEDED,
            succeeded(key, f"done {key.call_id}").payload_json(),
        )
        assert [e.to_status for e in await store.events(key)] == ["running", "succeeded"]


async def test_outcomes_stored_together__a_failure_a_late_result_and_odd_text_each_as_alone(
    engine: AsyncEngine,
) -> None:
    """One batch holding what the one-call write handles case by case: a failure (its stage
    and redacted detail), a result whose lease ran out meanwhile but whose token is still
    current (stored late, as the only run's), and text PostgreSQL's text type refuses raw."""
    store = LedgerStore(engine, actor=ACTOR, owner="gone-worker")
    ok, failing, late = new_key(), new_key(), new_key()
    await asyncio.gather(*(record(store, key) for key in (ok, failing, late)))
    (expired,) = await LedgerStore(engine, actor="other").expire_leases(late, gone_owners=["gone-worker"])
    assert expired.status is CallStatus.UNKNOWN

    with commits(engine) as counted:
        done = await asyncio.gather(
            store.complete(ok, 1, succeeded(ok, "nul \x00 and \ud800 here")),
            store.complete(
                failing, 1, failed(failing, "Tool failed", FailureStage.EXECUTION, detail="trace")
            ),
            store.complete(late, 1, succeeded(late, "late")),
        )
        assert await counted.writers_of([ok, failing]) == 1

    assert [call.status for call in done] == [CallStatus.SUCCEEDED, CallStatus.FAILED, CallStatus.SUCCEEDED]
    assert done[0].result == storable_text(succeeded(ok, "nul \x00 and \ud800 here").payload_json())
    assert (done[1].error_stage, done[1].error_detail) == ("execution", "trace")
    assert [(e.from_status, e.to_status, e.reason) for e in await store.events(failing)][-1] == (
        "running",
        "failed",
        "execution",
    )
    assert [(e.from_status, e.to_status) for e in await store.events(ok)][-1] == ("running", "succeeded")
    assert (await store.events(late))[-1].reason == "late result of the only run, after its lease expired"


async def test_a_call_completed_twice_in_one_batch__stored_once_with_one_event(engine: AsyncEngine) -> None:
    """Two outcomes of one call under the same token in one batch: the first is stored, the
    second is refused (fenced) as it would be one after the other; one event, the first's."""
    store = LedgerStore(engine, actor=ACTOR)
    key, other = new_key(), new_key()
    await asyncio.gather(record(store, key), record(store, other))

    first, second, alongside = await asyncio.gather(
        store.complete(key, 1, succeeded(key, "first")),
        store.complete(key, 1, failed(key, "second", FailureStage.EXECUTION)),
        store.complete(other, 1, succeeded(other, "other")),
        return_exceptions=True,
    )

    assert not isinstance(first, BaseException)
    assert first.result == succeeded(key, "first").payload_json()
    assert isinstance(second, FencedError)
    assert not isinstance(alongside, BaseException)
    assert alongside.status is CallStatus.SUCCEEDED
    assert [(e.to_status, e.reason) for e in await store.events(key)] == [
        ("running", "recorded and claimed"),
        ("succeeded", "handler returned"),
    ]


async def test_submitted_marks_made_together__share_one_commit_and_each_has_its_event(
    engine: AsyncEngine,
) -> None:
    """Calls of different sessions accepted at the same moment are marked by one write; a mark
    for a call with no stored result is refused alone, and a call marked twice at once is
    marked by the first."""
    store = LedgerStore(engine, actor=ACTOR)
    keys = [new_key(f"sess_mark_{n}") for n in range(4)]
    running, alone = new_key("sess_mark_running"), new_key("sess_mark_alone")
    await asyncio.gather(*(record(store, key) for key in [*keys, running, alone]))
    await asyncio.gather(*(store.complete(key, 1, succeeded(key, "done")) for key in [*keys, alone]))
    with commits(engine) as one_mark:  # on SQLite its pragmas' commits count too
        await store.mark_submitted(alone)

    with commits(engine) as counted:
        marks = await asyncio.gather(
            *(store.mark_submitted(key) for key in keys),
            store.mark_submitted(running),
            store.mark_submitted(keys[0]),
        )
        if engine.dialect.name == "postgresql":
            assert await counted.writers_of(keys) == 1
        else:
            assert counted.count == one_mark.count

    assert [None if m is None else (m.key, m.status) for m in marks] == [
        *((key, CallStatus.SUBMITTED) for key in keys),
        None,
        None,
    ]
    assert (await store.get(running)).status is CallStatus.RUNNING  # type: ignore[union-attr]
    for key in keys:
        (submission,) = [e for e in await store.events(key) if e.kind == "submission"]
        assert (submission.from_status, submission.to_status, submission.reason) == (
            "succeeded",
            "submitted",
            "result accepted",
        )


@dataclass
class _BadEffect:
    """Not an effect class the schema accepts: the database refuses the row."""

    value: str = "teleport"


async def test_a_batch_with_a_row_the_database_refuses__the_others_are_written(engine: AsyncEngine) -> None:
    store = LedgerStore(engine, actor=ACTOR)
    good, bad = [new_key() for _ in range(3)], new_key()

    results = await asyncio.gather(
        *(record(store, key) for key in good), record(store, bad, effect=_BadEffect()), return_exceptions=True
    )

    assert all(isinstance(one, Recorded) and one.claimed for one in results[:3]), results
    assert isinstance(results[3], Exception)
    assert await store.get(bad) is None
    for key in good:
        assert (await store.get(key)).status is CallStatus.RUNNING  # type: ignore[union-attr]


async def test_a_caller_cancelled_while_its_batch_is_written__the_others_get_their_results(
    engine: AsyncEngine,
) -> None:
    store = LedgerStore(engine, actor=ACTOR)
    keys = [new_key() for _ in range(4)]
    tasks = [asyncio.create_task(record(store, key)) for key in keys]
    await asyncio.sleep(0)
    tasks[0].cancel()

    done = await asyncio.gather(*tasks[1:])

    assert all(one.claimed for one in done)
    for key in keys[1:]:
        assert (await store.get(key)).status is CallStatus.RUNNING  # type: ignore[union-attr]


async def test_sqlite__a_submitted_mark_commits_without_fsync_and_leaves_the_connection_durable(
    sqlite_url: str,
) -> None:
    """SUBMIT is declared not durable: on SQLite its transaction runs with synchronous=NORMAL
    (no fsync at commit); every other write, and the connection once back in the pool, FULL."""
    engine = create_engine(sqlite_url, poolclass=StaticPool)  # one connection: the one reused
    seen: list[tuple[str, int]] = []

    def on_write(conn: Any, _cursor: Any, statement: str, *_rest: Any) -> None:
        if statement.lstrip().upper().startswith(("UPDATE", "INSERT")):
            level = conn.exec_driver_sql("PRAGMA synchronous").scalar_one()
            seen.append((statement.split()[0].upper(), level))

    try:
        store = LedgerStore(engine, actor=ACTOR, batching=False)
        key, other = new_key(), new_key()
        await record(store, key)
        await store.complete(key, 1, succeeded(key, "done"))
        event.listen(engine.sync_engine, "before_cursor_execute", on_write)
        await store.mark_submitted(key)
        marked_with = list(seen)
        seen.clear()
        await record(store, other)
        event.remove(engine.sync_engine, "before_cursor_execute", on_write)
        async with engine.connect() as conn:
            after = (await conn.exec_driver_sql("PRAGMA synchronous")).scalar_one()
    finally:
        await engine.dispose()

    normal, full = 1, 2
    assert {level for _, level in marked_with} == {normal}, marked_with
    assert {level for _, level in seen} == {full}, "a record is durable"
    assert after == full
    assert (await _status(sqlite_url, key)) == CallStatus.SUBMITTED.value


async def _status(url: str, key: CallKey) -> str:
    engine = create_engine(url)
    try:
        async with engine.connect() as conn:
            found = await conn.execute(
                text("SELECT status FROM tool_calls WHERE call_id = :id"), {"id": key.call_id}
            )
            return str(found.scalar_one())
    finally:
        await engine.dispose()
