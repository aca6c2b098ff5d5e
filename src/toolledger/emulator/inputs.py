"""Request bodies the emulator accepts, validated strictly so bad input gets a 400, never a 500."""

from __future__ import annotations

import json
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


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
ReasoningSummary = Literal["auto", "concise", "detailed"]
ServiceTier = Literal["auto", "default", "flex", "priority", "fast", "ultrafast"]


# ------------------------------------------------------------- reusable agents
#
# The bodies of client.beta.agents.create/update (types/beta/agent_create_params.py,
# agent_update_params.py, persisted_agent_tool_param.py), field for field: anything the SDK
# would not send is a 400, so a test cannot pass here on a body the service would refuse.

TOOLS_MAX_BYTES = 3 * 1024 * 1024
"""An agent's tool list must fit in 3 MiB of compact UTF-8 JSON."""


class FunctionToolParam(_Strict):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str
    parameters: dict[str, Any]
    defer_loading: bool = False
    async_: bool = Field(default=False, alias="async")


class ToolSearchToolParam(_Strict):
    type: Literal["tool_search"]


class ProgrammaticToolCallingParam(_Strict):
    type: Literal["programmatic_tool_calling"]
    enabled: bool = True


class McpHttpTransportParam(_Strict):
    type: Literal["http"]
    server_url: str = Field(min_length=1)
    headers: dict[str, str] | None = None


class McpStdioTransportParam(_Strict):
    type: Literal["stdio"]
    command: str = Field(min_length=1)
    cwd: str
    args: list[str] | None = None
    env_vars: list[str] | None = None


class McpToolParam(_Strict):
    type: Literal["mcp"]
    server_label: str = Field(min_length=1)
    transport: Annotated[McpHttpTransportParam | McpStdioTransportParam, Field(discriminator="type")]
    allowed_tools: list[str] | None = None
    connection_origin: Literal["service", "environment"] | None = None
    credential_id: str | None = None
    request_metadata: dict[str, Any] | None = None
    required: bool = False


class WebSearchLocationParam(_Strict):
    city: str | None = None
    country: str | None = None
    region: str | None = None
    timezone: str | None = None


class WebSearchToolParam(_Strict):
    type: Literal["web_search"]
    allowed_domains: list[str] | None = None
    context_size: Literal["low", "medium", "high"] | None = None
    location: WebSearchLocationParam | None = None
    mode: Literal["disabled", "cached", "live"] | None = None


class ComputerUseToolParam(_Strict):
    type: Literal["computer_use"]
    include_screenshots: bool = False


class AutomationsToolParam(_Strict):
    type: Literal["automations"]


PersistedToolParam = Annotated[
    FunctionToolParam
    | ToolSearchToolParam
    | ProgrammaticToolCallingParam
    | McpToolParam
    | WebSearchToolParam
    | ComputerUseToolParam
    | AutomationsToolParam,
    Field(discriminator="type"),
]


class CompactionParam(_Strict):
    async_: bool | None = Field(default=None, alias="async")


class ExperimentalParam(_Strict):
    time_awareness: bool = False


class MultiAgentParam(_Strict):
    enabled: bool
    max_concurrent_subagents: int = Field(default=6, ge=1)


class AgentReasoningParam(_Strict):
    effort: ReasoningEffort | None = None
    summary: ReasoningSummary | None = None


class TextFormatTextParam(_Strict):
    type: Literal["text"]


