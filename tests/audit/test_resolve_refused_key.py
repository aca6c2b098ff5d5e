"""A resolution whose submission the Agents API refuses (the key): it is on the record, the
answer says it was not sent, and `serve` submits it later; no 500."""

from __future__ import annotations

import asyncio

from pydantic import SecretStr

from tests.support.api_server import FULL, api_settings, serving
from toolledger.audit.api import create_app
from toolledger.domain.keys import CallKey
from toolledger.domain.states import EffectClass
from toolledger.emulator import EmulatorServer
from toolledger.store.engine import create_engine
from toolledger.store.ledger import LedgerStore
from toolledger.store.migrate import upgrade


async def test_resolve__key_refused_when_submitting__recorded_and_answered_submit_failed(
    database_url: str,
) -> None:
    upgrade(database_url)
    key = CallKey("sess_k", "turn_k", "call_k")
    engine = create_engine(database_url)
    try:
        store = LedgerStore(engine, actor="worker")
        await store.record(
            key, tool_name="charge", arguments={}, effect_class=EffectClass.AT_MOST_ONCE, lease_seconds=0.01
        )
        await asyncio.sleep(0.05)
        assert [c.key for c in await store.expire_leases()] == [key]
    finally:
        await engine.dispose()

    with EmulatorServer(api_key="the-right-key") as keyed:
        settings = api_settings(database_url, keyed.base_url, openai_api_key=SecretStr("sk-wrong-key"))
        async with serving(create_app(settings)) as client:
            response = await client.post(
                f"/api/calls/{key}/resolve",
                json={"kind": "error", "text": "not charged", "reason": "checked the bank"},
                headers=FULL,
            )
    assert response.status_code == 200, response.text
    assert response.json()["action"] == "submit_failed"
    assert response.json()["call"]["status"] == "failed", "the resolution is on the record"
