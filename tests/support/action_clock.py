"""When each function call was first required of us, read from the sessions' own event
streams, to time how long the service took to answer it (the emulator keeps no such time).

An observer of the test's own: one SSE stream per session, opened as the session is created,
read on a background thread with its own event loop (the test's loop blocks at times, and a
late read would make the waits look shorter). The first event of a stream is a snapshot of the
session's status: a session already requiring an action then is timed from the stream's
opening, a little late. A stream ends when its session's turn is over (``idle``/``failed``)
or when the clock stops.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import httpx

from toolledger.domain.keys import CallKey
from toolledger.emulator import EmulatorServer

ENDS = frozenset({"agent.session.idle", "agent.session.failed"})


@dataclass
class Step:
    """One entry of a session into requires_action, and the calls it newly required."""

    session_id: str
    entered_at: float
    calls: set[CallKey] = field(default_factory=set)


class ActionClock:
    def __init__(self, emulator: EmulatorServer) -> None:
        self.base_url = emulator.base_url.rstrip("/")
        self.steps: list[Step] = []
        self.failures: list[str] = []
        self._seen: set[CallKey] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="action-clock", daemon=True)
        self._client: httpx.AsyncClient | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self) -> ActionClock:
        self._thread.start()
        return self

    def watch(self, session_ids: list[str]) -> None:
        """Open the sessions' streams (returns once they are open)."""
        future: Future[None] = asyncio.run_coroutine_threadsafe(self._open(session_ids), self._loop)
        future.result(timeout=30)

    async def _open(self, session_ids: list[str]) -> None:
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(None, connect=10.0),
                headers={"authorization": "Bearer sk-test"},
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=0),
            )
        opened = [asyncio.get_running_loop().create_future() for _ in session_ids]
        for session_id, ready in zip(session_ids, opened, strict=True):
            task = asyncio.create_task(self._follow(session_id, ready))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        await asyncio.gather(*opened)

    async def _follow(self, session_id: str, ready: asyncio.Future[None]) -> None:
        assert self._client is not None
        try:
            url = f"{self.base_url}/agents/sessions/{session_id}/events"
            async with self._client.stream("GET", url) as r:
                ready.set_result(None)
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    now = time.time()
                    event: dict[str, Any] = json.loads(line[len("data:") :])
                    kind = event.get("type")
                    if kind == "agent.session.requires_action":
                        self._entered(session_id, now, event.get("session") or {})
                    elif kind in ENDS:
                        return
        except Exception as error:  # a figure's observer: said in the report, never fatal
            self.failures.append(f"{session_id}: {type(error).__name__}: {error}")
        finally:
            if not ready.done():
                ready.set_result(None)

    def _entered(self, session_id: str, now: float, session: dict[str, Any]) -> None:
        step = Step(session_id, now)
        for action in session.get("required_actions") or []:
            if action.get("type") != "function_call":
                continue
            key = CallKey(session_id, action["turn_id"], action["call_id"])
            if key not in self._seen:
                self._seen.add(key)
                step.calls.add(key)
        if step.calls:
            self.steps.append(step)

    def stop(self) -> None:
        async def close() -> None:
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            if self._client is not None:
                await self._client.aclose()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> ActionClock:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    def waits(self, emulator: EmulatorServer) -> list[tuple[Step, float | None]]:
        """Per step: seconds from requires_action to the last of its calls' accepted results
        (None when one of them was never answered: an at_most_once call left `unknown`)."""
        answered_at: dict[CallKey, float] = {}
        for receipt in emulator.control.tool_results():
            if receipt.outcome == "accepted":
                key = CallKey(receipt.session_id, receipt.turn_id, receipt.call_id)
                answered_at[key] = min(receipt.received_at, answered_at.get(key, receipt.received_at))
        waits: list[tuple[Step, float | None]] = []
        for step in list(self.steps):
            if all(key in answered_at for key in step.calls):
                waits.append((step, max(0.0, max(answered_at[k] for k in step.calls) - step.entered_at)))
            else:
                waits.append((step, None))
        return waits


def percentile(values: list[float], share: float) -> float | None:
    """Nearest rank, as tests/chaos/waits.py and the benchmarks report theirs."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(share * (len(ordered) - 1))))]


__all__ = ["ActionClock", "Step", "percentile"]
