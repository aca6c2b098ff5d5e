"""The audit trail's hash chain: what an event's hash covers, and how a chain is checked.

Each event of a call carries the hash of the call's previous event (``prev_sha256``; the
first one chains from ``GENESIS_SHA256``) and its own (``sha256``): SHA-256 over the UTF-8
bytes of ``event_text``. Editing, deleting, inserting or reordering an event breaks the
chain where it happened; ``check_trail`` finds the first break of a call's trail and names it.

This module is the one definition of the encoding. The databases compute the same text when
they store an event (``store.trail``: PostgreSQL in SQL, SQLite through a function that calls
``event_sha256``), and a test holds the SQL to it byte for byte.

The encoding, one line per field after a line naming the format::

    toolledger-trail-v1
    prev_sha256 64:<hex>
    session_id 7:sess_ab
    ...
    reason -

A value is ``<length>:<text>`` (the length in Unicode code points, so no character needs
escaping), or ``-`` for NULL. ``at`` is UTC to the microsecond, ``2026-12-07T01:02:03.000004Z``;
``lease_token`` is its decimal digits.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum

from toolledger.domain.keys import CallKey
from toolledger.domain.queries import MAX_FILTER_CHARS, QueryError
from toolledger.domain.records import CallEvent

TRAIL_FORMAT = "toolledger-trail-v1"
GENESIS_SHA256 = "0" * 64
"""What a call's first event chains from."""

FIELDS = (
    "prev_sha256",
    "session_id",
    "turn_id",
    "call_id",
    "at",
    "actor",
    "kind",
    "from_status",
    "to_status",
    "lease_token",
    "reason",
    "detail",
)
"""What an event's hash covers, in this order: every stored field but its id and its hash."""

NULL = "-"


def canonical_moment(at: datetime) -> str:
    """``at`` as the trail spells it: UTC, to the microsecond (a naive moment is UTC, as the
    ledger stores them on SQLite)."""
    utc = at.replace(tzinfo=UTC) if at.tzinfo is None else at.astimezone(UTC)
    return (
        f"{utc.year:04d}-{utc.month:02d}-{utc.day:02d}T"
        f"{utc.hour:02d}:{utc.minute:02d}:{utc.second:02d}.{utc.microsecond:06d}Z"
    )


def event_text(values: Mapping[str, str | int | datetime | None]) -> str:
    """The canonical text of an event: ``values`` holds every name of ``FIELDS``."""
    lines = [TRAIL_FORMAT]
    for name in FIELDS:
        value = values[name]
        if value is None:
            lines.append(f"{name} {NULL}")
            continue
        if isinstance(value, datetime):
            text = canonical_moment(value)
        elif isinstance(value, int):
            text = str(value)
        else:
            text = value
        lines.append(f"{name} {len(text)}:{text}")
    return "\n".join(lines) + "\n"


def event_sha256(values: Mapping[str, str | int | datetime | None]) -> str:
    """The hash an event carries (hex): SHA-256 of its canonical text."""
    return hashlib.sha256(event_text(values).encode("utf-8")).hexdigest()


def event_values(event: CallEvent, prev_sha256: str | None) -> dict[str, str | int | datetime | None]:
    """``event`` as ``event_text`` takes it, chained from ``prev_sha256``."""
    return {
        "prev_sha256": prev_sha256,
        "session_id": event.key.session_id,
        "turn_id": event.key.turn_id,
        "call_id": event.key.call_id,
        "at": event.at,
        "actor": event.actor,
        "kind": event.kind,
        "from_status": event.from_status,
        "to_status": event.to_status,
        "lease_token": event.lease_token,
        "reason": event.reason,
        "detail": event.detail,
    }


def recomputed_sha256(event: CallEvent) -> str:
    """What ``event``'s hash must be, given the hash it says it follows."""
    return event_sha256(event_values(event, event.prev_sha256))


