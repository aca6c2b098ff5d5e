"""Audit query speed at a million calls: seed a PostgreSQL ledger, time the audit queries, explain them.

    .venv/bin/python -m benchmarks.audit [--calls 1000000] [--database-url URL] [--json out.json] [--quick]

The database named by ``--database-url`` (its name must contain "bench") is dropped, created
again, migrated to head, and filled with set-based SQL (``INSERT ... SELECT FROM
generate_series``): ~50 calls per session in 5 turns, 30 tools with a Zipf skew, nearly every
call ``submitted`` with a few per thousand ``unknown``/``failed``/``abandoned``, created over 90
days, ~4 audit events per call. Then every list, filter, search, sort, show and paging query
of the audit views is timed through ``AuditService`` (what the CLI and the HTTP API call: the
store, then masked views) and through ``AuditStore`` alone, and ``EXPLAIN (ANALYZE, BUFFERS)``
is run on exactly the statements the store sent, so a reader sees index scans or seq scans.

Last, the write path: ``LedgerStore.record`` (and a call's whole life) timed without and with
the audit indexes, on new ledgers and on the seeded one, to show what they cost every write.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from psycopg import sql
from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine

from toolledger.audit.service import AuditService
from toolledger.domain.keys import CallKey
from toolledger.domain.queries import CallQuery, CallReference, SortKey
from toolledger.domain.results import succeeded
from toolledger.domain.states import CallStatus, EffectClass
from toolledger.runtime.composition import Runtime
from toolledger.settings import Settings
from toolledger.store import migrate
from toolledger.store.audit import AuditStore
from toolledger.store.engine import create_engine
from toolledger.store.ledger import LedgerStore

DEFAULT_DATABASE_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/toolledger_bench"
AUDIT_INDEXES_REVISION = "0003"
"""The migration that adds the audit indexes; the write-path comparison runs just before and at it."""
BEFORE_AUDIT_INDEXES = "0002"

FULL_CALLS = 1_000_000
QUICK_CALLS = 20_000
CALLS_PER_SESSION = 50
TURNS_PER_SESSION = 5
SPAN_DAYS = 90
SEED_CHUNK = 200_000
DEEP_PAGES = 20
PRUNE_AGE = timedelta(days=30)
PLAN_LINES = 14
LEDGER_TABLES = ("tool_calls", "tool_call_events")

# Thirty tools, most used first; each has one effect class, as a registry declares it.
TOOLS: tuple[tuple[str, EffectClass], ...] = (
    ("lookup_order", EffectClass.READ_ONLY),
    ("charge_card", EffectClass.AT_MOST_ONCE),
    ("send_receipt", EffectClass.IDEMPOTENT),
    ("search_catalog", EffectClass.READ_ONLY),
    ("get_customer", EffectClass.READ_ONLY),
    ("update_address", EffectClass.TRANSACTIONAL),
    ("create_ticket", EffectClass.IDEMPOTENT),
    ("send_email", EffectClass.IDEMPOTENT),
    ("check_inventory", EffectClass.READ_ONLY),
    ("reserve_stock", EffectClass.VERIFIED),
    ("ship_order", EffectClass.VERIFIED),
    ("track_shipment", EffectClass.READ_ONLY),
    ("refund_payment", EffectClass.AT_MOST_ONCE),
    ("apply_coupon", EffectClass.TRANSACTIONAL),
    ("issue_invoice", EffectClass.IDEMPOTENT),
    ("send_sms", EffectClass.AT_MOST_ONCE),
    ("book_meeting", EffectClass.VERIFIED),
    ("verify_identity", EffectClass.READ_ONLY),
    ("reset_password", EffectClass.AT_MOST_ONCE),
    ("cancel_subscription", EffectClass.VERIFIED),
    ("translate_text", EffectClass.READ_ONLY),
    ("summarize_document", EffectClass.READ_ONLY),
    ("query_warehouse", EffectClass.READ_ONLY),
    ("write_record", EffectClass.TRANSACTIONAL),
    ("schedule_callback", EffectClass.IDEMPOTENT),
    ("escalate_case", EffectClass.IDEMPOTENT),
    ("close_ticket", EffectClass.TRANSACTIONAL),
    ("export_report", EffectClass.IDEMPOTENT),
    ("notify_slack", EffectClass.IDEMPOTENT),
    ("wire_transfer", EffectClass.AT_MOST_ONCE),
)
ZIPF_EXPONENT = 1.0
"""With 30 tools: the most used takes ~25% of calls, the least used ~0.8%."""

STATUS_SHARES: tuple[tuple[CallStatus, float], ...] = (
    (CallStatus.PENDING, 0.0001),
    (CallStatus.RUNNING, 0.0002),
    (CallStatus.SUCCEEDED, 0.0005),
    (CallStatus.FAILED, 0.001),
    (CallStatus.UNKNOWN, 0.003),
    (CallStatus.ABANDONED, 0.002),
)
"""The rest is ``submitted``: at a million calls, 3,000 unknown, 2,000 abandoned, 1,000 failed."""
FAILURE_SHARE = 0.05
"""Of finished calls, this many told the model of a failure (a ToolError or a crash)."""
CRASH_SHARE = 0.01
"""Of finished calls, this many crashed (a redacted traceback kept in error_detail)."""

QUERY_NAMES = (
    "list: first page (-created, 50)",
    f"list: page {DEEP_PAGES + 1} via cursor",
    "filter: session",
    "filter: tool",
    "filter: status=unknown",
    "filter: status=abandoned",
    "filter: effect class=verified",
    "filter: one day (since/until)",
    "filter: tool + status=unknown",
    "search: call id substring (1 call)",
    "search: rare hex term",
    "search: rare tool term",
    "search: common term",
    "sort: tool (first page)",
    "sort: -status (first page)",
    "show: SESSION/TURN/CALL",
    "show: tl_ prefix",
    "show: bare call id",
    "count: status=unknown",
    "count: tool",
    "prune --dry-run (older than 30 days)",
    "sessions: list (100)",
)
"""Every figure the benchmark prints, in order (its test checks each one is there)."""


# ------------------------------------------------------------------------------------ databases


def libpq_url(url: str, database: str | None = None) -> str:
    parsed = make_url(url)
    if database is not None:
        parsed = parsed.set(database=database)
    return parsed.set(drivername="postgresql").render_as_string(hide_password=False)


def with_database(url: str, database: str) -> str:
    return make_url(url).set(database=database).render_as_string(hide_password=False)


def bench_database_name(url: str) -> str:
    """The database this run drops and creates: its name must say it is a benchmark's."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "postgresql":
        raise SystemExit("benchmarks.audit: --database-url must be a PostgreSQL URL")
    name = parsed.database or ""
    # The database is dropped first: refuse any name that could be someone's real ledger.
    if "bench" not in name:
        raise SystemExit(f"benchmarks.audit: refusing to drop {name!r}: its name must contain 'bench'")
    return name


