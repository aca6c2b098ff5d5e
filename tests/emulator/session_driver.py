"""Steps tests take against the emulator, through the real SDK only."""

from __future__ import annotations

import openai
from openai import OpenAI
from openai.types.beta.agent_session import (
    AgentSession,
    RequiredActionSessionRequiredActionResourceFunctionCall,
)
from openai.types.beta.agent_session_input_param import (
    SessionInputParamAgentSessionInputToolResult as ToolResultParam,
)

from tests.support.polling import eventually_sync
from toolledger.emulator import Script

FunctionCallAction = RequiredActionSessionRequiredActionResourceFunctionCall


def new_session(client: OpenAI, script: Script | None = None, **metadata: str) -> str:
    if script is not None:
        metadata["emulator_script"] = script.model_dump_json()
    session = client.beta.agents.sessions.create(
        environment={"type": "none"}, agent={"model": "emulated"}, metadata=metadata
    )
    return session.id


def start_turn(client: OpenAI, session_id: str, text: str = "go") -> None:
    client.beta.agents.sessions.events.create(
        session_id,
        events=[
            {
                "type": "agent.session.input.message",
                "input": [{"role": "user", "content": [{"type": "input_text", "text": text}]}],
            }
        ],
    )


def tool_result(
    action: FunctionCallAction,
    *,
    output: str | None = None,
    error: str | None = None,
    call_id: str | None = None,
) -> ToolResultParam:
    """The ``tool_result`` input event answering ``action`` (a failure when ``error`` is given)."""
    event: ToolResultParam = {
        "type": "agent.session.input.tool_result",
        "turn_id": action.turn_id,
        "call_id": call_id if call_id is not None else action.call_id,
        "success": error is None,
    }
    if error is None:
        event["output"] = output
    else:
        event["error"] = error
    return event


def submit(
    client: OpenAI, session_id: str, action: FunctionCallAction, *, output: str, key: str | None = None
) -> None:
    client.beta.agents.sessions.events.create(
        session_id,
        events=[tool_result(action, output=output)],
        idempotency_key=key if key is not None else openai.omit,
    )


def wait_for_status(client: OpenAI, session_id: str, status: str, timeout: float = 5.0) -> AgentSession:
    seen: list[AgentSession] = []  # the last one retrieved

    def reached() -> AgentSession | None:
        seen[:] = [client.beta.agents.sessions.retrieve(session_id)]
        return seen[0] if seen[0].status == status else None

    return eventually_sync(
        reached,
        within=timeout,
        what=lambda: f"session {session_id} is {seen[0].status}, not {status}",
        interval=0.01,
    )


def pending_calls(session: AgentSession) -> list[FunctionCallAction]:
    return [action for action in session.required_actions if isinstance(action, FunctionCallAction)]


def first_pending_call(client: OpenAI, session_id: str) -> FunctionCallAction:
    return pending_calls(wait_for_status(client, session_id, "requires_action"))[0]
