"""`toolledger calls verify-trail` against tampering by direct SQL, on a real SQLite file and a
real PostgreSQL database: an edited reason, a deleted event, a forged event, two events
swapped and the last one deleted are each named where they happened (exit 1); so is a call
whose stored result, arguments, approved arguments or error detail were changed after its last
event (and `calls show` says so); untouched calls verify (exit 0). An export anchors the trail:
a rewrite that recomputes every hash passes the chain but not the export; keyed, it passes
neither the chain nor the keys; pruning deletes whole calls and breaks nothing.
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import text

from tests.support.calls_cli import cli
from tests.support.trail_ledger import build_trail_ledger, forge_after, forge_content, rehash_from
from toolledger.domain.trail import TrailKey
from toolledger.store.audit import AuditStore
from toolledger.store.engine import create_engine


def verified(url: str, *args: str, env: dict[str, str | None] | None = None) -> tuple[int, dict[str, Any]]:
    result = cli(url, "verify-trail", *args, "--json", env=env)
    return result.exit_code, json.loads(result.stdout)


def test_verify_trail__each_kind_of_tampering__is_named_at_its_event_and_exits_1(database_url: str) -> None:
    ledger = build_trail_ledger(database_url)
    edited, deleted, forged_into, swapped, cut, untouched = ledger.keys
    trails = {key: ledger.events(key) for key in ledger.keys}
    assert all(len(events) == 4 for events in trails.values())
    code, before = verified(database_url, "--all")
    assert (code, before["intact"], before["calls"], before["events"]) == (0, True, 7, 28)

    with ledger.tampering() as sql:
        sql.execute(
            text("UPDATE tool_call_events SET reason = 'handler returned nothing' WHERE id = :id"),
            {"id": trails[edited][1].id},
        )
        sql.execute(text("DELETE FROM tool_call_events WHERE id = :id"), {"id": trails[deleted][1].id})
        forged = forge_after(sql, ledger, trails[forged_into][1], kind="flag", to_status=None, reason="ok")
        first, second = trails[swapped][1].id, trails[swapped][2].id
        for old, new in ((first, -1), (second, first), (-1, second)):
            sql.execute(
                text("UPDATE tool_call_events SET id = :new WHERE id = :old"), {"new": new, "old": old}
            )
        # The last two: a trailing note alone (a confirmation) changes no status, and only an
        # export's anchor tells it gone (see the export test).
        for gone in trails[cut][2:]:
            sql.execute(text("DELETE FROM tool_call_events WHERE id = :id"), {"id": gone.id})

    code, report = verified(database_url, "--all")

    assert code == 1
    assert (report["intact"], report["calls"], report["broken"]) == (False, 7, 5)
    found = {(b["call_id"], b["kind"], b["event_id"]) for b in report["breaks"]}
    assert found == {
        (edited.call_id, "edited", trails[edited][1].id),
        (deleted.call_id, "deleted", trails[deleted][2].id),
        (forged_into.call_id, "inserted", forged.id),
        (swapped.call_id, "reordered", first),
        (cut.call_id, "truncated", trails[cut][1].id),
    }
    assert untouched.call_id not in {b["call_id"] for b in report["breaks"]}

    printed = cli(database_url, "verify-trail", "--all")
    assert printed.exit_code == 1
    lines = printed.stdout.splitlines()
    edit_line = f"broken: {edited}: event {trails[edited][1].id} (transition running -> succeeded at"
    assert any(line.startswith(edit_line) for line in lines)
    assert any(line.startswith(f"broken: {deleted}: ") and "was deleted" in line for line in lines)
    assert any(line.startswith(f"broken: {forged_into}: event {forged.id} (flag at") for line in lines)
    assert any(line.startswith(f"broken: {swapped}: ") and "reordered" in line for line in lines)
    assert any(line.startswith(f"broken: {cut}: ") and "but the call is submitted" in line for line in lines)
    assert lines[-1] == "trail BROKEN: 5 of 7 call(s), 26 event(s) recomputed (the whole ledger)"

    # One call, or one session, is verified alone: the untouched ones still pass.
    assert verified(database_url, str(untouched))[0] == 0
    assert verified(database_url, "--session", ledger.apart.session_id) == (
        0,
        {
            "scope": "session sess_apart",
            "intact": True,
            "calls": 1,
            "events": 4,
            "broken": 0,
            "breaks": [],
            "breaks_not_listed": 0,
            "keyed": False,
            "content_not_covered": 0,
        },
    )
    code, one = verified(database_url, ledger.keys[0].idempotency_key[:16])
    assert (code, one["broken"], one["breaks"][0]["kind"]) == (1, 1, "edited")


def test_verify_trail__what_to_verify__exactly_one_and_it_must_exist(sqlite_url: str) -> None:
    build_trail_ledger(sqlite_url, calls=1)

    for args in ((), ("--all", "--session", "s"), ("sess_trail/turn_1/call_0", "--all")):
        refused = cli(sqlite_url, "verify-trail", *args)
        assert refused.exit_code == 2, args
        assert "exactly one of REFERENCE, --session ID, --all or --export FILE" in refused.stderr
    missing = cli(sqlite_url, "verify-trail", "--session", "sess_nobody")
    assert missing.exit_code == 1
    assert "no call of session 'sess_nobody' in the ledger" in missing.stderr
    assert cli(sqlite_url, "verify-trail", "tl_ffff").exit_code == 1
    assert cli(sqlite_url, "verify-trail", "--export", "/nonexistent/export.jsonl").exit_code == 1


def test_verify_trail_export__a_rewrite_with_every_hash_recomputed__passes_the_chain_not_the_export(
    database_url: str, tmp_path: Path
) -> None:
    ledger = build_trail_ledger(database_url, calls=3)
    jsonl, csv = tmp_path / "calls.jsonl", tmp_path / "calls.csv"
    assert cli(database_url, "export", "--output", str(jsonl)).exit_code == 0
    assert cli(database_url, "export", "--format", "csv", "--output", str(csv)).exit_code == 0
    for export in (jsonl, csv):
        code, report = verified(database_url, "--export", str(export))
        assert (code, report["intact"], report["file_whole"], report["calls"], report["missing"]) == (
            0,
            True,
            True,
            4,
            [],
        )

    rewritten = ledger.keys[1]
    events = ledger.events(rewritten)
    with ledger.tampering() as sql:
        rehash_from(sql, events, 1, reason="handler returned nothing")

    assert verified(database_url, "--all")[0] == 0, "the chain alone cannot tell a full rewrite"
    for export in (jsonl, csv):
        code, report = verified(database_url, "--export", str(export))
        assert code == 1
        assert report["file_whole"] is True
        ((broken),) = report["breaks"]
        assert (broken["call_id"], broken["kind"], broken["event_id"]) == (
            rewritten.call_id,
            "rewritten",
            events[3].id,
        )
        assert "the trail was rewritten since the export" in broken["message"]


def test_verify_trail_export__a_changed_file__is_refused_even_when_every_trail_holds(
    sqlite_url: str, tmp_path: Path
) -> None:
    build_trail_ledger(sqlite_url, calls=2)
    export = tmp_path / "calls.jsonl"
    assert cli(sqlite_url, "export", "--output", str(export)).exit_code == 0
    lines = export.read_text(encoding="utf-8").splitlines(keepends=True)
    export.write_text(
        "".join([lines[0].replace('"charge_card"', '"refund_card"'), *lines[1:]]), encoding="utf-8"
    )

    changed = cli(sqlite_url, "verify-trail", "--export", str(export))

    assert changed.exit_code == 1
    assert changed.stdout.startswith("export file CHANGED: what precedes its digest line hashes to ")
    assert changed.stdout.splitlines()[-1].startswith("every trail intact, but the export file changed")

    export.write_text("".join(lines[:-1]), encoding="utf-8")
    cut = cli(sqlite_url, "verify-trail", "--export", str(export))
    assert cut.exit_code == 1
    assert "is not a toolledger export's digest line" in cut.stderr

    no_digest = tmp_path / "bare.jsonl"
    assert cli(sqlite_url, "export", "--no-digest", "--output", str(no_digest)).exit_code == 0
    assert all("export_sha256" not in line for line in no_digest.read_text(encoding="utf-8").splitlines())


def test_prune__deletes_whole_calls__every_other_trail_still_verifies(
    database_url: str, tmp_path: Path
) -> None:
    ledger = build_trail_ledger(database_url, calls=3)
    export = tmp_path / "calls.jsonl"
    assert cli(database_url, "export", "--output", str(export)).exit_code == 0

    async def prune_the_trail_session() -> int:
        engine = create_engine(database_url)
        try:
            async with engine.begin() as conn:
                # Only sess_trail's calls are old enough: the other session stays whole.
                await conn.exec_driver_sql(
                    "UPDATE tool_calls SET updated_at = '2000-01-01 00:00:00' WHERE session_id = 'sess_trail'"
                )
            return await AuditStore(engine).prune(datetime.now(UTC) - timedelta(days=1))
        finally:
            await engine.dispose()

    assert asyncio.run(prune_the_trail_session()) == 3

    code, report = verified(database_url, "--all")
    assert (code, report["intact"], report["calls"], report["events"]) == (0, True, 1, 4)
    code, anchored = verified(database_url, "--export", str(export))
    assert code == 0
    assert sorted(anchored["missing"]) == [str(key) for key in ledger.keys]
    assert (anchored["intact"], anchored["calls"]) == (True, 1)
    printed = cli(database_url, "verify-trail", "--export", str(export))
    assert "3 call(s) of the export are no longer in the ledger (pruned since, or deleted)" in printed.stdout


FORGED_CONTENT = {
    "result": '{"type": "function_call_output", "output": "refund approved"}',
    "arguments": '{"amount": 100000}',
    "approved_arguments": '{"amount": 100000}',
    "error_detail": "nothing went wrong",
}
"""What someone with SQL access changes in a call's row, one column per call."""

