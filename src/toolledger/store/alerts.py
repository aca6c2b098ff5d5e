"""The alert sender's reads of the audit trail and its writes: the only writer of
``alert_cursors`` (but for a prune on SQLite, which brings cursors down: ``store.audit``).

The audit trail is the outbox: every event that raises an alert (``domain.alerts``) is
already written in the same commit as the change it records, so the sender reads events
after its cursor and nothing on a call's path waits for it. The cursor, and the lease that
says which replica sends, live in one row per destination. A delivery (or a round of failed
tries) is written in the call's own timeline, in the same commit as the cursor moving past
it: a restart never sends a delivered alert again.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import String, and_, case, func, literal, null, or_, select, true
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.sql.elements import ColumnElement

from toolledger.domain.alerts import ALERT_TRIGGERS, AlertSubject, AlertTrigger, alert_kind_of
from toolledger.domain.keys import CallKey
from toolledger.domain.redaction import Redactor
from toolledger.domain.trail import TrailKey
from toolledger.store.chain import content_sha256_sql
from toolledger.store.engine import (
    dialect_insert,
    uninterrupted_on_sqlite,
    utc_after,
    utc_now,
    write_transaction,
)
from toolledger.store.rows import call_event
from toolledger.store.schema import StorableText, alert_cursors, storable_text, tool_call_events, tool_calls
from toolledger.store.transitions import EVENT_COLUMNS


@dataclass(frozen=True)
class AlertLease:
    """This sender holds the destination's cursor under lease ``token``."""

    token: int
    cursor: int
    """Every event up to this id is dealt with (sent, or raises no alert)."""


@dataclass(frozen=True)
class EventWindow:
    """What the audit trail holds just after a cursor."""

    top: int
    """The highest event id read (the cursor itself when there is none)."""
    events: int
    """How many were read (the limit: more may follow at once)."""
    missing: tuple[int, ...]
    """Ids between the cursor and ``top`` not visible now: a transaction that has not
    committed yet, or one that rolled back (or events pruned since)."""
    subjects: list[AlertSubject]
    """The events up to ``top`` that raise an alert, oldest first."""


@dataclass(frozen=True)
class AlertNote:
    """A line of a call's timeline about one of its alerts."""

    key: CallKey
    kind: str
    reason: str
    detail: str


def trigger_clause(triggers: Sequence[AlertTrigger] = ALERT_TRIGGERS) -> ColumnElement[bool]:
    """The triggers as a filter of ``tool_call_events`` (the store's reading of the same data
    ``alert_kind_of`` reads)."""
    events = tool_call_events.c
    alternatives = []
    for trigger in triggers:
        conditions: list[ColumnElement[bool]] = []
        if trigger.event_kind is not None:
            conditions.append(events.kind == trigger.event_kind)
        if trigger.from_status is not None:
            conditions.append(events.from_status == trigger.from_status)
        if trigger.to_status is not None:
            conditions.append(events.to_status == trigger.to_status)
        if trigger.reason_prefixes:
            conditions.append(
                or_(
                    *(events.reason.startswith(prefix, autoescape=True) for prefix in trigger.reason_prefixes)
                )
            )
        alternatives.append(and_(true(), *conditions))
    return or_(*alternatives)


