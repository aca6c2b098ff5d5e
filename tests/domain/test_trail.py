"""The trail's hash chain as pure rules: the text an event's hash covers, and what a broken
chain says happened (each tampering shape built by hand, as a direct SQL change leaves it)."""

from __future__ import annotations

import dataclasses
import hashlib
from datetime import UTC, datetime, timedelta, timezone

import pytest

from toolledger.domain.keys import CallKey
from toolledger.domain.queries import QueryError
from toolledger.domain.records import CallEvent
from toolledger.domain.trail import (
    GENESIS_SHA256,
    BreakKind,
    TrailHead,
    TrailScope,
    canonical_moment,
    check_anchor,
    check_trail,
    event_sha256,
    event_text,
    event_values,
    trail_head,
)

KEY = CallKey("sess_1", "turn_1", "call_1")
START = datetime(2026, 12, 7, 1, 2, 3, 4, tzinfo=UTC)
Step = tuple[str, str | None, str | None, int | None, str | None, str | None]
"""kind, from and to status, lease token, reason, detail."""
LIFE: list[Step] = [
    ("transition", None, "running", 1, "recorded and claimed", "claim c1"),
    ("transition", "running", "succeeded", 1, "handler returned", None),
    ("submission_failed", None, None, None, "502 from the API", None),
    ("submission", "succeeded", "submitted", 1, "result accepted", None),
    ("confirmed", "submitted", "submitted", None, "left required_actions", None),
]


def chained(steps: list[Step]) -> list[CallEvent]:
    """Events as the database's trigger writes them: ids rising, each chained to the last."""
    events: list[CallEvent] = []
    previous = GENESIS_SHA256
    for number, (kind, source, target, token, reason, detail) in enumerate(steps):
        event = CallEvent(
            id=10 * (number + 1),
            key=KEY,
            at=START + timedelta(milliseconds=number),
            actor="worker-1",
            kind=kind,
            from_status=source,
            to_status=target,
            lease_token=token,
            reason=reason,
            detail=detail,
        )
        sha256 = event_sha256(event_values(event, previous))
        events.append(dataclasses.replace(event, prev_sha256=previous, sha256=sha256))
        previous = sha256
    return events


def test_event_text__each_field_on_its_line_with_its_length__nulls_as_a_dash() -> None:
    event = chained(LIFE)[0]

    text = event_text(event_values(event, GENESIS_SHA256))

    assert text == (
        "toolledger-trail-v1\n"
        f"prev_sha256 64:{GENESIS_SHA256}\n"
        "session_id 6:sess_1\n"
        "turn_id 6:turn_1\n"
        "call_id 6:call_1\n"
        "at 27:2026-12-07T01:02:03.000004Z\n"
        "actor 8:worker-1\n"
        "kind 10:transition\n"
        "from_status -\n"
        "to_status 7:running\n"
        "lease_token 1:1\n"
        "reason 20:recorded and claimed\n"
        "detail 8:claim c1\n"
    )
    assert event.sha256 == hashlib.sha256(text.encode("utf-8")).hexdigest()


def test_event_text__lengths_count_characters__a_newline_or_a_dash_in_a_value_is_unambiguous() -> None:
    event = dataclasses.replace(chained(LIFE)[0], reason="-", detail="é\nkind 1:x")

    text = event_text(event_values(event, GENESIS_SHA256))

    assert "reason 1:-\n" in text
    assert "detail 10:é\nkind 1:x\n" in text  # é is one character (two bytes)
    assert event_sha256(event_values(event, GENESIS_SHA256)) != event_sha256(
        event_values(dataclasses.replace(event, reason=None), GENESIS_SHA256)
    )


def test_canonical_moment__utc_to_the_microsecond__naive_is_utc__other_zones_converted() -> None:
    plus_two = timezone(timedelta(hours=2))

    assert canonical_moment(datetime(2026, 1, 2, 3, 4, 5)) == "2026-01-02T03:04:05.000000Z"
    assert canonical_moment(datetime(2026, 1, 2, 3, 4, 5, 999999, tzinfo=plus_two)) == (
        "2026-01-02T01:04:05.999999Z"
    )


def test_check_trail__a_whole_life__is_intact_and_its_head_is_the_last_hash() -> None:
    events = chained(LIFE)

    assert check_trail(events, "submitted") is None
    assert trail_head(events) == TrailHead(5, events[-1].sha256)


def test_check_trail__an_edited_reason__is_named_at_that_event() -> None:
    events = chained(LIFE)
    events[1] = dataclasses.replace(events[1], reason="handler returned nothing")

    found = check_trail(events, "submitted")

    assert found is not None
    assert (found.kind, found.event_id) == (BreakKind.EDITED, 20)
    assert (
        "event 20 (transition running -> succeeded at 2026-12-07T01:02:03.001004Z) was edited"
        in found.message
    )


def test_check_trail__a_deleted_middle_event__is_named_at_the_event_after_the_gap() -> None:
    events = chained(LIFE)
    del events[2]

    found = check_trail(events, "submitted")

    assert found is not None
    assert (found.kind, found.event_id) == (BreakKind.DELETED, 40)
    assert "between event 20 and it was deleted" in found.message


