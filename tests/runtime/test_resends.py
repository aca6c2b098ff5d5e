"""A resend is the same request, and the session's state decides what became of a call, on
SQLite and PostgreSQL, against the emulator over HTTP with the real SDK.

Before a stored result is first posted, the request it goes out in is recorded; every later
post of it is exactly that request. After a request the API did not take, one read of the
session decides: still listed, the same request again (or, refused whole, member by member);
no longer listed, confirmed if a request that may have carried it went out, abandoned if none
did; never by the wording of the refusal, which here takes each of the forms a real API might.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.runtime.test_submitter import registry, stored_results, submit_all
from tests.support.executor_harness import pending_actions, running_ledger
from tests.support.history import answered_then_sent_again, ledger_calls
from toolledger.domain.states import CallStatus
from toolledger.domain.submissions import SubmitOutcome
from toolledger.emulator import ALREADY_ANSWERED_STYLES, AlreadyAnswered, EmulatorServer
from toolledger.runtime.submitter import batch_idempotency_key

TWO_CALLS = [("noop", {"n": 1}), ("noop", {"n": 2})]


@pytest.mark.parametrize("style", ALREADY_ANSWERED_STYLES)
async def test_an_accepted_batch_whose_answer_was_lost__its_replays_refused_in_any_wording__is_confirmed(
    database_url: str, emulator: EmulatorServer, style: AlreadyAnswered
) -> None:
    """The API applied the batch but the answer never came; it keeps no keys, so the replay
    is refused as answered already, in this style's words. The session no longer lists the
    calls: confirmed, and nothing but that one request was ever sent."""
    emulator.control.set_behaviour(already_answered=style, idempotency_keys="ignored")
    session_id, actions = await pending_actions(emulator, TWO_CALLS)
    async with running_ledger(registry, database_url, emulator) as ledger:
        calls = await stored_results(ledger, session_id, actions)
        emulator.control.accept_then_drop(1, session_id=session_id)
        assert await submit_all(ledger, calls) == [SubmitOutcome.SUBMITTED] * 2
        trails = [await ledger.store.events(call.key) for call in calls]

    received = emulator.control.tool_results(session_id)
    assert {(r.idempotency_key, r.request_sha256) for r in received} == {
        (batch_idempotency_key(calls), received[0].request_sha256)
    }, "every post was the one recorded request"
    assert [r.outcome for r in received[:2]] == ["accepted", "accepted"]
    assert {r.outcome for r in received[2:]} == {"rejected"}, "its replays met the refusal"
    assert answered_then_sent_again(received) == []
    stored = await ledger_calls(database_url, [session_id])
    assert {(c.status, c.confirmed_at is not None) for c in stored.values()} == {(CallStatus.SUBMITTED, True)}
    for trail in trails:
        assert any("taken as answered by it" in (e.reason or "") for e in trail), trail


async def test_a_recorded_batch__is_posted_whole_whoever_sends_one_of_its_members(
    database_url: str, emulator: EmulatorServer
) -> None:
    """A process died after recording the batch, before posting it; another finds only one
    of its members to send. What goes out is the batch as recorded, both members in it."""
    session_id, actions = await pending_actions(emulator, TWO_CALLS)
    async with running_ledger(registry, database_url, emulator) as ledger:
        first, second = await stored_results(ledger, session_id, actions)
        key = batch_idempotency_key([first, second])
        recorded = await ledger.store.record_request([first.key, second.key], key, reason="by a dead worker")
        assert recorded is not None
        assert await ledger.executor.submitter.submit(recorded[0]) is SubmitOutcome.SUBMITTED

    received = emulator.control.tool_results(session_id)
    assert sorted((r.idempotency_key, r.call_id, r.outcome) for r in received) == sorted(
        (key, c.key.call_id, "accepted") for c in (first, second)
    )
    stored = await ledger_calls(database_url, [session_id])
    assert {c.status for c in stored.values()} == {CallStatus.SUBMITTED}


async def test_a_request_is_recorded_once__a_call_in_one_never_joins_another(
    database_url: str, emulator: EmulatorServer
) -> None:
    session_id, actions = await pending_actions(emulator, TWO_CALLS)
    async with running_ledger(registry, database_url, emulator) as ledger:
        first, second = await stored_results(ledger, session_id, actions)
        store = ledger.store
        assert await store.record_request([first.key], first.idempotency_key, reason="alone") is not None
        both = batch_idempotency_key([first, second])
        assert await store.record_request([first.key, second.key], both, reason="together") is None
        assert (await store.get(second.key)) == second, "all or none: the other call was left as it was"
        events = await store.events(first.key)
    assert [(e.kind, e.detail) for e in events if e.kind == "request"] == [("request", first.idempotency_key)]


async def test_a_stored_result_no_longer_awaited__is_never_sent(
    database_url: str, emulator: EmulatorServer
) -> None:
    """The turn ended before anything was posted: abandoned. A call whose request may have
    gone out (recorded, its answer unknown) is taken as answered by it. Neither is sent."""
    session_id, actions = await pending_actions(emulator, TWO_CALLS)
    async with running_ledger(registry, database_url, emulator) as ledger:
        never_posted, maybe_posted = await stored_results(ledger, session_id, actions)
        await ledger.store.record_request([maybe_posted.key], maybe_posted.idempotency_key, reason="test")
        emulator.control.cancel_turn(session_id)
        await ledger.recover()
        after = {key: await ledger.store.get(key) for key in (never_posted.key, maybe_posted.key)}

    assert emulator.control.tool_results(session_id) == []
    abandoned, confirmed = after[never_posted.key], after[maybe_posted.key]
    assert abandoned is not None
    assert confirmed is not None
    assert (abandoned.status, abandoned.abandoned_reason) == (
        CallStatus.ABANDONED,
        "no longer awaited by the session",
    )
    assert (confirmed.status, confirmed.confirmed_at is not None) == (CallStatus.SUBMITTED, True)


async def test_a_batch_refused_while_every_member_is_awaited__goes_out_member_by_member(
    database_url: str, emulator: EmulatorServer
) -> None:
    """A 4xx: the batch was not applied. Its members, still listed, go out alone at once."""
    session_id, actions = await pending_actions(emulator, TWO_CALLS)
    emulator.control.fail_submissions(1, status=400, session_id=session_id)
    async with running_ledger(registry, database_url, emulator) as ledger:
        calls = await stored_results(ledger, session_id, actions)
        assert await submit_all(ledger, calls) == [SubmitOutcome.SUBMITTED] * 2
        trail = await ledger.store.events(calls[0].key)

    batch = batch_idempotency_key(calls)
    received = emulator.control.tool_results(session_id)
    assert [(r.idempotency_key, r.outcome) for r in received[:2]] == [(batch, "rejected")] * 2
    assert sorted((r.idempotency_key, r.outcome) for r in received[2:]) == sorted(
        (c.idempotency_key, "accepted") for c in calls
    )
    moved = [e for e in trail if e.kind == "request"]
    assert [e.detail for e in moved] == [batch, calls[0].idempotency_key]
    assert moved[1].reason == f"request {batch} was refused; sent alone from now on"


async def test_a_batch_that_may_have_been_applied__goes_again_as_the_same_request(
    database_url: str, emulator: EmulatorServer
) -> None:
    """Server errors past the retries: maybe applied, so never split. The calls still listed,
    the next send is the same request, byte for byte."""
    session_id, actions = await pending_actions(emulator, TWO_CALLS)
    async with running_ledger(registry, database_url, emulator) as ledger:
        calls = await stored_results(ledger, session_id, actions)
        emulator.control.fail_submissions(6, status=500, session_id=session_id)
        assert await submit_all(ledger, calls) == [SubmitOutcome.FAILED] * 2
        again = [await ledger.store.get(call.key) for call in calls]
        assert all(call is not None and call.last_submission_error for call in again)
        assert (
            await asyncio.gather(
                *(ledger.executor.submitter.submit(call) for call in again if call is not None)
            )
            == [SubmitOutcome.SUBMITTED] * 2
        )

    received = emulator.control.tool_results(session_id)
    assert len({(r.idempotency_key, r.request_sha256) for r in received}) == 1
    assert [r.outcome for r in received] == ["rejected"] * 12 + ["accepted"] * 2
