"""Masking secrets before anything is logged, shown or exported."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterable, Mapping
from typing import Any

DEFAULT_SECRET_FIELDS = frozenset(
    {"password", "secret", "token", "api_key", "authorization", "card_number", "cvv", "ssn"}
)
MASK = "[REDACTED]"
SHORTEST_LITERAL = 6
"""A configured secret shorter than this is not searched for in text (it would mask words)."""
SHORTEST_CALL_VALUE = 3
"""A call's own secret-field value shorter than this is not searched for in its text; one
shorter than SHORTEST_LITERAL only as a whole word (a cvv's 3 digits, a PIN's 4: not inside
a longer number or word)."""
MAX_CALL_VALUES = 256
"""The values of one call searched for: the first this many secret-field values found."""
LITERAL_FRAGMENT = 12
"""A configured secret at least twice this long is also masked where only its head or its
tail is left (a repr cut short in the middle): from this many of its first or last
characters on, as far as the text goes on matching it."""

# Shapes of credentials that can appear in free text (exception messages, tracebacks).
_SECRET_PATTERNS = [
    # A left boundary, so "task-2024..." or "disk-usage-..." are left alone; a line break or
    # tab escaped in a repr ("...\\nsk-...") is a boundary too.
    # A repr cut short in the middle ("sk-proj-abc...xyz", as pydantic shows a long input)
    # keeps the key's tail after the dots: masked with it.
    re.compile(r"(?:(?<![A-Za-z0-9])|(?<=\\[ntr]))sk-[A-Za-z0-9_\-]{8,}(?:\.\.\.[A-Za-z0-9_\-]+)?"),
    re.compile(r"(?i)bearer\s+[A-Za-z0-9._\-~+/]{8,}=*"),
    re.compile(r"AKIA[0-9A-Z]{12,}"),
    # The password of any URL (postgresql://, mysql://, redis://, amqp://...), with or without
    # a user name (redis://:password@host). Anchored on "://" itself: a scheme matched from
    # every position of a long dotted word made the search quadratic. The user part excludes
    # ':' '/' '@' so a long run of look-alikes cannot make the match backtrack.
    re.compile(r"(://[^:/@\s]*:)[^@/\s]+(@)"),
]

# The value after a secret-named field: a quoted string to its closing quote (spaces and
# commas included: "4111 1111 1111 1111"), the same inside an encoded string (\"...\" in JSON
# held by JSON, \\'...\\' in the repr of a repr: up to 8 backslashes), a bytes repr (b'...'),
# or a bare word (which ends at a line break escaped in a repr, "\\n", as at a real one), with
# the scheme of an Authorization value ("Basic <credentials>") taken along. An unterminated
# quoted value is masked to the end of its line.
_ESCAPED_QUOTE = r"""\\{1,8}["']"""
_FIELD_VALUE = (
    r"""(?:(?P<dq>[bB]?")(?:[^"\\\n]|\\.)*(?P<dqc>"?)"""
    r"""|(?P<sq>[bB]?')(?:[^'\\\n]|\\.)*(?P<sqc>'?)"""
    rf"""|(?P<eq>{_ESCAPED_QUOTE})(?:(?!{_ESCAPED_QUOTE})[^\n])*(?P<eqc>(?:{_ESCAPED_QUOTE})?)"""
    r"""|(?!\[REDACTED\]|=)(?:(?:basic|bearer|digest|token)\s+)?(?:[^"'\s,&;}\])\\]|\\(?![ntr]))+)"""
)


def _name_pattern(field: str) -> str:
    """A field name whose "_" or "-" may be spelled either way or left out: api_key also
    finds X-Api-Key and apikey."""
    return "[-_]?".join(re.escape(part) for part in re.split(r"[-_]", field))


class Redactor:
    """Masks credentials by shape, the values of secret-named fields quoted in text, and the
    configured secrets themselves (an API key of no known shape, say). ``for_call`` gives one
    that also masks a call's own secret-field values, quoted bare."""

    def __init__(
        self, secret_fields: Iterable[str] = DEFAULT_SECRET_FIELDS, secrets: Iterable[str] = ()
    ) -> None:
        self.secret_fields = frozenset(f.lower() for f in secret_fields)
        self._literals = sorted(
            {s for s in secrets if s and len(s) >= SHORTEST_LITERAL}, key=len, reverse=True
        )
        self._words: re.Pattern[str] | None = None
        """Short values masked only as whole words: a call's own (``for_call``)."""
        names = "|".join(_name_pattern(f) for f in sorted(self.secret_fields, key=len, reverse=True))
        self._names = re.compile(names) if names else None
        # password=..., 'password': '...', "api_key": "...", password: ... (in reprs, logs, URLs).
        # The name is looked for only from the start of each word (a lookahead), and the word
        # is then taken whole without backtracking: a search from every position of a long
        # word was quadratic (seconds for a 10 kB base64 blob in a traceback).
        self._fields = (
            re.compile(
                rf"""(?i)(?P<prefix>(?<![\w-])(?=[\w-]*?(?:{names}))[\w-]*+(?:\\{{0,8}}["'])?\s*[:=]\s*)"""
                + _FIELD_VALUE
            )
            if names
            else None
        )

    def text(self, text: str) -> str:
        for literal in self._literals:
            text = _without_literal(text, literal)
        if self._words is not None:
            text = self._words.sub(MASK, text)
        for pattern in _SECRET_PATTERNS:
            if pattern.groups == 2:
                text = pattern.sub(lambda m: f"{m.group(1)}{MASK}{m.group(2)}", text)
            else:
                text = pattern.sub(MASK, text)
        if self._fields is not None:
            text = self._fields.sub(_masked_field, text)
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
        return self._names is not None and self._names.search(name.lower()) is not None

    def secret_values(self, value: Any) -> list[str]:
        """The values under secret-named fields of ``value`` (at any depth; every string and
        number inside an object or array held by one), as text: what a handler given
        ``value`` knows, and may quote bare in an error (``f"declined for {pin}"``), where no
        field name or shape tells the secret."""
        found: dict[str, None] = {}
        stack: list[tuple[Any, bool]] = [(value, False)]
        while stack and len(found) < MAX_CALL_VALUES:
            item, secret = stack.pop()
            if isinstance(item, Mapping):
                for key, inner in item.items():
                    stack.append((inner, secret or (isinstance(key, str) and self.is_secret(key))))
            elif isinstance(item, list | tuple):
                stack.extend((inner, secret) for inner in item)
            elif secret and isinstance(item, str | int | float) and not isinstance(item, bool):
                text = str(item)
                if len(text) >= SHORTEST_CALL_VALUE:
                    found[text] = None
        return list(found)

    def for_call(self, arguments: Any) -> Redactor:
        """This redactor, also masking the values of the secret-named fields in a call's
        ``arguments`` wherever they appear as text (``secret_values``): for what the call's
        handler and hooks say, stored or sent. Each value is masked as written, and as JSON
        and a repr spell it; one shorter than SHORTEST_LITERAL only as a whole word."""
        values = self.secret_values(arguments)
        if not values:
            return self
        forms = {form for value in values for form in _spellings(value) if len(form) >= SHORTEST_CALL_VALUE}
        call = copy.copy(self)
        call._literals = sorted(
            {*self._literals, *(f for f in forms if len(f) >= SHORTEST_LITERAL)}, key=len, reverse=True
        )
        short = sorted((f for f in forms if len(f) < SHORTEST_LITERAL), key=len, reverse=True)
        call._words = (
            re.compile(rf"(?<![A-Za-z0-9])(?:{'|'.join(map(re.escape, short))})(?![A-Za-z0-9])")
            if short
            else self._words
        )
        return call


def _without_literal(text: str, literal: str) -> str:
    """``text`` with ``literal`` masked, and the head or tail of it a cut-short repr left."""
    text = text.replace(literal, MASK)
    if len(literal) < 2 * LITERAL_FRAGMENT:
        return text
    head, tail = literal[:LITERAL_FRAGMENT], literal[-LITERAL_FRAGMENT:]
    if head in text:
        parts, start = [], 0
        while (found := text.find(head, start)) >= 0:
            end, matched = found + len(head), len(head)
            while end < len(text) and matched < len(literal) and text[end] == literal[matched]:
                end, matched = end + 1, matched + 1
            parts.append(text[start:found] + MASK)
            start = end
        text = "".join(parts) + text[start:]
    if tail in text:
        parts, end = [], len(text)
        while (found := text.rfind(tail, 0, end)) >= 0:
            begin, matched = found, len(literal) - len(tail)
            while begin > 0 and matched > 0 and text[begin - 1] == literal[matched - 1]:
                begin, matched = begin - 1, matched - 1
            parts.append(MASK + text[found + len(tail) : end])
            end = begin
        text = text[:end] + "".join(reversed(parts))
    return text


def _spellings(value: str) -> set[str]:
    """``value`` as text quotes it: as written, inside a JSON string, inside a repr."""
    return {value, json.dumps(value)[1:-1], json.dumps(value, ensure_ascii=False)[1:-1], repr(value)[1:-1]}


def _masked_field(match: re.Match[str]) -> str:
    """The field's name and separator kept, its value masked, its quotes kept."""
    prefix = match["prefix"]
    for opening, closing in (("dq", "dqc"), ("sq", "sqc"), ("eq", "eqc")):
        if match[opening] is not None:
            return f"{prefix}{match[opening]}{MASK}{match[closing]}"
    return f"{prefix}{MASK}"


DEFAULT_REDACTOR = Redactor()


def redact(value: Any, secret_fields: Iterable[str] = DEFAULT_SECRET_FIELDS) -> Any:
    """A copy of ``value`` with secret-named fields masked, and credentials in text masked."""
    redactor = (
        DEFAULT_REDACTOR if frozenset(secret_fields) == DEFAULT_SECRET_FIELDS else Redactor(secret_fields)
    )
    return redactor.value(value)


def redact_text(text: str) -> str:
    return DEFAULT_REDACTOR.text(text)
