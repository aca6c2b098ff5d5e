"""LedgerStore's transitions, on a real SQLite file and a real PostgreSQL database.

Each transition is a compare-and-set write plus its audit event: these tests check what
each one stores, what it refuses (lost races, stale lease tokens), and the audit trail.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import AsyncEngine

from toolledger.domain.keys import CallKey, arguments_fingerprint, canonical_json
from toolledger.domain.records import CallEvent, CallRecord
from toolledger.domain.results import FailureStage, Outcome, failed, succeeded
from toolledger.domain.states import CallStatus, EffectClass
from toolledger.errors import FencedError
from toolledger.store.engine import create_engine
from toolledger.store.ledger import LedgerStore
from toolledger.store.schema import tool_call_events, tool_calls

ACTOR = "worker-a"
OTHER_ACTOR = "worker-b"
LEASE_SECONDS = 30.0
SHORT_LEASE = 0.05
AFTER_SHORT_LEASE = 0.2
LEAKED_KEY = "sk-proj-ABCDEFGHIJKLMNOP"
ARGUMENTS: dict[str, Any] = {"amount": 7, "currency": "EUR", "note": "café"}


@pytest.fixture
def store(engine: AsyncEngine) -> LedgerStore:
    return LedgerStore(engine, actor=ACTOR)


@pytest.fixture
def other(engine: AsyncEngine) -> LedgerStore:
    """A second worker on the same ledger."""
    return LedgerStore(engine, actor=OTHER_ACTOR)


def new_key(session_id: str = "sess_1") -> CallKey:
    return CallKey(session_id, f"turn_{uuid.uuid4().hex[:8]}", f"call_{uuid.uuid4().hex[:8]}")


async def record_running(
    store: LedgerStore,
    key: CallKey,
    *,
    arguments: Any = None,
    lease_seconds: float = LEASE_SECONDS,
) -> CallRecord:
    recorded = await store.record(
        key,
        tool_name="charge_card",
        arguments=ARGUMENTS if arguments is None else arguments,
        effect_class=EffectClass.AT_MOST_ONCE,
        lease_seconds=lease_seconds,
    )
    assert recorded.claimed
    return recorded.call


async def record_unknown(store: LedgerStore, key: CallKey) -> CallRecord:
    await record_running(store, key, lease_seconds=SHORT_LEASE)
    await asyncio.sleep(AFTER_SHORT_LEASE)
    expired = await store.expire_leases(key)
    assert [call.key for call in expired] == [key]
    return expired[0]


async def record_succeeded(store: LedgerStore, key: CallKey) -> CallRecord:
    await record_running(store, key)
    return await store.complete(key, 1, succeeded(key, "charged"))


async def record_failed(store: LedgerStore, key: CallKey) -> CallRecord:
    await record_running(store, key)
    return await store.complete(key, 1, failed(key, "Tool handler failed.", FailureStage.EXECUTION))


async def record_submitted(store: LedgerStore, key: CallKey) -> CallRecord:
    await record_succeeded(store, key)
    call = await store.mark_submitted(key)
    assert call is not None
    return call


async def current(store: LedgerStore, key: CallKey) -> CallRecord:
    call = await store.get(key)
    assert call is not None, f"{key} is not in the ledger"
    return call


def shape(events: list[CallEvent]) -> list[tuple[str, str | None, str | None, int | None]]:
    return [(e.kind, e.from_status, e.to_status, e.lease_token) for e in events]


def on_postgres(engine: AsyncEngine) -> bool:
    return engine.dialect.name == "postgresql"


# ---------------------------------------------------------------------------------- record


async def test_record__a_new_call_is_inserted_claimed_and_audited(store: LedgerStore) -> None:
    key = new_key()

    recorded = await store.record(
        key,
        tool_name="charge_card",
        arguments=ARGUMENTS,
        effect_class=EffectClass.IDEMPOTENT,
        lease_seconds=LEASE_SECONDS,
    )

    call = recorded.call
    assert recorded.claimed is True
    assert recorded.arguments_mismatch is False
    assert call.key == key
    assert call.tool_name == "charge_card"
    assert call.arguments == canonical_json(ARGUMENTS)
    assert call.arguments_sha256 == arguments_fingerprint(ARGUMENTS)
    assert call.status is CallStatus.RUNNING
    assert call.effect_class is EffectClass.IDEMPOTENT
    assert call.idempotency_key == key.idempotency_key
    assert (call.lease_token, call.attempt_count, call.lease_owner) == (1, 1, ACTOR)
    assert call.result is None
    assert call.payload is None
    assert call.submission_count == 0
    assert call.started_at is not None
    assert call.lease_expires_at is not None
    lease = call.lease_expires_at - call.started_at
    assert timedelta(seconds=LEASE_SECONDS - 1) < lease < timedelta(seconds=LEASE_SECONDS + 1)
    assert (call.finished_at, call.submitted_at, call.confirmed_at) == (None, None, None)
    assert await store.get(key) == call

    [event] = await store.events(key)
    assert shape([event]) == [("transition", None, "running", 1)]
    assert event.actor == ACTOR
    assert event.reason == "recorded and claimed"


async def test_record__the_same_call_again_is_found_not_claimed_and_unchanged(
    store: LedgerStore, other: LedgerStore
) -> None:
    key = new_key()
    first = await record_running(store, key)

    again = await other.record(
        key,
        tool_name="charge_card",
        arguments=ARGUMENTS,
        effect_class=EffectClass.AT_MOST_ONCE,
        lease_seconds=LEASE_SECONDS,
    )

    assert again.claimed is False
    assert again.arguments_mismatch is False
    assert again.call == first
    assert await current(store, key) == first
    assert len(await store.events(key)) == 1


async def test_record__other_arguments_are_refused_and_flagged(store: LedgerStore) -> None:
    key = new_key()
    first = await record_running(store, key)
    other_arguments = {**ARGUMENTS, "amount": 7000}

    again = await store.record(
        key,
        tool_name="charge_card",
        arguments=other_arguments,
        effect_class=EffectClass.AT_MOST_ONCE,
        lease_seconds=LEASE_SECONDS,
    )

    assert again.arguments_mismatch is True
    assert again.claimed is False
    assert again.call == first
    assert await current(store, key) == first
    events = await store.events(key)
    assert shape(events) == [
        ("transition", None, "running", 1),
        ("arguments_mismatch", None, None, None),
    ]
    assert events[1].detail is not None
    assert first.arguments_sha256 in events[1].detail
    assert arguments_fingerprint(other_arguments) in events[1].detail


@pytest.mark.parametrize("dict_first", [True, False], ids=["dict-then-text", "text-then-dict"])
async def test_record__a_dict_and_its_json_text_have_one_fingerprint(
    store: LedgerStore, dict_first: bool
) -> None:
    as_dict: dict[str, Any] = {"b": [1, 2.5, None], "a": {"y": True, "x": "é"}}
    as_text = '{ "a" : {"x": "\\u00e9",  "y":true},\n "b":[1, 2.5, null] }'
    key = new_key()
    first, second = (as_dict, as_text) if dict_first else (as_text, as_dict)

    recorded = await record_running(store, key, arguments=first)
    again = await store.record(
        key,
        tool_name="charge_card",
        arguments=second,
        effect_class=EffectClass.AT_MOST_ONCE,
        lease_seconds=LEASE_SECONDS,
    )

    assert arguments_fingerprint(as_dict) == arguments_fingerprint(as_text)
    assert recorded.arguments_sha256 == arguments_fingerprint(as_dict)
    assert again.arguments_mismatch is False
    assert again.claimed is False
    assert [e.kind for e in await store.events(key)] == ["transition"]


AWKWARD_ARGUMENTS: list[tuple[str, Any, str]] = [
    # (case, arguments as received, arguments as stored: NUL and lone surrogates spelled as escapes)
    ("nul", "a\x00b", "a\\u0000b"),
    ("lone surrogate", "\ud800", "\\ud800"),
    ("json text with nul and surrogate", '{"note": "x\ud800\x00y"}', '{"note": "x\\ud800\\u0000y"}'),
    ("dict with nul and surrogate", {"note": "x\ud800\x00y"}, '{"note":"x\\ud800\\u0000y"}'),
    ("100 KB", "x" * 100_000, "x" * 100_000),
    ("not json", "not json {", "not json {"),
]


async def test_record__awkward_arguments_are_stored_and_recognised_again(store: LedgerStore) -> None:
    for case, arguments, stored in AWKWARD_ARGUMENTS:
        key = new_key()

        call = await record_running(store, key, arguments=arguments)
        again = await store.record(
            key,
            tool_name="charge_card",
            arguments=arguments,
            effect_class=EffectClass.AT_MOST_ONCE,
            lease_seconds=LEASE_SECONDS,
        )

        assert call.arguments == stored, case
        assert call.arguments_sha256 == arguments_fingerprint(arguments), case
        assert (again.claimed, again.arguments_mismatch) == (False, False), case
        assert (await current(store, key)).arguments == stored, case


# ------------------------------------------------------------------------------- heartbeat


async def test_heartbeat__with_the_current_token_extends_the_lease(store: LedgerStore) -> None:
    key = new_key()
    before = await record_running(store, key, lease_seconds=5)

    assert await store.heartbeat(key, 1, 60) is True

    after = await current(store, key)
    assert before.lease_expires_at is not None
    assert after.lease_expires_at is not None
    assert after.lease_expires_at - before.lease_expires_at > timedelta(seconds=50)
    assert (after.status, after.lease_token, after.attempt_count) == (CallStatus.RUNNING, 1, 1)


async def test_heartbeat__with_a_stale_token_is_refused(store: LedgerStore, other: LedgerStore) -> None:
    key = new_key()
    await record_unknown(store, key)
    taken = await other.claim(
        key, from_statuses=[CallStatus.UNKNOWN], lease_seconds=LEASE_SECONDS, reason="re-run"
    )
    assert taken is not None

    assert await store.heartbeat(key, 1, 60) is False
    assert await store.heartbeat(key, 3, 60) is False
    assert await current(store, key) == taken


async def test_heartbeat__on_a_finished_call_is_refused(store: LedgerStore) -> None:
    key = new_key()
    done = await record_succeeded(store, key)

    assert await store.heartbeat(key, 1, 60) is False
    assert await current(store, key) == done


# -------------------------------------------------------------------------------- complete


async def test_complete__with_the_current_token_stores_the_success(store: LedgerStore) -> None:
    key = new_key()
    await record_running(store, key)
    outcome = succeeded(key, [{"type": "input_text", "text": "charged 7 EUR, ünïcode \x00 \ud800"}])

    call = await store.complete(key, 1, outcome)

    assert call.status is CallStatus.SUCCEEDED
    assert call.payload == outcome.payload
    assert call.result == outcome.payload_json()
    assert (call.error_stage, call.error_detail) == (None, None)
    assert call.finished_at is not None
    assert call.lease_expires_at is None
    assert (call.lease_token, call.attempt_count) == (1, 1)
    assert await current(store, key) == call
    assert shape(await store.events(key))[-1] == ("transition", "running", "succeeded", 1)


async def test_complete__a_failure_is_stored_as_failed_with_a_redacted_detail(store: LedgerStore) -> None:
    key = new_key()
    await record_running(store, key)
    outcome = failed(
        key,
        "Tool handler failed.",
        FailureStage.EXECUTION,
        detail=f"Traceback: RuntimeError: bad key {LEAKED_KEY}\x00 end",
    )

    call = await store.complete(key, 1, outcome)

    assert call.status is CallStatus.FAILED
    assert call.payload == outcome.payload
    assert call.error_stage == "execution"
    assert call.error_detail is not None
    assert LEAKED_KEY not in call.error_detail
    assert "[REDACTED]" in call.error_detail
    assert "\x00" not in call.error_detail
    assert await current(store, key) == call
    assert shape(await store.events(key))[-1] == ("transition", "running", "failed", 1)


async def test_complete__with_a_wrong_token_is_fenced_and_changes_nothing(store: LedgerStore) -> None:
    key = new_key()
    before = await record_running(store, key)

    with pytest.raises(FencedError):
        await store.complete(key, 2, succeeded(key, "forged"))
    with pytest.raises(FencedError):
        await store.complete(key, 0, succeeded(key, "forged"))

    assert await current(store, key) == before
    assert len(await store.events(key)) == 1


async def test_complete__a_second_completion_is_fenced(store: LedgerStore) -> None:
    key = new_key()
    done = await record_succeeded(store, key)

    with pytest.raises(FencedError):
        await store.complete(key, 1, succeeded(key, "again"))

    assert await current(store, key) == done


# --------------------------------------------------------------------- leases and re-claims


async def test_expire_leases__a_lapsed_running_call_becomes_unknown_a_live_one_stays(
    store: LedgerStore,
) -> None:
    lapsed, live = new_key(), new_key()
    await record_running(store, lapsed, lease_seconds=SHORT_LEASE)
    live_before = await record_running(store, live, lease_seconds=LEASE_SECONDS)
    await asyncio.sleep(AFTER_SHORT_LEASE)

    assert await store.expire_leases(live) == []
    expired = await store.expire_leases()

    assert [call.key for call in expired] == [lapsed]
    assert expired[0].status is CallStatus.UNKNOWN
    assert expired[0].lease_token == 1
    assert await current(store, lapsed) == expired[0]
    assert await current(store, live) == live_before
    events = await store.events(lapsed)
    assert shape(events)[-1] == ("transition", "running", "unknown", 1)
    assert events[-1].reason is not None
    assert ACTOR in events[-1].reason
    assert await store.expire_leases() == [], "a second pass finds nothing"


async def test_expire_leases__a_finished_call_is_left_alone(store: LedgerStore) -> None:
    key = new_key()
    await record_running(store, key, lease_seconds=SHORT_LEASE)
    done = await store.complete(key, 1, succeeded(key, "in time"))
    await asyncio.sleep(AFTER_SHORT_LEASE)

    assert await store.expire_leases() == []
    assert await current(store, key) == done


async def test_mark_unknown__the_lease_holder_makes_its_running_call_unknown_at_once(
    store: LedgerStore,
) -> None:
    """A handler that cannot tell whether its effect happened: the call is unknown now, not
    when its 30 s lease runs out, and its unknown_deadline counts from now."""
    key = new_key()
    running = await record_running(store, key, lease_seconds=LEASE_SECONDS)
    assert running.lease_expires_at is not None

    unknown = await store.mark_unknown(
        key,
        1,
        reason=f"handler raised MaybeExecuted: read timed out (token {LEAKED_KEY})",
        detail=f"Traceback: ReadTimeout with Bearer {LEAKED_KEY}",
    )

    assert (unknown.status, unknown.lease_token, unknown.attempt_count) == (CallStatus.UNKNOWN, 1, 1)
    assert unknown.lease_expires_at is not None
    assert unknown.lease_expires_at < running.lease_expires_at - timedelta(seconds=LEASE_SECONDS / 2)
    assert await current(store, key) == unknown
    events = await store.events(key)
    assert shape(events) == [("transition", None, "running", 1), ("transition", "running", "unknown", 1)]
    assert events[-1].actor == ACTOR
    assert events[-1].reason is not None
    assert events[-1].reason.startswith("handler raised MaybeExecuted: read timed out")
    assert events[-1].detail is not None
    assert "ReadTimeout" in events[-1].detail
    assert LEAKED_KEY not in events[-1].reason + events[-1].detail
    assert await store.expire_leases() == [], "nothing is left running to expire"


async def test_mark_unknown__by_a_worker_that_lost_its_lease__is_fenced(
    store: LedgerStore, other: LedgerStore
) -> None:
    key = new_key()
    await record_unknown(store, key)
    taken = await other.claim(
        key, from_statuses=[CallStatus.UNKNOWN], lease_seconds=LEASE_SECONDS, reason="re-run"
    )
    assert taken is not None

    with pytest.raises(FencedError):
        await store.mark_unknown(key, 1, reason="the first run's doubt, too late")

    assert await current(store, key) == taken
    assert shape(await store.events(key))[-1] == ("transition", "unknown", "running", 2)


async def test_mark_unknown__found_unknown_under_its_own_token__is_the_same_end(store: LedgerStore) -> None:
    """Its lease ran out first (or an earlier try of the write committed unseen): the call
    is unknown under this run's token either way, and nothing is written twice."""
    key = new_key()
    expired = await record_unknown(store, key)
    events_before = await store.events(key)

    again = await store.mark_unknown(key, 1, reason="handler raised MaybeExecuted")

    assert again == expired
    assert await store.events(key) == events_before


