"""A call's identity, its idempotency key, and the fingerprint of its arguments."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

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
        except ValueError:
            return hashlib.sha256(arguments.encode("utf-8", "surrogatepass")).hexdigest()
        arguments = parsed
    try:
        text = canonical_json(arguments)
    except ValueError:
        text = repr(arguments)
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
