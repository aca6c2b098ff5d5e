"""Request bodies the emulator accepts, validated strictly so bad input gets a 400, never a 500."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

METADATA_MAX_PAIRS = 16
METADATA_MAX_KEY = 64
METADATA_MAX_VALUE = 512


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class InputText(_Strict):
    type: Literal["input_text"]
    text: str


class InputImage(_Strict):
    type: Literal["input_image"]
    image_url: str
    detail: Literal["low", "high", "auto", "original"] | None = None


InputContent = Annotated[InputText | InputImage, Field(discriminator="type")]


class InputMessage(_Strict):
    role: Literal["user"]
    content: list[InputContent] = Field(min_length=1)
    type: Literal["message"] = "message"


class MessageInput(_Strict):
    type: Literal["agent.session.input.message"]
    input: list[InputMessage] = Field(min_length=1)


class CancelInput(_Strict):
    type: Literal["agent.session.input.cancel"]


class ToolResultInput(_Strict):
    type: Literal["agent.session.input.tool_result"]
    turn_id: str = Field(min_length=1)
    call_id: str = Field(min_length=1)
    success: bool
    output: str | list[InputContent] | None = None
    error: str | None = None


class ApprovalResultInput(BaseModel):
    """Approval answers are well-formed input, but the emulator never asks for approvals."""

    model_config = ConfigDict(extra="allow")

    type: Literal[
        "agent.session.input.mcp_approval_request_result",
        "agent.session.input.computer_use_approval_request_result",
    ]
    request_id: str


InputEvent = Annotated[
    MessageInput | CancelInput | ToolResultInput | ApprovalResultInput, Field(discriminator="type")
]


class EventsBody(_Strict):
    events: list[InputEvent] = Field(min_length=1, max_length=100)


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class AgentConfig(BaseModel):
    """An inline agent: the settings the emulator echoes are typed; the rest is accepted."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    instructions: str | None = None
    name: str | None = None
    reasoning: ReasoningConfig | None = None
    service_tier: Literal["auto", "default", "flex", "priority", "fast", "ultrafast"] | None = None
    tools: list[dict[str, Any]] | None = None

    def settings(self) -> dict[str, Any]:
        """The settings given, as plain JSON (unset ones left out, so updates merge)."""
        return self.model_dump(mode="json", exclude_unset=True)


class SpendControlBody(BaseModel):
    """A session's spending limit in USD cents; null removes it."""

    model_config = ConfigDict(extra="forbid")

    limit: int | None = Field(gt=0)


class SessionCreateBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    environment: dict[str, Any]
    agent: AgentConfig | None = None
    agent_id: str | None = None
    input: str | list[InputMessage] | None = None
    metadata: dict[str, str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    review: Literal["none", "auto_review"] | None = None
    vault_ids: list[str] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    spend_control: SpendControlBody | None = None

    @field_validator("environment")
    @classmethod
    def _known_environment(cls, value: dict[str, Any]) -> dict[str, Any]:
        if value.get("type") not in ("none", "openai_hosted", "self_hosted"):
            raise ValueError("environment.type must be one of none, openai_hosted, self_hosted")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        check_metadata(value or {})
        return value


def check_metadata(metadata: dict[str, str]) -> None:
    if len(metadata) > METADATA_MAX_PAIRS:
        raise ValueError(f"metadata may hold at most {METADATA_MAX_PAIRS} pairs")
    for key, value in metadata.items():
        if not 1 <= len(key) <= METADATA_MAX_KEY:
            raise ValueError(f"metadata keys must be 1 to {METADATA_MAX_KEY} characters")
        if len(value) > METADATA_MAX_VALUE:
            raise ValueError(f"metadata values must be at most {METADATA_MAX_VALUE} characters")


EVENTS_BODY: TypeAdapter[EventsBody] = TypeAdapter(EventsBody)
SESSION_CREATE_BODY: TypeAdapter[SessionCreateBody] = TypeAdapter(SessionCreateBody)


def describe(error: ValidationError) -> tuple[str, str | None]:
    """A one-line message and the offending parameter, in the API's words."""
    first = error.errors(include_url=False)[0]
    location = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in first["loc"]).lstrip(
        "."
    )
    if first["type"] == "json_invalid":
        return "The request body is not valid JSON.", None
    message = first["msg"]
    return (f"Invalid value for '{location}': {message}." if location else f"{message}."), location or None


def message_text(messages: list[InputMessage]) -> str:
    return " ".join(
        part.text for message in messages for part in message.content if isinstance(part, InputText)
    )
