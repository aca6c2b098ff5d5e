"""The operator's views of the ledger (issue 15): outcomes and counts in every face, tables
that keep ids whole, short id prefixes, a live tail, and a session's page. Against a ledger
filled by real executions (ledger_fill), on SQLite and PostgreSQL, through the real commands
and the real app.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from typing import Any

import httpx
from click.testing import CliRunner

from tests.support.calls_cli import Ledger, add_unknown_call, cli, error_line, listed, ok
from tests.support.paths import ROOT
from toolledger.audit.api import create_app
from toolledger.cli import main
from toolledger.domain.keys import CallKey
from toolledger.settings import Settings


def outcome_of_row(row: Any) -> str | None:
    if row.result is None:
        return None
    return "failed" if row.error_stage is not None else "succeeded"


# ----------------------------------------------------------------------- 1. outcomes


def test_outcome__failures_stay_visible_after_submission_in_the_cli(ledger: Ledger) -> None:
    rows = ledger.rows()
    failures = {r.idempotency_key for r in rows if outcome_of_row(r) == "failed"}
    successes = {r.idempotency_key for r in rows if outcome_of_row(r) == "succeeded"}
    assert failures
    assert successes
    # The point: every failure was submitted, so a status filter cannot find it.
    assert {r.status for r in rows if r.idempotency_key in failures} == {"submitted"}
    assert listed(ledger.url, "--status", "failed") == []

    found = listed(ledger.url, "--outcome", "failed")
    assert {c["id"] for c in found} == failures
    assert {c["outcome"] for c in found} == {"failed"}
    assert {c["error_stage"] for c in found} == {"execution"}
    assert {c["id"] for c in listed(ledger.url, "--outcome", "succeeded")} == successes
    assert {c["id"] for c in listed(ledger.url, "--outcome", "succeeded,failed")} == failures | successes
    unknown = listed(ledger.url, "--unknown")
    assert all(c["outcome"] is None for c in unknown)

    table = ok(ledger.url, "list").stdout
    assert "outcome" in table.splitlines()[0]
    for row in rows:
        (line,) = [line for line in table.splitlines() if row.idempotency_key[:15] in line]
        if row.idempotency_key in failures:
            assert "failed (execution)" in line, line
        elif row.idempotency_key in successes:
            assert "succeeded" in line, line

    bad = cli(ledger.url, "list", "--outcome", "maybe")
    assert bad.exit_code == 2
    assert "unknown outcome 'maybe'" in error_line(bad)


def test_outcome__stats_count_by_status_and_outcome(ledger: Ledger) -> None:
    rows = ledger.rows()
    counts = json.loads(ok(ledger.url, "stats", "--json").stdout)
    assert counts["total"] == len(rows)
    assert counts["by_status"] == dict(Counter(r.status for r in rows))
    assert counts["by_outcome"] == dict(Counter(outcome_of_row(r) or "none" for r in rows))
    assert counts["failed_by_stage"] == dict(
        Counter(r.error_stage for r in rows if outcome_of_row(r) == "failed")
    )
    tool = json.loads(ok(ledger.url, "stats", "--json", "--tool", "lookup_order").stdout)
    assert tool["total"] == sum(r.tool_name == "lookup_order" for r in rows)
    text = ok(ledger.url, "stats").stdout
    assert f"{len(rows)} call(s)" in text
    assert "by outcome:" in text
    assert f"failed {counts['by_outcome']['failed']}" in text


def test_outcome__api_filter_and_counts(ledger: Ledger) -> None:
    rows = ledger.rows()
    failures = {r.idempotency_key for r in rows if outcome_of_row(r) == "failed"}

    async def check() -> None:
        app = create_app(Settings(database_url=ledger.url))
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as client,
        ):
            page = (await client.get("/api/calls", params={"outcome": "failed", "limit": 500})).json()
            assert {c["id"] for c in page["calls"]} == failures
            assert all(c["status"] == "submitted" and c["outcome"] == "failed" for c in page["calls"])
            counts = (await client.get("/api/counts")).json()
            assert counts["by_status"] == dict(Counter(r.status for r in rows))
            assert counts["by_outcome"]["failed"] == len(failures)
            narrowed = (await client.get("/api/counts", params={"outcome": "failed"})).json()
            assert narrowed["total"] == len(failures)
            assert (await client.get("/api/calls", params={"outcome": "maybe"})).status_code == 400
            assert (await client.get("/api/counts", params={"status": "nope"})).status_code == 400

    asyncio.run(check())


# ------------------------------------------------------------- 2. whole ids, prefixes


def test_table__ids_stay_whole_on_one_line_at_100_to_120_columns(ledger: Ledger) -> None:
    rows = ledger.rows()
    for width in ("100", "110", "120"):
        table = ok(ledger.url, "list", "--limit", "500", env={"COLUMNS": width}).stdout
        lines = table.splitlines()
        header = lines[0]
        table_lines = [header, *(line for line in lines if line.startswith("tl_"))]
        assert len(table_lines) == len(rows) + 1
        assert all(len(line) <= int(width) for line in table_lines), width
        for row in rows:
            (line,) = [line for line in lines if row.idempotency_key[:15] in line]
            assert row.tool_name in line
            assert row.status in line
            if "call" in header.split():
                assert row.call_id in line, (width, line)
            if "session" in header.split():
                assert row.session_id in line, (width, line)
        assert "call" in header.split(), "the call id fits at 100 columns"


def test_show__times_have_sub_second_precision(ledger: Ledger) -> None:
    row = ledger.rows()[0]
    shown = ok(ledger.url, "show", row.idempotency_key).stdout
    created = row.created_at.strftime("%Y-%m-%d %H:%M:%S.%f")
    assert created in shown, shown


def test_show__a_short_id_prefix_names_a_call_or_lists_candidates(ledger: Ledger) -> None:
    rows = ledger.rows()
    keys = [r.idempotency_key for r in rows]
    unique = next(key[:7] for key in keys if sum(other.startswith(key[:7]) for other in keys) == 1)
    detail = json.loads(ok(ledger.url, "show", unique, "--json").stdout)
    assert detail["call"]["id"].startswith(unique)

    # Two calls share a prefix of 4 hex digits in no ledger this small by chance: make one
    # (one key in 65,536 has it: a few hundred thousand hashes at most).
    prefix = keys[0][:7]
    if sum(key.startswith(prefix) for key in keys) == 1:
        number = 0
        while not (
            twin := CallKey("sess_prefix_twin", "turn_x", f"call_{number}")
        ).idempotency_key.startswith(prefix):
            number += 1
        asyncio.run(add_unknown_call(ledger.url, twin, "charge_card", {"amount": 1}))
    ambiguous = cli(ledger.url, "show", prefix)
    assert ambiguous.exit_code == 2
    assert "names 2 calls" in error_line(ambiguous) or "calls (" in error_line(ambiguous)

    short = cli(ledger.url, "show", "tl_05")
    assert short.exit_code == 2
    assert "at least 4 hex digits" in error_line(short)


# ------------------------------------------------------------------- 3. follow, session


def test_follow__prints_new_and_changed_calls_and_ends_cleanly_on_ctrl_c(ledger: Ledger) -> None:
    env = {
        **os.environ,
        "TOOLLEDGER_DATABASE_URL": ledger.url,
        "PYTHONPATH": str(ROOT),
        "COLUMNS": "200",
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "toolledger.cli", "calls", "list", "--follow", "--interval", "0.2"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        first = process.stdout.readline()
        assert "following" in first, first
        key = CallKey("sess_follow", "turn_follow", f"call_{time.monotonic_ns()}")
        asyncio.run(add_unknown_call(ledger.url, key, "charge_card", {"amount": 3}))
        seen: list[str] = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            seen.append(line)
            if key.call_id in line and "unknown" in line:
                break
        else:
            raise AssertionError(seen)
        assert "(transition)" in seen[-1]
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=20)
        assert process.returncode == 0, stderr
        assert "Traceback" not in stderr
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_sessions_show__watch_state_lease_and_calls(ledger: Ledger) -> None:
    session_id = ledger.filled.session_ids[0]
    rows = [r for r in ledger.rows() if r.session_id == session_id]
    runner = CliRunner()
    env = {"TOOLLEDGER_DATABASE_URL": ledger.url, "COLUMNS": "200"}
    result = runner.invoke(main, ["sessions", "show", session_id, "--json"], env=env)
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["session_id"] == session_id
    assert document["watched"] is False
    assert document["reason"] == "finished"
    assert document["last_polled_at"] is not None
    assert {c["id"]: (c["status"], c["outcome"]) for c in document["calls"]} == {
        r.idempotency_key: (r.status, outcome_of_row(r)) for r in rows
    }
    text = runner.invoke(main, ["sessions", "show", session_id], env=env)
    assert text.exit_code == 0, text.output
    assert "watched: no (finished)" in text.stdout
    assert "last poll" in text.stdout
    for row in rows:
        assert row.call_id in text.stdout
    missing = runner.invoke(main, ["sessions", "show", "sess_nobody"], env=env)
    assert missing.exit_code == 1
    assert "no session 'sess_nobody'" in missing.output