def recreate_database(url: str) -> None:
    name = bench_database_name(url)
    with psycopg.connect(libpq_url(url, "postgres"), autocommit=True) as admin:
        admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))


def drop_database(url: str) -> None:
    name = bench_database_name(url)
    with psycopg.connect(libpq_url(url, "postgres"), autocommit=True) as admin:
        admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def connect(url: str) -> psycopg.Connection[tuple[Any, ...]]:
    return psycopg.connect(libpq_url(url), autocommit=True)


# ------------------------------------------------------------------------------------ seeding


@dataclass(frozen=True)
class SeedReport:
    calls: int
    events: int
    sessions: int
    insert_seconds: float
    index_seconds: float
    vacuum_seconds: float

    @property
    def total_seconds(self) -> float:
        return self.insert_seconds + self.index_seconds + self.vacuum_seconds


def tool_thresholds() -> list[float]:
    """Upper bounds of each tool's share of [0, 1), for ``width_bucket``: Zipf-skewed."""
    weights = [1 / (rank + 1) ** ZIPF_EXPONENT for rank in range(len(TOOLS))]
    total = sum(weights)
    bounds, running = [], 0.0
    for weight in weights[:-1]:
        running += weight / total
        bounds.append(running)
    return bounds


def status_case() -> str:
    """A CASE over ``r_status`` giving each status its share (bounds are literals we wrote)."""
    branches, bound = [], 0.0
    for status, share in STATUS_SHARES:
        bound += share
        branches.append(f"WHEN r_status < {bound!r} THEN '{status.value}'")
    return f"CASE {' '.join(branches)} ELSE 'submitted' END"


# One statement per chunk: draw, derive ids and times, insert the calls, and their audit trail
# from what was inserted (a data-modifying CTE), so both tables are filled in one pass. Rows
# come out in ``i`` order, which is creation order, and each call's events in step order: event
# ids then follow time as the ledger's own would.
SEED_CALLS_SQL = """
WITH drawn AS (
    SELECT i,
           i / %(per_session)s::int AS session_no,
           (i %% %(per_session)s::int) / %(per_turn)s::int AS turn_no,
           i %% %(per_session)s::int AS position,
           random() AS r_tool, random() AS r_status, random() AS r_outcome, random() AS r_time
    FROM generate_series(%(first)s::int, %(last)s::int) AS i
), shaped AS (
    SELECT i, session_no, r_time,
           'sess_' || left(md5('session ' || session_no), 24) AS session_id,
           'turn_' || left(md5('turn ' || session_no || ' ' || turn_no), 24) AS turn_id,
           'call_' || left(md5('call ' || i), 24) AS call_id,
           width_bucket(r_tool, %(tool_bounds)s::float8[]) + 1 AS tool_no,
           {status_case} AS status,
           r_outcome >= %(failure_above)s AS told_failure,
           r_outcome >= %(crash_above)s AS crashed,
           %(anchor)s::timestamptz - make_interval(days => %(span_days)s)
             + make_interval(secs => session_no * %(session_gap)s + position * 2 + r_time) AS created_at,
           'replica-' || (session_no %% 3) AS owner
    FROM drawn
), timed AS (
    SELECT s.*,
           (%(tools)s::text[])[tool_no] AS tool_name,
           (%(effects)s::text[])[tool_no] AS effect_class,
           CASE WHEN status <> 'pending' THEN created_at + interval '5 milliseconds' END AS started_at,
           CASE
             WHEN status IN ('succeeded', 'failed', 'submitted')
               OR (status = 'abandoned' AND NOT told_failure)
             THEN created_at + make_interval(secs => 0.05 + r_time * 2)
           END AS finished_at,
           CASE status WHEN 'succeeded' THEN true WHEN 'failed' THEN false ELSE NOT told_failure END
             AS success,
           json_build_object('cents', i %% 100000, 'order_id', 'A' || i)::text AS arguments
    FROM shaped s
), finished AS (
    SELECT t.*,
           CASE WHEN status = 'submitted' THEN finished_at + interval '30 milliseconds' END AS submitted_at
    FROM timed t
), inserted AS (
    INSERT INTO tool_calls (
        session_id, turn_id, call_id, tool_name, arguments, arguments_sha256, status, effect_class,
        idempotency_key, attempt_count, lease_owner, lease_token, lease_expires_at, result,
        error_stage, error_detail, created_at, started_at, finished_at, submitted_at, confirmed_at,
        updated_at, submission_count, abandoned_reason
    )
    SELECT session_id, turn_id, call_id, tool_name, arguments,
           encode(sha256(convert_to(arguments, 'UTF8')), 'hex'),
           status, effect_class,
           'tl_' || left(encode(sha256(convert_to(
               session_id || chr(31) || turn_id || chr(31) || call_id, 'UTF8')), 'hex'), 48),
           CASE WHEN status = 'pending' THEN 0 ELSE 1 END,
           CASE WHEN status = 'pending' THEN NULL ELSE owner END,
           CASE WHEN status = 'pending' THEN 0 ELSE 1 END,
           CASE WHEN status IN ('pending', 'abandoned') THEN NULL ELSE started_at + interval '30 seconds' END,
           CASE
             WHEN finished_at IS NULL THEN NULL
             WHEN success THEN json_build_object(
               'type', 'agent.session.input.tool_result', 'turn_id', turn_id, 'call_id', call_id,
               'success', true,
               'output', json_build_object(
                 'order_id', 'A' || i, 'state', 'done', 'token', 'tok_' || left(md5('token ' || i), 16)
               )::text)::text
             ELSE json_build_object(
               'type', 'agent.session.input.tool_result', 'turn_id', turn_id, 'call_id', call_id,
               'success', false,
               'error', CASE WHEN crashed THEN 'Tool handler failed.'
                             ELSE 'Order A' || i || ' cannot be changed any more.' END)::text
           END,
           CASE WHEN finished_at IS NOT NULL AND NOT success THEN 'execution' END,
           CASE WHEN finished_at IS NOT NULL AND NOT success AND crashed THEN
             'Traceback (most recent call last):' || chr(10) || '  File "tools.py", line 42, in '
             || tool_name || chr(10) || 'RuntimeError: upstream refused the request (ref ' || i || ')'
           END,
           created_at, started_at, finished_at, submitted_at,
           CASE WHEN status = 'submitted' THEN submitted_at + interval '1 second' END,
           CASE
             WHEN status = 'submitted' THEN submitted_at + interval '1 second'
             WHEN status = 'abandoned' THEN coalesce(finished_at, started_at) + interval '10 minutes'
             WHEN status = 'unknown' THEN started_at + interval '30 seconds'
             ELSE coalesce(finished_at, started_at, created_at)
           END,
           CASE WHEN status = 'submitted' THEN 1 ELSE 0 END,
           CASE WHEN status = 'abandoned' THEN 'the session no longer awaits this call' END
    FROM finished
    RETURNING session_id, turn_id, call_id, status, lease_owner, lease_token, lease_expires_at,
              error_stage, error_detail, created_at, finished_at, submitted_at, confirmed_at,
              updated_at, abandoned_reason
)
INSERT INTO tool_call_events (
    session_id, turn_id, call_id, at, actor, kind, from_status, to_status, lease_token, reason, detail
)
SELECT c.session_id, c.turn_id, c.call_id, e.at, coalesce(c.lease_owner, 'replica-0'), e.kind,
       e.from_status, e.to_status, e.lease_token, e.reason, e.detail
FROM inserted c
CROSS JOIN LATERAL (VALUES
    (1, true, c.created_at, 'transition', NULL,
     CASE WHEN c.status = 'pending' THEN 'pending' ELSE 'running' END, c.lease_token,
     CASE WHEN c.status = 'pending' THEN 'recorded' ELSE 'recorded and claimed' END, NULL),
    (2, c.finished_at IS NOT NULL, c.finished_at, 'transition', 'running',
     CASE WHEN c.error_stage IS NULL THEN 'succeeded' ELSE 'failed' END, c.lease_token,
     CASE WHEN c.error_stage IS NULL THEN 'handler returned' ELSE 'handler failed' END, c.error_detail),
    (3, c.status = 'unknown', c.lease_expires_at, 'transition', 'running', 'unknown', c.lease_token,
     'lease expired without a result', NULL),
    (4, c.status = 'submitted', c.submitted_at, 'submission',
     CASE WHEN c.error_stage IS NULL THEN 'succeeded' ELSE 'failed' END, 'submitted', c.lease_token,
     'result accepted', NULL),
    (5, c.confirmed_at IS NOT NULL, c.confirmed_at, 'confirmed', 'submitted', 'submitted', NULL,
     'left required_actions', NULL),
    (6, c.status = 'abandoned', c.updated_at, 'transition',
     CASE WHEN c.finished_at IS NULL THEN 'running'
          WHEN c.error_stage IS NULL THEN 'succeeded' ELSE 'failed' END,
     'abandoned', c.lease_token, c.abandoned_reason, NULL)
) AS e(step, applies, at, kind, from_status, to_status, lease_token, reason, detail)
WHERE e.applies
"""

