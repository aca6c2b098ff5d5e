"""The ledger's writes and reads: the only writer of ``tool_calls`` and ``tool_call_events``.

Every status change is a transition of the catalogue (``domain.states.TRANSITIONS``, its SQL
in ``store.transitions``): a compare-and-set from the states it may start from and, for a
worker's writes, the lease token it holds, plus its audit event in the same commit. Zero rows
updated means a lost race or a stale worker: never a blind write.

``LedgerStore(engine, ...)`` is one of two executors, chosen by the engine's database:
``PostgresLedger`` (``store.ledger_postgres``) sends each write and its audit event as ONE
statement in autocommit; ``SqliteLedger`` (``store.ledger_sqlite``) runs a transaction of
separate statements behind the process's write lock. What they share (what a write means,
the reads) is written here once.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection, Hashable, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple, Protocol, TypeVar

from sqlalchemy import BigInteger, Select, String, and_, bindparam, func, or_, select, tuple_
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.sql.elements import BindParameter, ColumnElement

from toolledger.crashpoints import CP_AFTER_BATCH_OUTCOMES, CP_AFTER_BATCH_RECORD, crash_point
from toolledger.domain.keys import CallKey, arguments_fingerprint, arguments_text
from toolledger.domain.records import CallEvent, CallRecord, Recorded
from toolledger.domain.redaction import DEFAULT_REDACTOR, Redactor
from toolledger.domain.results import FailureStage, Outcome
from toolledger.domain.states import (
    ABANDON,
    APPROVE,
    CLAIM,
    COMPLETE,
    COMPLETE_LATE,
    DENY,
    EXPIRE,
    MARK_UNKNOWN,
    RECORD_FOR_APPROVAL,
    REOPEN,
    RESULT_STATUSES,
    SETTLE,
    SUBMIT,
    CallStatus,
    EffectClass,
    Transition,
)
from toolledger.domain.trail import TrailKey
from toolledger.errors import FencedError, TransitionError
from toolledger.store.batching import WriteBatcher
from toolledger.store.chain import content_sha256_sql
from toolledger.store.engine import dialect_insert, is_transient, seconds_until, utc_now
from toolledger.store.rows import call_events, call_record
from toolledger.store.schema import (
    StorableText,
    open_call_clause,
    storable_text,
    tool_call_events,
    tool_calls,
)
from toolledger.store.transitions import (
    CONFIRM,
    EVENT_COLUMNS,
    HEARTBEAT,
    KEY_COLUMNS,
    KEY_MATCH,
    LEASE_RAN_OUT,
    RESUBMISSION,
    SUBMISSION_FAILURE,
    Note,
    changes,
    content_written,
    key_params,
    record_insert,
)

log = logging.getLogger("toolledger.store")


@dataclass(frozen=True)
class NewCall:
    """A delivered call to record and claim: the parameters of its ``RECORD``."""

    key: CallKey
    params: dict[str, Any]
    fingerprint: str
    detail: str | None
    """Its claim's audit detail (the claim id)."""


class Completion(NamedTuple):
    """A run's outcome to store, by the run holding lease ``token``."""

    key: CallKey
    token: int
    outcome: Outcome


class _Mark(NamedTuple):
    key: CallKey
    reason: str


class _Keyed(Protocol):
    @property
    def key(self) -> CallKey: ...


_Item = TypeVar("_Item", bound=_Keyed)


def _where_key(key: CallKey) -> ColumnElement[bool]:
    """A call's key as literal values, for statements built per call (reads, admin writes)."""
    return and_(
        tool_calls.c.session_id == key.session_id,
        tool_calls.c.turn_id == key.turn_id,
        tool_calls.c.call_id == key.call_id,
    )