class BreakKind(StrEnum):
    """What a broken link looks like: what most likely happened to the trail there."""

    EDITED = "edited"
    """The event's stored fields (or its hash) are not what was hashed when it was written."""
    DELETED = "deleted"
    """The event chains from a hash no event of the call has: the one before it is gone."""
    INSERTED = "inserted"
    """Events sit in the trail that the chain does not go through."""
    REORDERED = "reordered"
    """An event chains from one that now comes after it."""
    UNCHAINED = "unchained"
    """An event carries no hash at all: written past the trail's trigger."""
    TRUNCATED = "truncated"
    """The trail stops short of the call's status: events at its end are gone."""
    EMPTY = "empty"
    """The call has no event at all."""
    REWRITTEN = "rewritten"
    """The chain holds, but not through the head an export recorded: rewritten since, hashes
    and all."""


@dataclass(frozen=True)
class TrailBreak:
    """The first broken link of one call's trail."""

    kind: BreakKind
    event_id: int | None
    """The event where the chain breaks (None: the trail has no event to name)."""
    message: str


@dataclass(frozen=True)
class TrailHead:
    """Where a call's trail stands: how many events, and the hash of the last one."""

    events: int
    sha256: str | None


@dataclass(frozen=True)
class TrailScope:
    """Whose trails to verify: one call, one session's calls, or (neither) every call."""

    key: CallKey | None = None
    session_id: str | None = None

    def __post_init__(self) -> None:
        if self.key is not None and self.session_id is not None:
            raise QueryError("verify one call or one session, not both")
        session = self.session_id
        if session is not None and (not session or len(session) > MAX_FILTER_CHARS or "\x00" in session):
            raise QueryError(f"a session id is 1 to {MAX_FILTER_CHARS} characters, without NUL")

    def __str__(self) -> str:
        if self.key is not None:
            return f"call {self.key}"
        return "the whole ledger" if self.session_id is None else f"session {self.session_id}"


def trail_head(events: Sequence[CallEvent]) -> TrailHead:
    return TrailHead(len(events), events[-1].sha256 if events else None)


def check_trail(events: Sequence[CallEvent], status: str) -> TrailBreak | None:
    """The first broken link of a call's trail (its events in id order, the call in
    ``status``), or None when every event chains from the one before it, each hash is its
    event's, and the last status change is the call's status."""
    if not events:
        return TrailBreak(BreakKind.EMPTY, None, "the call has no events: its whole trail was deleted")
    expected = GENESIS_SHA256
    for index, event in enumerate(events):
        if event.sha256 is None or event.prev_sha256 is None:
            return TrailBreak(
                BreakKind.UNCHAINED,
                event.id,
                f"event {event.id} ({_named(event)}) carries no hash: it was written past the trail's "
                "trigger (a direct INSERT with triggers off), or its hash was erased",
            )
        if recomputed_sha256(event) != event.sha256:
            return TrailBreak(
                BreakKind.EDITED,
                event.id,
                f"event {event.id} ({_named(event)}) was edited: its stored fields do not hash to the "
                f"hash it carries ({_short(event.sha256)})",
            )
        if event.prev_sha256 != expected:
            return _misplaced(events, index, expected)
        expected = event.sha256
    changed = next((e for e in reversed(events) if e.to_status is not None), None)
    if changed is None or changed.to_status != status:
        said = "no status change" if changed is None else f"its last status change to {changed.to_status}"
        return TrailBreak(
            BreakKind.TRUNCATED,
            events[-1].id,
            f"the trail (last event {events[-1].id}) ends at {said}, but the call is {status}: "
            "events at its end were deleted, or the call's row was edited",
        )
    return None