async def test_mark_unknown__of_a_finished_call__is_refused(store: LedgerStore) -> None:
    key = new_key()
    done = await record_succeeded(store, key)

    with pytest.raises(FencedError):
        await store.mark_unknown(key, 1, reason="too late: a result is stored")

    assert await current(store, key) == done


async def test_claim__from_unknown_takes_token_2_and_fences_the_first_worker(
    store: LedgerStore, other: LedgerStore
) -> None:
    key = new_key()
    await record_unknown(store, key)

    taken = await other.claim(
        key, from_statuses=[CallStatus.UNKNOWN], lease_seconds=LEASE_SECONDS, reason="idempotent re-run"
    )

    assert taken is not None
    assert (taken.status, taken.lease_token, taken.attempt_count) == (CallStatus.RUNNING, 2, 2)
    assert taken.lease_owner == OTHER_ACTOR
    assert taken.lease_expires_at is not None
    with pytest.raises(FencedError):
        await store.complete(key, 1, succeeded(key, "late result of the first run"))
    assert await current(store, key) == taken

    second = succeeded(key, "result of the second run")
    done = await other.complete(key, 2, second)

    assert done.status is CallStatus.SUCCEEDED
    assert done.payload == second.payload
    events = await store.events(key)
    assert shape(events) == [
        ("transition", None, "running", 1),
        ("transition", "running", "unknown", 1),
        ("transition", "unknown", "running", 2),
        ("transition", "running", "succeeded", 2),
    ]
    assert [e.actor for e in events] == [ACTOR, ACTOR, OTHER_ACTOR, OTHER_ACTOR]
    assert events[2].reason == "idempotent re-run"