class LedgerStore:
    """The ledger: ``LedgerStore(engine, ...)`` gives the executor of the engine's database
    (a subclass, which does what ``raise NotImplementedError`` marks here)."""

    _parallel_writes = 1
    """Batches of one kind of write in flight at once (``store.batching``)."""

    def __new__(
        cls,
        engine: AsyncEngine,
        *,
        actor: str,
        owner: str | None = None,
        redactor: Redactor = DEFAULT_REDACTOR,
        batching: bool = True,
        trail_key: TrailKey | None = None,
    ) -> LedgerStore:
        if cls is LedgerStore:
            cls = _executor_for(engine)
        return super().__new__(cls)

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        actor: str,
        owner: str | None = None,
        redactor: Redactor = DEFAULT_REDACTOR,
        batching: bool = True,
        trail_key: TrailKey | None = None,
    ) -> None:
        """``actor``: who this process is in the audit trail (the worker id). ``owner``: the
        process instance its leases name (``lease_owner``), unique per process so that a
        replica known to be gone can have its leases taken over (``store.liveness``).
        ``batching``: records and outcomes written at the same moment share one commit
        (``store.batching``); off, each is a write of its own. ``trail_key``: each event
        written carries its keyed MAC (``domain.trail.TrailKey``); None: none."""
        self.engine = engine
        self.actor = actor
        self.owner = owner or actor
        self.redactor = redactor
        self.batching = batching
        self.trail_key = trail_key
        self._statements: dict[Hashable, Any] = {}
        self._records: WriteBatcher[NewCall, Recorded] = WriteBatcher(
            self._records_together, flushes=self._parallel_writes
        )
        self._outcomes: WriteBatcher[Completion, CallRecord] = WriteBatcher(
            self._outcomes_together, flushes=self._parallel_writes
        )
        self._marks: WriteBatcher[_Mark, CallRecord | None] = WriteBatcher(
            self._marks_together, flushes=self._parallel_writes
        )

    # ------------------------------------------------------------------ writes

    async def record(
        self,
        key: CallKey,
        *,
        tool_name: str,
        arguments: Any,
        effect_class: EffectClass,
        lease_seconds: float,
        stored_arguments: str | None = None,
        claim_id: str | None = None,
        fingerprint: str | None = None,
    ) -> Recorded:
        """Record a delivered call and claim it in one commit (commit point 1), or find it recorded.

        A redelivery with other arguments is flagged in the audit trail and reported.
        ``stored_arguments`` replaces the text kept (a preview of refused arguments); the
        fingerprint is always that of the arguments delivered. ``claim_id`` goes into the
        claim's audit event: after an ambiguous commit, ``claimed_by`` tells whether it was ours.
        ``fingerprint``: the arguments' fingerprint when the caller has it already (a
        ``DeliveredCall``'s), so the hot path does not decode the arguments again.
        """
        if fingerprint is None:
            fingerprint = arguments_fingerprint(arguments)
        params = {
            **key_params(key),
            "p_tool_name": tool_name,
            "p_arguments": stored_arguments if stored_arguments is not None else arguments_text(arguments),
            "p_sha256": fingerprint,
            "p_effect_class": effect_class.value,
            "p_idempotency_key": key.idempotency_key,
            "p_lease_seconds": float(lease_seconds),
            "p_owner": self.owner,
        }
        new = NewCall(key, params, fingerprint, _claim_detail(claim_id))
        if self.batching:
            return await self._records.add(new)
        return await self._record_new(new)

    async def record_for_approval(
        self,
        key: CallKey,
        *,
        tool_name: str,
        arguments: Any,
        effect_class: EffectClass,
        approval_seconds: float | None,
        fingerprint: str | None = None,
    ) -> Recorded:
        """Record a delivered call that needs a person's approval: ``awaiting_approval``, not
        claimed (nothing runs), its wait ending ``approval_seconds`` from now (None: never);
        or find it recorded, as ``record`` does. Rare (a person decides each one): a write
        of its own, never batched."""
        if fingerprint is None:
            fingerprint = arguments_fingerprint(arguments)
        params = {
            **key_params(key),
            "p_tool_name": tool_name,
            "p_arguments": arguments_text(arguments),
            "p_sha256": fingerprint,
            "p_effect_class": effect_class.value,
            "p_idempotency_key": key.idempotency_key,
            "p_approval_seconds": None if approval_seconds is None else float(approval_seconds),
        }
        insert = self._statement(
            (RECORD_FOR_APPROVAL.name,),
            lambda: record_insert(dialect_insert(self.engine), RECORD_FOR_APPROVAL),
        )
        async with self._transaction() as conn:
            row = (await conn.execute(insert, params)).first()
            if row is None:
                return await self._already_recorded(conn, key, fingerprint)
            call = call_record(row)
            await self._event(
                conn,
                key,
                RECORD_FOR_APPROVAL.event,
                None,
                RECORD_FOR_APPROVAL.target,
                None,
                AWAITING_REASON,
                written=content_written(RECORD_FOR_APPROVAL, params),
            )
            return Recorded(call=call, claimed=False)

    async def approve(
        self,
        key: CallKey,
        *,
        arguments_sha256: str,
        decided_by: str,
        reason: str,
        amended_arguments: str | None = None,
        amended_sha256: str | None = None,
    ) -> CallRecord | None:
        """A call awaiting approval may now run (``pending``), with ``amended_arguments`` if
        given. ``arguments_sha256``: the fingerprint of the arguments the person saw. None
        when the compare-and-set finds nothing to approve: the call no longer awaits approval
        (decided by someone else first), its deadline has passed on the database's clock (even
        if nobody has written the expiry yet), or its arguments are not those."""
        params = {
            "p_seen_sha256": arguments_sha256,
            "p_decided_by": decided_by,
            "p_approved_arguments": amended_arguments,
            "p_approved_sha256": amended_sha256,
        }
        detail = None if amended_sha256 is None else f"amended arguments sha256={amended_sha256}"
        return await self._transition(APPROVE, key, reason, params, detail=detail)

    async def deny(
        self, key: CallKey, outcome: Outcome, *, decided_by: str, reason: str
    ) -> CallRecord | None:
        """A call awaiting approval gets the failure ``outcome`` instead of running (denied by a
        person, or not approved in time); None when it no longer awaits approval."""
        params = {**self._outcome_params(outcome), "p_decided_by": decided_by}
        return await self._transition(DENY, key, reason, params)

    async def claim(
        self,
        key: CallKey,
        *,
        from_statuses: Iterable[CallStatus],
        lease_seconds: float,
        reason: str,
        claim_id: str | None = None,
    ) -> CallRecord | None:
        """Take a new lease (a new token) on a recorded call, e.g. to re-run an unknown one.
        ``from_statuses``: those of ``CLAIM``'s sources the caller expects. ``claim_id``: as
        for ``record``."""
        params = {"p_lease_seconds": float(lease_seconds), "p_owner": self.owner}
        return await self._transition(
            CLAIM, key, reason, params, detail=_claim_detail(claim_id), only_from=from_statuses
        )

    async def heartbeat(self, key: CallKey, token: int, lease_seconds: float) -> bool:
        """Extend a running call's lease; False when the lease was lost (fenced)."""
        params = {**key_params(key), "p_token": token, "p_lease_seconds": float(lease_seconds)}
        async with self._writing() as conn:
            return (await conn.execute(HEARTBEAT, params)).rowcount == 1

    async def complete(
        self, key: CallKey, token: int, outcome: Outcome, *, connection: AsyncConnection | None = None
    ) -> CallRecord:
        """Store the outcome of a run (commit point 2). Raises FencedError if the lease was lost.

        With ``connection`` the write joins the caller's transaction: a transactional tool's
        side effect and its result then commit together.
        """
        completion = Completion(key, token, outcome)
        if connection is not None:
            return await self._complete(connection, completion)
        if self.batching:
            return await self._outcomes.add(completion)
        async with self._writing() as conn:
            return await self._complete(conn, completion)

    async def _complete(self, conn: AsyncConnection, completion: Completion) -> CallRecord:
        key, token, outcome = completion
        params = {"p_token": token, **self._outcome_params(outcome)}
        attempts = (
            (COMPLETE.of(outcome.success), completed_reason(outcome)),
            # The lease expired while the handler ran (a paused or partitioned worker) but
            # nobody claimed the call since: the token is still ours, and this is the one
            # true outcome of the only run. Better than leaving it unknown.
            (COMPLETE_LATE.of(outcome.success), "late result of the only run, after its lease expired"),
        )
        for transition, reason in attempts:
            call = await self._change(conn, transition, transition.sources, key, params, reason)
            if call is not None:
                return call
        raise FencedError(f"{key}: lease token {token} is no longer current; result refused")

    async def _outcomes_together(
        self, completions: Sequence[Completion]
    ) -> Sequence[CallRecord | BaseException]:
        """Outcomes that became ready together, stored in ONE transaction (one commit, one
        fsync), each with its own fencing: one refused outcome fails only its own call."""
        stored = await self._completions_batch(completions)
        if len(completions) > 1:
            crash_point(CP_AFTER_BATCH_OUTCOMES)
        return stored

    async def _completions_batch(
        self, completions: Sequence[Completion]
    ) -> Sequence[CallRecord | BaseException]:
        """``_complete`` for each of ``completions``, in one commit."""
        return await self._together(completions, self._complete)

    async def _records_together(self, news: Sequence[NewCall]) -> Sequence[Recorded | BaseException]:
        recorded = await self._record_batch(news)
        if len(news) > 1:
            crash_point(CP_AFTER_BATCH_RECORD)
        return recorded

    async def _together(
        self,
        items: Sequence[_Item],
        write: Callable[[AsyncConnection, _Item], Awaitable[Any]],
    ) -> list[Any]:
        """``write`` each of ``items`` in ONE transaction; a result or a refusal
        (``FencedError``, ``TransitionError``) per item. Rows are written in the order of
        their keys, so two processes' batches cannot deadlock each other. A batch that fails
        for another reason than the database being away is written item by item instead: a
        bad item fails alone. A lone item is a write of its own, as without batching."""
        if len(items) == 1:
            return [await self._alone(items[0], write)]
        written: list[Any] = [None] * len(items)
        try:
            async with self._transaction() as conn:
                for index in sorted(range(len(items)), key=lambda i: items[i].key):
                    try:
                        written[index] = await write(conn, items[index])
                    except (FencedError, TransitionError) as refused:
                        written[index] = refused
        except Exception as error:
            if is_transient(error):
                raise  # each caller's retry decides (an ambiguous commit is theirs to resolve)
            log.warning("a batch of %d ledger writes failed (%s): writing them one by one", len(items), error)
            return [await self._alone(item, write) for item in items]
        return written

    async def _alone(self, item: _Item, write: Callable[[AsyncConnection, _Item], Awaitable[Any]]) -> Any:
        try:
            async with self._writing() as conn:
                return await write(conn, item)
        except Exception as error:
            return error

    async def mark_unknown(
        self, key: CallKey, token: int, *, reason: str, detail: str | None = None
    ) -> CallRecord:
        """The run holding lease ``token`` cannot tell whether its side effect happened: the
        call becomes ``unknown`` now (``MARK_UNKNOWN``). Found ``unknown`` under that token
        already (its lease ran out first, or an earlier try of this write committed), it is
        returned as it is. Raises FencedError if another run took the call."""
        call = await self._transition(MARK_UNKNOWN, key, reason, {"p_token": token}, detail=detail)
        if call is not None:
            return call
        current = await self.get(key)
        if current is not None and current.status is CallStatus.UNKNOWN and current.lease_token == token:
            return current
        raise FencedError(f"{key}: lease token {token} is no longer current; unknown outcome refused")

    async def settle(self, key: CallKey, outcome: Outcome, *, reason: str) -> CallRecord | None:
        """Give an ``unknown`` call its outcome without running it (verify hook, operator, deadline)."""
        return await self._transition(SETTLE.of(outcome.success), key, reason, self._outcome_params(outcome))

    async def reopen(self, key: CallKey, *, reason: str) -> CallRecord | None:
        """An operator allows an ``unknown`` call to run again: it becomes claimable."""
        return await self._transition(REOPEN, key, reason, {})

    async def expire_leases(
        self, key: CallKey | None = None, *, gone_owners: Collection[str] = ()
    ) -> list[CallRecord]:
        """Running calls whose lease ran out without a result become ``unknown`` (one, or all);
        so do those whose owner is provably gone (``store.liveness``), without waiting for
        their leases to run out. Either way the same transition: the owner's token is dead."""
        gone = sorted(set(gone_owners) - {self.owner})
        lapsed = or_(LEASE_RAN_OUT, tool_calls.c.lease_owner.in_(gone)) if gone else LEASE_RAN_OUT
        statement = (
            tool_calls.update()
            .where(tool_calls.c.status.in_(sorted(s.value for s in EXPIRE.sources)), lapsed)
            .values(**changes(EXPIRE))
            .returning(tool_calls)
        )
        if key is not None:
            statement = statement.where(_where_key(key))
        async with self._transaction() as conn:
            expired = [call_record(row) for row in (await conn.execute(statement)).all()]
            for call in expired:
                reason = (
                    f"lease owner {call.lease_owner} is gone (its liveness lock is free): "
                    "taken over before its lease ran out"
                    if call.lease_owner in gone
                    else f"lease of {call.lease_owner} expired without a result"
                )
                await self._event(
                    conn, call.key, EXPIRE.event, CallStatus.RUNNING, EXPIRE.target, call.lease_token, reason
                )
            return expired

    async def lease_remaining(self, key: CallKey) -> float | None:
        """Seconds until a running call's lease runs out, on the database's clock (the clock
        leases are measured on); None when the call is not running under a lease."""
        async with self.engine.connect() as conn:
            remaining = (
                await conn.execute(
                    select(seconds_until(tool_calls.c.lease_expires_at)).where(
                        _where_key(key),
                        tool_calls.c.status == CallStatus.RUNNING.value,
                        tool_calls.c.lease_expires_at.is_not(None),
                    )
                )
            ).scalar()
        return None if remaining is None else max(float(remaining), 0.0)

    async def mark_submitted(self, key: CallKey, *, reason: str = "result accepted") -> CallRecord | None:
        """The Agents API accepted the stored result (commit point 3). With batching, marks
        made at the same moment (other sessions' calls answered meanwhile) share one statement."""
        if self.batching:
            return await self._marks.add(_Mark(key, reason))
        return await self._transition(SUBMIT, key, reason, {})

    async def mark_submitted_many(
        self, keys: Sequence[CallKey], *, reason: str = "result accepted in a batch"
    ) -> set[CallKey]:
        """``mark_submitted`` for the calls of one accepted batch, in one transaction (one
        commit for them all; with batching, with the other marks made at that moment). Returns
        the calls marked now."""
        if not self.batching:
            return set(await self._submitted_many(keys, reason))
        marked = await self._marks.add_many([_Mark(key, reason) for key in keys])
        for outcome in marked:
            if isinstance(outcome, BaseException):
                raise outcome
        return {call.key for call in marked if isinstance(call, CallRecord)}

    async def _submitted_many(self, keys: Sequence[CallKey], reason: str) -> dict[CallKey, CallRecord]:
        """``SUBMIT`` on each of ``keys`` that is in one of its sources, in one commit: the
        calls marked now, as they are after it."""
        marked: dict[CallKey, CallRecord] = {}
        async with self._transaction(durable=SUBMIT.durable) as conn:
            for key in keys:
                call = await self._change(conn, SUBMIT, SUBMIT.sources, key, {}, reason)
                if call is not None:
                    marked[key] = call
        return marked

    async def _marks_together(self, marks: Sequence[_Mark]) -> list[CallRecord | None]:
        if len(marks) == 1:
            (mark,) = marks
            return [await self._transition(SUBMIT, mark.key, mark.reason, {})]
        marked: dict[CallKey, CallRecord] = {}
        for reason in dict.fromkeys(mark.reason for mark in marks):
            keys = sorted({mark.key for mark in marks if mark.reason == reason})
            marked.update(await self._submitted_many(keys, reason))
        # A call marked twice at once: the first of its marks did it, as one after the other.
        return [marked.pop(mark.key, None) for mark in marks]

    async def record_request(
        self, keys: Sequence[CallKey], request_key: str, *, reason: str, replacing: str | None = None
    ) -> list[CallRecord] | None:
        """Record the request the stored results of ``keys`` (one session's) go out in, before
        it is first posted: for all of them in one commit, with an event each, or for none
        (None) when any of them is in another request already or holds no result to send any
        more. ``replacing``: the request they were in, refused whole; None: they were in none.
        Returns them as they are now, in the request's order (by idempotency key)."""
        return await self.record_requests(
            [(key, request_key) for key in keys], reason=reason, replacing=replacing
        )

    async def record_requests(
        self, assignments: Sequence[tuple[CallKey, str]], *, reason: str, replacing: str | None = None
    ) -> list[CallRecord] | None:
        """``record_request`` with a request key per call, all in one commit (a batch refused
        whole, its members moved to requests of their own at once: never half split)."""
        update = self._statement(("record_request",), _build_record_request)
        recorded: list[CallRecord] = []
        try:
            async with self._transaction() as conn:
                for key, request_key in sorted(assignments):
                    params = {**key_params(key), "p_request_key": request_key, "p_replacing": replacing}
                    row = (await conn.execute(update, params)).first()
                    if row is None:
                        raise _NotRecorded
                    recorded.append(call_record(row))
                    await self._event(conn, key, "request", None, None, None, reason, detail=request_key)
        except _NotRecorded:
            return None
        return sorted(recorded, key=lambda call: call.idempotency_key)

    async def request_members(self, session_id: str, request_key: str) -> list[CallRecord]:
        """The calls whose results go out in request ``request_key``, in its order."""
        async with self.engine.connect() as conn:
            rows = await conn.execute(
                select(tool_calls)
                .where(tool_calls.c.session_id == session_id, tool_calls.c.request_key == request_key)
                .order_by(tool_calls.c.idempotency_key)
            )
            return [call_record(row) for row in rows]

    async def note_resubmission(self, key: CallKey) -> int:
        """A submitted call still awaited was sent again and accepted again: count it (and say
        so in the audit trail). Returns how many times the call has been submitted."""
        row = await self._note(RESUBMISSION, key, {}, "accepted again; still awaited")
        return 0 if row is None else int(row["submission_count"])

    async def record_submission_failure(self, key: CallKey, error: str) -> None:
        await self._note(SUBMISSION_FAILURE, key, {"p_error": self.redactor.text(error)}, error)

    async def mark_confirmed(self, key: CallKey) -> bool:
        """The session no longer awaits the submitted result: it was consumed."""
        return await self._note(CONFIRM, key, {}, "left required_actions") is not None

    async def mark_confirmed_many(self, keys: Sequence[CallKey]) -> set[CallKey]:
        """``mark_confirmed`` for many calls (a session's turn, once it ended). Returns the
        calls confirmed now."""
        raise NotImplementedError

    async def abandon(self, key: CallKey, reason: str) -> CallRecord | None:
        """The session stopped awaiting a call before its result was submitted."""
        params = {"p_abandoned_reason": self.redactor.text(reason)}
        return await self._transition(ABANDON, key, reason, params)

    async def flag(self, key: CallKey, kind: str, reason: str, detail: str | None = None) -> None:
        """Note something about a call in its audit trail without changing it."""
        async with self._writing() as conn:
            await self._event(conn, key, kind, None, None, None, reason, detail=detail)

    # ------------------------------------------------------------------- reads

    async def claimed_by(self, key: CallKey, claim_id: str) -> CallRecord | None:
        """The call, if the claim ``claim_id`` committed and still holds its lease (a commit
        whose answer was lost on the way back is told apart from one that never happened)."""
        async with self.engine.connect() as conn:
            token = (
                await conn.execute(
                    select(tool_call_events.c.lease_token).where(
                        tool_call_events.c.session_id == key.session_id,
                        tool_call_events.c.turn_id == key.turn_id,
                        tool_call_events.c.call_id == key.call_id,
                        tool_call_events.c.detail == self._audit_text(f"claim {claim_id}"),
                    )
                )
            ).scalar()
            if token is None:
                return None
            call = await self._get(conn, key)
        if call is None or call.status is not CallStatus.RUNNING or call.lease_token != token:
            return None
        return call

    async def held_elsewhere(self) -> tuple[int, datetime | None]:
        """Running calls whose leases other processes hold, and the soonest their leases
        run out (what a starting service waits for)."""
        async with self.engine.connect() as conn:
            row = (
                await conn.execute(
                    select(func.count(), func.min(tool_calls.c.lease_expires_at)).where(
                        tool_calls.c.status == CallStatus.RUNNING.value,
                        tool_calls.c.lease_owner.is_distinct_from(self.owner),
                    )
                )
            ).one()
        return int(row[0]), row[1]

    async def running_owners(self) -> set[str]:
        """Who holds the leases of running calls."""
        async with self.engine.connect() as conn:
            rows = await conn.execute(
                select(tool_calls.c.lease_owner)
                .where(tool_calls.c.status == CallStatus.RUNNING.value, tool_calls.c.lease_owner.is_not(None))
                .distinct()
            )
            return {owner for owner in rows.scalars() if owner is not None}

    async def get(self, key: CallKey) -> CallRecord | None:
        async with self.engine.connect() as conn:
            return await self._get(conn, key)

    async def events(self, key: CallKey) -> list[CallEvent]:
        async with self.engine.connect() as conn:
            return await call_events(conn, key)

    async def decided_calls(self) -> set[CallKey]:
        """Calls an operator decided elsewhere and nobody has acted on yet:
        approved or re-opened (``pending``, claimable now), or denied (a failure stored by
        the approval, not yet sent). Both are rare; the claimable index finds them."""
        query = select(*KEY_COLUMNS).where(
            or_(
                tool_calls.c.status == CallStatus.PENDING.value,
                and_(
                    tool_calls.c.status == CallStatus.FAILED.value,
                    tool_calls.c.error_stage == FailureStage.APPROVAL.value,
                ),
            )
        )
        async with self.engine.connect() as conn:
            return {CallKey(*row) for row in await conn.execute(query)}

    async def in_states(
        self, statuses: Iterable[CallStatus], *, session_id: str | None = None, limit: int = 1000
    ) -> list[CallRecord]:
        query = select(tool_calls).where(tool_calls.c.status.in_([s.value for s in statuses]))
        if session_id is not None:
            query = query.where(tool_calls.c.session_id == session_id)
        query = query.order_by(tool_calls.c.created_at, *KEY_COLUMNS).limit(limit)
        async with self.engine.connect() as conn:
            return [call_record(row) for row in await conn.execute(query)]

    async def for_session(self, session_id: str) -> list[CallRecord]:
        async with self.engine.connect() as conn:
            rows = await conn.execute(
                select(tool_calls)
                .where(tool_calls.c.session_id == session_id)
                .order_by(tool_calls.c.created_at)
            )
            return [call_record(row) for row in rows]

    async def open_calls(self, session_id: str) -> list[CallRecord]:
        """The session's calls it may still be waiting on (not abandoned, not confirmed)."""
        async with self.engine.connect() as conn:
            return [call_record(row) for row in await conn.execute(open_calls_of(session_id))]

    async def count_in(self, status: CallStatus) -> int:
        """Calls in one state: a claimable one counts through its partial index, not a scan of
        every call ever recorded (``count_by_status``)."""
        async with self.engine.connect() as conn:
            counted = select(func.count()).where(tool_calls.c.status == status.value)
            return int((await conn.execute(counted)).scalar_one())

    async def count_by_status(self) -> dict[str, int]:
        async with self.engine.connect() as conn:
            rows = await conn.execute(select(tool_calls.c.status, func.count()).group_by(tool_calls.c.status))
            return {row[0]: row[1] for row in rows}

    async def count_unconfirmed(self, min_submissions: int) -> int:
        """Submitted calls still awaited after ``min_submissions`` acceptances."""
        async with self.engine.connect() as conn:
            count = (
                await conn.execute(
                    select(func.count()).where(
                        tool_calls.c.status == CallStatus.SUBMITTED.value,
                        tool_calls.c.confirmed_at.is_(None),
                        tool_calls.c.submission_count >= min_submissions,
                    )
                )
            ).scalar_one()
            return int(count)

    async def oldest_unsubmitted(self) -> datetime | None:
        """When the oldest stored result still waiting to be submitted was finished."""
        async with self.engine.connect() as conn:
            oldest: datetime | None = (
                await conn.execute(
                    select(func.min(tool_calls.c.finished_at)).where(
                        tool_calls.c.status.in_([s.value for s in RESULT_STATUSES])
                    )
                )
            ).scalar_one_or_none()
            return oldest

    async def get_many(self, keys: Sequence[CallKey]) -> dict[CallKey, CallRecord]:
        if not keys:
            return {}
        async with self.engine.connect() as conn:
            rows = await conn.execute(
                select(tool_calls).where(
                    tuple_(*KEY_COLUMNS).in_([(k.session_id, k.turn_id, k.call_id) for k in keys])
                )
            )
            records = [call_record(row) for row in rows]
        return {record.key: record for record in records}

    # ------------------------------------------------- what each database does its own way

    def _writing(self, *, durable: bool = True) -> AbstractAsyncContextManager[AsyncConnection]:
        """A connection for one write. ``durable=False``: its commit need not reach the disk
        before it returns (``Transition.durable``)."""
        raise NotImplementedError

    def _transaction(self, *, durable: bool = True) -> AbstractAsyncContextManager[AsyncConnection]:
        """A transaction for a write of several statements (``durable`` as for ``_writing``)."""
        raise NotImplementedError

    async def _record_new(self, new: NewCall) -> Recorded:
        """``RECORD`` in a write of its own, or the call as recorded before
        (``_already_recorded``)."""
        raise NotImplementedError

    async def _record_batch(self, news: Sequence[NewCall]) -> Sequence[Recorded | BaseException]:
        """``_record_new`` for calls delivered together, in one commit."""
        raise NotImplementedError

    async def _change(
        self,
        conn: AsyncConnection,
        transition: Transition,
        sources: frozenset[CallStatus],
        key: CallKey,
        params: dict[str, Any],
        reason: str,
        detail: str | None = None,
    ) -> CallRecord | None:
        """Run ``transition`` on ``conn`` from whichever of ``sources`` the call is in now,
        with its audit event; None when it is in none of them (or changed under us)."""
        raise NotImplementedError

    async def _note(
        self, note: Note, key: CallKey, params: dict[str, Any], reason: str
    ) -> Mapping[str, Any] | None:
        """Run ``note``'s UPDATE on the call and, if it changed the row, its audit event.
        Its returned columns by name, or None."""
        raise NotImplementedError

    # ------------------------------------------------------------- shared parts

    async def _transition(
        self,
        transition: Transition,
        key: CallKey,
        reason: str,
        params: dict[str, Any],
        *,
        detail: str | None = None,
        only_from: Iterable[CallStatus] | None = None,
    ) -> CallRecord | None:
        """``transition`` on one call, in a write of its own; ``only_from`` narrows its sources."""
        sources = transition.sources if only_from is None else transition.sources & frozenset(only_from)
        if not sources:
            return None
        async with self._writing(durable=transition.durable) as conn:
            return await self._change(conn, transition, sources, key, params, reason, detail)

    async def _already_recorded(self, conn: AsyncConnection, key: CallKey, fingerprint: str) -> Recorded:
        """A delivered call found recorded before: flagged if its arguments differ."""
        existing = await self._get(conn, key)
        if existing is None:
            # Recorded a moment ago, then pruned already: not something a live call meets.
            raise TransitionError(f"{key}: recorded, then deleted before it could be read")
        if existing.arguments_sha256 != fingerprint:
            await self._event(
                conn,
                key,
                "arguments_mismatch",
                None,
                None,
                None,
                "redelivered with other arguments; refused",
                detail=f"recorded sha256={existing.arguments_sha256} received sha256={fingerprint}",
            )
            return Recorded(call=existing, claimed=False, arguments_mismatch=True)
        return Recorded(call=existing, claimed=False)

    async def _get(self, conn: AsyncConnection, key: CallKey) -> CallRecord | None:
        row = (await conn.execute(select(tool_calls).where(_where_key(key)))).first()
        return None if row is None else call_record(row)

    def _statement(self, shape: Hashable, build: Callable[[], Any]) -> Any:
        """A write statement built once per shape (building one costs more than running it)."""
        statement = self._statements.get(shape)
        if statement is None:
            statement = self._statements[shape] = build()
        return statement

    def _event_params(self, reason: str | None, detail: str | None = None) -> dict[str, Any]:
        return {
            "e_actor": self.actor,
            "e_reason": self._audit_text(reason) if reason is not None else None,
            "e_detail": self._audit_text(detail) if detail is not None else None,
        }

    def _mac(
        self,
        key: CallKey,
        kind: str,
        to_status: CallStatus | str | None,
        reason: str | None,
        detail: str | None = None,
        written: Mapping[str, str | None] | None = None,
    ) -> str | None:
        """The keyed MAC of an event this store writes (None without the trail key): over its
        fields as they will be stored (``reason`` and ``detail`` redacted, as
        ``_event_params`` passes them) and the content its write sets (``written``)."""
        if self.trail_key is None:
            return None
        values = {
            "session_id": key.session_id,
            "turn_id": key.turn_id,
            "call_id": key.call_id,
            "actor": self.actor,
            "kind": kind,
            "to_status": to_status.value if isinstance(to_status, CallStatus) else to_status,
            "reason": None if reason is None else storable_text(self._audit_text(reason)),
            "detail": None if detail is None else storable_text(self._audit_text(detail)),
        }
        return self.trail_key.mac(values, written or {})

    def _outcome_params(self, outcome: Outcome) -> dict[str, Any]:
        return {
            "p_result": outcome.payload_json(),
            "p_error_stage": outcome.stage.value if outcome.stage else None,
            "p_error_detail": self.redactor.text(outcome.detail) if outcome.detail else None,
        }

    def _audit_text(self, text: str) -> str:
        # Every audit line is redacted: reasons quote the API and hooks quote tracebacks.
        return self.redactor.text(text)

    async def _event(
        self,
        conn: AsyncConnection,
        key: CallKey,
        kind: str,
        from_status: CallStatus | None,
        to_status: CallStatus | None,
        lease_token: int | None,
        reason: str | None,
        *,
        detail: str | None = None,
        written: Mapping[str, str | None] | None = None,
    ) -> None:
        """An audit event written by a statement of its own, with the digest of the call's
        content as ``conn`` sees it now (after this transaction's own writes: ``written``, the
        content they set, is what the event's keyed MAC names)."""
        insert = self._statement(("event",), self._build_event)
        params = {
            **key_params(key),
            **self._event_params(reason, detail),
            "e_kind": kind,
            "e_from_status": from_status.value if from_status else None,
            "e_to_status": to_status.value if to_status else None,
            "e_lease_token": lease_token,
            "e_trail_mac": self._mac(key, kind, to_status, reason, detail, written),
        }
        if (await conn.execute(insert, params)).first() is None:
            raise TransitionError(f"{key}: not in the ledger; its {kind} event was not written")

    def _build_event(self) -> Any:
        """An event of one call, inserted from its row (its key, and its content digest): on
        PostgreSQL the row is locked first (``FOR NO KEY UPDATE``, as the trail's trigger
        would), so that a write of the call committing meanwhile is waited for and its content
        read, not the content before it (which the trigger would then chain after it)."""
        row = select(
            *KEY_COLUMNS,
            utc_now(),
            bindparam("e_actor", type_=String),
            bindparam("e_kind", type_=String),
            bindparam("e_from_status", type_=String),
            bindparam("e_to_status", type_=String),
            bindparam("e_lease_token", type_=BigInteger),
            bindparam("e_reason", type_=StorableText),
            bindparam("e_detail", type_=StorableText),
            content_sha256_sql(self.engine.dialect.name, tool_calls.c),
            bindparam("e_trail_mac", type_=String),
        ).where(KEY_MATCH)
        if self.engine.dialect.name == "postgresql":
            row = row.with_for_update(key_share=True)
        return tool_call_events.insert().from_select(EVENT_COLUMNS, row).returning(tool_call_events.c.id)


