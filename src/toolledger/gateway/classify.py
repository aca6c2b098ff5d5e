"""What an Agents API failure means for a submission: the one place that decides."""

from __future__ import annotations

from enum import StrEnum

import openai

PENDING_RACE_CODE = "invalid_request_error"
PENDING_RACE_PREFIX = "Unknown pending tool call: "
ALREADY_ANSWERED_CODE = "tool_result_already_submitted"


class Failure(StrEnum):
    RETRYABLE = "retryable"
    """Transport errors, timeouts, 408, 409, 429 and 5xx: the same request may be sent again."""
    PENDING_RACE = "pending_race"
    """The call was announced before the service registered it: retry shortly."""
    ALREADY_ANSWERED = "already_answered"
    """The session already holds a result for this call (an earlier submission landed)."""
    SESSION_GONE = "session_gone"
    """404: the session no longer exists."""
    REFUSED = "refused"
    """Any other 4xx: sending it again will not help."""


def classify(error: BaseException, call_id: str | None = None) -> Failure:
    if isinstance(error, openai.APIConnectionError):  # includes APITimeoutError
        return Failure.RETRYABLE
    if isinstance(error, openai.APIStatusError):
        status = error.status_code
        if status in (408, 409, 429) or status >= 500:
            return Failure.RETRYABLE
        if status == 404:
            return Failure.SESSION_GONE
        if status == 400 and is_pending_race(error, call_id):
            return Failure.PENDING_RACE
        if status == 400 and _error_code(error) == ALREADY_ANSWERED_CODE:
            return Failure.ALREADY_ANSWERED
        return Failure.REFUSED
    return Failure.REFUSED


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
