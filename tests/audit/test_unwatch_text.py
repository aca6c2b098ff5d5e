"""The API writes an operator's unwatch reason through the same storable-text rule as every
other writer: a NUL in it was a 500 on PostgreSQL (SQLite stored it)."""

from __future__ import annotations

from tests.support.api_server import FULL, api_settings, serving
from toolledger.audit.api import create_app
from toolledger.store.migrate import upgrade


async def test_unwatch_reason_with_nul__stored_escaped_on_both_databases(database_url: str) -> None:
    upgrade(database_url)
    app = create_app(api_settings(database_url))
    async with serving(app) as client:
        assert (await client.post("/api/sessions/s1/watch", headers=FULL)).status_code == 200
        unwatched = await client.post("/api/sessions/s1/unwatch", json={"reason": "a\u0000b"}, headers=FULL)
    assert unwatched.status_code == 200, unwatched.text
    assert unwatched.json()["reason"].startswith("a\\u0000b")
