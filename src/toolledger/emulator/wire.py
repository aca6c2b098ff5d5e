"""JSON shapes of the Agents API as the openai SDK parses them (types/beta/agent*.py).

Every object the emulator sends is built here, so one file answers "what does the wire
look like"; tests parse each of them with the SDK's strict validation.
"""

from __future__ import annotations

import secrets
import string
import time
from typing import Any

_ALPHANUMERIC = string.ascii_letters + string.digits


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def now() -> int:
    return int(time.time())


def obfuscation() -> str:
    """Random padding the real service adds to stream events unless asked not to."""
    return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(secrets.randbelow(16) + 4))


def _settings(config: dict[str, Any]) -> dict[str, Any]:
    """An agent's resolved settings: what the service echoes for what was left out or null."""
    reasoning = config.get("reasoning") or {}
    multi_agent = config.get("multi_agent") or {}
    text = config.get("text") or {}
    compaction = config.get("compaction") or {}
    experimental = config.get("experimental") or {}
    return {
        "instructions": config.get("instructions"),
        "model": config.get("model") or "emulated-model",
        "name": config.get("name"),
        "multi_agent": (
            {"enabled": True, "max_concurrent_subagents": multi_agent.get("max_concurrent_subagents", 6)}
            if multi_agent.get("enabled")
            else {"enabled": False, "max_concurrent_subagents": None}
        ),
        "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
        "service_tier": config.get("service_tier") or "auto",
        "text": {
            "format": text.get("format") or {"type": "text"},
            "verbosity": text.get("verbosity") or "medium",
        },
        "compaction": {"async": bool(compaction.get("async"))},
        "experimental": {"time_awareness": bool(experimental.get("time_awareness"))},
    }


def agent(agent_id: str, config: dict[str, Any]) -> dict[str, Any]:
    """The session's effective agent. Only function tools are echoed: the SDK's AgentTool
    union has no ``tool_search`` entry, and the emulator runs no hosted tools."""
    tools = [
        {
            "type": "function",
            "name": tool["name"],
            "description": tool.get("description", ""),
            "parameters": tool.get("parameters", {}),
            "defer_loading": bool(tool.get("defer_loading", False)),
        }
        for tool in config.get("tools") or []
        if isinstance(tool, dict) and tool.get("type") == "function" and isinstance(tool.get("name"), str)
    ]
    return {"id": agent_id, **_settings(config), "tools": tools}


def reusable_agent(
    agent_id: str, config: dict[str, Any], *, created_at: int, updated_at: int
) -> dict[str, Any]:
    """A saved agent (types/beta/agent.py), from the create and update fields it was given."""
    return {
        "id": agent_id,
        "object": "agent",
        "created_at": created_at,
        "updated_at": updated_at,
        "metadata": dict(config.get("metadata") or {}),
        **_settings(config),
        "tools": [persisted_tool(tool) for tool in config.get("tools") or []],
    }


def persisted_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """One tool of a saved agent, every default filled in as the service reports it."""
    kind = tool["type"]
    if kind == "function":
        return {
            "type": "function",
            "name": tool["name"],
            "description": tool["description"],
            "parameters": tool["parameters"],
            "defer_loading": bool(tool.get("defer_loading", False)),
            "async": bool(tool.get("async", False)),
        }
    if kind == "programmatic_tool_calling":
        return {"type": kind, "enabled": tool.get("enabled", True)}
    if kind == "mcp":
        transport = dict(tool["transport"])
        if transport["type"] == "http":
            transport["headers"] = transport.get("headers") or {}
        else:
            transport["args"] = transport.get("args") or []
            transport["env_vars"] = transport.get("env_vars") or []
        return {
            "type": kind,
            "server_label": tool["server_label"],
            "transport": transport,
            "allowed_tools": tool.get("allowed_tools"),
            "connection_origin": tool.get("connection_origin") or "service",
            "credential_id": tool.get("credential_id"),
            "request_metadata": tool.get("request_metadata") or {},
            "required": bool(tool.get("required", False)),
        }
    if kind == "web_search":
        return {
            "type": kind,
            "allowed_domains": tool.get("allowed_domains"),
            "context_size": tool.get("context_size") or "medium",
            "location": tool.get("location"),
            "mode": tool.get("mode") or "live",
        }
    if kind == "computer_use":
        return {"type": kind, "include_screenshots": bool(tool.get("include_screenshots", False))}
    return {"type": kind}


