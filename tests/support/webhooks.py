"""Sending webhooks to a toolledger intake as the Agents API does, signed as the emulator signs
its own (Standard Webhooks), for tests that play the sender themselves: a bad signature, a
stale timestamp, a redelivery."""

from __future__ import annotations

import base64
import json
import secrets
import time
from typing import Any

import httpx

from toolledger.emulator.webhooks import decode_secret, sign

SECRET = "whsec_" + base64.b64encode(b"toolledger-test-webhook-secret!!").decode()
OTHER_SECRET = "whsec_" + base64.b64encode(b"a-secret-nobody-configured-here").decode()


def event(kind: str, session_id: str, **data: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"id": session_id, **data}
    if kind == "agent.session.action_required":
        body.setdefault("required_action", {"type": "function_call"})
    return {
        "id": f"evt_{secrets.token_hex(8)}",
        "object": "event",
        "created_at": int(time.time()),
        "type": kind,
        "data": body,
    }


def signed_headers(
    body: bytes, *, secret: str = SECRET, webhook_id: str | None = None, timestamp: int | None = None
) -> dict[str, str]:
    webhook_id = webhook_id or f"msg_{secrets.token_hex(8)}"
    stamp = int(time.time()) if timestamp is None else timestamp
    return {
        "webhook-id": webhook_id,
        "webhook-timestamp": str(stamp),
        "webhook-signature": sign(decode_secret(secret), webhook_id, stamp, body),
        "content-type": "application/json",
    }


async def send(
    url: str, payload: dict[str, Any], *, secret: str = SECRET, webhook_id: str | None = None
) -> httpx.Response:
    body = json.dumps(payload).encode()
    async with httpx.AsyncClient(timeout=10.0) as client:
        return await client.post(
            url, content=body, headers=signed_headers(body, secret=secret, webhook_id=webhook_id)
        )