async def test_complete__late_result_of_an_unclaimed_unknown_call__is_the_one_true_outcome(
    store: LedgerStore,
) -> None:
    """A paused worker's lease expired, but nobody ran the call again: its token is still the
    current one, so its result settles the call instead of leaving it unknown."""
    key = new_key()
    await record_unknown(store, key)

    done = await store.complete(key, 1, succeeded(key, "charged"))

    assert (done.status, done.lease_token, done.attempt_count) == (CallStatus.SUCCEEDED, 1, 1)
    events = await store.events(key)
    assert shape(events)[-1] == ("transition", "unknown", "succeeded", 1)
    assert events[-1].reason == "late result of the only run, after its lease expired"


async def test_claim__from_a_state_not_listed_returns_none(store: LedgerStore, other: LedgerStore) -> None:
    key = new_key()
    running = await record_running(store, key)

    assert await other.claim(key, from_statuses=[CallStatus.UNKNOWN], lease_seconds=1, reason="steal") is None
    assert await other.claim(new_key(), from_statuses=list(CallStatus), lease_seconds=1, reason="x") is None
    assert await current(store, key) == running
    assert len(await store.events(key)) == 1


# ---------------------------------------------------------------------------------- settle


@pytest.mark.parametrize("success", [True, False], ids=["succeeded", "failed"])
async def test_settle__moves_an_unknown_call_to_its_outcome(store: LedgerStore, success: bool) -> None:
    key = new_key()
    await record_unknown(store, key)
    outcome: Outcome = (
        succeeded(key, "verified downstream")
        if success
        else failed(key, "The tool's outcome is unknown.", FailureStage.RECOVERY)
    )

    call = await store.settle(key, outcome, reason="operator resolved")

    assert call is not None
    assert call.status is (CallStatus.SUCCEEDED if success else CallStatus.FAILED)
    assert call.payload == outcome.payload
    assert call.error_stage == (None if success else "recovery")
    assert call.finished_at is not None
    assert call.lease_expires_at is None
    assert call.attempt_count == 1, "settling does not run the call"
    assert await current(store, key) == call
    events = await store.events(key)
    assert shape(events)[-1] == ("transition", "unknown", call.status.value, 1)
    assert events[-1].reason == "operator resolved"


