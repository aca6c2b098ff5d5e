"""toolledger: durable, idempotent execution of function tools for OpenAI Agents API sessions."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from toolledger.version import __version__ as __version__

# Imported on first use, so `toolledger --help` does not pay for the openai SDK's import.
_EXPORTS = {
    "CallKey": "toolledger.domain.keys",
    "CallStatus": "toolledger.domain.states",
    "EffectClass": "toolledger.domain.states",
    "MaybeExecuted": "toolledger.domain.results",
    "NotExecuted": "toolledger.domain.results",
    "Service": "toolledger.runtime.service",
    "Settings": "toolledger.settings",
    "ToolContext": "toolledger.runtime.context",
    "ToolError": "toolledger.domain.results",
    "ToolLedger": "toolledger.runtime.tool_ledger",
    "ToolRegistry": "toolledger.runtime.registry",
    "Verification": "toolledger.runtime.context",
    "classified_http_errors": "toolledger.runtime.http_errors",
    "classify_http_error": "toolledger.runtime.http_errors",
    "current_context": "toolledger.runtime.context",
    "verify_alert_signature": "toolledger.runtime.alert_signature",
}

if TYPE_CHECKING:
    from toolledger.domain.keys import CallKey
    from toolledger.domain.results import MaybeExecuted, NotExecuted, ToolError
    from toolledger.domain.states import CallStatus, EffectClass
    from toolledger.runtime.alert_signature import verify_alert_signature
    from toolledger.runtime.context import ToolContext, Verification, current_context
    from toolledger.runtime.http_errors import classified_http_errors, classify_http_error
    from toolledger.runtime.registry import ToolRegistry
    from toolledger.runtime.service import Service
    from toolledger.runtime.tool_ledger import ToolLedger
    from toolledger.settings import Settings


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'toolledger' has no attribute {name!r}")


__all__ = [
    "CallKey",
    "CallStatus",
    "EffectClass",
    "MaybeExecuted",
    "NotExecuted",
    "Service",
    "Settings",
    "ToolContext",
    "ToolError",
    "ToolLedger",
    "ToolRegistry",
    "Verification",
    "classified_http_errors",
    "classify_http_error",
    "current_context",
    "verify_alert_signature",
]
