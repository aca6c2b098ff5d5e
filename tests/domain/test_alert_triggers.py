"""Which audit events raise which alert: the triggers are data, matched the same way by the
store's SQL filter and by ``alert_kind_of``; the decider's own give-up reasons raise
"given_up", an operator's resolution does not."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from toolledger.domain.alerts import (
    ALERT_TRIGGERS,
    AlertKind,
    AlertSubject,
    alert_body,
    alert_kind_of,
    call_page_url,
)
from toolledger.domain.keys import CallKey
from toolledger.domain.records import CallEvent
from toolledger.domain.redaction import Redactor
from toolledger.domain.results import gave_up_after_attempts, gave_up_after_deadline

KEY = CallKey("sess_1", "turn_1", "call_1")
AT = datetime(2026, 12, 7, 9, 30, tzinfo=UTC)


def event(
    kind: str = "transition",
    from_status: str | None = None,
    to_status: str | None = None,
    reason: str | None = None,
) -> CallEvent:
    return CallEvent(7, KEY, AT, "worker-1", kind, from_status, to_status, 3, reason, None)


@pytest.mark.parametrize(
    ("raised", "expected"),
    [
        (event(from_status="running", to_status="unknown", reason="lease of w expired"), AlertKind.UNKNOWN),
        (event(from_status="pending", to_status="awaiting_approval"), AlertKind.AWAITING_APPROVAL),
        (event(kind="unconfirmed", reason="accepted 5 times"), AlertKind.UNCONFIRMED),
        (
            event(from_status="unknown", to_status="failed", reason=gave_up_after_attempts(3)),
            AlertKind.GIVEN_UP,
        ),
        (
            event(from_status="unknown", to_status="failed", reason=gave_up_after_deadline(2)),
            AlertKind.GIVEN_UP,
        ),
    ],
)
def test_alert_kind_of__each_trigger__names_its_alert(raised: CallEvent, expected: AlertKind) -> None:
    assert alert_kind_of(raised) is expected


@pytest.mark.parametrize(
    "quiet",
    [
        event(from_status="running", to_status="succeeded", reason="handler returned"),
        event(
            from_status="unknown", to_status="failed", reason="resolved by operator (error): card declined"
        ),
        event(from_status="unknown", to_status="succeeded", reason=gave_up_after_attempts(3)),
        event(kind="submission", from_status="succeeded", to_status="submitted"),
        event(kind="alert_sent", reason="unknown alert delivered"),
        event(kind="arguments_mismatch", reason="redelivered with other arguments; refused"),
    ],
)
def test_alert_kind_of__ordinary_events__raise_none(quiet: CallEvent) -> None:
    assert alert_kind_of(quiet) is None


def test_alert_triggers__declared_once_per_kind() -> None:
    assert sorted(t.alert for t in ALERT_TRIGGERS) == sorted(AlertKind)


def subject(raised: CallEvent, kind: AlertKind = AlertKind.UNKNOWN) -> AlertSubject:
    return AlertSubject(raised, kind, "charge_card", "unknown", "at_most_once", "tl_abc/def", 2)


def test_alert_body__allow_listed_fields_a_redacted_reason_and_a_link() -> None:
    raised = event(to_status="unknown", reason="lease expired; password=hunter22 was in the traceback")
    body = alert_body(subject(raised), redactor=Redactor(), public_url="https://ops.example.com/ledger/")

    assert body == {
        "id": subject(raised).alert_id,
        "kind": "unknown",
        "occurred_at": "2026-12-07T09:30:00+00:00",
        "reason": "lease expired; password=[REDACTED] was in the traceback",
        "call": {
            "id": "tl_abc/def",
            "session_id": "sess_1",
            "turn_id": "turn_1",
            "call_id": "call_1",
            "tool": "charge_card",
            "effect_class": "at_most_once",
            "status": "unknown",
            "attempts": 2,
        },
        "event_id": 7,
        "url": "https://ops.example.com/ledger/ui/#call=tl_abc%2Fdef",
    }
    assert "url" not in alert_body(subject(raised), redactor=Redactor(), public_url=None)
    json.dumps(body)  # plain JSON


def test_alert_id__stable_for_one_event__another_for_an_id_given_again_later() -> None:
    raised = event(to_status="unknown")
    assert subject(raised).alert_id == subject(raised).alert_id
    assert subject(raised).alert_id.startswith("tla_")
    # SQLite gives a pruned event's id again: the alert of the new event is another one.
    again = replace(raised, at=AT + timedelta(days=30))
    assert subject(again).alert_id != subject(raised).alert_id


def test_call_page_url__public_url_with_or_without_a_slash() -> None:
    assert call_page_url("https://x.example", "tl_1") == call_page_url("https://x.example/", "tl_1")
    assert call_page_url("https://x.example", "tl_1") == "https://x.example/ui/#call=tl_1"
