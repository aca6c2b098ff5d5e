"""Exports of the ledger's calls, and reading one back to check it.

An export is JSON lines or CSV (a header first), one call a line with its trail's chain head
(``trail_events``, ``trail_sha256``: how many events the call had and the hash of the last),
closed by a digest line: the SHA-256 of every byte before it. Kept somewhere the ledger's
writers cannot reach, an export anchors the trail: ``toolledger calls verify-trail --export
FILE`` checks that the file is whole and that every call's trail still begins with what was
exported (docs/audit-trail.md).

The digest line::

    {"export_sha256": "<hex>", "calls": 42, "trail_format": "toolledger-trail-v2"}   (jsonl)
    # toolledger export: export_sha256=<hex> calls=42 trail_format=toolledger-trail-v2  (csv)
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, Field

from toolledger.audit.views import CallView
from toolledger.domain.keys import CallKey
from toolledger.domain.trail import TRAIL_FORMAT_V2, TrailHead
from toolledger.errors import ToolLedgerError

ExportFormat = Literal["jsonl", "csv"]
FORMATS: tuple[ExportFormat, ...] = ("jsonl", "csv")

CSV_COLUMNS = [
    "id",
    "session_id",
    "turn_id",
    "call_id",
    "tool_name",
    "effect_class",
    "status",
    "outcome",
    "attempts",
    "created_at",
    "finished_at",
    "submitted_at",
    "confirmed_at",
    "submissions",
    "arguments",
    "result",
    "error_stage",
    "error_detail",
    "abandoned_reason",
    "trail_events",
    "trail_sha256",
]
CSV_DIGEST_PREFIX = "# toolledger export: "
_CSV_DIGEST = re.compile(
    re.escape(CSV_DIGEST_PREFIX) + r"export_sha256=([0-9a-f]{64}) calls=(\d+) trail_format=(\S+)\r?\n?"
)
_TAIL_BYTES = 4096
"""A digest line is well under this: the file's last line is found in its last few KB."""


class ExportFileError(ToolLedgerError):
    """A file that is not a toolledger export (or lost its digest line)."""

    code = "bad_export"


class ExportedCall(CallView):
    trail_events: int = Field(description="Events in the call's audit trail when it was exported.")
    trail_sha256: str | None = Field(
        description="The hash of the call's last event then: its trail's chain head (docs/audit-trail.md)."
    )


class ExportDigest(BaseModel):
    export_sha256: str = Field(description="SHA-256 (hex) of every byte of the export before this line.")
    calls: int = Field(description="Calls in the export.")
    trail_format: str = Field(description="How the calls' trail hashes are computed.")


class ExportLine(NamedTuple):
    text: str
    is_call: bool
    """A call's line (not the CSV header, not the digest line)."""


def exported_call(view: CallView, head: TrailHead | None) -> ExportedCall:
    return ExportedCall(
        **view.model_dump(),
        trail_events=0 if head is None else head.events,
        trail_sha256=None if head is None else head.sha256,
    )


class ExportWriter:
    """The lines of one export, hashed as they are made."""

    def __init__(self, fmt: str) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"unknown export format {fmt!r}: choose jsonl or csv")
        self.fmt = fmt
        self.calls = 0
        self._digest = hashlib.sha256()

    def header(self) -> ExportLine | None:
        return self._hashed(_csv_line(CSV_COLUMNS), is_call=False) if self.fmt == "csv" else None

    def call(self, call: ExportedCall) -> ExportLine:
        self.calls += 1
        if self.fmt == "jsonl":
            return self._hashed(call.model_dump_json() + "\n", is_call=True)
        return self._hashed(_csv_line(_csv_row(call)), is_call=True)

    def digest(self) -> ExportLine:
        """The closing line: the digest of every line before it."""
        digest = ExportDigest(
            export_sha256=self._digest.hexdigest(), calls=self.calls, trail_format=TRAIL_FORMAT_V2
        )
        if self.fmt == "jsonl":
            return ExportLine(digest.model_dump_json() + "\n", is_call=False)
        line = (
            f"{CSV_DIGEST_PREFIX}export_sha256={digest.export_sha256} calls={digest.calls} "
            f"trail_format={digest.trail_format}\n"
        )
        return ExportLine(line, is_call=False)

    def _hashed(self, text: str, *, is_call: bool) -> ExportLine:
        self._digest.update(text.encode("utf-8"))
        return ExportLine(text, is_call)


@dataclass(frozen=True)
class ExportedHead:
    """A call of an export, with its trail's head as exported."""

    key: CallKey
    head: TrailHead


