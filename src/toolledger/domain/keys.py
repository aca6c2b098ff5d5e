"""A call's identity, its idempotency key, and the fingerprint of its arguments."""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from typing import Any

from toolledger.domain.redaction import DEFAULT_REDACTOR, Redactor

_SEPARATOR = "\x1f"


@dataclass(frozen=True, order=True)
class CallKey:
    """The natural key of a call: it is unique in the ledger."""

    session_id: str
    turn_id: str
    call_id: str

    def __str__(self) -> str:
        return f"{self.session_id}/{self.turn_id}/{self.call_id}"

    @classmethod
    def parse(cls, text: str) -> CallKey:
        parts = text.split("/")
        if len(parts) != 3 or not all(parts):
            raise ValueError(f"expected SESSION/TURN/CALL, got {text!r}")
        return cls(*parts)

    @property
    def idempotency_key(self) -> str:
        """Stable across crashes and replicas: the same call always gets the same key.

        Handlers pass it downstream (a payment API's idempotency key); submissions of the
        call's result to the Agents API carry it too, so a resubmission is recognised.
        """
        digest = hashlib.sha256(_SEPARATOR.join(self.__dict__.values()).encode()).hexdigest()
        return f"tl_{digest[:48]}"


def canonical_json(value: Any) -> str:
    """One spelling per JSON value: sorted keys, no spaces, no NaN."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def arguments_fingerprint(arguments: Any) -> str:
    """sha256 of the arguments: canonical JSON when they are JSON, else their raw text."""
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except (ValueError, RecursionError):  # not JSON, or nested beyond Python's stack
            return hashlib.sha256(arguments.encode("utf-8", "surrogatepass")).hexdigest()
        arguments = parsed
    return value_fingerprint(arguments)


def value_fingerprint(value: Any) -> str:
    """sha256 of arguments already decoded: their canonical JSON, else their repr."""
    try:
        text = canonical_json(value)
    except (ValueError, RecursionError):
        text = repr(value)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def arguments_text(arguments: Any) -> str:
    """The arguments as stored: a string as received, anything else as canonical JSON."""
    if isinstance(arguments, str):
        return arguments
    try:
        return canonical_json(arguments)
    except ValueError:
        return json.dumps(arguments, default=str)


def is_finite_json(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(is_finite_json(v) for v in value.values())
    if isinstance(value, list):
        return all(is_finite_json(v) for v in value)
    return True


class ArgumentsRefused(ValueError):
    """Arguments a handler must not see; the message is safe to give the model."""


def parse_arguments(text: str, max_bytes: int) -> dict[str, Any]:
    """Strict JSON for a handler: an object, finite numbers, no duplicate keys, no NUL or
    unpaired surrogates, within a size. Raises ArgumentsRefused with a message that never
    echoes the arguments."""
    if len(text.encode("utf-8", "surrogatepass")) > max_bytes:
        raise ArgumentsRefused(f"Invalid arguments: larger than {max_bytes} bytes.")
    try:
        value = json.loads(text, object_pairs_hook=_no_duplicate_keys, parse_constant=_no_constants)
        if not isinstance(value, dict):
            raise ArgumentsRefused("Invalid arguments: expected a JSON object.")
        if not is_finite_json(value):  # 1e999 parses as inf
            raise ArgumentsRefused("Invalid arguments: numbers must be finite.")
    except ArgumentsRefused:
        raise
    except RecursionError:
        raise ArgumentsRefused("Invalid arguments: nested too deeply.") from None
    except ValueError:
        raise ArgumentsRefused("Invalid arguments: expected a JSON object.") from None
    if not _clean_text(value):
        raise ArgumentsRefused("Invalid arguments: text contains a NUL character or an unpaired surrogate.")
    return value


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ArgumentsRefused("Invalid arguments: a key appears twice in one object.")
    return dict(pairs)


def _no_constants(name: str) -> Any:
    raise ArgumentsRefused("Invalid arguments: NaN and Infinity are not JSON.")


_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
"""NUL (no PostgreSQL text holds it) and unpaired surrogates (no UTF-8 spells them)."""


def _clean_text(value: Any) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if _UNSTORABLE.search(item):
                return False
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return True


PREVIEW_CHARS = 512


def refused_arguments_preview(text: str, redactor: Redactor = DEFAULT_REDACTOR) -> str:
    """What is kept of arguments a handler will never see: a redacted head and the size.
    (The fingerprint of the whole text is kept beside it, so a redelivery is still known.)"""
    size = len(text.encode("utf-8", "surrogatepass"))
    head = redactor.text(text[:PREVIEW_CHARS]).encode("utf-8", "backslashreplace").decode("utf-8")
    return f"{head.replace(chr(0), '')}… [refused arguments: {size} bytes, only this preview kept]"
