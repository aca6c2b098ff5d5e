"""Sends stored results to the Agents API and writes down what became of them.

Results of one session go out in batches without ever waiting to fill one: a result whose
session has no submission in flight is sent at once, alone; results that become ready while
one is in flight go out together in the next request, as ONE ``events.create`` whose
Idempotency-Key is derived from its calls' keys and payloads (a retry of the same batch, after
a crash too, replays). The API applies a request whole or not at all; a batch it refuses (one
call answered already, or no longer awaited) is sent again call by call, so one bad call
never holds up the others. An accepted batch is marked ``submitted`` in one transaction.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from toolledger import metrics
from toolledger.crashpoints import CP_AFTER_BATCH_RESPONSE, CP_AFTER_SUBMIT_RESPONSE, crash_point
from toolledger.domain.keys import CallKey, canonical_json
from toolledger.domain.records import CallRecord
from toolledger.domain.submissions import SubmissionFailure, SubmitOutcome
from toolledger.errors import SessionGoneError, SubmissionError
from toolledger.gateway.agents import AgentsGateway
from toolledger.logs import log_fields
from toolledger.runtime.retried_ledger import RetriedLedger
from toolledger.tracing import call_span

log = logging.getLogger("toolledger.executor")

SIBLING_WAIT_SECONDS = 1.0
"""How long a session's ready results wait for its calls still running here, to go in one
request with theirs. Bounded: the waiting results and their sender hold handler slots (the
call runner's), so a slow tool would otherwise hold its siblings, and with enough such
sessions every slot of the process, until it finished."""
SUBMIT_RETRY_FIRST = 1.0
SUBMIT_RETRY_MAX = 30.0


@dataclass
class _Waiting:
    """A stored result queued for its session's next request."""

    call: CallRecord
    listed: bool
    outcome: asyncio.Future[SubmitOutcome]


@dataclass
class _SessionQueue:
    waiting: list[_Waiting] = field(default_factory=list)
    sending: bool = False
    """A request of this session is in flight: what queues meanwhile goes out next, together."""
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)


