"""What verifying the audit trail reports, for the CLI (text or ``--json``) and the HTTP API.

A verification recomputes each call's hash chain (``domain.trail.check_trail``), holds the
call's stored content to the digest its last event carries, and reports the first broken link
of every broken call; keyed, it also checks every event's MAC (``domain.trail.check_keyed``).
Checking an export also says whether the file is whole and whether each call's trail still
begins with the head the export recorded.
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
    content_covered: bool = True
    """Its last event carries a digest of its content (False: all its events were written
    before content digests were kept, and its content is held to nothing)."""


class TrailBreakView(BaseModel):
    id: str = Field(description="The call's id (its idempotency key).")
    session_id: str
    turn_id: str
    call_id: str
    kind: str = Field(
        description="edited, deleted, inserted, reordered, unchained, truncated, empty, rewritten, "
        "content (the call's stored content changed after its last event), or keyed: forged, unkeyed."
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
    keyed: bool = Field(
        default=False,
        description="Every event's keyed MAC was checked too, with TOOLLEDGER_TRAIL_KEY (`--keyed`).",
    )
    content_not_covered: int = Field(
        default=0,
        description="Calls whose every event was written before content digests were kept "
        "(migration 0010): their stored content is held to nothing, only their events are checked.",
    )


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


class TrailStateView(BaseModel):
    """One call's trail as `calls show` sees it, read with the call in one snapshot."""

    intact: bool = Field(
        description="Its trail verifies as `calls verify-trail` verifies it, and its stored content "
        "(arguments, approved arguments, result, error, tool, effect class) is what its last event "
        "recorded. False: what this answer shows of the call is not what its trail recorded."
    )
    content_covered: bool = Field(
        description="Its last event carries a digest of its content. False: every event was written "
        "before content digests were kept (migration 0010), and the content is held to nothing."
    )
    kind: str | None = Field(description="The first broken link's kind (as `calls verify-trail` names it).")
    event_id: int | None = Field(description="The event where the trail breaks.")
    message: str | None = Field(description="What differs there, in one line.")
    keyed: bool | None = Field(
        description="Every event's keyed MAC matches (TOOLLEDGER_TRAIL_KEY); null: no key where this ran."
    )
    keyed_message: str | None = Field(description="Why the keyed check failed.")


def trail_state(
    found: TrailBreak | None, covered: bool, keyed: TrailBreak | None, key_held: bool
) -> TrailStateView:
    return TrailStateView(
        intact=found is None,
        content_covered=covered,
        kind=None if found is None else found.kind.value,
        event_id=None if found is None else found.event_id,
        message=None if found is None else found.message,
        keyed=(keyed is None) if key_held else None,
        keyed_message=None if keyed is None else keyed.message,
    )


def tally(report: TrailReport, check: TrailCheck, max_listed: int | None) -> None:
    """``check`` counted into ``report`` (its break listed while under ``max_listed``)."""
    report.calls += 1
    report.events += check.events
    if not check.content_covered:
        report.content_not_covered += 1
    if check.found is None:
        return
    report.intact = False
    report.broken += 1
    if max_listed is not None and len(report.breaks) >= max_listed:
        report.breaks_not_listed += 1
    else:
        report.breaks.append(break_view(check.key, check.found))


__all__ = [
    "ExportReport",
    "TrailBreakView",
    "TrailCheck",
    "TrailReport",
    "TrailStateView",
    "break_view",
    "tally",
    "trail_state",
]
