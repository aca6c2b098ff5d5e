"""What an audit query asks for: filters, order, page; and how a call is referred to.

Pure values: the CLI and the HTTP API parse user input into these, the store turns them
into SQL (bound parameters only), so both faces accept and refuse exactly the same things.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import TypeVar

from toolledger.domain.keys import CallKey
from toolledger.domain.states import CallStatus, EffectClass

E = TypeVar("E", bound=StrEnum)

MAX_PAGE = 500
"""Largest page one list request returns (exports stream instead)."""
DEFAULT_PAGE = 50
MAX_FILTER_CHARS = 255
"""Ids and names are at most 255 characters in the ledger: a longer filter matches nothing."""
MAX_TEXT_CHARS = 200
_MAX_CURSOR_JSON = 4 * (MAX_FILTER_CHARS * 12 + 2) + 5
MAX_CURSOR_CHARS = 4 * -(-_MAX_CURSOR_JSON // 3)
"""The longest cursor ``Cursor.encode`` can make: a JSON array of four strings of at most 255
characters, each escaped to at most 12 (a surrogate pair), in base64."""
MAX_TIME_CHARS = 64
"""Longer than any ISO 8601 time or duration: refused before it is parsed."""
MAX_DURATION_DIGITS = 6


class QueryError(ValueError):
    """A filter, sort, cursor or reference the user gave cannot be used; the message says why."""


class Outcome(StrEnum):
    """How a call ended, once it has a result: kept after its submission, when the status
    says only ``submitted``."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"


def outcome_of(result: str | None, error_stage: str | None) -> Outcome | None:
    """A call's outcome from its stored columns: none without a result; a failure result is
    the one with an error stage (``failed()`` always sets one, ``succeeded()`` never does)."""
    if result is None:
        return None
    return Outcome.FAILED if error_stage is not None else Outcome.SUCCEEDED


MIN_PREFIX_HEX = 4
"""The shortest idempotency-key prefix `show` accepts (tl_ and 4 hex digits: 65,536 values)."""


class SortKey(StrEnum):
    CREATED = "created"
    FINISHED = "finished"
    TOOL = "tool"
    STATUS = "status"


@dataclass(frozen=True)
class Cursor:
    """Where the previous page ended: the sort value and the key of its last call."""

    value: str | None
    key: CallKey

    def encode(self) -> str:
        raw = json.dumps([self.value, *self.key.__dict__.values()], separators=(",", ":"))
        return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")

    @classmethod
    def decode(cls, text: str) -> Cursor:
        """The cursor ``encode`` made, or QueryError: a cursor is opaque, and anything else
        (hand-made, edited, truncated) is refused before it reaches a parser's recursion, the
        driver's text encoding or a query."""
        try:
            if len(text) > MAX_CURSOR_CHARS:
                raise ValueError
            padded = text + "=" * (-len(text) % 4)
            value, *key = json.loads(base64.urlsafe_b64decode(padded.encode("ascii")))
            if not (value is None or isinstance(value, str)) or len(key) != 3:
                raise ValueError
            if not all(isinstance(part, str) for part in key):
                raise ValueError
            for part in (value or "", *key):
                # PostgreSQL refuses NUL, and a lone surrogate is not text any driver can send.
                if "\x00" in part or len(part) > MAX_FILTER_CHARS:
                    raise ValueError
                part.encode("utf-8")
            cursor = cls(value, CallKey(*key))
            # base64 decoding skips characters outside its alphabet and JSON has many
            # spellings of one value: only the server's own spelling is a cursor.
            if cursor.encode() != text.rstrip("="):
                raise ValueError
            return cursor
        except (ValueError, TypeError, UnicodeError, RecursionError, binascii.Error) as error:
            raise QueryError("invalid cursor: pass the next_cursor of a previous page unchanged") from error


@dataclass(frozen=True)
class CallQuery:
    """Which calls, in which order, how many. Every filter is optional; all must hold."""

    session_id: str | None = None
    turn_id: str | None = None
    tool_names: tuple[str, ...] = ()
    statuses: tuple[CallStatus, ...] = ()
    outcomes: tuple[Outcome, ...] = ()
    """Succeeded or failed: calls with a result of that kind, submitted or not."""
    effect_classes: tuple[EffectClass, ...] = ()
    since: datetime | None = None
    """Recorded at or after (created_at)."""
    until: datetime | None = None
    """Recorded before."""
    text: str | None = None
    """Substring of the tool name, session, turn or call id (case-insensitive)."""
    sort: SortKey = SortKey.CREATED
    descending: bool = True
    limit: int = DEFAULT_PAGE
    cursor: Cursor | None = field(default=None)

    def __post_init__(self) -> None:
        if not 1 <= self.limit <= MAX_PAGE:
            raise QueryError(f"limit must be between 1 and {MAX_PAGE}, got {self.limit}")
        for name in ("session_id", "turn_id"):
            value = getattr(self, name)
            if value is not None and (not value or len(value) > MAX_FILTER_CHARS):
                raise QueryError(f"{name} must be 1 to {MAX_FILTER_CHARS} characters")
        if any(not name or len(name) > MAX_FILTER_CHARS for name in self.tool_names):
            raise QueryError(f"tool names must be 1 to {MAX_FILTER_CHARS} characters")
        if self.text is not None and (not self.text or len(self.text) > MAX_TEXT_CHARS):
            raise QueryError(f"search text must be 1 to {MAX_TEXT_CHARS} characters")
        for name in ("since", "until"):
            moment = getattr(self, name)
            if moment is not None:
                # One zone for every moment a query holds (the store writes any zone as UTC
                # itself): naive and aware moments could not be compared below, and a moment
                # that UTC cannot represent is the user's error, not a crash in the store.
                try:
                    utc = moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
                except OverflowError:
                    raise QueryError(f"{name} is out of range") from None
                object.__setattr__(self, name, utc)
        if self.since and self.until and self.since >= self.until:
            raise QueryError("since must be earlier than until")
        for text in (self.session_id, self.turn_id, self.text, *self.tool_names):
            if text is not None and "\x00" in text:
                raise QueryError("filters cannot contain NUL characters")

    def next_page(self, cursor: Cursor) -> CallQuery:
        return replace(self, cursor=cursor)


