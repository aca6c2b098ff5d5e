"""``toolledger calls``: list, show, export, resolve and prune the ledger's calls.

Every command first turns what was typed into the audit core's values (``CallQuery``,
``Resolution``, a duration), so a mistake exits 2 before the database is touched; then it
runs one ``AuditService`` operation. Nothing is printed that the audit views did not mask.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import getpass
import os
import sys
import time
import unicodedata
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from dataclasses import dataclass, fields, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Literal, TypeVar

import click

from toolledger.cli.common import (
    LOG_LEVELS,
    base_url_option,
    configure_logging,
    database_option,
    iso,
    ledger_runtime,
    load_tools,
    missing_sqlite_file,
    run,
    settings_from,
)
from toolledger.domain.queries import (
    DEFAULT_PAGE,
    MAX_PAGE,
    CallQuery,
    CallReference,
    Cursor,
    QueryError,
    SortKey,
    parse_duration,
    parse_effect_classes,
    parse_moment,
    parse_outcomes,
    parse_sort,
    parse_statuses,
)
from toolledger.domain.states import CallStatus

if TYPE_CHECKING:
    from rich.console import Console
    from rich.text import Text

    from toolledger.audit.bulk import BulkItem, BulkReport
    from toolledger.audit.service import AuditService, Decision, Resolution, ResolveReport
    from toolledger.audit.trail import TrailReport
    from toolledger.audit.views import CallCountsView, CallDetail, CallPage, CallView
    from toolledger.domain.keys import CallKey
    from toolledger.domain.records import SessionRecord
    from toolledger.runtime.registry import ToolRegistry
    from toolledger.settings import Settings
    from toolledger.store.audit import Change

T = TypeVar("T")

ID_PREFIX_CHARS = len("tl_") + 12
"""Enough of the idempotency key to tell calls apart at a glance and to name one in `show`."""
PROGRESS_EVERY_SECONDS = 0.5
UNLIMITED_WIDTH = 100_000


@click.group()
def calls() -> None:
    """Audit past tool executions and settle calls whose outcome is unknown."""


# --------------------------------------------------------------------- filters


@dataclass(frozen=True)
class Filters:
    """The filter flags as typed; ``query`` checks and converts them."""

    session: str | None
    turn: str | None
    tools: tuple[str, ...]
    statuses: tuple[str, ...]
    outcomes: tuple[str, ...]
    effect_classes: tuple[str, ...]
    since: str | None
    until: str | None
    unknown_only: bool
    search: str | None
    sort: str

    @property
    def narrows(self) -> bool:
        """Some flag selects calls (the sort alone selects none)."""
        return any(getattr(self, f.name) for f in fields(self) if f.name != "sort")

    def query(self, *, limit: int = DEFAULT_PAGE, cursor: str | None = None) -> CallQuery:
        """The CallQuery these flags ask for; bad input is a usage error (exit 2)."""
        for hint, value in (("--session", self.session), ("--turn", self.turn), ("--search", self.search)):
            _check_text(value, hint)
        for tool in self.tools:
            _check_text(tool, "--tool")
        now = datetime.now(UTC)
        statuses = _parsed("--status", parse_statuses, self.statuses)
        if self.unknown_only:
            if statuses and CallStatus.UNKNOWN not in statuses:
                raise click.UsageError("--unknown lists only unknown calls: it contradicts --status")
            statuses = (CallStatus.UNKNOWN,)
        sort, descending = _parsed("--sort", parse_sort, self.sort)
        try:
            return CallQuery(
                session_id=self.session,
                turn_id=self.turn,
                tool_names=self.tools,
                statuses=statuses,
                outcomes=_parsed("--outcome", parse_outcomes, self.outcomes),
                effect_classes=_parsed("--effect-class", parse_effect_classes, self.effect_classes),
                since=None if self.since is None else _parsed("--since", parse_moment, self.since, now),
                until=None if self.until is None else _parsed("--until", parse_moment, self.until, now),
                text=self.search,
                sort=sort,
                descending=descending,
                limit=limit,
                cursor=None if cursor is None else _parsed("--cursor", Cursor.decode, cursor),
            )
        except QueryError as error:
            raise click.UsageError(str(error)) from None


FILTER_OPTIONS = (
    click.option("--session", default=None, help="Only calls of this session."),
    click.option("--turn", default=None, help="Only calls of this turn."),
    click.option("--tool", "tools", multiple=True, help="Only this tool (repeatable)."),
    click.option(
        "--status",
        "statuses",
        multiple=True,
        help="Only these states (repeatable or comma-separated): "
        + ", ".join(status.value for status in CallStatus)
        + ".",
    ),
    click.option(
        "--outcome",
        "outcomes",
        multiple=True,
        help="Only calls that ended so (repeatable or comma-separated): succeeded or failed, "
        "submitted or not.",
    ),
    click.option(
        "--effect-class",
        "effect_classes",
        multiple=True,
        help="Only these effect classes (repeatable or comma-separated).",
    ),
    click.option("--since", default=None, help="Recorded at or after: ISO 8601, or a duration ago (24h)."),
    click.option("--until", default=None, help="Recorded before: ISO 8601, or a duration ago (7d)."),
    click.option("--unknown", "unknown_only", is_flag=True, help="Only calls whose outcome is unknown."),
    click.option("--search", default=None, help="Text in the tool name or the session, turn or call id."),
    click.option(
        "--sort",
        default="-created",
        show_default=True,
        help="created, finished, tool or status; a leading - sorts descending.",
    ),
)


def filter_options(command: Callable[..., None]) -> Callable[..., None]:
    """Adds the filter flags; the command receives them as one ``filters: Filters``."""

    @functools.wraps(command)
    def with_filters(**options: Any) -> None:
        filters = Filters(**{field.name: options.pop(field.name) for field in fields(Filters)})
        command(filters=filters, **options)

    decorated: Callable[..., None] = with_filters
    for option in reversed(FILTER_OPTIONS):
        decorated = option(decorated)
    return decorated


def _parsed(hint: str, parse: Callable[..., T], *arguments: Any) -> T:
    try:
        return parse(*arguments)
    except QueryError as error:
        raise click.BadParameter(str(error), param_hint=hint) from None


def _check_text(value: str | None, hint: str) -> None:
    # Bytes that are not UTF-8 reach Python's argv as lone surrogates, which no database
    # driver can encode: refuse them here rather than fail inside a query.
    if value is None:
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise click.BadParameter("is not valid UTF-8 text", param_hint=hint) from None


# ------------------------------------------------------------------------ list


@calls.command("list")
@filter_options
@click.option(
    "--limit",
    type=click.IntRange(1, MAX_PAGE),
    default=None,
    help=f"Calls per page (default {DEFAULT_PAGE}; --jsonl streams every call unless given).",
)
@click.option("--cursor", default=None, help="Continue after a previous page (its next cursor).")
@click.option("--json", "as_json", is_flag=True, help='One JSON document: {"calls": [...], "next_cursor"}.')
@click.option("--jsonl", "as_jsonl", is_flag=True, help="One JSON call per line, streamed.")
@click.option(
    "--follow",
    "-f",
    is_flag=True,
    help="Print the latest calls (--limit, default 10), then each call as it is recorded or "
    "changes, until Ctrl-C. With --jsonl: one JSON call per change.",
)
@click.option(
    "--interval",
    type=click.FloatRange(0.05, 3600),
    default=1.0,
    show_default=True,
    help="With --follow: seconds between two looks at the ledger.",
)
@database_option
def list_calls(
    filters: Filters,
    limit: int | None,
    cursor: str | None,
    as_json: bool,
    as_jsonl: bool,
    follow: bool,
    interval: float,
    database_url: str | None,
) -> None:
    """The ledger's calls, newest first: a table, or JSON for scripts; or, with --follow, a
    live tail of the calls as they change."""
    if as_json and as_jsonl:
        raise click.UsageError("--json and --jsonl are two formats: choose one")
    if follow:
        if as_json or cursor is not None:
            raise click.UsageError("--follow prints calls as they change: use it without --json or --cursor")
        query = filters.query(limit=limit or FOLLOW_BACKLOG)
        settings = settings_from(database_url=database_url)
        try:
            execute(_follow(settings, query, interval=interval, as_jsonl=as_jsonl))
        except KeyboardInterrupt:
            # Ctrl-C is how a tail ends: not an error, and no traceback.
            click.echo("stopped", err=True)
        return
    query = filters.query(limit=limit or DEFAULT_PAGE, cursor=cursor)
    settings = settings_from(database_url=database_url)
    if as_jsonl and limit is None:
        execute(_stream_jsonl(settings, query))
        return
    page = execute(_page(settings, query))
    if as_json:
        click.echo(page.model_dump_json(indent=2))
    elif as_jsonl:
        for view in page.calls:
            click.echo(view.model_dump_json())
    else:
        _print_table(page)


FOLLOW_BACKLOG = 10
GAP_PATIENCE_SECONDS = 10.0
"""How long a follower waits for a missing event id. Ids are taken when a transaction writes
and become visible when it commits, so a later id can be seen first; an id that never shows
belonged to a rolled-back transaction."""


async def _follow(settings: Settings, query: CallQuery, *, interval: float, as_jsonl: bool) -> None:
    from toolledger.audit.views import call_view

    async with audit_service(settings) as service:
        follower = Follower(await service.store.last_event_id())
        backlog = await service.list_calls(query)
        if not as_jsonl:
            click.echo(_plain(f"following the ledger, every {interval:g}s (Ctrl-C to stop)").plain)
        for view in reversed(backlog.calls):
            _echo_change(view, None, view.created_at, as_jsonl=as_jsonl)
        while True:
            changes = await service.store.changes_after(query, follower.floor)
            # A call that changed several times since the last look is printed once, as it
            # is now, with what happened to it: its state at each event is not kept.
            latest: dict[CallKey, list[Change]] = {}
            for change in follower.new(changes, time.monotonic()):
                if change.matches:
                    latest.setdefault(change.call.key, []).append(change)
            for events in latest.values():
                kinds = ", ".join(dict.fromkeys(event.kind for event in events))
                view = call_view(events[-1].call, service.redactor)
                _echo_change(view, kinds, events[-1].at, as_jsonl=as_jsonl)
            await asyncio.sleep(interval)


class Follower:
    """Which events a tail has printed. It reads the events above ``floor`` and raises the
    floor over every id it has seen, or has waited for longer than GAP_PATIENCE_SECONDS."""

    def __init__(self, floor: int) -> None:
        self.floor = floor
        self._seen: set[int] = set()
        self._missing_since: dict[int, float] = {}

    def new(self, changes: list[Change], now: float) -> list[Change]:
        fresh = [change for change in changes if change.event_id not in self._seen]
        self._seen.update(change.event_id for change in fresh)
        top = max(self._seen, default=self.floor)
        for event_id in range(self.floor + 1, top + 1):
            if event_id not in self._seen:
                self._missing_since.setdefault(event_id, now)
        while self.floor < top:
            following = self.floor + 1
            waited = now - self._missing_since.get(following, now)
            if following not in self._seen and waited < GAP_PATIENCE_SECONDS:
                break
            self.floor = following
            self._seen.discard(following)
            self._missing_since.pop(following, None)
        return fresh


def _echo_change(view: CallView, kind: str | None, at: datetime, *, as_jsonl: bool) -> None:
    if as_jsonl:
        click.echo(view.model_dump_json())
        return
    line = "  ".join(
        (
            _precise(at)[:23],
            view.id[:ID_PREFIX_CHARS],
            f"{view.status:<9}",
            f"{outcome_text(view):<20}",
            view.tool_name,
            f"{view.session_id}/{view.turn_id}/{view.call_id}",
            f"({kind})" if kind else "(listed)",
        )
    )
    click.echo(_plain(line).plain)


async def _page(settings: Settings, query: CallQuery) -> CallPage:
    async with audit_service(settings) as service:
        return await service.list_calls(query)


async def _stream_jsonl(settings: Settings, query: CallQuery) -> None:
    out = sys.stdout
    async with audit_service(settings) as service:
        async for view in service.iter_calls(query):
            out.write(view.model_dump_json() + "\n")
    out.flush()


@dataclass(frozen=True)
class Column:
    header: str
    value: Callable[[CallView], str]
    rank: int
    """Which columns a narrow terminal keeps: the lowest ranks, as many as fit."""
    justify: Literal["left", "right"] = "left"


def outcome_text(view: CallView) -> str:
    if view.outcome == "failed" and view.error_stage:
        return f"failed ({view.error_stage})"
    return view.outcome or ""


LIST_COLUMNS = (
    Column("id", lambda v: v.id[:ID_PREFIX_CHARS], 0),
    Column("session", lambda v: v.session_id, 5),
    Column("call", lambda v: v.call_id, 4),
    Column("tool", lambda v: v.tool_name, 1),
    Column("effect", lambda v: v.effect_class, 7),
    Column("status", lambda v: v.status, 2),
    Column("outcome", outcome_text, 3),
    Column("attempts", lambda v: str(v.attempts), 8, "right"),
    Column("created (UTC)", lambda v: _moment(v.created_at), 6),
    Column("finished (UTC)", lambda v: _moment(v.finished_at), 9),
)
COLUMN_GAP = 2
"""Rich's padding between two cells of a box-less table (one each side)."""


