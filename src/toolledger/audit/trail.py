"""What verifying the audit trail reports, for the CLI (text or ``--json``) and the HTTP API.

A verification recomputes each call's hash chain (``domain.trail.check_trail``) and reports
the first broken link of every broken call; checking an export also says whether the file is
whole and whether each call's trail still begins with the head the export recorded.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, Field

from toolledger.domain.keys import CallKey
from toolledger.domain.trail import TrailBreak


@dataclass(frozen=True)
class TrailCheck:
    """One call's trail, recomputed."""

    key: CallKey
    events: int
    found: TrailBreak | None
    """Its first broken link; None when intact."""


class TrailBreakView(BaseModel):
    id: str = Field(description="The call's id (its idempotency key).")
    session_id: str
    turn_id: str
    call_id: str
    kind: str = Field(
        description="edited, deleted, inserted, reordered, unchained, truncated, empty or rewritten."
    )
    event_id: int | None = Field(description="The event where the chain breaks (null: none to name).")
    message: str = Field(description="What differs there, in one line.")


class TrailReport(BaseModel):
    scope: str = Field(description="What was verified: a call, a session, or the whole ledger.")
    intact: bool = Field(description="Every trail verified: no broken link anywhere.")
    calls: int = Field(description="Calls whose trails were recomputed.")
    events: int = Field(description="Events recomputed.")
    broken: int = Field(description="Calls with a broken trail.")
    breaks: list[TrailBreakView] = Field(description="The first broken link of each broken call.")
    breaks_not_listed: int = Field(default=0, description="Broken calls left out of `breaks` (a limit).")


class ExportReport(TrailReport):
    file_whole: bool = Field(description="The file hashes to its digest line, and holds as many calls.")
    export_sha256: str = Field(description="The digest its last line records.")
    computed_sha256: str = Field(description="What the bytes before that line hash to now.")
    exported_calls: int = Field(description="Calls the digest line says the export holds.")
    missing: list[str] = Field(
        description="Calls of the export no longer in the ledger (SESSION/TURN/CALL): pruned since, "
        "or deleted. Not a broken link: pruning deletes whole calls."
    )


def break_view(key: CallKey, found: TrailBreak) -> TrailBreakView:
    return TrailBreakView(
        id=key.idempotency_key,
        session_id=key.session_id,
        turn_id=key.turn_id,
        call_id=key.call_id,
        kind=found.kind.value,
        event_id=found.event_id,
        message=found.message,
    )


def tally(report: TrailReport, check: TrailCheck, max_listed: int | None) -> None:
    """``check`` counted into ``report`` (its break listed while under ``max_listed``)."""
    report.calls += 1
    report.events += check.events
    if check.found is None:
        return
    report.intact = False
    report.broken += 1
    if max_listed is not None and len(report.breaks) >= max_listed:
        report.breaks_not_listed += 1
    else:
        report.breaks.append(break_view(check.key, check.found))


__all__ = ["ExportReport", "TrailBreakView", "TrailCheck", "TrailReport", "break_view", "tally"]