async def test_settle__from_a_state_other_than_unknown_returns_none(store: LedgerStore) -> None:
    arrangements: list[Callable[[LedgerStore, CallKey], Awaitable[CallRecord]]] = [
        record_running,
        record_succeeded,
        record_failed,
        record_submitted,
    ]
    for arrange in arrangements:
        key = new_key()
        before = await arrange(store, key)
        events_before = len(await store.events(key))

        assert await store.settle(key, succeeded(key, "guess"), reason="operator") is None, before.status

        assert await current(store, key) == before
        assert len(await store.events(key)) == events_before


async def test_settle__an_unrecorded_call_returns_none(store: LedgerStore) -> None:
    key = new_key()
    assert await store.settle(key, succeeded(key, "x"), reason="operator") is None
    assert await store.get(key) is None


# ------------------------------------------------------------------------------ submission


@pytest.mark.parametrize("arrange", [record_succeeded, record_failed], ids=["from-succeeded", "from-failed"])
async def test_mark_submitted__moves_a_stored_result_to_submitted_once(
    store: LedgerStore, arrange: Callable[[LedgerStore, CallKey], Awaitable[CallRecord]]
) -> None:
    key = new_key()
    result = await arrange(store, key)

    call = await store.mark_submitted(key)

    assert call is not None
    assert call.status is CallStatus.SUBMITTED
    assert call.submission_count == 1
    assert call.submitted_at is not None
    assert call.confirmed_at is None
    assert call.result == result.result, "the stored result is kept as it was"
    assert await store.mark_submitted(key) is None
    assert await current(store, key) == call
    events = await store.events(key)
    assert shape(events)[-1] == ("submission", result.status.value, "submitted", 1)
    assert [e.kind for e in events].count("submission") == 1


