"""Serving sessions without an event stream: looks and sweeps.

A session that came by a webhook or a sweep (an *intake* session) is served by looks. A look
is asked for in the database (``sessions.look_requested_at``) by a webhook, a sweep, a known
wait's end or an operator's decision; any replica claims it (one at a time, under a lease),
reads the session's agent once, and, for a configured agent, reconciles the session: its
listed ``function_call`` actions run through the ledger as the streams' do, its results are
submitted, and the look is given back (due again at a known wait's end). Nothing is held per
session between looks: a replica's memory does not grow with the number of sessions.

The sweep pages each configured agent's sessions newest first, down to the watermark the
previous sweep left, then a rolling share of the older ones (``ROLLING_SESSIONS``, on from
where the previous sweep stopped), and asks for a look at those that require an action: what
a dropped webhook, or no webhook at all, leaves waiting.
One replica sweeps an agent at a time (a lease on its ``agent_sweeps`` row).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable

from toolledger import metrics
from toolledger.domain.records import LookClaim
from toolledger.errors import AgentsAuthError, SessionGoneError
from toolledger.gateway.agents import AgentsGateway
from toolledger.logs import log_fields
from toolledger.runtime.loop_logging import log_failure
from toolledger.runtime.reconciler import Reconciler
from toolledger.runtime.wakeups import woken_within
from toolledger.settings import Settings
from toolledger.store.intake import IntakeStore, SweepClaim
from toolledger.store.sessions import SessionStore

log = logging.getLogger("toolledger.intake")

LOOKS_AT_ONCE = 64
"""Looks one replica runs at once (each a reconcile: its listed calls run under the
executor's own bound on concurrent calls)."""
LOOK_LEASE_SECONDS = 30.0
"""A look held longer (its calls still running) may be taken by another replica: harmless,
the ledger runs each call once; the second look finds them running and waits."""
LOOK_POLL_SECONDS = 0.25
"""How often a replica asks the database for due looks (its own webhooks wake it at once)."""
LOOK_AGAIN_AFTER_FAILURE = 5.0
ROLLING_SESSIONS = 1000
"""Older sessions (below the watermark) each sweep pages on from where the last one stopped,
wrapping around at the end: an agent with up to this many sessions has all of them looked
over at every sweep; one with N more, within N / ROLLING_SESSIONS sweeps. A long-lived
session's next turn, whose webhook is lost, is found that way."""
SWEEP_STATUSES = frozenset({"requires_action", "budget_reached"})


class LookTaker:
    """Claims due looks and runs them; ``counts`` by result."""

    def __init__(
        self,
        settings: Settings,
        sessions: SessionStore,
        reconciler: Reconciler,
        gateway: AgentsGateway,
        owner: str,
        *,
        on_fatal: Callable[[AgentsAuthError], None],
    ) -> None:
        self.sessions = sessions
        self.reconciler = reconciler
        self.gateway = gateway
        self.owner = owner
        self.agent_ids = frozenset(settings.agent_ids)
        self._on_fatal = on_fatal
        self._looking: dict[str, asyncio.Task[None]] = {}
        self._wake = asyncio.Event()
        self.counts: Counter[str] = Counter()

    def wake(self) -> None:
        """A look was asked for here (a webhook this replica took): claim it now."""
        self._wake.set()

    @property
    def looking(self) -> int:
        return len(self._looking)

    async def run(self) -> None:
        while True:
            self._wake.clear()
            claimed = 0
            try:
                free = LOOKS_AT_ONCE - len(self._looking)
                claims = await self.sessions.claim_looks(self.owner, free, LOOK_LEASE_SECONDS)
                claimed = len(claims)
                for claim in claims:
                    self._looking[claim.session_id] = asyncio.create_task(
                        self._look(claim), name=f"look {claim.session_id}"
                    )
            except Exception:
                log_failure(log, "claiming looks failed; retrying")
            if claimed and len(self._looking) < LOOKS_AT_ONCE:
                continue  # more may be due
            await woken_within(self._wake, LOOK_POLL_SECONDS)

    async def stop(self) -> None:
        tasks = list(self._looking.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._looking.clear()
        try:
            await self.sessions.release_looks(self.owner)
        except Exception:
            log_failure(log, "shutdown: looks were not given back; their leases expire on their own")

    async def _look(self, claim: LookClaim) -> None:
        session_id = claim.session_id
        again_in: float | None = None
        agent_id = claim.agent_id
        try:
            with log_fields(session_id=session_id):
                result, agent_id, again_in = await self._look_at(claim)
                self.counts[result] += 1
                metrics.LOOKS.labels(result).inc()
        except AgentsAuthError as error:
            self._on_fatal(error)
            again_in = LOOK_AGAIN_AFTER_FAILURE
        except Exception:
            log_failure(
                log, "session %s: look failed; looking again in %.0fs", session_id, LOOK_AGAIN_AFTER_FAILURE
            )
            self.counts["failed"] += 1
            metrics.LOOKS.labels("failed").inc()
            again_in = LOOK_AGAIN_AFTER_FAILURE
        finally:
            self._looking.pop(session_id, None)
        try:
            await self.sessions.finish_look(claim, self.owner, again_in=again_in, agent_id=agent_id)
        except Exception:
            log_failure(
                log, "session %s: the look was not given back; its lease expires on its own", session_id
            )

    async def _look_at(self, claim: LookClaim) -> tuple[str, str | None, float | None]:
        """What the look did, the session's agent (read once, then kept on its row), and when
        to look again (a wait with a known end), if at all."""
        session_id = claim.session_id
        agent_id = claim.agent_id
        if agent_id is None:
            try:
                agent_id = (await self.gateway.retrieve(session_id)).agent.id
            except SessionGoneError:
                return "gone", None, None
        if agent_id not in self.agent_ids:
            # Never answered: its tools may share our names, but not our agent's meaning.
            log.debug("session %s belongs to agent %s, not configured here: left alone", session_id, agent_id)
            return "other_agent", agent_id, None
        started = time.monotonic()
        result = await self.reconciler.reconcile_session(session_id)
        if result.actions:
            done = ", ".join(f"{action} {count}" for action, count in sorted(result.actions.items()))
            log.info("session %s looked at: %s (%.2fs)", session_id, done, time.monotonic() - started)
        again_in = result.retry_in if result.stopped is None else None
        return "reconciled", agent_id, again_in


class Sweeper:
    """Sweeps each configured agent's sessions when due, under a lease per agent."""

    def __init__(
        self,
        settings: Settings,
        store: IntakeStore,
        sessions: SessionStore,
        gateway: AgentsGateway,
        owner: str,
        *,
        on_fatal: Callable[[AgentsAuthError], None],
        on_found: Callable[[], None] | None = None,
    ) -> None:
        self.store = store
        self.sessions = sessions
        self.gateway = gateway
        self.owner = owner
        self.agent_ids = tuple(settings.agent_ids)
        self.every = settings.sweep_seconds
        self._on_fatal = on_fatal
        self._on_found = on_found
        self.overlap = max(60.0, 2 * self.every)
        """Seconds below the watermark a sweep still pages: a session listed late is not missed."""

    async def run(self) -> None:
        while True:
            for agent_id in self.agent_ids:
                try:
                    claim = await self.store.claim_sweep(
                        agent_id,
                        self.owner,
                        every_seconds=self.every,
                        lease_seconds=max(60.0, 4 * self.every),
                    )
                    if claim is not None:
                        await self.sweep(claim)
                except AgentsAuthError as error:
                    self._on_fatal(error)
                    return
                except Exception:
                    log_failure(log, "sweeping agent %s failed; retrying", agent_id)
            await asyncio.sleep(min(max(self.every / 4, 0.05), 5.0))

    async def sweep(self, claim: SweepClaim) -> int:
        """Page the agent's new sessions (down to the watermark), then go on with the rolling
        pass over older ones (``ROLLING_SESSIONS`` of them, from where the last sweep
        stopped); ask for a look at those awaiting an action. Returns how many were found."""
        newest: int | None = None
        found: dict[str, None] = {}
        paged = 0
        started = time.monotonic()
        try:
            if claim.watermark is not None:
                floor = claim.watermark - self.overlap
                async for session in self.gateway.agent_sessions(claim.agent_id):
                    paged += 1
                    newest = session.created_at if newest is None else max(newest, session.created_at)
                    if session.created_at < floor:
                        break
                    if session.status in SWEEP_STATUSES:
                        found[session.id] = None
            rolled, resume_after = 0, None
            async for session in self.gateway.agent_sessions(claim.agent_id, after=claim.resume_after):
                paged += 1
                rolled += 1
                newest = session.created_at if newest is None else max(newest, session.created_at)
                if session.status in SWEEP_STATUSES:
                    found[session.id] = None
                if rolled >= ROLLING_SESSIONS:
                    resume_after = session.id  # the next sweep goes on after it
                    break
        except AgentsAuthError:
            raise
        except Exception as error:
            metrics.SWEEPS.labels("failed").inc()
            await self.store.finish_sweep(
                claim, self.owner, watermark=None, found=0, error=type(error).__name__
            )
            raise
        if found:
            await self.sessions.request_looks(list(found), intake="sweep", agent_id=claim.agent_id)
            metrics.SWEPT_SESSIONS.inc(len(found))
            if self._on_found is not None:
                self._on_found()
        await self.store.finish_sweep(
            claim, self.owner, watermark=newest, found=len(found), resume_after=resume_after
        )
        metrics.SWEEPS.labels("done").inc()
        log.log(
            logging.INFO if found else logging.DEBUG,
            "swept agent %s: %d session(s) paged (the rolling pass %s), %d requiring an action (%.2fs)",
            claim.agent_id,
            paged,
            "wrapped around" if resume_after is None else f"goes on after {resume_after}",
            len(found),
            time.monotonic() - started,
        )
        if resume_after is None:
            await self.store.prune_deliveries()
        return len(found)


__all__ = ["ROLLING_SESSIONS", "LookTaker", "Sweeper"]