CONTENT_COVERED = (
    "tool_name, effect_class, arguments, arguments_sha256, approved_arguments, "
    "approved_arguments_sha256, result, error_stage, error_detail"
)


def test_verify_trail__a_calls_content_changed_by_sql__is_named_single_all_and_export__show_flags_it(
    database_url: str, tmp_path: Path
) -> None:
    ledger = build_trail_ledger(database_url, calls=5)
    export = tmp_path / "calls.jsonl"
    assert cli(database_url, "export", "--output", str(export)).exit_code == 0
    assert verified(database_url, "--all")[0] == 0
    forged = dict(zip(ledger.keys, FORGED_CONTENT.items(), strict=False))
    last = {key: ledger.events(key)[-1] for key in forged}
    with ledger.tampering() as sql:
        for key, (column, value) in forged.items():
            sql.execute(
                text(f"UPDATE tool_calls SET {column} = :value WHERE call_id = :call"),  # noqa: S608
                {"value": value, "call": key.call_id},
            )

    code, report = verified(database_url, "--all")

    assert (code, report["intact"], report["calls"], report["broken"]) == (1, False, 6, 4)
    assert {(b["call_id"], b["kind"], b["event_id"]) for b in report["breaks"]} == {
        (key.call_id, "content", last[key].id) for key in forged
    }
    for listed in report["breaks"]:
        assert listed["message"].startswith(
            f"the call's stored content ({CONTENT_COVERED}) was changed outside toolledger after event "
            f"{listed['event_id']} (confirmed submitted -> submitted at "
        )
    result_forged = ledger.keys[0]
    code, one = verified(database_url, str(result_forged))
    assert (code, one["broken"], one["breaks"][0]["kind"]) == (1, 1, "content")
    assert verified(database_url, str(ledger.keys[4]))[0] == 0
    code, anchored = verified(database_url, "--export", str(export))
    assert (code, anchored["file_whole"], anchored["broken"]) == (1, True, 4)
    assert {b["kind"] for b in anchored["breaks"]} == {"content"}
    printed = cli(database_url, "verify-trail", "--all")
    assert (
        printed.stdout.splitlines()[-1]
        == "trail BROKEN: 4 of 6 call(s), 24 event(s) recomputed (the whole ledger)"
    )

    shown = cli(database_url, "show", str(result_forged))
    (trail_line,) = [
        line
        for line in shown.stdout.splitlines()
        if line.startswith("trail ") and not line.startswith("trail head")
    ]
    assert f"BROKEN (content): the call's stored content ({CONTENT_COVERED}) was changed" in trail_line
    assert "What is shown below is NOT what the call's trail recorded" in trail_line
    detail = json.loads(cli(database_url, "show", str(result_forged), "--json").stdout)
    assert detail["call"]["result"] == {"type": "function_call_output", "output": "refund approved"}
    assert (detail["trail"]["intact"], detail["trail"]["kind"], detail["trail"]["event_id"]) == (
        False,
        "content",
        last[result_forged].id,
    )
    untouched = json.loads(cli(database_url, "show", str(ledger.keys[4]), "--json").stdout)
    assert (untouched["trail"]["intact"], untouched["trail"]["content_covered"]) == (True, True)
    assert untouched["trail"]["keyed"] is None
    (fine,) = [
        line
        for line in cli(database_url, "show", str(ledger.keys[4])).stdout.splitlines()
        if line.startswith("trail ") and not line.startswith("trail head")
    ]
    assert f"intact; the content shown is what event {ledger.events(ledger.keys[4])[-1].id} recorded" in fine