async def test_mark_submitted__without_a_stored_result_returns_none(store: LedgerStore) -> None:
    running, unknown = new_key(), new_key()
    arranged = [await record_running(store, running), await record_unknown(store, unknown)]

    for before in arranged:
        assert await store.mark_submitted(before.key) is None, before.status
        assert await current(store, before.key) == before


async def test_record_submission_failure__counts_and_stores_the_redacted_error(
    store: LedgerStore, engine: AsyncEngine
) -> None:
    key = new_key()
    await record_succeeded(store, key)

    await store.record_submission_failure(key, f"500 Internal Server Error (api key {LEAKED_KEY})")
    await store.record_submission_failure(key, f"timeout\x00 with Bearer {LEAKED_KEY}")

    call = await current(store, key)
    assert call.status is CallStatus.SUCCEEDED
    assert call.submission_count == 2
    assert call.last_submission_error is not None
    assert call.last_submission_error.startswith("timeout")
    assert "[REDACTED]" in call.last_submission_error
    assert "ABCDEFGHIJKLMNOP" not in call.last_submission_error
    events = await store.events(key)
    assert [e.kind for e in events][-2:] == ["submission_failed", "submission_failed"]
    async with engine.connect() as conn:
        stored = [
            *(await conn.execute(select(tool_calls))).all(),
            *(await conn.execute(select(tool_call_events))).all(),
        ]
    assert "ABCDEFGHIJKLMNOP" not in repr(stored), "the secret is stored nowhere"

    submitted = await store.mark_submitted(key)
    assert submitted is not None
    assert submitted.submission_count == 3
    assert submitted.last_submission_error is None


