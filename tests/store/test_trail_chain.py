"""The audit trail's hash chain as the databases write it, on a real SQLite file and a real
PostgreSQL database: every path that inserts an event (one-statement CTEs, batched array
statements, SQLite transactions, flags, operators' writes, alert deliveries) leaves each call
one intact chain, each event carrying the digest of its call's content right after its write
(and, with the trail's key, its keyed MAC); writers racing on one call never fork it nor chain
a stale digest; the SQL hashes exactly the texts ``domain.trail`` defines; migration 0008
chains a ledger written before it, and 0011 keeps it verifying, both ways.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Coroutine
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import MetaData, Table, literal, pool, select, text
from sqlalchemy import create_engine as create_sync_engine
from sqlalchemy.ext.asyncio import AsyncEngine

from tests.support.databases import NewDatabase, with_later_columns, without_later_columns
from toolledger.domain.keys import CallKey, arguments_fingerprint
from toolledger.domain.records import CallEvent
from toolledger.domain.redaction import Redactor
from toolledger.domain.results import FailureStage, failed, succeeded
from toolledger.domain.states import CallStatus, EffectClass
from toolledger.domain.trail import (
    CONTENT_FIELDS,
    FIELDS,
    FIELDS_V2,
    GENESIS_SHA256,
    TrailKey,
    TrailScope,
    check_trail,
    content_sha256,
    event_sha256,
    event_text,
)
from toolledger.store import migrate
from toolledger.store.alerts import AlertNote, AlertStore
from toolledger.store.chain import PG_TEXT_FUNCTION, PG_TEXT_FUNCTION_V2, SQLITE_FUNCTION, content_sha256_sql
from toolledger.store.engine import create_engine, sync_url, write_transaction
from toolledger.store.ledger import LedgerStore
from toolledger.store.rows import call_event
from toolledger.store.schema import metadata
from toolledger.store.trail import CallTrail, TrailStore

LEASE = 30.0


def new_key(session_id: str = "sess_trail") -> CallKey:
    return CallKey(session_id, f"turn_{uuid.uuid4().hex[:6]}", f"call_{uuid.uuid4().hex[:6]}")


async def record(store: LedgerStore, key: CallKey, *, lease: float = LEASE, arguments: Any = None) -> int:
    recorded = await store.record(
        key,
        tool_name="charge_card",
        arguments={"amount": 1} if arguments is None else arguments,
        effect_class=EffectClass.AT_MOST_ONCE,
        lease_seconds=lease,
        claim_id=f"claim-{key.call_id}",
    )
    assert recorded.claimed
    return recorded.call.lease_token


async def all_trails(engine: AsyncEngine, scope: TrailScope | None = None) -> list[CallTrail]:
    return [trail async for trail in TrailStore(engine).trails(scope or TrailScope(), batch=3)]


def assert_intact(trails: list[CallTrail]) -> None:
    assert trails
    for trail in trails:
        assert check_trail(trail.events, trail.status, trail.content) is None, trail.key
        ids = [event.id for event in trail.events]
        assert ids == sorted(set(ids)), "a call's events in id order are its chain's order"
        links = [event.prev_sha256 for event in trail.events]
        assert len(set(links)) == len(links), "no two events chain from the same one: no fork"


async def test_every_kind_of_write__leaves_each_call_one_intact_chain(engine: AsyncEngine) -> None:
    store = LedgerStore(engine, actor="worker-1")
    operator = LedgerStore(engine, actor="operator:ann", batching=False)
    session = f"sess_{uuid.uuid4().hex[:6]}"

    # Recorded and completed together (one statement or transaction each), then marked together.
    batch = [new_key(session) for _ in range(6)]
    tokens = await asyncio.gather(*(record(store, key) for key in batch))
    await asyncio.gather(
        *(
            store.complete(
                key, token, succeeded(key, "ok") if n % 2 else failed(key, "no", FailureStage.EXECUTION)
            )
            for n, (key, token) in enumerate(zip(batch, tokens, strict=True))
        )
    )
    await asyncio.gather(*(store.mark_submitted(key) for key in batch[:3]))
    assert await store.mark_submitted_many(batch[3:]) == set(batch[3:])
    await store.note_resubmission(batch[0])
    await store.record_submission_failure(batch[1], "502 Bad Gateway")
    assert await store.mark_confirmed(batch[2])
    assert await store.mark_confirmed_many(batch[3:]) == set(batch[3:])

    # Alone, without batching: a redelivery with other arguments, a flag, an abandonment.
    alone = new_key(session)
    token = await record(operator, alone)
    await operator.record(
        alone,
        tool_name="charge_card",
        arguments={"amount": 2},
        effect_class=EffectClass.AT_MOST_ONCE,
        lease_seconds=LEASE,
    )
    await operator.flag(alone, "note", "looked at by ann", detail="multi\nline é 😀")
    await operator.abandon(alone, "the session ended")
    assert token == 1

    # A lease that runs out: unknown, settled by an operator; another re-opened and run again.
    for lapsed in (new_key(session), new_key(session)):
        await record(store, lapsed, lease=0.01)
    lapsed_keys = [trail.key for trail in await all_trails(engine) if trail.status == "running"]
    await asyncio.sleep(0.05)
    assert {call.key for call in await store.expire_leases()} >= set(lapsed_keys)
    settled, reopened = sorted(lapsed_keys)
    assert await operator.settle(settled, succeeded(settled, "done by hand"), reason="checked") is not None
    assert await operator.reopen(reopened, reason="safe to run") is not None
    claimed = await store.claim(
        reopened, from_statuses=[CallStatus.PENDING], lease_seconds=LEASE, reason="re-run", claim_id="c2"
    )
    assert claimed is not None

    # A transactional tool's result, written in the caller's transaction.
    async with write_transaction(engine) as conn:
        await store.complete(reopened, claimed.lease_token, succeeded(reopened, "tx"), connection=conn)

    trails = await all_trails(engine, TrailScope(session_id=session))
    assert len(trails) == 9
    assert_intact(trails)
    assert all(event.content_sha256 is not None for trail in trails for event in trail.events)
    # 6 lives of 3 events, a resubmission, a failed submission, 4 confirmations; 4 for the
    # call alone; 2 expiries of 2, a settlement, a re-opening, its claim and its result.
    assert sum(len(trail.events) for trail in trails) == 18 + 1 + 1 + 4 + 4 + 4 + 4


TRAIL_KEY = TrailKey(b"test-trail-key-" + b"k" * 32)


async def held(engine: AsyncEngine, key: CallKey, events: int) -> None:
    """The call's trail verifies keyed, ``events`` long, its last event carrying the digest of
    the content as it is now: the write just made computed it from the row it changed."""
    (trail,) = await TrailStore(engine).trails_of([key])
    assert len(trail.events) == events, [e.kind for e in trail.events]
    assert trail.events[-1].content_sha256 == content_sha256(trail.content)
    assert trail.events[-1].trail_mac is not None
    assert check_trail(trail.events, trail.status, trail.content, key=TRAIL_KEY) is None


async def test_a_normal_life_of_every_kind__each_event_holds_the_content_after_its_write__keyed(
    engine: AsyncEngine,
) -> None:
    """Record (batched and alone), claim, complete (batched and alone), submit (alone and
    many), confirm (alone and many), a request, a flag, approval (amended), denial, expiry,
    settlement, re-opening, a redelivery with other arguments, a failed submission, a
    resubmission, an abandonment and an alert delivery: after each, the call's last event
    carries the digest of its content as it is, and every MAC matches."""
    store = LedgerStore(engine, actor="worker-1", trail_key=TRAIL_KEY)
    alone = LedgerStore(engine, actor="operator:ann", batching=False, trail_key=TRAIL_KEY)
    session = f"sess_{uuid.uuid4().hex[:6]}"

    batch = [new_key(session) for _ in range(4)]
    tokens = await asyncio.gather(*(record(store, key) for key in batch))
    for key in batch:
        await held(engine, key, 1)
    await asyncio.gather(
        *(
            store.complete(
                key, token, succeeded(key, "ok") if n else failed(key, "no", FailureStage.EXECUTION)
            )
            for n, (key, token) in enumerate(zip(batch, tokens, strict=True))
        )
    )
    for key in batch:
        await held(engine, key, 2)
    assert await store.record_request(batch[:2], "req_1", reason="to be sent together") is not None
    await store.mark_submitted(batch[0])
    assert await store.mark_submitted_many(batch[1:3]) == set(batch[1:3])
    await held(engine, batch[0], 4)
    await held(engine, batch[2], 3)
    await store.note_resubmission(batch[0])
    await store.record_submission_failure(batch[1], "502 Bad Gateway")
    assert await store.mark_confirmed(batch[2])
    assert await store.mark_confirmed_many(batch[:2]) == set(batch[:2])
    await held(engine, batch[0], 6)
    await held(engine, batch[1], 6)
    await held(engine, batch[2], 4)
    await store.flag(batch[3], "note", "looked at", detail="multi\nline é 😀")
    await store.abandon(batch[3], "the session ended")
    await held(engine, batch[3], 4)

    # A gated tool: approved with amended arguments, claimed and run; another denied.
    gated, denied = new_key(session), new_key(session)
    for key in (gated, denied):
        await alone.record_for_approval(
            key,
            tool_name="refund",
            arguments={"cents": 500},
            effect_class=EffectClass.AT_MOST_ONCE,
            approval_seconds=None,
        )
        await held(engine, key, 1)
    amended = '{"cents":50}'
    approved = await alone.approve(
        gated,
        arguments_sha256=arguments_fingerprint({"cents": 500}),
        decided_by="ann",
        reason="a smaller refund",
        amended_arguments=amended,
        amended_sha256=arguments_fingerprint(amended),
    )
    assert approved is not None
    await held(engine, gated, 2)
    claimed = await store.claim(
        gated, from_statuses=[CallStatus.PENDING], lease_seconds=LEASE, reason="approved"
    )
    assert claimed is not None
    await held(engine, gated, 3)
    await alone.complete(gated, claimed.lease_token, succeeded(gated, "refunded 50"))
    await held(engine, gated, 4)
    outcome = failed(denied, "Not approved: too much", FailureStage.APPROVAL)
    assert await alone.deny(denied, outcome, decided_by="bob", reason="too much") is not None
    await held(engine, denied, 2)

    # A redelivery with other arguments; a lease that runs out, settled; another re-opened.
    lapsed, reopened = new_key(session), new_key(session)
    await record(alone, lapsed, lease=0.01)
    await alone.record(
        lapsed,
        tool_name="charge_card",
        arguments={"amount": 2},
        effect_class=EffectClass.AT_MOST_ONCE,
        lease_seconds=1,
    )
    await held(engine, lapsed, 2)
    await record(alone, reopened, lease=0.01)
    await asyncio.sleep(0.05)
    assert {call.key for call in await alone.expire_leases()} >= {lapsed, reopened}
    await held(engine, lapsed, 3)
    assert await alone.settle(lapsed, succeeded(lapsed, "done by hand"), reason="checked") is not None
    await held(engine, lapsed, 4)
    assert await alone.reopen(reopened, reason="safe to run") is not None
    await held(engine, reopened, 3)

    # An alert delivered: a note in the call's timeline, written by the alert sender.
    alerts = AlertStore(
        engine, destination="webhook", actor="alerts:test", redactor=Redactor(), trail_key=TRAIL_KEY
    )
    await alerts.ensure_cursor()
    lease = await alerts.take_lease("replica-a", 30.0)
    assert lease is not None
    note = AlertNote(reopened, "alert_sent", "unknown alert delivered", "alert tla_x of event 1")
    assert await alerts.record("replica-a", lease.token, note)
    await held(engine, reopened, 4)

    trails = await all_trails(engine, TrailScope(session_id=session))
    assert len(trails) == 8
    assert_intact(trails)


async def test_writers_racing_on_one_call__chain_its_events_one_after_another(database_url: str) -> None:
    """Four engines (four connections at once) write events for the same call at the same
    moment: flags, notes, a failed submission, and its completion."""
    engines = [create_engine(database_url) for _ in range(4)]
    try:
        stores = [
            LedgerStore(engine, actor=f"worker-{n}", batching=False) for n, engine in enumerate(engines)
        ]
        key = new_key()
        token = await record(stores[0], key)
        writes: list[Coroutine[Any, Any, object]] = [
            stores[n % 4].flag(key, "note", f"look {n}") for n in range(24)
        ]
        writes += [stores[n % 4].record_submission_failure(key, f"refused {n}") for n in range(8)]
        writes.append(stores[1].complete(key, token, succeeded(key, "ok")))
        await asyncio.gather(*writes)
        await asyncio.gather(*(stores[n].mark_submitted(key) for n in range(4)))
        await asyncio.gather(*(stores[n % 4].note_resubmission(key) for n in range(8)))

        (trail,) = await all_trails(engines[0], TrailScope(key=key))
        assert len(trail.events) == 1 + 24 + 8 + 1 + 1 + 8
        assert_intact([trail])
        # Each event carries the content as it was after its own write: the one before the
        # result up to the completion, the one with it from there on (a flag that read the row
        # before the completion committed, but was chained after it, would carry the old one).
        digests = [event.content_sha256 for event in trail.events]
        completed = next(n for n, event in enumerate(trail.events) if event.to_status == "succeeded")
        assert len(set(digests[:completed])) == 1
        assert set(digests[completed:]) == {content_sha256(trail.content)} != set(digests[:completed])
    finally:
        for engine in engines:
            await engine.dispose()


# The values the text function must spell as domain.trail does: NULLs, empty text, newlines,
# characters beyond ASCII and beyond the BMP, a dash that is not a NULL, moment edge cases.
AWKWARD: list[dict[str, Any]] = [
    {
        "prev_sha256": GENESIS_SHA256,
        "session_id": "sess_1",
        "turn_id": "turn_1",
        "call_id": "call_1",
        "at": datetime(2026, 12, 7, 1, 2, 3, 4, tzinfo=UTC),
        "actor": "worker-1",
        "kind": "transition",
        "from_status": None,
        "to_status": "running",
        "lease_token": 1,
        "reason": "recorded and claimed",
        "detail": None,
    },
    {
        "prev_sha256": "f" * 64,
        "session_id": "sess é/ü",
        "turn_id": "",
        "call_id": "-",
        "at": datetime(2026, 1, 1, 0, 0, 0, 0, tzinfo=UTC),
        "actor": "operator:Zoë 😀",
        "kind": "note",
        "from_status": "submitted",
        "to_status": "submitted",
        "lease_token": 9_223_372_036_854_775_807,
        "reason": "line one\nline two\r\n\ttabbed\\u0000 escaped NUL",
        "detail": "ΣΑΣ ς İ \U0010fffd",
    },
    {
        "prev_sha256": "0" * 63 + "1",
        "session_id": "s",
        "turn_id": "t",
        "call_id": "c",
        "at": datetime(1999, 12, 31, 23, 59, 59, 999_999, tzinfo=UTC),
        "actor": "a",
        "kind": "k",
        "from_status": None,
        "to_status": None,
        "lease_token": None,
        "reason": None,
        "detail": "",
    },
]


async def test_the_database_spells_an_event_as_domain_trail_does__byte_for_byte(engine: AsyncEngine) -> None:
    async with engine.connect() as conn:
        if engine.dialect.name == "postgresql":
            # The session's zone must not matter: the trail spells moments in UTC.
            await conn.execute(text("SET TIME ZONE 'Asia/Kolkata'"))
            types = {"at": "timestamptz", "lease_token": "bigint"}
            arguments = ", ".join(f"CAST(:{name} AS {types.get(name, 'text')})" for name in FIELDS)
            for values in AWKWARD:
                spelled = (
                    await conn.execute(text(f"SELECT {PG_TEXT_FUNCTION}({arguments})"), values)
                ).scalar_one()
                assert spelled.encode("utf-8") == event_text(values).encode("utf-8")
                hashing = f"SELECT encode(sha256(convert_to({PG_TEXT_FUNCTION}({arguments}), 'UTF8')), 'hex')"
                hashed = (await conn.execute(text(hashing), values)).scalar_one()
                assert hashed == event_sha256(values)
        else:
            arguments = ", ".join(f":{name}" for name in FIELDS)
            for values in AWKWARD:
                # As SQLite holds a moment: UTC digits in SQLAlchemy's text form.
                stored = {**values, "at": values["at"].strftime("%Y-%m-%d %H:%M:%S.%f")}
                hashed = (
                    await conn.execute(text(f"SELECT {SQLITE_FUNCTION}({arguments})"), stored)
                ).scalar_one()
                assert hashed == event_sha256(values)


V2_EXTRAS: list[dict[str, Any]] = [
    {"content_sha256": "c" * 64, "trail_mac": None},
    {"content_sha256": None, "trail_mac": "request,outcome:" + "d" * 64},
    {"content_sha256": "-", "trail_mac": ""},
]
"""What a version 2 event adds, one per ``AWKWARD`` event."""

AWKWARD_CONTENT: list[dict[str, str | None]] = [
    {
        "tool_name": "charge_card",
        "effect_class": "at_most_once",
        "arguments": '{"amount":1}',
        "arguments_sha256": "a" * 64,
        "approved_arguments": None,
        "approved_arguments_sha256": None,
        "result": None,
        "error_stage": None,
        "error_detail": None,
    },
    {
        "tool_name": "-",
        "effect_class": "",
        "arguments": '{"note":"line one\nline two é 😀 \\u0000"}',
        "arguments_sha256": "b" * 64,
        "approved_arguments": "ΣΑΣ ς İ \U0010fffd",
        "approved_arguments_sha256": "",
        "result": '{"type":"tool_result","output":"tool_name 3:abc\n"}',
        "error_stage": "execution",
        "error_detail": "Traceback\r\n\tline",
    },
]


async def test_the_database_spells_a_v2_event_and_a_calls_content_as_domain_trail_does(
    engine: AsyncEngine,
) -> None:
    dialect = engine.dialect.name
    async with engine.connect() as conn:
        if dialect == "postgresql":
            await conn.execute(text("SET TIME ZONE 'Pacific/Chatham'"))
        for base, extra in zip(AWKWARD, V2_EXTRAS, strict=True):
            values = {**base, **extra}
            if dialect == "postgresql":
                types = {"at": "timestamptz", "lease_token": "bigint"}
                arguments = ", ".join(f"CAST(:{name} AS {types.get(name, 'text')})" for name in FIELDS_V2)
                spelled = (
                    await conn.execute(text(f"SELECT {PG_TEXT_FUNCTION_V2}({arguments})"), values)
                ).scalar_one()
                assert spelled.encode("utf-8") == event_text(values).encode("utf-8")
            else:
                arguments = ", ".join(f":{name}" for name in FIELDS_V2)
                stored = {**values, "at": values["at"].strftime("%Y-%m-%d %H:%M:%S.%f")}
                hashed = (
                    await conn.execute(text(f"SELECT {SQLITE_FUNCTION}({arguments})"), stored)
                ).scalar_one()
                assert hashed == event_sha256(values)
        for content in AWKWARD_CONTENT:
            row = select(*(literal(content[name]).label(name) for name in CONTENT_FIELDS)).subquery()
            digest = (await conn.execute(select(content_sha256_sql(dialect, row.c)))).scalar_one()
            assert digest == content_sha256(content)


async def test_stored_hashes__recomputed_from_the_rows_read_back__match(engine: AsyncEngine) -> None:
    """The same awkward text through the ledger's own writes, read back as the verifier reads it."""
    store = LedgerStore(engine, actor="operator:Zoë 😀", batching=False)
    key = CallKey("sess é/ü", "turn", "-")
    await record(store, key)
    for values in AWKWARD:
        await store.flag(key, "note", values["reason"] or "-", detail=values["detail"])

    (trail,) = await all_trails(engine, TrailScope(key=key))

    assert len(trail.events) == 1 + len(AWKWARD)
    assert_intact([trail])


