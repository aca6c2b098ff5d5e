"""The scripted model: what the emulated agent does in each turn.

A script is a list of steps. Each step issues its function calls in parallel; the next
step starts once every call of the step has a result; after the last step the turn
completes with an assistant message that reflects every result it received.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from toolledger.emulator.behaviour import AlreadyAnswered

SCRIPT_METADATA_KEY = "emulator_script"
"""Session (or saved agent) metadata key that selects a script: a registered script's name,
or the script inline as JSON."""


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
    # Left out of the script's JSON when unset: a script travels in 512 characters of metadata.
    already_answered: AlreadyAnswered | None = Field(default=None, exclude_if=lambda value: value is None)
    """How a result for a call answered already is refused in this script's sessions (see
    ``emulator.behaviour``); None: as the emulator's behaviour says."""

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


def final_answer(
    script: Script, outcomes: list[ToolOutcome], user_text: str, *, unscripted_tools: Sequence[str] = ()
) -> str:
    """The assistant's closing message, reflecting every result of the turn.

    ``unscripted_tools``: the agent's tools when no script calls any; the answer then says
    so, since a user watching for calls would otherwise see only silence.
    """
    if script.final_message is not None:
        return script.final_message
    if not outcomes:
        said = f"You said: {user_text}" if user_text else "Done."
        if unscripted_tools:
            said += (
                f"\n(The emulated model called none of its tools ({', '.join(unscripted_tools)}): "
                "it calls tools only as a script says. See docs/emulator.md.)"
            )
        return said
    lines = ["Results:"]
    for outcome in outcomes:
        if outcome.success:
            shown = outcome.output if isinstance(outcome.output, str) else json.dumps(outcome.output)
            lines.append(f"- {outcome.name}: ok {shown}")
        else:
            lines.append(f"- {outcome.name}: failed {outcome.error or ''}".rstrip())
    return "\n".join(lines)


SCRIPT_NAME_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,64}")
"""A name a ``--script NAME=FILE`` registers: it goes in metadata and in URLs as it is."""


def script_option(value: str) -> tuple[str | None, Path]:
    """``[NAME=]FILE`` split into its name (None: the default script) and its file.

    A file whose own name holds ``=`` is still read as a file when it exists.
    """
    name, equals, rest = value.partition("=")
    if equals and SCRIPT_NAME_PATTERN.fullmatch(name) and not Path(value).exists():
        return name, Path(rest)
    return None, Path(value)


def load_script(path: Path) -> Script:
    """A script file; ``ValueError`` says in words what is wrong with it."""
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise ValueError(f"cannot read {path}: {error.strerror or error}") from None
    try:
        return Script.model_validate_json(raw)
    except ValidationError as error:
        raise ValueError(f"{path} is not a valid script:\n{error}") from None