def test_check_trail__a_forged_event_chained_to_its_predecessor__is_named_as_inserted() -> None:
    events = chained(LIFE)
    forged = dataclasses.replace(events[1], id=25, kind="flag", reason="all fine", to_status=None)
    forged = dataclasses.replace(forged, prev_sha256=events[1].sha256, sha256=None)
    forged = dataclasses.replace(forged, sha256=event_sha256(event_values(forged, events[1].sha256)))
    events.insert(2, forged)

    found = check_trail(events, "submitted")

    assert found is not None
    assert (found.kind, found.event_id) == (BreakKind.INSERTED, 25)
    assert "event 25 (flag at" in found.message
    assert "is not in the chain: inserted after event 20 (event 30 chains from event 20)" in found.message


def test_check_trail__a_forged_event_with_any_hashes__is_named_as_inserted() -> None:
    events = chained(LIFE)
    forged = dataclasses.replace(events[1], id=25, prev_sha256="a" * 64)
    forged = dataclasses.replace(forged, sha256=event_sha256(event_values(forged, "a" * 64)))
    events.insert(2, forged)

    found = check_trail(events, "submitted")

    assert found is not None
    assert (found.kind, found.event_id) == (BreakKind.INSERTED, 25)


def test_check_trail__a_forged_event_appended_as_a_branch__is_named_not_the_events_it_skips() -> None:
    events = chained(LIFE)
    forged = dataclasses.replace(events[0], id=60, kind="flag", to_status=None, prev_sha256=events[0].sha256)
    forged = dataclasses.replace(forged, sha256=event_sha256(event_values(forged, events[0].sha256)))

    found = check_trail([*events, forged], "submitted")

    assert found is not None
    assert (found.kind, found.event_id) == (BreakKind.INSERTED, 60)
    assert "chains from event 10, not from event 50: inserted at the end of the trail" in found.message


def test_check_trail__two_events_swapped__is_named_as_reordered() -> None:
    events = chained(LIFE)
    second, third = events[1], events[2]
    events[1] = dataclasses.replace(third, id=second.id)
    events[2] = dataclasses.replace(second, id=third.id)

    found = check_trail(events, "submitted")

    assert found is not None
    assert (found.kind, found.event_id) == (BreakKind.REORDERED, 20)
    assert "chains from event 30, which now comes after it" in found.message


def test_check_trail__the_last_events_deleted__the_trail_stops_short_of_the_status() -> None:
    events = chained(LIFE)[:2]

    found = check_trail(events, "submitted")

    assert found is not None
    assert (found.kind, found.event_id) == (BreakKind.TRUNCATED, 20)
    assert "ends at its last status change to succeeded, but the call is submitted" in found.message


def test_check_trail__no_events_or_an_unhashed_one__are_breaks_too() -> None:
    events = chained(LIFE)
    events[3] = dataclasses.replace(events[3], sha256=None)

    unhashed = check_trail(events, "submitted")
    empty = check_trail([], "submitted")

    assert unhashed is not None
    assert (unhashed.kind, unhashed.event_id) == (BreakKind.UNCHAINED, 40)
    assert empty is not None
    assert (empty.kind, empty.event_id) == (BreakKind.EMPTY, None)


def test_check_trail__a_first_event_not_from_genesis__is_a_break() -> None:
    events = chained(LIFE)[1:]

    found = check_trail(events, "submitted")

    assert found is not None
    assert (found.kind, found.event_id) == (BreakKind.DELETED, 20)
    assert "between the start of the trail and it" in found.message


def test_check_anchor__a_trail_that_grew_since__still_holds_the_exported_head() -> None:
    events = chained(LIFE)

    assert check_anchor(events, trail_head(events[:3])) is None
    assert check_anchor(events, TrailHead(0, None)) is None


def test_check_anchor__a_rewritten_trail_whose_chain_holds__breaks_the_anchor() -> None:
    original = chained(LIFE)
    edited: Step = ("transition", "running", "succeeded", 1, "handler returned nothing", None)
    rewritten = chained([LIFE[0], edited, *LIFE[2:]])
    assert check_trail(rewritten, "submitted") is None

    found = check_anchor(rewritten, trail_head(original[:3]))
    shorter = check_anchor(original[:2], trail_head(original[:3]))

    assert found is not None
    assert (found.kind, found.event_id) == (BreakKind.REWRITTEN, 30)
    assert shorter is not None
    assert shorter.kind is BreakKind.TRUNCATED


def test_trail_scope__one_call_or_one_session__never_both() -> None:
    assert str(TrailScope()) == "the whole ledger"
    assert str(TrailScope(session_id="s")) == "session s"
    assert str(TrailScope(key=KEY)) == "call sess_1/turn_1/call_1"
    with pytest.raises(QueryError, match="not both"):
        TrailScope(key=KEY, session_id="s")
    for unnamable in ("", "s\x00", "s" * 300):
        with pytest.raises(QueryError, match="a session id is 1 to 255 characters"):
            TrailScope(session_id=unnamable)
