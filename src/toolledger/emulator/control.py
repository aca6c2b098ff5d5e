"""A Python client for the emulator's control API: scripts, faults, and what it received."""

from __future__ import annotations

import time
from typing import Any, Literal

import httpx2
from pydantic import BaseModel, TypeAdapter

from toolledger.emulator.behaviour import AlreadyAnswered, ApiBehaviour, IdempotencyKeys
from toolledger.emulator.faults import (
    AcceptThenDrop,
    AcceptWithoutApply,
    CloseStreams,
    DelayRegistration,
    DropBeforeApply,
    DuplicateEvents,
    FailSubmissions,
    Fault,
    UnknownPending,
)
from toolledger.emulator.script import Script
from toolledger.emulator.webhooks import WebhookConfig, WebhookCounts, WebhookFaults


class ReceivedToolResult(BaseModel):
    """A tool_result the emulator received, and what became of it."""

    session_id: str
    turn_id: str
    call_id: str
    outcome: str
    """``accepted``, ``replayed`` (an idempotent repeat, applied once), ``rejected``, or
    ``lost`` (answered 202 but not applied: the accept_without_apply fault)."""
    reason: str | None
    idempotency_key: str | None
    payload: dict[str, Any]
    received_at: float
    request_sha256: str = ""
    """The whole request's body hashed: equal for every post of one request."""


_RECEIPTS: TypeAdapter[list[ReceivedToolResult]] = TypeAdapter(list[ReceivedToolResult])


