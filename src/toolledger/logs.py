"""Log lines as operators read them: redacted whole (message, arguments and traceback, from
toolledger's own loggers and from every library's), each with the session, turn and call it
is about, as text on a terminal and as JSON lines elsewhere (a log shipper's input).

Redaction happens in the formatter, at the one place every record passes on its way out:
a secret in an exception's text, an SDK's debug line or a driver's error is masked wherever
it was logged from, not only where someone remembered to call the redactor.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Literal, TextIO

from toolledger.domain.redaction import DEFAULT_REDACTOR, Redactor

LogFormat = Literal["auto", "text", "json"]

_fields: ContextVar[Mapping[str, str]] = ContextVar("toolledger_log_fields", default={})  # noqa: B039 - never mutated

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Libraries that log one line per request, or (aiosqlite at DEBUG) statement parameters:
# tool arguments and outputs.
NOISY_LOGGERS = ("httpx", "httpx2", "httpcore", "httpcore2", "openai", "alembic", "aiosqlite")


@contextmanager
def log_fields(**ids: str | None) -> Iterator[None]:
    """Every line logged inside (in this task, and tasks it starts) names these ids."""
    merged = {**_fields.get(), **{name: value for name, value in ids.items() if value is not None}}
    token = _fields.set(merged)
    try:
        yield
    finally:
        _fields.reset(token)


def current_fields() -> Mapping[str, str]:
    return _fields.get()


class RedactingFormatter(logging.Formatter):
    """Formats a record as text or one JSON object, with its context ids, and masks secrets
    in what it writes."""

    def __init__(self, redactor: Redactor = DEFAULT_REDACTOR, *, as_json: bool = False) -> None:
        super().__init__(TEXT_FORMAT)
        self.redactor = redactor
        self.as_json = as_json

    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "toolledger_fields", None) or _fields.get()
        if self.as_json:
            return self._json(record, fields)
        text = super().format(record)
        if fields:
            ids = " ".join(f"{name}={value}" for name, value in fields.items())
            head, newline, rest = text.partition("\n")
            text = f"{head} [{ids}]{newline}{rest}"
        return self.redactor.text(text)

    def _json(self, record: logging.LogRecord, fields: Mapping[str, str]) -> str:
        # Each string is redacted before it is encoded: masking the encoded line could cut
        # through its quoting.
        entry: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": self.redactor.text(record.getMessage()),
            **{name: self.redactor.text(value) for name, value in fields.items()},
        }
        if record.exc_info:
            entry["exception"] = self.redactor.text(self.formatException(record.exc_info))
        elif record.exc_text:
            entry["exception"] = self.redactor.text(record.exc_text)
        return json.dumps(entry, ensure_ascii=False)


class _KeepFields(logging.Filter):
    """Captures the context ids when the record is made: a queue or another thread may
    format it later, outside the task that logged it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "toolledger_fields"):
            record.toolledger_fields = _fields.get()
        return True


def configure_logging(
    level: str = "info",
    *,
    redactor: Redactor = DEFAULT_REDACTOR,
    log_format: LogFormat = "auto",
    stream: TextIO | None = None,
) -> logging.Handler:
    """Route every logger through one redacting handler on ``stream`` (stderr). ``auto`` is
    text when the stream is a terminal and JSON lines when it is not."""
    stream = stream if stream is not None else sys.stderr
    as_json = log_format == "json" or (log_format == "auto" and not _is_terminal(stream))
    handler = logging.StreamHandler(stream)
    handler.setFormatter(RedactingFormatter(redactor, as_json=as_json))
    handler.addFilter(_KeepFields())
    root = logging.getLogger()
    for existing in list(root.handlers):
        root.removeHandler(existing)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for noisy in NOISY_LOGGERS:
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
    return handler


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
