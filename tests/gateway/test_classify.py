"""What an Agents API failure means for a submission, with the SDK's own exception objects.

Each error is what the SDK raises for an HTTP answer: the client turns a response into its
exception class (404 → NotFoundError, ...) as it does on the wire. No network.
"""

from __future__ import annotations

from typing import Any

import httpx2
import openai
import pytest

from toolledger.domain.submissions import SubmissionFailure
from toolledger.errors import SessionGoneError, SubmissionError
from toolledger.gateway.classify import (
    PENDING_RACE_CODE,
    PENDING_RACE_PREFIX,
    classify,
    describe,
    is_pending_race,
    maybe_applied,
    retry_after_seconds,
)

URL = "http://agents.test/v1/agents/sessions/sess_1/events"
REQUEST = httpx2.Request("POST", URL)
CLIENT = openai.OpenAI(api_key="sk-test", base_url="http://agents.test/v1")


def status_error(
    status: int, body: Any = None, headers: dict[str, str] | None = None
) -> openai.APIStatusError:
    """The exception the SDK raises for this HTTP answer."""
    payload = {"json": {"error": body}} if body is not None else {"text": "upstream trouble"}
    response = httpx2.Response(status, headers=headers, request=REQUEST, **payload)
    return CLIENT._make_status_error_from_response(response)


def race(call_id: str = "call_1") -> openai.APIStatusError:
    return status_error(400, {"code": PENDING_RACE_CODE, "message": f"{PENDING_RACE_PREFIX}{call_id}"})


# ------------------------------------------------------------------ classify


@pytest.mark.parametrize(
    "error",
    [
        openai.APIConnectionError(request=REQUEST),
        openai.APITimeoutError(request=REQUEST),
    ],
    ids=["connection", "timeout"],
)
def test_transport_errors__retryable(error: openai.OpenAIError) -> None:
    assert classify(error) is SubmissionFailure.RETRYABLE


@pytest.mark.parametrize("status", [408, 409, 429, 500, 502, 503, 504])
def test_timeouts_conflicts_throttling_and_5xx__retryable(status: int) -> None:
    assert classify(status_error(status, {"message": "try later"})) is SubmissionFailure.RETRYABLE


def test_404__the_session_is_gone() -> None:
    error = status_error(404, {"message": "No session found"})

    assert isinstance(error, openai.NotFoundError)
    assert classify(error) is SubmissionFailure.SESSION_GONE


def test_unknown_pending_tool_call__not_pending() -> None:
    assert classify(race("call_1"), "call_1") is SubmissionFailure.NOT_PENDING


def test_unknown_pending_tool_call_without_a_call_named__any_call_counts() -> None:
    assert classify(race("call_9")) is SubmissionFailure.NOT_PENDING


def test_unknown_pending_tool_call_about_another_call__refused() -> None:
    assert classify(race("call_9"), "call_1") is SubmissionFailure.REFUSED


def test_the_pending_race_needs_its_code() -> None:
    error = status_error(400, {"code": "other", "message": f"{PENDING_RACE_PREFIX}call_1"})

    assert not is_pending_race(error, "call_1")
    assert classify(error, "call_1") is SubmissionFailure.REFUSED


def test_the_pending_race_needs_a_text_message() -> None:
    error = status_error(400, {"code": PENDING_RACE_CODE, "message": ["not", "text"]})

    assert not is_pending_race(error, None)
    assert classify(error) is SubmissionFailure.REFUSED


@pytest.mark.parametrize(
    "body",
    [
        {"code": "tool_result_already_submitted", "message": "Tool call call_1 already has a result."},
        {"message": "Tool call call_1 in turn turn_1 has already been answered."},
    ],
    ids=["coded", "worded"],
)
def test_an_already_answered_refusal__is_a_refusal_like_any_other(body: dict[str, str]) -> None:
    """No code or wording the SDK does not document decides anything: the session's state does."""
    assert classify(status_error(400, body), "call_1") is SubmissionFailure.REFUSED


@pytest.mark.parametrize(
    ("error", "applied"),
    [
        (openai.APIConnectionError(request=REQUEST), True),
        (openai.APITimeoutError(request=REQUEST), True),
        (status_error(500), True),
        (status_error(503, {"message": "busy"}), True),
        (status_error(400, {"message": "no"}), False),
        (status_error(409, {"message": "conflict"}), False),
        (status_error(429, {"message": "slow"}), False),
        (race(), False),
    ],
    ids=["connection", "timeout", "500", "503", "400", "409", "429", "race"],
)
def test_maybe_applied__only_when_no_refusal_came_back(error: openai.OpenAIError, applied: bool) -> None:
    assert maybe_applied(error) is applied


@pytest.mark.parametrize("status", [400, 401, 403, 413, 422])
def test_any_other_4xx__refused(status: int) -> None:
    assert classify(status_error(status, {"message": "no"}), "call_1") is SubmissionFailure.REFUSED


def test_a_body_that_is_not_json__refused_by_its_status() -> None:
    error = status_error(400)

    assert not isinstance(error.body, dict)
    assert classify(error) is SubmissionFailure.REFUSED
    assert classify(status_error(503)) is SubmissionFailure.RETRYABLE


def test_an_error_that_is_not_the_sdks__refused() -> None:
    assert classify(ValueError("bad")) is SubmissionFailure.REFUSED
    assert classify(openai.OpenAIError("client-side")) is SubmissionFailure.REFUSED


# ------------------------------------------------------------------ retry-after


def test_retry_after__seconds_from_the_header() -> None:
    assert retry_after_seconds(status_error(429, {"message": "slow"}, {"retry-after": "2.5"})) == 2.5


@pytest.mark.parametrize(
    "error",
    [
        status_error(429, {"message": "slow"}),
        status_error(429, {"message": "slow"}, {"retry-after": "Wed, 21 Oct 2026 07:28:00 GMT"}),
        openai.APIConnectionError(request=REQUEST),
    ],
    ids=["no-header", "http-date", "no-response"],
)
def test_retry_after__none_without_a_number_of_seconds(error: openai.OpenAIError) -> None:
    assert retry_after_seconds(error) is None


# ------------------------------------------------------------------ describe


def test_describe__the_status_and_the_services_message() -> None:
    assert describe(status_error(400, {"message": "bad payload"})) == "HTTP 400: bad payload"


def test_describe__the_sdks_message_when_the_body_has_none() -> None:
    assert describe(status_error(500)) == "HTTP 500: Error code: 500"


@pytest.mark.parametrize(
    ("error", "text"),
    [
        (openai.APITimeoutError(request=REQUEST), "timed out"),
        (openai.APIConnectionError(request=REQUEST), "connection failed"),
        (ValueError("secret detail"), "ValueError"),
    ],
)
def test_describe__transport_errors_without_their_text(error: BaseException, text: str) -> None:
    assert describe(error) == text


# ------------------------------------------------------------------ one vocabulary


def test_the_kind_a_submission_error_carries_is_the_classification_itself() -> None:
    """One enum from the gateway to the executor (it went enum → string → enum)."""
    error = SubmissionError("HTTP 400: no", kind=classify(race(), "call_1"))

    assert error.kind is SubmissionFailure.NOT_PENDING
    spelled: str = error.kind  # a StrEnum: callers comparing strings still match
    assert spelled == "not_pending"
    assert not error.retryable
    assert SubmissionError("x", kind=SubmissionFailure.RETRYABLE).retryable
    assert SessionGoneError("gone").kind is SubmissionFailure.SESSION_GONE
