"""Masking secrets before anything is logged, shown or exported."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

DEFAULT_SECRET_FIELDS = frozenset(
    {"password", "secret", "token", "api_key", "authorization", "card_number", "cvv", "ssn"}
)
MASK = "[REDACTED]"

# Shapes of credentials that can appear in free text (exception messages, tracebacks).
_SECRET_PATTERNS = [
    re.compile(r"sk-[A-Za-z0-9_\-]{8,}"),
    re.compile(r"(?i)bearer\s+[A-Za-z0-9._\-~+/]{8,}=*"),
    re.compile(r"AKIA[0-9A-Z]{12,}"),
    re.compile(r"(?i)(postgres(?:ql)?(?:\+\w+)?://[^:/\s]+:)[^@\s]+(@)"),
]


def _is_secret(name: str, secret_fields: Iterable[str]) -> bool:
    lowered = name.lower()
    return any(field in lowered for field in secret_fields)


def redact(value: Any, secret_fields: Iterable[str] = DEFAULT_SECRET_FIELDS) -> Any:
    """A copy of ``value`` with secret-named fields masked, and credentials in text masked."""
    fields = frozenset(f.lower() for f in secret_fields)
    if isinstance(value, Mapping):
        return {
            key: MASK if isinstance(key, str) and _is_secret(key, fields) else redact(item, fields)
            for key, item in value.items()
        }
    if isinstance(value, list | tuple):
        return [redact(item, fields) for item in value]
    if isinstance(value, str):
        return redact_text(value)
    return value


def redact_text(text: str) -> str:
    for pattern in _SECRET_PATTERNS:
        if pattern.groups == 2:
            text = pattern.sub(lambda m: f"{m.group(1)}{MASK}{m.group(2)}", text)
        else:
            text = pattern.sub(MASK, text)
    return text