@uninterrupted_on_sqlite
class AlertStore:
    def __init__(
        self,
        engine: AsyncEngine,
        *,
        destination: str,
        actor: str,
        redactor: Redactor,
        trail_key: TrailKey | None = None,
    ) -> None:
        """``trail_key``: each note written carries its keyed MAC, as the ledger's events do."""
        self.engine = engine
        self.destination = destination
        self.actor = actor
        self.redactor = redactor
        self.trail_key = trail_key
        self._insert = dialect_insert(engine)
        self._triggered = trigger_clause()

    # ------------------------------------------------------------------ cursor

    async def ensure_cursor(self) -> None:
        """The destination's cursor, created at the end of the audit trail the first time (a
        ledger's past is not alerted on once a webhook is configured); kept as it is after."""
        newest = select(func.coalesce(func.max(tool_call_events.c.id), 0)).scalar_subquery()
        insert = (
            self._insert(alert_cursors)
            .values(name=self.destination, last_event_id=newest, lease_token=0, updated_at=utc_now())
            .on_conflict_do_nothing(index_elements=[alert_cursors.c.name])
        )
        async with write_transaction(self.engine) as conn:
            await conn.execute(insert)

    async def take_lease(self, owner: str, lease_seconds: float) -> AlertLease | None:
        """Take the destination's lease (or renew it, if ``owner`` holds it): None while another
        sender holds it. The token changes whenever the lease changes hands or had run out."""
        row = alert_cursors.c
        held_by_us = and_(row.owner == owner, row.lease_expires_at >= utc_now())
        free = or_(row.owner.is_(None), row.lease_expires_at.is_(None), row.lease_expires_at < utc_now())
        statement = (
            alert_cursors.update()
            .where(row.name == self.destination, or_(held_by_us, free))
            .values(
                owner=owner,
                lease_token=case((held_by_us, row.lease_token), else_=row.lease_token + 1),
                lease_expires_at=utc_after(float(lease_seconds)),
                updated_at=utc_now(),
            )
            .returning(row.lease_token, row.last_event_id)
        )
        async with write_transaction(self.engine) as conn:
            found = (await conn.execute(statement)).first()
        return None if found is None else AlertLease(int(found.lease_token), int(found.last_event_id))

    async def renew(self, owner: str, token: int, lease_seconds: float) -> bool:
        """Extend a lease still held; False once it is lost (ran out and was taken over)."""
        statement = (
            alert_cursors.update()
            .where(*self._held(owner, token))
            .values(lease_expires_at=utc_after(float(lease_seconds)), updated_at=utc_now())
        )
        async with write_transaction(self.engine) as conn:
            return (await conn.execute(statement)).rowcount == 1

    async def release(self, owner: str) -> None:
        """Give the lease back (a graceful stop), so that another replica sends at once."""
        statement = (
            alert_cursors.update()
            .where(alert_cursors.c.name == self.destination, alert_cursors.c.owner == owner)
            .values(owner=None, lease_expires_at=None, updated_at=utc_now())
        )
        async with write_transaction(self.engine) as conn:
            await conn.execute(statement)

    async def free(self, owners: Collection[str]) -> bool:
        """Free the lease of replicas provably gone (``store.liveness``): taken at once by
        another, not when it runs out. True if one was freed."""
        if not owners:
            return False
        statement = (
            alert_cursors.update()
            .where(alert_cursors.c.name == self.destination, alert_cursors.c.owner.in_(sorted(owners)))
            .values(owner=None, lease_expires_at=None, updated_at=utc_now())
        )
        async with write_transaction(self.engine) as conn:
            return (await conn.execute(statement)).rowcount == 1

    async def advance(self, owner: str, token: int, *, expected: int, to: int) -> bool:
        """Move the cursor from ``expected`` to ``to``; False if the lease is lost or the cursor
        was moved by someone else meanwhile (a prune on SQLite, ``AuditStore.prune``)."""
        async with write_transaction(self.engine) as conn:
            moved = await conn.execute(self._moved(owner, token, expected, to))
            return moved.rowcount == 1

    async def record(
        self, owner: str, token: int, note: AlertNote, *, cursor: tuple[int, int] | None = None
    ) -> bool:
        """Write ``note`` in its call's timeline (a call pruned meanwhile gets none) and, with
        ``cursor`` (expected, to), move the cursor in the same commit. False, and nothing
        written, if the lease is lost or the cursor is not where it was expected."""
        async with write_transaction(self.engine) as conn:
            if cursor is not None:
                check = self._moved(owner, token, *cursor)
            else:
                check = alert_cursors.update().where(*self._held(owner, token)).values(updated_at=utc_now())
            if (await conn.execute(check)).rowcount != 1:
                return False  # nothing was changed: the empty transaction commits
            await conn.execute(self._note_insert(note))
            return True

    # ------------------------------------------------------------------ reads

    async def window(self, after: int, *, limit: int) -> EventWindow:
        """The next ``limit`` event ids after ``after`` (which of them are missing), and those
        of them that raise an alert: one aggregate when the ids run without a hole (nearly
        always), their list only when they do not."""
        ids = (
            select(tool_call_events.c.id)
            .where(tool_call_events.c.id > after)
            .order_by(tool_call_events.c.id)
            .limit(limit)
            .subquery()
        )
        async with self.engine.connect() as conn:
            count, top = (await conn.execute(select(func.count(), func.max(ids.c.id)))).one()
            if not count:
                return EventWindow(after, 0, (), [])
            top = int(top)
            missing: tuple[int, ...] = ()
            if top - after != count:
                present = set((await conn.execute(select(ids.c.id))).scalars())
                missing = tuple(i for i in range(after + 1, top) if i not in present)
            rows = await conn.execute(
                self._subjects().where(
                    tool_call_events.c.id > after, tool_call_events.c.id <= top, self._triggered
                )
            )
            return EventWindow(top, int(count), missing, _subjects(rows))

    async def among(self, event_ids: Collection[int]) -> tuple[set[int], list[AlertSubject]]:
        """Which of ``event_ids`` are visible now, and those of them that raise an alert (ids
        once missing, looked for again after the cursor went past them)."""
        if not event_ids:
            return set(), []
        wanted = sorted(event_ids)
        async with self.engine.connect() as conn:
            present = set(
                (
                    await conn.execute(select(tool_call_events.c.id).where(tool_call_events.c.id.in_(wanted)))
                ).scalars()
            )
            rows = await conn.execute(
                self._subjects().where(tool_call_events.c.id.in_(wanted), self._triggered)
            )
            return present, _subjects(rows)

    async def cursor(self) -> AlertLease | None:
        """The destination's row as it is (for status and tests): token and cursor."""
        async with self.engine.connect() as conn:
            found = (
                await conn.execute(
                    select(alert_cursors.c.lease_token, alert_cursors.c.last_event_id).where(
                        alert_cursors.c.name == self.destination
                    )
                )
            ).first()
        return None if found is None else AlertLease(int(found.lease_token), int(found.last_event_id))

    # ---------------------------------------------------------------- helpers

    def _held(self, owner: str, token: int) -> tuple[ColumnElement[bool], ...]:
        row = alert_cursors.c
        return (row.name == self.destination, row.owner == owner, row.lease_token == token)

    def _moved(self, owner: str, token: int, expected: int, to: int) -> Any:
        return (
            alert_cursors.update()
            .where(*self._held(owner, token), alert_cursors.c.last_event_id == expected)
            .values(last_event_id=to, updated_at=utc_now())
        )

    def _note_insert(self, note: AlertNote) -> Any:
        """The note as an event of its call, if the call is still in the ledger, with the
        digest of the call's content (read from its row, locked on PostgreSQL as a ledger
        event's INSERT locks it: ``LedgerStore._build_event``)."""
        key = note.key
        reason = storable_text(self.redactor.text(note.reason))
        detail = storable_text(self.redactor.text(note.detail))
        mac = None
        if self.trail_key is not None:
            mac = self.trail_key.mac(
                {
                    "session_id": key.session_id,
                    "turn_id": key.turn_id,
                    "call_id": key.call_id,
                    "actor": self.actor,
                    "kind": note.kind,
                    "to_status": None,
                    "reason": reason,
                    "detail": detail,
                },
                {},
            )
        values = select(
            tool_calls.c.session_id,
            tool_calls.c.turn_id,
            tool_calls.c.call_id,
            utc_now(),
            literal(self.actor),
            literal(note.kind),
            null(),
            null(),
            null(),
            literal(reason, StorableText),
            literal(detail, StorableText),
            content_sha256_sql(self.engine.dialect.name, tool_calls.c),
            literal(mac, String),
        ).where(
            tool_calls.c.session_id == key.session_id,
            tool_calls.c.turn_id == key.turn_id,
            tool_calls.c.call_id == key.call_id,
        )
        if self.engine.dialect.name == "postgresql":
            values = values.with_for_update(key_share=True)
        return tool_call_events.insert().from_select(EVENT_COLUMNS, values)

    @staticmethod
    def _subjects() -> Any:
        events, calls = tool_call_events.c, tool_calls.c
        return (
            select(
                *events,
                # What an alert may say of its call, and nothing more: arguments, results and
                # error details are not even read.
                calls.tool_name,
                calls.status,
                calls.effect_class,
                calls.idempotency_key,
                calls.attempt_count,
            )
            .select_from(
                tool_call_events.join(
                    tool_calls,
                    and_(
                        calls.session_id == events.session_id,
                        calls.turn_id == events.turn_id,
                        calls.call_id == events.call_id,
                    ),
                )
            )
            .order_by(events.id)
        )


def _subjects(rows: Any) -> list[AlertSubject]:
    subjects = []
    for row in rows:
        event = call_event(row)
        kind = alert_kind_of(event)
        if kind is None:  # the SQL filter and the triggers agree; this keeps the types honest
            continue
        subjects.append(
            AlertSubject(
                event=event,
                kind=kind,
                tool_name=row.tool_name,
                status=row.status,
                effect_class=row.effect_class,
                call_id=row.idempotency_key,
                attempts=int(row.attempt_count),
            )
        )
    return subjects


__all__ = ["AlertLease", "AlertNote", "AlertStore", "EventWindow", "trigger_clause"]
