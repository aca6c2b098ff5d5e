"""Webhooks for ``agent.session.*`` events, sent as the Agents API sends them.

The wire format is the openai SDK's (``types/webhooks/agent_session_*_webhook_event.py``,
``lib/_webhooks.py``): a JSON event ``{"id": "evt_…", "object": "event", "created_at": …,
"type": …, "data": {...}}`` POSTed with Standard Webhooks headers (``webhook-id``,
``webhook-timestamp``, ``webhook-signature: v1,<base64 HMAC-SHA256>``). What a receiver must
cope with is emulated too: each event is delivered at least once, retried with backoff (the
same ``webhook-id`` every time) until answered 2xx or given up, in no guaranteed order, and
the faults below (drop, duplicate, reorder, delay, wrong signature) make the rarer cases
happen on demand, drawn from a seeded generator so a run can be repeated.

Everything here runs on the emulator's event loop: ``WebhookSender.session_event`` is called
by the state machine without awaiting, and the sender's own tasks do the HTTP.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import json
import logging
import random
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx2
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

log = logging.getLogger("toolledger.emulator")

WebhookType = Literal[
    "agent.session.created",
    "agent.session.in_progress",
    "agent.session.action_required",
    "agent.session.idle",
    "agent.session.failed",
]

SESSION_WEBHOOKS: dict[str, WebhookType] = {
    "agent.session.created": "agent.session.created",
    "agent.session.in_progress": "agent.session.in_progress",
    # The stream calls it requires_action, the webhook action_required.
    "agent.session.requires_action": "agent.session.action_required",
    "agent.session.idle": "agent.session.idle",
    "agent.session.failed": "agent.session.failed",
}
"""Session transitions (as the event stream names them) that have a webhook. The SDK types
no webhook for ``budget_reached`` (nor do turn or item events have one)."""

FIRST_BACKOFF_SECONDS = 0.1
MAX_BACKOFF_SECONDS = 5.0
ATTEMPT_TIMEOUT_SECONDS = 10.0
GIVE_UP_AFTER_SECONDS = 3600.0
REORDER_HOLD_SECONDS = 1.0
"""A held-back event waits this long at most for a next one to overtake it, so a reorder
never turns into a loss when the session goes quiet."""


class WebhookFaults(BaseModel):
    """What goes wrong with deliveries: probabilities drawn per event (``wrong_signature``:
    per attempt), from ``random.Random(seed)``."""

    model_config = ConfigDict(extra="forbid")

    drop: float = Field(default=0.0, ge=0.0, le=1.0)
    """The event is never sent (the real API promises at least once; a receiver that also
    polls copes)."""
    duplicate: float = Field(default=0.0, ge=0.0, le=1.0)
    """The event is delivered twice: the same body and ``webhook-id``."""
    reorder: float = Field(default=0.0, ge=0.0, le=1.0)
    """The event is held back and sent after the next one (or after a second if none comes)."""
    delay_seconds: float = Field(default=0.0, ge=0.0, le=3600.0)
    """Every event is first sent this long after it happened."""
    wrong_signature: float = Field(default=0.0, ge=0.0, le=1.0)
    """An attempt is signed with another secret; the receiver refuses it and the retry is
    drawn again."""


def decode_secret(secret: str) -> bytes:
    """The HMAC key of a ``whsec_<base64>`` secret, as the SDK derives it."""
    if not secret.startswith("whsec_"):
        raise ValueError("the webhook secret must start with 'whsec_'")
    try:
        key = base64.b64decode(secret.removeprefix("whsec_"), validate=True)
    except binascii.Error:
        raise ValueError("the webhook secret must be base64 after 'whsec_'") from None
    if not key:
        raise ValueError("the webhook secret must not be empty after 'whsec_'")
    return key


class WebhookConfig(BaseModel):
    """Where webhooks go, signed with what, and what goes wrong (``PUT /_emulator/webhooks``).

    ``url`` null: no webhooks are sent."""

    model_config = ConfigDict(extra="forbid")

    url: str | None = None
    secret: str | None = None
    faults: WebhookFaults = Field(default_factory=WebhookFaults)
    seed: int | None = None
    """Seeds the draws of the faults (and the wrong secret), so a run can be repeated."""
    give_up_after_seconds: float = Field(default=GIVE_UP_AFTER_SECONDS, gt=0.0, le=7 * 24 * 3600.0)
    """A delivery still failing this long after its first attempt is given up."""

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError("the webhook url must start with http:// or https://")
        return value

    @field_validator("secret")
    @classmethod
    def _whsec(cls, value: str | None) -> str | None:
        if value is not None:
            decode_secret(value)
        return value

    @model_validator(mode="after")
    def _secret_with_url(self) -> WebhookConfig:
        if self.url is not None and self.secret is None:
            raise ValueError("a webhook url needs a secret (whsec_...)")
        return self

    def public(self) -> dict[str, Any]:
        """The configuration as shown back: never the secret."""
        shown = self.model_dump(exclude={"secret"})
        shown["secret_set"] = self.secret is not None
        return shown


class WebhookCounts(BaseModel):
    """What became of the webhooks since the configuration was last set.

    Per delivery copy: ``sent + duplicated - dropped == delivered + given_up + pending``."""

    sent: int = 0
    """Events the emulator had to send (one per session transition)."""
    delivered: int = 0
    """Copies answered 2xx (a duplicated event counts twice)."""
    attempts: int = 0
    """HTTP requests made, retries included."""
    failed_attempts: int = 0
    """Requests answered non-2xx or that did not reach the receiver."""
    dropped: int = 0
    """Events never sent (the ``drop`` fault)."""
    duplicated: int = 0
    """Events sent twice (the ``duplicate`` fault)."""
    given_up: int = 0
    """Copies still failing after ``give_up_after_seconds``."""
    pending: int = 0
    """Copies not delivered or given up yet: queued, held, delayed or between retries."""


def sign(secret_key: bytes, webhook_id: str, timestamp: int, body: bytes) -> str:
    """``webhook-signature``: ``v1,`` and the HMAC-SHA256 of ``{id}.{timestamp}.{body}``."""
    signed = f"{webhook_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(secret_key, signed, hashlib.sha256).digest()).decode()


def session_webhook(stream_type: str, session: dict[str, Any]) -> dict[str, Any] | None:
    """The webhook event for a session transition (``session``: the session's JSON), or
    None for a transition with no webhook. No agent id: the real events carry none."""
    webhook_type = SESSION_WEBHOOKS.get(stream_type)
    if webhook_type is None:
        return None
    data: dict[str, Any] = {"id": session["id"]}
    if webhook_type == "agent.session.action_required":
        # Only the first action's type: the receiver retrieves the session for the rest.
        actions = session.get("required_actions") or []
        data["required_action"] = {"type": actions[0]["type"] if actions else "function_call"}
    else:
        data["environment_type"] = (session.get("environment") or {}).get("type", "none")
    return {
        "id": f"evt_{secrets.token_hex(12)}",
        "object": "event",
        "created_at": int(time.time()),
        "type": webhook_type,
        "data": data,
    }


@dataclass
class _Delivery:
    """One copy of one event on its way: its webhook-id is kept across retries."""

    webhook_id: str
    body: bytes
    due: float
    """Monotonic time before which the first attempt is not made (``delay_seconds``)."""
    rng: random.Random
    """This copy's own draws (``wrong_signature``, per attempt): seeded from the sender's
    generator when the event happens, so how attempts of different events interleave in
    time cannot change what a seed gives."""
    first_attempt: float | None = None


@dataclass
class _Outbox:
    """A configuration's deliveries: replaced whole when the configuration changes."""

    config: WebhookConfig
    key: bytes
    rng: random.Random
    wrong_key: bytes
    counts: WebhookCounts = field(default_factory=WebhookCounts)
    queue: asyncio.Queue[_Delivery] = field(default_factory=asyncio.Queue)
    held: _Delivery | None = None
    worker: asyncio.Task[None] | None = None
    tasks: set[asyncio.Task[None]] = field(default_factory=set)


class WebhookSender:
    """Signs, queues and delivers the webhooks of one emulator, with its faults and counts.

    First attempts are made one at a time in the order events happened (faults aside), so a
    receiver sees order broken only by a fault or a retry, as it would be in real life; a
    failed delivery retries on its own task, never holding the queue back."""

    def __init__(
        self,
        config: WebhookConfig | None = None,
        *,
        first_backoff: float = FIRST_BACKOFF_SECONDS,
        max_backoff: float = MAX_BACKOFF_SECONDS,
    ) -> None:
        self._startup = config or WebhookConfig()
        self._first_backoff = first_backoff
        self._max_backoff = max_backoff
        self._http: httpx2.AsyncClient | None = None
        self._outbox = self._new_outbox(self._startup)

    @staticmethod
    def _new_outbox(config: WebhookConfig) -> _Outbox:
        # Reproducible fault draws are the point; nothing secret comes from this generator.
        rng = random.Random(config.seed)  # noqa: S311
        return _Outbox(
            config=config,
            key=decode_secret(config.secret) if config.secret else b"",
            rng=rng,
            # Drawn from the seeded generator too: the "other secret" is the same each run.
            wrong_key=rng.randbytes(32),
        )

    @property
    def config(self) -> WebhookConfig:
        return self._outbox.config

    def counts(self) -> WebhookCounts:
        return self._outbox.counts.model_copy()

    def configure(self, config: WebhookConfig) -> None:
        """Replace the configuration: the counts start again, deliveries in flight are
        abandoned (they were for the old receiver)."""
        self._abandon()
        self._outbox = self._new_outbox(config)

    def reset(self) -> None:
        """Back to the start-up configuration (``--webhook-url``), counts at zero."""
        self.configure(self._startup)

    def close(self) -> None:
        self._abandon()

    async def aclose(self) -> None:
        self._abandon()
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    def _abandon(self) -> None:
        for task in list(self._outbox.tasks):
            task.cancel()
        self._outbox.tasks.clear()

    # ------------------------------------------------------------------ events

    def session_event(self, stream_type: str, session: dict[str, Any]) -> None:
        """A session changed state (``stream_type`` as the event stream names it): queue its
        webhook, if it has one and webhooks are on. Never awaits: the state machine calls it
        in the middle of a transition."""
        outbox = self._outbox
        if outbox.config.url is None:
            return
        event = session_webhook(stream_type, session)
        if event is None:
            return
        outbox.counts.sent += 1
        faults = outbox.config.faults
        # Every draw is made, used or not, so one seed gives the same faults for the same
        # events whatever the probabilities of the others.
        drop, duplicate, reorder = (outbox.rng.random() for _ in range(3))
        attempt_seeds = (outbox.rng.getrandbits(64), outbox.rng.getrandbits(64))
        if drop < faults.drop:
            outbox.counts.dropped += 1
            return
        body = json.dumps(event, separators=(",", ":"), ensure_ascii=False).encode()
        due = time.monotonic() + faults.delay_seconds
        webhook_id = f"wh_{secrets.token_hex(16)}"
        copies = [_Delivery(webhook_id, body, due, random.Random(attempt_seeds[0]))]  # noqa: S311
        if duplicate < faults.duplicate:
            outbox.counts.duplicated += 1
            copies.append(_Delivery(webhook_id, body, due, random.Random(attempt_seeds[1])))  # noqa: S311
        outbox.counts.pending += len(copies)
        self._ensure_worker(outbox)
        held, outbox.held = outbox.held, None
        if held is None and reorder < faults.reorder:
            # Held until the next event is queued: that one overtakes it. One at a time, so
            # the event that overtakes is never held itself.
            outbox.held = copies[0]
            self._spawn(outbox, self._release_later(outbox, copies[0]))
            copies = copies[1:]
        for copy in copies:
            outbox.queue.put_nowait(copy)
        if held is not None:
            outbox.queue.put_nowait(held)

    async def _release_later(self, outbox: _Outbox, delivery: _Delivery) -> None:
        await asyncio.sleep(REORDER_HOLD_SECONDS)
        if outbox.held is delivery:
            outbox.held = None
            outbox.queue.put_nowait(delivery)

    # ---------------------------------------------------------------- delivery

    def _spawn(self, outbox: _Outbox, work: Any) -> None:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(work)
        outbox.tasks.add(task)
        task.add_done_callback(outbox.tasks.discard)

    def _ensure_worker(self, outbox: _Outbox) -> None:
        # Started with the first event, on the loop serving the emulator (the sender is made
        # before that loop runs).
        if outbox.worker is None or outbox.worker.done():
            outbox.worker = asyncio.get_running_loop().create_task(self._work(outbox))
            outbox.tasks.add(outbox.worker)
            outbox.worker.add_done_callback(outbox.tasks.discard)

    def _client(self) -> httpx2.AsyncClient:
        if self._http is None:
            self._http = httpx2.AsyncClient(timeout=ATTEMPT_TIMEOUT_SECONDS)
        return self._http

    async def _work(self, outbox: _Outbox) -> None:
        while True:
            delivery = await outbox.queue.get()
            wait = delivery.due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if not await self._attempt(outbox, delivery):
                self._spawn(outbox, self._retry(outbox, delivery))

    async def _retry(self, outbox: _Outbox, delivery: _Delivery) -> None:
        backoff = self._first_backoff
        assert delivery.first_attempt is not None
        while True:
            elapsed = time.monotonic() - delivery.first_attempt
            if elapsed + backoff > outbox.config.give_up_after_seconds:
                outbox.counts.pending -= 1
                outbox.counts.given_up += 1
                log.warning("webhook %s given up after %.1f s", delivery.webhook_id, elapsed)
                return
            await asyncio.sleep(backoff)
            if await self._attempt(outbox, delivery):
                return
            backoff = min(backoff * 2, self._max_backoff)

    async def _attempt(self, outbox: _Outbox, delivery: _Delivery) -> bool:
        """One POST; True once answered 2xx (the delivery is then done)."""
        config = outbox.config
        assert config.url is not None
        if delivery.first_attempt is None:
            delivery.first_attempt = time.monotonic()
        # Signed at each attempt, with the time of the attempt, as Standard Webhooks senders
        # do: a retry an hour later still passes the receiver's 300 s tolerance.
        timestamp = int(time.time())
        wrong = delivery.rng.random() < config.faults.wrong_signature
        key = outbox.wrong_key if wrong else outbox.key
        headers = {
            "content-type": "application/json",
            "user-agent": "toolledger-emulator-webhooks",
            "webhook-id": delivery.webhook_id,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": sign(key, delivery.webhook_id, timestamp, delivery.body),
        }
        outbox.counts.attempts += 1
        try:
            response = await self._client().post(config.url, content=delivery.body, headers=headers)
        except httpx2.HTTPError as error:
            outbox.counts.failed_attempts += 1
            log.debug("webhook %s: %s", delivery.webhook_id, error)
            return False
        if 200 <= response.status_code < 300:
            outbox.counts.pending -= 1
            outbox.counts.delivered += 1
            return True
        outbox.counts.failed_attempts += 1
        log.debug("webhook %s: HTTP %s", delivery.webhook_id, response.status_code)
        return False


__all__ = [
    "SESSION_WEBHOOKS",
    "WebhookConfig",
    "WebhookCounts",
    "WebhookFaults",
    "WebhookSender",
    "decode_secret",
    "session_webhook",
    "sign",
]
