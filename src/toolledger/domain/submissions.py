"""What became of a stored result sent to the Agents API: one vocabulary from the gateway's
classification of a refusal, through the executor, to the operator's commands."""

from __future__ import annotations

from enum import StrEnum


class SubmissionFailure(StrEnum):
    """Why the Agents API did not take a submission (``SubmissionError.kind``)."""

    RETRYABLE = "retryable"
    """Transport errors, timeouts, 408, 409, 429 and 5xx: the same request may be sent again."""
    NOT_PENDING = "not_pending"
    """400 "Unknown pending tool call: <call_id>" (code ``invalid_request_error``), the answer
    the SDK documents for its registration race: just after the call was announced, the
    service has not registered it yet. Worth a few quick retries of the same request; what
    it means beyond that the session's state decides, not this answer (a real API may give
    it for a call answered already, too)."""
    SESSION_GONE = "session_gone"
    """404: the session no longer exists."""
    REFUSED = "refused"
    """Any other 4xx: the request was not applied. Whether the call is still awaited, answered
    already or abandoned, the session's state decides (its wording is not ours to know)."""


class SubmitOutcome(StrEnum):
    """What one submission of a stored result came to."""

    SUBMITTED = "submitted"
    """Accepted by the Agents API; or no longer awaited by the session after a request that
    may have carried it had gone out (taken as answered by it, and confirmed)."""
    ABANDONED = "abandoned"
    """The session is gone, or no longer awaits a call whose result was never accepted."""
    FAILED = "failed"
    """Not accepted this time; the stored result waits for the reconciler (its request is
    sent again as it is, or the session's state closes it)."""
    NOT_SENT = "not_sent"
    """No gateway, or no stored result."""
