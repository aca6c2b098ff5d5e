"""Alerts: which audit events mean a call needs a person, and what an alert says of it.

The triggers are data (``ALERT_TRIGGERS``), read in one place: the store turns them into
the filter of its scan of the audit trail, and ``alert_kind_of`` names the alert an event
raises. An alert's body is built from an allow-list of the call's columns: never its
arguments, its result or its error detail, which may hold what the tool was given or said.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any
from urllib.parse import quote

from toolledger.domain.records import CallEvent
from toolledger.domain.redaction import Redactor
from toolledger.domain.results import GIVEN_UP_REASONS
from toolledger.domain.states import CallStatus

ALERT_ID_PREFIX = "tla_"
CALL_PAGE_PATH = "/ui/#call="
"""A call's page in the audit API's web view, followed by the call's id (its idempotency
key): the fragment ``audit/web/app.js`` opens the call's detail from."""


class AlertKind(StrEnum):
    UNKNOWN = "unknown"
    """The call's lease ran out without a result: its handler may have run."""
    AWAITING_APPROVAL = "awaiting_approval"
    """The call's tool needs an operator's approval before it runs."""
    UNCONFIRMED = "unconfirmed"
    """The result was accepted again and again, yet the session still awaits it."""
    GIVEN_UP = "given_up"
    """Recovery gave up on the call (too many attempts, or unknown past its deadline) and sent
    a fixed failure to the model."""


@dataclass(frozen=True)
class AlertTrigger:
    """An audit event that raises an alert: every field given must match (None: any)."""

    alert: AlertKind
    event_kind: str | None = None
    from_status: str | None = None
    to_status: str | None = None
    reason_prefixes: tuple[str, ...] = ()
    """The event's reason begins with one of these (empty: any reason)."""

    def matches(self, event: CallEvent) -> bool:
        expected = ((self.event_kind, event.kind), (self.from_status, event.from_status))
        if any(want is not None and want != got for want, got in expected):
            return False
        if self.to_status is not None and self.to_status != event.to_status:
            return False
        return not self.reason_prefixes or (event.reason or "").startswith(self.reason_prefixes)


ALERT_TRIGGERS: tuple[AlertTrigger, ...] = (
    # Any write that leaves a call unknown (a lease run out, its owner found gone).
    AlertTrigger(AlertKind.UNKNOWN, to_status=CallStatus.UNKNOWN.value),
    # A call of a tool declared ``approval=...`` recorded to wait for a person.
    AlertTrigger(AlertKind.AWAITING_APPROVAL, to_status=CallStatus.AWAITING_APPROVAL.value),
    # ``Executor._note_unconfirmed`` flags it once, after UNCONFIRMED_ALERT_AFTER acceptances.
    AlertTrigger(AlertKind.UNCONFIRMED, event_kind="unconfirmed"),
    # Recovery's own settlements (``runtime.decider``); an operator's resolution is not one.
    AlertTrigger(
        AlertKind.GIVEN_UP,
        event_kind="transition",
        from_status=CallStatus.UNKNOWN.value,
        to_status=CallStatus.FAILED.value,
        reason_prefixes=GIVEN_UP_REASONS,
    ),
)
"""Every event that raises an alert, and which: the one place they are declared."""

ALERT_EVENT_KINDS = ("alert_sent", "alert_failed")
"""What the sender writes in a call's timeline: a delivery, or a round of failed tries."""


def alert_kind_of(event: CallEvent) -> AlertKind | None:
    """The alert ``event`` raises, if any (the first trigger it matches)."""
    for trigger in ALERT_TRIGGERS:
        if trigger.matches(event):
            return trigger.alert
    return None


@dataclass(frozen=True)
class AlertSubject:
    """An event that raises an alert, with what the alert may say of its call."""

    event: CallEvent
    kind: AlertKind
    tool_name: str
    status: str
    """The call's status when it was read (the event's to-status is what the alert reports)."""
    effect_class: str
    call_id: str
    """The call's id in the audit views and the CLI: its idempotency key."""
    attempts: int

    @property
    def alert_id(self) -> str:
        """Stable across every try of this alert, so receivers can drop repeats: the event's
        id with what makes it unique for good (an id SQLite gives again after a prune is
        another call's, or the same call's at another moment)."""
        at = self.event.at.isoformat()
        digest = hashlib.sha256(f"{self.event.id}|{self.call_id}|{at}".encode()).hexdigest()
        return ALERT_ID_PREFIX + digest[:32]


def call_page_url(public_url: str, call_id: str) -> str:
    """The call's page in the web view behind ``public_url``."""
    return public_url.rstrip("/") + CALL_PAGE_PATH + quote(call_id, safe="")


def alert_body(subject: AlertSubject, *, redactor: Redactor, public_url: str | None) -> dict[str, Any]:
    """The JSON an alert carries: an allow-list of the call's columns, the event's reason
    (redacted when it was written, and again here), and a link to the call's page."""
    event = subject.event
    body: dict[str, Any] = {
        "id": subject.alert_id,
        "kind": subject.kind.value,
        "occurred_at": _iso(event.at),
        "reason": redactor.text(event.reason) if event.reason is not None else None,
        "call": {
            "id": subject.call_id,
            "session_id": event.key.session_id,
            "turn_id": event.key.turn_id,
            "call_id": event.key.call_id,
            "tool": subject.tool_name,
            "effect_class": subject.effect_class,
            "status": event.to_status or subject.status,
            "attempts": subject.attempts,
        },
        "event_id": event.id,
    }
    if public_url:
        body["url"] = call_page_url(public_url, subject.call_id)
    return body


def _iso(moment: datetime) -> str:
    return moment.isoformat()


__all__ = [
    "ALERT_EVENT_KINDS",
    "ALERT_TRIGGERS",
    "CALL_PAGE_PATH",
    "AlertKind",
    "AlertSubject",
    "AlertTrigger",
    "alert_body",
    "alert_kind_of",
    "call_page_url",
]