def fitting_columns(views: list[CallView], width: int) -> list[Column]:
    """The columns that fit ``width`` whole, most important first, shown in their usual order.
    A cell never wraps: an id folded over two lines cannot be copied, so a column that does
    not fit is left out instead (--json has every field)."""
    from rich.cells import cell_len

    needed = {
        column.header: max(
            [cell_len(column.header)] + [cell_len(_plain(column.value(v)).plain) for v in views]
        )
        for column in LIST_COLUMNS
    }
    chosen: set[str] = set()
    used = -COLUMN_GAP
    for column in sorted(LIST_COLUMNS, key=lambda c: c.rank):
        extra = needed[column.header] + COLUMN_GAP
        if not chosen or used + extra <= width:
            chosen.add(column.header)
            used += extra
    return [column for column in LIST_COLUMNS if column.header in chosen]


def _print_table(page: CallPage) -> None:
    from rich.table import Table

    console = _console()
    if not page.calls:
        console.print(_plain("no calls match"))
        return
    columns = fitting_columns(page.calls, console.width)
    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in columns:
        # Never folded nor cut: a column that does not fit was left out above.
        table.add_column(column.header, no_wrap=True, overflow="ignore", justify=column.justify)
    for view in page.calls:
        table.add_row(
            *(_plain(column.value(view)) for column in columns),
            style="bold red" if view.needs_operator else None,
        )
    console.print(table)
    waiting = sum(view.needs_operator for view in page.calls)
    shown = f"{len(page.calls)} call(s)"
    if waiting:
        shown += f"; {waiting} with an unknown outcome (toolledger calls resolve ID ...)"
    console.print(_plain(shown), soft_wrap=True)
    left_out = [column.header for column in LIST_COLUMNS if column not in columns]
    if left_out:
        console.print(
            _plain(f"not shown at this width: {', '.join(left_out)} (widen the terminal, or --json)"),
            soft_wrap=True,
        )
    if page.next_cursor:
        # Soft-wrapped: the terminal folds it, so a copied cursor has no line breaks in it.
        console.print(_plain(f"more: --cursor {page.next_cursor}"), soft_wrap=True)