def check_anchor(events: Sequence[CallEvent], exported: TrailHead) -> TrailBreak | None:
    """A call's trail as stored now (its chain checked intact) against the head an earlier
    export recorded: the trail may have grown since, but what was exported must still be its
    beginning. A chain can be rebuilt, every hash recomputed; an anchor kept elsewhere cannot."""
    if len(events) < exported.events:
        return TrailBreak(
            BreakKind.TRUNCATED,
            events[-1].id if events else None,
            f"the call has {len(events)} event(s), the export saw {exported.events}: events were "
            "deleted since",
        )
    if exported.events == 0:
        return None
    anchor = events[exported.events - 1]
    if anchor.sha256 != exported.sha256:
        return TrailBreak(
            BreakKind.REWRITTEN,
            anchor.id,
            f"event {anchor.id} ({_named(anchor)}), the last one exported, hashes to "
            f"{_short(anchor.sha256)} but the export recorded {_short(exported.sha256)}: the trail "
            "was rewritten since the export, its hashes recomputed",
        )
    return None


def _misplaced(events: Sequence[CallEvent], index: int, expected: str) -> TrailBreak:
    """Event ``index`` does not chain from the one before it (whose hash is ``expected``):
    what the hashes around it say happened."""
    event = events[index]
    before = f"event {events[index - 1].id}" if index else "the start of the trail"
    hashes = {e.sha256: position for position, e in enumerate(events)}
    hashes.setdefault(GENESIS_SHA256, -1)
    chained_from = hashes.get(event.prev_sha256) if event.prev_sha256 is not None else None
    if chained_from is not None and chained_from > index:
        return TrailBreak(
            BreakKind.REORDERED,
            event.id,
            f"event {event.id} ({_named(event)}) chains from event {events[chained_from].id}, which "
            "now comes after it: events were reordered",
        )
    resumes = next((j for j in range(index + 1, len(events)) if events[j].prev_sha256 == expected), None)
    if resumes is not None:
        stray = events[index:resumes]
        return TrailBreak(
            BreakKind.INSERTED,
            event.id,
            f"{_listed(stray)} {'is' if len(stray) == 1 else 'are'} not in the chain: inserted after "
            f"{before} (event {events[resumes].id} chains from {before})",
        )
    if chained_from is not None and chained_from < index - 1:
        # Event ``index`` chains from an earlier one: two branches leave it. The shorter one
        # is taken for the inserted events (the other explanation is said too).
        skipped, rest = events[chained_from + 1 : index], events[index:]
        follows = f"event {events[chained_from].id}" if chained_from >= 0 else "the start of the trail"
        if len(rest) < len(skipped):
            return TrailBreak(
                BreakKind.INSERTED,
                event.id,
                f"{_listed(rest)} {'chains' if len(rest) == 1 else 'chain'} from {follows}, not from "
                f"{before}: inserted at the end of the trail as a second branch (or "
                f"{_listed(skipped)} were)",
            )
        return TrailBreak(
            BreakKind.INSERTED,
            skipped[0].id,
            f"{_listed(skipped)} {'is' if len(skipped) == 1 else 'are'} not in the chain: inserted after "
            f"{follows} (event {event.id} chains from {follows})",
        )
    return TrailBreak(
        BreakKind.DELETED,
        event.id,
        f"event {event.id} ({_named(event)}) chains from {_short(event.prev_sha256)}, which no event of "
        f"the call has: an event between {before} and it was deleted (or {before} was rewritten, "
        "hash and all)",
    )


def _named(event: CallEvent) -> str:
    change = f" {event.from_status or 'new'} -> {event.to_status}" if event.to_status else ""
    return f"{event.kind}{change} at {canonical_moment(event.at)}"


def _listed(events: Sequence[CallEvent]) -> str:
    if len(events) == 1:
        return f"event {events[0].id} ({_named(events[0])})"
    return "events " + ", ".join(str(e.id) for e in events)


def _short(sha256: str | None) -> str:
    return "no hash" if sha256 is None else f"{sha256[:12]}…"


__all__ = [
    "FIELDS",
    "GENESIS_SHA256",
    "NULL",
    "TRAIL_FORMAT",
    "BreakKind",
    "TrailBreak",
    "TrailHead",
    "TrailScope",
    "canonical_moment",
    "check_anchor",
    "check_trail",
    "event_sha256",
    "event_text",
    "event_values",
    "recomputed_sha256",
    "trail_head",
]
