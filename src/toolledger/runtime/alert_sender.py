"""The alert webhook's sender: a task of ``serve`` that reads the audit trail and POSTs a
signed alert for every event that means a call needs a person (``domain.alerts``).

Nothing on a call's path waits for it: the events it reads are written with the changes
they record, and it reads them after a cursor kept in the ledger (``store.alerts``). One
replica at a time sends, under a lease on that cursor. Alerts go out in the order of the
audit trail, each until it is delivered: a receiver that is down holds the next ones back in
the ledger (not in memory) and gets them all, in order, once it is back. Delivery is at
least once (a crash between the receiver's answer and the commit that records it sends the
alert again), with the same ``X-Toolledger-Alert-Id`` each time.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Collection, Iterable
from urllib.parse import urlsplit

import httpx2
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from toolledger.domain.alerts import AlertSubject, alert_body
from toolledger.domain.redaction import Redactor
from toolledger.errors import ConfigurationError
from toolledger.metrics import ALERT_POSTS
from toolledger.runtime.alert_signature import ALERT_ID_HEADER, SIGNATURE_HEADER, sign_alert
from toolledger.runtime.loop_logging import log_failure
from toolledger.runtime.wakeups import woken_within
from toolledger.settings import Settings
from toolledger.store.alerts import AlertLease, AlertNote, AlertStore, EventWindow
from toolledger.version import __version__

log = logging.getLogger("toolledger.alerts")

WEBHOOK = "webhook"
"""The destination's name in ``alert_cursors`` (one row per destination)."""
POLL_SECONDS = 1.0
"""How often the audit trail is read for new events once the sender has caught up."""
WINDOW_EVENTS = 500
"""Events looked at per read: what the sender holds in memory at once."""
GAP_PATIENCE_SECONDS = 10.0
"""How long the cursor waits at an event id not visible yet. Ids are taken when a transaction
writes and seen when it commits, so a later id can be seen first; an id that never shows
belonged to a transaction that rolled back."""
LATE_WATCH_SECONDS = 600.0
"""An id the cursor went past without seeing it is looked for again this long (a commit
slower than GAP_PATIENCE_SECONDS still raises its alert, out of order)."""
LATE_IDS_KEPT = 1000
CURSOR_SAVE_SECONDS = 5.0
"""How often the cursor is saved while it moves over events that raise no alert."""
TRIES_PER_ROUND = 3
"""POSTs of one alert in a round (with short pauses) before a failed round is noted."""
FIRST_ROUND_PAUSE = 1.0
"""Pause after the first failed round; it doubles after each one, up to
``alert_retry_max_seconds``."""


class AlertDeliveryError(Exception):
    """One POST of an alert failed; the message says how, without the URL (it may hold a
    credential) or anything the receiver said."""


