"""Sends stored results to the Agents API and writes down what became of them.

**A resend is the same request.** Before a stored result is first posted, the request it goes
out in is recorded (``request_key``: its Idempotency-Key, which a batch's members share). From
then on the result is only ever sent in exactly that request, after a crash too: the same key,
the same members, the same bytes. Only once the API has refused that request (a 4xx: it was not
applied) may a member still awaited go out in a request of its own, under its own key.

**Only what is pending is sent**, and after any request the API did not take, one read of the
session decides what became of its calls, never the error's wording (a real API's is not ours
to know):
- still listed: sent again per the failure, the same request after a backoff; a batch refused
  whole, or holding calls no longer awaited, goes out member by member at once;
- no longer listed: confirmed when a request that may have carried it went out (taken as
  answered by it), abandoned when none can have (outside the moments after a call is made,
  when the session may not list it yet: the SDK-documented registration race);
- the session gone or failed: abandoned.

Results of one session go out in batches without ever waiting to fill one: a result whose
session has no request in flight is sent at once, alone; results that become ready while one is
in flight go out together in the next request, whose key is derived from its members' keys and
payloads. An accepted batch is marked ``submitted`` in one transaction.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Protocol

import openai

from toolledger import metrics
from toolledger.crashpoints import (
    CP_AFTER_BATCH_RESPONSE,
    CP_AFTER_REQUEST_RECORD,
    CP_AFTER_SUBMIT_REFUSED,
    CP_AFTER_SUBMIT_RESPONSE,
    crash_point,
)
from toolledger.domain.delivered import delivered_key
from toolledger.domain.keys import CallKey, canonical_json
from toolledger.domain.records import CallRecord
from toolledger.domain.states import RESULT_STATUSES, CallStatus
from toolledger.domain.submissions import SubmissionFailure, SubmitOutcome
from toolledger.errors import AgentsAuthError, SessionGoneError, SubmissionError
from toolledger.gateway.agents import AgentsGateway, FunctionCallAction
from toolledger.logs import log_fields
from toolledger.runtime.retried_ledger import RetriedLedger
from toolledger.store.ledger import SENDABLE_STATUSES
from toolledger.tracing import call_span

log = logging.getLogger("toolledger.executor")

SIBLING_WAIT_SECONDS = 1.0
"""How long a session's ready results wait for its calls still running here, to go in one
request with theirs. Bounded: the waiting results and their sender hold handler slots (the
call runner's), so a slow tool would otherwise hold its siblings, and with enough such
sessions every slot of the process, until it finished."""
SUBMIT_RETRY_FIRST = 1.0
SUBMIT_RETRY_MAX = 30.0
LISTING_RACE_SECONDS = 5.0
"""How long after a call was recorded its session may not list it yet: the registration race
the SDK documents (its own helper retries it for a second). Until then a call the session
does not list, and no request of which can have been applied, is looked at again rather
than abandoned (unless the session is idle: then it awaits nothing)."""
UNLISTED_REASON = "no longer awaited by the session"


class Unlisted(StrEnum):
    """What became of a call with a stored result that its session no longer lists."""

    CONFIRMED = "confirmed"
    """A request that may have carried it went out: taken as answered by it, and confirmed."""
    ABANDONED = "abandoned"
    """No request carrying it was ever accepted: nobody awaits it any more."""
    AWAITING_LISTING = "awaiting_listing"
    """Recorded moments ago: the session may not list it yet. Looked at again soon."""
    RACED = "raced"
    """Another worker moved it on first."""


_UNLISTED_OUTCOMES = {
    Unlisted.CONFIRMED: SubmitOutcome.SUBMITTED,
    Unlisted.ABANDONED: SubmitOutcome.ABANDONED,
    Unlisted.AWAITING_LISTING: SubmitOutcome.FAILED,
    Unlisted.RACED: SubmitOutcome.NOT_SENT,
}


@dataclass(frozen=True)
class _Request:
    """One request of stored results, as recorded: what every post of it sends."""

    session_id: str
    key: str
    members: list[CallRecord]
    """In the request's order (by idempotency key)."""
    new: bool
    """Recorded by this submission: no earlier post of it can have been applied."""

    @property
    def payloads(self) -> list[dict[str, Any]]:
        return [member.payload for member in self.members if member.payload is not None]


@dataclass
class _Waiting:
    """A stored result queued for its session's next request."""

    call: CallRecord
    outcome: asyncio.Future[SubmitOutcome]


@dataclass
class _SessionQueue:
    waiting: list[_Waiting] = field(default_factory=list)
    sending: bool = False
    """A request of this session is in flight: what queues meanwhile goes out next, together."""
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)