@dataclass(frozen=True)
class ExportFile:
    """An export read back: what its digest line says, and what its bytes hash to."""

    path: Path
    fmt: ExportFormat
    recorded: ExportDigest
    computed_sha256: str
    body_bytes: int
    """Where its digest line starts."""

    @property
    def whole(self) -> bool:
        return self.recorded.export_sha256 == self.computed_sha256

    def heads(self) -> Iterator[ExportedHead]:
        """Each call of the export with its exported head, read from the file as it goes."""
        with self.path.open("rb") as raw:
            text = io.TextIOWrapper(
                io.BufferedReader(_Limited(raw, self.body_bytes)), encoding="utf-8", newline=""
            )
            if self.fmt == "jsonl":
                for number, line in enumerate(text, start=1):
                    yield _head(_json_line(line, number), f"line {number}")
                return
            reader = csv.DictReader(text)
            if not {"session_id", "turn_id", "call_id"} <= set(reader.fieldnames or ()):
                raise ExportFileError(f"{self.path}: its CSV header has no session_id, turn_id and call_id")
            for row in reader:
                yield _head(row, f"row {reader.line_num}")


def read_export(path: Path) -> ExportFile:
    """``path`` as an export: its format, its digest line, and the SHA-256 of what precedes it
    (read once, in chunks). Raises ExportFileError for a file that is not one."""
    try:
        size = path.stat().st_size
        with path.open("rb") as file:
            file.seek(max(0, size - _TAIL_BYTES))
            tail = file.read()
            end = len(tail) - 1 if tail.endswith(b"\n") else len(tail)
            start = tail.rfind(b"\n", 0, end) + 1
            body_bytes = size - len(tail) + start
            last = tail[start:].decode("utf-8", "replace")
            file.seek(0)
            first = file.read(1)
            file.seek(0)
            digest = hashlib.sha256()
            remaining = body_bytes
            while remaining > 0:
                chunk = file.read(min(1 << 20, remaining))
                if not chunk:
                    break
                digest.update(chunk)
                remaining -= len(chunk)
    except OSError as error:
        raise ExportFileError(f"{path}: {error.strerror or error}") from None
    fmt: ExportFormat = "jsonl" if first in (b"{", b"") else "csv"
    recorded = _digest_line(last, fmt)
    if recorded is None:
        raise ExportFileError(
            f"{path}: its last line is not a toolledger export's digest line (cut short, or exported "
            "with --no-digest?)"
        )
    return ExportFile(path, fmt, recorded, digest.hexdigest(), body_bytes)


def _digest_line(line: str, fmt: ExportFormat) -> ExportDigest | None:
    if fmt == "csv":
        match = _CSV_DIGEST.fullmatch(line)
        if match is None:
            return None
        return ExportDigest(export_sha256=match[1], calls=int(match[2]), trail_format=match[3])
    try:
        return ExportDigest.model_validate_json(line)
    except ValueError:
        return None


def _json_line(line: str, number: int) -> dict[str, Any]:
    try:
        value = json.loads(line)
    except ValueError:
        raise ExportFileError(f"line {number} is not JSON") from None
    if not isinstance(value, dict):
        raise ExportFileError(f"line {number} is not a call")
    return value


def _head(call: dict[str, Any], where: str) -> ExportedHead:
    try:
        key = CallKey(str(call["session_id"]), str(call["turn_id"]), str(call["call_id"]))
        events = int(call.get("trail_events") or 0)
    except (KeyError, TypeError, ValueError):
        raise ExportFileError(f"{where} names no call (session_id, turn_id, call_id)") from None
    sha256 = call.get("trail_sha256") or None
    return ExportedHead(key, TrailHead(events, None if sha256 is None else str(sha256)))


class _Limited(io.RawIOBase):
    """The first ``limit`` bytes of a binary file: an export without its digest line."""

    def __init__(self, raw: Any, limit: int) -> None:
        self._raw = raw
        self._left = limit

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self._left <= 0:
            return 0
        view = memoryview(buffer)[: self._left]
        count: int = self._raw.readinto(view)
        self._left -= count
        return count


def _csv_row(call: ExportedCall) -> list[str]:
    data = call.model_dump(mode="json")
    row = []
    for column in CSV_COLUMNS:
        value = data[column]
        if isinstance(value, dict | list):
            value = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
        row.append(_spreadsheet_safe("" if value is None else str(value)))
    return row


def _spreadsheet_safe(cell: str) -> str:
    """A cell a spreadsheet would run as a formula (=, +, -, @) is quoted as text."""
    return "'" + cell if cell[:1] in ("=", "+", "-", "@", "\t", "\r") else cell


def _csv_line(cells: list[str]) -> str:
    buffer = io.StringIO()
    csv.writer(buffer, lineterminator="\n").writerow(cells)
    return buffer.getvalue()


__all__ = [
    "CSV_COLUMNS",
    "FORMATS",
    "ExportDigest",
    "ExportFile",
    "ExportFileError",
    "ExportLine",
    "ExportWriter",
    "ExportedCall",
    "ExportedHead",
    "exported_call",
    "read_export",
]
