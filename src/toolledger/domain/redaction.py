"""Masking secrets before anything is logged, shown or exported."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

DEFAULT_SECRET_FIELDS = frozenset(
    {"password", "secret", "token", "api_key", "authorization", "card_number", "cvv", "ssn"}
)
MASK = "[REDACTED]"
SHORTEST_LITERAL = 6
"""A configured secret shorter than this is not searched for in text (it would mask words)."""

# Shapes of credentials that can appear in free text (exception messages, tracebacks).
_SECRET_PATTERNS = [
    # A left boundary, so "task-2024..." or "disk-usage-..." are left alone.
    re.compile(r"(?<![A-Za-z0-9])sk-[A-Za-z0-9_\-]{8,}"),
    re.compile(r"(?i)bearer\s+[A-Za-z0-9._\-~+/]{8,}=*"),
    re.compile(r"AKIA[0-9A-Z]{12,}"),
    # The password of any URL (postgresql://, mysql://, redis://, amqp://...). The user part
    # excludes ':' '/' '@' so a long run of look-alikes cannot make the match backtrack.
    re.compile(r"(\b[A-Za-z][A-Za-z0-9+.\-]*://[^:/@\s]+:)[^@/\s]+(@)"),
]


class Redactor:
    """Masks credentials by shape, the values of secret-named fields quoted in text, and the
    configured secrets themselves (an API key of no known shape, say)."""

    def __init__(
        self, secret_fields: Iterable[str] = DEFAULT_SECRET_FIELDS, secrets: Iterable[str] = ()
    ) -> None:
        self.secret_fields = frozenset(f.lower() for f in secret_fields)
        self._literals = sorted(
            {s for s in secrets if s and len(s) >= SHORTEST_LITERAL}, key=len, reverse=True
        )
        names = "|".join(re.escape(f) for f in sorted(self.secret_fields, key=len, reverse=True))
        # password=..., 'password': '...', "api_key": "...", password: ... (in reprs, logs, URLs).
        self._fields = (
            re.compile(
                rf"""(?i)((?:[\w-]*(?:{names})[\w-]*)["']?\s*[:=]\s*["']?)(?!\[REDACTED\])([^"'\s,&;}}\])]+)"""
            )
            if names
            else None
        )

    def text(self, text: str) -> str:
        for literal in self._literals:
            text = text.replace(literal, MASK)
        for pattern in _SECRET_PATTERNS:
            if pattern.groups == 2:
                text = pattern.sub(lambda m: f"{m.group(1)}{MASK}{m.group(2)}", text)
            else:
                text = pattern.sub(MASK, text)
        if self._fields is not None:
            text = self._fields.sub(lambda m: f"{m.group(1)}{MASK}", text)
        return text

    def value(self, value: Any) -> Any:
        """A copy of ``value`` with secret-named fields masked, and credentials in text masked."""
        if isinstance(value, Mapping):
            return {
                key: MASK if isinstance(key, str) and self.is_secret(key) else self.value(item)
                for key, item in value.items()
            }
        if isinstance(value, list | tuple):
            return [self.value(item) for item in value]
        if isinstance(value, str):
            return self.text(value)
        return value

    def is_secret(self, name: str) -> bool:
        lowered = name.lower()
        return any(field in lowered for field in self.secret_fields)


DEFAULT_REDACTOR = Redactor()


def redact(value: Any, secret_fields: Iterable[str] = DEFAULT_SECRET_FIELDS) -> Any:
    """A copy of ``value`` with secret-named fields masked, and credentials in text masked."""
    redactor = (
        DEFAULT_REDACTOR if frozenset(secret_fields) == DEFAULT_SECRET_FIELDS else Redactor(secret_fields)
    )
    return redactor.value(value)


def redact_text(text: str) -> str:
    return DEFAULT_REDACTOR.text(text)
