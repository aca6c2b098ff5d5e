"""What the ledger returns: plain values, free of the database layer."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from toolledger.domain.keys import CallKey
from toolledger.domain.states import CallStatus, EffectClass


@dataclass(frozen=True)
class CallRecord:
    key: CallKey
    tool_name: str
    arguments: str
    arguments_sha256: str
    status: CallStatus
    effect_class: EffectClass
    idempotency_key: str
    attempt_count: int
    lease_owner: str | None
    lease_token: int
    lease_expires_at: datetime | None
    result: str | None
    error_stage: str | None
    error_detail: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    submitted_at: datetime | None
    confirmed_at: datetime | None
    submission_count: int
    last_submission_error: str | None
    abandoned_reason: str | None
    approval_expires_at: datetime | None = None
    approval_decided_by: str | None = None
    approval_decided_at: datetime | None = None
    approved_arguments: str | None = None
    """Arguments amended by the approver: what the handler receives (``arguments`` keeps
    what the model sent)."""
    approved_arguments_sha256: str | None = None
    request_key: str | None = None
    """The Idempotency-Key of the request the stored result goes out in, recorded before its
    first post; None while it has never been posted. A batch's members share it."""

    @property
    def payload(self) -> dict[str, Any] | None:
        """The stored tool_result event, exactly as it is (re)submitted."""
        return None if self.result is None else json.loads(self.result)


@dataclass(frozen=True)
class CallEvent:
    id: int
    key: CallKey
    at: datetime
    actor: str
    kind: str
    from_status: str | None
    to_status: str | None
    lease_token: int | None
    reason: str | None
    detail: str | None
    prev_sha256: str | None = None
    """The hash of the call's event before this one (``domain.trail``)."""
    sha256: str | None = None
    """This event's own hash, over its fields and ``prev_sha256``."""
    content_sha256: str | None = None
    """The digest of the call's stored content just after this event's write
    (``domain.trail.content_sha256``); None in events written before it was kept."""
    trail_mac: str | None = None
    """The event's keyed MAC (``domain.trail.TrailKey``), when its writer held the trail key."""


@dataclass(frozen=True)
class Recorded:
    """What recording a delivered call found."""

    call: CallRecord
    claimed: bool
    """This worker recorded it and holds its lease (``call.lease_token``)."""
    arguments_mismatch: bool = False


@dataclass(frozen=True)
class SessionRecord:
    """A session the service watches (or stopped watching, with the reason)."""

    session_id: str
    watched: bool
    owner: str | None
    lease_token: int
    lease_expires_at: datetime | None
    last_event_id: str | None
    last_polled_at: datetime | None
    status: str | None
    reason: str | None
    created_at: datetime
    updated_at: datetime
    intake: str | None = None
    """How it came without registration (``webhook``, ``sweep``): then it is served by looks."""
    agent_id: str | None = None
    look_requested_at: datetime | None = None
    look_seq: int = 0
    look_owner: str | None = None
    look_expires_at: datetime | None = None


@dataclass(frozen=True)
class LookClaim:
    """A look at an intake session taken by one replica: ``seq`` as it was then (asked for
    again meanwhile, the look stays due), ``agent_id`` if already known."""

    session_id: str
    seq: int
    agent_id: str | None


@dataclass(frozen=True)
class ReplicaRecord:
    replica_id: str
    hostname: str
    pid: int
    started_at: datetime
    heartbeat_at: datetime
    expires_at: datetime
    handler_load: Mapping[str, int] | None = None
    """How its handlers stood at its last heartbeat (slots, threads, waits), if it said."""
    intake_counts: Mapping[str, int] | None = None
    """Its webhook intake's counts since it started (accepted, duplicate, refused_…), if any."""