# ----------------------------------------------------------------------- stats


@calls.command("stats")
@filter_options
@click.option("--json", "as_json", is_flag=True, help="Print the counts as JSON.")
@database_option
def call_stats(filters: Filters, as_json: bool, database_url: str | None) -> None:
    """How many calls the filters match, by status and by outcome (a failure keeps its
    outcome after it is submitted; its stage says where it failed)."""
    query = filters.query()
    settings = settings_from(database_url=database_url)
    counts = execute(_counts(settings, query))
    if as_json:
        click.echo(counts.model_dump_json(indent=2))
        return
    click.echo(f"{counts.total} call(s)")
    for title, tally in (
        ("by status", counts.by_status),
        ("by outcome", counts.by_outcome),
        ("failed by stage", counts.failed_by_stage),
    ):
        if tally:
            parts = ", ".join(f"{name} {count}" for name, count in sorted(tally.items()))
            click.echo(f"{title}: {_plain(parts).plain}")


async def _counts(settings: Settings, query: CallQuery) -> CallCountsView:
    async with audit_service(settings) as service:
        return await service.counts(query)


# ------------------------------------------------------------------------ show


@calls.command("show")
@click.argument("reference")
@click.option("--json", "as_json", is_flag=True, help="Print the call and its timeline as JSON.")
@database_option
def show_call(reference: str, as_json: bool, database_url: str | None) -> None:
    """One call and its timeline. REFERENCE: its tl_ id (or a unique prefix of it, from tl_
    and 4 hex digits), SESSION/TURN/CALL, or its call id."""
    _check_text(reference, "REFERENCE")
    settings = settings_from(database_url=database_url)
    detail = execute(_show(settings, reference))
    if as_json:
        click.echo(detail.model_dump_json(indent=2))
    else:
        _print_detail(detail)


async def _show(settings: Settings, reference: str) -> CallDetail:
    async with audit_service(settings) as service:
        return await service.show(reference)


def _print_detail(detail: CallDetail) -> None:
    import json

    from rich.table import Table

    call = detail.call
    console = _console()
    fields = Table.grid(padding=(0, 2))
    fields.add_column(style="bold", no_wrap=True)
    fields.add_column(overflow="fold")
    status = _plain(call.status)
    if call.needs_operator:
        status = _plain(f"{call.status}: the outcome is unknown, resolve it with `toolledger calls resolve`")
        status.stylize("bold red")
    if call.needs_approval:
        status = _plain(
            f"{call.status}: approve it with `toolledger calls approve {call.call_id} --sha256 "
            f"{call.arguments_sha256}` or deny it with `toolledger calls deny`"
        )
        status.stylize("bold yellow")
    decided = (
        f"by {call.approval_decided_by} at {_precise(call.approval_decided_at)}"
        if call.approval_decided_by and call.approval_decided_at
        else None
    )
    rows: list[tuple[str, Text | str | None]] = [
        ("trail", _trail_state(detail)),
        ("call", f"{call.session_id}/{call.turn_id}/{call.call_id}"),
        ("id", call.id),
        ("tool", f"{call.tool_name} ({call.effect_class})"),
        ("status", status),
        ("attempts", str(call.attempts)),
        ("submissions", str(call.submissions)),
        ("created", _precise(call.created_at)),
        ("started", _precise(call.started_at) if call.started_at else None),
        ("finished", _precise(call.finished_at) if call.finished_at else None),
        ("submitted", _precise(call.submitted_at) if call.submitted_at else None),
        ("confirmed", _precise(call.confirmed_at) if call.confirmed_at else None),
        ("lease", _lease(call.status, call.lease_owner, call.lease_expires_at)),
        ("error", ": ".join(part for part in (call.error_stage, call.error_detail) if part) or None),
        ("abandoned", call.abandoned_reason),
        ("last submit error", call.last_submission_error),
        ("approval until", _precise(call.approval_expires_at) if call.approval_expires_at else None),
        ("approval decided", decided),
        # Its audit trail's chain head: `verify-trail` recomputes the chain up to it.
        ("trail head", detail.timeline[-1].sha256 if detail.timeline else None),
        ("arguments", json.dumps(call.arguments, indent=2, ensure_ascii=False)),
        ("arguments sha256", call.arguments_sha256),
        (
            "approved arguments",
            None
            if call.approved_arguments is None
            else json.dumps(call.approved_arguments, indent=2, ensure_ascii=False),
        ),
        ("result", None if call.result is None else json.dumps(call.result, indent=2, ensure_ascii=False)),
    ]
    for name, value in rows:
        if value is not None:
            fields.add_row(name, value if not isinstance(value, str) else _plain(value))
    console.print(fields)
    console.print()
    timeline = Table(title=_plain("timeline"), title_justify="left", header_style="bold", box=None)
    timeline.add_column("#", justify="right")
    timeline.add_column("at (UTC)", no_wrap=True)
    for name in ("actor", "event", "transition", "reason"):
        timeline.add_column(name, overflow="fold")
    for number, event in enumerate(detail.timeline, start=1):
        change = f"{event.from_status or 'new'} → {event.to_status}" if event.to_status else ""
        if event.lease_token is not None:
            change += f" (lease {event.lease_token})"
        reason = " | ".join(part for part in (event.reason, event.detail) if part)
        timeline.add_row(
            _plain(str(number)),
            _plain(_precise(event.at)),
            _plain(event.actor),
            _plain(event.kind),
            _plain(change.strip()),
            _plain(reason),
        )
    console.print(timeline)


