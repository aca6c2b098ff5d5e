"""The tool_result payload: what the model is told, built once and stored byte for byte."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import pydantic
import pydantic_core

from toolledger.domain.keys import CallKey
from toolledger.domain.redaction import DEFAULT_REDACTOR, Redactor

FAILED_MESSAGE = "Tool handler failed."
"""What the model hears of an unexpected exception: never the exception's text."""
TIMEOUT_MESSAGE = "Tool handler timed out."
OUTPUT_FAILED_MESSAGE = "Tool output could not be returned."
OUTPUT_TOO_LARGE_MESSAGE = "Tool output exceeded the size limit."
UNKNOWN_OUTCOME_MESSAGE = (
    "The tool's outcome is unknown after an interruption; it was not run again. Do not assume it succeeded."
)
POISON_MESSAGE = "Tool handler failed repeatedly and was given up."
NOT_APPROVED_IN_TIME_MESSAGE = "Not run: the call was not approved in time."
DENIED_PREFIX = "Not run: an operator denied the call: "
NOT_EXECUTED_MESSAGE = "The tool's action was not carried out."
"""What the model hears of a ``NotExecuted`` that carries no text of its own."""
GAVE_UP_AFTER_ATTEMPTS = "gave up after "
GAVE_UP_AFTER_DEADLINE = "unknown for more than "
GIVEN_UP_REASONS = (GAVE_UP_AFTER_ATTEMPTS, GAVE_UP_AFTER_DEADLINE)
"""How the audit reason of a call given up begins (settled with POISON_MESSAGE or
UNKNOWN_OUTCOME_MESSAGE by recovery, not by an operator): alerts are raised on it."""


def gave_up_after_attempts(attempts: int) -> str:
    return f"{GAVE_UP_AFTER_ATTEMPTS}{attempts} attempts"


def gave_up_after_deadline(deadline: float) -> str:
    return f"{GAVE_UP_AFTER_DEADLINE}{deadline:g}s: fixed failure submitted"


TOOL_ERROR_MAX_CHARS = 500


class FailureStage(StrEnum):
    LOOKUP = "lookup"
    ARGUMENTS = "arguments"
    EXECUTION = "execution"
    TIMEOUT = "timeout"
    OUTPUT = "output"
    RECOVERY = "recovery"
    APPROVAL = "approval"
    NOT_EXECUTED = "not_executed"
    """The handler said its side effect surely did not happen (``NotExecuted``)."""


class ToolError(Exception):
    """Raise it in a handler to tell the model what went wrong: its message is sent, redacted
    (credentials by shape, secret-named fields, and the values of the call's own secret fields
    wherever they appear: ``ToolError(f"card {card_number} declined")`` reaches the model as
    ``card [REDACTED] declined``) and capped at ``TOOL_ERROR_MAX_CHARS``."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class NotExecuted(Exception):
    """Raise it in a handler when its side effect surely did not happen (the connection was
    refused before anything was sent, say). Even where the effect class forbids a second run,
    the handler is run again within its claim, up to the tool's ``retries``: nothing happened,
    so a retry is not a second effect. Once they are used up, the model is told the message,
    as a ``ToolError``'s (redacted and capped), and may decide to try again itself."""

    def __init__(self, message: str = NOT_EXECUTED_MESSAGE) -> None:
        super().__init__(message)
        self.message = message


class MaybeExecuted(Exception):
    """Raise it in a handler when it cannot tell whether its side effect happened (the
    request was sent, then the answer timed out, say). Where a second run is unsafe
    (``at_most_once``, ``verified``) the call becomes ``unknown`` at once and is settled as
    after a crash mid-run: by the verify hook, an operator or ``unknown_deadline``; the model
    is never told "failed" for what may have happened. Where a second run is safe, the
    handler runs again: within its claim up to the tool's ``retries``, then as an ``unknown``
    call, up to ``max_attempts``. The message goes to the audit trail (redacted), never to
    the model."""

    def __init__(self, message: str = "the handler could not tell whether its effect happened") -> None:
        super().__init__(message)
        self.message = message


@dataclass(frozen=True)
class InDoubt:
    """A run that ended without knowing whether its side effect happened (its handler raised
    ``MaybeExecuted``): there is no result to send; the call becomes ``unknown``."""

    reason: str
    """For the audit trail: what the handler said (redacted when stored)."""
    detail: str | None = None
    """Redacted diagnostic (the traceback) for the audit trail only."""


class OutputError(Exception):
    """The handler's return value cannot be sent; the message is safe for the model."""


@dataclass(frozen=True)
class Outcome:
    """The result of a call as it will be submitted, and what the audit trail keeps of it."""

    payload: dict[str, Any]
    """The ``agent.session.input.tool_result`` event."""
    detail: str | None = None
    """Redacted diagnostic (a traceback) for the audit trail only."""
    stage: FailureStage | None = None
    retried: tuple[str, ...] = ()
    """The exceptions (their class names) the handler was run again after, within its claim,
    before this outcome: said in the audit event that stores it."""

    @property
    def success(self) -> bool:
        return bool(self.payload["success"])

    def payload_json(self) -> str:
        # ASCII escapes keep any text (even lone surrogates) storable in every database.
        return json.dumps(self.payload, separators=(",", ":"))


