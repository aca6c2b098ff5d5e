"""The audit trail's hash chain: what an event's hash covers, and how a chain is checked.

Each event of a call carries the hash of the call's previous event (``prev_sha256``; the
first one chains from ``GENESIS_SHA256``) and its own (``sha256``): SHA-256 over the UTF-8
bytes of ``event_text``. Editing, deleting, inserting or reordering an event breaks the
chain where it happened; ``check_trail`` finds the first break of a call's trail and names it.

Each event also carries the digest of the call's stored content as it is right after the
event's write (``content_sha256``: ``content_text`` over ``CONTENT_FIELDS``), and its hash
covers that digest (the text's second version, ``toolledger-trail-v2``; events written
before content digests were kept hash as version 1). A call's row edited after its last
event no longer hashes to the digest that event carries: ``check_trail`` says so.

With a key the database does not hold (``TrailKey``), each event also carries an HMAC
computed by the application over what it writes: the event's own fields and the content it
sets (``mac_text``). Someone who can write the database can recompute every unkeyed hash, not
these (``check_keyed``).

This module is the one definition of the encodings. The databases compute the same texts when
they store an event (``store.chain``: PostgreSQL in SQL, SQLite through functions that call
``event_sha256`` and ``content_sha256``), and a test holds the SQL to them byte for byte.

The encoding, one line per field after a line naming the format::

    toolledger-trail-v2
    prev_sha256 64:<hex>
    session_id 7:sess_ab
    ...
    reason -
    detail -
    content_sha256 64:<hex>
    trail_mac -

A value is ``<length>:<text>`` (the length in Unicode code points, so no character needs
escaping), or ``-`` for NULL. ``at`` is UTC to the microsecond, ``2026-12-07T01:02:03.000004Z``;
``lease_token`` is its decimal digits. Version 1 is the same without its last two lines.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum

from toolledger.domain.keys import CallKey
from toolledger.domain.queries import MAX_FILTER_CHARS, QueryError
from toolledger.domain.records import CallEvent, CallRecord

TRAIL_FORMAT = "toolledger-trail-v1"
"""The first version of an event's text: the events written before content digests were kept."""
TRAIL_FORMAT_V2 = "toolledger-trail-v2"
"""An event's text with the digest of its call's content and its keyed MAC (either may be
NULL in it); every event the ledger writes now is hashed this way."""
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
"""What a version 1 event's hash covers, in this order: every field it had but its id and hash."""

FIELDS_V2 = (*FIELDS, "content_sha256", "trail_mac")
"""What a version 2 event's hash covers, in this order: every stored field but its id and hash."""

NULL = "-"

CONTENT_FORMAT = "toolledger-content-v1"

CONTENT_PARTS: Mapping[str, tuple[str, ...]] = {
    "request": ("tool_name", "effect_class", "arguments", "arguments_sha256"),
    "approval": ("approved_arguments", "approved_arguments_sha256"),
    "outcome": ("result", "error_stage", "error_detail"),
}
"""The call's content, by the write that sets it, each once in a call's life: what was asked
and how it may run (recorded), what a person let run instead (approved), what it answered
(its outcome: a run's, a settlement's, a denial's). These are what a handler receives, what
decides whether a call is run again, and what the model is sent; nothing else of the row
changes them. The row's other columns are bookkeeping, each change of it told by an event
(status, lease, counters and moments; a heartbeat moves the lease without one) and not
covered: the status is checked against the trail's last status change instead."""

CONTENT_FIELDS = tuple(name for fields in CONTENT_PARTS.values() for name in fields)
"""What a call's content digest covers, in this order (``content_text``)."""

MAC_FORMAT = "toolledger-trail-mac-v1"
MAC_FIELDS = ("session_id", "turn_id", "call_id", "actor", "kind", "to_status", "reason", "detail")
"""The fields of an event its keyed MAC covers: those its writer supplies itself. The others
(``at``, ``from_status``, ``lease_token``, the hashes, the content digest) are the
database's doing in some writes, so the application cannot know them before the write."""

MIN_KEY_BYTES = 32


def canonical_moment(at: datetime) -> str:
    """``at`` as the trail spells it: UTC, to the microsecond (a naive moment is UTC, as the
    ledger stores them on SQLite)."""
    utc = at.replace(tzinfo=UTC) if at.tzinfo is None else at.astimezone(UTC)
    return (
        f"{utc.year:04d}-{utc.month:02d}-{utc.day:02d}T"
        f"{utc.hour:02d}:{utc.minute:02d}:{utc.second:02d}.{utc.microsecond:06d}Z"
    )


def _line(name: str, value: str | int | datetime | None) -> str:
    if value is None:
        return f"{name} {NULL}"
    if isinstance(value, datetime):
        text = canonical_moment(value)
    elif isinstance(value, int):
        text = str(value)
    else:
        text = value
    return f"{name} {len(text)}:{text}"


