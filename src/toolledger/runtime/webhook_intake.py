"""The signed webhook intake: ``POST /webhooks/agents``, served by every replica.

A webhook is verified with the openai SDK's own Standard Webhooks check (the current secret,
or the one being rotated out), then recorded by its ``webhook-id`` together with the look it
asks for, in one commit, and only then answered 2xx: a sender that hears 2xx never has to
send it again, and nothing it told us can be lost. A redelivery (same id) is answered 2xx and
changes nothing. What is refused (a bad or missing signature, a stale timestamp, a body that
is not a JSON event or is too large) gets a 4xx with a one-line reason and stores nothing;
a ledger that cannot be written gets 503, so that the sender tries again later.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from openai import InvalidWebhookSignatureError
from sqlalchemy.exc import DBAPIError, OperationalError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from toolledger import metrics
from toolledger.gateway.agents import AgentsGateway
from toolledger.settings import Settings
from toolledger.store.intake import IntakeStore

log = logging.getLogger("toolledger.intake")

PATH = "/webhooks/agents"
TOLERANCE_SECONDS = 300
"""The SDK's window for a webhook's timestamp (either way)."""
REQUIRED_HEADERS = ("webhook-id", "webhook-timestamp", "webhook-signature")
LOOK_EVENTS = frozenset({"agent.session.action_required", "agent.session.idle", "agent.session.failed"})
"""Events after which the session may await us (an action) or hold calls to close (a turn
over, a failure); the others (created, in_progress) are recorded and counted only."""
REFUSALS_SAID_EVERY = 60.0


class WebhookIntake:
    """Verifies and records webhooks; counts what it did (``counts``, shown by `status`)."""

    def __init__(
        self,
        settings: Settings,
        store: IntakeStore,
        gateway: AgentsGateway,
        *,
        on_look_requested: Callable[[], None] | None = None,
    ) -> None:
        self.store = store
        self.gateway = gateway
        secrets = (settings.webhook_secret, settings.webhook_previous_secret)
        self._secrets = [secret.get_secret_value() for secret in secrets if secret is not None]
        self._max_bytes = settings.webhook_max_bytes
        self._on_look_requested = on_look_requested
        self.counts: Counter[str] = Counter()
        self._refusals_said: dict[str, float] = {}

    def app(self) -> Starlette:
        return Starlette(routes=[Route(PATH, self._receive, methods=["POST"])])

    async def _receive(self, request: Request) -> JSONResponse:
        started = time.perf_counter()
        try:
            outcome, status, body = await self._take(request)
        finally:
            metrics.WEBHOOK_ACK_DURATION.observe(time.perf_counter() - started)
        self.counts[outcome] += 1
        metrics.WEBHOOKS.labels(outcome).inc()
        return JSONResponse(body, status_code=status)

    async def _take(self, request: Request) -> tuple[str, int, dict[str, Any]]:
        raw = await _read_at_most(request, self._max_bytes)
        if raw is None:
            return self._refuse("too_large", 413, f"body over {self._max_bytes} bytes")
        headers = {name: request.headers[name] for name in REQUIRED_HEADERS if name in request.headers}
        missing = [name for name in REQUIRED_HEADERS if name not in headers]
        if missing:
            return self._refuse("missing_header", 400, f"missing header {', '.join(missing)}")
        try:
            sent_at = int(headers["webhook-timestamp"])
        except ValueError:
            return self._refuse("bad_timestamp", 400, "webhook-timestamp is not a number of seconds")
        if abs(time.time() - sent_at) > TOLERANCE_SECONDS:
            return self._refuse(
                "stale_timestamp", 400, f"webhook-timestamp is more than {TOLERANCE_SECONDS} s from now"
            )
        if not self._signed(raw, headers):
            return self._refuse("bad_signature", 401, "webhook-signature does not match")
        try:
            event = json.loads(raw)
        except ValueError:
            return self._refuse("not_json", 400, "the body is not JSON")
        if not isinstance(event, dict) or not isinstance(event.get("type"), str):
            return self._refuse("not_an_event", 400, "the body is not an event (no type)")
        kind: str = event["type"]
        if not kind.startswith("agent.session."):
            return "ignored", 200, {"ignored": kind[:64]}
        data = event.get("data")
        session_id = data.get("id") if isinstance(data, dict) else None
        if not isinstance(session_id, str) or not 0 < len(session_id) <= 255:
            return self._refuse("not_an_event", 400, "a session event without data.id")
        try:
            taken = await self.store.take_webhook(
                headers["webhook-id"], kind, session_id, look=kind in LOOK_EVENTS
            )
        except (OperationalError, DBAPIError, OSError, TimeoutError):
            log.warning("webhook %s not taken: the ledger is unavailable (503; the sender retries)", kind)
            return "unavailable", 503, {"error": "the ledger is unavailable; send it again later"}
        if not taken:
            return "duplicate", 200, {"taken": False, "duplicate": True}
        if kind in LOOK_EVENTS and self._on_look_requested is not None:
            self._on_look_requested()
        return "accepted", 200, {"taken": True}

    def _signed(self, raw: bytes, headers: dict[str, str]) -> bool:
        for secret in self._secrets:
            try:
                self.gateway.verify_webhook(raw, headers, secret)
            except (InvalidWebhookSignatureError, ValueError):
                continue
            return True
        return False

    def _refuse(self, reason: str, status: int, message: str) -> tuple[str, int, dict[str, Any]]:
        """A refusal is the sender's problem (or an attacker's), not ours: said at warning once
        a minute per reason, at debug in between; never at error."""
        now = time.monotonic()
        level = logging.DEBUG
        if now - self._refusals_said.get(reason, -REFUSALS_SAID_EVERY) >= REFUSALS_SAID_EVERY:
            self._refusals_said[reason] = now
            level = logging.WARNING
        log.log(level, "webhook refused (%d): %s", status, message)
        return f"refused_{reason}", status, {"error": message}


async def _read_at_most(request: Request, limit: int) -> bytes | None:
    """The body, or None once it is over ``limit`` bytes (not read further)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        return None
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


__all__ = ["LOOK_EVENTS", "PATH", "WebhookIntake"]
