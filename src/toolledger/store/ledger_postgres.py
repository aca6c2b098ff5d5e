"""The ledger on PostgreSQL: each write and its audit event as ONE statement in autocommit.

A data-modifying CTE (``WITH changed AS (UPDATE ... RETURNING ...) INSERT INTO events SELECT
... FROM changed``) is one round trip and one commit instead of BEGIN, a read, the write, the
event and COMMIT: that is most of the ledger's cost per call (DESIGN.md, "Performance
facts"). Each statement is built once per shape (building a CTE costs more than running it)
and runs prepared on psycopg (``store.prepared``): SQLAlchemy's own execution of it cost as
much client CPU as PostgreSQL spent running it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

from sqlalchemy import (
    CTE,
    BigInteger,
    Select,
    String,
    Text,
    and_,
    bindparam,
    func,
    literal,
    null,
    select,
    true,
    tuple_,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.sql.elements import BindParameter, ColumnElement
from sqlalchemy.sql.visitors import replacement_traverse

from toolledger.domain.keys import CallKey
from toolledger.domain.records import CallRecord, Recorded
from toolledger.domain.states import COMPLETE, RECORD, SUBMIT, CallStatus, Transition
from toolledger.errors import TransitionError
from toolledger.store.chain import content_sha256_sql
from toolledger.store.engine import autocommit, is_transient, utc_now
from toolledger.store.ledger import (
    RECORDED_REASON,
    Completion,
    LedgerStore,
    NewCall,
    completed_reason,
    log,
    open_calls_of,
)
from toolledger.store.prepared import PreparedStatement
from toolledger.store.rows import call_record
from toolledger.store.schema import StorableText, storable_text, tool_call_events, tool_calls
from toolledger.store.transitions import (
    CONFIRM,
    EVENT_COLUMNS,
    KEY_COLUMNS,
    KEY_MATCH,
    Note,
    changes,
    content_written,
    fenced,
    key_params,
    record_insert,
)


class PostgresLedger(LedgerStore):
    # PostgreSQL commits several transactions at a time and groups their WAL flushes itself:
    # one batch in flight would queue what it could run side by side.
    _parallel_writes = 4

    @property
    def _autocommit(self) -> AsyncEngine:
        return autocommit(self.engine)

    async def mark_confirmed_many(self, keys: Sequence[CallKey]) -> set[CallKey]:
        if not keys:
            return set()
        statement = self._prepared(("mark_confirmed_many",), self._build_confirm_many)
        reason = "left required_actions"
        macs = [self._mac(key, CONFIRM.event, CONFIRM.status, reason) for key in keys]
        params = {**_key_arrays(keys), **self._event_params(reason), "a_e_trail_mac": macs}
        async with self._autocommit.connect() as conn:
            rows = await statement.rows(conn, params)
        return {_key(row) for row in rows}

    async def open_calls(self, session_id: str) -> list[CallRecord]:
        # Read at every reconcile and turn end: prepared, and in autocommit (no BEGIN, and no
        # ROLLBACK when the connection goes back to the pool).
        statement = self._prepared(("open_calls",), self._build_open_calls)
        async with self._autocommit.connect() as conn:
            rows = await statement.rows(conn, {"p_session_id": session_id})
        return [call_record(row) for row in rows]

    async def _submitted_many(self, keys: Sequence[CallKey], reason: str) -> dict[CallKey, CallRecord]:
        if not keys:
            return {}
        statement = self._prepared(("mark_submitted_many",), lambda: self._build_change_many(SUBMIT))
        macs = [self._mac(key, SUBMIT.event, SUBMIT.target, reason) for key in keys]
        params = {**_key_arrays(keys), **self._event_params(reason), "a_e_trail_mac": macs}
        async with self._autocommit.connect() as conn:
            rows = await statement.rows(conn, params)
        return {call.key: call for call in map(call_record, rows)}

    def _writing(self, *, durable: bool = True) -> AbstractAsyncContextManager[AsyncConnection]:
        # Durability is the statement's own business here (``_with_event``): in autocommit it
        # sets synchronous_commit for its own transaction.
        return self._autocommit.connect()

    def _transaction(self, *, durable: bool = True) -> AbstractAsyncContextManager[AsyncConnection]:
        return self.engine.begin()

    async def _record_new(self, new: NewCall) -> Recorded:
        statement = self._prepared((RECORD.name,), self._build_record)
        values = {
            **new.params,
            **self._event_params(RECORDED_REASON, new.detail),
            "e_trail_mac": self._record_mac(new),
        }
        async with self._autocommit.connect() as conn:
            rows = await statement.rows(conn, values)
        if rows:
            return Recorded(call=call_record(rows[0]), claimed=True)
        async with self.engine.begin() as conn:
            return await self._already_recorded(conn, new.key, new.fingerprint)

    async def _record_batch(self, news: Sequence[NewCall]) -> Sequence[Recorded | BaseException]:
        """The calls delivered together, recorded and claimed by ONE statement (each with its
        claim event); those recorded before are then read, as for one call."""
        if len(news) == 1:
            return [await self._record_new(news[0])]
        first: dict[CallKey, NewCall] = {}
        for new in news:
            first.setdefault(new.key, new)
        statement = self._prepared(("record_many",), self._build_record_many)
        values = {
            **{f"a_{name}": [self._row_value(name, new) for new in first.values()] for name in _RECORD_ROW},
            "p_lease_seconds": next(iter(first.values())).params["p_lease_seconds"],
            "p_owner": self.owner,
            **self._event_params(RECORDED_REASON),
        }
        calls = await self._rows_together(statement, values, "recording", len(news))
        if calls is None:
            return [await _outcome_of(self._record_new(new)) for new in news]
        claimed = {call.key: call for call in calls}
        recorded: list[Recorded | BaseException] = []
        for new in news:
            if new.key in claimed and first[new.key] is new:
                recorded.append(Recorded(call=claimed[new.key], claimed=True))
                continue
            try:
                async with self.engine.begin() as conn:
                    recorded.append(await self._already_recorded(conn, new.key, new.fingerprint))
            except TransitionError as error:
                recorded.append(error)
        return recorded

    async def _completions_batch(
        self, completions: Sequence[Completion]
    ) -> Sequence[CallRecord | BaseException]:
        """Outcomes ready together, stored by ONE statement, each fenced by its own token; one
        its token no longer holds (or whose lease ran out meanwhile) is then tried alone, as
        ``_complete`` does for one call. A call's second outcome in the batch goes alone too:
        the statement changes a row once, with one event."""
        if len(completions) == 1:
            return [await self._alone(completions[0], self._complete)]
        # Sent in the order of their keys, as ``_together`` writes a transaction's rows.
        first: dict[CallKey, int] = {}
        for index in sorted(range(len(completions)), key=lambda i: completions[i].key):
            first.setdefault(completions[index].key, index)
        per_call = [self._completion_row(completions[index]) for index in first.values()]
        statement = self._prepared(("complete_many",), self._build_complete_many)
        values = {
            **{f"a_{name}": [row[name] for row in per_call] for name in _COMPLETE_ROW},
            "e_actor": self.actor,
        }
        calls = await self._rows_together(statement, values, "storing the outcomes of", len(completions))
        if calls is None:
            return [await self._alone(c, self._complete) for c in completions]
        stored = {call.key: call for call in calls}
        results: list[CallRecord | BaseException] = []
        for index, completion in enumerate(completions):
            call = stored.get(completion.key)
            if call is not None and first[completion.key] == index and call.lease_token == completion.token:
                results.append(call)
            else:
                results.append(await self._alone(completion, self._complete))
        return results

    async def _rows_together(
        self, statement: PreparedStatement, values: dict[str, Any], doing: str, count: int
    ) -> list[CallRecord] | None:
        """``statement`` for ``count`` calls at once, in autocommit: the calls it wrote; None
        when it failed for another reason than the database being away (the caller then
        writes them one by one, so that a bad call fails alone)."""
        try:
            async with self._autocommit.connect() as conn:
                rows = await statement.rows(conn, values)
        except Exception as error:
            if is_transient(error):
                raise  # each caller's retry decides (an ambiguous commit is theirs to resolve)
            log.warning("%s %d calls together failed (%s): one by one", doing, count, error)
            return None
        return [call_record(row) for row in rows]

    def _completion_row(self, completion: Completion) -> dict[str, Any]:
        """A ``complete_many`` row: the one-call statement's parameters for ``completion``."""
        key, token, outcome = completion
        transition = COMPLETE.of(outcome.success)
        row: dict[str, Any] = {
            **key_params(key),
            **self._outcome_params(outcome),
            "p_token": token,
            "p_status": transition.target.value,
            "e_reason": self._audit_text(completed_reason(outcome)),
        }
        written = content_written(transition, row)
        reason = completed_reason(outcome)
        row["e_trail_mac"] = self._mac(key, transition.event, transition.target, reason, None, written)
        # An array's elements skip the column types' bind processing: StorableText's rule here.
        for name in ("p_result", "p_error_detail", "e_reason"):
            if row[name] is not None:
                row[name] = storable_text(row[name])
        return row

    def _record_mac(self, new: NewCall) -> str | None:
        written = content_written(RECORD, new.params)
        return self._mac(new.key, RECORD.event, RECORD.target, RECORDED_REASON, new.detail, written)

    def _row_value(self, name: str, new: NewCall) -> str | None:
        if name == "e_detail":
            # Redacted as every audit line is (``_event_params``): its MAC is over what is stored.
            return None if new.detail is None else storable_text(self._audit_text(new.detail))
        if name == "e_trail_mac":
            return self._record_mac(new)
        value = new.params[name]
        # An array's elements skip the column type's bind processing: StorableText's rule here.
        return storable_text(value) if name == "p_arguments" else value

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
        allowed = tuple(sorted(s.value for s in sources))
        statement = self._prepared(
            (transition.name, transition.target, allowed), lambda: self._build_change(transition, allowed)
        )
        values = {
            **params,
            **key_params(key),
            **self._event_params(reason, detail),
            "e_trail_mac": self._mac(
                key, transition.event, transition.target, reason, detail, content_written(transition, params)
            ),
        }
        rows = await statement.rows(conn, values)
        return call_record(rows[0]) if rows else None

    async def _note(
        self, note: Note, key: CallKey, params: dict[str, Any], reason: str
    ) -> Mapping[str, Any] | None:
        statement = self._prepared(
            (note.name,),
            lambda: self._with_event(
                note.update(KEY_MATCH).cte("changed"), note.event, note.status, note.status, with_token=False
            ),
        )
        async with self._autocommit.connect() as conn:
            values = {
                **params,
                **key_params(key),
                **self._event_params(reason),
                "e_trail_mac": self._mac(key, note.event, note.status, reason),
            }
            rows = await statement.rows(conn, values)
            return rows[0] if rows else None

    def _prepared(self, shape: Hashable, build: Callable[[], Select[Any]]) -> PreparedStatement:
        return self._statement(shape, lambda: PreparedStatement(build(), self.engine.dialect))  # type: ignore[no-any-return]

    # -------------------------------------------------------------- statements

    def _build_open_calls(self) -> Select[Any]:
        return open_calls_of(bindparam("p_session_id", type_=Text))

    def _build_record(self) -> Select[Any]:
        return self._with_event(
            record_insert(postgresql.insert).cte("recorded"), RECORD.event, None, RECORD.target
        )

    def _build_record_many(self) -> Select[Any]:
        """``RECORD`` for the calls in the array parameters ``a_<name>`` (one element per
        call, ``_RECORD_ROW``), each with its event: the one-call statement's declaration
        (``record_insert``), its per-call parameters read from the arrays instead."""
        delivered = select(
            *(func.unnest(bindparam(f"a_{name}", type_=ARRAY(Text))).label(name) for name in _RECORD_ROW)
        ).cte("delivered")
        per_call = {name: delivered.c[name] for name in _RECORD_ROW}
        columns = {
            "session_id": bindparam("k_session_id"),
            "turn_id": bindparam("k_turn_id"),
            "call_id": bindparam("k_call_id"),
            **changes(RECORD),
        }
        recorded = (
            postgresql.insert(tool_calls)
            .from_select(list(columns), select(*(_read_from(value, per_call) for value in columns.values())))
            .on_conflict_do_nothing()
            .returning(tool_calls)
            .cte("recorded")
        )
        events = select(
            recorded.c.session_id,
            recorded.c.turn_id,
            recorded.c.call_id,
            utc_now(),
            bindparam("e_actor", type_=String),
            literal(RECORD.event, String),
            null(),
            literal(RECORD.target.value, String),
            recorded.c.lease_token,
            bindparam("e_reason", type_=StorableText),
            delivered.c.e_detail,
            content_sha256_sql("postgresql", recorded.c),
            delivered.c.e_trail_mac,
        ).join_from(
            recorded,
            delivered,
            and_(
                recorded.c.session_id == delivered.c.k_session_id,
                recorded.c.turn_id == delivered.c.k_turn_id,
                recorded.c.call_id == delivered.c.k_call_id,
            ),
        )
        logged = tool_call_events.insert().from_select(EVENT_COLUMNS, events).cte("logged")
        return select(recorded).add_cte(logged)

    def _build_complete_many(self) -> Select[Any]:
        """``COMPLETE`` for the outcomes in the array parameters ``a_<name>`` (one element per
        call, ``_COMPLETE_ROW``): each call's target, result and token read from its row of
        the arrays instead of the one-call statement's parameters, each with its event."""
        given = select(
            *(
                func.unnest(
                    bindparam(f"a_{name}", type_=ARRAY(BigInteger if name == "p_token" else Text))
                ).label(name)
                for name in _COMPLETE_ROW
            )
        ).cte("given")
        row_of = {name: given.c[name] for name in _COMPLETE_ROW}
        source = CallStatus.RUNNING.value
        (succeeded, failed) = COMPLETE
        assert succeeded.sources == failed.sources == frozenset({CallStatus.RUNNING})
        columns = {**changes(succeeded), "status": given.c.p_status}
        changed = (
            tool_calls.update()
            .where(
                tool_calls.c.session_id == given.c.k_session_id,
                tool_calls.c.turn_id == given.c.k_turn_id,
                tool_calls.c.call_id == given.c.k_call_id,
                tool_calls.c.status == source,
                *(_read_from(clause, row_of) for clause in fenced(succeeded)),
            )
            .values({name: _read_from(value, row_of) for name, value in columns.items()})
            .returning(tool_calls)
            .cte("changed")
        )
        events = select(
            changed.c.session_id,
            changed.c.turn_id,
            changed.c.call_id,
            utc_now(),
            bindparam("e_actor", type_=String),
            literal(succeeded.event, String),
            literal(source, String),
            changed.c.status,
            changed.c.lease_token,
            given.c.e_reason,
            null(),
            content_sha256_sql("postgresql", changed.c),
            given.c.e_trail_mac,
        ).join_from(
            changed,
            given,
            and_(
                changed.c.session_id == given.c.k_session_id,
                changed.c.turn_id == given.c.k_turn_id,
                changed.c.call_id == given.c.k_call_id,
                changed.c.lease_token == given.c.p_token,
            ),
        )
        logged = tool_call_events.insert().from_select(EVENT_COLUMNS, events).cte("logged")
        return select(changed).add_cte(logged)

    def _build_change(self, transition: Transition, allowed: tuple[str, ...]) -> Select[Any]:
        if len(allowed) == 1:
            # One source: the event names it; the compare-and-set alone decides.
            (source,) = allowed
            changed = (
                tool_calls.update()
                .where(KEY_MATCH, tool_calls.c.status == source, *fenced(transition))
                .values(**changes(transition))
                .returning(tool_calls)
                .cte("changed")
            )
            return self._with_event(
                changed, transition.event, CallStatus(source), transition.target, durable=transition.durable
            )
        # Locked first, so the event names the state the row really left (a concurrent
        # writer's commit is waited for and re-read, as the UPDATE itself would).
        locked = (
            select(tool_calls.c.status.label("from_status"))
            .where(KEY_MATCH)
            .with_for_update()
            .cte("current_state")
        )
        changed = (
            tool_calls.update()
            .where(
                KEY_MATCH,
                tool_calls.c.status == locked.c.from_status,
                locked.c.from_status.in_(allowed),
                *fenced(transition),
            )
            .values(**changes(transition))
            .returning(*tool_calls.c, locked.c.from_status)
            .cte("changed")
        )
        return self._with_event(
            changed, transition.event, changed.c.from_status, transition.target, durable=transition.durable
        )

    def _build_change_many(self, transition: Transition) -> Select[Any]:
        """``transition`` on every call of ``p_keys`` that is in one of its sources, each with
        its event naming the state it left (locked first, as for one call)."""
        allowed = sorted(s.value for s in transition.sources)
        locked = (
            select(*KEY_COLUMNS, tool_calls.c.status.label("from_status"))
            .where(
                _KEY_IN_ARRAYS,
                tool_calls.c.status.in_(allowed),
            )
            .with_for_update()
            .cte("current_state")
        )
        changed = (
            tool_calls.update()
            .where(
                tool_calls.c.session_id == locked.c.session_id,
                tool_calls.c.turn_id == locked.c.turn_id,
                tool_calls.c.call_id == locked.c.call_id,
                tool_calls.c.status == locked.c.from_status,
                *fenced(transition),
            )
            .values(**changes(transition))
            .returning(*tool_calls.c, locked.c.from_status)
            .cte("changed")
        )
        return self._with_event(
            changed,
            transition.event,
            changed.c.from_status,
            transition.target,
            durable=transition.durable,
            macs_in_arrays=True,
        )

    def _build_confirm_many(self) -> Select[Any]:
        confirmed = CONFIRM.update(_KEY_IN_ARRAYS)
        return self._with_event(
            confirmed.cte("changed"),
            CONFIRM.event,
            CONFIRM.status,
            CONFIRM.status,
            with_token=False,
            macs_in_arrays=True,
        )

    def _with_event(
        self,
        changed: CTE,
        kind: str,
        from_status: ColumnElement[Any] | CallStatus | None,
        to_status: CallStatus | None,
        *,
        with_token: bool = True,
        durable: bool = True,
        macs_in_arrays: bool = False,
    ) -> Select[Any]:
        """The rows ``changed`` returns, each with its audit event inserted by the same statement
        (actor, reason and detail are the parameters ``e_actor``, ``e_reason`` and ``e_detail``)
        and the digest of the call's content as ``changed`` returns it (the trigger would read
        the row as it was before the statement). The event's keyed MAC is the parameter
        ``e_trail_mac``, or with ``macs_in_arrays`` the element of ``a_e_trail_mac`` at the
        call's place in the key arrays (``_key_arrays``).
        ``durable=False``: the statement's own transaction commits without waiting for the WAL
        flush (``Transition.durable``); set by the statement itself, as it runs in autocommit."""
        mac: ColumnElement[Any] = bindparam("e_trail_mac", type_=String)
        if macs_in_arrays:
            macs = select(
                *(
                    func.unnest(bindparam(f"a_{name}", type_=ARRAY(Text))).label(name)
                    for name in ("k_session_id", "k_turn_id", "k_call_id", "e_trail_mac")
                )
            ).cte("macs")
            mac = (
                select(macs.c.e_trail_mac)
                .where(
                    macs.c.k_session_id == changed.c.session_id,
                    macs.c.k_turn_id == changed.c.turn_id,
                    macs.c.k_call_id == changed.c.call_id,
                )
                .limit(1)
                .scalar_subquery()
            )
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
            content_sha256_sql("postgresql", changed.c),
            mac,
        )
        logged = tool_call_events.insert().from_select(EVENT_COLUMNS, rows).cte("logged")
        if durable:
            return select(changed).add_cte(logged)
        # Transaction-local (is_local): it lasts until this statement's commit, which it governs.
        relaxed = select(
            func.set_config("synchronous_commit", "off", true()).label("synchronous_commit")
        ).cte("relaxed")
        return select(changed).add_cte(logged).join_from(changed, relaxed, true())