class _NotRecorded(Exception):
    """A member of a request could not be recorded in it: the whole request is rolled back."""


SENDABLE_STATUSES = (*sorted(RESULT_STATUSES), CallStatus.SUBMITTED)
"""A call whose stored result may go out in a request: not sent yet, or sent and accepted
(sent again, the request is replayed)."""


def _build_record_request() -> Any:
    return (
        tool_calls.update()
        .where(
            KEY_MATCH,
            tool_calls.c.status.in_([status.value for status in SENDABLE_STATUSES]),
            tool_calls.c.request_key.is_not_distinct_from(bindparam("p_replacing", type_=String)),
        )
        .values(request_key=bindparam("p_request_key"), updated_at=utc_now())
        .returning(tool_calls)
    )


def _executor_for(engine: AsyncEngine) -> type[LedgerStore]:
    # Imported here: each executor's module builds on this one.
    if engine.dialect.name == "postgresql":
        from toolledger.store.ledger_postgres import PostgresLedger

        return PostgresLedger
    if engine.dialect.name == "sqlite":
        from toolledger.store.ledger_sqlite import SqliteLedger

        return SqliteLedger
    raise ValueError(f"no ledger for {engine.dialect.name}: use PostgreSQL or SQLite")


def completed_reason(outcome: Outcome) -> str:
    """The audit reason of a run's outcome stored: the stage that failed, if one did, and
    what the handler was run again after within its claim, if anything."""
    reason = outcome.stage.value if outcome.stage else "handler returned"
    if not outcome.retried:
        return reason
    runs = len(outcome.retried) + 1
    return f"{reason} (run {runs} times within its claim; again after {', '.join(outcome.retried)})"


def require(call: CallRecord | None, what: str) -> CallRecord:
    if call is None:
        raise TransitionError(what)
    return call


RECORDED_REASON = "recorded and claimed"
AWAITING_REASON = "recorded: awaiting a person's approval"


def _claim_detail(claim_id: str | None) -> str | None:
    return None if claim_id is None else f"claim {claim_id}"


def open_calls_of(session_id: str | BindParameter[str]) -> Select[Any]:
    """A session's open calls, oldest first (``session_id``: a value, or a bind parameter for
    a statement prepared once)."""
    return (
        select(tool_calls)
        .where(tool_calls.c.session_id == session_id, open_call_clause())
        .order_by(tool_calls.c.created_at)
    )


__all__ = ["LedgerStore", "call_events", "open_calls_of", "require"]