@dataclass(frozen=True)
class SessionListing:
    """What a read of a session found: the calls it awaits (its ``function_call`` required
    actions) and its status; or, in ``ended``, why it awaits nothing any more."""

    awaited: frozenset[CallKey]
    status: str | None
    ended: str | None = None


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
        """Send the stored result in its recorded request (recording one first if it has none).

        ``listed``: the session listed the call a moment ago. False (an operator's resolution,
        say): the session is read first, and the result sent only if it still awaits the call.
        """
        key = call.key
        if listed is False and self.gateway is not None and call.payload is not None:
            # Counted where it is decided: sent (by this method) or closed unsent.
            return (await self.submit_awaited(key.session_id, [call]))[key]
        with (
            log_fields(session_id=key.session_id, turn_id=key.turn_id, call_id=key.call_id),
            call_span("toolledger.submit", key, tool=call.tool_name) as span,
        ):
            if self.gateway is None or call.payload is None:
                outcome = SubmitOutcome.NOT_SENT
            elif self.batching:
                outcome = await self._queued(call)
            else:
                outcome = (await self._send(key.session_id, [call]))[key]
            span.set("outcome", outcome.value)
        _count([outcome])
        return outcome

    async def submit_awaited(
        self, session_id: str, calls: Sequence[CallRecord]
    ) -> dict[CallKey, SubmitOutcome]:
        """Read the session, then send the stored results of ``calls`` it still awaits (in one
        request where they can go together) and close those it does not."""
        if self.gateway is None:
            return {call.key: SubmitOutcome.NOT_SENT for call in calls}
        try:
            listing = await self._listing(session_id)
        except AgentsAuthError:
            raise
        except (openai.OpenAIError, SubmissionError) as error:
            log.warning("session %s could not be read (%s): its results wait", session_id, error)
            outcomes = {call.key: SubmitOutcome.FAILED for call in calls}
            _count(outcomes.values())
            return outcomes
        outcomes = {}
        awaited: list[CallRecord] = []
        for call in calls:
            if listing.ended is not None:
                outcomes[call.key] = await self._abandon(call, listing.ended)
            elif call.key in listing.awaited:
                awaited.append(call)
            else:
                fate = await self.close_unlisted(
                    call, may_have_landed=call.request_key is not None, session_status=listing.status
                )
                outcomes[call.key] = await self._unlisted_outcome(call, fate)
        _count(outcomes.values())
        if awaited:
            sent = await asyncio.gather(*(self.submit(call) for call in awaited))
            outcomes.update(zip((call.key for call in awaited), sent, strict=True))
        return outcomes

    async def close_unlisted(
        self, call: CallRecord, *, may_have_landed: bool, session_status: str | None
    ) -> Unlisted:
        """A call with a result (stored or submitted) that its session no longer lists: never
        sent again. ``may_have_landed``: a request carrying it went out and may have been
        applied (its answer was not seen, or was a success). ``session_status``: the
        session's, as it was read with its listing."""
        store = self.ledger.store
        if call.status is CallStatus.SUBMITTED:
            return Unlisted.CONFIRMED if await store.mark_confirmed(call.key) else Unlisted.RACED
        if call.status not in RESULT_STATUSES:
            return Unlisted.RACED
        if not may_have_landed:
            # Read again before abandoning: another process (serve beside an operator's
            # command, say) may have put it in a request and sent it since ``call`` was read,
            # and a call whose request went out is never told it was not answered.
            current = await store.get(call.key)
            if current is None or current.status not in RESULT_STATUSES:
                return Unlisted.RACED
            may_have_landed = current.request_key not in (None, call.request_key)
            call = current
        if may_have_landed:
            # Were it wrong (a call the session lists again later), the call is answered
            # then all the same: a listed call's request is sent again, whatever its status.
            reason = (
                f"no longer awaited by the session after request {call.request_key} went out "
                "(its answer was not seen): taken as answered by it"
            )
            if await store.mark_submitted(call.key, reason=reason) is None:
                return Unlisted.RACED
            await store.mark_confirmed(call.key)
            return Unlisted.CONFIRMED
        if session_status != "idle" and _seconds_since(call.created_at) < LISTING_RACE_SECONDS:
            # Abandoned, a call the session lists a moment later would never be answered.
            return Unlisted.AWAITING_LISTING
        if await store.abandon(call.key, UNLISTED_REASON):
            return Unlisted.ABANDONED
        return Unlisted.RACED

    # ------------------------------------------------------------------ batching

    async def _queued(self, call: CallRecord) -> SubmitOutcome:
        """Queue the result; whoever finds no request of the session in flight sends all that
        is queued (its own result included), and the others wait for their outcome."""
        session_id = call.key.session_id
        queue = self._queues.setdefault(session_id, _SessionQueue())
        mine = _Waiting(call, asyncio.get_running_loop().create_future())
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
            outcomes = await self._send(session_id, [waiting.call for waiting in batch])
            for waiting in batch:
                if not waiting.outcome.done():
                    waiting.outcome.set_result(outcomes.get(waiting.call.key, SubmitOutcome.NOT_SENT))
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

    # ------------------------------------------------------------------ requests

    async def _send(self, session_id: str, calls: Sequence[CallRecord]) -> dict[CallKey, SubmitOutcome]:
        """Post the recorded requests of ``calls`` (one, unless some are in other requests
        already); what became of each call."""
        outcomes, requests = await self._requests_for(session_id, calls)
        for request in requests:
            outcomes.update(await self._post(request))
        return outcomes

    async def _requests_for(
        self, session_id: str, calls: Sequence[CallRecord]
    ) -> tuple[dict[CallKey, SubmitOutcome], list[_Request]]:
        """The requests ``calls`` go out in: those they are recorded in already, and one
        recorded now for those in none (before it is ever posted). Calls that hold no result
        to send any more get their outcome instead."""
        store = self.ledger.store
        outcomes: dict[CallKey, SubmitOutcome] = {}
        requests: dict[str, _Request] = {}
        unresolved = list({call.key: call for call in calls}.values())
        while unresolved:
            fresh = [call for call in unresolved if call.request_key is None]
            placed = [call for call in unresolved if call.request_key is not None]
            unresolved = []
            if fresh:
                request_key = fresh[0].idempotency_key if len(fresh) == 1 else batch_idempotency_key(fresh)
                reason = _request_reason(request_key, len(fresh))
                recorded = await self._record([(c.key, request_key) for c in fresh], reason=reason)
                if recorded is not None:
                    requests[request_key] = _Request(session_id, request_key, recorded, new=True)
                else:
                    # Another worker put some of them in a request first, or they moved on.
                    unresolved += await self._read_again(fresh, outcomes)
            for call in placed:
                assert call.request_key is not None
                request = requests.get(call.request_key)
                if request is None:
                    members = await store.request_members(session_id, call.request_key)
                    request = requests[call.request_key] = _Request(
                        session_id, call.request_key, members, new=False
                    )
                if call.key not in {member.key for member in request.members}:
                    # Moved to a request of its own since it was read (its batch was refused).
                    unresolved += await self._read_again([call], outcomes)
        return outcomes, [request for request in requests.values() if request.members]

    async def _record(
        self, assignments: Sequence[tuple[CallKey, str]], *, reason: str, replacing: str | None = None
    ) -> list[CallRecord] | None:
        """Record requests before their first post (``LedgerStore.record_requests``)."""
        recorded = await self.ledger.record_requests(assignments, reason=reason, replacing=replacing)
        if recorded is not None:
            crash_point(CP_AFTER_REQUEST_RECORD)
        return recorded

    async def _read_again(
        self, calls: Sequence[CallRecord], outcomes: dict[CallKey, SubmitOutcome]
    ) -> list[CallRecord]:
        """``calls`` as they are now, if they still hold a result to send (else their outcome)."""
        current = await self.ledger.store.get_many([call.key for call in calls])
        sendable = []
        for call in current.values():
            if call.status in SENDABLE_STATUSES:
                sendable.append(call)
            else:
                outcomes[call.key] = _outcome_of(call)
        return sendable

    async def _post(self, request: _Request) -> dict[CallKey, SubmitOutcome]:
        """Post ``request`` as recorded; on anything but acceptance, the session decides."""
        assert self.gateway is not None
        batched = len(request.members) > 1
        if batched:
            metrics.SUBMISSION_BATCH_SIZE.observe(len(request.members))
        try:
            with metrics.SUBMISSION_DURATION.time():
                await self.gateway.submit_tool_results(request.session_id, request.payloads, request.key)
        except SubmissionError as error:
            crash_point(CP_AFTER_SUBMIT_REFUSED)
            return await self._after_refusal(request, error)
        if batched:
            crash_point(CP_AFTER_BATCH_RESPONSE)
            await self.ledger.mark_submitted_many([member.key for member in request.members])
        else:
            crash_point(CP_AFTER_SUBMIT_RESPONSE)
            await self.ledger.mark_submitted(request.members[0].key)
        return {member.key: SubmitOutcome.SUBMITTED for member in request.members}

    async def _after_refusal(self, request: _Request, error: SubmissionError) -> dict[CallKey, SubmitOutcome]:
        """The API did not take ``request``: one read of the session decides each member."""
        members = request.members
        try:
            listing = await self._listing(request.session_id)
        except AgentsAuthError:
            raise
        except (openai.OpenAIError, SubmissionError):
            # The session cannot be read now either: the same request goes again later.
            return {member.key: await self._failed(member, str(error)) for member in members}
        if listing.ended is not None:
            return {member.key: await self._abandon(member, listing.ended) for member in members}
        outcomes: dict[CallKey, SubmitOutcome] = {}
        # Refused with a 4xx at every try, a request recorded just now was never applied.
        landed = error.maybe_applied or not request.new
        still = []
        for member in members:
            if member.key in listing.awaited:
                still.append(member)
                continue
            fate = await self.close_unlisted(member, may_have_landed=landed, session_status=listing.status)
            if fate is Unlisted.AWAITING_LISTING:
                still.append(member)
            else:
                outcomes[member.key] = await self._unlisted_outcome(member, fate)
        if not still:
            return outcomes
        refused_whole = error.kind is SubmissionFailure.REFUSED or len(still) < len(members)
        if len(members) > 1 and not error.maybe_applied and refused_whole:
            # Never applied, and never to be (a member it cannot carry): the members left go
            # out alone from now on, each under its own key.
            outcomes.update(await self._each_alone(request, still))
        else:
            for member in still:
                outcomes[member.key] = await self._failed(member, str(error))
        return outcomes

    async def _each_alone(
        self, request: _Request, members: Sequence[CallRecord]
    ) -> dict[CallKey, SubmitOutcome]:
        """Members of a batch the API refused, moved to requests of their own in one commit
        (so the batch is never left half split), and sent."""
        moved = await self._record(
            [(member.key, member.idempotency_key) for member in members],
            reason=f"request {request.key} was refused; sent alone from now on",
            replacing=request.key,
        )
        outcomes: dict[CallKey, SubmitOutcome] = {}
        if moved is None:
            # Another worker moved them first (or closed one): each as it is now.
            current = await self._read_again(members, outcomes)
            for call in current:
                if call.request_key == request.key:
                    outcomes[call.key] = await self._failed(call, f"request {request.key} was refused")
            outcomes.update(
                await self._send(request.session_id, [c for c in current if c.request_key != request.key])
            )
            return outcomes
        posted = await asyncio.gather(
            *(self._post(_Request(request.session_id, m.idempotency_key, [m], new=True)) for m in moved)
        )
        for each in posted:
            outcomes.update(each)
        return outcomes

    async def _unlisted_outcome(self, call: CallRecord, fate: Unlisted) -> SubmitOutcome:
        """What closing an unlisted call came to; a race lost is what the winner made of it."""
        if fate is not Unlisted.RACED:
            return _UNLISTED_OUTCOMES[fate]
        current = await self.ledger.store.get(call.key)
        return SubmitOutcome.NOT_SENT if current is None else _outcome_of(current)

    async def _listing(self, session_id: str) -> SessionListing:
        """Read the session: what it awaits now."""
        assert self.gateway is not None
        try:
            session = await self.gateway.retrieve(session_id)
        except SessionGoneError:
            return SessionListing(frozenset(), None, ended="session deleted")
        if session.status == "failed":
            # The API's failure text may quote anything: it is redacted before it is kept.
            error = self.ledger.store.redactor.text(session.error) if session.error else None
            return SessionListing(
                frozenset(), "failed", f"session failed: {error}" if error else "session failed"
            )
        awaited = frozenset(
            delivered_key(session_id, action)
            for action in session.required_actions
            if isinstance(action, FunctionCallAction)
        )
        return SessionListing(awaited, session.status)

    async def _abandon(self, call: CallRecord, reason: str) -> SubmitOutcome:
        if call.status in (CallStatus.SUBMITTED, CallStatus.ABANDONED):
            return _outcome_of(call)
        if await self.ledger.store.abandon(call.key, reason) is not None:
            return SubmitOutcome.ABANDONED
        current = await self.ledger.store.get(call.key)
        return SubmitOutcome.NOT_SENT if current is None else _outcome_of(current)

    async def _failed(self, call: CallRecord, why: str) -> SubmitOutcome:
        store = self.ledger.store
        await store.record_submission_failure(call.key, why)
        log.warning(
            "submitting %s failed (%s); its request goes again later", call.key, store.redactor.text(why)
        )
        return SubmitOutcome.FAILED