def _trail_state(detail: CallDetail) -> Text:
    """Whether what `calls show` prints is what the call's trail recorded: said first, in red
    when it is not."""
    trail = detail.trail
    if not trail.intact:
        said = _plain(
            f"BROKEN ({trail.kind}): {trail.message}. What is shown below is NOT what the call's "
            "trail recorded (`toolledger calls verify-trail` names every break)"
        )
        said.stylize("bold red")
        return said
    last = detail.timeline[-1].id if detail.timeline else None
    said = _plain(
        f"intact; the content shown is what event {last} recorded"
        if trail.content_covered
        else "intact (its events predate content digests: the content shown is held to nothing)"
    )
    if trail.keyed is False:
        keyed = _plain(f"; keyed check FAILED: {trail.keyed_message}")
        keyed.stylize("bold red")
        said.append_text(keyed)
    elif trail.keyed:
        said.append("; every keyed MAC matches")
    return said


# ---------------------------------------------------------------------- export


@calls.command("export")
@filter_options
@click.option("--format", "fmt", type=click.Choice(["jsonl", "csv"]), default="jsonl", show_default=True)
@click.option(
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write to this file (default: standard output). It appears only once complete.",
)
@click.option("--progress", is_flag=True, help="Count exported calls on stderr (default: when a terminal).")
@click.option(
    "--no-digest",
    is_flag=True,
    help="Leave out the closing digest line (for tools that take only calls); the export can "
    "then not be checked by `verify-trail --export`.",
)
@database_option
def export_calls(
    filters: Filters,
    fmt: str,
    output: Path | None,
    progress: bool,
    no_digest: bool,
    database_url: str | None,
) -> None:
    """Every matching call, streamed as JSON lines or CSV (secret fields masked), each with
    its audit trail's chain head (trail_events, trail_sha256); the last line is the digest of
    every line before it. Check it later with `toolledger calls verify-trail --export FILE`."""
    query = filters.query()
    settings = settings_from(database_url=database_url)
    counter = ProgressLine("exported", enabled=progress or sys.stderr.isatty())
    with _sink(output) as sink:
        written = execute(_export(settings, query, fmt, sink, counter, digest=not no_digest))
    counter.done(written)


async def _export(
    settings: Settings, query: CallQuery, fmt: str, sink: IO[str], counter: ProgressLine, *, digest: bool
) -> int:
    written = 0
    async with audit_service(settings) as service:
        async for line in service.export(query, fmt, digest=digest):
            sink.write(line.text)
            if line.is_call:
                written += 1
                counter.update(written)
    return written


# ----------------------------------------------------------------- verify-trail


@calls.command("verify-trail")
@click.argument("reference", required=False)
@click.option("--session", "session_id", default=None, help="Every call of this session.")
@click.option("--all", "whole_ledger", is_flag=True, help="Every call in the ledger.")
@click.option(
    "--export",
    "export_file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="The calls of an earlier `calls export` (jsonl or csv): the file must be whole, and each "
    "call's trail must still begin with the chain head the export recorded.",
)
@click.option(
    "--keyed",
    is_flag=True,
    help="Also check every event's keyed MAC with TOOLLEDGER_TRAIL_KEY: what someone who can write "
    "the database cannot recompute. An event without one (written before the key was set) is a break.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option(
    "--progress/--no-progress",
    default=None,
    help="Count verified calls on stderr (default: with --all or --export, on a terminal).",
)
@database_option
def verify_trail(
    reference: str | None,
    session_id: str | None,
    whole_ledger: bool,
    export_file: Path | None,
    keyed: bool,
    as_json: bool,
    progress: bool | None,
    database_url: str | None,
) -> None:
    """Recompute the audit trail's hash chains and report the first broken link of each
    broken call (an edited, deleted, inserted or reordered event, or a call whose stored
    content was changed after its last event). One call (REFERENCE: its tl_ id,
    SESSION/TURN/CALL or its call id), --session ID, --all, or --export FILE. Exits 1 if any
    trail is broken (or the export file changed), 0 when all are intact."""
    given = [reference is not None, session_id is not None, whole_ledger, export_file is not None]
    if sum(given) != 1:
        raise click.UsageError("give exactly one of REFERENCE, --session ID, --all or --export FILE")
    _check_text(reference, "REFERENCE")
    _check_text(session_id, "--session")
    settings = settings_from(database_url=database_url)
    wide = whole_ledger or export_file is not None
    counter = ProgressLine(
        "verified", enabled=progress if progress is not None else wide and sys.stderr.isatty()
    )
    report = execute(
        _verify_trail(
            settings, reference, session_id, export_file, counter, keyed=keyed, listed_live=not as_json
        )
    )
    counter.done(report.calls)
    if as_json:
        click.echo(report.model_dump_json(indent=2))
    else:
        _print_trail_report(report)
    if not report.intact:
        click.get_current_context().exit(1)


async def _verify_trail(
    settings: Settings,
    reference: str | None,
    session_id: str | None,
    export_file: Path | None,
    counter: ProgressLine,
    *,
    keyed: bool,
    listed_live: bool,
) -> TrailReport:
    """The report; with ``listed_live`` each broken call is printed as it is found (not kept)."""
    from toolledger.audit.trail import TrailCheck

    done = 0

    def checked(check: TrailCheck) -> None:
        nonlocal done
        done += 1
        counter.update(done)
        if listed_live and check.found is not None:
            click.echo(_plain(f"broken: {check.key}: {check.found.message}").plain)

    kept = 0 if listed_live else None
    async with audit_service(settings) as service:
        if export_file is not None:
            return await service.verify_export(export_file, keyed=keyed, max_listed=kept, on_check=checked)
        scope = await service.trail_scope(reference, session_id=session_id)
        return await service.verify_trail(scope, keyed=keyed, max_listed=kept, on_check=checked)


def _print_trail_report(report: TrailReport) -> None:
    from toolledger.audit.trail import ExportReport

    if isinstance(report, ExportReport):
        if report.file_whole:
            click.echo(f"export file whole: its {report.exported_calls} call(s) hash to its digest line")
        else:
            click.echo(
                f"export file CHANGED: what precedes its digest line hashes to {report.computed_sha256}, "
                f"the line records {report.export_sha256} for {report.exported_calls} call(s)"
            )
        if report.missing:
            shown = ", ".join(report.missing[:MISSING_SHOWN])
            more = (
                f" and {len(report.missing) - MISSING_SHOWN} more"
                if len(report.missing) > MISSING_SHOWN
                else ""
            )
            click.echo(
                _plain(
                    f"{len(report.missing)} call(s) of the export are no longer in the ledger (pruned "
                    f"since, or deleted): {shown}{more}"
                ).plain
            )
    for listed in report.breaks:
        key = f"{listed.session_id}/{listed.turn_id}/{listed.call_id}"
        click.echo(_plain(f"broken: {key}: {listed.message}").plain)
    if report.content_not_covered:
        click.echo(
            f"{report.content_not_covered} call(s) have only events written before content digests were "
            "kept (migration 0010): their stored content is held to nothing"
        )
    keyed = ", every keyed MAC checked" if report.keyed else ""
    checked = f"{report.calls} call(s), {report.events} event(s) recomputed{keyed} ({report.scope})"
    if report.broken:
        click.echo(_plain(f"trail BROKEN: {report.broken} of {checked}").plain)
    elif report.intact:
        click.echo(_plain(f"trail intact: {checked}").plain)
    else:
        click.echo(_plain(f"every trail intact, but the export file changed: {checked}").plain)


