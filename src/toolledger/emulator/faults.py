"""Faults the emulator can inject, armed through its control API.

Each fault is spent after ``count`` uses (``count=None`` lasts until the faults are
cleared) and may be limited to one session.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter


class _FaultBase(BaseModel):
    model_config = ConfigDict(extra="forbid")

    session_id: str | None = None
    """Only this session; every session when unset."""
    count: int | None = Field(default=1, ge=1)
    """How many times it fires before it is spent; None: until cleared."""


class CloseStreams(_FaultBase):
    """Close event streams after they have sent ``after_events`` more events.

    ``mode="drop"`` cuts the connection mid-response (the client sees a transport error);
    ``mode="end"`` ends the response cleanly. ``count`` is the number of streams closed.
    """

    kind: Literal["close_streams"] = "close_streams"
    after_events: int = Field(default=0, ge=0)
    mode: Literal["drop", "end"] = "drop"


class FailSubmissions(_FaultBase):
    """Answer the next ``count`` event submissions with an HTTP error, applying nothing."""

    kind: Literal["fail_submissions"] = "fail_submissions"
    status: int = Field(default=500, ge=400, le=599)
    retry_after: float | None = Field(default=None, ge=0)
    only_tool_results: bool = True
    """Count only submissions that carry a tool_result (not messages or cancels)."""


class AcceptThenDrop(_FaultBase):
    """Apply the next ``count`` tool-result submissions, then drop the connection unanswered."""

    kind: Literal["accept_then_drop"] = "accept_then_drop"


class AcceptWithoutApply(_FaultBase):
    """Answer the next ``count`` tool-result submissions 202 but lose them: the call stays
    pending. The answer is kept for the Idempotency-Key, so a resubmission with the same key
    gets the same 202 and is lost too: "accepted" is not "consumed"."""

    kind: Literal["accept_without_apply"] = "accept_without_apply"


class DropBeforeApply(_FaultBase):
    """Drop the connection of the next ``count`` tool-result submissions before applying them."""

    kind: Literal["drop_before_apply"] = "drop_before_apply"


class DelayRegistration(_FaultBase):
    """Register the calls of the next ``count`` steps only ``seconds`` after announcing them.

    Until then a tool_result for them gets 400 "Unknown pending tool call", the race the
    SDK's helper retries.
    """

    kind: Literal["delay_registration"] = "delay_registration"
    seconds: float = Field(default=0.5, gt=0, le=60)


class UnknownPending(_FaultBase):
    """Refuse the next ``count`` tool-result submissions with the pending-call race error."""

    kind: Literal["unknown_pending"] = "unknown_pending"


class DuplicateEvents(_FaultBase):
    """Deliver each of the next ``count`` stream events twice, with the same event_id."""

    kind: Literal["duplicate_events"] = "duplicate_events"


Fault = Annotated[
    CloseStreams
    | FailSubmissions
    | AcceptThenDrop
    | AcceptWithoutApply
    | DropBeforeApply
    | DelayRegistration
    | UnknownPending
    | DuplicateEvents,
    Field(discriminator="kind"),
]
FaultAdapter: TypeAdapter[Fault] = TypeAdapter(Fault)


class ArmedFault:
    """A fault with its remaining uses."""

    _ids = itertools.count(1)

    def __init__(self, fault: Fault) -> None:
        self.id = next(self._ids)
        self.fault = fault
        self.remaining = fault.count
        self.fired = 0

    def matches(self, session_id: str | None) -> bool:
        return self.fault.session_id is None or self.fault.session_id == session_id

    def use(self) -> None:
        self.fired += 1
        if self.remaining is not None:
            self.remaining -= 1

    @property
    def spent(self) -> bool:
        return self.remaining is not None and self.remaining <= 0


class FaultBoard:
    """The armed faults, consumed in the order they were armed."""

    def __init__(self) -> None:
        self._armed: list[ArmedFault] = []

    def arm(self, fault: Fault) -> ArmedFault:
        armed = ArmedFault(fault)
        self._armed.append(armed)
        return armed

    def clear(self) -> None:
        self._armed.clear()

    def listing(self) -> list[dict[str, object]]:
        return [
            {"id": a.id, "fired": a.fired, "remaining": a.remaining, **a.fault.model_dump()}
            for a in self._armed
        ]

    def armed(self, kind: type[_FaultBase], session_id: str | None) -> list[ArmedFault]:
        return [a for a in self._armed if isinstance(a.fault, kind) and a.matches(session_id)]

    def take(self, kind: type[_FaultBase], session_id: str | None) -> ArmedFault | None:
        """Use the oldest armed fault of this kind that applies, if any."""
        return self.take_if(kind, session_id, lambda _fault: True)

    def take_if(
        self, kind: type[_FaultBase], session_id: str | None, applies: Callable[[Any], bool]
    ) -> ArmedFault | None:
        for armed in self.armed(kind, session_id):
            if applies(armed.fault):
                self.use(armed)
                return armed
        return None

    def use(self, armed: ArmedFault) -> None:
        armed.use()
        if armed.spent:
            self._armed.remove(armed)
