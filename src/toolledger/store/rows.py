"""Rows of the ledger's tables as domain records: the one mapping every store reads through."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import Row, Select, select
from sqlalchemy.ext.asyncio import AsyncConnection

from toolledger.domain.keys import CallKey
from toolledger.domain.records import CallEvent, CallRecord
from toolledger.domain.states import CallStatus, EffectClass
from toolledger.store.schema import tool_call_events


def call_record(row: Row[Any] | Mapping[str, Any]) -> CallRecord:
    """A ``tool_calls`` row (or any row holding its columns, as a join does) as a record."""
    m = row._mapping if isinstance(row, Row) else row
    return CallRecord(
        key=CallKey(m["session_id"], m["turn_id"], m["call_id"]),
        tool_name=m["tool_name"],
        arguments=m["arguments"],
        arguments_sha256=m["arguments_sha256"],
        status=CallStatus(m["status"]),
        effect_class=EffectClass(m["effect_class"]),
        idempotency_key=m["idempotency_key"],
        attempt_count=m["attempt_count"],
        lease_owner=m["lease_owner"],
        lease_token=m["lease_token"],
        lease_expires_at=m["lease_expires_at"],
        result=m["result"],
        error_stage=m["error_stage"],
        error_detail=m["error_detail"],
        created_at=m["created_at"],
        started_at=m["started_at"],
        finished_at=m["finished_at"],
        submitted_at=m["submitted_at"],
        confirmed_at=m["confirmed_at"],
        submission_count=m["submission_count"],
        last_submission_error=m["last_submission_error"],
        abandoned_reason=m["abandoned_reason"],
        # Rows of the hot path's own statements (store.prepared) carry only what they need.
        approval_expires_at=m.get("approval_expires_at"),
        approval_decided_by=m.get("approval_decided_by"),
        approval_decided_at=m.get("approval_decided_at"),
        approved_arguments=m.get("approved_arguments"),
        approved_arguments_sha256=m.get("approved_arguments_sha256"),
        request_key=m.get("request_key"),
    )


async def call_events(conn: AsyncConnection, key: CallKey) -> list[CallEvent]:
    """A call's audit trail, oldest first."""
    return [call_event(row) for row in await conn.execute(call_events_query(key))]


def call_events_query(key: CallKey) -> Select[Any]:
    """The rows of a call's audit trail, oldest first (``call_event`` reads each)."""
    return (
        select(tool_call_events)
        .where(
            tool_call_events.c.session_id == key.session_id,
            tool_call_events.c.turn_id == key.turn_id,
            tool_call_events.c.call_id == key.call_id,
        )
        .order_by(tool_call_events.c.id)
    )


def call_event(row: Row[Any]) -> CallEvent:
    """A ``tool_call_events`` row as a record."""
    return CallEvent(
        id=row.id,
        key=CallKey(row.session_id, row.turn_id, row.call_id),
        at=row.at,
        actor=row.actor,
        kind=row.kind,
        from_status=row.from_status,
        to_status=row.to_status,
        lease_token=row.lease_token,
        reason=row.reason,
        detail=row.detail,
        prev_sha256=row.prev_sha256,
        sha256=row.sha256,
        # Absent from a ledger before revision 0010 (read by its migration's tests).
        content_sha256=row._mapping.get("content_sha256"),
        trail_mac=row._mapping.get("trail_mac"),
    )


__all__ = ["call_event", "call_events", "call_events_query", "call_record"]
