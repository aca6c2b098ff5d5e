"""Each kind of answer the Agents API can give a submission, against a running service:
transient ones end in exactly one accepted result (same key, same body on every try);
refusals are not retried in a tight loop, and the stored result goes out once the API
accepts again."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from tests.support.history import ledger_calls
from tests.support.polling import eventually
from tests.support.service_harness import running_service
from tests.support.workload import read_effects, start_sessions, wait_until_idle
from toolledger.domain.states import CallStatus
from toolledger.emulator import EmulatorServer, Script

ONE_CALL = Script.of_calls([("lookup", {"order_id": "A1"})])


@pytest.mark.parametrize(
    ("status", "retry_after", "count"),
    [(500, None, 3), (502, None, 2), (503, 1.0, 1), (429, 1.0, 2), (408, None, 2), (409, None, 2)],
)
async def test_transient_answers__end_in_one_accepted_result_with_one_key_and_body(
    status: int,
    retry_after: float | None,
    count: int,
    sqlite_url: str,
    emulator: EmulatorServer,
    effects_file: Path,
) -> None:
    [session_id] = await start_sessions(emulator, 1, ONE_CALL)
    emulator.control.fail_submissions(count, status=status, retry_after=retry_after, session_id=session_id)
    started = time.monotonic()
    async with running_service(sqlite_url, emulator) as service:
        await service.watch(session_id)
        await wait_until_idle(emulator, [session_id])
    took = time.monotonic() - started

    received = emulator.control.tool_results(session_id)
    assert [r.outcome for r in received] == ["rejected"] * count + ["accepted"]
    assert len({r.idempotency_key for r in received}) == 1
    assert len({json.dumps(r.payload, sort_keys=True) for r in received}) == 1
    assert len(read_effects(effects_file)) == 1, "retrying a submission never re-runs the handler"
    if retry_after is not None:
        assert took >= retry_after * count, "Retry-After was honoured"


async def test_credentials_refused_on_a_submission__the_service_fails_and_the_result_is_kept(
    sqlite_url: str, emulator: EmulatorServer, effects_file: Path
) -> None:
    """A 401 says the key itself is refused: nothing will work until it is fixed, so the
    service stops saying so, instead of recording a refusal per call and retrying forever."""
    [session_id] = await start_sessions(emulator, 1, ONE_CALL)
    emulator.control.fail_submissions(1000, status=401, session_id=session_id)
    async with running_service(sqlite_url, emulator) as service:
        await service.watch(session_id)
        await asyncio.wait_for(service.failed.wait(), timeout=10.0)
        assert service.failure is not None
        assert "refused the credentials (HTTP 401" in str(service.failure)
    [call] = (await ledger_calls(sqlite_url, [session_id])).values()
    assert call.status is CallStatus.SUCCEEDED, "the result is kept for the next start"
    assert call.last_submission_error is None, "not the call's refusal"


@pytest.mark.parametrize("status", [400, 403, 422])
async def test_refusals__are_not_retried_in_a_tight_loop_and_the_result_waits(
    status: int, sqlite_url: str, emulator: EmulatorServer, effects_file: Path
) -> None:
    [session_id] = await start_sessions(emulator, 1, ONE_CALL)
    emulator.control.fail_submissions(1000, status=status, session_id=session_id)
    interval = 0.5
    async with running_service(sqlite_url, emulator, reconcile_interval_seconds=interval) as service:
        await service.watch(session_id)
        await asyncio.sleep(3.0)
        refused = emulator.control.tool_results(session_id)
        [call] = (await ledger_calls(sqlite_url, [session_id])).values()
        assert call.status is CallStatus.SUCCEEDED, "the result is kept, not lost or abandoned"
        assert call.last_submission_error is not None
        assert f"HTTP {status}" in call.last_submission_error
        # Once per reconcile pass at most (plus the first try): no tight loop.
        assert 1 <= len(refused) <= 3.0 / interval + 2

        emulator.control.clear_faults()
        await wait_until_idle(emulator, [session_id])
        await eventually(lambda: _submitted(sqlite_url, session_id))

    assert [r.outcome for r in emulator.control.tool_results(session_id)][-1] == "accepted"
    assert len(read_effects(effects_file)) == 1


async def _submitted(database_url: str, session_id: str) -> bool:
    [call] = (await ledger_calls(database_url, [session_id])).values()
    return call.status is CallStatus.SUBMITTED