MISSING_SHOWN = 10


@contextlib.contextmanager
def _sink(output: Path | None) -> Iterator[IO[str]]:
    """Standard output, or a file that gets its name only once the export is complete: an
    interrupted export never leaves a file that looks whole."""
    if output is None:
        yield sys.stdout
        sys.stdout.flush()
        return
    partial = output.with_name(output.name + ".partial")
    try:
        file = partial.open("w", encoding="utf-8", newline="")
    except OSError as error:
        raise click.FileError(str(output), hint=error.strerror or str(error)) from None
    try:
        with file:
            yield file
        partial.replace(output)
    finally:
        partial.unlink(missing_ok=True)


class ProgressLine:
    """A count on stderr, rewritten in place on a terminal, a line at a time otherwise."""

    def __init__(self, verb: str, *, enabled: bool) -> None:
        self.verb = verb
        self.enabled = enabled
        self.live = sys.stderr.isatty()
        self._shown_at = time.monotonic()
        # On a terminal each count overwrites the last one.
        self._start = "\r" if self.live else ""

    def update(self, count: int) -> None:
        if not self.enabled or time.monotonic() - self._shown_at < PROGRESS_EVERY_SECONDS:
            return
        self._shown_at = time.monotonic()
        click.echo(f"{self._start}{self.verb} {count} call(s)", err=True, nl=not self.live)

    def done(self, count: int) -> None:
        if self.enabled:
            click.echo(f"{self._start}{self.verb} {count} call(s)", err=True)


# --------------------------------------------------------------------- resolve


RESOLVE_MESSAGES = {
    "submitted": "{verb}, and its result was submitted: the session has it",
    "abandoned": "{verb}, but the session no longer awaits it: abandoned",
    "submit_failed": "{verb}; the submission failed for now and is retried by `toolledger serve`",
    "not_sent": "{verb}; no Agents API is configured here, `toolledger serve` submits it",
    "rerun": "ran again here, and its result was submitted",
    "rerunning": "re-opened, and being run again in the background: follow the call",
    "left_for_service": "re-opened or approved: `toolledger serve` runs it (or another worker took it first)",
    "ran": "approved, run here, and its result submitted",
}


@calls.command("resolve")
@click.argument("reference", required=False)
@click.option(
    "--filter",
    "bulk",
    is_flag=True,
    help="Resolve every unknown call the filter flags (--tool, --session, --since, ...) select, "
    "instead of one REFERENCE: one audit event per call, verified tools' hooks asked first "
    "(give --tools), at --rate calls per second, a summary at the end.",
)
@filter_options
@click.option("--dry-run", is_flag=True, help="With --filter: show what would be resolved, change nothing.")
@click.option(
    "--rate",
    type=float,
    default=5.0,
    show_default=True,
    help="With --filter: calls resolved per second at most.",
)
@click.option("--yes", is_flag=True, help="With --filter: do not ask for confirmation.")
@click.option("--output", "output_text", default=None, help="It happened: the output the model is given.")
@click.option("--error", "error_text", default=None, help="It did not happen: the error the model is given.")
@click.option("--rerun", is_flag=True, help="A second run is safe: run the call again.")
@click.option("--reason", required=True, help="Why (kept in the audit trail).")
@click.option("--operator", default=None, help="Who resolves it (default: $USER or the login name).")
@click.option(
    "--tools",
    "tools_reference",
    default=None,
    envvar="TOOLLEDGER_TOOLS",
    help="With --rerun: the application's tools, to run the call here (else `serve` runs it); "
    "with --filter: also to ask verified tools' hooks first.",
)
@click.option("--json", "as_json", is_flag=True, help='Print {"action": ..., "call": ...} as JSON.')
@database_option
@base_url_option
@click.option("--log-level", type=LOG_LEVELS, default="warning", show_default=True)
def resolve_call(
    reference: str | None,
    bulk: bool,
    filters: Filters,
    dry_run: bool,
    rate: float,
    yes: bool,
    output_text: str | None,
    error_text: str | None,
    rerun: bool,
    reason: str,
    operator: str | None,
    tools_reference: str | None,
    as_json: bool,
    database_url: str | None,
    base_url: str | None,
    log_level: str,
) -> None:
    """Settle a call whose outcome is unknown: say what happened (--output or --error), or
    allow it to run again (--rerun). The result is submitted to the session right away.
    With --filter instead of REFERENCE: every unknown call the filter flags select.

    --rerun without --tools re-opens the call for `serve` and returns at once. With --tools it
    runs here and waits, saying on stderr every few seconds how long it has run: at most the
    tool's timeout (TOOLLEDGER_HANDLER_TIMEOUT_SECONDS unless the tool declares one), then
    the submission."""
    from toolledger.audit.service import Resolution, ResolutionKind

    if (reference is None) == (not bulk):
        raise click.UsageError("give a REFERENCE, or --filter with filter flags (--tool, --session, ...)")
    if not bulk and (dry_run or yes or filters.narrows):
        raise click.UsageError("--dry-run, --yes and the filter flags are for --filter")
    if bulk and not filters.narrows:
        raise click.UsageError("--filter needs at least one filter flag (--tool, --session, --since, ...)")

    chosen = [
        kind
        for kind, given in (
            (ResolutionKind.OUTPUT, output_text is not None),
            (ResolutionKind.ERROR, error_text is not None),
            (ResolutionKind.RERUN, rerun),
        )
        if given
    ]
    if len(chosen) != 1:
        raise click.UsageError("give exactly one of --output TEXT, --error MESSAGE or --rerun")
    if tools_reference is not None and not rerun and not bulk:
        raise click.UsageError("--tools is for --rerun: an output or error runs nothing")
    for hint, value in (
        ("REFERENCE", reference),
        ("--output", output_text),
        ("--error", error_text),
        ("--reason", reason),
        ("--operator", operator),
    ):
        _check_text(value, hint)
    try:
        resolution = Resolution(
            kind=chosen[0],
            operator=operator if operator is not None else _login_name(),
            reason=reason,
            text=output_text if output_text is not None else error_text,
        )
    except QueryError as error:
        raise click.UsageError(str(error)) from None
    registry = load_tools(tools_reference) if tools_reference is not None else None
    settings = settings_from(database_url=database_url, openai_base_url=base_url)
    configure_logging(log_level, settings)
    if bulk:
        query = filters.query()
        _bulk_resolve(
            settings, query, resolution, registry, dry_run=dry_run, rate=rate, yes=yes, as_json=as_json
        )
        return
    assert reference is not None
    _print_report(execute(_resolve(settings, reference, resolution, registry)), as_json, "resolved")


