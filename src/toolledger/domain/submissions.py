"""What became of a stored result sent to the Agents API: one vocabulary from the gateway's
classification of a refusal, through the executor, to the operator's commands."""

from __future__ import annotations

from enum import StrEnum


class SubmissionFailure(StrEnum):
    """Why the Agents API did not take a submission (``SubmissionError.kind``)."""

    RETRYABLE = "retryable"
    """Transport errors, timeouts, 408, 409, 429 and 5xx: the same request may be sent again."""
    NOT_PENDING = "not_pending"
    """"Unknown pending tool call": the session does not await this call. Just after the call
    was announced it is the registration race (the service has not registered it yet): worth
    a few retries while the call is listed; otherwise final."""
    ALREADY_ANSWERED = "already_answered"
    """The session already holds a result for this call (an earlier submission landed)."""
    SESSION_GONE = "session_gone"
    """404: the session no longer exists."""
    REFUSED = "refused"
    """Any other 4xx: sending it again will not help."""


class SubmitOutcome(StrEnum):
    """What one submission of a stored result came to."""

    SUBMITTED = "submitted"
    """Accepted by the Agents API (or found already answered there)."""
    ABANDONED = "abandoned"
    """The session is gone or no longer awaits the call."""
    FAILED = "failed"
    """Not accepted this time; the stored result waits for the reconciler."""
    NOT_SENT = "not_sent"
    """No gateway, or no stored result."""
