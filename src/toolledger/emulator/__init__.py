"""A local Agents API for tests, benchmarks, the demo, and users testing their own tools.

It speaks the wire format of ``client.beta.agents`` and its sessions (openai >= 3.51), runs a
scripted model, injects faults on request, and records every tool result it receives.
It stands alone: it imports nothing of toolledger's outside this folder, and only the demo
and the CLI (and tests and benchmarks) import it.
"""

from toolledger.emulator.app import create_app
from toolledger.emulator.behaviour import ALREADY_ANSWERED_STYLES, AlreadyAnswered, ApiBehaviour
from toolledger.emulator.control import EmulatorControl, ReceivedToolResult
from toolledger.emulator.faults import (
    AcceptThenDrop,
    AcceptWithoutApply,
    CloseStreams,
    DelayRegistration,
    DropBeforeApply,
    DuplicateEvents,
    FailSubmissions,
    Fault,
    UnknownPending,
)
from toolledger.emulator.script import SCRIPT_METADATA_KEY, Script, ScriptedCall, ScriptStep
from toolledger.emulator.server import EmulatorServer, serve
from toolledger.emulator.state import EmulatorState
from toolledger.emulator.webhooks import WebhookConfig, WebhookCounts, WebhookFaults

__all__ = [
    "ALREADY_ANSWERED_STYLES",
    "SCRIPT_METADATA_KEY",
    "AcceptThenDrop",
    "AcceptWithoutApply",
    "AlreadyAnswered",
    "ApiBehaviour",
    "CloseStreams",
    "DelayRegistration",
    "DropBeforeApply",
    "DuplicateEvents",
    "EmulatorControl",
    "EmulatorServer",
    "EmulatorState",
    "FailSubmissions",
    "Fault",
    "ReceivedToolResult",
    "Script",
    "ScriptStep",
    "ScriptedCall",
    "UnknownPending",
    "WebhookConfig",
    "WebhookCounts",
    "WebhookFaults",
    "create_app",
    "serve",
]