def _bulk_resolve(
    settings: Settings,
    query: CallQuery,
    resolution: Resolution,
    registry: ToolRegistry | None,
    *,
    dry_run: bool,
    rate: float,
    yes: bool,
    as_json: bool,
) -> None:
    from toolledger.audit.bulk import BulkResolver

    async def count() -> int:
        async with audit_service(settings, registry=registry) as service:
            return len(await BulkResolver(service, rate=rate).matching(query))

    if not dry_run and not yes:
        matched = execute(count())
        if matched == 0:
            click.echo("no unknown call matches the filter: nothing to resolve")
            return
        if not sys.stdin.isatty():
            raise click.UsageError(f"resolving {matched} call(s) needs confirmation: pass --yes")
        click.confirm(f"resolve {matched} unknown call(s) by {resolution.kind.value}?", abort=True)

    def progress(done: int, total: int, item: BulkItem) -> None:
        if sys.stderr.isatty() or not as_json:
            view = item.call
            note = f" ({item.note})" if item.note else ""
            click.echo(
                f"[{done}/{total}] {view.session_id}/{view.turn_id}/{view.call_id} {view.tool_name}: "
                f"{item.action}{note}",
                err=True,
            )

    resolvers: list[BulkResolver] = []

    async def run() -> BulkReport:
        async with audit_service(settings, registry=registry) as service:
            resolvers.append(BulkResolver(service, rate=rate))
            return await resolvers[0].resolve(query, resolution, dry_run=dry_run, progress=progress)

    try:
        report = execute(run())
    except KeyboardInterrupt:
        # Ctrl-C: the call under way was finished first (BulkResolver); say how far it went.
        _say_interrupted(resolvers[0].report if resolvers else None)
        sys.exit(130)
    if as_json:
        import json

        document = {
            "run_id": report.run_id,
            "dry_run": report.dry_run,
            "matched": report.matched,
            "counts": report.counts,
            "calls": [
                {"action": item.action, "note": item.note, "call": item.call.model_dump(mode="json")}
                for item in report.items
            ],
        }
        click.echo(json.dumps(document, indent=2))
        return
    what = "would be resolved (dry run: nothing changed)" if dry_run else f"resolved (bulk {report.run_id})"
    click.echo(f"{report.matched} unknown call(s) matched; {what}:")
    for action, number in sorted(report.counts.items()):
        click.echo(f"  {action}: {number}")


def _say_interrupted(report: BulkReport | None) -> None:
    """``interrupted: N resolved, M left (bulk RUN_ID)`` on stderr, with what to do next."""
    if report is None:
        click.echo("interrupted before any call was resolved: nothing changed", err=True)
        return
    if report.dry_run:
        click.echo("interrupted (dry run: nothing changed)", err=True)
        return
    skipped = f"{report.skipped} skipped, " if report.skipped else ""
    click.echo(
        f"interrupted: {report.done - report.skipped} resolved, {skipped}{report.left} left "
        f"(bulk {report.run_id}, named in each resolved call's reason); run the same command "
        "again to resolve the rest",
        err=True,
    )


RERUN_PROGRESS_SECONDS = 5.0
"""How often a re-run run here says, on stderr, that it is still under way."""


async def _resolve(
    settings: Settings, reference: str, resolution: Resolution, registry: ToolRegistry | None
) -> ResolveReport:
    """The resolution, once done. A re-run with ``--tools`` runs the handler in this process
    and waits for it, saying every few seconds on stderr how long it has run: at most the
    tool's timeout (its ``timeout``, else TOOLLEDGER_HANDLER_TIMEOUT_SECONDS; a sync handler
    that passes it is left to its thread, which ends with this process), then the submission.
    Without ``--tools`` the call is re-opened for `serve` and the command returns at once."""
    from toolledger.audit.service import ResolutionKind

    async with audit_service(settings, registry=registry) as service:
        if resolution.kind is not ResolutionKind.RERUN or registry is None:
            return await service.resolve(reference, resolution)
        call = await service.find_one(reference)
        tool = registry.get(call.tool_name)
        bound = settings.handler_timeout_seconds
        if tool is not None and tool.timeout is not None:
            bound = tool.timeout
        resolving = asyncio.ensure_future(service.resolve(reference, resolution))
        started = time.monotonic()
        while True:
            done, _ = await asyncio.wait({resolving}, timeout=RERUN_PROGRESS_SECONDS)
            if done:
                return resolving.result()
            state = next(
                (run.describe() for run in service.runtime.handler_threads().runs() if run.key == call.key),
                f"running for {time.monotonic() - started:.0f}s",
            )
            click.echo(
                f"re-running {call.key} ({call.tool_name}): {state}; it times out after {bound:g}s",
                err=True,
            )


# -------------------------------------------------------------- approve / deny

_DECISION_OPTIONS = [
    click.argument("reference"),
    click.option("--reason", required=True, help="Why (kept in the audit trail)."),
    click.option("--operator", default=None, help="Who decides (default: $USER or the login name)."),
    click.option(
        "--sha256",
        "arguments_sha256",
        default=None,
        help="The arguments' fingerprint you looked at (`calls show`): refused if the call's are other.",
    ),
    click.option("--json", "as_json", is_flag=True, help='Print {"action": ..., "call": ...} as JSON.'),
    database_option,
    base_url_option,
    click.option("--log-level", type=LOG_LEVELS, default="warning", show_default=True),
]


def _decision_options(command: Callable[..., None]) -> Callable[..., None]:
    for option in reversed(_DECISION_OPTIONS):
        command = option(command)
    return command


EXIT_NOT_APPROVED_IN_TIME = 3
"""`calls approve` (or `deny`) of a call whose approval deadline has passed: it never runs."""


class NotApprovedInTime(click.ClickException):
    """Refused: the call's approval deadline passed (exit 3, apart from other refusals' 1)."""

    exit_code = EXIT_NOT_APPROVED_IN_TIME


