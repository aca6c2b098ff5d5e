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
    CONTENT_FIELDS,
    GENESIS_SHA256,
    BreakKind,
    TrailHead,
    TrailKey,
    TrailScope,
    canonical_moment,
    check_anchor,
    check_keyed,
    check_trail,
    content_covered,
    content_sha256,
    content_text,
    event_sha256,
    event_text,
    event_values,
    mac_text,
    mac_values,
    parts_written,
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


# ------------------------------------------------------------------ the call's content (v2)

Content = dict[str, str | None]
REQUEST: Content = {
    "tool_name": "charge_card",
    "effect_class": "at_most_once",
    "arguments": '{"amount":1}',
    "arguments_sha256": "a" * 64,
}
NO_APPROVAL: Content = {"approved_arguments": None, "approved_arguments_sha256": None}
NO_OUTCOME: Content = {"result": None, "error_stage": None, "error_detail": None}
OUTCOME: Content = {
    "result": '{"type":"tool_result","output":"ok"}',
    "error_stage": None,
    "error_detail": None,
}
RECORDED: Content = {**REQUEST, **NO_APPROVAL, **NO_OUTCOME}
ANSWERED: Content = {**REQUEST, **NO_APPROVAL, **OUTCOME}
SECRET = TrailKey(b"k" * 32)
WROTE: list[Content] = [REQUEST, OUTCOME, {}, {}, {}]
"""What each step of ``LIFE`` writes of the call's content: recorded, then its outcome."""
CONTENTS = [RECORDED, ANSWERED, ANSWERED, ANSWERED, ANSWERED]
"""The call's content right after each step of ``LIFE``."""


def chained_v2(
    steps: list[Step] = LIFE,
    contents: list[Content] = CONTENTS,
    wrote: list[Content] = WROTE,
    key: TrailKey | None = None,
) -> list[CallEvent]:
    """Events as the ledger writes them now: each with its call's content digest (and, with
    ``key``, its MAC), hashed as version 2."""
    events: list[CallEvent] = []
    previous = GENESIS_SHA256
    for event, content, written in zip(chained(steps), contents, wrote, strict=True):
        event = dataclasses.replace(event, content_sha256=content_sha256(content))
        if key is not None:
            event = dataclasses.replace(event, trail_mac=key.mac(mac_values(event), written))
        sha256 = event_sha256(event_values(event, previous))
        events.append(dataclasses.replace(event, prev_sha256=previous, sha256=sha256))
        previous = sha256
    return events


def rehashed(events: list[CallEvent]) -> list[CallEvent]:
    """Every hash recomputed, as someone with the database and this module can."""
    previous = GENESIS_SHA256
    out = []
    for event in events:
        sha256 = event_sha256(event_values(event, previous))
        out.append(dataclasses.replace(event, prev_sha256=previous, sha256=sha256))
        previous = sha256
    return out


def test_content_text__each_covered_field_on_its_line__nulls_as_a_dash() -> None:
    assert content_text(ANSWERED) == (
        "toolledger-content-v1\n"
        "tool_name 11:charge_card\n"
        "effect_class 12:at_most_once\n"
        'arguments 12:{"amount":1}\n'
        f"arguments_sha256 64:{'a' * 64}\n"
        "approved_arguments -\n"
        "approved_arguments_sha256 -\n"
        'result 36:{"type":"tool_result","output":"ok"}\n'
        "error_stage -\n"
        "error_detail -\n"
    )
    assert content_sha256(ANSWERED) == hashlib.sha256(content_text(ANSWERED).encode()).hexdigest()
    assert tuple(ANSWERED) == CONTENT_FIELDS


def test_event_text_v2__adds_the_content_digest_and_the_mac__v1_when_both_are_null() -> None:
    event = chained_v2(key=SECRET)[0]

    text = event_text(event_values(event, GENESIS_SHA256))
    v1 = event_text(
        event_values(dataclasses.replace(event, content_sha256=None, trail_mac=None), GENESIS_SHA256)
    )

    assert text.startswith("toolledger-trail-v2\n")
    assert text.endswith(
        f"detail 8:claim c1\ncontent_sha256 64:{content_sha256(RECORDED)}\n"
        f"trail_mac {len(event.trail_mac or '')}:{event.trail_mac}\n"
    )
    assert v1.startswith("toolledger-trail-v1\n")
    assert v1.endswith("detail 8:claim c1\n")


def test_check_trail__a_whole_life_with_content_digests__is_intact_keyed_or_not() -> None:
    events = chained_v2(key=SECRET)

    assert check_trail(events, "submitted", ANSWERED) is None
    assert check_trail(events, "submitted", ANSWERED, key=SECRET) is None
    assert content_covered(events)
    assert not content_covered(chained(LIFE))
    # A trail written before content digests were kept: nothing to hold the content to.
    assert check_trail(chained(LIFE), "submitted", {**ANSWERED, "result": "forged"}) is None