async def _outcome_of(write: Awaitable[Recorded]) -> Recorded | BaseException:
    try:
        return await write
    except Exception as error:  # this call's own, handed to its caller
        return error


def _read_from(expression: Any, row: Mapping[str, ColumnElement[Any]]) -> ColumnElement[Any]:
    """``expression`` (a one-call statement's value or condition) with each bind parameter
    named in ``row`` replaced by that column: the per-call value read from a row of arrays."""
    clause: ColumnElement[Any] = expression if isinstance(expression, ColumnElement) else literal(expression)

    def replace(element: Any, **_options: Any) -> Any:
        return row.get(element.key) if isinstance(element, BindParameter) else None

    return replacement_traverse(clause, {}, replace)  # type: ignore[no-any-return]


_COMPLETE_ROW = (
    "k_session_id",
    "k_turn_id",
    "k_call_id",
    "p_token",
    "p_status",
    "p_result",
    "p_error_stage",
    "p_error_detail",
    "e_reason",
    "e_trail_mac",
)
"""What differs between the outcomes of one ``complete_many``: an array each."""


_RECORD_ROW = (
    "k_session_id",
    "k_turn_id",
    "k_call_id",
    "p_tool_name",
    "p_arguments",
    "p_sha256",
    "p_effect_class",
    "p_idempotency_key",
    "e_detail",
    "e_trail_mac",
)
"""What differs between the calls of one ``record_many``: a text array each."""


_KEY_IN_ARRAYS = tuple_(*KEY_COLUMNS).in_(
    select(
        *(
            func.unnest(bindparam(f"a_{name}", type_=ARRAY(Text)))
            for name in ("k_session_id", "k_turn_id", "k_call_id")
        )
    )
)
"""The calls whose keys are the elements of the array parameters ``a_k_session_id``,
``a_k_turn_id`` and ``a_k_call_id`` (one fixed text for any number of calls: preparable)."""


def _key_arrays(keys: Sequence[CallKey]) -> dict[str, list[str]]:
    return {
        "a_k_session_id": [k.session_id for k in keys],
        "a_k_turn_id": [k.turn_id for k in keys],
        "a_k_call_id": [k.call_id for k in keys],
    }


def _key(row: Mapping[str, Any]) -> CallKey:
    return CallKey(row["session_id"], row["turn_id"], row["call_id"])


def _status_sql(status: ColumnElement[Any] | CallStatus | None) -> ColumnElement[Any]:
    if status is None:
        return null()
    if isinstance(status, CallStatus):
        return literal(status.value, String)
    return status


__all__ = ["PostgresLedger"]