@calls.command("approve")
@_decision_options
@click.option(
    "--arguments",
    "amended_arguments",
    default=None,
    help="JSON object: amended arguments the handler receives instead of the model's (both are "
    "kept). Checked against the tool's parameters first: needs --tools.",
)
@click.option(
    "--tools",
    "tools_reference",
    default=None,
    envvar="TOOLLEDGER_TOOLS",
    help="The application's tools, to run the call here (else `serve` runs it within a second) "
    "and to check amended arguments.",
)
@click.option(
    "--yes",
    is_flag=True,
    help="Do not show the arguments and ask: only with --sha256, the arguments you saw.",
)
def approve_call(
    reference: str,
    reason: str,
    operator: str | None,
    arguments_sha256: str | None,
    as_json: bool,
    database_url: str | None,
    base_url: str | None,
    log_level: str,
    amended_arguments: str | None,
    tools_reference: str | None,
    yes: bool,
) -> None:
    """Approve a call awaiting approval: it runs once (here with --tools, else in `serve`).

    The approval is bound to the arguments you saw: give their sha256 (--sha256, as `calls
    show` prints it beside them), or leave it out on a terminal to be shown them and asked
    (the fingerprint of what was shown is used). Past the call's deadline it is refused, exit 3.
    """
    if arguments_sha256 is None and yes:
        raise click.UsageError(
            "--yes approves without showing the arguments: give --sha256 with it (the fingerprint "
            "`toolledger calls show` prints beside the arguments)"
        )
    if arguments_sha256 is None and not _on_terminal():
        raise click.UsageError(
            "an approval is bound to the arguments you saw: give --sha256 (from `toolledger calls "
            "show REFERENCE`), or run it on a terminal to be shown them and asked"
        )
    decision = _decision(reference, reason, operator, arguments_sha256, amended_arguments)
    registry = load_tools(tools_reference) if tools_reference is not None else None
    settings = settings_from(database_url=database_url, openai_base_url=base_url)
    configure_logging(log_level, settings)
    report = execute(_approve(settings, reference, decision, registry, ask=arguments_sha256 is None))
    _print_report(report, as_json, "approved")


def _on_terminal() -> bool:
    """Someone is there to be shown the arguments and to answer."""
    return sys.stdin.isatty()


async def _approve(
    settings: Settings, reference: str, decision: Decision, registry: ToolRegistry | None, *, ask: bool
) -> ResolveReport:
    """The approval; with ``ask``, first the call's arguments shown (masked, as every view shows
    them) and a yes asked for, then approved by the fingerprint of what was shown."""
    from toolledger.audit.service import NotApprovedInTimeError
    from toolledger.domain.keys import CallKey

    target: str | CallReference = reference
    async with audit_service(settings, registry=registry) as service:
        if ask:
            call = (await service.show(reference)).call
            if call.needs_approval:
                _show_for_approval(call, decision.amended_arguments)
                question = f"approve {call.tool_name} {call.call_id} with these arguments?"
                if not await asyncio.to_thread(click.confirm, question, default=False, err=True):
                    raise click.ClickException("not approved: nothing changed")
            decision = replace(decision, arguments_sha256=call.arguments_sha256)
            target = CallReference(key=CallKey(call.session_id, call.turn_id, call.call_id))
        try:
            return await service.approve(target, decision)
        except NotApprovedInTimeError as error:
            raise NotApprovedInTime(str(error)) from None


def _show_for_approval(call: CallView, amended: str | None) -> None:
    """What is approved, on stderr (stdout keeps the report, --json included)."""
    import json

    deadline = (
        f"{_precise(call.approval_expires_at)} UTC (then the model is told it was not approved in time)"
        if call.approval_expires_at
        else "none: it waits until someone decides"
    )
    lines = [
        f"call {call.session_id}/{call.turn_id}/{call.call_id} ({call.id}) awaits approval: {call.tool_name}",
        "arguments (secret fields masked):",
        json.dumps(call.arguments, indent=2, ensure_ascii=False, sort_keys=True),
        f"arguments sha256: {call.arguments_sha256}",
        f"deadline: {deadline}",
    ]
    if amended is not None:
        lines += ["amended arguments (what the handler receives instead):", amended]
    for line in lines:
        click.echo(_escaped(line), err=True)


@calls.command("deny")
@_decision_options
def deny_call(
    reference: str,
    reason: str,
    operator: str | None,
    arguments_sha256: str | None,
    as_json: bool,
    database_url: str | None,
    base_url: str | None,
    log_level: str,
) -> None:
    """Deny a call awaiting approval: it never runs; the model gets your reason as its failure."""
    decision = _decision(reference, reason, operator, arguments_sha256, None)
    settings = settings_from(database_url=database_url, openai_base_url=base_url)
    configure_logging(log_level, settings)
    _print_report(execute(_decide(settings, "deny", reference, decision, None)), as_json, "denied")


def _decision(
    reference: str, reason: str, operator: str | None, arguments_sha256: str | None, amended: str | None
) -> Decision:
    from toolledger.audit.service import Decision

    for hint, value in (
        ("REFERENCE", reference),
        ("--reason", reason),
        ("--operator", operator),
        ("--sha256", arguments_sha256),
        ("--arguments", amended),
    ):
        _check_text(value, hint)
    try:
        return Decision(
            operator=operator if operator is not None else _login_name(),
            reason=reason,
            arguments_sha256=arguments_sha256,
            amended_arguments=amended,
        )
    except QueryError as error:
        raise click.UsageError(str(error)) from None


async def _decide(
    settings: Settings, verb: str, reference: str, decision: Decision, registry: ToolRegistry | None
) -> ResolveReport:
    from toolledger.audit.service import NotApprovedInTimeError

    async with audit_service(settings, registry=registry) as service:
        try:
            if verb == "approve":
                return await service.approve(reference, decision)
            return await service.deny(reference, decision)
        except NotApprovedInTimeError as error:
            raise NotApprovedInTime(str(error)) from None


def _print_report(report: ResolveReport, as_json: bool, verb: str) -> None:
    if as_json:
        import json

        click.echo(
            json.dumps({"action": str(report.action), "call": report.call.model_dump(mode="json")}, indent=2)
        )
        return
    call = report.call
    message = RESOLVE_MESSAGES[report.action].format(verb=verb)
    click.echo(f"{call.session_id}/{call.turn_id}/{call.call_id}: {message}")
    click.echo(f"action: {report.action}; status: {call.status}")


def _login_name() -> str:
    name = os.environ.get("USER")
    if name:
        return name
    try:
        return getpass.getuser()
    except (OSError, KeyError):
        raise click.UsageError("who resolves it? give --operator NAME") from None


# ----------------------------------------------------------------------- prune


@calls.command("prune")
@click.option("--older-than", required=True, help="Finished at least this long ago: 90d, 12h, 30m.")
@click.option("--dry-run", is_flag=True, help="Only count what would be deleted.")
@click.option("--yes", is_flag=True, help="Do not ask for confirmation (required when not on a terminal).")
@database_option
def prune_calls(older_than: str, dry_run: bool, yes: bool, database_url: str | None) -> None:
    """Delete finished calls (submitted or abandoned) and their audit trails. Calls still open
    (pending, running, unknown, with an unsubmitted result) are never deleted."""
    age = _parsed("--older-than", parse_duration, older_than)
    if age <= timedelta(0):
        raise click.BadParameter("must be a positive duration", param_hint="--older-than")
    settings = settings_from(database_url=database_url)
    if dry_run:
        count = execute(_prune(settings, age, dry_run=True))
        click.echo(f"{count} finished call(s) older than {older_than} would be deleted (dry run)")
        return
    if not yes:
        if not sys.stdin.isatty():
            raise click.UsageError(
                "deleting needs confirmation: pass --yes (standard input is not a terminal)"
            )
        count = execute(_prune(settings, age, dry_run=True))
        if count == 0:
            click.echo(f"no finished call older than {older_than}")
            return
        click.confirm(
            f"delete {count} finished call(s) older than {older_than}, with their audit trails?", abort=True
        )
    counter = ProgressLine("deleted", enabled=sys.stderr.isatty())
    removed = execute(_prune(settings, age, dry_run=False, progress=counter.update))
    click.echo(f"deleted {removed} finished call(s) older than {older_than}")