async def test_trail_heads__the_last_event_of_each_call__absent_for_unknown_calls(
    engine: AsyncEngine,
) -> None:
    store = LedgerStore(engine, actor="worker-1", batching=False)
    keys = [new_key() for _ in range(3)]
    for key in keys:
        await record(store, key)
    await store.flag(keys[0], "note", "one more")

    heads = await TrailStore(engine).heads([*keys, new_key()])

    trails = {trail.key: trail for trail in await all_trails(engine)}
    assert set(heads) == set(keys)
    for key in keys:
        assert heads[key].events == len(trails[key].events)
        assert heads[key].sha256 == trails[key].events[-1].sha256
    assert heads[keys[0]].events == 2


# --------------------------------------------------------------------------- migration 0008


BEFORE_THE_TRAIL = "0007"
"""The revision before the trail's (0008): today's store writes every column it has, and the
later ones (``with_later_columns``)."""


async def write_lives_before_the_trail(url: str) -> list[CallKey]:
    """Calls written the way the release before 0008 wrote them (no hash columns yet)."""
    engine = create_engine(url)
    try:
        store = LedgerStore(engine, actor="old-release")
        keys = [new_key(f"sess_{n % 2}") for n in range(5)]
        tokens = await asyncio.gather(*(record(store, key) for key in keys))
        await asyncio.gather(
            *(
                store.complete(key, token, succeeded(key, "ok"))
                for key, token in zip(keys, tokens, strict=True)
            )
        )
        await asyncio.gather(*(store.mark_submitted(key) for key in keys[:3]))
        await store.flag(keys[4], "note", "written before the trail was chained\nin two lines")
        return keys
    finally:
        await engine.dispose()