class Submitter:
    def __init__(
        self, gateway: AgentsGateway | None, ledger: RetriedLedger, *, batching: bool = True
    ) -> None:
        """``batching=False``: every result in a request of its own (the benchmarks' baseline)."""
        self.gateway = gateway
        self.ledger = ledger
        self.batching = batching
        self._queues: dict[str, _SessionQueue] = {}
        self._running: Callable[[str], Collection[CallKey]] = lambda _session_id: ()

    def follow_running(self, running: Callable[[str], Collection[CallKey]]) -> None:
        """``running(session)``: the session's calls being handled in this process now (the
        call runner's). A request waits for those to have their results ready (or to be done
        without one), up to ``SIBLING_WAIT_SECONDS``: the session's turn continues only once
        it has every result, so its calls' results go together (``running_finished`` says
        when one is done)."""
        self._running = running

    async def running_finished(self, session_id: str) -> None:
        queue = self._queues.get(session_id)
        if queue is not None:
            async with queue.changed:
                queue.changed.notify_all()

    async def submit(self, call: CallRecord, *, listed: bool = True) -> SubmitOutcome:
        """Send the stored result, byte for byte, with the call's stable Idempotency-Key (or
        in a batch of its session's results, with the batch's).

        ``listed``: the call was in the session's ``required_actions`` just now. A call that
        was not is abandoned if the session refuses it as not pending.
        """
        key = call.key
        with (
            log_fields(session_id=key.session_id, turn_id=key.turn_id, call_id=key.call_id),
            call_span("toolledger.submit", key, tool=call.tool_name) as span,
        ):
            if self.gateway is None or call.payload is None:
                outcome = SubmitOutcome.NOT_SENT
            elif self.batching:
                outcome = await self._queued(call, listed)
            else:
                outcome = await self._alone(call, listed)
            span.set("outcome", outcome.value)
        metrics.SUBMISSIONS.labels(outcome.value).inc()
        return outcome

    async def _queued(self, call: CallRecord, listed: bool) -> SubmitOutcome:
        """Queue the result; whoever finds no request of the session in flight sends all that
        is queued (its own result included), and the others wait for their outcome."""
        session_id = call.key.session_id
        queue = self._queues.setdefault(session_id, _SessionQueue())
        mine = _Waiting(call, listed, asyncio.get_running_loop().create_future())
        queue.waiting.append(mine)
        async with queue.changed:
            queue.changed.notify_all()  # a sender waiting for this result has it now
            while queue.sending and not mine.outcome.done():
                await queue.changed.wait()
            if mine.outcome.done():
                return mine.outcome.result()
            queue.sending = True
        batch: list[_Waiting] = []
        try:
            # One turn of the event loop, not a timer: results made ready by the same moment
            # (a session's calls resubmitted together after a crash) join this request; so do
            # those of its calls still running here (see follow_running).
            await asyncio.sleep(0)
            async with queue.changed:
                try:
                    async with asyncio.timeout(SIBLING_WAIT_SECONDS):
                        while self._still_running(session_id, queue):
                            await queue.changed.wait()
                except TimeoutError:
                    pass  # a sibling still running goes in a later request of its own
                batch, queue.waiting = queue.waiting, []
            await self._send(session_id, batch)
        except BaseException as error:
            unsent = [w for w in batch if not w.outcome.done()]
            if isinstance(error, asyncio.CancelledError):
                # This sender's caller gave up: the others' results go out with the next one.
                queue.waiting = [w for w in unsent + queue.waiting if w is not mine]
            else:
                for waiting in unsent:
                    if waiting is not mine:
                        waiting.outcome.set_exception(error)
            raise
        finally:
            async with queue.changed:
                queue.sending = False
                if not queue.waiting and self._queues.get(session_id) is queue:
                    del self._queues[session_id]
                queue.changed.notify_all()
        return mine.outcome.result()

    def _still_running(self, session_id: str, queue: _SessionQueue) -> bool:
        """Whether a call of the session runs here whose result is not queued yet."""
        running = self._running(session_id)
        if not running:
            return False
        queued = {waiting.call.key for waiting in queue.waiting}
        return any(key not in queued for key in running)

    async def _send(self, session_id: str, batch: Sequence[_Waiting]) -> None:
        """One request for ``batch``; each waiting call's outcome set."""
        if len(batch) == 1:
            (only,) = batch
            only.outcome.set_result(await self._alone(only.call, only.listed))
            return
        assert self.gateway is not None
        calls = sorted((w.call for w in batch), key=lambda c: c.idempotency_key)
        payloads = [c.payload for c in calls if c.payload is not None]
        metrics.SUBMISSION_BATCH_SIZE.observe(len(calls))
        try:
            with metrics.SUBMISSION_DURATION.time():
                await self.gateway.submit_tool_results(
                    session_id,
                    payloads,
                    batch_idempotency_key(calls),
                    expect_pending=all(w.listed for w in batch),
                )
        except SessionGoneError as error:
            for waiting in batch:
                await self.ledger.store.abandon(waiting.call.key, f"session gone: {error}")
                waiting.outcome.set_result(SubmitOutcome.ABANDONED)
            return
        except SubmissionError as error:
            if error.kind is SubmissionFailure.RETRYABLE:
                # The API is away, for every call alike: each waits for its backoff.
                for waiting in batch:
                    waiting.outcome.set_result(await self._failed(waiting.call, error))
                return
            # Refused for one of them (answered already, not awaited, not acceptable):
            # each call on its own, as if it had never been batched.
            outcomes = await asyncio.gather(*(self._alone(w.call, w.listed) for w in batch))
            for waiting, outcome in zip(batch, outcomes, strict=True):
                waiting.outcome.set_result(outcome)
            return
        crash_point(CP_AFTER_BATCH_RESPONSE)
        await self.ledger.mark_submitted_many([c.key for c in calls])
        for waiting in batch:
            waiting.outcome.set_result(SubmitOutcome.SUBMITTED)

    async def _alone(self, call: CallRecord, listed: bool) -> SubmitOutcome:
        assert self.gateway is not None
        assert call.payload is not None
        store = self.ledger.store
        try:
            with metrics.SUBMISSION_DURATION.time():
                await self.gateway.submit_tool_result(
                    call.key.session_id, call.payload, call.idempotency_key, expect_pending=listed
                )
        except SessionGoneError as error:
            await store.abandon(call.key, f"session gone: {error}")
            return SubmitOutcome.ABANDONED
        except SubmissionError as error:
            outcome = await self._refused(call, error, listed)
            if outcome is not SubmitOutcome.FAILED:
                return outcome
            return await self._failed(call, error)
        crash_point(CP_AFTER_SUBMIT_RESPONSE)
        await self.ledger.mark_submitted(call.key)
        return SubmitOutcome.SUBMITTED

    async def _failed(self, call: CallRecord, error: SubmissionError) -> SubmitOutcome:
        store = self.ledger.store
        await store.record_submission_failure(call.key, str(error))
        log.warning(
            "submitting %s failed (%s); left for the reconciler", call.key, store.redactor.text(str(error))
        )
        return SubmitOutcome.FAILED

    async def _refused(self, call: CallRecord, error: SubmissionError, listed: bool) -> SubmitOutcome:
        """A refusal that ends the call's submission: answered already, or not awaited any more."""
        store = self.ledger.store
        if error.kind is SubmissionFailure.ALREADY_ANSWERED:
            # An earlier submission of this call landed but its answer never reached us.
            await store.mark_submitted(call.key, reason=f"already answered: {error}")
            return SubmitOutcome.SUBMITTED
        if error.kind is SubmissionFailure.NOT_PENDING and not listed:
            await store.abandon(call.key, "no longer awaited by the session")
            return SubmitOutcome.ABANDONED
        return SubmitOutcome.FAILED


class StoredResult(Protocol):
    """What a batch's key is made of: each call's own key and its stored result."""

    @property
    def idempotency_key(self) -> str: ...

    @property
    def payload(self) -> dict[str, Any] | None: ...


def batch_idempotency_key(calls: Sequence[StoredResult]) -> str:
    """The same for the same calls with the same stored results, whatever their order: a
    batch sent again after a crash is replayed by the API, not applied twice. (A batch made
    up differently gets another key; the API then refuses the calls it has answered, and the
    per-call fallback recognises them.)"""
    lines = sorted(f"{c.idempotency_key} {canonical_json(c.payload)}" for c in calls)
    digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()
    return f"tlb_{digest[:48]}"


def submission_backoff(call: CallRecord) -> float:
    """When to send a stored result again after a failed try: sooner than the next periodic
    reconcile, later with each try the call has had."""
    return min(SUBMIT_RETRY_FIRST * 2.0 ** min(call.submission_count, 16), SUBMIT_RETRY_MAX)
