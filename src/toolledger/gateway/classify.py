"""What an Agents API failure means for a submission: the one place that decides."""

from __future__ import annotations

import openai

from toolledger.domain.submissions import SubmissionFailure

PENDING_RACE_CODE = "invalid_request_error"
PENDING_RACE_PREFIX = "Unknown pending tool call: "
ALREADY_ANSWERED_CODE = "tool_result_already_submitted"


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
        if status == 400 and _error_code(error) == ALREADY_ANSWERED_CODE:
            return SubmissionFailure.ALREADY_ANSWERED
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


def _error_code(error: openai.APIStatusError) -> object:
    body = error.body if isinstance(error.body, dict) else {}
    return body.get("code")


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