async def test_upgrade_to_0008__chains_the_events_already_stored__and_new_ones_follow_on(
    new_database: NewDatabase,
) -> None:
    url = new_database()
    migrate.upgrade(url, BEFORE_THE_TRAIL)
    with_later_columns(url)
    keys = await write_lives_before_the_trail(url)
    without_later_columns(url)

    migrate.upgrade(url)

    engine = create_engine(url)
    try:
        trails = await all_trails(engine)
        assert {trail.key for trail in trails} == set(keys)
        assert_intact(trails)
        assert all(trail.events[0].prev_sha256 == GENESIS_SHA256 for trail in trails)
        store = LedgerStore(engine, actor="new-release")
        await store.flag(keys[0], "note", "after the upgrade")
        await store.mark_submitted(keys[4])
        assert_intact(await all_trails(engine))
    finally:
        await engine.dispose()

    migrate.downgrade(url, BEFORE_THE_TRAIL)
    sync = create_sync_engine(sync_url(url), poolclass=pool.NullPool)
    try:
        with sync.connect() as conn:
            columns = {
                row[1]
                for row in conn.execute(text("SELECT * FROM tool_call_events LIMIT 0")).cursor.description
            }
    finally:
        sync.dispose()
    assert not {"prev_sha256", "sha256"} & columns

    migrate.upgrade(url)
    engine = create_engine(url)
    try:
        assert_intact(await all_trails(engine))
    finally:
        await engine.dispose()


