"""`toolledger calls` end to end: the real command (in process through click, and as a
subprocess where the process itself is under test) against a ledger filled by real
executions on SQLite and PostgreSQL, answering through the emulator over HTTP.

A fill runs `toolledger serve` twice (one SIGKILLed) and costs seconds, so the ledger is
filled once per database for this module. Tests that change it (resolving, adding calls)
compare with the database as it is when they run, never with a remembered picture; pruning
runs on a copy of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import hashlib
import io
import json
import sqlite3
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta, timezone
from pathlib import Path
from typing import Any

import psycopg
from click.testing import CliRunner
from psycopg import sql
from sqlalchemy.engine import make_url

from tests.support.calls_cli import (
    EVERY,
    FINISHED,
    Ledger,
    add_unknown_call,
    cli,
    error_line,
    ids,
    listed,
    ok,
)
from tests.support.ledger_fill import charge_only_script
from tests.support.ordering import listing_order
from tests.support.polling import eventually
from tests.support.serve_process import run_cli
from tests.support.shop_tools import CANARY
from tests.support.workload import start_sessions
from toolledger.audit.service import CSV_COLUMNS
from toolledger.cli import main
from toolledger.domain.keys import CallKey
from toolledger.domain.redaction import MASK
from toolledger.gateway.agents import AgentsGateway

# -------------------------------------------------------------------------------- list


def test_list__each_filter_matches_the_ledger(ledger: Ledger) -> None:
    rows = ledger.rows()
    assert any(CANARY in (r.result or "") + r.arguments for r in rows), "the canary must be stored"
    session = ledger.filled.session_ids[0]
    turn = next(r.turn_id for r in rows if r.session_id == session)
    moments = sorted({r.created_at for r in rows})
    middle = moments[len(moments) // 2]
    elsewhere = timezone(timedelta(hours=5, minutes=30))

    def where(predicate: Any) -> set[str]:
        return {r.idempotency_key for r in rows if predicate(r)}

    def searched(text: str) -> set[str]:
        needle = text.lower()
        return where(
            lambda r: any(needle in v.lower() for v in (r.tool_name, r.session_id, r.turn_id, r.call_id))
        )

    cases: list[tuple[tuple[str, ...], set[str]]] = [
        ((), where(lambda r: True)),
        (("--session", session), where(lambda r: r.session_id == session)),
        (("--turn", turn), where(lambda r: r.turn_id == turn)),
        (
            ("--tool", "lookup_order", "--tool", "send_receipt"),
            where(lambda r: r.tool_name in ("lookup_order", "send_receipt")),
        ),
        (("--status", "submitted"), where(lambda r: r.status == "submitted")),
        (
            ("--status", "unknown,abandoned", "--status", "PENDING"),
            where(lambda r: r.status in ("unknown", "abandoned", "pending")),
        ),
        (("--unknown",), where(lambda r: r.status == "unknown")),
        (("--unknown", "--status", "unknown"), where(lambda r: r.status == "unknown")),
        (("--effect-class", "read_only"), where(lambda r: r.effect_class == "read_only")),
        (
            ("--effect-class", "at_most_once,idempotent"),
            where(lambda r: r.effect_class in ("at_most_once", "idempotent")),
        ),
        (("--since", middle.isoformat()), where(lambda r: r.created_at >= middle)),
        (("--until", middle.isoformat()), where(lambda r: r.created_at < middle)),
        # The same moment written in another zone selects the same calls.
        (
            ("--since", middle.astimezone(elsewhere).isoformat()),
            where(lambda r: r.created_at >= middle),
        ),
        (("--since", "1h"), where(lambda r: True)),
        (("--until", "1h"), set()),
        (("--search", session[5:17].upper()), searched(session[5:17])),
        (("--search", "_order"), searched("_order")),
        (("--search", "%"), set()),
        (
            ("--session", session, "--tool", "lookup_order", "--status", "submitted"),
            where(
                lambda r: (
                    r.session_id == session and r.tool_name == "lookup_order" and r.status == "submitted"
                )
            ),
        ),
    ]
    for args, expected in cases:
        got = ids(listed(ledger.url, *args))
        assert len(got) == len(set(got)), args
        assert set(got) == expected, args
    # None of the filters above was vacuous where it should select something.
    for args, expected in cases[:11]:
        assert expected, args
    assert ledger.filled.unknown.idempotency_key in ids(listed(ledger.url, "--unknown"))

    # Newest first by default, ties broken by the call's key.
    assert ids(listed(ledger.url)) == listing_order(rows)
    assert ids(listed(ledger.url, "--sort", "created")) == listing_order(rows, descending=False)


def test_list__the_table_shows_every_call_and_highlights_unknown_ones(ledger: Ledger) -> None:
    rows = ledger.rows()
    table = ok(ledger.url, "list").stdout
    header, *lines = table.splitlines()
    for column in ("id", "session", "call", "tool", "effect", "status", "attempts", "created", "finished"):
        assert column in header
    for row in rows:
        (line,) = [line for line in lines if row.idempotency_key[:15] in line]
        for value in (row.session_id, row.call_id, row.tool_name, row.effect_class, row.status):
            # (A hostile id of another test is shown escaped: see the hostile filters' test.)
            assert value in line or not value.isprintable(), (value, line)
    waiting = sum(r.status == "unknown" for r in rows)
    assert waiting, "the filled ledger holds an unknown call until the resolve tests"
    assert f"{len(rows)} call(s); {waiting} with an unknown outcome" in table
    assert "more:" not in table

    colored = ok(ledger.url, "list", env={"FORCE_COLOR": "1", "TERM": "xterm"}).stdout
    for row in rows:
        (line,) = [line for line in colored.splitlines() if row.idempotency_key[:15] in line]
        highlighted = "\x1b[1;31m" in line
        assert highlighted == (row.status == "unknown"), line

    assert ok(ledger.url, "list", "--session", "sess_nobody").stdout.strip() == "no calls match"


def test_list__cursor_paging_visits_every_call_once_in_order(ledger: Ledger) -> None:
    rows = ledger.rows()
    for sort, column, descending in (
        ("-created", "created_at", True),
        ("tool", "tool_name", False),
        ("-status", "status", True),
        ("finished", "finished_at", False),
    ):
        present = [r for r in rows if getattr(r, column) is not None]

        expected = listing_order(present, column, descending=descending)
        seen: list[str] = []
        cursor: list[str] = []
        pages = 0
        while True:
            page = json.loads(
                ok(ledger.url, "list", "--json", "--sort", sort, "--limit", "4", *cursor).stdout
            )
            seen += ids(page["calls"])
            pages += 1
            if page["next_cursor"] is None:
                break
            cursor = ["--cursor", page["next_cursor"]]
        assert seen == expected, sort
        assert pages == max(1, -(-len(expected) // 4)), sort

    # The table's footer carries the same cursor as --json.
    first = json.loads(ok(ledger.url, "list", "--json", "--limit", "4").stdout)
    table = ok(ledger.url, "list", "--limit", "4").stdout
    assert f"more: --cursor {first['next_cursor']}" in table

    # --jsonl streams every call (no page limit) unless --limit is given.
    streamed = [json.loads(line) for line in ok(ledger.url, "list", "--jsonl").stdout.splitlines()]
    assert ids(streamed) == listing_order(rows)
    assert streamed == listed(ledger.url)
    limited = ok(ledger.url, "list", "--jsonl", "--limit", "3").stdout.splitlines()
    assert [json.loads(line)["id"] for line in limited] == listing_order(rows)[:3]
    tools = ok(ledger.url, "list", "--jsonl", "--tool", "lookup_order").stdout.splitlines()
    assert {json.loads(line)["id"] for line in tools} == {
        r.idempotency_key for r in rows if r.tool_name == "lookup_order"
    }


# -------------------------------------------------------------------------------- show


def test_show__each_kind_of_reference_prints_the_call_and_its_timeline(ledger: Ledger) -> None:
    rows = ledger.rows()
    shop = set(ledger.filled.session_ids)
    charge = next(r for r in rows if r.tool_name == "charge_card" and r.session_id in shop)
    crashed = next(r for r in rows if r.tool_name == "lookup_order" and r.error_stage and r.error_detail)
    for row in (charge, crashed):
        key = row.idempotency_key
        for reference in (key, key[:15], f"{row.session_id}/{row.turn_id}/{row.call_id}", row.call_id):
            detail = json.loads(ok(ledger.url, "show", reference, "--json").stdout)
            assert detail["call"]["id"] == key, reference
            changes = [(e["from_status"], e["to_status"]) for e in detail["timeline"] if e["to_status"]]
            assert changes[0] == (None, "running")
            assert changes[-1][1] == "submitted"
            assert changes[1][1] in ("succeeded", "failed")
            assert [e["id"] for e in detail["timeline"]] == sorted(e["id"] for e in detail["timeline"])
            links = [e["prev_sha256"] for e in detail["timeline"]]
            assert links == ["0" * 64] + [e["sha256"] for e in detail["timeline"][:-1]], "one chain"

        table = ok(ledger.url, "show", key).stdout
        head = ["trail", "head", detail["timeline"][-1]["sha256"]]
        assert any(line.split() == head for line in table.splitlines()), table
        assert f"{row.session_id}/{row.turn_id}/{row.call_id}" in table
        assert "new → running" in table
        assert table.index("new → running") < table.index("→ submitted")
        assert "recorded and claimed" in table

    # Secret fields are masked in the arguments and in the output nested in the result.
    detail = json.loads(ok(ledger.url, "show", charge.idempotency_key, "--json").stdout)
    assert detail["call"]["arguments"]["card_number"] == MASK
    assert json.loads(detail["call"]["result"]["output"])["token"] == MASK
    assert MASK in ok(ledger.url, "show", charge.idempotency_key).stdout

    unknown = ok(ledger.url, "show", str(ledger.filled.unknown)).stdout
    assert "toolledger calls resolve" in unknown or ledger.status(ledger.filled.unknown) != "unknown"

    missing = cli(ledger.url, "show", "tl_0000000000000000")
    assert missing.exit_code == 1
    assert "no call matches" in error_line(missing)
    assert cli(ledger.url, "show", "call_that_never_was").exit_code == 1
    for malformed in ("a/b", "a//c", "", "x" * 300):
        assert cli(ledger.url, "show", malformed).exit_code == 2, malformed


# ------------------------------------------------------------------------------ export


def test_export__jsonl_and_csv_round_trip(ledger: Ledger, tmp_path: Path) -> None:
    rows = ledger.rows()
    as_listed = listed(ledger.url)

    *lines, digest_line = ok(ledger.url, "export").stdout.splitlines(keepends=True)
    exported = [json.loads(line) for line in lines]
    heads = [(call.pop("trail_events"), call.pop("trail_sha256")) for call in exported]
    assert exported == as_listed
    assert all(events >= 1 and len(head) == 64 for events, head in heads)
    assert json.loads(digest_line) == {
        "export_sha256": hashlib.sha256("".join(lines).encode()).hexdigest(),
        "calls": len(rows),
        "trail_format": "toolledger-trail-v2",
    }

    target = tmp_path / "calls.csv"
    result = ok(ledger.url, "export", "--format", "csv", "--output", str(target), "--progress")
    assert result.stdout == ""
    assert f"exported {len(rows)} call(s)" in result.stderr
    assert list(tmp_path.iterdir()) == [target], "no partial file is left"
    with target.open(encoding="utf-8", newline="") as file:
        reader = csv.DictReader(file)
        assert reader.fieldnames == CSV_COLUMNS
        *records, digest_row = list(reader)
    assert digest_row["id"].startswith("# toolledger export: export_sha256=")
    assert len(records) == len(rows)
    assert [(int(r["trail_events"]), r["trail_sha256"]) for r in records] == heads
    assert [r["id"] for r in records] == ids(as_listed)
    for record, view in zip(records, as_listed, strict=True):
        for column in ("session_id", "turn_id", "call_id", "tool_name", "status", "effect_class"):
            assert record[column] == view[column]
        assert record["attempts"] == str(view["attempts"])
        assert json.loads(record["arguments"]) == view["arguments"]
        if view["result"] is not None:
            assert json.loads(record["result"]) == view["result"]

    filtered = ok(ledger.url, "export", "--format", "csv", "--tool", "lookup_order", "--sort", "tool").stdout
    records = list(csv.DictReader(io.StringIO(filtered, newline="")))[:-1]
    assert {r["id"] for r in records} == {r.idempotency_key for r in rows if r.tool_name == "lookup_order"}

    refused = tmp_path / "refused.csv"
    assert cli(ledger.url, "export", "--output", str(refused), "--status", "bogus").exit_code == 2
    assert not refused.exists()
    unwritable = cli(ledger.url, "export", "--output", str(tmp_path / "no" / "such" / "dir.csv"))
    assert unwritable.exit_code == 1
    assert "No such file or directory" in error_line(unwritable)


def test_verify_trail__a_ledger_written_by_serve__batched_and_killed_once__every_trail_intact(
    ledger: Ledger, tmp_path: Path
) -> None:
    """The fill ran `serve` (writes batched, the default) and SIGKILLed one inside a handler:
    every event it and the recovery wrote chains, on both databases."""
    rows = ledger.rows()
    events = ledger.events()

    whole = ok(ledger.url, "verify-trail", "--all")
    session = ok(ledger.url, "verify-trail", "--session", ledger.filled.session_ids[0])
    killed = ok(ledger.url, "verify-trail", str(ledger.filled.unknown))

    assert whole.stdout.splitlines()[-1] == (
        f"trail intact: {len(rows)} call(s), {len(events)} event(s) recomputed (the whole ledger)"
    )
    assert session.stdout.startswith("trail intact: 5 call(s), ")
    assert killed.stdout.startswith("trail intact: 1 call(s), ")

    export = tmp_path / "calls.csv"
    ok(ledger.url, "export", "--format", "csv", "--output", str(export))
    anchored = ok(ledger.url, "verify-trail", "--export", str(export))
    assert anchored.stdout.startswith(f"export file whole: its {len(rows)} call(s) hash to its digest line")


# ----------------------------------------------------------------------------- resolve


def test_resolve__an_output_is_submitted_once_and_on_the_record(ledger: Ledger) -> None:
    unknown, session = ledger.filled.unknown, ledger.filled.unknown_session
    control = ledger.emulator.control
    base = ledger.emulator.base_url
    reference = str(unknown)
    assert ledger.status(unknown) == "unknown"
    assert control.tool_results(session) == [], "the SIGKILLed serve never answered it"

    for args, message in (
        (("--output", "x"), "Missing option '--reason'"),
        (("--output", "x", "--rerun", "--reason", "r"), "exactly one of"),
        (("--output", "x", "--error", "y", "--reason", "r"), "exactly one of"),
        (("--reason", "r"), "exactly one of"),
        (("--error", "", "--reason", "r"), "an error message must be"),
        (("--output", "x", "--reason", "   "), "a reason"),
        (
            ("--output", "x", "--reason", "r", "--tools", "tests.support.shop_tools:registry"),
            "--tools is for --rerun",
        ),
        (("--output", "x", "--reason", "r", "--operator", ""), "operator"),
    ):
        refused = cli(ledger.url, "resolve", reference, *args, base_url=base)
        assert refused.exit_code == 2, (args, refused.output)
        assert message in error_line(refused), args
    assert ledger.status(unknown) == "unknown"
    assert control.tool_results(session) == []

    text = '{"charged": 99, "checked": "by phone with the bank"}'
    why = "the bank confirmed the charge went through"
    done = run_cli(
        "calls", "resolve", reference, "--output", text, "--reason", why, "--operator", "alice",
        database_url=ledger.url,
        base_url=base,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "action: submitted; status: submitted" in done.stdout
    assert "Traceback" not in done.stderr
    assert CANARY not in done.stdout + done.stderr

    received = control.tool_results(session)
    assert len(received) == 1
    assert received[0].outcome == "accepted"
    assert (received[0].turn_id, received[0].call_id) == (unknown.turn_id, unknown.call_id)
    assert received[0].payload["output"] == text
    assert received[0].idempotency_key == unknown.idempotency_key

    detail = json.loads(ok(ledger.url, "show", reference, "--json").stdout)
    assert detail["call"]["status"] == "submitted"
    by_operator = [e for e in detail["timeline"] if e["actor"] == "operator:alice"]
    assert by_operator, detail["timeline"]
    assert by_operator[0]["to_status"] == "succeeded"
    assert why in (by_operator[0]["reason"] or "")
    assert detail["timeline"][-1]["to_status"] == "submitted"

    again = cli(ledger.url, "resolve", reference, "--error", "no", "--reason", "twice", base_url=base)
    assert again.exit_code == 1
    assert "only an unknown outcome can be resolved" in error_line(again)
    assert len(control.tool_results(session)) == 1


def test_resolve__a_rerun_is_left_to_serve_or_run_here_with_tools(ledger: Ledger) -> None:
    control = ledger.emulator.control
    base = ledger.emulator.base_url
    # An unknown call whose call id another session's call also has.
    twin = next(r for r in ledger.rows() if r.session_id in ledger.filled.session_ids)
    left = CallKey(f"sess_cli_{uuid.uuid4().hex[:12]}", "turn_cli", twin.call_id)
    asyncio.run(add_unknown_call(ledger.url, left, "charge_card", {"amount": 7, "card_number": CANARY}))

    for command in (("show", twin.call_id), ("resolve", twin.call_id, "--rerun", "--reason", "r")):
        ambiguous = cli(ledger.url, *command, base_url=base)
        assert ambiguous.exit_code == 2, command
        assert "names 2 calls" in error_line(ambiguous)
    assert ledger.status(left) == "unknown"

    # Without --tools: re-opened for `serve`; the operator defaults to $USER.
    reopened = ok(ledger.url, "resolve", str(left), "--rerun", "--reason", "never ran", env={"USER": "carol"})
    assert "action: left_for_service; status: pending" in reopened.stdout
    assert ledger.status(left) == "pending"
    timeline = json.loads(ok(ledger.url, "show", str(left), "--json").stdout)["timeline"]
    assert (timeline[-1]["actor"], timeline[-1]["from_status"], timeline[-1]["to_status"]) == (
        "operator:carol",
        "unknown",
        "pending",
    )
    assert "never ran" in timeline[-1]["reason"]
    assert control.tool_results(left.session_id) == []
    assert cli(ledger.url, "resolve", str(left), "--rerun", "--reason", "again").exit_code == 1

    # With --tools: the call runs here and its result reaches the session that awaits it.
    (session,) = asyncio.run(start_sessions(ledger.emulator, 1, charge_only_script()))
    action = asyncio.run(pending_call(base, session))
    key = CallKey(session, action.turn_id, action.call_id)
    arguments = json.loads(action.arguments) if isinstance(action.arguments, str) else action.arguments
    asyncio.run(add_unknown_call(ledger.url, key, action.name, arguments))
    rerun = ok(
        ledger.url,
        "resolve", str(key), "--rerun", "--tools", "tests.support.shop_tools:registry",
        "--reason", "the bank has no record of it", "--operator", "dana", "--json",
        base_url=base,
    )  # fmt: skip
    report = json.loads(rerun.stdout)
    assert report["action"] == "rerun"
    assert report["call"]["status"] == "submitted"
    assert report["call"]["attempts"] == 2
    received = control.tool_results(session)
    assert [(r.call_id, r.outcome) for r in received] == [(key.call_id, "accepted")]
    assert json.loads(received[0].payload["output"])["charged"] == 99


async def pending_call(base_url: str, session_id: str) -> Any:
    gateway = AgentsGateway.connect(api_key=None, base_url=base_url)
    try:
        (action,) = await eventually(
            lambda: gateway.pending_function_calls(session_id),
            within=10,
            what="the session asked for its call",
        )
        return action
    finally:
        await gateway.close()


# ------------------------------------------------------------------------------- prune


@contextlib.contextmanager
def ledger_copy(ledger: Ledger, workdir: Path) -> Iterator[str]:
    """The shared ledger as it is now, copied, so that pruning it leaves the original whole."""
    parsed = make_url(ledger.url)
    if parsed.get_backend_name() == "sqlite":
        assert parsed.database is not None
        copy = workdir / "copy.sqlite3"
        with sqlite3.connect(parsed.database) as source, sqlite3.connect(copy) as target:
            source.backup(target)
        yield f"sqlite+aiosqlite:///{copy}"
        return
    name = f"toolledger_copy_{uuid.uuid4().hex[:12]}"
    admin = parsed.set(drivername="postgresql", database="postgres").render_as_string(hide_password=False)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(name), sql.Identifier(str(parsed.database))
            )
        )
    try:
        yield parsed.set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def test_prune__deletes_only_finished_calls_older_than_asked(ledger: Ledger, tmp_path: Path) -> None:
    with ledger_copy(ledger, tmp_path) as url:
        copy = Ledger(ledger.filled, ledger.emulator, url)
        before = copy.rows()
        events_before = copy.events()
        finished = {(r.session_id, r.turn_id, r.call_id) for r in before if r.status in FINISHED}
        still_open = {(r.session_id, r.turn_id, r.call_id) for r in before if r.status not in FINISHED}
        assert finished
        assert still_open, "an unknown or re-opened call is always left in the test ledger"

        for args, message in (
            (("--older-than", "90x"), "invalid duration"),
            (("--older-than", "0s", "--yes"), "positive"),
            (("--older-than", "1s"), "--yes"),
            ((), "Missing option '--older-than'"),
        ):
            refused = cli(url, "prune", *args)
            assert refused.exit_code == 2, args
            assert message in error_line(refused), args
        assert ok(url, "prune", "--older-than", "1h", "--yes").stdout.startswith("deleted 0 ")
        assert len(copy.rows()) == len(before)

        time.sleep(1.1)
        dry = ok(url, "prune", "--older-than", "1s", "--dry-run").stdout
        assert dry.startswith(f"{len(finished)} finished call(s) older than 1s would be deleted")
        assert len(copy.rows()) == len(before)

        assert ok(url, "prune", "--older-than", "1s", "--yes").stdout.startswith(f"deleted {len(finished)} ")
        after = copy.rows()
        assert {(r.session_id, r.turn_id, r.call_id) for r in after} == still_open
        assert [e.id for e in copy.events()] == [
            e.id for e in events_before if (e.session_id, e.turn_id, e.call_id) in still_open
        ]
        # Whole calls go, with every event: no trail left is broken.
        assert ok(url, "verify-trail", "--all").stdout.startswith(f"trail intact: {len(still_open)} call(s)")
    assert len(ledger.rows()) == len(before), "the shared ledger was not touched"


# ------------------------------------------------------------------------- bad input


def test_bad_input__exits_2_with_a_one_line_reason(ledger: Ledger) -> None:
    tool_cursor = json.loads(ok(ledger.url, "list", "--json", "--sort", "tool", "--limit", "2").stdout)
    cases: list[tuple[tuple[str, ...], str]] = [
        (("list", "--status", "bogus"), "unknown status 'bogus'"),
        (("list", "--status", "submitted,nope"), "unknown status 'nope'"),
        (("list", "--effect-class", "sometimes"), "unknown effect class"),
        (("list", "--since", "yesterday"), "invalid time 'yesterday'"),
        (("list", "--until", "2026-13-45"), "invalid time"),
        (("list", "--since", "1h", "--until", "2h"), "since must be earlier than until"),
        (("list", "--limit", "0"), "--limit"),
        (("list", "--limit", "501"), "--limit"),
        (("list", "--limit", "ten"), "--limit"),
        (("list", "--cursor", "garbage!"), "invalid cursor"),
        (("list", "--cursor", "WyJhIl0"), "invalid cursor"),
        # A cursor of one order handed to another.
        (("list", "--cursor", str(tool_cursor["next_cursor"])), "invalid cursor for this sort order"),
        (("list", "--sort", "price"), "unknown sort key 'price'"),
        (("list", "--sort", "--created"), "unknown sort key"),
        (("list", "--json", "--jsonl"), "choose one"),
        (("list", "--unknown", "--status", "submitted"), "contradicts --status"),
        (("list", "--session", ""), "session_id must be 1 to 255 characters"),
        (("list", "--search", "x" * 201), "search text must be 1 to 200 characters"),
        (("show", "s/t"), "expected SESSION/TURN/CALL"),
        (("export", "--format", "xml"), "'xml' is not one of"),
        (("export", "--since", "tomorrow"), "invalid time"),
        (("list", "--bogus-flag"), "No such option"),
    ]
    for args, message in cases:
        result = cli(ledger.url, *args)
        assert result.exit_code == 2, (args, result.output)
        assert message in error_line(result), (args, result.stderr)
        assert result.stdout == "", args


HOSTILE = [
    "' OR 1=1--",
    "'; DROP TABLE tool_calls;--",
    'x") OR ("1"="1',
    "%",
    "_",
    "\\",
    "\\%",
    "sess_%",
    "[bold red]markup[/]",
    "\x1b[2J\u202eevil",
    "セッション🔑 ünïcödé",
    "x" * 10_240,
]


def test_hostile_filters__never_crash_nor_change_the_ledger(ledger: Ledger) -> None:
    rows = ledger.rows()
    before = len(rows)

    def oracle(option: str, value: str) -> set[str]:
        if option == "--search":
            needle = value.lower()
            return {
                r.idempotency_key
                for r in rows
                if any(needle in v.lower() for v in (r.tool_name, r.session_id, r.turn_id, r.call_id))
            }
        column = {"--session": "session_id", "--turn": "turn_id", "--tool": "tool_name"}[option]
        return {r.idempotency_key for r in rows if getattr(r, column) == value}

    exits = set()
    for value in HOSTILE:
        for option in ("--session", "--turn", "--tool", "--search"):
            result = cli(ledger.url, "list", "--json", "--limit", EVERY, option, value)
            exits.add(result.exit_code)
            assert result.exit_code in (0, 2), (option, value[:40], result.output)
            if result.exit_code == 0:
                assert set(ids(json.loads(result.stdout)["calls"])) == oracle(option, value), (option, value)
        table = cli(ledger.url, "list", "--search", value)
        assert table.exit_code in (0, 2)
        assert "\x1b[2J" not in table.stdout
        shown = cli(ledger.url, "show", value)
        assert shown.exit_code in (1, 2), value[:40]
        exported = cli(ledger.url, "export", "--search", value)
        assert exported.exit_code in (0, 2)
    assert exits == {0, 2}
    assert len(ledger.rows()) == before

    # Ids are data: control characters and markup in them are shown, never obeyed.
    hostile = CallKey("sess_\x1b[2J\u202e[bold]x", "turn_hostile", "call_hostile")
    asyncio.run(add_unknown_call(ledger.url, hostile, "lookup_order", {"order_id": "A1"}))
    listing = ok(ledger.url, "list", "--turn", "turn_hostile").stdout
    assert "sess_\\x1b[2J\\u202e[bold]x" in listing
    assert "\x1b" not in listing
    detail = ok(ledger.url, "show", str(hostile)).stdout
    assert "\\x1b[2J" in detail
    assert "\x1b" not in detail
    assert "\u202e" not in detail
    before = len(ledger.rows())

    # A real process, with bytes that are not UTF-8 among its arguments.
    refused = run_cli(
        "calls", "list", "--session", "'; DROP TABLE tool_calls;--", "--search", "\udcff\udcfe",
        database_url=ledger.url,
    )  # fmt: skip
    assert refused.returncode == 2, refused.stderr
    assert "is not valid UTF-8" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert len(ledger.rows()) == before


def test_unreachable_or_missing_database__one_line_and_no_traceback(tmp_path: Path) -> None:
    closed_port = "postgresql+psycopg://postgres@127.0.0.1:9/test"
    down = run_cli("calls", "list", database_url=closed_port)
    assert down.returncode == 1
    assert down.stdout == ""
    assert down.stderr.startswith("Error: the ledger database is unavailable"), down.stderr
    assert len(down.stderr.strip().splitlines()) == 1, down.stderr

    missing = tmp_path / "typo.sqlite3"
    result = cli(f"sqlite+aiosqlite:///{missing}", "show", "tl_0123456789ab")
    assert result.exit_code == 1
    assert "no ledger file at" in error_line(result)
    assert not missing.exists(), "a mistyped path is not turned into an empty ledger"


def test_calls_group__lists_its_commands() -> None:
    help_text = CliRunner().invoke(main, ["calls", "--help"]).stdout
    for command in ("list", "show", "export", "verify-trail", "resolve", "prune"):
        assert command in help_text