def _count(outcomes: Iterable[SubmitOutcome]) -> None:
    for outcome in outcomes:
        metrics.SUBMISSIONS.labels(outcome.value).inc()


def _outcome_of(call: CallRecord) -> SubmitOutcome:
    """What a call that holds no result to send any more came to."""
    if call.status is CallStatus.SUBMITTED:
        return SubmitOutcome.SUBMITTED
    if call.status is CallStatus.ABANDONED:
        return SubmitOutcome.ABANDONED
    return SubmitOutcome.NOT_SENT


def _request_reason(request_key: str, members: int) -> str:
    if members == 1:
        return "to be sent alone, under its own key"
    return f"to be sent in request {request_key} with {members - 1} other result(s)"


def _seconds_since(moment: datetime) -> float:
    return (datetime.now(UTC) - moment).total_seconds()


class StoredResult(Protocol):
    """What a batch's key is made of: each call's own key and its stored result."""

    @property
    def idempotency_key(self) -> str: ...

    @property
    def payload(self) -> dict[str, Any] | None: ...


def batch_idempotency_key(calls: Sequence[StoredResult]) -> str:
    """The same for the same calls with the same stored results, whatever their order. It is
    recorded with the members before the batch is first posted, so a resend is the same
    request whoever sends it; this derivation only keeps it readable and unique."""
    lines = sorted(f"{c.idempotency_key} {canonical_json(c.payload)}" for c in calls)
    digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()
    return f"tlb_{digest[:48]}"


def submission_backoff(call: CallRecord) -> float:
    """When to send a stored result again after a failed try: sooner than the next periodic
    reconcile, later with each try the call has had."""
    return min(SUBMIT_RETRY_FIRST * 2.0 ** min(call.submission_count, 16), SUBMIT_RETRY_MAX)