def trail_objects(url: str) -> dict[str, str]:
    """The trail's trigger and functions as the database describes them."""
    engine = create_sync_engine(sync_url(url), poolclass=pool.NullPool)
    try:
        with engine.connect() as conn:
            if engine.dialect.name == "postgresql":
                rows = conn.execute(
                    text(
                        "SELECT proname, pg_get_functiondef(oid) FROM pg_proc "
                        "WHERE proname LIKE 'toolledger%' "
                        "UNION ALL SELECT tgname, pg_get_triggerdef(oid) FROM pg_trigger "
                        "WHERE NOT tgisinternal"
                    )
                )
            else:
                rows = conn.execute(text("SELECT name, sql FROM sqlite_master WHERE type = 'trigger'"))
            return {name: " ".join(definition.split()) for name, definition in rows}
    finally:
        engine.dispose()


def test_migrations__build_the_same_trigger_and_functions_as_the_schema(new_database: NewDatabase) -> None:
    migrated, reference = new_database(), new_database()
    migrate.upgrade(migrated)
    engine = create_sync_engine(sync_url(reference), poolclass=pool.NullPool)
    try:
        metadata.create_all(engine)
    finally:
        engine.dispose()

    built = trail_objects(migrated)

    assert built == trail_objects(reference)
    assert "tool_call_events_trail" in built
    if "postgresql" in migrated:
        assert {"toolledger_chain_event", "toolledger_trail_text"} <= set(built)


