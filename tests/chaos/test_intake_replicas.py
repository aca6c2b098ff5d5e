"""The intake with real replicas: `toolledger serve --agent A --listen 127.0.0.1:<port>`
subprocesses behind a round-robin load balancer (tests/support/load_balancer.py), the emulator
sending its signed webhooks to the balancer, sessions of agent A that nobody registers.

- Three replicas on one PostgreSQL ledger, one SIGKILLed while inside handlers: every call of
  agent A's sessions answered exactly once (the strict history check), the session of another
  agent never answered, however the webhooks fell on the replicas.
- Every replica down when the sessions are created (the balancer answers 502): they are
  answered once the replicas start, by the webhook's retry or, its webhook dropped, by the
  sweep; one replica on SQLite, two on PostgreSQL.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from openai import AsyncOpenAI

from tests.runtime.test_intake import new_agent
from tests.support.history import assert_history, create_refunds_table, wait_quiescent
from tests.support.intake_replicas import IntakeReplicas, webhook_url
from tests.support.load_balancer import LoadBalancer
from tests.support.polling import eventually
from tests.support.webhooks import SECRET
from tests.support.workload import (
    EVERY_CLASS_CALLS,
    assert_exactly_once,
    every_class_script,
    read_effects,
    shop_script,
    start_sessions,
)
from toolledger.emulator import EmulatorServer, Script

PAUSE_MS = 1500


def notify_paused_first() -> Script:
    """The six calls of every_class_script, the first step's notify paused: sessions started
    together are all inside it at once, and no at_most_once call runs until it is over (a kill
    then cuts off idempotent handlers only, so every call must end answered)."""
    return Script.of_calls(
        [("notify", {"message": "paid", "pause_ms": PAUSE_MS}), ("lookup", {"order_id": "A1"})],
        [("charge", {"amount": 10}), ("record_refund", {"cents": 5}), ("ship", {"parcel": "P1"})],
        [("notify", {"message": "shipped"})],
    )


async def session_status(emulator: EmulatorServer, session_id: str) -> str:
    async with AsyncOpenAI(base_url=emulator.base_url, api_key="sk-test") as client:
        return (await client.beta.agents.sessions.retrieve(session_id)).status


async def test_intake_replicas__three_behind_a_balancer__one_sigkilled_inside_handlers__every_call_once(
    postgres_url: str, emulator: EmulatorServer, effects_file: Path, tmp_path: Path
) -> None:
    await create_refunds_table(postgres_url)
    mine, theirs = await new_agent(emulator), await new_agent(emulator)
    # No sweep within the test: the webhooks, and the take-over of the dead replica's looks
    # and calls, must do it all.
    with (
        IntakeReplicas(postgres_url, emulator.base_url, mine, tmp_path, 3, sweep_seconds=3600) as replicas,
        LoadBalancer(replicas.backends) as balancer,
    ):
        emulator.control.configure_webhooks(webhook_url(balancer.url), SECRET)
        serves = replicas.start_all()
        for serve in serves:
            await asyncio.to_thread(serve.wait_serving)
        paused = await start_sessions(emulator, 6, notify_paused_first(), agent_id=mine)
        foreign = await start_sessions(emulator, 1, shop_script(), agent_id=theirs)

        pids = {serve.pid: index for index, serve in enumerate(serves)}
        victim: list[int] = []

        async def inside_a_notify() -> bool:
            # A replica inside a paused notify: killed 0.2 s in, well inside its pause.
            running = [e for e in read_effects(effects_file) if e.tool == "notify" and e.pid in pids]
            if running:
                victim.append(pids[running[0].pid])
            return bool(running)

        await eventually(inside_a_notify, within=30, what="a replica inside a notify", interval=0.05)
        await asyncio.sleep(0.2)
        killed_at = time.monotonic()
        replicas.kill(victim[0])
        # Created with a replica down: a third of their webhooks meet it (502, sent again).
        later = await start_sessions(emulator, 2, every_class_script(), agent_id=mine)
        ours = paused + later
        states = await wait_quiescent(emulator, postgres_url, ours, within=90)
        settled_in = time.monotonic() - killed_at
        counts = emulator.control.webhook_counts()
        assert await session_status(emulator, foreign[0]) == "requires_action"
        balanced = dict(balancer.counts)

    killed_pid = serves[victim[0]].pid
    assert any(e.pid == killed_pid for e in read_effects(effects_file)), "the kill cut off handlers"
    assert set(states.values()) == {"idle"}, states
    figures = await assert_history(emulator, postgres_url, ours, states, effects_file)
    assert figures["lost"] == 0
    assert_exactly_once(emulator, ours, effects_file, EVERY_CLASS_CALLS)
    assert [r for r in emulator.control.tool_results() if r.session_id == foreign[0]] == []
    assert not [e for e in read_effects(effects_file) if e.session_id == foreign[0]]
    assert counts.given_up == 0
    assert balanced.get("status_200", 0) >= 1
    # The dead replica's looks and calls were taken over at once, not when a lease ran out.
    assert settled_in < 30, f"settled {settled_in:.1f}s after the kill"


@pytest.mark.parametrize("by", ["webhook_retry", "sweep"])
async def test_intake_replicas__sessions_created_while_every_replica_is_down__answered_once_they_start(
    database_url: str, emulator: EmulatorServer, effects_file: Path, tmp_path: Path, by: str
) -> None:
    count = 1 if database_url.startswith("sqlite") else 2
    await create_refunds_table(database_url)
    mine = await new_agent(emulator)
    # webhook_retry: no sweep within the test, the emulator's retries deliver once a replica
    # is up. sweep: every webhook dropped, the first sweep finds the sessions.
    sweep_seconds = 3600.0 if by == "webhook_retry" else 1.0
    drop = 0.0 if by == "webhook_retry" else 1.0
    with (
        IntakeReplicas(
            database_url, emulator.base_url, mine, tmp_path, count, sweep_seconds=sweep_seconds
        ) as replicas,
        LoadBalancer(replicas.backends) as balancer,
    ):
        emulator.control.configure_webhooks(webhook_url(balancer.url), SECRET, drop=drop, seed=3)
        session_ids = await start_sessions(emulator, 3, every_class_script(), agent_id=mine)

        async def all_waiting() -> bool:
            states = [await session_status(emulator, s) for s in session_ids]
            return states == ["requires_action"] * len(session_ids)

        await eventually(all_waiting, within=10, what="the sessions awaiting their first calls")
        if by == "webhook_retry":
            await eventually(
                lambda: balancer.counts["unreachable"] >= len(session_ids),
                within=10,
                what="their webhooks refused by the balancer (no replica up)",
            )
        await asyncio.sleep(1.0)  # down a while: the webhooks are between retries
        assert read_effects(effects_file) == []
        for serve in replicas.start_all():
            await asyncio.to_thread(serve.wait_serving)
        states = await wait_quiescent(emulator, database_url, session_ids, within=60)
        counts = emulator.control.webhook_counts()

    assert set(states.values()) == {"idle"}, states
    figures = await assert_history(emulator, database_url, session_ids, states, effects_file)
    assert figures["lost"] == 0
    assert_exactly_once(emulator, session_ids, effects_file, EVERY_CLASS_CALLS)
    if by == "webhook_retry":
        assert counts.failed_attempts >= len(session_ids)
        assert counts.delivered >= len(session_ids)
    else:
        assert counts.delivered == 0
