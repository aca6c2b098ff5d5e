"""What audit views show of a call: masked for display, never the stored bytes themselves.

The ledger keeps a result byte for byte (it must be resubmitted exactly); every view, export
and API answer is built here, through the configured redactor, so none can forget to mask.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field

from toolledger.audit.trail import TrailStateView
from toolledger.domain.queries import outcome_of
from toolledger.domain.records import CallEvent, CallRecord
from toolledger.domain.redaction import Redactor
from toolledger.store.audit import CallCounts, SessionSummary

Utc = datetime
"""The ledger reads every time back as aware UTC (store.schema.UtcDateTime)."""


class CallView(BaseModel):
    id: str = Field(description="The call's idempotency key: names it in `calls show` and the API.")
    session_id: str
    turn_id: str
    call_id: str
    tool_name: str
    effect_class: str
    status: str
    outcome: Literal["succeeded", "failed"] | None = Field(
        description="How it ended, once it has a result (kept after submission; error_stage says "
        "where a failure happened); null before."
    )
    needs_operator: bool = Field(description="Outcome unknown: an operator must resolve it.")
    attempts: int
    created_at: Utc
    started_at: Utc | None
    finished_at: Utc | None
    submitted_at: Utc | None
    confirmed_at: Utc | None
    submissions: int
    last_submission_error: str | None
    arguments: Any = Field(description="As recorded, with secret fields masked.")
    result: Any = Field(description="The tool_result payload as submitted, with secret fields masked.")
    error_stage: str | None
    error_detail: str | None
    abandoned_reason: str | None
    lease_owner: str | None
    lease_expires_at: Utc | None
    arguments_sha256: str = Field(
        description="Fingerprint of the arguments as the model sent them: an approval names it, so "
        "that it approves exactly the arguments the approver saw."
    )
    needs_approval: bool = Field(description="Waits for a person's approval: approve or deny it.")
    approval_expires_at: Utc | None = Field(
        description='When a call awaiting approval is answered "not approved in time"; null: never.'
    )
    approval_decided_by: str | None = Field(description="Who approved or denied it (toolledger: expired).")
    approval_decided_at: Utc | None
    approved_arguments: Any = Field(
        description="Arguments the approver amended (what the handler received), masked; null if none."
    )


class EventView(BaseModel):
    id: int
    at: Utc
    actor: str
    kind: str
    from_status: str | None
    to_status: str | None
    lease_token: int | None
    reason: str | None
    detail: str | None
    prev_sha256: str | None = Field(
        description="The hash of the call's event before this one (its trail's chain)."
    )
    sha256: str | None = Field(
        description="This event's hash, over its stored fields (as written, before masking) and prev_sha256."
    )
    content_sha256: str | None = Field(
        default=None,
        description="The digest of the call's content right after this event's write (null: written "
        "before content digests were kept).",
    )
    trail_mac: str | None = Field(
        default=None,
        description="Its keyed MAC (the content parts it wrote, then the HMAC): null when its writer "
        "held no TOOLLEDGER_TRAIL_KEY.",
    )


class CallDetail(BaseModel):
    call: CallView
    timeline: list[EventView] = Field(description="Every transition and submission attempt, in order.")
    trail: TrailStateView = Field(
        description="Whether the call's trail verifies and holds its stored content: when `intact` is "
        "false, the call shown is not what its trail recorded."
    )


class CallPage(BaseModel):
    calls: list[CallView]
    next_cursor: str | None = Field(description="Pass as `cursor` for the next page; null on the last.")


class CallCountsView(BaseModel):
    total: int = Field(description="Calls the filters match (sort, page and cursor aside).")
    by_status: dict[str, int]
    by_outcome: dict[str, int] = Field(description="succeeded, failed, and none (no result yet).")
    failed_by_stage: dict[str, int] = Field(description="Failures by error_stage.")


def counts_view(counts: CallCounts) -> CallCountsView:
    return CallCountsView(
        total=counts.total,
        by_status=counts.by_status,
        by_outcome=counts.by_outcome,
        failed_by_stage=counts.failed_by_stage,
    )


class SessionView(BaseModel):
    session_id: str
    watched: bool | None
    owner: str | None = Field(
        description="The last replica to hold it: it follows the session only until lease_expires_at."
    )
    lease_expires_at: Utc | None
    status: str | None
    reason: str | None
    last_polled_at: Utc | None
    calls: dict[str, int]
    intake: str | None = Field(
        description="How it came without registration: a signed webhook, or the sweep of its "
        "agent's sessions (then `serve` looks at it when asked, with no stream to follow); null: "
        "registered (watched)."
    )
    agent_id: str | None = Field(description="The agent it belongs to, once known (intake sessions).")
    looking: bool = Field(
        description="A replica is looking at it now (holds its look, on the database's clock)."
    )


class SweepView(BaseModel):
    agent_id: str
    runs: int = Field(description="Sweeps of this agent's sessions run so far.")
    last_run_age_seconds: float | None = Field(description="Since the last sweep ended; null: never run.")
    last_found: int | None = Field(description="Sessions the last sweep asked a look for.")
    watermark: int | None = Field(
        description="Unix seconds (UTC): the newest session creation a sweep has seen; the next "
        "sweep pages down to it (less an overlap). Null: no sweep has seen a session yet."
    )
    last_error: str | None = Field(description="Why the last sweep failed (masked); null: it did not.")


class IntakeView(BaseModel):
    modes: list[str] = Field(
        description="watch: registered sessions are followed (always); agents: the configured "
        "agents' sessions are swept; webhooks: signed webhooks are taken (`serve --listen`)."
    )
    agent_ids: list[str] = Field(description="The agents whose sessions are served without registration.")
    intake_sessions: int = Field(description="Sessions that came by webhook or sweep, in all.")
    looks_due: int = Field(description="Looks asked for, due now, and held by no replica.")
    webhooks_taken: int = Field(description="Webhook ids kept (for deduplication, 7 days).")
    counts: dict[str, int] = Field(
        description="The live replicas' intake counts since each started, summed (the load "
        "balancer spreads webhooks over them): webhook_<outcome> (accepted, duplicate, ignored, "
        "unavailable, refused_<reason>) and look_<result>."
    )
    sweeps: list[SweepView] = Field(description="Each agent's sweep, by agent id.")


SUBMISSION_EVENT_KINDS = frozenset({"submission", "submission_failed", "resubmission", "confirmed"})


def call_view(call: CallRecord, redactor: Redactor) -> CallView:
    return CallView(
        id=call.idempotency_key,
        session_id=call.key.session_id,
        turn_id=call.key.turn_id,
        call_id=call.key.call_id,
        tool_name=call.tool_name,
        effect_class=call.effect_class.value,
        status=call.status.value,
        outcome=_outcome_name(call),
        needs_operator=call.status.value == "unknown",
        attempts=call.attempt_count,
        created_at=call.created_at,
        started_at=call.started_at,
        finished_at=call.finished_at,
        submitted_at=call.submitted_at,
        confirmed_at=call.confirmed_at,
        submissions=call.submission_count,
        last_submission_error=_text(call.last_submission_error, redactor),
        arguments=masked_json(call.arguments, redactor),
        result=masked_json(call.result, redactor) if call.result is not None else None,
        error_stage=call.error_stage,
        error_detail=_text(call.error_detail, redactor),
        abandoned_reason=_text(call.abandoned_reason, redactor),
        lease_owner=call.lease_owner,
        lease_expires_at=call.lease_expires_at,
        arguments_sha256=call.arguments_sha256,
        needs_approval=call.status.value == "awaiting_approval",
        approval_expires_at=call.approval_expires_at,
        approval_decided_by=call.approval_decided_by,
        approval_decided_at=call.approval_decided_at,
        approved_arguments=(
            masked_json(call.approved_arguments, redactor) if call.approved_arguments is not None else None
        ),
    )


def _outcome_name(call: CallRecord) -> Literal["succeeded", "failed"] | None:
    outcome = outcome_of(call.result, call.error_stage)
    if outcome is None:
        return None
    return "failed" if outcome.value == "failed" else "succeeded"


def event_view(event: CallEvent, redactor: Redactor) -> EventView:
    return EventView(
        id=event.id,
        at=event.at,
        actor=event.actor,
        kind=event.kind,
        from_status=event.from_status,
        to_status=event.to_status,
        lease_token=event.lease_token,
        # Written redacted already; masked again with today's configuration.
        reason=_text(event.reason, redactor),
        detail=_text(event.detail, redactor),
        prev_sha256=event.prev_sha256,
        sha256=event.sha256,
        content_sha256=event.content_sha256,
        trail_mac=event.trail_mac,
    )


def session_view(summary: SessionSummary, redactor: Redactor) -> SessionView:
    return SessionView(
        session_id=summary.session_id,
        watched=summary.watched,
        owner=summary.owner,
        lease_expires_at=summary.lease_expires_at,
        status=summary.status,
        reason=_text(summary.reason, redactor),
        last_polled_at=summary.last_polled_at,
        calls=summary.calls,
        intake=summary.intake,
        agent_id=summary.agent_id,
        looking=summary.looking,
    )


def intake_view(report: dict[str, Any], redactor: Redactor) -> IntakeView:
    """``audit.intake_report``'s report as the API answers it; a sweep's error masked again
    with today's configuration (it was masked when written)."""
    return IntakeView.model_validate(
        {
            **report,
            "sweeps": [
                {**sweep, "last_error": _text(sweep["last_error"], redactor)} for sweep in report["sweeps"]
            ],
        }
    )


def masked_json(text: str, redactor: Redactor) -> Any:
    """JSON text as a value with secret fields masked, including JSON nested in strings (a
    tool's output is often JSON text inside the payload); other text as masked text."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return redactor.text(text)
    return _mask_nested(value, redactor)


def _mask_nested(value: Any, redactor: Redactor) -> Any:
    if isinstance(value, dict):
        return {
            key: "[REDACTED]"
            if isinstance(key, str) and redactor.is_secret(key)
            else _mask_nested(item, redactor)
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [_mask_nested(item, redactor) for item in value]
    if isinstance(value, str):
        stripped = value.lstrip()
        if stripped[:1] in ("{", "["):
            try:
                inner = json.loads(value)
            except (ValueError, RecursionError):
                return redactor.text(value)
            return json.dumps(_mask_nested(inner, redactor), ensure_ascii=False, separators=(",", ":"))
        return redactor.text(value)
    return value


def _text(text: str | None, redactor: Redactor) -> str | None:
    return None if text is None else redactor.text(text)
