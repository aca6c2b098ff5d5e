"""A delivered call: a ``function_call`` entry of a session's ``required_actions``, read once.

The entry arrives as the SDK's object (or, through the Python API, a mapping). It is turned
into one value at the edge, so its key is built, and its arguments decoded and fingerprinted,
in one place; everything further in is handed that value.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from toolledger.domain.keys import (
    ArgumentsRefused,
    CallKey,
    arguments_fingerprint,
    arguments_text,
    parse_arguments,
    value_fingerprint,
)


def delivered_key(session_id: str, action: Any) -> CallKey:
    """The key of a ``function_call`` entry (an SDK object or a mapping), without reading its
    arguments: cheap enough to tell a repeated announcement from a new one."""
    if isinstance(action, DeliveredCall):
        return action.key
    return CallKey(session_id, str(_field(action, "turn_id")), str(_field(action, "call_id")))


@dataclass(frozen=True)
class DeliveredCall:
    key: CallKey
    tool_name: str
    text: str
    """The arguments as stored: the text as received (anything else as canonical JSON)."""
    fingerprint: str
    """sha256 of the arguments (``arguments_fingerprint``): a redelivery with other arguments
    is told by it."""
    arguments: dict[str, Any] | None
    """What the handler gets; None when refused."""
    refused: ArgumentsRefused | None
    """Why no handler may see these arguments (its message is safe to give the model)."""

    @classmethod
    def parse(cls, session_id: str, action: Any, max_arguments_bytes: int) -> DeliveredCall:
        """Read a ``function_call`` entry; a DeliveredCall is returned as it is."""
        if isinstance(action, DeliveredCall):
            return action
        raw = _field(action, "arguments")
        text = arguments_text(raw)
        try:
            arguments: dict[str, Any] | None = parse_arguments(text, max_arguments_bytes)
            refused: ArgumentsRefused | None = None
        except ArgumentsRefused as error:
            arguments, refused = None, error
        return cls(
            key=delivered_key(session_id, action),
            tool_name=str(_field(action, "name")),
            text=text,
            fingerprint=_fingerprint(raw, arguments),
            arguments=arguments,
            refused=refused,
        )


def _fingerprint(raw: Any, arguments: dict[str, Any] | None) -> str:
    """The fingerprint from the value decoded already: for arguments a handler may see, the
    lenient decoding ``arguments_fingerprint`` does gives the same object as the strict one."""
    return arguments_fingerprint(raw) if arguments is None else value_fingerprint(arguments)


def _field(action: Any, name: str) -> Any:
    if isinstance(action, Mapping):
        return action[name] if name != "arguments" else action.get(name)
    return getattr(action, name)