async def test_mark_confirmed__sets_confirmed_at_once(store: LedgerStore) -> None:
    key = new_key()
    await record_submitted(store, key)

    assert await store.mark_confirmed(key) is True
    confirmed = await current(store, key)
    assert confirmed.confirmed_at is not None
    assert confirmed.status is CallStatus.SUBMITTED

    assert await store.mark_confirmed(key) is False
    assert await current(store, key) == confirmed
    assert [e.kind for e in await store.events(key)].count("confirmed") == 1


async def test_mark_confirmed__a_call_not_submitted_is_not_confirmed(store: LedgerStore) -> None:
    key = new_key()
    done = await record_succeeded(store, key)

    assert await store.mark_confirmed(key) is False
    assert await current(store, key) == done


async def test_mark_confirmed_many__confirms_the_submitted_ones_once_each_with_an_event(
    store: LedgerStore,
) -> None:
    submitted = [new_key(), new_key(), new_key()]
    for key in submitted:
        await record_submitted(store, key)
    not_yet = new_key()
    await record_succeeded(store, not_yet)
    await store.mark_confirmed(submitted[0])

    confirmed = await store.mark_confirmed_many([*submitted, not_yet, new_key()])

    assert confirmed == set(submitted[1:])
    for key in submitted:
        call = await current(store, key)
        assert call.confirmed_at is not None
        trail = await store.events(key)
        assert [e.kind for e in trail].count("confirmed") == 1
        assert trail[-1].reason == "left required_actions"
        assert trail[-1].actor == store.actor
    assert (await current(store, not_yet)).confirmed_at is None
    assert await store.mark_confirmed_many(submitted) == set()
    assert await store.mark_confirmed_many([]) == set()


async def test_mark_submitted_many__moves_each_stored_result_once_with_the_state_it_left(
    store: LedgerStore,
) -> None:
    succeeded_key, failed_key, already = new_key(), new_key(), new_key()
    await record_succeeded(store, succeeded_key)
    await record_failed(store, failed_key)
    await record_submitted(store, already)
    running = new_key()
    await record_running(store, running)

    marked = await store.mark_submitted_many([succeeded_key, failed_key, already, running, new_key()])

    assert marked == {succeeded_key, failed_key}
    for key, left in ((succeeded_key, "succeeded"), (failed_key, "failed")):
        call = await current(store, key)
        assert call.status is CallStatus.SUBMITTED
        assert call.submission_count == 1
        assert call.submitted_at is not None
        last = (await store.events(key))[-1]
        assert (last.kind, last.from_status, last.to_status) == ("submission", left, "submitted")
        assert (last.actor, last.reason) == (store.actor, "result accepted in a batch")
    assert (await current(store, already)).submission_count == 1, "a submitted call is not counted again"
    assert (await current(store, running)).status is CallStatus.RUNNING
    assert await store.mark_submitted_many([succeeded_key, failed_key]) == set()
    assert await store.mark_submitted_many([]) == set()


# --------------------------------------------------------------------------------- abandon