def is_v2(values: Mapping[str, object]) -> bool:
    """Whether an event hashes as version 2: it carries a content digest or a keyed MAC."""
    return values.get("content_sha256") is not None or values.get("trail_mac") is not None


def event_text(values: Mapping[str, str | int | datetime | None]) -> str:
    """The canonical text of an event: ``values`` holds every name of ``FIELDS`` (and of
    ``FIELDS_V2``, unless both of its own are NULL: then the text is version 1)."""
    if is_v2(values):
        return "\n".join([TRAIL_FORMAT_V2, *(_line(name, values[name]) for name in FIELDS_V2)]) + "\n"
    return "\n".join([TRAIL_FORMAT, *(_line(name, values[name]) for name in FIELDS)]) + "\n"


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
        "content_sha256": event.content_sha256,
        "trail_mac": event.trail_mac,
    }


def content_text(content: Mapping[str, str | None]) -> str:
    """The canonical text of a call's content: ``content`` holds every name of
    ``CONTENT_FIELDS`` (its stored values, as the row holds them)."""
    return "\n".join([CONTENT_FORMAT, *(_line(name, content[name]) for name in CONTENT_FIELDS)]) + "\n"


def content_sha256(content: Mapping[str, str | None]) -> str:
    """The digest of a call's content (hex) that each event of its trail carries."""
    return hashlib.sha256(content_text(content).encode("utf-8")).hexdigest()


def content_of(call: CallRecord) -> dict[str, str | None]:
    """``call``'s content, as ``content_text`` takes it."""
    return {
        "tool_name": call.tool_name,
        "effect_class": call.effect_class.value,
        "arguments": call.arguments,
        "arguments_sha256": call.arguments_sha256,
        "approved_arguments": call.approved_arguments,
        "approved_arguments_sha256": call.approved_arguments_sha256,
        "result": call.result,
        "error_stage": call.error_stage,
        "error_detail": call.error_detail,
    }


def parts_written(columns: Collection[str]) -> tuple[str, ...]:
    """The content parts a write of ``columns`` sets (each whole, or not at all)."""
    parts = []
    for part, fields in CONTENT_PARTS.items():
        written = set(fields) & set(columns)
        if written and written != set(fields):
            raise ValueError(f"a write sets {sorted(written)} of the call's {part}, not all of {fields}")
        if written:
            parts.append(part)
    return tuple(parts)


def mac_text(values: Mapping[str, str | None], written: Mapping[str, str | None]) -> str:
    """What an event's keyed MAC covers: the event's ``MAC_FIELDS`` (``values``), the names
    of the content parts its write set, and their stored values (``written``, every field of
    each part it set)."""
    parts = parts_written(written)
    lines = [MAC_FORMAT, *(_line(name, values[name]) for name in MAC_FIELDS), _line("wrote", ",".join(parts))]
    lines += [_line(name, written[name]) for part in parts for name in CONTENT_PARTS[part]]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class TrailKey:
    """The trail's key (``TOOLLEDGER_TRAIL_KEY``): kept by the application, never written to
    the database. Each event's ``trail_mac`` is ``<parts>:<hex>``: the content parts its
    write set, and HMAC-SHA256 of ``mac_text`` under this key."""

    secret: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if len(self.secret) < MIN_KEY_BYTES:
            raise ValueError(f"the trail key must be at least {MIN_KEY_BYTES} bytes")

    def mac(self, values: Mapping[str, str | None], written: Mapping[str, str | None]) -> str:
        text = mac_text(values, written)
        digest = hmac.new(self.secret, text.encode("utf-8"), hashlib.sha256).hexdigest()
        return f"{','.join(parts_written(written))}:{digest}"