def parse_statuses(values: list[str] | tuple[str, ...]) -> tuple[CallStatus, ...]:
    return tuple(_member(CallStatus, v, "status") for v in _split(values))


def parse_outcomes(values: list[str] | tuple[str, ...]) -> tuple[Outcome, ...]:
    return tuple(_member(Outcome, v, "outcome") for v in _split(values))


def parse_effect_classes(values: list[str] | tuple[str, ...]) -> tuple[EffectClass, ...]:
    return tuple(_member(EffectClass, v, "effect class") for v in _split(values))


def parse_sort(text: str) -> tuple[SortKey, bool]:
    """``created`` (ascending), ``-created`` (descending)."""
    descending = text.startswith("-")
    name = text[1:] if descending else text
    return _member(SortKey, name, "sort key"), descending


_DURATION = re.compile(r"^\s*([0-9]+)\s*(s|m|h|d|w)\s*$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> timedelta:
    """``90d``, ``12h``, ``30m``, ``45s``, ``2w``."""
    match = _DURATION.match(text)
    if match is None:
        raise QueryError(f"invalid duration {_quoted(text)}: use a number and a unit, like 90d, 12h, 30m")
    # int() refuses more than 4,300 digits with a ValueError of its own: count them first.
    digits = match.group(1).lstrip("0") or "0"
    if len(digits) > MAX_DURATION_DIGITS or int(digits) > 100_000:
        raise QueryError(f"duration {_quoted(text)} is too long")
    return timedelta(seconds=int(digits) * _UNITS[match.group(2)])


def parse_moment(text: str, now: datetime) -> datetime:
    """An ISO 8601 time (UTC unless it says otherwise), or a duration meaning that long ago."""
    usage = "use ISO 8601 (2026-12-01T09:00:00Z) or a duration ago (24h)"
    if len(text) > MAX_TIME_CHARS:
        raise QueryError(f"time {_quoted(text)} is too long: {usage}")
    if _DURATION.match(text) is not None:
        return now - parse_duration(text)
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise QueryError(f"invalid time {_quoted(text)}: {usage}") from None
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)


@dataclass(frozen=True)
class CallReference:
    """How a user names a call: its key, its idempotency key (or a unique prefix), or its id."""

    key: CallKey | None = None
    idempotency_prefix: str | None = None
    call_id: str | None = None

    @classmethod
    def parse(cls, text: str) -> CallReference:
        text = text.strip()
        if not text or len(text) > 3 * MAX_FILTER_CHARS + 2 or "\x00" in text:
            raise QueryError("a call is named by SESSION/TURN/CALL, its tl_ key, or its call id")
        if "/" in text:
            try:
                return cls(key=CallKey.parse(text))
            except ValueError as error:
                raise QueryError(str(error)) from None
        if re.fullmatch(rf"tl_[0-9a-f]{{{MIN_PREFIX_HEX},48}}", text):
            return cls(idempotency_prefix=text)
        if re.fullmatch(r"tl_[0-9a-f]{0,3}", text):
            # No call id looks like this: it is a prefix too short to name anything useful.
            raise QueryError(f"an id prefix needs at least {MIN_PREFIX_HEX} hex digits after tl_")
        if len(text) > MAX_FILTER_CHARS:
            raise QueryError(f"a call id is at most {MAX_FILTER_CHARS} characters")
        return cls(call_id=text)


def _quoted(text: str) -> str:
    """The value as typed, in a message: shortened, so a 10 KB filter is not echoed whole."""
    return repr(text) if len(text) <= MAX_TIME_CHARS else repr(text[:MAX_TIME_CHARS]) + "..."


def _split(values: list[str] | tuple[str, ...]) -> list[str]:
    """Repeated options and comma-separated lists both work: ``--status a,b --status c``."""
    return [part.strip() for value in values for part in value.split(",") if part.strip()]


def _member(enum: type[E], value: str, what: str) -> E:
    try:
        return enum(value.strip().lower())
    except ValueError:
        choices = ", ".join(member.value for member in enum)
        raise QueryError(f"unknown {what} {value!r}: choose from {choices}") from None