# --------------------------------------------------------------------------- migration 0011


BEFORE_CONTENT = "0010"
"""The revision before content digests (0011)."""


def events_as_stored(url: str) -> dict[CallKey, tuple[str, list[CallEvent]]]:
    """Each call's status and events read by plain SQL, whatever columns the revision has."""
    engine = create_sync_engine(sync_url(url), poolclass=pool.NullPool)
    try:
        with engine.connect() as conn:
            statuses = {
                CallKey(*row[:3]): row[3]
                for row in conn.execute(text("SELECT session_id, turn_id, call_id, status FROM tool_calls"))
            }
            trails: dict[CallKey, tuple[str, list[CallEvent]]] = {key: (s, []) for key, s in statuses.items()}
            # Reflected: its columns as this revision has them, moments read back as moments.
            events = Table("tool_call_events", MetaData(), autoload_with=conn)
            for row in conn.execute(select(events).order_by(events.c.id)):
                trails[CallKey(row.session_id, row.turn_id, row.call_id)][1].append(call_event(row))
            return trails
    finally:
        engine.dispose()


async def test_upgrade_to_0011__old_events_keep_their_hashes__new_ones_hold_the_content__and_back(
    new_database: NewDatabase,
) -> None:
    url = new_database()
    migrate.upgrade(url, BEFORE_CONTENT)
    with_later_columns(url)
    keys = await write_lives_before_the_trail(url)
    without_later_columns(url)
    before = events_as_stored(url)

    migrate.upgrade(url)

    engine = create_engine(url)
    try:
        trails = await all_trails(engine)
        assert_intact(trails)
        assert all(event.content_sha256 is None for trail in trails for event in trail.events)
        assert {t.key: [e.sha256 for e in t.events] for t in trails} == {
            key: [e.sha256 for e in events] for key, (_, events) in before.items()
        }, "the events already stored keep their hashes"
        store = LedgerStore(engine, actor="new-release", trail_key=TRAIL_KEY)
        await store.flag(keys[0], "note", "after the upgrade")
        await store.mark_submitted(keys[4])
        trails = await all_trails(engine)
        assert_intact(trails)
        covered = {t.key for t in trails if t.events[-1].content_sha256 is not None}
        assert covered == {keys[0], keys[4]}
        async with engine.begin() as conn:
            await conn.execute(
                text("UPDATE tool_calls SET result = 'forged' WHERE call_id IN (:a, :b)"),
                {"a": keys[0].call_id, "b": keys[1].call_id},
            )
        found = {t.key: check_trail(t.events, t.status, t.content) for t in await all_trails(engine)}
        forged = found[keys[0]]
        assert forged is not None
        assert forged.kind.value == "content"
        assert found[keys[1]] is None, "an old call's content is held to nothing"
    finally:
        await engine.dispose()

    migrate.downgrade(url, BEFORE_CONTENT)

    after = events_as_stored(url)
    assert all(
        event.content_sha256 is None and event.trail_mac is None for _, es in after.values() for event in es
    )
    for status, events in after.values():
        assert check_trail(events, status) is None, "re-chained as version 1: the release before verifies it"
    assert [e.sha256 for e in after[keys[2]][1]] == [e.sha256 for e in before[keys[2]][1]], "untouched"
    reference = new_database()
    migrate.upgrade(reference, BEFORE_CONTENT)
    assert trail_objects(url) == trail_objects(reference), "0008's trigger and functions are back"

    migrate.upgrade(url)
    engine = create_engine(url)
    try:
        assert_intact(await all_trails(engine))
    finally:
        await engine.dispose()
