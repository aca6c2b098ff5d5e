"""The ledger's transitions: each one a compare-and-set write plus its audit event, in one commit.

A transition names the states it may start from and, for a worker's writes, the lease token
it holds. Zero rows updated means a lost race or a stale worker: never a blind write.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Row, and_, func, select, tuple_
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.sql.elements import ColumnElement

from toolledger.domain.keys import CallKey, arguments_fingerprint, arguments_text
from toolledger.domain.records import CallEvent, CallRecord, Recorded
from toolledger.domain.redaction import DEFAULT_REDACTOR, Redactor
from toolledger.domain.results import Outcome
from toolledger.domain.states import RESULT_STATUSES, CallStatus, EffectClass
from toolledger.errors import FencedError, TransitionError
from toolledger.store.engine import utc_after, utc_now
from toolledger.store.schema import open_call_clause, tool_call_events, tool_calls

_KEY_COLUMNS = (tool_calls.c.session_id, tool_calls.c.turn_id, tool_calls.c.call_id)


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


class LedgerStore:
    """The only writer of ``tool_calls`` and ``tool_call_events``."""

    def __init__(self, engine: AsyncEngine, *, actor: str, redactor: Redactor = DEFAULT_REDACTOR) -> None:
        self.engine = engine
        self.actor = actor
        self.redactor = redactor
        self._insert = postgresql.insert if engine.dialect.name == "postgresql" else sqlite.insert

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
    ) -> Recorded:
        """Record a delivered call and claim it in one commit (commit point 1), or find it recorded.

        A redelivery with other arguments is flagged in the audit trail and reported.
        ``stored_arguments`` replaces the text kept (a preview of refused arguments); the
        fingerprint is always that of the arguments delivered.
        """
        fingerprint = arguments_fingerprint(arguments)
        insert = (
            self._insert(tool_calls)
            .values(
                session_id=key.session_id,
                turn_id=key.turn_id,
                call_id=key.call_id,
                tool_name=tool_name,
                arguments=_storable(
                    stored_arguments if stored_arguments is not None else arguments_text(arguments)
                ),
                arguments_sha256=fingerprint,
                status=CallStatus.RUNNING.value,
                effect_class=effect_class.value,
                idempotency_key=key.idempotency_key,
                attempt_count=1,
                lease_owner=self.actor,
                lease_token=1,
                lease_expires_at=utc_after(float(lease_seconds)),
                created_at=utc_now(),
                started_at=utc_now(),
                updated_at=utc_now(),
            )
            # No conflict target: the idempotency key is unique too, and a racing insert can
            # hit either constraint first; both mean "already recorded".
            .on_conflict_do_nothing()
            .returning(tool_calls)
        )
        async with self.engine.begin() as conn:
            row = (await conn.execute(insert)).first()
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
                )
                return Recorded(call=call, claimed=True)
            existing = await self._get(conn, key)
            assert existing is not None, "a conflicting row cannot vanish inside this transaction"
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
    ) -> CallRecord | None:
        """Take a new lease (a new token) on a recorded call, e.g. to re-run an unknown one."""
        return await self._transition(
            key,
            from_statuses,
            CallStatus.RUNNING,
            reason,
            values={
                "lease_token": tool_calls.c.lease_token + 1,
                "attempt_count": tool_calls.c.attempt_count + 1,
                "lease_owner": self.actor,
                "lease_expires_at": utc_after(float(lease_seconds)),
                "started_at": utc_now(),
            },
        )

    async def heartbeat(self, key: CallKey, token: int, lease_seconds: float) -> bool:
        """Extend a running call's lease; False when the lease was lost (fenced)."""
        async with self.engine.begin() as conn:
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
        values = {
            "status": target.value,
            "result": outcome.payload_json(),
            "error_stage": outcome.stage.value if outcome.stage else None,
            "error_detail": _storable(self.redactor.text(outcome.detail)) if outcome.detail else None,
            "finished_at": utc_now(),
            "lease_expires_at": None,
            "updated_at": utc_now(),
        }

        def update(source: CallStatus) -> Any:
            return (
                tool_calls.update()
                .where(
                    _where_key(key),
                    tool_calls.c.status == source.value,
                    tool_calls.c.lease_token == token,
                )
                .values(**values)
                .returning(tool_calls)
            )

        async def write(conn: AsyncConnection) -> CallRecord:
            source, reason = CallStatus.RUNNING, outcome.stage.value if outcome.stage else "handler returned"
            row = (await conn.execute(update(source))).first()
            if row is None:
                # The lease expired while the handler ran (a paused or partitioned worker) but
                # nobody claimed the call since: the token is still ours, and this is the one
                # true outcome of the only run. Better than leaving it unknown.
                source, reason = CallStatus.UNKNOWN, "late result of the only run, after its lease expired"
                row = (await conn.execute(update(source))).first()
            if row is None:
                raise FencedError(f"{key}: lease token {token} is no longer current; result refused")
            await self._event(conn, key, "transition", source, target, token, reason)
            return _record(row)

        if connection is not None:
            return await write(connection)
        async with self.engine.begin() as conn:
            return await write(conn)

    async def settle(self, key: CallKey, outcome: Outcome, *, reason: str) -> CallRecord | None:
        """Give an ``unknown`` call its outcome without running it (verify hook, operator, deadline)."""
        target = CallStatus.SUCCEEDED if outcome.success else CallStatus.FAILED
        return await self._transition(
            key,
            [CallStatus.UNKNOWN],
            target,
            reason,
            values={
                "result": outcome.payload_json(),
                "error_stage": outcome.stage.value if outcome.stage else None,
                "error_detail": _storable(self.redactor.text(outcome.detail)) if outcome.detail else None,
                "finished_at": utc_now(),
                "lease_expires_at": None,
            },
        )

    async def reopen(self, key: CallKey, *, reason: str) -> CallRecord | None:
        """An operator allows an ``unknown`` call to run again: it becomes claimable."""
        return await self._transition(
            key, [CallStatus.UNKNOWN], CallStatus.PENDING, reason, values={"lease_expires_at": None}
        )

    async def expire_leases(self, key: CallKey | None = None) -> list[CallRecord]:
        """Running calls whose lease ran out without a result become ``unknown`` (one, or all)."""
        statement = tool_calls.update().where(
            tool_calls.c.status == CallStatus.RUNNING.value, tool_calls.c.lease_expires_at < utc_now()
        )
        if key is not None:
            statement = statement.where(_where_key(key))
        async with self.engine.begin() as conn:
            rows = (
                await conn.execute(
                    statement.values(status=CallStatus.UNKNOWN.value, updated_at=utc_now()).returning(
                        tool_calls
                    )
                )
            ).all()
            expired = [_record(row) for row in rows]
            for call in expired:
                await self._event(
                    conn,
                    call.key,
                    "transition",
                    CallStatus.RUNNING,
                    CallStatus.UNKNOWN,
                    call.lease_token,
                    f"lease of {call.lease_owner} expired without a result",
                )
            return expired

    async def mark_submitted(self, key: CallKey, *, reason: str = "result accepted") -> CallRecord | None:
        """The Agents API accepted the stored result (commit point 3)."""
        return await self._transition(
            key,
            RESULT_STATUSES,
            CallStatus.SUBMITTED,
            reason,
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
        async with self.engine.begin() as conn:
            count = (
                await conn.execute(
                    tool_calls.update()
                    .where(_where_key(key), tool_calls.c.status == CallStatus.SUBMITTED.value)
                    .values(submission_count=tool_calls.c.submission_count + 1, updated_at=utc_now())
                    .returning(tool_calls.c.submission_count)
                )
            ).scalar_one_or_none()
            if count is None:
                return 0
            await self._event(conn, key, "resubmission", None, None, None, "accepted again; still awaited")
            return int(count)

    async def record_submission_failure(self, key: CallKey, error: str) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(
                tool_calls.update()
                .where(_where_key(key))
                .values(
                    submission_count=tool_calls.c.submission_count + 1,
                    last_submission_error=_storable(self.redactor.text(error)),
                    updated_at=utc_now(),
                )
            )
            await self._event(conn, key, "submission_failed", None, None, None, error)

    async def mark_confirmed(self, key: CallKey) -> bool:
        """The session no longer awaits the submitted result: it was consumed."""
        async with self.engine.begin() as conn:
            result = await conn.execute(
                tool_calls.update()
                .where(
                    _where_key(key),
                    tool_calls.c.status == CallStatus.SUBMITTED.value,
                    tool_calls.c.confirmed_at.is_(None),
                )
                .values(confirmed_at=utc_now(), updated_at=utc_now())
            )
            if result.rowcount != 1:
                return False
            await self._event(
                conn,
                key,
                "confirmed",
                CallStatus.SUBMITTED,
                CallStatus.SUBMITTED,
                None,
                "left required_actions",
            )
            return True

    async def abandon(self, key: CallKey, reason: str) -> CallRecord | None:
        """The session stopped awaiting a call before its result was submitted."""
        return await self._transition(
            key,
            [CallStatus.PENDING, CallStatus.RUNNING, CallStatus.UNKNOWN, *RESULT_STATUSES],
            CallStatus.ABANDONED,
            reason,
            values={"abandoned_reason": _storable(self.redactor.text(reason)), "lease_expires_at": None},
        )

    async def flag(self, key: CallKey, kind: str, reason: str, detail: str | None = None) -> None:
        """Note something about a call in its audit trail without changing it."""
        async with self.engine.begin() as conn:
            await self._event(conn, key, kind, None, None, None, reason, detail=detail)

    # ------------------------------------------------------------------- reads

    async def get(self, key: CallKey) -> CallRecord | None:
        async with self.engine.connect() as conn:
            return await self._get(conn, key)

    async def events(self, key: CallKey) -> list[CallEvent]:
        async with self.engine.connect() as conn:
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
        values: dict[str, Any],
        event_kind: str = "transition",
    ) -> CallRecord | None:
        """Compare-and-set from the state the row is in now, if that state allows ``target``.

        None when the call is in no such state (or changed under us): the caller lost a race.
        """
        allowed = {s.value for s in from_statuses}
        async with self.engine.begin() as conn:
            current = (await conn.execute(select(tool_calls.c.status).where(_where_key(key)))).scalar()
            if current is None:
                return None
            if current not in allowed:
                return None
            row = (
                await conn.execute(
                    tool_calls.update()
                    .where(_where_key(key), tool_calls.c.status == current)
                    .values(status=target.value, updated_at=utc_now(), **values)
                    .returning(tool_calls)
                )
            ).first()
            if row is None:
                return None
            call = _record(row)
            await self._event(conn, key, event_kind, CallStatus(current), target, call.lease_token, reason)
            return call

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
                reason=_storable(self.redactor.text(reason)) if reason is not None else None,
                detail=_storable(self.redactor.text(detail)) if detail is not None else None,
            )
        )


def require(call: CallRecord | None, what: str) -> CallRecord:
    if call is None:
        raise TransitionError(what)
    return call


def _storable(text: str) -> str:
    """PostgreSQL text holds neither NUL nor lone surrogates: spell those as escapes."""
    return text.replace("\x00", "\\u0000").encode("utf-8", "backslashreplace").decode("utf-8")


__all__ = ["LedgerStore", "require"]
