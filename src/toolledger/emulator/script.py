"""The scripted model: what the emulated agent does in each turn.

A script is a list of steps. Each step issues its function calls in parallel; the next
step starts once every call of the step has a result; after the last step the turn
completes with an assistant message that reflects every result it received.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

SCRIPT_METADATA_KEY = "emulator_script"
"""Session metadata key that selects a script: a registered script's name, or inline JSON."""


class ScriptedCall(BaseModel):
    """One function call the model makes."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    arguments: Any = Field(default_factory=dict)
    """Any JSON value. A string is sent as it is, so a test can send arguments that are not JSON."""


class ScriptStep(BaseModel):
    """Calls issued together; the model waits for all of their results."""

    model_config = ConfigDict(extra="forbid")

    calls: list[ScriptedCall] = Field(min_length=1)
    approvals: list[str] = Field(default_factory=list)
    """MCP server labels: an ``mcp_approval_request`` per label is listed in
    ``required_actions`` beside the step's calls while it waits, as a real agent's MCP tools
    would ask. The emulator does not need them answered; they show that a client leaves
    actions that are not function calls alone."""


class Script(BaseModel):
    """What the model does in every turn of a session."""

    model_config = ConfigDict(extra="forbid")

    steps: list[ScriptStep] = Field(default_factory=list)
    final_message: str | None = None
    """Text of the final answer; by default a summary of the turn's tool results."""
    think_seconds: float = Field(default=0.0, ge=0.0, le=60.0)
    """Delay before each step and before the final answer, as a model would take."""

    @classmethod
    def of_calls(cls, *steps: list[tuple[str, Any]], final_message: str | None = None) -> Script:
        """Build a script from steps given as lists of ``(name, arguments)`` pairs."""
        return cls(
            steps=[
                ScriptStep(calls=[ScriptedCall(name=name, arguments=args) for name, args in step])
                for step in steps
            ],
            final_message=final_message,
        )


class ToolOutcome(BaseModel):
    """A result the model received, as the final message reports it."""

    name: str
    success: bool
    output: Any = None
    error: str | None = None


def final_answer(script: Script, outcomes: list[ToolOutcome], user_text: str) -> str:
    """The assistant's closing message, reflecting every result of the turn."""
    if script.final_message is not None:
        return script.final_message
    if not outcomes:
        return f"You said: {user_text}" if user_text else "Done."
    lines = ["Results:"]
    for outcome in outcomes:
        if outcome.success:
            shown = outcome.output if isinstance(outcome.output, str) else json.dumps(outcome.output)
            lines.append(f"- {outcome.name}: ok {shown}")
        else:
            lines.append(f"- {outcome.name}: failed {outcome.error or ''}".rstrip())
    return "\n".join(lines)
