"""How long the calls open at each kill of a chaos run waited for their answers.

After each kill the sessions' awaited function calls are read from the emulator (what the
model waits for, whether or not the killed `serve` had recorded them); the clock of each runs
from the next `serve`'s start (the restart) until the emulator accepted its result. When that
`serve` is killed too before answering, the wait goes on through the next trials (their set-up
included) until some `serve` answers: ``later_kills`` says how many kills it spanned. Calls
that end `unknown` (at_most_once, cut off mid-handler: an operator's to settle) are never
answered and are counted apart, as ``left_unknown``.

A figure, never an assertion: the chaos run asserts the history, not timings.
"""

from __future__ import annotations

import asyncio
import bisect
import time
from dataclasses import dataclass, field
from typing import Any

from openai import AsyncOpenAI
from openai.types.beta.agent_session import AgentSession

from tests.support.history import FunctionCallAction, ledger_calls
from tests.support.workload import AT_MOST_ONCE_TOOLS
from toolledger.domain.keys import CallKey
from toolledger.domain.states import CallStatus
from toolledger.emulator import EmulatorServer

RETRIEVES_AT_ONCE = 32


@dataclass
class Kill:
    trial: int
    awaited: set[CallKey]
    restarted_at: float | None = None


@dataclass
class KillWaits:
    """Kills and restarts as the run goes; ``figures()`` once every answer is in."""

    kills: list[Kill] = field(default_factory=list)
    restarts: list[float] = field(default_factory=list)
    _live: set[str] = field(default_factory=set)
    """Sessions that may still await a call that will be answered."""

    def add_sessions(self, session_ids: list[str]) -> None:
        self._live.update(session_ids)

    def restarting(self) -> None:
        """Just before a `serve` starts: the restart after every kill not yet followed by one."""
        now = time.time()
        self.restarts.append(now)
        for kill in self.kills:
            if kill.restarted_at is None:
                kill.restarted_at = now

    async def killed(self, trial: int, emulator: EmulatorServer, database_url: str) -> None:
        """Just after a kill: what the sessions await now."""
        slots = asyncio.Semaphore(RETRIEVES_AT_ONCE)
        async with AsyncOpenAI(base_url=emulator.base_url, api_key="sk-test") as client:

            async def retrieve(session_id: str) -> AgentSession:
                async with slots:
                    return await client.beta.agents.sessions.retrieve(session_id)

            sessions = await asyncio.gather(*(retrieve(s) for s in sorted(self._live)))
        awaited = {
            s.id: [
                CallKey(s.id, a.turn_id, a.call_id)
                for a in s.required_actions
                if isinstance(a, FunctionCallAction)
            ]
            for s in sessions
        }
        self._live -= {s for s, calls in awaited.items() if not calls}
        await self._forget_stuck(database_url, awaited)
        self.kills.append(Kill(trial, {key for calls in awaited.values() for key in calls}))

    async def _forget_stuck(self, database_url: str, awaited: dict[str, list[CallKey]]) -> None:
        """A session awaiting only `unknown` at_most_once calls awaits an operator for ever:
        it is read no more (the run would otherwise read hundreds of them at every kill)."""
        waiting = [s for s, calls in awaited.items() if calls]
        if not waiting:
            return
        ledger = await ledger_calls(database_url, waiting)
        for session_id in waiting:
            calls = [ledger.get(key) for key in awaited[session_id]]
            if all(
                c is not None and c.status is CallStatus.UNKNOWN and c.tool_name in AT_MOST_ONCE_TOOLS
                for c in calls
            ):
                self._live.discard(session_id)

    def figures(self, emulator: EmulatorServer) -> dict[str, Any]:
        """Per kill: calls open, left unknown, the longest wait from the restart to an answer
        and how many later kills it spanned; over the kills: max, p50 and p99 of the longest."""
        answered_at: dict[CallKey, float] = {}
        for receipt in emulator.control.tool_results():
            if receipt.outcome == "accepted":
                key = CallKey(receipt.session_id, receipt.turn_id, receipt.call_id)
                answered_at[key] = min(receipt.received_at, answered_at.get(key, receipt.received_at))
        per_trial: list[dict[str, Any]] = []
        for kill in self.kills:
            answered = [answered_at[key] for key in kill.awaited if key in answered_at]
            longest: float | None = None
            later_kills = 0
            if answered and kill.restarted_at is not None:
                last = max(answered)
                longest = round(max(0.0, last - kill.restarted_at), 2)
                # Restarts between this kill's and the one whose serve gave the last answer.
                later_kills = max(0, bisect.bisect_right(self.restarts, last) - 1 - self._index(kill))
            per_trial.append(
                {
                    "trial": kill.trial,
                    "open_at_kill": len(kill.awaited),
                    "left_unknown": len(kill.awaited) - len(answered),
                    "longest_wait": longest,
                    "later_kills": later_kills,
                }
            )
        longest_waits = [t["longest_wait"] for t in per_trial if t["longest_wait"] is not None]
        return {
            "longest_wait_per_trial": per_trial,
            "longest_wait_max": max(longest_waits, default=None),
            "longest_wait_p50": _percentile(longest_waits, 0.5),
            "longest_wait_p99": _percentile(longest_waits, 0.99),
        }

    def _index(self, kill: Kill) -> int:
        assert kill.restarted_at is not None
        return self.restarts.index(kill.restarted_at)


def _percentile(values: list[float], share: float) -> float | None:
    """Nearest rank, as the benchmarks report theirs."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(share * (len(ordered) - 1))))]