@pytest.mark.parametrize(
    "arrange",
    [record_running, record_unknown, record_succeeded, record_failed],
    ids=["running", "unknown", "succeeded", "failed"],
)
async def test_abandon__an_open_call_is_abandoned_with_its_reason(
    store: LedgerStore, arrange: Callable[[LedgerStore, CallKey], Awaitable[CallRecord]]
) -> None:
    key = new_key()
    before = await arrange(store, key)

    call = await store.abandon(key, "left required_actions before a result was submitted")

    assert call is not None
    assert call.status is CallStatus.ABANDONED
    assert call.abandoned_reason == "left required_actions before a result was submitted"
    assert call.lease_expires_at is None
    assert call.result == before.result
    assert await current(store, key) == call
    events = await store.events(key)
    assert shape(events)[-1] == ("transition", before.status.value, "abandoned", before.lease_token)
    assert events[-1].reason == "left required_actions before a result was submitted"
    assert await store.abandon(key, "again") is None, "abandoned is final"


async def test_abandon__a_submitted_call_returns_none(store: LedgerStore) -> None:
    key = new_key()
    submitted = await record_submitted(store, key)

    assert await store.abandon(key, "too late") is None
    assert await current(store, key) == submitted


async def test_abandon__a_reason_with_a_nul_character_is_stored(
    store: LedgerStore, engine: AsyncEngine
) -> None:
    key = new_key()
    await record_running(store, key)

    call = await store.abandon(key, "operator said: stop\x00now")

    assert call is not None
    assert call.abandoned_reason == "operator said: stop\\u0000now"


# ------------------------------------------------------------------------------ audit reads


async def test_events__a_full_life_is_listed_in_order(store: LedgerStore) -> None:
    key = new_key()
    await record_running(store, key)
    await store.complete(key, 1, succeeded(key, "charged"))
    await store.mark_submitted(key)
    await store.mark_confirmed(key)

    events = await store.events(key)

    assert shape(events) == [
        ("transition", None, "running", 1),
        ("transition", "running", "succeeded", 1),
        ("submission", "succeeded", "submitted", 1),
        ("confirmed", "submitted", "submitted", None),
    ]
    assert [e.id for e in events] == sorted({e.id for e in events})
    assert [e.at for e in events] == sorted(e.at for e in events)
    assert {e.actor for e in events} == {ACTOR}
    assert {e.key for e in events} == {key}
    assert await store.events(new_key()) == []


async def test_in_states__for_session__get_many__return_the_matching_calls(store: LedgerStore) -> None:
    running_1, unknown_1, done_1 = (CallKey("sess_a", "turn_1", f"call_{i}") for i in (1, 2, 3))
    running_2 = CallKey("sess_b", "turn_1", "call_1")
    # Creation order is the order of the keys, a little apart so the timestamps differ.
    await record_running(store, running_1)
    await asyncio.sleep(0.01)
    await record_running(store, unknown_1, lease_seconds=SHORT_LEASE)
    await asyncio.sleep(0.01)
    await record_succeeded(store, done_1)
    await asyncio.sleep(0.01)
    await record_running(store, running_2)
    await asyncio.sleep(AFTER_SHORT_LEASE)
    await store.expire_leases(unknown_1)

    def keys(calls: list[CallRecord]) -> list[CallKey]:
        return [call.key for call in calls]

    assert keys(await store.in_states([CallStatus.RUNNING])) == [running_1, running_2]
    assert keys(await store.in_states([CallStatus.RUNNING], session_id="sess_b")) == [running_2]
    assert keys(await store.in_states([CallStatus.RUNNING, CallStatus.UNKNOWN], limit=2)) == [
        running_1,
        unknown_1,
    ]
    assert keys(await store.in_states([CallStatus.UNKNOWN, CallStatus.SUCCEEDED])) == [unknown_1, done_1]
    assert await store.in_states([CallStatus.SUBMITTED]) == []
    assert all(c.status is CallStatus.RUNNING for c in await store.in_states([CallStatus.RUNNING]))

    assert keys(await store.for_session("sess_a")) == [running_1, unknown_1, done_1]
    assert keys(await store.for_session("sess_b")) == [running_2]
    assert await store.for_session("sess_none") == []

    missing = CallKey("sess_a", "turn_1", "call_9")
    many = await store.get_many([done_1, running_2, missing])
    assert many == {done_1: await current(store, done_1), running_2: await current(store, running_2)}
    assert many[done_1].status is CallStatus.SUCCEEDED
    assert await store.get_many([]) == {}


# -------------------------------------------------------------------------------- the engine


async def test_create_engine__sqlite_runs_in_wal_with_synchronous_full(sqlite_url: str) -> None:
    engine = create_engine(sqlite_url)
    try:
        async with engine.connect() as conn:
            journal_mode = (await conn.execute(text("PRAGMA journal_mode"))).scalar_one()
            synchronous = (await conn.execute(text("PRAGMA synchronous"))).scalar_one()
            foreign_keys = (await conn.execute(text("PRAGMA foreign_keys"))).scalar_one()
            busy_timeout = (await conn.execute(text("PRAGMA busy_timeout"))).scalar_one()
    finally:
        await engine.dispose()

    assert str(journal_mode).lower() == "wal"
    assert synchronous == 2, "2 is FULL"
    assert foreign_keys == 1
    assert busy_timeout >= 1000