SEED_SESSIONS_SQL = """
INSERT INTO sessions (session_id, watched, owner, lease_token, lease_expires_at, last_event_id,
                      last_polled_at, status, created_at, updated_at)
SELECT 'sess_' || left(md5('session ' || n), 24), true, 'replica-' || (n %% 3), 1,
       %(anchor)s::timestamptz + interval '30 seconds', 'evt_' || left(md5('event ' || n), 24),
       %(anchor)s::timestamptz, 'idle', created, created
FROM (
    SELECT n, %(anchor)s::timestamptz - make_interval(days => %(span_days)s)
              + make_interval(secs => n * %(session_gap)s) AS created
    FROM generate_series(0, %(sessions)s::int - 1) AS n
) AS s
"""

# Building indexes once after the load is several times faster than keeping them up to date
# row by row; the definitions come from the migrated database itself, so the schema is the
# migrations' exactly (checked after the rebuild). Partial indexes stay: they hold few rows,
# and their predicates would come back from pg_get_indexdef spelled differently.
INDEX_DEFINITIONS_SQL = """
SELECT i.indexname, i.indexdef
FROM pg_indexes i JOIN pg_index x ON x.indexrelid = (quote_ident(i.indexname))::regclass
WHERE i.schemaname = 'public' AND i.tablename = ANY(%(tables)s) AND x.indpred IS NULL
  AND NOT EXISTS (SELECT 1 FROM pg_constraint c WHERE c.conname = i.indexname)
ORDER BY i.tablename, i.indexname
"""
CONSTRAINT_DEFINITIONS_SQL = """
SELECT t.relname, c.conname, c.contype, pg_get_constraintdef(c.oid)
FROM pg_constraint c JOIN pg_class t ON t.oid = c.conrelid
WHERE t.relname = ANY(%(tables)s) AND c.contype IN ('p', 'u', 'f')
ORDER BY CASE c.contype WHEN 'f' THEN 1 ELSE 0 END, t.relname, c.conname
"""


