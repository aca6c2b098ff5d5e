"""The ledger's transitions: each one a compare-and-set write plus its audit event, in one commit.

A transition names the states it may start from and, for a worker's writes, the lease token
it holds. Zero rows updated means a lost race or a stale worker: never a blind write.

On PostgreSQL a write and its audit event travel as ONE statement in autocommit (a
data-modifying CTE: ``WITH changed AS (UPDATE ... RETURNING ...) INSERT INTO events SELECT
... FROM changed``): one round trip and one commit instead of BEGIN, a read, the write, the
event and COMMIT. That is most of the ledger's cost per call (DESIGN.md, "Performance
facts"). SQLite has no data-modifying CTEs and no network between the two: it keeps the
transaction of separate statements.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from datetime import datetime
from functools import partial
from typing import Any

from sqlalchemy import (
    CTE,
    Float,
    Row,
    Select,
    String,
    and_,
    bindparam,
    case,
    func,
    literal,
    null,
    or_,
    select,
    tuple_,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.sql.elements import ColumnElement

from toolledger.domain.keys import CallKey, arguments_fingerprint, arguments_text
from toolledger.domain.records import CallEvent, CallRecord, Recorded
from toolledger.domain.redaction import DEFAULT_REDACTOR, Redactor
from toolledger.domain.results import Outcome
from toolledger.domain.states import RESULT_STATUSES, CallStatus, EffectClass
from toolledger.errors import FencedError, TransitionError
from toolledger.store.engine import (
    seconds_until,
    uninterrupted_on_sqlite,
    utc_after,
    utc_now,
    write_transaction,
)
from toolledger.store.schema import StorableText, open_call_clause, tool_call_events, tool_calls

_KEY_COLUMNS = (tool_calls.c.session_id, tool_calls.c.turn_id, tool_calls.c.call_id)
_EVENT_COLUMNS = (
    "session_id",
    "turn_id",
    "call_id",
    "at",
    "actor",
    "kind",
    "from_status",
    "to_status",
    "lease_token",
    "reason",
    "detail",
)


_KEY_MATCH = and_(
    tool_calls.c.session_id == bindparam("k_session_id"),
    tool_calls.c.turn_id == bindparam("k_turn_id"),
    tool_calls.c.call_id == bindparam("k_call_id"),
)
"""A call's key as bind parameters, for statements built once (``_key_params`` fills them)."""

_OUTCOME_VALUES: dict[str, Any] = {
    "result": bindparam("p_result"),
    "error_stage": bindparam("p_error_stage"),
    "error_detail": bindparam("p_error_detail"),
}


def _key_params(key: CallKey) -> dict[str, str]:
    return {"k_session_id": key.session_id, "k_turn_id": key.turn_id, "k_call_id": key.call_id}


def _completion(source: CallStatus, target: CallStatus) -> Any:
    """A run's outcome stored, if the run's lease token (``p_token``) is still current."""
    return (
        tool_calls.update()
        .where(
            _KEY_MATCH, tool_calls.c.status == source.value, tool_calls.c.lease_token == bindparam("p_token")
        )
        .values(
            status=target.value,
            **_OUTCOME_VALUES,
            finished_at=utc_now(),
            lease_expires_at=None,
            updated_at=utc_now(),
        )
        .returning(tool_calls)
    )


def _where_key(key: CallKey) -> ColumnElement[bool]:
    return and_(
        tool_calls.c.session_id == key.session_id,
        tool_calls.c.turn_id == key.turn_id,
        tool_calls.c.call_id == key.call_id,
    )