async def _prune(
    settings: Settings, age: timedelta, *, dry_run: bool, progress: Callable[[int], None] | None = None
) -> int:
    async with audit_service(settings) as service:
        return await service.prune(age, dry_run=dry_run, progress=progress)


# -------------------------------------------------------------------- sessions


def show_session(session_id: str, *, as_json: bool, database_url: str | None) -> None:
    """`toolledger sessions show`: the session's watch state, who follows it under which lease,
    its last poll, and its calls with their status and outcome."""
    import json

    _check_text(session_id, "SESSION")
    try:
        query = CallQuery(session_id=session_id, sort=SortKey.CREATED, descending=False, limit=MAX_PAGE)
    except QueryError as error:
        raise click.BadParameter(str(error), param_hint="SESSION") from None
    settings = settings_from(database_url=database_url)
    record, page, counts = execute(_session(settings, query))
    if record is None and not page.calls:
        raise click.ClickException(f"no session {session_id!r} in the ledger")
    state = _session_state(record)
    if as_json:
        document = {
            "session_id": session_id,
            **state,
            "counts": counts.model_dump(mode="json"),
            "calls": [view.model_dump(mode="json") for view in page.calls],
            "more_calls": page.next_cursor is not None,
        }
        click.echo(json.dumps(document, indent=2, ensure_ascii=False))
        return
    console = _console()
    console.print(_plain(f"session {session_id}"), soft_wrap=True)
    if record is None:
        console.print(_plain("watched: never (its calls are in the ledger)"))
    else:
        why = f" ({record.reason})" if record.reason else ""
        console.print(_plain(f"watched: {'yes' if record.watched else 'no'}{why}"), soft_wrap=True)
        console.print(_plain(f"status: {record.status or '-'}"), soft_wrap=True)
        console.print(_plain(f"owner: {state['lease']}"), soft_wrap=True)
        polled = _precise(record.last_polled_at) if record.last_polled_at else "never"
        console.print(_plain(f"last poll (UTC): {polled}"), soft_wrap=True)
    tally = ", ".join(f"{name} {count}" for name, count in sorted(counts.by_status.items()))
    outcomes = ", ".join(f"{name} {count}" for name, count in sorted(counts.by_outcome.items()))
    console.print(_plain(f"calls: {counts.total} ({tally}); outcomes: {outcomes}"), soft_wrap=True)
    if page.calls:
        _print_table(page)


async def _session(
    settings: Settings, query: CallQuery
) -> tuple[SessionRecord | None, CallPage, CallCountsView]:
    assert query.session_id is not None
    async with audit_service(settings) as service:
        record = await service.sessions.get(query.session_id)
        return record, await service.list_calls(query), await service.counts(query)


def _session_state(record: SessionRecord | None) -> dict[str, Any]:
    if record is None:
        return {
            "watched": None,
            "status": None,
            "reason": None,
            "owner": None,
            "lease": "none",
            "lease_expires_at": None,
            "last_polled_at": None,
            "last_event_id": None,
        }
    expires = record.lease_expires_at
    live = record.owner is not None and expires is not None and expires > datetime.now(UTC)
    if live:
        assert expires is not None
        lease = f"{record.owner} until {_precise(expires)}"
    elif record.owner is not None:
        lease = f"none (the lease of {record.owner} has expired)"
    else:
        lease = "none"
    return {
        "watched": record.watched,
        "status": record.status,
        "reason": record.reason,
        "owner": record.owner if live else None,
        "lease": lease,
        "lease_expires_at": expires.isoformat() if expires else None,
        "last_polled_at": iso(record.last_polled_at),
        "last_event_id": record.last_event_id,
    }


# ------------------------------------------------------------------- plumbing


def execute(coroutine: Coroutine[Any, Any, T]) -> T:
    """``run`` (toolledger errors and an unreachable database: one line, exit 1), plus: input
    the audit core refuses, or a reference naming several calls, is a usage error (exit 2).
    (A pipe closed early, ``| head``, is click's to handle: it exits quietly.)"""
    from toolledger.audit.service import AmbiguousCallError

    async def guarded() -> T:
        try:
            return await coroutine
        except AmbiguousCallError as error:
            raise QueryError(str(error)) from None

    try:
        return run(guarded())
    except QueryError as error:
        raise click.UsageError(str(error)) from None


@contextlib.asynccontextmanager
async def audit_service(
    settings: Settings, *, registry: ToolRegistry | None = None
) -> AsyncIterator[AuditService]:
    """An AuditService over the configured ledger; a resolution is submitted to the Agents API
    when one is configured (the gateway, and the SDK with it, is built only then)."""
    from toolledger.audit.service import AuditService

    missing = missing_sqlite_file(settings.database_url)
    if missing is not None:
        raise click.ClickException(f"no ledger file at {missing} (`toolledger migrate` creates one)")
    async with ledger_runtime(settings) as runtime:
        yield AuditService(runtime, registry=registry)


def _console() -> Console:
    from rich.console import Console

    # Piped into a file or another program, nothing is folded or cut: the width is the
    # content's (unless COLUMNS says otherwise). markup and highlighting off: ids and tool
    # names are data, never formatting.
    width = None if sys.stdout.isatty() or os.environ.get("COLUMNS") else UNLIMITED_WIDTH
    return Console(markup=False, highlight=False, emoji=False, width=width)


def _plain(text: str) -> Text:
    """Text as data: control and format characters (escape sequences, bidi overrides) shown
    as escapes, so a hostile id cannot redraw the terminal."""
    from rich.text import Text

    return Text(_escaped(text))


def _escaped(text: str) -> str:
    """``text`` with its control and format characters (but line breaks) shown as escapes."""
    return "".join(
        repr(char)[1:-1] if unicodedata.category(char) in ("Cc", "Cf") and char != "\n" else char
        for char in text
    )


def _lease(status: str, owner: str | None, expires_at: datetime | None) -> str | None:
    """The lease while the call runs under it. A finished call keeps its last owner's name,
    and an expired lease names a worker that may be long dead: neither holds the call."""
    if owner is None or status != CallStatus.RUNNING.value:
        return None
    if expires_at is None:
        return owner
    if expires_at <= datetime.now(UTC):
        return f"expired at {_precise(expires_at)} (held by {owner})"
    return f"{owner} until {_precise(expires_at)}"


def _precise(moment: datetime) -> str:
    """To the microsecond: a call's steps are often within the same second."""
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")


def _moment(moment: datetime | None) -> str:
    if moment is None:
        return ""
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")