class TextFormatJSONSchemaParam(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class AgentTextParam(_Strict):
    format: Annotated[TextFormatTextParam | TextFormatJSONSchemaParam, Field(discriminator="type")] | None = (
        None
    )
    verbosity: Literal["low", "medium", "high"] | None = None


class _AgentFields(_Strict):
    """What create and update share; every field may be null except ``experimental``."""

    compaction: CompactionParam | None = None
    experimental: ExperimentalParam = Field(default_factory=ExperimentalParam)
    instructions: str | None = None
    metadata: dict[str, str] | None = None
    multi_agent: MultiAgentParam | None = None
    name: str | None = None
    reasoning: AgentReasoningParam | None = None
    service_tier: ServiceTier | None = None
    text: AgentTextParam | None = None
    tools: list[PersistedToolParam] | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        check_metadata(value or {})
        return value

    @field_validator("tools")
    @classmethod
    def _tool_list(cls, value: list[PersistedToolParam] | None) -> list[PersistedToolParam] | None:
        if value is None:
            return value
        functions = [tool for tool in value if isinstance(tool, FunctionToolParam)]
        names = [tool.name for tool in functions]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"function tool names must be unique; repeated: {', '.join(repeated)}")
        # A deferred function is found only through tool search (the registry adds it).
        if any(tool.defer_loading for tool in functions) and not any(
            isinstance(tool, ToolSearchToolParam) for tool in value
        ):
            raise ValueError("a function with defer_loading needs a tool_search tool in the list")
        size = len(
            json.dumps(
                [tool.model_dump(mode="json", by_alias=True, exclude_unset=True) for tool in value],
                separators=(",", ":"),
                ensure_ascii=False,
            ).encode()
        )
        if size > TOOLS_MAX_BYTES:
            raise ValueError(f"the tool list is {size} bytes of JSON, over the {TOOLS_MAX_BYTES} allowed")
        return value

    def settings(self) -> dict[str, Any]:
        """The fields given, as JSON under their wire names; null ones kept (they reset)."""
        return self.model_dump(mode="json", by_alias=True, exclude_unset=True)


class AgentCreateBody(_AgentFields):
    model: str = Field(min_length=1)


class AgentUpdateBody(_AgentFields):
    model: str | None = Field(default=None, min_length=1)

    @field_validator("model")
    @classmethod
    def _model_not_null(cls, value: str | None) -> str:
        # The model can be replaced, never removed: null is not a model name.
        if value is None:
            raise ValueError("Input should be a valid string")
        return value


AGENT_CREATE_BODY: TypeAdapter[AgentCreateBody] = TypeAdapter(AgentCreateBody)
AGENT_UPDATE_BODY: TypeAdapter[AgentUpdateBody] = TypeAdapter(AgentUpdateBody)


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    effort: ReasoningEffort | None = None
    summary: ReasoningSummary | None = None


class AgentConfig(BaseModel):
    """An inline agent: the settings the emulator echoes are typed; the rest is accepted."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    instructions: str | None = None
    name: str | None = None
    reasoning: ReasoningConfig | None = None
    service_tier: ServiceTier | None = None
    tools: list[dict[str, Any]] | None = None
    text: AgentTextParam | None = None
    multi_agent: MultiAgentParam | None = None
    compaction: CompactionParam | None = None
    experimental: ExperimentalParam | None = None

    def settings(self) -> dict[str, Any]:
        """The settings given, as plain JSON (unset ones left out, so updates merge)."""
        return self.model_dump(mode="json", by_alias=True, exclude_unset=True)


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


def describe(error: ValidationError, document: Any = None) -> tuple[str, str | None]:
    """A one-line message and the offending parameter, in the API's words.

    ``document``: the JSON that failed, so the location can be spelled as the request's
    own path (pydantic puts each tagged union's tag in it: ``tools[0].function.name``).
    """
    first = error.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        return "The request body is not valid JSON.", None
    location = "".join(
        f"[{part}]" if isinstance(part, int) else f".{part}" for part in _request_path(first["loc"], document)
    ).lstrip(".")
    message = first["msg"].removeprefix("Value error, ")
    return (f"Invalid value for '{location}': {message}." if location else f"{message}."), location or None


def _request_path(loc: tuple[int | str, ...], document: Any) -> list[int | str]:
    path: list[int | str] = []
    node = document
    for part in loc:
        if isinstance(node, dict) and part not in node and part == node.get("type"):
            continue  # a union's tag, not a key of the request
        path.append(part)
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        else:
            node = None
    return path


def first_error(error: ValidationError) -> str:
    """The first problem of a validation error, in one line."""
    message, _param = describe(error)
    return message


def message_text(messages: list[InputMessage]) -> str:
    return " ".join(
        part.text for message in messages for part in message.content if isinstance(part, InputText)
    )
