"""What an Agents API failure means for a submission: the one place that decides."""

from __future__ import annotations

import openai

from toolledger.domain.submissions import SubmissionFailure

PENDING_RACE_CODE = "invalid_request_error"
PENDING_RACE_PREFIX = "Unknown pending tool call: "
"""The SDK's own helper (``openai.lib.streaming.agents._tools.is_pending_call_race``) matches
exactly this code and message: the one refusal whose words the SDK documents. Nothing else
in an error's body is read to decide anything."""


def classify(error: BaseException, call_id: str | None = None) -> SubmissionFailure:
    """What an error of the SDK means for a submission of call ``call_id`` (any call when None)."""
    if isinstance(error, openai.APIConnectionError):  # includes APITimeoutError
        return SubmissionFailure.RETRYABLE
    if isinstance(error, openai.APIStatusError):
        status = error.status_code
        if status in (408, 409, 429) or status >= 500:
            return SubmissionFailure.RETRYABLE
        if status == 404:
            return SubmissionFailure.SESSION_GONE
        if status == 400 and is_pending_race(error, call_id):
            return SubmissionFailure.NOT_PENDING
        return SubmissionFailure.REFUSED
    return SubmissionFailure.REFUSED


def is_pending_race(error: openai.APIStatusError, call_id: str | None) -> bool:
    body = error.body if isinstance(error.body, dict) else {}
    message = body.get("message")
    if body.get("code") != PENDING_RACE_CODE or not isinstance(message, str):
        return False
    return (
        message == f"{PENDING_RACE_PREFIX}{call_id}" if call_id else message.startswith(PENDING_RACE_PREFIX)
    )


def maybe_applied(error: BaseException) -> bool:
    """Whether the API may have applied a request that ended in ``error``: its answer never
    came (a transport error, a timeout) or was a server error. A 4xx is a refusal: the
    request was not applied."""
    if isinstance(error, openai.APIConnectionError):
        return True
    if isinstance(error, openai.APIStatusError):
        return error.status_code >= 500
    return True


def retry_after_seconds(error: BaseException) -> float | None:
    if not isinstance(error, openai.APIStatusError):
        return None
    value = error.response.headers.get("retry-after")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def describe(error: BaseException) -> str:
    """A short description for the audit trail (redacted by the ledger before storing)."""
    if isinstance(error, openai.APIStatusError):
        body = error.body if isinstance(error.body, dict) else {}
        return f"HTTP {error.status_code}: {body.get('message') or error.message}"
    if isinstance(error, openai.APITimeoutError):
        return "timed out"
    if isinstance(error, openai.APIConnectionError):
        return "connection failed"
    return type(error).__name__
