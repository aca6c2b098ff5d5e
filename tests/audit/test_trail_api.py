"""The audit trail over HTTP, on a real SQLite file and a real PostgreSQL database:
``GET /api/trail`` verifies a call, a session or the whole ledger with a read token (keyed
too, with the server's trail key), a call's detail says whether its content is what its
trail recorded, and ``GET /api/export`` streams the same bytes `toolledger calls export`
writes (chain heads and the closing digest line)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from sqlalchemy import text

from tests.support.api_server import READ, api_settings, serving
from tests.support.calls_cli import cli
from tests.support.trail_ledger import build_trail_ledger, forge_content
from toolledger.audit.api import create_app
from toolledger.domain.trail import TrailKey

TRAIL_KEY = "fedcba9876543210" * 4


async def test_trail__a_call_a_session_or_every_call__each_broken_one_named(database_url: str) -> None:
    ledger = await asyncio.to_thread(build_trail_ledger, database_url, 3)
    edited, other_edited, untouched = ledger.keys
    with ledger.tampering() as sql:
        for key in (edited, other_edited):
            sql.execute(
                text("UPDATE tool_call_events SET actor = 'someone else' WHERE id = :id"),
                {"id": ledger.events(key)[2].id},
            )

    async with serving(create_app(api_settings(database_url))) as client:
        whole = await client.get("/api/trail", params={"all": "true"}, headers=READ)
        limited = await client.get("/api/trail", params={"all": "true", "limit": "1"}, headers=READ)
        one = await client.get("/api/trail", params={"call": str(untouched)}, headers=READ)
        broken_one = await client.get("/api/trail", params={"call": edited.idempotency_key}, headers=READ)
        session = await client.get("/api/trail", params={"session_id": "sess_apart"}, headers=READ)
        refused = [
            await client.get("/api/trail", params=params, headers=READ)
            for params in (
                {},
                {"all": "true", "session_id": "sess_apart"},
                {"session_id": ""},
                {"limit": "0"},
            )
        ]
        nobody = await client.get("/api/trail", params={"session_id": "sess_nobody"}, headers=READ)

    assert whole.status_code == 200, whole.text
    report = whole.json()
    assert (report["scope"], report["intact"], report["calls"], report["broken"]) == (
        "the whole ledger",
        False,
        4,
        2,
    )
    assert {(b["call_id"], b["kind"]) for b in report["breaks"]} == {
        (edited.call_id, "edited"),
        (other_edited.call_id, "edited"),
    }
    assert (len(limited.json()["breaks"]), limited.json()["breaks_not_listed"]) == (1, 1)
    assert (one.json()["intact"], one.json()["calls"], one.json()["events"]) == (True, 1, 4)
    assert broken_one.json()["breaks"][0]["event_id"] == ledger.events(edited)[2].id
    assert (session.json()["scope"], session.json()["intact"]) == ("session sess_apart", True)
    assert [r.status_code for r in refused] == [400, 400, 400, 400]
    assert "exactly one of call, session_id or all=true" in refused[0].json()["detail"]
    assert nobody.status_code == 404


async def test_export__streams_what_the_cli_writes__and_verifies_as_an_export(
    database_url: str, tmp_path: Path
) -> None:
    await asyncio.to_thread(build_trail_ledger, database_url, 2)

    async with serving(create_app(api_settings(database_url))) as client:
        jsonl = await client.get("/api/export", headers=READ)
        csv = await client.get("/api/export", params={"format": "csv", "sort": "tool"}, headers=READ)
        nothing = await client.get(
            "/api/export", params={"unknown_only": "true", "status": "running"}, headers=READ
        )
        refused = await client.get("/api/export", params={"format": "xml"}, headers=READ)

    assert jsonl.status_code == 200, jsonl.text
    assert jsonl.headers["content-type"] == "application/x-ndjson"
    assert jsonl.headers["content-disposition"] == 'attachment; filename="toolledger-calls.jsonl"'
    assert csv.headers["content-type"] == "text/csv; charset=utf-8"
    from_cli = await asyncio.to_thread(cli, database_url, "export")
    csv_from_cli = await asyncio.to_thread(cli, database_url, "export", "--format", "csv", "--sort", "tool")
    assert jsonl.text == from_cli.stdout
    assert csv.text == csv_from_cli.stdout
    *calls, digest = jsonl.text.splitlines()
    assert len(calls) == 3
    assert all(json.loads(line)["trail_events"] == 4 for line in calls)
    assert json.loads(digest)["calls"] == 3
    assert json.loads(nothing.text.splitlines()[-1])["calls"] == 0
    assert refused.status_code == 400

    saved = tmp_path / "from-api.jsonl"
    saved.write_bytes(jsonl.content)
    checked = await asyncio.to_thread(cli, database_url, "verify-trail", "--export", str(saved))
    assert checked.exit_code == 0, checked.output
    assert checked.stdout.startswith("export file whole: its 3 call(s) hash to its digest line")


async def test_trail__content_changed_by_sql__named_by_the_trail_and_flagged_in_the_calls_detail(
    database_url: str,
) -> None:
    ledger = await asyncio.to_thread(
        build_trail_ledger, database_url, 3, trail_key=TrailKey(TRAIL_KEY.encode())
    )
    changed, rewritten, untouched = ledger.keys
    last = ledger.events(changed)[-1]
    with ledger.tampering() as sql:
        sql.execute(
            text("UPDATE tool_calls SET arguments = :forged WHERE call_id = :call"),
            {"forged": '{"amount": 100000}', "call": changed.call_id},
        )
        forge_content(sql, ledger.events(rewritten), error_detail="nothing went wrong")

    async with serving(create_app(api_settings(database_url, trail_key=TRAIL_KEY))) as client:
        whole = await client.get("/api/trail", params={"all": "true"}, headers=READ)
        keyed = await client.get("/api/trail", params={"all": "true", "keyed": "true"}, headers=READ)
        detail = await client.get(f"/api/calls/{changed.idempotency_key}", headers=READ)
        forged = await client.get(f"/api/calls/{rewritten.idempotency_key}", headers=READ)
        fine = await client.get(f"/api/calls/{untouched.idempotency_key}", headers=READ)
    async with serving(create_app(api_settings(database_url))) as client:
        keyless = await client.get("/api/trail", params={"all": "true", "keyed": "true"}, headers=READ)

    assert whole.status_code == 200, whole.text
    assert {(b["call_id"], b["kind"], b["event_id"]) for b in whole.json()["breaks"]} == {
        (changed.call_id, "content", last.id)
    }
    assert {(b["call_id"], b["kind"]) for b in keyed.json()["breaks"]} == {
        (changed.call_id, "content"),
        (rewritten.call_id, "forged"),
    }
    assert keyed.json()["keyed"] is True
    trail = detail.json()["trail"]
    assert (trail["intact"], trail["kind"], trail["event_id"]) == (False, "content", last.id)
    assert "was changed outside toolledger after event" in trail["message"]
    assert detail.json()["call"]["arguments"] == {"amount": 100000}
    assert (forged.json()["trail"]["intact"], forged.json()["trail"]["keyed"]) == (True, False)
    assert "error_detail (which it wrote)" in forged.json()["trail"]["keyed_message"]
    assert fine.json()["trail"] == {
        "intact": True,
        "content_covered": True,
        "kind": None,
        "event_id": None,
        "message": None,
        "keyed": True,
        "keyed_message": None,
    }
    assert all(event["content_sha256"] and event["trail_mac"] for event in fine.json()["timeline"])
    assert keyless.status_code == 400
    assert "TOOLLEDGER_TRAIL_KEY" in keyless.json()["detail"]