def mac_values(event: CallEvent) -> dict[str, str | None]:
    """``event``'s fields its keyed MAC covers, as ``mac_text`` takes them."""
    return {
        "session_id": event.key.session_id,
        "turn_id": event.key.turn_id,
        "call_id": event.key.call_id,
        "actor": event.actor,
        "kind": event.kind,
        "to_status": event.to_status,
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
    CONTENT = "content"
    """The call's stored content is not what its last event recorded: its row was changed
    outside toolledger after that event (or an event's content digest was erased)."""
    FORGED = "forged"
    """Keyed verification: an event's MAC does not match its fields and the content it wrote,
    or the call holds content no keyed event wrote: changed without the trail key."""
    UNKEYED = "unkeyed"
    """Keyed verification: an event carries no MAC (written before the trail key was set, by a
    process without it, or its MAC was removed)."""


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


def check_trail(
    events: Sequence[CallEvent],
    status: str,
    content: Mapping[str, str | None] | None = None,
    *,
    key: TrailKey | None = None,
) -> TrailBreak | None:
    """The first broken link of a call's trail (its events in id order, the call in
    ``status``, its stored ``content``), or None when every event chains from the one before
    it, each hash is its event's, the last status change is the call's status, and the
    content is what the last event recorded. With ``key``, also ``check_keyed``."""
    if not events:
        return TrailBreak(BreakKind.EMPTY, None, "the call has no events: its whole trail was deleted")
    expected = GENESIS_SHA256
    digested: CallEvent | None = None
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
        if event.content_sha256 is not None:
            digested = event
        elif digested is not None:
            return TrailBreak(
                BreakKind.CONTENT,
                event.id,
                f"event {event.id} ({_named(event)}) carries no digest of the call's content, though "
                f"event {digested.id} before it does: it was written past toolledger, or its digest "
                "was erased and its hash recomputed",
            )
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
    if content is not None and digested is not None:
        stored = content_sha256(content)
        if stored != digested.content_sha256:
            return TrailBreak(
                BreakKind.CONTENT,
                digested.id,
                f"the call's stored content ({', '.join(CONTENT_FIELDS)}) was changed outside "
                f"toolledger after event {digested.id} ({_named(digested)}): it hashes to "
                f"{_short(stored)}, the event recorded {_short(digested.content_sha256)}",
            )
    if key is not None:
        return check_keyed(events, content if content is not None else {}, key)
    return None


def content_covered(events: Sequence[CallEvent]) -> bool:
    """Whether a call's stored content is held to its trail: its last event carries a content
    digest (a call whose events were all written before digests were kept is not)."""
    return bool(events) and events[-1].content_sha256 is not None


def check_keyed(
    events: Sequence[CallEvent], content: Mapping[str, str | None], key: TrailKey
) -> TrailBreak | None:
    """The first event of a call's trail the application's key does not vouch for: one without
    a MAC, or whose MAC does not match its fields and the content it wrote (the call's stored
    values of the parts it names: each part is written once in a call's life); or stored
    content that no event's MAC names (the event that wrote it deleted). Unlike the hashes,
    no one without ``key`` can make these match."""
    writers: dict[str, CallEvent] = {}
    for event in events:
        if event.trail_mac is None:
            return TrailBreak(
                BreakKind.UNKEYED,
                event.id,
                f"event {event.id} ({_named(event)}) carries no keyed MAC: it was written before "
                "the trail key was set, by a process without it, or its MAC was removed",
            )
        named, _, _ = event.trail_mac.partition(":")
        parts = tuple(part for part in named.split(",") if part)
        if any(part not in CONTENT_PARTS for part in parts):
            return _forged(event, parts)
        written = {name: content.get(name) for part in parts for name in CONTENT_PARTS[part]}
        if not hmac.compare_digest(key.mac(mac_values(event), written), event.trail_mac):
            return _forged(event, parts)
        writers.update(dict.fromkeys(parts, event))
    for part, fields in CONTENT_PARTS.items():
        if part not in writers and any(content.get(name) is not None for name in fields):
            return TrailBreak(
                BreakKind.FORGED,
                events[-1].id,
                f"the call's stored {', '.join(fields)} were written by no event the trail key "
                "vouches for: set outside toolledger, or the event that wrote them was deleted",
            )
    return None


def _forged(event: CallEvent, parts: Sequence[str]) -> TrailBreak:
    wrote = [name for part in parts for name in CONTENT_PARTS[part]]
    content = f", or the call's stored {', '.join(wrote)} (which it wrote)" if wrote else ""
    return TrailBreak(
        BreakKind.FORGED,
        event.id,
        f"event {event.id} ({_named(event)}) does not match its keyed MAC: its "
        f"{', '.join(MAC_FIELDS[3:])}{content} were changed, or it was written, without the trail key",
    )


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
    "CONTENT_FIELDS",
    "CONTENT_FORMAT",
    "CONTENT_PARTS",
    "FIELDS",
    "FIELDS_V2",
    "GENESIS_SHA256",
    "MAC_FIELDS",
    "MAC_FORMAT",
    "MIN_KEY_BYTES",
    "NULL",
    "TRAIL_FORMAT",
    "TRAIL_FORMAT_V2",
    "BreakKind",
    "TrailBreak",
    "TrailHead",
    "TrailKey",
    "TrailScope",
    "canonical_moment",
    "check_anchor",
    "check_keyed",
    "check_trail",
    "content_covered",
    "content_of",
    "content_sha256",
    "content_text",
    "event_sha256",
    "event_text",
    "event_values",
    "is_v2",
    "mac_text",
    "mac_values",
    "parts_written",
    "recomputed_sha256",
    "trail_head",
]