def succeeded(key: CallKey, output: str | list[dict[str, Any]] | None) -> Outcome:
    return Outcome(
        {
            "type": "agent.session.input.tool_result",
            "turn_id": key.turn_id,
            "call_id": key.call_id,
            "success": True,
            "output": output,
        }
    )


def failed(key: CallKey, message: str, stage: FailureStage, detail: str | None = None) -> Outcome:
    return Outcome(
        {
            "type": "agent.session.input.tool_result",
            "turn_id": key.turn_id,
            "call_id": key.call_id,
            "success": False,
            "error": message,
        },
        detail=detail,
        stage=stage,
    )


def tool_error_message(error: ToolError, redactor: Redactor = DEFAULT_REDACTOR) -> str:
    """A ToolError's message for the model: redacted and capped. A subclass that skipped
    ``ToolError.__init__`` or carries no text gets the fixed message. Pass the call's own
    redactor (``Redactor.for_call`` of its arguments): a message quoting a secret argument's
    bare value has nothing else to be known by."""
    return _message_for_model(error, FAILED_MESSAGE, redactor)


def not_executed_message(error: NotExecuted, redactor: Redactor = DEFAULT_REDACTOR) -> str:
    """A NotExecuted's message for the model, as a ToolError's (redacted and capped); the
    fixed ``NOT_EXECUTED_MESSAGE`` when it carries no text."""
    return _message_for_model(error, NOT_EXECUTED_MESSAGE, redactor)


def _message_for_model(error: ToolError | NotExecuted, fallback: str, redactor: Redactor) -> str:
    """The message an exception meant for the model carries: its own ``message`` (or text),
    redacted and capped; ``fallback`` when it has none, or when reading it fails."""
    try:
        message = error.message if isinstance(getattr(error, "message", None), str) else str(error)
    except Exception:  # an evil __str__
        return fallback
    if not message:
        return fallback
    text = redactor.text(message)
    return _capped(text, TOOL_ERROR_MAX_CHARS)


def validation_message(error: pydantic.ValidationError, redactor: Redactor = DEFAULT_REDACTOR) -> str:
    """What the model needs to correct its arguments, without echoing their values. A custom
    validator's own words are kept (they say what is wrong), redacted: pass the configured
    redactor so the secrets toolledger holds are masked too."""
    problems = []
    for item in error.errors(include_url=False, include_input=False, include_context=False)[:10]:
        location = ".".join(str(part) for part in item["loc"]) or "arguments"
        # A location is made of the model's own keys: cap it, or a huge key floods the reply.
        # Each part is redacted on its own: redacted together, "password: Extra inputs are
        # not permitted" reads as a secret-named field and its value, and loses its message.
        problems.append(f"{redactor.text(_capped(location, 80))}: {redactor.text(item['msg'])}")
    return _capped("Invalid arguments: " + "; ".join(problems), TOOL_ERROR_MAX_CHARS)


def _capped(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def normalize_output(value: Any, max_bytes: int) -> str | list[dict[str, Any]] | None:
    """A handler's return value as the API takes it: a string, a content array, or JSON text."""
    output: str | list[dict[str, Any]] | None
    if value is None or isinstance(value, str):
        output = value
    elif isinstance(value, pydantic.BaseModel):
        output = value.model_dump_json()
    elif _is_content_array(value):
        output = [dict(part) for part in value]
    else:
        if isinstance(value, Iterator):
            value = bounded_list(value, max_bytes)
        try:
            if isinstance(value, Mapping | list | tuple | int | float | bool):
                output = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
            else:
                output = pydantic_core.to_json(value).decode()
        except (TypeError, ValueError, pydantic_core.PydanticSerializationError) as error:
            raise OutputError(OUTPUT_FAILED_MESSAGE) from error
    size = (
        len(output.encode("utf-8", "surrogatepass")) if isinstance(output, str) else len(json.dumps(output))
    )
    if size > max_bytes:
        raise OutputError(OUTPUT_TOO_LARGE_MESSAGE)
    return output


def _is_content_array(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(
            isinstance(part, Mapping)
            and (
                (part.get("type") == "input_text" and isinstance(part.get("text"), str))
                or (part.get("type") == "input_image" and isinstance(part.get("image_url"), str))
            )
            for part in value
        )
    )


def bounded_list(items: Iterator[Any], max_bytes: int) -> list[Any]:
    """Materialise an iterator, but stop once it is surely too large to send."""
    collected: list[Any] = []
    size = 0
    for item in items:
        collected.append(item)
        size += len(repr(item)) if not isinstance(item, str) else len(item)
        if size > max_bytes:
            raise OutputError(OUTPUT_TOO_LARGE_MESSAGE)
    return collected
