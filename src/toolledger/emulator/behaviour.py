"""How the emulated API answers where real APIs each answer their own way: a result for a call
that has one already, and a request whose Idempotency-Key was used before.

A client must not depend on either: toolledger decides what became of a call from the
session's state, and the crash matrix and the chaos run go through every variant here. Set for
every session through the control API (``PUT /_emulator/behaviour``), or per script
(``Script.already_answered``), which wins for its sessions.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

AlreadyAnswered = Literal["coded", "worded", "conflict", "unknown_pending"]
"""How a tool_result for a call that has a result already is refused:

- ``coded``: 400 "Tool call X of turn Y already has a result.", code ``tool_result_already_submitted``;
- ``worded``: 400 with other words and no code ("Tool call X in turn Y has already been answered.");
- ``conflict``: 409 with no code;
- ``unknown_pending``: 400 "Unknown pending tool call: X", code ``invalid_request_error``: the
  very answer the SDK documents for its registration race.
"""
ALREADY_ANSWERED_STYLES: tuple[AlreadyAnswered, ...] = ("coded", "worded", "conflict", "unknown_pending")

IdempotencyKeys = Literal["honoured", "ignored"]
"""``honoured``: a request repeating an earlier one's Idempotency-Key and body gets the first
answer again, applied once (a different body with that key is refused); ``ignored``: every
request is applied anew, as by an API that keeps no keys (or forgot them)."""


class ApiBehaviour(BaseModel):
    """The emulator's answers where real APIs differ (``GET``/``PUT /_emulator/behaviour``)."""

    model_config = ConfigDict(extra="forbid")

    already_answered: AlreadyAnswered = "coded"
    idempotency_keys: IdempotencyKeys = "honoured"