class AlertSender:
    """Sends the alerts of one destination while this process holds its lease."""

    def __init__(
        self,
        store: AlertStore,
        *,
        url: str,
        secret: str,
        owner: str,
        redactor: Redactor,
        public_url: str | None = None,
        timeout: float = 10.0,
        retry_max_seconds: float = 300.0,
        lease_seconds: float = 30.0,
        poll_seconds: float = POLL_SECONDS,
        gap_patience_seconds: float = GAP_PATIENCE_SECONDS,
    ) -> None:
        self.store = store
        self.url = url
        self.owner = owner
        self.redactor = redactor
        self.public_url = public_url
        self.timeout = timeout
        self.retry_max_seconds = retry_max_seconds
        self.lease_seconds = lease_seconds
        self.poll_seconds = poll_seconds
        self.gap_patience_seconds = gap_patience_seconds
        self._secret = secret
        self._client: httpx2.AsyncClient | None = None
        self._late: dict[int, float] = {}
        """Ids the cursor went past unseen -> until when they are looked for."""
        self._announced = False
        self._wake = asyncio.Event()

    @property
    def destination(self) -> str:
        """The webhook's origin, for logs: never its path or query (they may hold a credential)."""
        parts = urlsplit(self.url)
        return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}"

    # ------------------------------------------------------------------ life

    async def run(self) -> None:
        """Send while this process holds the destination's lease; wait for it otherwise."""
        while True:
            try:
                lease = await self.store.take_lease(self.owner, self.lease_seconds)
            except Exception:
                log_failure(log, "alerts: the sender's lease could not be taken; retrying")
                lease = None
            if lease is None:
                # Another replica sends; its lease runs out if it dies (or is freed at once
                # when it is found gone: ``take_over_from``).
                await woken_within(self._wake, max(self.poll_seconds, self.lease_seconds / 3))
                self._wake.clear()
                continue
            if not self._announced:
                log.info("alerts: this replica sends the alert webhook's alerts to %s", self.destination)
                self._announced = True
            await self._hold(lease)

    async def take_over_from(self, gone: Collection[str]) -> None:
        """Replicas provably gone (``store.liveness``): if one of them held the lease, free it
        and take it now, not when it runs out."""
        if await self.store.free(gone):
            log.info("alerts: the sender's lease of a replica that is gone was freed")
            self._wake.set()

    async def close(self) -> None:
        """Give the lease back (another replica takes over at once) and close the client."""
        try:
            await self.store.release(self.owner)
        finally:
            if self._client is not None:
                await self._client.aclose()

    async def _hold(self, lease: AlertLease) -> None:
        """Send under ``lease``, renewing it meanwhile; return once it is lost or the cursor
        was moved under us (the caller takes the lease again and reads the cursor afresh)."""
        sending = asyncio.create_task(self._send(lease), name="alert sending")
        try:
            while True:
                done, _ = await asyncio.wait({sending}, timeout=self.lease_seconds / 3)
                if done:
                    return
                try:
                    if not await self.store.renew(self.owner, lease.token, self.lease_seconds):
                        log.warning("alerts: the sender's lease was taken over; another replica sends now")
                        self._announced = False
                        return
                except Exception:
                    # Sending goes on; every cursor write checks the lease, so nothing is
                    # recorded twice if it runs out meanwhile.
                    log_failure(log, "alerts: the sender's lease could not be renewed; retrying")
        finally:
            sending.cancel()
            await asyncio.gather(sending, return_exceptions=True)

    # --------------------------------------------------------------- sending

    async def _send(self, lease: AlertLease) -> None:
        # ``cursor``: how far this sender has dealt with the trail; ``saved``: how far the
        # ledger says. A delivery saves it in its own commit; a stretch of events that raise
        # nothing is saved every CURSOR_SAVE_SECONDS (read again after a crash, it raises
        # nothing again), so a busy ledger does not pay a write per look.
        saved = cursor = lease.cursor
        saved_at = time.monotonic()
        waiting: dict[int, float] = {}
        while True:
            try:
                window = await self.store.window(cursor, limit=WINDOW_EVENTS)
                horizon, passed = self._horizon(cursor, window, waiting)
                for subject in window.subjects:
                    if subject.event.id > horizon:
                        break
                    if not await self._deliver(subject, lease, cursor=(saved, subject.event.id)):
                        return
                    saved = cursor = subject.event.id
                    saved_at = time.monotonic()
                cursor = max(cursor, horizon)
                if cursor > saved and time.monotonic() - saved_at >= CURSOR_SAVE_SECONDS:
                    if not await self.store.advance(self.owner, lease.token, expected=saved, to=cursor):
                        return
                    saved, saved_at = cursor, time.monotonic()
                delivered = {subject.event.id for subject in window.subjects}
                self._watch_late(i for i in passed if i not in delivered)
                if not await self._deliver_late(lease):
                    return
            except Exception:
                log_failure(log, "alerts: reading or recording alerts failed; retrying")
                await asyncio.sleep(self.poll_seconds)
                continue
            if window.events >= WINDOW_EVENTS and cursor == window.top:
                continue  # a backlog: read on at once
            await asyncio.sleep(self.poll_seconds)

    def _horizon(self, cursor: int, window: EventWindow, waiting: dict[int, float]) -> tuple[int, list[int]]:
        """How far the cursor may go now: up to the first missing id still waited for (each
        is waited for GAP_PATIENCE_SECONDS from when it was first missed); the missing ids it
        goes past are returned."""
        now = time.monotonic()
        missing_now = set(window.missing)
        for seen in [i for i in waiting if i <= cursor or i not in missing_now]:
            del waiting[seen]
        passed: list[int] = []
        for missing in window.missing:
            since = waiting.setdefault(missing, now)
            if now - since < self.gap_patience_seconds:
                return missing - 1, passed
            passed.append(missing)
        return window.top, passed

    def _watch_late(self, event_ids: Iterable[int]) -> None:
        until = time.monotonic() + LATE_WATCH_SECONDS
        for event_id in event_ids:
            self._late[event_id] = until
        if len(self._late) > LATE_IDS_KEPT:
            for event_id in sorted(self._late)[: len(self._late) - LATE_IDS_KEPT]:
                del self._late[event_id]
            log.warning(
                "alerts: more than %d event ids never showed; the oldest are no longer looked for",
                LATE_IDS_KEPT,
            )

    async def _deliver_late(self, lease: AlertLease) -> bool:
        """Alerts of events that committed after the cursor went past their ids."""
        now = time.monotonic()
        for event_id in [i for i, until in self._late.items() if until < now]:
            del self._late[event_id]
        if not self._late:
            return True
        present, subjects = await self.store.among(self._late)
        for subject in subjects:
            log.info("alerts: event %d committed late; its alert is sent now", subject.event.id)
            if not await self._deliver(subject, lease, cursor=None):
                return False
        for event_id in present:
            self._late.pop(event_id, None)
        return True

    async def _deliver(
        self, subject: AlertSubject, lease: AlertLease, *, cursor: tuple[int, int] | None
    ) -> bool:
        """POST one alert until it is delivered, noting failed rounds in the call's timeline
        (the 1st, 2nd, 4th, 8th...: a long outage leaves a few lines, not thousands), then
        record the delivery (and move the cursor) in one commit. False: the lease is lost."""
        body = alert_body(subject, redactor=self.redactor, public_url=self.public_url)
        raw = json.dumps(body, separators=(",", ":"), sort_keys=True).encode()
        about = f"alert {subject.alert_id} of event {subject.event.id}"
        rounds = 0
        while True:
            rounds += 1
            try:
                status, tries = await self._post_round(raw, subject.alert_id)
            except AlertDeliveryError as failure:
                pause = min(self.retry_max_seconds, FIRST_ROUND_PAUSE * 2 ** (rounds - 1))
                reason = (
                    f"{subject.kind.value} alert not delivered: {failure} ({rounds * TRIES_PER_ROUND} "
                    f"tries so far); trying again in {pause:g}s"
                )
                log.warning("alerts: call %s: %s", subject.event.key, reason)
                if rounds & (rounds - 1) == 0:
                    note = AlertNote(subject.event.key, "alert_failed", reason, about)
                    if not await self.store.record(self.owner, lease.token, note):
                        return False
                await asyncio.sleep(pause)
                continue
            plural = "try" if tries == 1 else "tries"
            reason = f"{subject.kind.value} alert delivered (HTTP {status}, {tries} {plural})"
            note = AlertNote(subject.event.key, "alert_sent", reason, about)
            log.info("alerts: call %s: %s", subject.event.key, reason)
            return await self.store.record(self.owner, lease.token, note, cursor=cursor)

    async def _post_round(self, raw: bytes, alert_id: str) -> tuple[int, int]:
        """POST up to TRIES_PER_ROUND times: the status that accepted it, and the tries made."""
        retrying = AsyncRetrying(
            stop=stop_after_attempt(TRIES_PER_ROUND),
            wait=wait_exponential(multiplier=0.25, max=min(2.0, self.retry_max_seconds)),
            retry=retry_if_exception_type(AlertDeliveryError),
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                return await self._post(raw, alert_id), attempt.retry_state.attempt_number
        raise AssertionError("tenacity either returns or raises")  # pragma: no cover

    def _http(self) -> httpx2.AsyncClient:
        """One connection, kept between alerts; built at the first alert, not at start."""
        if self._client is None:
            self._client = httpx2.AsyncClient(
                timeout=httpx2.Timeout(self.timeout),
                follow_redirects=False,
                limits=httpx2.Limits(max_connections=1, max_keepalive_connections=1),
                headers={"User-Agent": f"toolledger/{__version__}", "Content-Type": "application/json"},
            )
        return self._client

    async def _post(self, raw: bytes, alert_id: str) -> int:
        headers = {
            ALERT_ID_HEADER: alert_id,
            SIGNATURE_HEADER: sign_alert(raw, self._secret, int(time.time())),
        }
        try:
            # The whole request, not each read: a receiver trickling bytes cannot hold it longer.
            async with asyncio.timeout(self.timeout):
                async with self._http().stream("POST", self.url, content=raw, headers=headers) as response:
                    status = response.status_code  # its body is not read: nothing of it is kept
        except (TimeoutError, httpx2.TimeoutException):
            ALERT_POSTS.labels("failed").inc()
            raise AlertDeliveryError(f"no answer within {self.timeout:g}s") from None
        except httpx2.ConnectError:
            ALERT_POSTS.labels("failed").inc()
            raise AlertDeliveryError("could not connect") from None
        except httpx2.HTTPError as error:
            ALERT_POSTS.labels("failed").inc()
            raise AlertDeliveryError(type(error).__name__) from None
        if not 200 <= status < 300:
            ALERT_POSTS.labels("failed").inc()
            raise AlertDeliveryError(f"HTTP {status}")
        ALERT_POSTS.labels("delivered").inc()
        return status


def alert_sender_for(
    settings: Settings, store: AlertStore, *, owner: str, redactor: Redactor
) -> AlertSender | None:
    """The sender the settings configure (None without a webhook URL). Refuses a webhook
    without a secret: unsigned alerts could be forged by anyone who finds the receiver."""
    if settings.alert_webhook_url is None:
        return None
    secret = settings.alert_webhook_secret.get_secret_value() if settings.alert_webhook_secret else ""
    if not secret.strip():
        raise ConfigurationError(
            "TOOLLEDGER_ALERT_WEBHOOK_URL is set but TOOLLEDGER_ALERT_WEBHOOK_SECRET is not: alerts are "
            "signed with it (HMAC-SHA256) so the receiver can tell them from forgeries. Set it to a "
            'long random string shared with the receiver, e.g. `python -c "import secrets; '
            'print(secrets.token_urlsafe(32))"`'
        )
    return AlertSender(
        store,
        url=settings.alert_webhook_url,
        secret=secret,
        owner=owner,
        redactor=redactor,
        public_url=settings.public_url,
        timeout=settings.alert_timeout_seconds,
        retry_max_seconds=settings.alert_retry_max_seconds,
        lease_seconds=settings.session_lease_seconds,
    )


__all__ = ["AlertDeliveryError", "AlertSender", "alert_sender_for"]