class EmulatorControl:
    """Drives a running emulator; ``base_url`` is the one its clients use (``.../v1``)."""

    def __init__(self, base_url: str, *, timeout: float = 10.0) -> None:
        root = base_url.rstrip("/").removesuffix("/v1")
        self._http = httpx2.Client(base_url=f"{root}/_emulator", timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        response = self._http.request(method, path, json=body)
        response.raise_for_status()
        return response.json()

    def wait_ready(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._call("GET", "/health")
                return
            except httpx2.TransportError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    # scripts
    def register_script(self, name: str, script: Script) -> None:
        """Sessions created with metadata ``{"emulator_script": name}`` follow it."""
        self._call("PUT", f"/scripts/{name}", script.model_dump(mode="json"))

    def set_default_script(self, script: Script) -> None:
        self._call("PUT", "/default-script", script.model_dump(mode="json"))

    def set_script(self, session_id: str, script: Script) -> None:
        self._call("PUT", f"/sessions/{session_id}/script", script.model_dump(mode="json"))

    # how the API answers where real ones differ
    def set_behaviour(
        self,
        *,
        already_answered: AlreadyAnswered = "coded",
        idempotency_keys: IdempotencyKeys = "honoured",
    ) -> None:
        """How a result for a call answered already is refused, and whether Idempotency-Keys
        are kept (``emulator.behaviour``); every session, until changed or reset."""
        behaviour = ApiBehaviour(already_answered=already_answered, idempotency_keys=idempotency_keys)
        self._call("PUT", "/behaviour", behaviour.model_dump())

    def behaviour(self) -> ApiBehaviour:
        return ApiBehaviour.model_validate(self._call("GET", "/behaviour"))

    # faults
    def arm(self, fault: Fault) -> int:
        armed: dict[str, Any] = self._call("POST", "/faults", fault.model_dump(mode="json"))
        return int(armed["id"])

    def faults(self) -> list[dict[str, Any]]:
        listing: list[dict[str, Any]] = self._call("GET", "/faults")
        return listing

    def clear_faults(self) -> None:
        self._call("DELETE", "/faults")

    def close_streams(
        self,
        *,
        after_events: int = 0,
        mode: Literal["drop", "end"] = "drop",
        session_id: str | None = None,
        count: int | None = 1,
    ) -> int:
        return self.arm(
            CloseStreams(after_events=after_events, mode=mode, session_id=session_id, count=count)
        )

    def fail_submissions(
        self,
        count: int = 1,
        *,
        status: int = 500,
        retry_after: float | None = None,
        session_id: str | None = None,
    ) -> int:
        return self.arm(
            FailSubmissions(count=count, status=status, retry_after=retry_after, session_id=session_id)
        )

    def accept_then_drop(self, count: int = 1, *, session_id: str | None = None) -> int:
        return self.arm(AcceptThenDrop(count=count, session_id=session_id))

    def accept_without_apply(self, count: int = 1, *, session_id: str | None = None) -> int:
        return self.arm(AcceptWithoutApply(count=count, session_id=session_id))

    def drop_before_apply(self, count: int = 1, *, session_id: str | None = None) -> int:
        return self.arm(DropBeforeApply(count=count, session_id=session_id))

    def delay_registration(self, seconds: float, *, steps: int = 1, session_id: str | None = None) -> int:
        return self.arm(DelayRegistration(seconds=seconds, count=steps, session_id=session_id))

    def unknown_pending(self, count: int = 1, *, session_id: str | None = None) -> int:
        return self.arm(UnknownPending(count=count, session_id=session_id))

    def duplicate_events(self, count: int | None = None, *, session_id: str | None = None) -> int:
        return self.arm(DuplicateEvents(count=count, session_id=session_id))

    # webhooks
    def configure_webhooks(
        self,
        url: str | None,
        secret: str | None,
        *,
        drop: float = 0.0,
        duplicate: float = 0.0,
        reorder: float = 0.0,
        delay_seconds: float = 0.0,
        wrong_signature: float = 0.0,
        seed: int | None = None,
        give_up_after_seconds: float = 3600.0,
    ) -> dict[str, Any]:
        """Send ``agent.session.*`` webhooks to ``url`` signed with ``secret`` (``whsec_...``),
        with these faults (probabilities, drawn from ``random.Random(seed)``); ``url`` None
        stops sending. The counts start again. Returns the configuration as the emulator
        shows it (without the secret)."""
        config = WebhookConfig(
            url=url,
            secret=secret,
            faults=WebhookFaults(
                drop=drop,
                duplicate=duplicate,
                reorder=reorder,
                delay_seconds=delay_seconds,
                wrong_signature=wrong_signature,
            ),
            seed=seed,
            give_up_after_seconds=give_up_after_seconds,
        )
        shown: dict[str, Any] = self._call("PUT", "/webhooks", config.model_dump(mode="json"))
        return shown

    def webhooks(self) -> dict[str, Any]:
        """The webhook configuration (without the secret) and its ``counts``."""
        shown: dict[str, Any] = self._call("GET", "/webhooks")
        return shown

    def webhook_counts(self) -> WebhookCounts:
        return WebhookCounts.model_validate(self.webhooks()["counts"])

    # sessions
    def fail_session(self, session_id: str, message: str | None = None) -> None:
        self._call("POST", f"/sessions/{session_id}/fail", {"message": message} if message else None)

    def cancel_turn(self, session_id: str) -> None:
        self._call("POST", f"/sessions/{session_id}/cancel")

    # what was received
    def tool_results(self, session_id: str | None = None) -> list[ReceivedToolResult]:
        path = "/tool-results" + (f"?session_id={session_id}" if session_id else "")
        return _RECEIPTS.validate_python(self._call("GET", path))

    def accepted_results(
        self, session_id: str | None = None
    ) -> dict[tuple[str, str, str], list[dict[str, Any]]]:
        """Per (session, turn, call): the payloads accepted (an idempotent replay is not a new one)."""
        accepted: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
        for receipt in self.tool_results(session_id):
            if receipt.outcome == "accepted":
                key = (receipt.session_id, receipt.turn_id, receipt.call_id)
                accepted.setdefault(key, []).append(receipt.payload)
        return accepted

    def reset(self) -> None:
        self._call("POST", "/reset")
