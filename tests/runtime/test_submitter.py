"""Submissions in batches, against the emulator over HTTP with the real SDK, on SQLite and
PostgreSQL: a session's results ready at the same moment, or while its request is in flight,
go out together in ONE request; a lone result goes out at once, alone; a batch sent again (its
answer lost) is replayed, not applied twice; a batch refused for one call falls back to call
by call; a batch to a session that is gone abandons its calls.

The results are stored first (as a crashed worker leaves them), then submitted, so which
request carries which result is known.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass
from typing import Any, cast

from openai import AsyncOpenAI

from tests.support.executor_harness import FunctionCallAction, pending_actions, running_ledger
from tests.support.history import ledger_calls
from tests.support.polling import eventually
from toolledger.domain.keys import CallKey
from toolledger.domain.records import CallRecord
from toolledger.domain.results import succeeded
from toolledger.domain.states import CallStatus, EffectClass
from toolledger.domain.submissions import SubmitOutcome
from toolledger.emulator import EmulatorServer
from toolledger.runtime.call_runner import CallRunner
from toolledger.runtime.registry import ToolRegistry
from toolledger.runtime.submitter import batch_idempotency_key
from toolledger.runtime.tool_ledger import ToolLedger

registry = ToolRegistry()


@registry.tool(effect="idempotent")
def noop(n: int) -> str:
    """Does nothing: only its result's way to the API matters here."""
    return f"ok {n}"


CALLS = 5


async def stored_results(
    ledger: ToolLedger, session_id: str, actions: list[FunctionCallAction]
) -> list[CallRecord]:
    """Each action recorded, claimed and its result stored, nothing submitted."""
    store = ledger.executor.store
    calls = []
    for action in actions:
        key = CallKey(session_id, action.turn_id, action.call_id)
        recorded = await store.record(
            key,
            tool_name="noop",
            arguments=action.arguments,
            effect_class=EffectClass.IDEMPOTENT,
            lease_seconds=30,
        )
        calls.append(
            await store.complete(key, recorded.call.lease_token, succeeded(key, f"ok {key.call_id}"))
        )
    return calls


async def submit_all(ledger: ToolLedger, calls: list[CallRecord]) -> list[SubmitOutcome]:
    return list(await asyncio.gather(*(ledger.executor.submitter.submit(call) for call in calls)))


def requests(emulator: EmulatorServer, session_id: str) -> list[tuple[str | None, list[str], str]]:
    """The session's submissions as the emulator received them: per request (its key), the
    calls it carried and what became of it, in arrival order."""
    receipts = emulator.control.tool_results(session_id)
    grouped = itertools.groupby(receipts, key=lambda r: (r.idempotency_key, r.outcome))
    return [(key, [r.call_id for r in group], outcome) for (key, outcome), group in grouped]


async def test_results_ready_at_the_same_moment__go_out_together_in_one_request(
    database_url: str, emulator: EmulatorServer
) -> None:
    session_id, actions = await pending_actions(emulator, [("noop", {"n": n}) for n in range(CALLS)])
    async with running_ledger(registry, database_url, emulator) as ledger:
        calls = await stored_results(ledger, session_id, actions)
        assert await submit_all(ledger, calls) == [SubmitOutcome.SUBMITTED] * CALLS

    [(key, carried, outcome)] = requests(emulator, session_id)
    assert (key, sorted(carried), outcome) == (
        batch_idempotency_key(calls),
        sorted(c.key.call_id for c in calls),
        "accepted",
    )
    accepted = emulator.control.accepted_results(session_id)
    assert [len(payloads) for payloads in accepted.values()] == [1] * CALLS
    assert all(p == c.payload for c in calls for p in accepted[astuple(c.key)])
    stored = await ledger_calls(database_url, [session_id])
    assert {c.status for c in stored.values()} == {CallStatus.SUBMITTED}
    assert {c.submission_count for c in stored.values()} == {1}


async def test_a_lone_result__goes_out_at_once_under_its_own_key(
    database_url: str, emulator: EmulatorServer
) -> None:
    session_id, actions = await pending_actions(emulator, [("noop", {"n": 1})])
    async with running_ledger(registry, database_url, emulator) as ledger:
        [call] = await stored_results(ledger, session_id, actions)
        assert await submit_all(ledger, [call]) == [SubmitOutcome.SUBMITTED]
    assert requests(emulator, session_id) == [(call.idempotency_key, [call.key.call_id], "accepted")]


async def test_results_ready_while_a_request_is_in_flight__go_out_together_in_the_next(
    database_url: str, emulator: EmulatorServer
) -> None:
    """The first request is applied and its answer lost, so it is in flight (retried with
    its key, and replayed) while two more results become ready: they wait for it, then go
    out together."""
    session_id, actions = await pending_actions(emulator, [("noop", {"n": n}) for n in range(CALLS)])
    emulator.control.accept_then_drop(1, session_id=session_id)
    async with running_ledger(registry, database_url, emulator) as ledger:
        calls = await stored_results(ledger, session_id, actions)
        early, late = calls[:3], calls[3:]
        first = asyncio.ensure_future(submit_all(ledger, early))
        await eventually(lambda: emulator.control.tool_results(session_id), what="the first request applied")
        assert not first.done(), "its answer was lost: it is being sent again"
        assert await submit_all(ledger, late) == [SubmitOutcome.SUBMITTED] * 2
        assert await first == [SubmitOutcome.SUBMITTED] * 3

    assert [(key, outcome) for key, _calls, outcome in requests(emulator, session_id)] == [
        (batch_idempotency_key(early), "accepted"),
        (batch_idempotency_key(early), "replayed"),
        (batch_idempotency_key(late), "accepted"),
    ]
    accepted = emulator.control.accepted_results(session_id)
    assert [len(payloads) for payloads in accepted.values()] == [1] * CALLS