TRAIL_KEY = "0123456789abcdef" * 4
KEYED: dict[str, str | None] = {"TOOLLEDGER_TRAIL_KEY": TRAIL_KEY}


def test_verify_trail_keyed__forged_content_or_events_with_the_chain_recomputed__pass_unkeyed_fail_keyed(
    database_url: str,
) -> None:
    ledger = build_trail_ledger(database_url, calls=5, trail_key=TrailKey(TRAIL_KEY.encode()))
    content, edited, appended, stripped, untouched = ledger.keys
    trails = {key: ledger.events(key) for key in ledger.keys}
    code, before = verified(database_url, "--all", "--keyed", env=KEYED)
    assert (code, before["intact"], before["keyed"], before["calls"]) == (0, True, True, 6)

    with ledger.tampering() as sql:
        forge_content(sql, trails[content], result='{"type": "function_call_output", "output": "refunded"}')
        rehash_from(sql, trails[edited], 2, reason="accepted by hand")
        forged = forge_after(
            sql, ledger, trails[appended][-1], kind="flag", to_status=None, reason="all fine"
        )
        rehash_from(sql, trails[stripped], 1, trail_mac=None)

    code, unkeyed = verified(database_url, "--all")
    assert (code, unkeyed["intact"]) == (0, True), "every unkeyed hash and digest was recomputed"
    code, keyed = verified(database_url, "--all", "--keyed", env=KEYED)
    assert (code, keyed["intact"], keyed["broken"]) == (1, False, 4)
    assert {(b["call_id"], b["kind"], b["event_id"]) for b in keyed["breaks"]} == {
        (content.call_id, "forged", trails[content][1].id),
        (edited.call_id, "forged", trails[edited][2].id),
        (appended.call_id, "forged", forged.id),
        (stripped.call_id, "unkeyed", trails[stripped][1].id),
    }
    (named,) = [b["message"] for b in keyed["breaks"] if b["call_id"] == content.call_id]
    assert "or the call's stored result, error_stage, error_detail (which it wrote)" in named
    assert verified(database_url, str(untouched), "--keyed", env=KEYED)[0] == 0

    shown = json.loads(cli(database_url, "show", str(content), "--json", env=KEYED).stdout)
    assert (shown["trail"]["intact"], shown["trail"]["keyed"]) == (True, False)
    other_key: dict[str, str | None] = {"TOOLLEDGER_TRAIL_KEY": "f" * 64}
    assert verified(database_url, str(untouched), "--keyed", env=other_key)[0] == 1
    no_key = cli(database_url, "verify-trail", "--all", "--keyed")
    assert no_key.exit_code == 2
    assert "keyed verification needs the trail's key: set TOOLLEDGER_TRAIL_KEY" in no_key.stderr
    short = cli(database_url, "verify-trail", "--all", "--keyed", env={"TOOLLEDGER_TRAIL_KEY": "short"})
    assert short.exit_code != 0
    assert "short" not in short.output
