"""What a conformance check's worker processes do, one job each: get a throwaway ledger
ready, handle the session's call (perhaps dying at the armed crash point), or recover what a
killed worker left, as a fresh process does after a crash.

Each job writes what it found to a JSON file for the check; the ledger stays the judge of
what happened to the call.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from toolledger.domain.keys import CallKey
from toolledger.domain.states import CallStatus
from toolledger.runtime.context import ToolContext, Verification
from toolledger.runtime.registry import RegisteredTool, ToolRegistry, VerifyHook
from toolledger.runtime.tool_ledger import ToolLedger
from toolledger.settings import Settings
from toolledger.store import check_effects
from toolledger.store import migrate as migrations
from toolledger.store.engine import create_engine
from toolledger.testing import probe
from toolledger.testing.workers import API_KEY, Job

LEASE_SECONDS = 0.5
"""A killed worker's claim lapses this soon, so the recovery need not wait long."""
CHECK_OPERATOR = "toolledger check"
"""Who approves a call of a tool that needs approval, on the throwaway ledger's record."""
RECOVERY_SECONDS = 10.0
"""How long the recovery waits for the dead worker's lease to lapse (on the ledger's clock)."""


def run_job(job: Job, registry: ToolRegistry) -> None:
    if job.world:
        probe.bind(Path(job.world))
    found = asyncio.run(_JOBS[job.kind](job, registry))
    Path(job.out).write_text(json.dumps(found), encoding="utf-8")


def recording_answers(registry: ToolRegistry) -> ToolRegistry:
    """The same tools, each verify hook's answers noted in the run's world as it gives them."""
    tools = {tool.name: _recording(tool) for tool in registry}
    return ToolRegistry(_tools=tools)


def _recording(tool: RegisteredTool) -> RegisteredTool:
    hook = tool.verify
    if hook is None:
        return tool

    async def verify(context: ToolContext) -> Verification:
        try:
            answer = hook(context)
            verification = await answer if inspect.isawaitable(answer) else answer
        except Exception as error:
            probe.record_answer(context, f"raised {type(error).__name__}")
            raise
        probe.record_answer(context, str(getattr(verification, "kind", "unknown")))
        return verification

    recording: VerifyHook = verify
    return replace(tool, verify=recording)


def _settings(job: Job) -> Settings:
    return Settings(
        database_url=job.database_url,
        openai_base_url=job.base_url,
        openai_api_key=SecretStr(API_KEY),
        lease_seconds=LEASE_SECONDS,
        worker_id="toolledger-check",
    )


async def _prepare(job: Job, registry: ToolRegistry) -> dict[str, Any]:
    """The ledger every run starts from a copy of: migrated, with the effects table."""
    await asyncio.to_thread(migrations.upgrade, job.database_url)
    engine = create_engine(job.database_url)
    try:
        await check_effects.create_table(engine)
    finally:
        await engine.dispose()
    return {}


async def _run(job: Job, registry: ToolRegistry) -> dict[str, Any]:
    """Handle the session's call, as a worker does when the session lists it."""
    async with ToolLedger(registry, _settings(job), auto_migrate=False) as ledger:
        pending = await ledger.gateway.pending_function_calls(job.session_id)
        actions = [action for action in pending if action.call_id == job.call_id]
        if not actions:
            raise RuntimeError(f"session {job.session_id} does not list the call {job.call_id}")
        await ledger.handle(job.session_id, actions[0])
        waiting = await ledger.store.get(job.key)
        if waiting is not None and waiting.status is CallStatus.AWAITING_APPROVAL:
            # Approved as a person would (`toolledger calls approve`), then run as `serve`
            # runs it: the check is about what the tool does once it runs.
            approved = await ledger.store.approve(
                job.key,
                arguments_sha256=waiting.arguments_sha256,
                decided_by=CHECK_OPERATOR,
                reason=f"approved by {CHECK_OPERATOR}",
            )
            if approved is not None:
                await ledger.executor.handle_recorded(approved)
        return await _observe(ledger, job.key)


async def _recover(job: Job, registry: ToolRegistry) -> dict[str, Any]:
    """What a fresh process does after a crash: recover, once the dead worker's lease lapsed."""
    async with ToolLedger(registry, _settings(job), auto_migrate=False) as ledger:
        before = await check_effects.counts(ledger.engine)
        deadline = time.monotonic() + RECOVERY_SECONDS
        while True:
            await ledger.recover()
            call = await ledger.store.get(job.key)
            if call is None or call.status is not CallStatus.RUNNING or time.monotonic() > deadline:
                break
            await asyncio.sleep(LEASE_SECONDS / 5)
        return {**await _observe(ledger, job.key), "ledger_effects_before": before}


async def _observe(ledger: ToolLedger, key: CallKey) -> dict[str, Any]:
    call = await ledger.store.get(key)
    events = await ledger.store.events(key)
    effects: Counter[str] = await check_effects.counts(ledger.engine)
    payload = call.payload if call is not None else None
    return {
        "status": call.status.value if call is not None else None,
        "runs": sum(1 for e in events if e.to_status == CallStatus.RUNNING.value),
        "payload": payload,
        "ledger_effects": effects,
    }


_JOBS = {"prepare": _prepare, "run": _run, "recover": _recover}
