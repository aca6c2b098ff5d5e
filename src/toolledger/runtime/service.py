"""The long-running service: follows watched sessions and answers their function calls.

    async with Service(registry, Settings()) as service:
        await service.watch(session_id)
        await service.wait_stopped()

One asyncio task per followed session (an open event stream, no thread), one bounded pool of
running calls for the whole process. Sessions are shared between replicas through leases on
the ``sessions`` table: each live replica owns a fair share, renews it, and takes over the
sessions of a replica whose leases ran out. Every decision about a call is the ledger's, so
a session followed twice for a moment (a lease taken over from a paused replica) still runs
each call at most once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import resource
import socket
import time
from collections import OrderedDict
from contextlib import AsyncExitStack
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from toolledger.domain.keys import CallKey
from toolledger.domain.states import CallStatus
from toolledger.errors import (
    AgentsAuthError,
    AgentsUnavailableError,
    ConfigurationError,
    SessionGoneError,
    StreamInterruptedError,
)
from toolledger.gateway.agents import AgentsGateway, FunctionCallAction
from toolledger.logs import log_fields
from toolledger.runtime.alert_sender import WEBHOOK, AlertSender, alert_sender_for
from toolledger.runtime.call_runner import CallRunner
from toolledger.runtime.composition import Runtime
from toolledger.runtime.executor import HandleReport
from toolledger.runtime.handler_runner import HandlerLoad
from toolledger.runtime.handler_threads import running_handler_threads
from toolledger.runtime.looks import LookTaker, Sweeper
from toolledger.runtime.loop_logging import log_failure
from toolledger.runtime.reconciler import Reconciler, SessionReconciliation
from toolledger.runtime.registry import ToolRegistry
from toolledger.runtime.tool_ledger import ToolLedger
from toolledger.runtime.wakeups import woken_within
from toolledger.runtime.webhook_intake import PATH as WEBHOOK_PATH
from toolledger.runtime.webhook_intake import WebhookIntake
from toolledger.settings import Settings
from toolledger.store.sessions import SessionStore

log = logging.getLogger("toolledger.service")

EVENT_IDS_REMEMBERED = 512
FIRST_RECONNECT_DELAY = 0.2
WATCH_POLL_SECONDS = 1.0
STREAMS_OPENING_AT_ONCE = 16
"""Event streams being opened at once. A restart follows every watched session: opened all
together, a thousand streams kept every session's first reconcile waiting for tens of seconds
(48 s with 1,790 sessions in the chaos run). Taken in turn, in the order sessions were taken
(those with calls to move on first), the first answers go out at once."""
TURN_ENDS = frozenset(
    {"agent.session.turn.completed", "agent.session.turn.cancelled", "agent.session.turn.failed"}
)
ASK_AGAIN_AFTER = 10.0
"""Seconds before a session is reconciled again for the same decided call."""
UNCHANGED_ACTIONS = frozenset(
    {
        "waiting_for_approval",
        "waiting_for_operator",
        "running_elsewhere",
        "already_submitted",
        "in_flight",
        "left_alone",
        "left_for_service",
        "nothing_to_do",
        "awaiting_listing",
        "raced",
    }
)
"""What a reconcile reports for a call it found as it was, and left so."""
RECONNECTS_SAID_EVERY = 60.0
"""Seconds between two reconnect lines of one session at info or warning (the others debug)."""
EVENTS_ACTED_ON = TURN_ENDS | {"agent.session.requires_action", "agent.session.failed"}
"""What ``_on_event`` reads; the stream drops every other event unbuilt."""


@dataclass(frozen=True)
class ServiceStatus:
    replica_id: str
    followed_sessions: int
    running_calls: int
    """Calls being handled now: recorded and claimed, their handlers running or waiting."""
    started: bool
    stopping: bool
    handlers: HandlerLoad | None = None
    """Its handlers' slots and threads: taken, timed out and still running, waited for."""
    looking: int = 0
    """Intake sessions being looked at now (served without a stream)."""
    intake_counts: dict[str, int] | None = None
    """Its webhook intake's and looks' counts since it started (None: no intake here)."""