async def test_a_batch_refused_for_one_call__the_others_go_out_one_by_one(
    database_url: str, emulator: EmulatorServer
) -> None:
    session_id, actions = await pending_actions(emulator, [("noop", {"n": n}) for n in range(3)])
    async with running_ledger(registry, database_url, emulator) as ledger:
        first, second, answered = await stored_results(ledger, session_id, actions)
        # Someone answered the third call already (an earlier submission whose answer was lost).
        async with AsyncOpenAI(base_url=emulator.base_url, api_key="sk-test") as client:
            await client.beta.agents.sessions.events.create(
                session_id, events=[cast(Any, answered.payload)], idempotency_key=answered.idempotency_key
            )
        assert await submit_all(ledger, [first, second, answered]) == [SubmitOutcome.SUBMITTED] * 3

    sent = requests(emulator, session_id)
    refused_batch = (batch_idempotency_key([first, second, answered]), "rejected")
    assert refused_batch in {(key, outcome) for key, _calls, outcome in sent}
    accepted = emulator.control.accepted_results(session_id)
    assert [len(payloads) for payloads in accepted.values()] == [1] * 3, "each call answered once"
    stored = await ledger_calls(database_url, [session_id])
    assert {c.status for c in stored.values()} == {CallStatus.SUBMITTED}


async def test_a_batch_to_a_session_that_is_gone__abandons_every_call_of_it(
    database_url: str, emulator: EmulatorServer
) -> None:
    session_id, actions = await pending_actions(emulator, [("noop", {"n": n}) for n in range(3)])
    async with running_ledger(registry, database_url, emulator) as ledger:
        calls = await stored_results(ledger, session_id, actions)
        async with AsyncOpenAI(base_url=emulator.base_url, api_key="sk-test") as client:
            await client.beta.agents.sessions.delete(session_id)
        assert await submit_all(ledger, calls) == [SubmitOutcome.ABANDONED] * 3

    stored = await ledger_calls(database_url, [session_id])
    assert {c.status for c in stored.values()} == {CallStatus.ABANDONED}


@dataclass(frozen=True)
class Result:
    idempotency_key: str
    payload: dict[str, Any]


def test_batch_key__the_same_for_the_same_results_in_any_order_and_another_for_others() -> None:
    def result(call_id: str, output: str) -> Result:
        key = CallKey("sess_a", "turn_1", call_id)
        return Result(key.idempotency_key, succeeded(key, output).payload)

    a, b, c = result("c1", "x"), result("c2", "y"), result("c3", "z")
    assert batch_idempotency_key([a, b, c]) == batch_idempotency_key([c, a, b])
    assert batch_idempotency_key([a, b]) != batch_idempotency_key([a, b, c])
    assert batch_idempotency_key([a, b]) != batch_idempotency_key([a, result("c2", "another output")])
    assert batch_idempotency_key([a, b]).startswith("tlb_")


def astuple(key: CallKey) -> tuple[str, str, str]:
    return key.session_id, key.turn_id, key.call_id


async def test_stored_results_resent_through_the_call_runner__take_no_handler_slot(
    sqlite_url: str, emulator: EmulatorServer
) -> None:
    """A reconcile hands the runner a session's stored results: they run no handler, so they
    do not queue for handler slots (held here by a handler that waits), and go out together
    in one request. Queued for slots, they trickled out a few at a time after a crash."""
    slow = ToolRegistry()
    release = asyncio.Event()

    @slow.tool(effect="idempotent")
    async def wait(n: int) -> str:
        await release.wait()
        return "done"

    session_id, actions = await pending_actions(emulator, [("noop", {"n": n}) for n in range(CALLS)])
    busy_id, [busy] = await pending_actions(emulator, [("wait", {"n": 0})])
    async with running_ledger(slow, sqlite_url, emulator, max_concurrent_calls=1) as ledger:
        calls = await stored_results(ledger, session_id, actions)
        runner = CallRunner(ledger.executor)
        holding = runner.dispatch(busy_id, busy)
        await eventually(lambda: runner.is_running(CallKey(busy_id, busy.turn_id, busy.call_id)))
        reports = await asyncio.wait_for(
            asyncio.gather(*(runner.run(session_id, a, c) for a, c in zip(actions, calls, strict=True))),
            timeout=10,
        )
        assert holding is not None
        assert not holding.done(), "the only handler slot was held throughout"
        release.set()
        await holding

    assert [r.submitted for r in reports if r is not None] == [True] * CALLS
    [(key, carried, outcome)] = requests(emulator, session_id)
    assert (key, len(carried), outcome) == (batch_idempotency_key(calls), CALLS, "accepted")