def schema_fingerprint(conn: psycopg.Connection[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    indexes = conn.execute(
        "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = ANY(%(tables)s) ORDER BY 1",
        {"tables": list(LEDGER_TABLES)},
    ).fetchall()
    constraints = conn.execute(CONSTRAINT_DEFINITIONS_SQL, {"tables": list(LEDGER_TABLES)}).fetchall()
    return sorted(indexes + constraints, key=repr)


Definitions = list[tuple[Any, ...]]


def drop_for_load(conn: psycopg.Connection[tuple[Any, ...]]) -> tuple[Definitions, Definitions]:
    """Drop the ledger tables' keys and (non-partial) indexes; returns their definitions."""
    indexes = conn.execute(INDEX_DEFINITIONS_SQL, {"tables": list(LEDGER_TABLES)}).fetchall()
    constraints = conn.execute(CONSTRAINT_DEFINITIONS_SQL, {"tables": list(LEDGER_TABLES)}).fetchall()
    with conn.transaction():
        for table, name, _kind, _definition in reversed(constraints):  # foreign key first
            conn.execute(
                sql.SQL("ALTER TABLE {} DROP CONSTRAINT {}").format(
                    sql.Identifier(table), sql.Identifier(name)
                )
            )
        for name, _definition in indexes:
            conn.execute(sql.SQL("DROP INDEX {}").format(sql.Identifier(name)))
    return indexes, constraints


def rebuild_after_load(
    conn: psycopg.Connection[tuple[Any, ...]],
    indexes: Definitions,
    constraints: Definitions,
    progress: Callable[[str], None],
) -> None:
    for table, name, _kind, definition in constraints:
        progress(f"adding {name}")
        conn.execute(
            sql.SQL("ALTER TABLE {} ADD CONSTRAINT {} {}").format(
                sql.Identifier(table), sql.Identifier(name), sql.SQL(definition)
            )
        )
    for name, definition in indexes:
        progress(f"building {name}")
        conn.execute(definition)


def seed(url: str, calls: int, anchor: datetime, progress: Callable[[str], None]) -> SeedReport:
    sessions = max(1, -(-calls // CALLS_PER_SESSION))
    span = SPAN_DAYS * 86400
    parameters: dict[str, Any] = {
        "per_session": CALLS_PER_SESSION,
        "per_turn": CALLS_PER_SESSION // TURNS_PER_SESSION,
        "tool_bounds": tool_thresholds(),
        "tools": [name for name, _ in TOOLS],
        "effects": [effect.value for _, effect in TOOLS],
        "failure_above": 1 - FAILURE_SHARE,
        "crash_above": 1 - CRASH_SHARE,
        "anchor": anchor,
        "span_days": SPAN_DAYS,
        # Sessions follow one another over the span; each lasts ~100 s (50 calls, 2 s apart).
        "session_gap": (span - 3600) / sessions,
        "sessions": sessions,
    }
    statement = SEED_CALLS_SQL.format(status_case=status_case())
    with connect(url) as conn:
        expected = schema_fingerprint(conn)
        conn.execute("SET synchronous_commit = off")
        conn.execute("SET maintenance_work_mem = '1GB'")
        conn.execute("SET max_parallel_maintenance_workers = 2")
        indexes, constraints = drop_for_load(conn)
        # The trail's trigger chains each event through the indexes dropped above: a seeded
        # event would scan the tables. Seeded events carry no chain (the benchmark times
        # reads and writes, not `verify-trail`); the trigger is back before anything else runs.
        conn.execute("ALTER TABLE tool_call_events DISABLE TRIGGER tool_call_events_trail")

        started = time.perf_counter()
        conn.execute("SELECT setseed(0.42)")
        for first in range(0, calls, SEED_CHUNK):
            last = min(calls, first + SEED_CHUNK) - 1
            conn.execute(statement, {**parameters, "first": first, "last": last})
            progress(f"seeded {last + 1:,} of {calls:,} calls")
        conn.execute(SEED_SESSIONS_SQL, parameters)
        inserted = time.perf_counter()

        conn.execute("ALTER TABLE tool_call_events ENABLE TRIGGER tool_call_events_trail")
        rebuild_after_load(conn, indexes, constraints, progress)
        indexed = time.perf_counter()
        if schema_fingerprint(conn) != expected:
            raise RuntimeError("the rebuilt indexes and constraints differ from the migrated schema")

        progress("VACUUM ANALYZE")
        for table in ("tool_calls", "tool_call_events", "sessions"):
            conn.execute(sql.SQL("VACUUM ANALYZE {}").format(sql.Identifier(table)))
        vacuumed = time.perf_counter()
        events = conn.execute("SELECT count(*) FROM tool_call_events").fetchone()
    return SeedReport(
        calls=calls,
        events=int(events[0]) if events else 0,
        sessions=sessions,
        insert_seconds=inserted - started,
        index_seconds=indexed - inserted,
        vacuum_seconds=vacuumed - indexed,
    )


# ------------------------------------------------------------------------------------ timing


Operation = Callable[[], Awaitable[int]]
"""One audit query, run once; returns how many rows (calls, events, or a count) it produced."""


@dataclass(frozen=True)
class QuerySpec:
    name: str
    service: Operation
    """Through ``AuditService``: the store, then masked pydantic views (what the CLI and API get)."""
    store: Operation
    """Through ``AuditStore`` alone: the SQL and the rows turned into records."""


@dataclass
class QueryResult:
    name: str
    median_ms: float
    p95_ms: float
    store_median_ms: float
    db_ms: float
    """Execution time of the statements as EXPLAIN ANALYZE reports it (the server's share)."""
    rows: int
    plan_summary: str
    plans: list[list[str]] = field(default_factory=list)


class StatementRecorder:
    """Keeps the statements (and parameters) an engine sends while recording is on."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.statements: list[tuple[str, Any]] = []
        self.active = False
        event.listen(engine.sync_engine, "before_cursor_execute", self._seen)

    def _seen(self, _conn: Any, _cursor: Any, statement: str, parameters: Any, *_rest: Any) -> None:
        if self.active:
            self.statements.append((statement, parameters))

    @contextmanager
    def recording(self) -> Iterator[list[tuple[str, Any]]]:
        self.statements = []
        self.active = True
        try:
            yield self.statements
        finally:
            self.active = False


_COST = re.compile(r"\s*\(cost=[^)]*\)")
_NODE = re.compile(r"^\s*(?:->\s*)?([A-Z][^(]*?)\s*(?:\(|$)")


def summarize_plan(lines: list[str]) -> str:
    """The plan's nodes from the top, e.g. ``Limit > Index Scan Backward using ix_x``."""
    nodes = []
    for number, line in enumerate(lines):
        if number > 0 and not line.lstrip().startswith("->"):
            continue
        match = _NODE.match(line)
        if match:
            nodes.append(re.sub(r" on (tool_calls|tool_call_events)$", "", match.group(1)))
    return " > ".join(nodes[:5])


_DETAILS = ("Index Cond:", "Filter:", "Rows Removed by Filter:", "Heap Blocks:")


def plan_head(lines: list[str]) -> list[str]:
    """What a reader needs of a plan: its nodes, their conditions, the top node's buffers,
    the execution time; each line cut at 150 characters."""
    kept = []
    for number, line in enumerate(lines):
        stripped = line.strip()
        wanted = (
            number == 0
            or stripped.startswith(("->", *_DETAILS, "Execution Time:"))
            or (number == 1 and stripped.startswith("Buffers:"))
        )
        if wanted:
            kept.append(line if len(line) <= 150 else line[:149] + "…")
    if len(kept) > PLAN_LINES:
        kept = [*kept[: PLAN_LINES - 1], f"   ... ({len(kept) - PLAN_LINES} more) ...", kept[-1]]
    return kept


async def explain(engine: AsyncEngine, statements: list[tuple[str, Any]]) -> tuple[float, list[list[str]]]:
    total, plans = 0.0, []
    async with engine.connect() as conn:
        for statement, parameters in statements:
            result = await conn.exec_driver_sql("EXPLAIN (ANALYZE, BUFFERS) " + statement, parameters)
            lines = [str(row[0]) for row in result]
            for line in lines:
                if line.startswith("Execution Time:"):
                    total += float(line.split()[2])
            plans.append([_COST.sub("", line) for line in lines])
    return total, plans


async def durations_ms(operation: Operation, *, runs: int, warmup: int) -> tuple[list[float], int]:
    for _ in range(warmup):
        await operation()
    durations, rows = [], 0
    for _ in range(runs):
        started = time.perf_counter()
        rows = await operation()
        durations.append((time.perf_counter() - started) * 1000)
    return sorted(durations), rows


def percentile(ordered: list[float], share: float) -> float:
    """Nearest-rank percentile of sorted values."""
    return ordered[min(len(ordered) - 1, max(0, math.ceil(share * len(ordered)) - 1))]


async def time_query(
    spec: QuerySpec, engine: AsyncEngine, recorder: StatementRecorder, *, runs: int, warmup: int
) -> QueryResult:
    through_service, rows = await durations_ms(spec.service, runs=runs, warmup=warmup)
    through_store, _ = await durations_ms(spec.store, runs=runs, warmup=warmup)
    with recorder.recording() as statements:
        await spec.store()
    db_ms, plans = await explain(engine, list(statements))
    return QueryResult(
        name=spec.name,
        median_ms=statistics.median(through_service),
        p95_ms=percentile(through_service, 0.95),
        store_median_ms=statistics.median(through_store),
        db_ms=db_ms,
        rows=rows,
        plan_summary=" ; ".join(summarize_plan(plan) for plan in plans),
        plans=plans,
    )


@dataclass(frozen=True)
class Sample:
    """A call from the middle of the ledger: its ids name it, and give terms to search for."""

    key: CallKey
    idempotency_key: str


async def pick_sample(engine: AsyncEngine, calls: int) -> Sample:
    async with engine.connect() as conn:
        row: tuple[Any, ...] = tuple(
            (
                await conn.exec_driver_sql(
                    "SELECT session_id, turn_id, call_id, idempotency_key FROM tool_calls "
                    "WHERE status = 'submitted' ORDER BY created_at LIMIT 1 OFFSET %(middle)s",
                    {"middle": calls // 2},
                )
            ).one()
        )
    return Sample(CallKey(row[0], row[1], row[2]), row[3])


def build_queries(
    service: AuditService, sample: Sample, anchor: datetime, deep_page: CallQuery
) -> list[QuerySpec]:
    store = service.store

    def listing(name: str, query: CallQuery) -> QuerySpec:
        async def through_service() -> int:
            return len((await service.list_calls(query)).calls)

        async def through_store() -> int:
            return len((await store.list_calls(query)).calls)

        return QuerySpec(name, through_service, through_store)

    def showing(name: str, text: str) -> QuerySpec:
        async def through_service() -> int:
            return len((await service.show(text)).timeline)

        async def through_store() -> int:
            # What show does beneath the views: find the call, then read its audit trail.
            (call,) = await store.find(CallReference.parse(text))
            return len(await store.events(call.key))

        return QuerySpec(name, through_service, through_store)

    def counting(name: str, query: CallQuery) -> QuerySpec:
        async def count() -> int:
            return await store.count_calls(query)

        return QuerySpec(name, count, count)

    async def prune_count() -> int:
        return await service.prune(PRUNE_AGE, dry_run=True)

    async def prune_count_store() -> int:
        return await store.prune(datetime.now(UTC) - PRUNE_AGE, dry_run=True)

    async def session_list() -> int:
        return len(await service.session_list(limit=100))

    async def session_list_store() -> int:
        return len(await store.session_summaries(limit=100))

    mid_tool = TOOLS[10][0]
    rarest_word = TOOLS[-1][0].split("_")[0]  # "wire": only the least used tool's name has it
    day = anchor - timedelta(days=30)
    specs = [
        listing(QUERY_NAMES[0], CallQuery()),
        listing(QUERY_NAMES[1], deep_page),
        listing(QUERY_NAMES[2], CallQuery(session_id=sample.key.session_id)),
        listing(QUERY_NAMES[3], CallQuery(tool_names=(mid_tool,))),
        listing(QUERY_NAMES[4], CallQuery(statuses=(CallStatus.UNKNOWN,))),
        listing(QUERY_NAMES[5], CallQuery(statuses=(CallStatus.ABANDONED,))),
        listing(QUERY_NAMES[6], CallQuery(effect_classes=(EffectClass.VERIFIED,))),
        listing(QUERY_NAMES[7], CallQuery(since=day, until=day + timedelta(days=1))),
        listing(QUERY_NAMES[8], CallQuery(tool_names=(TOOLS[1][0],), statuses=(CallStatus.UNKNOWN,))),
        listing(QUERY_NAMES[9], CallQuery(text=sample.key.call_id[8:20])),
        listing(QUERY_NAMES[10], CallQuery(text=sample.key.turn_id[10:15])),
        listing(QUERY_NAMES[11], CallQuery(text=rarest_word)),
        listing(QUERY_NAMES[12], CallQuery(text="order")),
        listing(QUERY_NAMES[13], CallQuery(sort=SortKey.TOOL, descending=False)),
        listing(QUERY_NAMES[14], CallQuery(sort=SortKey.STATUS, descending=True)),
        showing(QUERY_NAMES[15], str(sample.key)),
        showing(QUERY_NAMES[16], sample.idempotency_key[:15]),
        showing(QUERY_NAMES[17], sample.key.call_id),
        counting(QUERY_NAMES[18], CallQuery(statuses=(CallStatus.UNKNOWN,))),
        counting(QUERY_NAMES[19], CallQuery(tool_names=(mid_tool,))),
        QuerySpec(QUERY_NAMES[20], prune_count, prune_count_store),
        QuerySpec(QUERY_NAMES[21], session_list, session_list_store),
    ]
    assert [spec.name for spec in specs] == list(QUERY_NAMES)
    return specs


async def page_deep(store: AuditStore, pages: int) -> CallQuery:
    """The query for the page after ``pages`` pages of the default listing."""
    query = CallQuery()
    for _ in range(pages):
        page = await store.list_calls(query)
        assert page.next_cursor is not None, "the ledger is too small to page that deep"
        query = query.next_page(page.next_cursor)
    return query


async def run_queries(
    url: str, calls: int, anchor: datetime, *, runs: int, warmup: int, progress: Callable[[str], None]
) -> list[QueryResult]:
    settings = Settings(database_url=url)
    engine = create_engine(url)
    try:
        service = AuditService(Runtime.from_settings(settings, engine=engine))
        recorder = StatementRecorder(engine)
        sample = await pick_sample(engine, calls)
        deep_page = await page_deep(service.store, DEEP_PAGES)
        results = []
        for spec in build_queries(service, sample, anchor, deep_page):
            progress(f"timing {spec.name}")
            results.append(await time_query(spec, engine, recorder, runs=runs, warmup=warmup))
        return results
    finally:
        await engine.dispose()


# ------------------------------------------------------------------------------------ write path


@dataclass(frozen=True)
class WriteCost:
    """Microseconds per call written one after another, as a single worker writes them."""

    ledger: str
    samples: int
    record_us_before: float
    record_us_after: float
    life_us_before: float
    life_us_after: float
    """record + complete + mark_submitted: a status change rewrites every index entry."""
    server_us_before: float
    server_us_after: float
    """The server's own time for a call's three writes to tool_calls (insert, two status
    changes), with no commit: index upkeep without the fsync and the client around it."""
    wal_bytes_before: float
    wal_bytes_after: float
    """WAL written for those three writes, per call."""


# A call's three writes to tool_calls as the ledger makes them (recorded and claimed, finished,
# submitted), a batch at a time under EXPLAIN ANALYZE, which reports the server's time and the
# WAL of exactly these statements; rolled back. Ids are as long as real ones: a trigram index's
# work grows with them.
INDEX_WORK_SQL = (
    """
    EXPLAIN (ANALYZE, WAL, FORMAT JSON)
    INSERT INTO tool_calls (session_id, turn_id, call_id, tool_name, arguments, arguments_sha256,
        status, effect_class, idempotency_key, attempt_count, lease_owner, lease_token,
        lease_expires_at, created_at, started_at, updated_at)
    SELECT left(%(prefix)s || md5('s' || n / 50), 29), 'turn_' || left(md5(%(prefix)s || n / 10), 24),
        'call_' || left(md5(%(prefix)s || n), 24), (%(tools)s::text[])[1 + n %% 30],
        '{"cents":' || n || '}', md5(n::text) || md5(n::text), 'running', 'idempotent',
        'tl_' || left(encode(sha256(convert_to(%(prefix)s || n, 'UTF8')), 'hex'), 48), 1, 'bench', 1,
        clock_timestamp() + interval '30 seconds', clock_timestamp(), clock_timestamp(), clock_timestamp()
    FROM generate_series(1, %(calls)s::int) AS n
    """,
    """
    EXPLAIN (ANALYZE, WAL, FORMAT JSON)
    UPDATE tool_calls SET status = 'succeeded', result = '{"success":true,"output":"done"}',
        lease_expires_at = NULL, finished_at = clock_timestamp(), updated_at = clock_timestamp()
    WHERE session_id >= %(prefix)s AND session_id < %(prefix_end)s
    """,
    """
    EXPLAIN (ANALYZE, WAL, FORMAT JSON)
    UPDATE tool_calls SET status = 'submitted', submission_count = 1,
        submitted_at = clock_timestamp(), updated_at = clock_timestamp()
    WHERE session_id >= %(prefix)s AND session_id < %(prefix_end)s
    """,
)


def index_work(url: str, tag: str, calls: int = 1000) -> tuple[float, float]:
    """Server µs and WAL bytes per call for a call's three writes to tool_calls."""
    prefix = f"sess_p{tag}_"
    parameters = {
        "prefix": prefix,
        "prefix_end": prefix[:-1] + chr(ord("_") + 1),
        "calls": calls,
        "tools": [name for name, _ in TOOLS],
    }
    milliseconds = wal_bytes = 0.0
    with connect(url) as conn, conn.transaction(force_rollback=True):
        for statement in INDEX_WORK_SQL:
            row = conn.execute(statement, parameters).fetchone()
            assert row is not None
            (explained,) = row[0]
            milliseconds += float(explained["Execution Time"])
            wal_bytes += float(explained["Plan"]["WAL Bytes"])
    return milliseconds * 1000 / calls, wal_bytes / calls


async def write_calls(url: str, prefix: str, count: int, *, whole_life: bool) -> float:
    """Seconds to record ``count`` calls (and, for ``whole_life``, complete and submit each)."""
    engine = create_engine(url)
    store = LedgerStore(engine, actor="bench")
    try:
        started = time.perf_counter()
        for n in range(count):
            key = CallKey(f"sess_{prefix}{n // 50}", f"turn_{prefix}{n // 10}", f"call_{prefix}_{n}")
            recorded = await store.record(
                key,
                tool_name=TOOLS[n % len(TOOLS)][0],
                arguments={"order_id": f"A{n}", "cents": n},
                effect_class=EffectClass.IDEMPOTENT,
                lease_seconds=30,
            )
            if whole_life:
                await store.complete(key, recorded.call.lease_token, succeeded(key, "done"))
                await store.mark_submitted(key)
        return time.perf_counter() - started
    finally:
        await engine.dispose()


class WriteTimer:
    """Per (before or after, record or whole life): µs per call of each batch written. The
    median batch is reported: the machine is shared, and a batch that another process slowed
    down should not decide the figure."""

    def __init__(self) -> None:
        self.batches: dict[tuple[bool, bool], list[float]] = {}
        self.calls = 0
        self.server_us: dict[bool, list[float]] = {False: [], True: []}
        self.wal_bytes: dict[bool, list[float]] = {False: [], True: []}

    def probe(self, url: str, tag: str, *, after: bool) -> None:
        server_us, wal_bytes = index_work(url, tag)
        self.server_us[after].append(server_us)
        self.wal_bytes[after].append(wal_bytes)

    async def run(self, url: str, prefix: str, count: int, *, after: bool, whole_life: bool) -> None:
        spent = await write_calls(url, prefix, count, whole_life=whole_life)
        self.batches.setdefault((after, whole_life), []).append(spent / count * 1e6)
        self.calls += count if after and not whole_life else 0

    def cost(self, ledger: str) -> WriteCost:
        def us(after: bool, whole_life: bool) -> float:
            return statistics.median(self.batches[after, whole_life])

        return WriteCost(
            ledger=ledger,
            samples=self.calls,
            record_us_before=us(False, False),
            record_us_after=us(True, False),
            life_us_before=us(False, True),
            life_us_after=us(True, True),
            server_us_before=statistics.median(self.server_us[False]),
            server_us_after=statistics.median(self.server_us[True]),
            wal_bytes_before=statistics.median(self.wal_bytes[False]),
            wal_bytes_after=statistics.median(self.wal_bytes[True]),
        )


async def write_cost_on_new_ledgers(
    url: str, added: set[str], samples: int, progress: Callable[[str], None]
) -> WriteCost:
    """Two new ledgers at the head revision, one with the audit indexes (``added``) dropped,
    written in alternating rounds (each round starting with the other) so that other load on
    the machine hits both alike. (Not a ledger at the revision before them: today's code
    writes columns later revisions added.)"""
    base = bench_database_name(url)
    urls = {
        False: with_database(url, f"{base}_write_before"),
        True: with_database(url, f"{base}_write_after"),
    }
    timer, rounds = WriteTimer(), 8
    try:
        for after, database_url in urls.items():
            recreate_database(database_url)
            migrate.upgrade(database_url)
            if not after:
                with connect(database_url) as conn:
                    for name in sorted(added):
                        conn.execute(sql.SQL("DROP INDEX {}").format(sql.Identifier(name)))
        progress("write path, new ledgers: the server's work")
        for round_number in range(3):
            for after in (False, True) if round_number % 2 == 0 else (True, False):
                timer.probe(urls[after], f"{round_number}", after=after)
        for whole_life in (False, True):
            progress(f"write path, new ledgers: {'whole lives' if whole_life else 'records'}")
            for round_number in range(rounds):
                order = [False, True] if round_number % 2 == 0 else [True, False]
                for after in order:
                    prefix = f"{'l' if whole_life else 'r'}{round_number}"
                    await timer.run(
                        urls[after], prefix, samples // rounds, after=after, whole_life=whole_life
                    )
    finally:
        for database_url in urls.values():
            drop_database(database_url)
    return timer.cost("new, empty ledger")


async def write_cost_on_seeded_ledger(
    url: str, calls: int, added: set[str], samples: int, progress: Callable[[str], None]
) -> WriteCost:
    """The seeded ledger with the audit indexes, without them, and with them rebuilt (so that
    a drift in the machine's load shows on both sides): what the indexes cost at this size,
    where a GIN index's pending list costs more to merge into it."""
    with connect(url) as conn:
        definitions = conn.execute(
            "SELECT indexname, indexdef FROM pg_indexes WHERE indexname = ANY(%(names)s)",
            {"names": sorted(added)},
        ).fetchall()
    timer, batch = WriteTimer(), samples // 4
    timer.probe(url, "a1", after=True)
    for whole_life in (False, True):
        for part in range(2):
            await timer.run(url, f"a1{whole_life:d}{part}", batch, after=True, whole_life=whole_life)
    progress("write path, seeded ledger: dropping the audit indexes")
    with connect(url) as conn:
        for name, _definition in definitions:
            conn.execute(sql.SQL("DROP INDEX {}").format(sql.Identifier(name)))
    for tag in ("b1", "b2", "b3"):
        timer.probe(url, tag, after=False)
    for whole_life in (False, True):
        for part in range(4):
            await timer.run(url, f"b{whole_life:d}{part}", batch, after=False, whole_life=whole_life)
    progress("write path, seeded ledger: building the audit indexes again")
    with connect(url) as conn:
        conn.execute("SET maintenance_work_mem = '1GB'")
        for _name, definition in definitions:
            conn.execute(definition)
    timer.probe(url, "a2", after=True)
    timer.probe(url, "a3", after=True)
    for whole_life in (False, True):
        for part in range(2):
            await timer.run(url, f"a2{whole_life:d}{part}", batch, after=True, whole_life=whole_life)
    return timer.cost(f"seeded ledger ({calls:,} calls)")


# ------------------------------------------------------------------------------------ sizes


@dataclass(frozen=True)
class RelationSize:
    table: str
    name: str
    kind: str
    """``table``, or the index's access method (btree, gin)."""
    bytes: int


def relation_sizes(url: str) -> list[RelationSize]:
    with connect(url) as conn:
        rows = conn.execute(
            """
            SELECT t.relname, t.relname, 'table', pg_table_size(t.oid)
            FROM pg_class t WHERE t.relname = ANY(%(tables)s) AND t.relkind = 'r'
            UNION ALL
            SELECT t.relname, c.relname, am.amname, pg_relation_size(c.oid)
            FROM pg_index i
            JOIN pg_class c ON c.oid = i.indexrelid
            JOIN pg_class t ON t.oid = i.indrelid
            JOIN pg_am am ON am.oid = c.relam
            WHERE t.relname = ANY(%(tables)s)
            ORDER BY 1, 3 DESC, 2
            """,
            {"tables": list(LEDGER_TABLES)},
        ).fetchall()
    return [RelationSize(*row) for row in rows]


def audit_index_names(url: str) -> set[str]:
    """Indexes the audit-indexes migration adds: those at its revision and not before it."""
    base = bench_database_name(url)
    names: dict[str, set[str]] = {}
    for revision in (BEFORE_AUDIT_INDEXES, AUDIT_INDEXES_REVISION):
        database_url = with_database(url, f"{base}_r{revision}")
        recreate_database(database_url)
        try:
            migrate.upgrade(database_url, revision)
            with connect(database_url) as conn:
                names[revision] = {
                    str(row[0])
                    for row in conn.execute(
                        "SELECT indexname FROM pg_indexes WHERE tablename = ANY(%(tables)s)",
                        {"tables": list(LEDGER_TABLES)},
                    )
                }
        finally:
            drop_database(database_url)
    return names[AUDIT_INDEXES_REVISION] - names[BEFORE_AUDIT_INDEXES]


# ------------------------------------------------------------------------------------ report


def megabytes(size: int) -> str:
    return f"{size / 1024 / 1024:,.1f} MB"


def print_report(
    seeded: SeedReport,
    results: list[QueryResult],
    sizes: list[RelationSize],
    added: set[str],
    write_costs: list[WriteCost],
    server: str,
) -> None:
    print(f"\n{server}")
    print(
        f"seeded {seeded.calls:,} calls, {seeded.events:,} events, {seeded.sessions:,} sessions in "
        f"{seeded.total_seconds:.1f} s (insert {seeded.insert_seconds:.1f} s, indexes and constraints "
        f"{seeded.index_seconds:.1f} s, VACUUM ANALYZE {seeded.vacuum_seconds:.1f} s)\n"
    )
    width = max(len(r.name) for r in results)
    print("ms: median and p95 through AuditService (views included), median through AuditStore")
    print("alone, and the server's execution time from EXPLAIN ANALYZE; rows: calls, events or count\n")
    print(f"{'query':<{width}}  {'median':>7}  {'p95':>7}  {'store':>7}  {'db':>7}  {'rows':>6}  plan")
    for r in results:
        print(
            f"{r.name:<{width}}  {r.median_ms:>7.2f}  {r.p95_ms:>7.2f}  {r.store_median_ms:>7.2f}  "
            f"{r.db_ms:>7.2f}  {r.rows:>6}  {r.plan_summary}"
        )
    print("\nplans (EXPLAIN (ANALYZE, BUFFERS): nodes, conditions, buffers; costs left out):")
    for r in results:
        print(f"\n-- {r.name}")
        for plan in r.plans:
            for line in plan_head(plan):
                print(f"   {line}")
    print("\nsizes (* = added by the audit-indexes migration):")
    for size in sizes:
        mark = "*" if size.name in added else " "
        print(f" {mark} {size.table:<17} {size.name:<40} {size.kind:<6} {megabytes(size.bytes):>12}")
    extra = sum(s.bytes for s in sizes if s.name in added)
    print(f"   {len(added)} indexes added, {megabytes(extra)} in all")
    for cost in write_costs:
        print(
            f"\nwrite path on a {cost.ledger}, {cost.samples:,} calls one after another,"
            " µs per call (median batch):"
        )
        print(f"   {'':<40} {'before':>8} {'after':>8}")
        for label, before, after in (
            ("LedgerStore.record", cost.record_us_before, cost.record_us_after),
            ("record + complete + mark_submitted", cost.life_us_before, cost.life_us_after),
            ("server time of its 3 tool_calls writes", cost.server_us_before, cost.server_us_after),
            ("WAL bytes of those writes", cost.wal_bytes_before, cost.wal_bytes_after),
        ):
            print(f"   {label:<40} {before:>8.0f} {after:>8.0f}   {after / before - 1:+.0%}")


def server_version(url: str) -> str:
    with connect(url) as conn:
        row = conn.execute(
            "SELECT version(), current_setting('shared_buffers'), current_setting('work_mem')"
        ).fetchone()
    assert row is not None
    return f"{str(row[0]).split(' on ')[0]}, shared_buffers {row[1]}, work_mem {row[2]}"


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.audit", description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=None, help=f"calls to seed (default {FULL_CALLS:,})")
    parser.add_argument(
        "--database-url",
        default=DEFAULT_DATABASE_URL,
        help="PostgreSQL database to DROP and create (its name must contain 'bench')",
    )
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    parser.add_argument(
        "--quick", action="store_true", help=f"{QUICK_CALLS:,} calls, fewer runs (a smoke test)"
    )
    parser.add_argument("--runs", type=int, default=None, help="timed runs per query (default 20)")
    parser.add_argument("--write-samples", type=int, default=None, help="calls per write-path run")
    parser.add_argument("--no-write-path", action="store_true", help="skip the write-path comparison")
    parser.add_argument("--drop", action="store_true", help="drop the benchmark database at the end")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    arguments = parse_arguments(argv)
    calls = arguments.calls or (QUICK_CALLS if arguments.quick else FULL_CALLS)
    runs = arguments.runs or (5 if arguments.quick else 20)
    warmup = 1 if arguments.quick else 3
    samples = arguments.write_samples or (80 if arguments.quick else 2000)
    url = arguments.database_url
    bench_database_name(url)
    if calls < CALLS_PER_SESSION * (DEEP_PAGES + 2):
        raise SystemExit(f"benchmarks.audit: --calls must be at least {CALLS_PER_SESSION * (DEEP_PAGES + 2)}")

    def progress(message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    anchor = datetime.now(UTC).replace(microsecond=0)
    progress(f"creating {make_url(url).database} and migrating it")
    recreate_database(url)
    try:
        migrate.upgrade(url)
        seeded = seed(url, calls, anchor, progress)
        results = asyncio.run(run_queries(url, calls, anchor, runs=runs, warmup=warmup, progress=progress))
        sizes = relation_sizes(url)
        added = audit_index_names(url)
        write_costs = []
        if not arguments.no_write_path:
            write_costs.append(asyncio.run(write_cost_on_new_ledgers(url, added, samples, progress)))
            write_costs.append(asyncio.run(write_cost_on_seeded_ledger(url, calls, added, samples, progress)))
        print_report(seeded, results, sizes, added, write_costs, server_version(url))
    finally:
        if arguments.drop:
            drop_database(url)
    if arguments.json:
        with open(arguments.json, "w", encoding="utf-8") as out:
            json.dump(
                {
                    "calls": calls,
                    "runs": runs,
                    "seed": {**asdict(seeded), "total_seconds": seeded.total_seconds},
                    "queries": [asdict(r) for r in results],
                    "sizes": [{**asdict(s), "added": s.name in added} for s in sizes],
                    "write_path": [asdict(cost) for cost in write_costs],
                },
                out,
                indent=2,
            )


if __name__ == "__main__":
    main()