class Service:
    def __init__(
        self,
        registry: ToolRegistry,
        settings: Settings | None = None,
        *,
        gateway: AgentsGateway | None = None,
        auto_migrate: bool | None = None,
        runtime: Runtime | None = None,
    ) -> None:
        """``runtime``: the engine, gateway and redactor to run on (left open when the service
        stops); without it, one is built from ``settings`` (and ``gateway``, if given)."""
        self.settings = settings or (runtime.settings if runtime is not None else Settings())
        self.ledger = ToolLedger(
            registry, self.settings, gateway=gateway, auto_migrate=auto_migrate, runtime=runtime
        )
        # Session and call leases name the same process instance (store.liveness).
        self.replica_id = self.ledger.instance_id
        self._lock = self.ledger.serve_lock
        self._leases: dict[str, int] = {}
        self._wakes: dict[str, asyncio.TimerHandle] = {}
        self._followers: dict[str, asyncio.Task[None]] = {}
        self._reconciling: dict[str, asyncio.Task[None]] = {}
        self._reconnects: dict[str, tuple[float, int]] = {}
        self._last_reconciled: dict[str, dict[str, int]] = {}
        """Per session: what its last reconcile did (a repeat of a wait is said at debug)."""
        """Per session: when its last reconnect was said, and how many were not since."""
        self._again: set[str] = set()
        self._opening_streams = asyncio.Semaphore(STREAMS_OPENING_AT_ONCE)
        self._loops: list[asyncio.Task[None]] = []
        self._wake_leases = asyncio.Event()
        self._stopped = asyncio.Event()
        self.failed = asyncio.Event()
        """Set when the service cannot go on (the Agents API refused its credentials):
        ``failure`` says why; whoever runs the service should stop it."""
        self.failure: BaseException | None = None
        self._stopping = False
        self._started = False
        self._last_renewal = time.monotonic()
        self._sessions: SessionStore | None = None
        self._runner: CallRunner | None = None
        self._reconciler: Reconciler | None = None
        self._alerts: AlertSender | None = None
        self._looks: LookTaker | None = None
        self._webhooks: WebhookIntake | None = None
        self.webhook_address: tuple[str, int] | None = None
        """Where the webhook intake listens (the real port when ``listen`` said 0)."""

    # ------------------------------------------------------------------ life

    async def start(self) -> Service:
        if not self.ledger.runtime.agents_api_configured:
            raise ConfigurationError(
                "no Agents API configured: set TOOLLEDGER_OPENAI_API_KEY (or the SDK's own "
                "OPENAI_API_KEY) for the OpenAI API, or TOOLLEDGER_OPENAI_BASE_URL (or "
                "OPENAI_BASE_URL) for another server (a `toolledger emulator`, say)"
            )
        problem = self.settings.intake_problem()
        if problem is not None:
            raise ConfigurationError(problem)
        runtime = self.ledger.runtime
        # Refused before anything is taken: a webhook without a secret is a configuration error.
        self._alerts = alert_sender_for(
            self.settings,
            runtime.alert_store(WEBHOOK, actor=f"alerts:{self.replica_id}"),
            owner=self.replica_id,
            redactor=runtime.redactor,
        )
        if self.ledger.engine_is_sqlite:
            self._lock.acquire()
        try:
            await self.ledger.start()
            await self._check_agents_api()
            # Before this replica registers or claims anything: held for its whole life, so
            # that others can tell when it is gone (store.liveness).
            await self.ledger.liveness.hold()
        except BaseException:
            await self.ledger.close()
            self._lock.release()
            raise
        _allow_many_connections()
        executor = self.ledger.executor
        self._sessions = self.ledger.runtime.session_store()
        self._runner = CallRunner(executor, on_report=self._note_report, on_fatal=self._fail)
        self._reconciler = Reconciler(
            executor,
            self.ledger.gateway,
            self._sessions,
            run_call=self._runner.run,
            in_flight=self._runner.is_running,
        )
        try:
            if self._alerts is not None:
                # Before recovery makes any call unknown: the first start with a webhook
                # alerts on what happens from here on.
                await self._alerts.store.ensure_cursor()
            # Recovery after a crash: every session with a call it may still await is
            # followed, and each follower reconciles its session before anything else.
            recovered = await self._sessions.watch_new(await self._sessions.with_open_calls())
            if recovered:
                log.info("recovery: %d session(s) with open calls are watched again", recovered)
            await self._take_over_gone()
            if self.settings.agent_ids:
                await self._sessions.request_looks_at_open_calls()
            # Said before any follower starts: "serving" then comes before the first call's work.
            await self._say_what_recovery_waits_for()
            await self._balance()
        except BaseException:
            # Nothing is left holding the locks of a service that never started.
            await self.stop(grace=0)
            raise
        self._loops = [
            asyncio.create_task(self._lease_loop(), name="session leases"),
            asyncio.create_task(self._reconcile_loop(), name="periodic reconcile"),
            asyncio.create_task(self._decisions_loop(), name="operator decisions"),
        ]
        if self.settings.discover_metadata:
            self._loops.append(asyncio.create_task(self._discovery_loop(), name="session discovery"))
        if self._alerts is not None:
            self._loops.append(asyncio.create_task(self._alerts.run(), name="alert webhook"))
        if self.settings.agent_ids:
            await self._start_intake()
        self._started = True
        log.info(
            "replica %s serving: %d session(s), up to %d concurrent calls, %d handler threads",
            self.replica_id,
            len(self._followers),
            self.settings.max_concurrent_calls,
            self.settings.handler_threads,
        )
        return self

    async def _start_intake(self) -> None:
        """Looks, the agents' sweeps and (with ``listen``) the webhook intake. Its address
        taken by another process stops the start-up: a replica behind a load balancer that
        cannot take webhooks must not look healthy."""
        sessions, reconciler = self.sessions, self.reconciler
        intake = self.ledger.runtime.intake_store()
        looks = LookTaker(
            self.settings, sessions, reconciler, self.ledger.gateway, self.replica_id, on_fatal=self._fail
        )
        self._looks = looks
        sweeper = Sweeper(
            self.settings,
            intake,
            sessions,
            self.ledger.gateway,
            self.replica_id,
            on_fatal=self._fail,
            on_found=looks.wake,
        )
        self._loops += [
            asyncio.create_task(looks.run(), name="looks"),
            asyncio.create_task(sweeper.run(), name="agent sweeps"),
        ]
        address = self.settings.listen_address
        if address is None:
            log.info(
                "serving the sessions of agent(s) %s: swept every %.0fs",
                ", ".join(looks.agent_ids),
                sweeper.every,
            )
            return
        from toolledger.runtime.http_serving import serve_app

        self._webhooks = WebhookIntake(
            self.settings, intake, self.ledger.gateway, on_look_requested=looks.wake
        )
        listening: asyncio.Future[tuple[str, int]] = asyncio.get_running_loop().create_future()

        def bound(host: str, port: int) -> None:
            if not listening.done():
                listening.set_result((host, port))

        server = asyncio.create_task(
            serve_app(
                self._webhooks.app(),
                *address,
                name="webhook intake",
                on_listening=bound,
                lifespan="off",
                # `serve --processes N`: every process listens on the port, the kernel spreads
                # the webhooks among them.
                shared_port=True,
                # The process's level (serve's --log-level): uvicorn's default, info, wrote an
                # access line per webhook under `serve --log-level warning` (10,000 lines for
                # the intake benchmark's 10,000 sessions).
                log_level=logging.getLogger().getEffectiveLevel(),
            ),
            name="webhook intake",
        )
        self._loops.append(server)
        pending: list[asyncio.Future[Any]] = [server, listening]
        await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        if not listening.done():
            try:
                server.result()
            except OSError as error:
                raise ConfigurationError(
                    f"cannot listen on {self.settings.listen}: {error.strerror or error}"
                ) from None
            raise ConfigurationError(f"the webhook intake on {self.settings.listen} stopped while starting")
        self.webhook_address = listening.result()
        host, port = self.webhook_address
        log.info(
            "serving the sessions of agent(s) %s: webhooks at http://%s:%d%s, swept every %.0fs",
            ", ".join(looks.agent_ids),
            f"[{host}]" if ":" in host else host,
            port,
            WEBHOOK_PATH,
            sweeper.every,
        )

    async def _say_what_recovery_waits_for(self) -> None:
        """An operator restarting after a crash should not have to guess why nothing moves."""
        store = self.ledger.store
        held, soonest = await store.held_elsewhere()
        if held:
            log.info(
                "recovery: %d call(s) run under live leases of other processes; taken when those "
                "run out (the first at %s UTC) or as soon as their owners are found gone",
                held,
                soonest.strftime("%H:%M:%S") if soonest is not None else "?",
            )
        unknown = await store.count_in(CallStatus.UNKNOWN)
        if unknown:
            log.warning(
                "recovery: %d call(s) have an unknown outcome; those of at_most_once tools wait for "
                "an operator: toolledger calls list --status unknown",
                unknown,
            )

    async def _check_agents_api(self) -> None:
        """Refused credentials end the start-up with the reason; an API away for now does
        not (the ledger's own recovery goes on, and followers retry)."""
        try:
            await self.ledger.gateway.check()
        except AgentsUnavailableError as error:
            log.warning("the Agents API is not reachable now (%s); sessions are followed once it is", error)

    def _fail(self, error: AgentsAuthError) -> None:
        if self.failure is None:
            self.failure = error
            log.error("%s; stopping", error)
        self.failed.set()

    async def stop(self, grace: float | None = None, *, exiting: bool = False) -> int:
        """Graceful shutdown: take no new calls, let running ones finish within the grace
        period, give the session leases back. Returns how many calls were cut off (they
        become ``unknown``, as after a crash); each is logged with its tool and state.

        A sync handler's thread cannot be stopped: cut off, it runs on until its handler
        returns. ``exiting``: the caller ends the process right after (``toolledger serve``),
        and with it those threads. Then, if calls were cut off, this replica stays registered
        and keeps its liveness lock until the process is gone: peers take its calls over as
        soon as it is, as after a crash, not when their leases run out. Otherwise (a service
        in an application's own process) the replica unregisters: its cut-off calls are taken
        when their leases run out (their threads may still be at work until then)."""
        if self._stopping:
            await self._stopped.wait()
            return 0
        self._stopping = True
        grace = self.settings.shutdown_grace_seconds if grace is None else grace
        cut_off = 0
        left_to_exit = False
        try:
            await _cancel_all([*self._loops, *self._followers.values(), *self._reconciling.values()])
            self._followers.clear()
            if self._looks is not None:
                await self._looks.stop()
            if self._alerts is not None:
                try:
                    await self._alerts.close()
                except Exception:
                    log_failure(
                        log, "shutdown: the alert sender's lease was not given back; it expires on its own"
                    )
            if self._runner is not None:
                cut = await self._runner.drain(grace, before_cut=lambda keys: self._log_cut_off(keys, grace))
                cut_off = len(cut)
                left_to_exit = exiting and cut_off > 0
            if self._sessions is not None:
                try:
                    await self._sessions.release(self.replica_id)
                    if not left_to_exit:
                        # Unregistered, the replica is never "provably gone": calls cut off
                        # above (a handler thread may still be at work) are taken when their
                        # leases run out, not as soon as the locks below are given back.
                        await self._sessions.remove_replica(self.replica_id)
                except Exception:
                    log_failure(log, "shutdown: could not release session leases; they expire on their own")
        finally:
            for handle in self._wakes.values():
                handle.cancel()
            self._wakes.clear()
            if left_to_exit:
                # Registered, its lock held: the lock goes with the process (and with its
                # threads), and peers then take its calls over at once.
                log.info(
                    "shutdown: replica %s stays registered until the process exits; its cut-off "
                    "calls are taken over then",
                    self.replica_id,
                )
            else:
                try:
                    await self.ledger.liveness.release()
                except Exception:
                    log_failure(log, "shutdown: the liveness lock was not released; it goes with the process")
            await self.ledger.close()
            if not left_to_exit:
                self._lock.release()
            self._stopped.set()
            log.info("replica %s stopped", self.replica_id)
        return cut_off

    def _log_cut_off(self, keys: list[CallKey], grace: float) -> None:
        """Each call cut off, by tool and key (never its arguments), and how far it got."""
        handlers = self.ledger.executor.handlers
        log.warning("shutdown: %d call(s) still running after %.0fs are cut off", len(keys), grace)
        for key in keys:
            where = handlers.describe(key)
            log.warning(
                "shutdown: cut off call %s (tool %s): %s",
                key,
                where[0] if where is not None else "?",
                where[1] if where is not None else "not in its handler (recording or submitting)",
            )

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    async def __aenter__(self) -> Service:
        return await self.start()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    # ----------------------------------------------------------------- watching

    async def watch(self, session_id: str) -> None:
        """Follow a session (on this replica or another, whichever has room)."""
        if await self.sessions.watch(session_id):
            log.info("session %s watched", session_id)
        self._wake_leases.set()

    async def unwatch(self, session_id: str, reason: str = "unwatched by the application") -> None:
        await self.sessions.unwatch(session_id, reason)
        await self._drop(session_id)

    def status(self) -> ServiceStatus:
        return ServiceStatus(
            replica_id=self.replica_id,
            followed_sessions=len(self._followers),
            running_calls=self._runner.inflight if self._runner else 0,
            started=self._started,
            stopping=self._stopping,
            handlers=self._handler_load(),
            looking=self._looks.looking if self._looks is not None else 0,
            intake_counts=self._intake_counts(),
        )

    def _intake_counts(self) -> dict[str, int] | None:
        if self._looks is None:
            return None
        counts = {f"look_{result}": n for result, n in self._looks.counts.items()}
        if self._webhooks is not None:
            counts.update({f"webhook_{outcome}": n for outcome, n in self._webhooks.counts.items()})
        return counts

    def _handler_load(self) -> HandlerLoad | None:
        try:
            return self.ledger.executor.handlers.load()
        except RuntimeError:  # not started
            return None

    @staticmethod
    def handler_threads_running() -> list[str]:
        """Every handler thread of this process still running, as log lines would name it."""
        return [f"{run.key} (tool {run.tool}): {run.describe()}" for run in running_handler_threads()]

    @property
    def sessions(self) -> SessionStore:
        if self._sessions is None:
            raise RuntimeError("Service is not started: use `async with Service(...)`")
        return self._sessions

    @property
    def reconciler(self) -> Reconciler:
        if self._reconciler is None:
            raise RuntimeError("Service is not started: use `async with Service(...)`")
        return self._reconciler

    @property
    def followed(self) -> frozenset[str]:
        return frozenset(self._followers)

    # ------------------------------------------------------------------ leases

    async def _lease_loop(self) -> None:
        renew_every = self.settings.session_lease_seconds / 3
        while True:
            await woken_within(self._wake_leases, min(renew_every, WATCH_POLL_SECONDS))
            woken = self._wake_leases.is_set()
            self._wake_leases.clear()
            try:
                await self.ledger.liveness.ensure_held()
            except Exception:
                # Peers may take this replica for gone meanwhile (its calls are then fenced, as
                # after a lease expiry); the sessions' own leases are renewed all the same.
                log_failure(log, "the liveness lock could not be taken again; retrying")
            try:
                # A replica that died leaves its sessions and calls under live leases: taken
                # now, not when those run out.
                woken = await self._take_over_gone() or woken
                # A cheap look for sessions nobody follows (just watched, or left by a dead
                # replica) between renewals, so new sessions are picked up within a second.
                due = time.monotonic() - self._last_renewal >= renew_every
                if woken or due or await self.sessions.has_unowned():
                    await self._balance()
            except Exception:
                log_failure(log, "renewing session leases failed; retrying")
                if time.monotonic() - self._last_renewal > self.settings.session_lease_seconds:
                    # Our leases have run out: another replica may follow these sessions now.
                    for session_id in list(self._followers):
                        await self._drop(session_id)

    async def _balance(self) -> None:
        """Renew what we own, then take or give back sessions to hold a fair share."""
        sessions, lease = self.sessions, self.settings.session_lease_seconds
        load = self._handler_load()
        await sessions.heartbeat_replica(
            self.replica_id,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            lease_seconds=lease,
            handler_load=None if load is None else load.as_dict(),
            intake_counts=self._intake_counts(),
        )
        renewed = await sessions.renew(self.replica_id, self._leases, lease)
        self._last_renewal = time.monotonic()
        for session_id in set(self._leases) - renewed:
            log.info("session %s: lease lost (unwatched or taken over)", session_id)
            await self._drop(session_id)
        share = await sessions.fair_share()
        excess = len(self._leases) - share
        if excess > 0:
            given = sorted(self._leases)[:excess]
            for session_id in given:
                await self._drop(session_id)
            await sessions.release(self.replica_id, given)
            log.info("rebalancing: gave back %d session(s)", len(given))
        elif excess < 0 and not self._stopping:
            acquired = await sessions.acquire(self.replica_id, -excess, lease)
            if len(acquired) > 1:
                # Sessions with calls to move on first: after a restart with many watched
                # sessions, their reconciles (queued, a few at a time) come before those of
                # idle sessions and of sessions waiting only for an operator.
                movable = set(await sessions.with_work())
                acquired = dict(sorted(acquired.items(), key=lambda item: item[0] not in movable))
            for session_id, token in acquired.items():
                self._leases[session_id] = token
                self._followers[session_id] = asyncio.create_task(
                    self._follow(session_id), name=f"follow {session_id}"
                )

    async def _take_over_gone(self) -> bool:
        """Retire the replicas provably gone (store.liveness): free their session leases, give
        back their looks and sweeps, and make their running calls ``unknown``, to be settled by
        effect class. True if any."""
        # Only those that still hold something: once taken over, a replica holds nothing and
        # is not looked at again (and one wrongly taken for gone is, once it holds again).
        holding = await self.sessions.holders() | await self.ledger.store.running_owners()
        intake = self.ledger.runtime.intake_store() if self.settings.agent_ids else None
        if intake is not None:
            holding |= await intake.sweep_holders()
        gone = await self.ledger.liveness.gone(holding - {self.replica_id})
        if not gone:
            return False
        freed = await self.sessions.retire_replicas(gone)
        if intake is not None:
            await intake.release_sweeps(gone)
        taken = await self.ledger.store.expire_leases(gone_owners=gone)
        if self._alerts is not None:
            await self._alerts.take_over_from(gone)
        named = sorted(gone)
        log.warning(
            "replica(s) %s gone (liveness lock free): took over %d session lease(s) and %d running call(s)",
            ", ".join(named[:5]) + (f" and {len(named) - 5} more" if len(named) > 5 else ""),
            freed,
            len(taken),
        )
        touched = {call.key.session_id for call in taken}
        for session_id in touched & set(self._followers):
            self._request_reconcile(session_id)
        if self._looks is not None and await self.sessions.nudge_looks(touched - set(self._followers)):
            self._looks.wake()
        return True

    async def _drop(self, session_id: str) -> None:
        wake = self._wakes.pop(session_id, None)
        if wake is not None:
            wake.cancel()
        self._leases.pop(session_id, None)
        self._reconnects.pop(session_id, None)
        self._last_reconciled.pop(session_id, None)
        follower = self._followers.pop(session_id, None)
        reconciling = self._reconciling.pop(session_id, None)
        await _cancel_all([t for t in (follower, reconciling) if t is not None])

    # --------------------------------------------------------------- following

    async def _follow(self, session_id: str) -> None:
        """Follow one session's events until it fails, is deleted, or is no longer ours."""
        with log_fields(session_id=session_id):
            await self._follow_events(session_id)

    async def _follow_events(self, session_id: str) -> None:
        seen: OrderedDict[str, None] = OrderedDict()
        delay = FIRST_RECONNECT_DELAY
        while True:
            try:
                async with AsyncExitStack() as stream:
                    async with self._opening_streams:
                        events = await stream.enter_async_context(
                            self.ledger.gateway.events(
                                session_id,
                                idle_timeout=self.settings.stream_idle_timeout_seconds,
                                types=EVENTS_ACTED_ON,
                            )
                        )
                    # The stream is open: what happened while we were away is settled now,
                    # what happens from here on arrives as events.
                    if await self._reconcile(session_id) is None:
                        return
                    async for event in events:
                        delay = FIRST_RECONNECT_DELAY
                        if event.event_id in seen:
                            continue
                        seen[event.event_id] = None
                        if len(seen) > EVENT_IDS_REMEMBERED:
                            seen.popitem(last=False)
                        if not await self._on_event(session_id, event):
                            return
                self._reconnecting(session_id, logging.INFO, "event stream ended")
            except SessionGoneError:
                if await self._reconcile(session_id) is None:
                    return
            except AgentsAuthError as error:
                self._fail(error)
                return
            except StreamInterruptedError as error:
                interrupted = f"event stream interrupted ({self.ledger.redactor.text(str(error))})"
                self._reconnecting(session_id, logging.INFO, interrupted)
            except Exception:
                log_failure(log, "session %s: following failed; reconnecting", session_id)
            except BaseException as interruption:  # from a handler run during a reconcile
                if isinstance(interruption, asyncio.CancelledError | KeyboardInterrupt | SystemExit):
                    raise
                self._reconnecting(
                    session_id, logging.WARNING, f"interrupted ({type(interruption).__qualname__})"
                )
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))  # noqa: S311 - jitter, not secrecy
            delay = min(delay * 2, self.settings.stream_backoff_max_seconds)

    def _reconnecting(self, session_id: str, level: int, why: str) -> None:
        """Say that a session's stream reconnects: at ``level`` once a minute per session (with
        how many were not said meanwhile), at debug in between. A flapping connection must
        not drown the log in warnings."""
        now = time.monotonic()
        said_at, unsaid = self._reconnects.get(session_id, (-RECONNECTS_SAID_EVERY, 0))
        if now - said_at < RECONNECTS_SAID_EVERY:
            self._reconnects[session_id] = (said_at, unsaid + 1)
            log.debug("session %s: %s; reconnecting", session_id, why)
            return
        self._reconnects[session_id] = (now, 0)
        since = f" ({unsaid} more since the last said)" if unsaid else ""
        log.log(level, "session %s: %s; reconnecting%s", session_id, why, since)

    async def _on_event(self, session_id: str, event: Any) -> bool:
        """Act on one event; False once the session is no longer to be followed."""
        kind = event.type
        if kind == "agent.session.requires_action":
            runner = self._runner
            assert runner is not None
            for action in event.session.required_actions:
                if isinstance(action, FunctionCallAction):
                    runner.dispatch(session_id, action, listing_may_be_stale=True)
                else:
                    self.reconciler.note_foreign_action(session_id, action)
        elif kind == "agent.session.failed":
            return await self._reconcile(session_id) is not None
        elif kind in TURN_ENDS:
            # The turn's calls left required_actions: confirm (or abandon) them in the ledger.
            completed = event.turn_id if kind == "agent.session.turn.completed" else None
            self._request_reconcile(session_id, completed_turn=completed)
        return True

    async def _reconcile(self, session_id: str) -> SessionReconciliation | None:
        """Reconcile one session; None once it failed or was deleted (no longer followed)."""
        result = await self.reconciler.reconcile_session(session_id)
        if result.actions:
            with log_fields(session_id=session_id):
                waiting = "" if result.retry_in is None else f"; looking again in {result.retry_in:.1f}s"
                # A session that only waits (for a person, another replica, its own run) is
                # looked at every interval: said at info only when something moved.
                actions = dict(result.actions)
                same = self._last_reconciled.get(session_id) == actions
                self._last_reconciled[session_id] = actions
                level = logging.DEBUG if same and set(actions) <= UNCHANGED_ACTIONS else logging.INFO
                done = ", ".join(f"{action} {count}" for action, count in sorted(result.actions.items()))
                log.log(level, "session %s reconciled: %s%s", session_id, done, waiting)
        if result.stopped is not None:
            await self._drop(session_id)
            return None
        if result.retry_in is not None:
            self._wake_later(session_id, result.retry_in)
        return result

    async def _confirm_turn(self, session_id: str, turn_id: str) -> bool:
        """Whether the completed turn's results were all that was open, now confirmed."""
        confirmed = await self.reconciler.confirm_turn(session_id, turn_id)
        if confirmed is None:
            return False
        with log_fields(session_id=session_id):
            log.info("session %s: turn %s completed: %s", session_id, turn_id, {"confirmed": confirmed})
        return True

    def _note_report(self, report: HandleReport) -> None:
        if report.retry_in is not None:
            self._wake_later(report.key.session_id, report.retry_in)

    def _wake_later(self, session_id: str, seconds: float) -> None:
        """Reconcile the session once a wait with a known end is over (a lease of another
        worker, an ``unknown_deadline``, a submission backoff), not at the next interval."""
        if self._stopping or session_id not in self._followers:
            return
        loop = asyncio.get_running_loop()
        when = loop.time() + max(seconds, 0.0)
        earlier = self._wakes.get(session_id)
        if earlier is not None:
            if earlier.when() <= when:
                return
            earlier.cancel()
        self._wakes[session_id] = loop.call_at(when, self._woken, session_id)

    def _woken(self, session_id: str) -> None:
        self._wakes.pop(session_id, None)
        if not self._stopping and session_id in self._followers:
            self._request_reconcile(session_id)

    def _request_reconcile(self, session_id: str, *, completed_turn: str | None = None) -> None:
        """Reconcile in the background, at most one pass per session at a time.

        ``completed_turn``: the session just said this turn completed. Its results were
        consumed, and when they are all that is open they are confirmed without a full pass
        (no read of the session back from the API: the event said what it would say)."""
        if session_id in self._reconciling:
            self._again.add(session_id)
            return

        runner = self._runner
        assert runner is not None

        async def run() -> None:
            turn = completed_turn
            try:
                while True:
                    self._again.discard(session_id)
                    try:
                        # The turn's last submissions may still be on their way back.
                        await runner.wait_for_running(session_id)
                        if turn is None or not await self._confirm_turn(session_id, turn):
                            await self._reconcile(session_id)
                        turn = None  # a pass asked for again may have been asked for anything
                    except AgentsAuthError as error:
                        self._fail(error)
                        return
                    except Exception:
                        log_failure(log, "session %s: reconcile failed", session_id)
                    except BaseException as interruption:
                        if isinstance(interruption, asyncio.CancelledError | KeyboardInterrupt | SystemExit):
                            raise
                        log.warning(
                            "session %s: reconcile interrupted (%s)",
                            session_id,
                            type(interruption).__qualname__,
                        )
                    if session_id not in self._again:
                        return
            finally:
                self._reconciling.pop(session_id, None)

        self._reconciling[session_id] = asyncio.create_task(run(), name=f"reconcile {session_id}")

    # ----------------------------------------------------------------- timers

    async def _reconcile_loop(self) -> None:
        """Catch what events missed, and sessions the application handled by itself."""
        while True:
            await asyncio.sleep(self.settings.reconcile_interval_seconds)
            try:
                added = await self.sessions.watch_new(await self.sessions.with_open_calls())
                if added:
                    self._wake_leases.set()
                for session_id in list(self._followers):
                    self._request_reconcile(session_id)
                if self._looks is not None and await self.sessions.request_looks_at_open_calls():
                    self._looks.wake()
            except Exception:
                log_failure(log, "periodic reconcile failed; retrying")

    async def _decisions_loop(self) -> None:
        """An approval, a denial or a re-run decided in another process (the CLI, the API)
        is acted on within a poll, not at the next periodic reconcile: a person who approves
        a call expects it to run now. A session is asked for again only after a pause, so a
        call that stays decided-but-unsent (its submission failing) does not spin."""
        asked: dict[CallKey, float] = {}
        while True:
            await asyncio.sleep(self.settings.decision_poll_seconds)
            try:
                now = time.monotonic()
                decided = await self.ledger.store.decided_calls()
                unfollowed: set[str] = set()
                for key in decided:
                    if now - asked.get(key, -ASK_AGAIN_AFTER) < ASK_AGAIN_AFTER:
                        continue
                    if key.session_id in self._followers:
                        asked[key] = now
                        self._request_reconcile(key.session_id)
                    elif self._looks is not None:
                        asked[key] = now
                        unfollowed.add(key.session_id)
                if unfollowed and self._looks is not None and await self.sessions.nudge_looks(unfollowed):
                    self._looks.wake()
                for key in [k for k in asked if k not in decided]:
                    del asked[key]
            except Exception:
                log_failure(log, "looking for operators' decisions failed; retrying")

    async def _discovery_loop(self) -> None:
        metadata = self.settings.discover_metadata
        assert metadata is not None
        while True:
            try:
                found = await self.ledger.gateway.discover(metadata)
                candidates = [s.id for s in found if s.status != "failed"]
                if await self.sessions.watch_new(candidates):
                    self._wake_leases.set()
            except AgentsAuthError as error:
                self._fail(error)
                return
            except Exception:
                log_failure(log, "discovering sessions by metadata %s failed; retrying", metadata)
            await asyncio.sleep(self.settings.discover_interval_seconds)


async def _cancel_all(tasks: list[asyncio.Task[Any]]) -> None:
    current = asyncio.current_task()
    others = [t for t in tasks if t is not current]
    for task in others:
        task.cancel()
    await asyncio.gather(*others, return_exceptions=True)


def _allow_many_connections() -> None:
    """Each followed session holds a socket: raise the open-files limit as far as allowed."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            log.warning("could not raise the open-files limit from %d", soft)
