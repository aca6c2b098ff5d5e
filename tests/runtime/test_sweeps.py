"""The sweep: new sessions down to the watermark, then a rolling pass over older ones that
goes on where the previous sweep stopped, so that an old session's next turn whose webhook is
lost is found too (within one sweep for an agent with up to ROLLING_SESSIONS sessions)."""

from __future__ import annotations

import time

import pytest

from tests.runtime.test_intake import new_agent, new_session
from toolledger.emulator import EmulatorServer
from toolledger.errors import AgentsAuthError
from toolledger.gateway.agents import AgentsGateway
from toolledger.runtime import looks
from toolledger.runtime.looks import Sweeper
from toolledger.settings import Settings
from toolledger.store.engine import create_engine
from toolledger.store.intake import IntakeStore
from toolledger.store.sessions import SessionStore


def _fatal(error: AgentsAuthError) -> None:
    raise error


async def test_sweep__older_sessions__covered_in_turn_by_the_rolling_pass(
    database_url: str, emulator: EmulatorServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(looks, "ROLLING_SESSIONS", 2)
    agent_id = await new_agent(emulator)
    waiting = [await new_session(emulator, agent_id) for _ in range(5)]
    engine = create_engine(database_url)
    gateway = AgentsGateway.connect(api_key="sk-test", base_url=emulator.base_url)
    try:
        store, sessions = IntakeStore(engine), SessionStore(engine)
        settings = Settings(agent_ids=agent_id, sweep_seconds=0.01)
        sweeper = Sweeper(settings, store, sessions, gateway, "me", on_fatal=_fatal)
        # A watermark past them all: every session is an "old" one, left to the rolling pass.
        first = await store.claim_sweep(agent_id, "me", every_seconds=0, lease_seconds=60)
        assert first is not None
        await store.finish_sweep(first, "me", watermark=int(time.time()) + 3600, found=0)

        found_per_sweep = []
        for _ in range(3):
            claim = await store.claim_sweep(agent_id, "me", every_seconds=0, lease_seconds=60)
            assert claim is not None
            found_per_sweep.append(await sweeper.sweep(claim))
        asked = {
            record.session_id for record in await sessions.find(watched=None) if record.intake == "sweep"
        }
        last = (await store.sweeps())[0]
    finally:
        await gateway.close()
        await engine.dispose()

    assert found_per_sweep == [2, 2, 1], "two sessions a sweep, the last sweep reaching the end"
    assert asked == set(waiting)
    assert last.resume_after is None, "the pass wrapped around: the next sweep starts at the newest"


async def test_sweep__first_sweep__looks_at_every_session_awaiting_an_action(
    sqlite_url: str, emulator: EmulatorServer
) -> None:
    agent_id, other = await new_agent(emulator), await new_agent(emulator)
    mine = [await new_session(emulator, agent_id) for _ in range(3)]
    await new_session(emulator, other)
    engine = create_engine(sqlite_url)
    gateway = AgentsGateway.connect(api_key="sk-test", base_url=emulator.base_url)
    try:
        store, sessions = IntakeStore(engine), SessionStore(engine)
        sweeper = Sweeper(Settings(agent_ids=agent_id), store, sessions, gateway, "me", on_fatal=_fatal)
        claim = await store.claim_sweep(agent_id, "me", every_seconds=30, lease_seconds=60)
        assert claim is not None
        found = await sweeper.sweep(claim)
        again = await store.claim_sweep(agent_id, "me", every_seconds=30, lease_seconds=60)
        records = {r.session_id: r for r in await sessions.find(watched=None)}
        sweep = (await store.sweeps())[0]
    finally:
        await gateway.close()
        await engine.dispose()

    assert found == 3
    assert set(records) == set(mine), "the other agent's session is not even asked about"
    assert {r.agent_id for r in records.values()} == {agent_id}
    assert all(r.look_requested_at is not None for r in records.values())
    assert again is None, "not due again for 30 s"
    assert sweep.watermark is not None
    assert sweep.runs == 1