def agent_deleted(agent_id: str) -> dict[str, Any]:
    return {"id": agent_id, "deleted": True, "object": "agent.deleted"}


def session(
    *,
    session_id: str,
    agent_json: dict[str, Any],
    created_at: int,
    last_active_at: int,
    metadata: dict[str, str],
    status: str,
    error: str | None,
    required_actions: list[dict[str, Any]],
    spend_limit: int | None = None,
    vault_ids: list[str] | None = None,
) -> dict[str, Any]:
    return {
        "id": session_id,
        "object": "agent.session",
        "agent": agent_json,
        "created_at": created_at,
        "last_active_at": last_active_at,
        "environment": {"type": "none"},
        "error": error,
        "metadata": dict(metadata),
        "required_actions": required_actions,
        "spend_control": {"consumed": 0, "limit": spend_limit},
        "status": status,
        "usage": None,
        "vault_ids": list(vault_ids or []),
    }


def session_deleted(session_id: str) -> dict[str, Any]:
    return {"id": session_id, "deleted": True, "object": "agent.session.deleted"}


def turn(
    *,
    turn_id: str,
    session_id: str,
    agent_id: str,
    status: str,
    created_at: int,
    started_at: int | None,
    completed_at: int | None,
    error: dict[str, str] | None,
) -> dict[str, Any]:
    return {
        "id": turn_id,
        "object": "agent.session.turn",
        "agent_id": agent_id,
        "session_id": session_id,
        "status": status,
        "created_at": created_at,
        "started_at": started_at,
        "completed_at": completed_at,
        "error": error,
        "subagent_id": None,
        "usage": None,
    }


def function_call_action(*, turn_id: str, call_id: str, name: str, arguments: Any) -> dict[str, Any]:
    """An entry of ``session.required_actions``."""
    return {
        "type": "function_call",
        "turn_id": turn_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }


def mcp_approval_action(*, turn_id: str, request_id: str, server_label: str) -> dict[str, Any]:
    """An MCP tool-call approval request in ``session.required_actions`` (not a function call)."""
    return {
        "type": "mcp_approval_request",
        "turn_id": turn_id,
        "request_id": request_id,
        "request": {
            "type": "mcp_tool_call",
            "server_label": server_label,
            "name": "delete_everything",
            "arguments": {},
            "message": f"{server_label} asks to run delete_everything",
        },
    }


def function_call_item(
    *, item_id: str, turn_id: str, call_id: str, name: str, arguments: Any, status: str
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "turn_id": turn_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def function_call_output_item(*, item_id: str, turn_id: str, result: dict[str, Any]) -> dict[str, Any]:
    success = bool(result.get("success"))
    return {
        "type": "function_call_output",
        "id": item_id,
        "turn_id": turn_id,
        "call_id": result["call_id"],
        "status": "completed" if success else "failed",
        "output": result.get("output") if success else None,
        "error": None if success else result.get("error"),
    }


def user_message_item(*, item_id: str, turn_id: str, content: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "turn_id": turn_id,
        "role": "user",
        "status": "completed",
        "content": content,
    }


def assistant_message_item(*, item_id: str, turn_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "turn_id": turn_id,
        "role": "assistant",
        "phase": "final_answer",
        "status": status,
        "content": [{"type": "output_text", "text": text}] if status == "completed" else [],
    }


def event(event_type: str, **fields: Any) -> dict[str, Any]:
    return {"type": event_type, "event_id": new_id("evt"), **fields}


def error_body(
    message: str, *, error_type: str, code: str | None, param: str | None = None
) -> dict[str, Any]:
    """The error envelope of the OpenAI API; the SDK reads ``body["error"]``."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}