def test_check_trail__content_changed_after_the_last_event__names_that_event_and_what_is_covered() -> None:
    events = chained_v2()

    for field in ("result", "arguments", "approved_arguments", "error_detail", "tool_name"):
        found = check_trail(events, "submitted", {**ANSWERED, field: "forged"})

        assert found is not None
        assert (found.kind, found.event_id) == (BreakKind.CONTENT, 50)
        assert found.message.startswith(
            "the call's stored content (tool_name, effect_class, arguments, arguments_sha256, "
            "approved_arguments, approved_arguments_sha256, result, error_stage, error_detail) was "
            "changed outside toolledger after event 50 (confirmed submitted -> submitted at "
        )


def test_check_trail__a_content_digest_erased__breaks_the_hash__or_if_rehashed_the_content_rule() -> None:
    events = chained_v2()
    events[4] = dataclasses.replace(events[4], content_sha256=None)

    erased = check_trail(events, "submitted", ANSWERED)
    rehashed_as_v1 = check_trail(rehashed(events), "submitted", ANSWERED)

    assert erased is not None
    assert (erased.kind, erased.event_id) == (BreakKind.EDITED, 50)
    assert rehashed_as_v1 is not None
    assert (rehashed_as_v1.kind, rehashed_as_v1.event_id) == (BreakKind.CONTENT, 50)
    assert "carries no digest of the call's content, though event 40 before it does" in rehashed_as_v1.message


def test_check_trail__events_before_digests_then_events_with_them__the_last_one_counts() -> None:
    old = chained(LIFE[:2])
    new = chained_v2()[2:]
    events = rehashed([*old, *new])

    assert check_trail(events, "submitted", ANSWERED) is None
    found = check_trail(events, "submitted", {**ANSWERED, "result": "forged"})
    assert found is not None
    assert (found.kind, found.event_id) == (BreakKind.CONTENT, 50)


def test_keyed__forged_content_with_every_unkeyed_hash_recomputed__passes_unkeyed_fails_keyed() -> None:
    events = chained_v2(key=SECRET)
    forged = {**ANSWERED, "result": '{"type":"tool_result","output":"refunded"}'}
    rewritten = rehashed(
        [
            dataclasses.replace(e, content_sha256=content_sha256(forged)) if n else e
            for n, e in enumerate(events)
        ]
    )

    assert check_trail(rewritten, "submitted", forged) is None
    found = check_trail(rewritten, "submitted", forged, key=SECRET)

    assert found is not None
    assert (found.kind, found.event_id) == (BreakKind.FORGED, 20)
    assert "event 20 (transition running -> succeeded at" in found.message
    assert "or the call's stored result, error_stage, error_detail (which it wrote)" in found.message


def test_keyed__an_edited_or_forged_event_with_hashes_recomputed__fails_keyed_only() -> None:
    events = chained_v2(key=SECRET)
    edited = rehashed(
        [e if n != 2 else dataclasses.replace(e, reason="all fine") for n, e in enumerate(events)]
    )
    copied = dataclasses.replace(events[2], id=35, kind="flag", reason="refund approved")
    inserted = rehashed([*events[:3], copied, *events[3:]])

    for tampered, event_id in ((edited, 30), (inserted, 35)):
        assert check_trail(tampered, "submitted", ANSWERED) is None
        found = check_trail(tampered, "submitted", ANSWERED, key=SECRET)
        assert found is not None
        assert (found.kind, found.event_id) == (BreakKind.FORGED, event_id)


def test_keyed__a_mac_removed__or_content_no_keyed_event_wrote__or_another_key() -> None:
    events = chained_v2(key=SECRET)
    stripped = rehashed(
        [e if n != 3 else dataclasses.replace(e, trail_mac=None) for n, e in enumerate(events)]
    )
    # The outcome's writer deleted, the rest rehashed: the result is nobody's.
    orphaned = rehashed([events[0], *events[2:]])

    unkeyed = check_trail(stripped, "submitted", ANSWERED, key=SECRET)
    nobody = check_keyed(orphaned, ANSWERED, SECRET)
    other = check_trail(events, "submitted", ANSWERED, key=TrailKey(b"o" * 32))

    assert unkeyed is not None
    assert (unkeyed.kind, unkeyed.event_id) == (BreakKind.UNKEYED, 40)
    assert "carries no keyed MAC: it was written before the trail key was set" in unkeyed.message
    assert nobody is not None
    assert (nobody.kind, nobody.event_id) == (BreakKind.FORGED, 50)
    assert "stored result, error_stage, error_detail were written by no event the trail key" in nobody.message
    assert other is not None
    assert (other.kind, other.event_id) == (BreakKind.FORGED, 10)


def test_trail_key__hidden_from_repr__at_least_32_bytes__parts_whole_or_refused() -> None:
    assert "kkkk" not in repr(SECRET)
    with pytest.raises(ValueError, match="at least 32 bytes"):
        TrailKey(b"short")
    assert SECRET.mac(mac_values(chained(LIFE)[0]), {}).startswith(":")
    assert SECRET.mac(mac_values(chained(LIFE)[0]), OUTCOME).startswith("outcome:")
    with pytest.raises(ValueError, match="of the call's outcome, not all of"):
        SECRET.mac(mac_values(chained(LIFE)[0]), {"result": "x"})
    assert parts_written(["result", "error_stage", "error_detail", "finished_at"]) == ("outcome",)
    assert "kind 10:transition\nto_status 7:running\n" in mac_text(mac_values(chained(LIFE)[0]), {})
