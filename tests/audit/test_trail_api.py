"""The audit trail over HTTP, on a real SQLite file and a real PostgreSQL database:
``GET /api/trail`` verifies a call, a session or the whole ledger with a read token, and
``GET /api/export`` streams the same bytes `toolledger calls export` writes (chain heads and
the closing digest line)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from sqlalchemy import text

from tests.support.api_server import READ, api_settings, serving
from tests.support.calls_cli import cli
from tests.support.trail_ledger import build_trail_ledger
from toolledger.audit.api import create_app


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