def _record(row: Row[Any] | Mapping[str, Any]) -> CallRecord:
    m = row._mapping if isinstance(row, Row) else row
    return CallRecord(
        key=CallKey(m["session_id"], m["turn_id"], m["call_id"]),
        tool_name=m["tool_name"],
        arguments=m["arguments"],
        arguments_sha256=m["arguments_sha256"],
        status=CallStatus(m["status"]),
        effect_class=EffectClass(m["effect_class"]),
        idempotency_key=m["idempotency_key"],
        attempt_count=m["attempt_count"],
        lease_owner=m["lease_owner"],
        lease_token=m["lease_token"],
        lease_expires_at=m["lease_expires_at"],
        result=m["result"],
        error_stage=m["error_stage"],
        error_detail=m["error_detail"],
        created_at=m["created_at"],
        started_at=m["started_at"],
        finished_at=m["finished_at"],
        submitted_at=m["submitted_at"],
        confirmed_at=m["confirmed_at"],
        submission_count=m["submission_count"],
        last_submission_error=m["last_submission_error"],
        abandoned_reason=m["abandoned_reason"],
    )


@uninterrupted_on_sqlite
class LedgerStore:
    """The only writer of ``tool_calls`` and ``tool_call_events``."""

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        actor: str,
        owner: str | None = None,
        redactor: Redactor = DEFAULT_REDACTOR,
    ) -> None:
        """``actor``: who this process is in the audit trail (the worker id). ``owner``: the
        process instance its leases name (``lease_owner``), unique per process so that a
        replica known to be gone can have its leases taken over (``store.liveness``)."""
        self.engine = engine
        self.actor = actor
        self.owner = owner or actor
        self.redactor = redactor
        self._insert = postgresql.insert if engine.dialect.name == "postgresql" else sqlite.insert
        self._one_statement = engine.dialect.name == "postgresql"
        # Same pool; each single-statement write commits by itself (no BEGIN/COMMIT trips).
        self._autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
        self._statements: dict[Hashable, Any] = {}

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
    ) -> Recorded:
        """Record a delivered call and claim it in one commit (commit point 1), or find it recorded.

        A redelivery with other arguments is flagged in the audit trail and reported.
        ``stored_arguments`` replaces the text kept (a preview of refused arguments); the
        fingerprint is always that of the arguments delivered. ``claim_id`` goes into the
        claim's audit event: after an ambiguous commit, ``claimed_by`` tells whether it was ours.
        """
        fingerprint = arguments_fingerprint(arguments)
        params = {
            **_key_params(key),
            **self._event_params("recorded and claimed", _claim_detail(claim_id)),
            "p_tool_name": tool_name,
            "p_arguments": stored_arguments if stored_arguments is not None else arguments_text(arguments),
            "p_sha256": fingerprint,
            "p_effect_class": effect_class.value,
            "p_idempotency_key": key.idempotency_key,
            "p_lease_seconds": float(lease_seconds),
            "p_owner": self.owner,
        }
        if self._one_statement:
            statement = self._statement(("record",), self._build_record)
            async with self._autocommit.connect() as conn:
                row = (await conn.execute(statement, params)).first()
            if row is not None:
                return Recorded(call=_record(row), claimed=True)
        async with write_transaction(self.engine) as conn:
            if not self._one_statement:
                row = (await conn.execute(self._record_insert(), params)).first()
                if row is not None:
                    call = _record(row)
                    await self._event(
                        conn,
                        key,
                        "transition",
                        None,
                        CallStatus.RUNNING,
                        call.lease_token,
                        "recorded and claimed",
                        detail=_claim_detail(claim_id),
                    )
                    return Recorded(call=call, claimed=True)
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
        ``claim_id``: as for ``record``."""
        return await self._transition(
            key,
            from_statuses,
            CallStatus.RUNNING,
            reason,
            detail=_claim_detail(claim_id),
            shape="claim",
            values={
                "lease_token": tool_calls.c.lease_token + 1,
                "attempt_count": tool_calls.c.attempt_count + 1,
                "lease_owner": bindparam("p_owner"),
                "lease_expires_at": utc_after(bindparam("p_lease_seconds", type_=Float)),
                "started_at": utc_now(),
            },
            params={"p_lease_seconds": float(lease_seconds), "p_owner": self.owner},
        )

    async def heartbeat(self, key: CallKey, token: int, lease_seconds: float) -> bool:
        """Extend a running call's lease; False when the lease was lost (fenced)."""
        async with self._writing() as conn:
            result = await conn.execute(
                tool_calls.update()
                .where(
                    _where_key(key),
                    tool_calls.c.status == CallStatus.RUNNING.value,
                    tool_calls.c.lease_token == token,
                )
                .values(lease_expires_at=utc_after(float(lease_seconds)), updated_at=utc_now())
            )
            return result.rowcount == 1

    async def complete(
        self, key: CallKey, token: int, outcome: Outcome, *, connection: AsyncConnection | None = None
    ) -> CallRecord:
        """Store the outcome of a run (commit point 2). Raises FencedError if the lease was lost.

        With ``connection`` the write joins the caller's transaction: a transactional tool's
        side effect and its result then commit together.
        """
        target = CallStatus.SUCCEEDED if outcome.success else CallStatus.FAILED
        params = {**_key_params(key), "p_token": token, **self._outcome_params(outcome)}
        attempts = (
            (CallStatus.RUNNING, outcome.stage.value if outcome.stage else "handler returned"),
            # The lease expired while the handler ran (a paused or partitioned worker) but
            # nobody claimed the call since: the token is still ours, and this is the one
            # true outcome of the only run. Better than leaving it unknown.
            (CallStatus.UNKNOWN, "late result of the only run, after its lease expired"),
        )

        async def write(conn: AsyncConnection) -> CallRecord:
            for source, reason in attempts:
                if self._one_statement:
                    statement = self._statement(
                        ("complete", source, target), partial(self._build_completion, source, target)
                    )
                    row = (await conn.execute(statement, {**params, **self._event_params(reason)})).first()
                    if row is not None:
                        return _record(row)
                    continue
                row = (await conn.execute(_completion(source, target), params)).first()
                if row is not None:
                    await self._event(conn, key, "transition", source, target, token, reason)
                    return _record(row)
            raise FencedError(f"{key}: lease token {token} is no longer current; result refused")

        if connection is not None:
            return await write(connection)
        async with self._writing() as conn:
            return await write(conn)

    async def settle(self, key: CallKey, outcome: Outcome, *, reason: str) -> CallRecord | None:
        """Give an ``unknown`` call its outcome without running it (verify hook, operator, deadline)."""
        target = CallStatus.SUCCEEDED if outcome.success else CallStatus.FAILED
        return await self._transition(
            key,
            [CallStatus.UNKNOWN],
            target,
            reason,
            shape="settle",
            values={**_OUTCOME_VALUES, "finished_at": utc_now(), "lease_expires_at": None},
            params=self._outcome_params(outcome),
        )

    async def reopen(self, key: CallKey, *, reason: str) -> CallRecord | None:
        """An operator allows an ``unknown`` call to run again: it becomes claimable."""
        return await self._transition(
            key,
            [CallStatus.UNKNOWN],
            CallStatus.PENDING,
            reason,
            shape="reopen",
            values={"lease_expires_at": None},
        )

    async def expire_leases(
        self, key: CallKey | None = None, *, gone_owners: Collection[str] = ()
    ) -> list[CallRecord]:
        """Running calls whose lease ran out without a result become ``unknown`` (one, or all);
        so do those whose owner is provably gone (``store.liveness``), without waiting for
        their leases to run out. Either way the same transition: the owner's token is dead."""
        ran_out = tool_calls.c.lease_expires_at < utc_now()
        gone = sorted(set(gone_owners) - {self.owner})
        lapsed = or_(ran_out, tool_calls.c.lease_owner.in_(gone)) if gone else ran_out
        statement = tool_calls.update().where(tool_calls.c.status == CallStatus.RUNNING.value, lapsed)
        if key is not None:
            statement = statement.where(_where_key(key))
        async with write_transaction(self.engine) as conn:
            rows = (
                await conn.execute(
                    statement.values(
                        status=CallStatus.UNKNOWN.value,
                        # When the run's lease ended: an unknown call's deadline counts from here.
                        lease_expires_at=case((ran_out, tool_calls.c.lease_expires_at), else_=utc_now()),
                        updated_at=utc_now(),
                    ).returning(tool_calls)
                )
            ).all()
            expired = [_record(row) for row in rows]
            for call in expired:
                reason = (
                    f"lease owner {call.lease_owner} is gone (its liveness lock is free): "
                    "taken over before its lease ran out"
                    if call.lease_owner in gone
                    else f"lease of {call.lease_owner} expired without a result"
                )
                await self._event(
                    conn,
                    call.key,
                    "transition",
                    CallStatus.RUNNING,
                    CallStatus.UNKNOWN,
                    call.lease_token,
                    reason,
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
        """The Agents API accepted the stored result (commit point 3)."""
        return await self._transition(
            key,
            RESULT_STATUSES,
            CallStatus.SUBMITTED,
            reason,
            shape="mark_submitted",
            values={
                "submitted_at": utc_now(),
                "submission_count": tool_calls.c.submission_count + 1,
                "last_submission_error": None,
            },
            event_kind="submission",
        )

    async def note_resubmission(self, key: CallKey) -> int:
        """A submitted call still awaited was sent again and accepted again: count it (and say
        so in the audit trail). Returns how many times the call has been submitted."""

        def counted(match: ColumnElement[bool]) -> Any:
            return (
                tool_calls.update()
                .where(match, tool_calls.c.status == CallStatus.SUBMITTED.value)
                .values(submission_count=tool_calls.c.submission_count + 1, updated_at=utc_now())
                .returning(*_KEY_COLUMNS, tool_calls.c.submission_count)
            )

        row = await self._change_noted(
            key, "note_resubmission", counted, {}, "resubmission", None, None, "accepted again; still awaited"
        )
        return 0 if row is None else int(row.submission_count)

    async def record_submission_failure(self, key: CallKey, error: str) -> None:
        def counted(match: ColumnElement[bool]) -> Any:
            return (
                tool_calls.update()
                .where(match)
                .values(
                    submission_count=tool_calls.c.submission_count + 1,
                    last_submission_error=bindparam("p_error"),
                    updated_at=utc_now(),
                )
                .returning(*_KEY_COLUMNS)
            )

        params = {"p_error": self.redactor.text(error)}
        await self._change_noted(
            key, "record_submission_failure", counted, params, "submission_failed", None, None, error
        )

    async def mark_confirmed(self, key: CallKey) -> bool:
        """The session no longer awaits the submitted result: it was consumed."""

        def confirmed(match: ColumnElement[bool]) -> Any:
            return (
                tool_calls.update()
                .where(
                    match,
                    tool_calls.c.status == CallStatus.SUBMITTED.value,
                    tool_calls.c.confirmed_at.is_(None),
                )
                .values(confirmed_at=utc_now(), updated_at=utc_now())
                .returning(*_KEY_COLUMNS)
            )

        row = await self._change_noted(
            key,
            "mark_confirmed",
            confirmed,
            {},
            "confirmed",
            CallStatus.SUBMITTED,
            CallStatus.SUBMITTED,
            "left required_actions",
        )
        return row is not None

    async def mark_confirmed_many(self, keys: Sequence[CallKey]) -> set[CallKey]:
        """``mark_confirmed`` for many calls in one statement (a session's turn, once it ended).
        Returns the calls confirmed now."""
        if not keys:
            return set()
        if not self._one_statement:
            return {key for key in keys if await self.mark_confirmed(key)}
        statement = self._statement(("mark_confirmed_many",), self._build_confirm_many)
        params = {
            "p_keys": [(k.session_id, k.turn_id, k.call_id) for k in keys],
            **self._event_params("left required_actions"),
        }
        async with self._autocommit.connect() as conn:
            rows = (await conn.execute(statement, params)).all()
        return {CallKey(r.session_id, r.turn_id, r.call_id) for r in rows}

    async def abandon(self, key: CallKey, reason: str) -> CallRecord | None:
        """The session stopped awaiting a call before its result was submitted."""
        return await self._transition(
            key,
            [CallStatus.PENDING, CallStatus.RUNNING, CallStatus.UNKNOWN, *RESULT_STATUSES],
            CallStatus.ABANDONED,
            reason,
            shape="abandon",
            values={"abandoned_reason": bindparam("p_abandoned_reason"), "lease_expires_at": None},
            params={"p_abandoned_reason": self.redactor.text(reason)},
        )

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

    async def in_states(
        self, statuses: Iterable[CallStatus], *, session_id: str | None = None, limit: int = 1000
    ) -> list[CallRecord]:
        query = select(tool_calls).where(tool_calls.c.status.in_([s.value for s in statuses]))
        if session_id is not None:
            query = query.where(tool_calls.c.session_id == session_id)
        query = query.order_by(tool_calls.c.created_at, *_KEY_COLUMNS).limit(limit)
        async with self.engine.connect() as conn:
            return [_record(row) for row in await conn.execute(query)]

    async def for_session(self, session_id: str) -> list[CallRecord]:
        async with self.engine.connect() as conn:
            rows = await conn.execute(
                select(tool_calls)
                .where(tool_calls.c.session_id == session_id)
                .order_by(tool_calls.c.created_at)
            )
            return [_record(row) for row in rows]

    async def open_calls(self, session_id: str) -> list[CallRecord]:
        """The session's calls it may still be waiting on (not abandoned, not confirmed)."""
        async with self.engine.connect() as conn:
            rows = await conn.execute(
                select(tool_calls)
                .where(tool_calls.c.session_id == session_id, open_call_clause())
                .order_by(tool_calls.c.created_at)
            )
            return [_record(row) for row in rows]

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
                    tuple_(*_KEY_COLUMNS).in_([(k.session_id, k.turn_id, k.call_id) for k in keys])
                )
            )
            records = [_record(row) for row in rows]
        return {record.key: record for record in records}

    # --------------------------------------------------------------- internals

    async def _get(self, conn: AsyncConnection, key: CallKey) -> CallRecord | None:
        row = (await conn.execute(select(tool_calls).where(_where_key(key)))).first()
        return None if row is None else _record(row)

    async def _transition(
        self,
        key: CallKey,
        from_statuses: Iterable[CallStatus],
        target: CallStatus,
        reason: str,
        *,
        shape: str,
        values: dict[str, Any],
        params: dict[str, Any] | None = None,
        event_kind: str = "transition",
        detail: str | None = None,
    ) -> CallRecord | None:
        """Compare-and-set from the state the row is in now, if that state allows ``target``.

        ``values`` are the columns set besides the status: constant expressions and bind
        parameters (given in ``params``), so the statement is built once per ``shape``.
        None when the call is in no such state (or changed under us): the caller lost a race.
        """
        allowed = tuple(sorted({s.value for s in from_statuses}))
        params = {**(params or {}), **self._event_params(reason, detail)}
        if self._one_statement:

            def build() -> Select[Any]:
                # Locked first, so the event names the state the row really left (a concurrent
                # writer's commit is waited for and re-read, as the UPDATE itself would).
                locked = (
                    select(tool_calls.c.status.label("from_status"))
                    .where(_KEY_MATCH)
                    .with_for_update()
                    .cte("current_state")
                )
                changed = (
                    tool_calls.update()
                    .where(
                        _KEY_MATCH,
                        tool_calls.c.status == locked.c.from_status,
                        locked.c.from_status.in_(allowed),
                    )
                    .values(status=target.value, updated_at=utc_now(), **values)
                    .returning(*tool_calls.c, locked.c.from_status)
                    .cte("changed")
                )
                return self._with_event(changed, event_kind, changed.c.from_status, target)

            statement = self._statement((shape, allowed, target, event_kind), build)
            async with self._autocommit.connect() as conn:
                row = (await conn.execute(statement, {**params, **_key_params(key)})).first()
            return None if row is None else _record(row)
        async with write_transaction(self.engine) as conn:
            current = (await conn.execute(select(tool_calls.c.status).where(_where_key(key)))).scalar()
            if current is None or current not in allowed:
                return None
            row = (
                await conn.execute(
                    tool_calls.update()
                    .where(_where_key(key), tool_calls.c.status == current)
                    .values(status=target.value, updated_at=utc_now(), **values)
                    .returning(tool_calls),
                    params,
                )
            ).first()
            if row is None:
                return None
            call = _record(row)
            await self._event(
                conn, key, event_kind, CallStatus(current), target, call.lease_token, reason, detail=detail
            )
            return call

    def _statement(self, shape: Hashable, build: Callable[[], Any]) -> Any:
        """A write statement built once per shape (building a CTE costs more than running it)."""
        statement = self._statements.get(shape)
        if statement is None:
            statement = self._statements[shape] = build()
        return statement

    def _build_completion(self, source: CallStatus, target: CallStatus) -> Select[Any]:
        return self._with_event(_completion(source, target).cte("changed"), "transition", source, target)

    def _build_confirm_many(self) -> Select[Any]:
        confirmed = (
            tool_calls.update()
            .where(
                tuple_(*_KEY_COLUMNS).in_(bindparam("p_keys", expanding=True)),
                tool_calls.c.status == CallStatus.SUBMITTED.value,
                tool_calls.c.confirmed_at.is_(None),
            )
            .values(confirmed_at=utc_now(), updated_at=utc_now())
            .returning(*_KEY_COLUMNS)
        )
        return self._with_event(
            confirmed.cte("changed"),
            "confirmed",
            CallStatus.SUBMITTED,
            CallStatus.SUBMITTED,
            with_token=False,
        )

    def _build_record(self) -> Select[Any]:
        return self._with_event(self._record_insert().cte("recorded"), "transition", None, CallStatus.RUNNING)

    def _record_insert(self) -> Any:
        return (
            self._insert(tool_calls)
            .values(
                session_id=bindparam("k_session_id"),
                turn_id=bindparam("k_turn_id"),
                call_id=bindparam("k_call_id"),
                tool_name=bindparam("p_tool_name"),
                arguments=bindparam("p_arguments"),
                arguments_sha256=bindparam("p_sha256"),
                status=CallStatus.RUNNING.value,
                effect_class=bindparam("p_effect_class"),
                idempotency_key=bindparam("p_idempotency_key"),
                attempt_count=1,
                lease_owner=bindparam("p_owner"),
                lease_token=1,
                lease_expires_at=utc_after(bindparam("p_lease_seconds", type_=Float)),
                created_at=utc_now(),
                started_at=utc_now(),
                updated_at=utc_now(),
            )
            # No conflict target: the idempotency key is unique too, and a racing insert can
            # hit either constraint first; both mean "already recorded".
            .on_conflict_do_nothing()
            .returning(tool_calls)
        )

    def _writing(self) -> AbstractAsyncContextManager[AsyncConnection]:
        """A connection for one write: autocommit where writes are single statements."""
        return self._autocommit.connect() if self._one_statement else write_transaction(self.engine)

    def _event_params(self, reason: str | None, detail: str | None = None) -> dict[str, Any]:
        return {
            "e_actor": self.actor,
            "e_reason": self._audit_text(reason) if reason is not None else None,
            "e_detail": self._audit_text(detail) if detail is not None else None,
        }

    def _outcome_params(self, outcome: Outcome) -> dict[str, Any]:
        return {
            "p_result": outcome.payload_json(),
            "p_error_stage": outcome.stage.value if outcome.stage else None,
            "p_error_detail": self.redactor.text(outcome.detail) if outcome.detail else None,
        }

    def _with_event(
        self,
        changed: CTE,
        kind: str,
        from_status: ColumnElement[Any] | CallStatus | None,
        to_status: CallStatus | None,
        *,
        with_token: bool = True,
    ) -> Select[Any]:
        """The rows ``changed`` returns, each with its audit event inserted by the same statement
        (actor, reason and detail are the parameters ``e_actor``, ``e_reason`` and ``e_detail``)."""
        rows = select(
            changed.c.session_id,
            changed.c.turn_id,
            changed.c.call_id,
            utc_now(),
            bindparam("e_actor", type_=String),
            literal(kind, String),
            _status_sql(from_status),
            _status_sql(to_status),
            changed.c.lease_token if with_token else null(),
            bindparam("e_reason", type_=StorableText),
            bindparam("e_detail", type_=StorableText),
        )
        logged = tool_call_events.insert().from_select(_EVENT_COLUMNS, rows).cte("logged")
        return select(changed).add_cte(logged)

    async def _change_noted(
        self,
        key: CallKey,
        shape: str,
        change: Callable[[ColumnElement[bool]], Any],
        params: dict[str, Any],
        kind: str,
        from_status: CallStatus | None,
        to_status: CallStatus | None,
        reason: str,
    ) -> Row[Any] | None:
        """Run an UPDATE (built by ``change`` for a key match) returning the key columns; if it
        changed the row, note it in the trail. No lease token is recorded."""
        if self._one_statement:
            statement = self._statement(
                (shape,),
                lambda: self._with_event(
                    change(_KEY_MATCH).cte("changed"), kind, from_status, to_status, with_token=False
                ),
            )
            async with self._autocommit.connect() as conn:
                values = {**params, **_key_params(key), **self._event_params(reason)}
                noted: Row[Any] | None = (await conn.execute(statement, values)).first()
                return noted
        async with write_transaction(self.engine) as conn:
            row: Row[Any] | None = (await conn.execute(change(_where_key(key)), params)).first()
            if row is not None:
                await self._event(conn, key, kind, from_status, to_status, None, reason)
            return row

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
    ) -> None:
        await conn.execute(
            tool_call_events.insert().values(
                session_id=key.session_id,
                turn_id=key.turn_id,
                call_id=key.call_id,
                at=utc_now(),
                actor=self.actor,
                kind=kind,
                from_status=from_status.value if from_status else None,
                to_status=to_status.value if to_status else None,
                lease_token=lease_token,
                # Every audit line is redacted: reasons quote the API and hooks quote tracebacks.
                reason=self.redactor.text(reason) if reason is not None else None,
                detail=self.redactor.text(detail) if detail is not None else None,
            )
        )


async def call_events(conn: AsyncConnection, key: CallKey) -> list[CallEvent]:
    """A call's audit trail, oldest first."""
    rows = await conn.execute(
        select(tool_call_events)
        .where(
            tool_call_events.c.session_id == key.session_id,
            tool_call_events.c.turn_id == key.turn_id,
            tool_call_events.c.call_id == key.call_id,
        )
        .order_by(tool_call_events.c.id)
    )
    return [
        CallEvent(
            id=r.id,
            key=key,
            at=r.at,
            actor=r.actor,
            kind=r.kind,
            from_status=r.from_status,
            to_status=r.to_status,
            lease_token=r.lease_token,
            reason=r.reason,
            detail=r.detail,
        )
        for r in rows
    ]


def require(call: CallRecord | None, what: str) -> CallRecord:
    if call is None:
        raise TransitionError(what)
    return call


def _claim_detail(claim_id: str | None) -> str | None:
    return None if claim_id is None else f"claim {claim_id}"


def _status_sql(status: ColumnElement[Any] | CallStatus | None) -> ColumnElement[Any]:
    if status is None:
        return null()
    if isinstance(status, CallStatus):
        return literal(status.value, String)
    return status


__all__ = ["LedgerStore", "call_events", "require"]