async def test_pool_exhausted__is_a_transient_error_the_outcome_write_retries(postgres_url: str) -> None:
    """Every pooled connection busy past the pool timeout (a burst of sessions) must be retried
    like a restarting database, not drop an outcome write."""
    from sqlalchemy import exc

    from toolledger.store.engine import is_transient

    engine = create_engine(postgres_url, pool_size=1, max_overflow=0, pool_timeout=0.2)
    try:
        store = LedgerStore(engine, actor="w")
        async with engine.connect():
            with pytest.raises(exc.TimeoutError) as raised:
                await store.get(CallKey("s", "t", "c"))
        assert is_transient(raised.value)
        assert await store.get(CallKey("s", "t", "c")) is None  # the pool is free again
    finally:
        await engine.dispose()


# ------------------------------------------------------------------------------- moments


async def test_every_moment_is_read_back_aware_in_utc_whatever_the_session_zone(database_url: str) -> None:
    """SQLite gives its UTC digits back naive, PostgreSQL gives timestamptz back in the
    session's zone: the ledger's column type makes both an aware UTC datetime."""
    far_from_utc = {"connect_args": {"options": "-c TimeZone=Asia/Kolkata"}}
    engine = create_engine(database_url, **(far_from_utc if database_url.startswith("postgresql") else {}))
    try:
        store = LedgerStore(engine, actor=ACTOR)
        running, finished = new_key(), new_key()
        claimed = await record_running(store, running)
        await record_succeeded(store, finished)
        await store.mark_submitted(finished)
        await store.mark_confirmed(finished)
        done = await current(store, finished)
        moments = [
            claimed.created_at,
            claimed.started_at,
            claimed.lease_expires_at,
            done.finished_at,
            done.submitted_at,
            done.confirmed_at,
            *(e.at for e in await store.events(finished)),
        ]
        _, soonest = await LedgerStore(engine, actor=OTHER_ACTOR).held_elsewhere()
        moments.append(soonest)

        for moment in moments:
            assert moment is not None
            assert moment.utcoffset() == timedelta(0)
        assert claimed.started_at is not None
        assert claimed.lease_expires_at is not None
        assert timedelta(seconds=LEASE_SECONDS - 5) < claimed.lease_expires_at - claimed.started_at
    finally:
        await engine.dispose()


async def test_a_moment_written_in_another_zone_is_stored_as_the_same_instant(engine: AsyncEngine) -> None:
    store = LedgerStore(engine, actor=ACTOR)
    call = await record_running(store, new_key())
    elsewhere = timezone(timedelta(hours=-7))
    moment = datetime(2026, 12, 4, 9, 30, tzinfo=elsewhere)
    async with engine.begin() as conn:
        await conn.execute(
            tool_calls.update()
            .where(tool_calls.c.call_id == call.key.call_id)
            .values(lease_expires_at=moment)
        )
        stored = (
            await conn.execute(
                select(tool_calls.c.call_id).where(
                    tool_calls.c.lease_expires_at == datetime(2026, 12, 4, 16, 30, tzinfo=UTC)
                )
            )
        ).scalar()

    assert stored == call.key.call_id
    assert (await current(store, call.key)).lease_expires_at == moment


# ------------------------------------------------------------------- one executor per database


async def test_a_ledger_store_is_the_executor_of_its_engines_database(engine: AsyncEngine) -> None:
    from toolledger.store.ledger_postgres import PostgresLedger
    from toolledger.store.ledger_sqlite import SqliteLedger

    store = LedgerStore(engine, actor=ACTOR, owner="replica-1")

    expected = PostgresLedger if engine.dialect.name == "postgresql" else SqliteLedger
    assert type(store) is expected
    assert isinstance(store, LedgerStore)
    assert (store.engine, store.actor, store.owner) == (engine, ACTOR, "replica-1")


async def test_claim__only_from_the_catalogues_sources_whatever_the_caller_lists(
    store: LedgerStore, other: LedgerStore
) -> None:
    """A submitted call is never claimed again, even by a caller that lists every state."""
    key = new_key()
    await record_succeeded(store, key)
    submitted = await store.mark_submitted(key)
    assert submitted is not None

    assert await other.claim(key, from_statuses=list(CallStatus), lease_seconds=1, reason="x") is None
    assert await current(store, key) == submitted
