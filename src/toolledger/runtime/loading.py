"""Finds the application's tool registry from a ``package.module:attribute`` reference."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from toolledger.errors import ToolLedgerError
from toolledger.runtime.registry import ToolRegistry


class ToolsNotFoundError(ToolLedgerError):
    code = "tools_not_found"


def load_registry(reference: str) -> ToolRegistry:
    """``package.module:registry`` (a ToolRegistry, or a function returning one)."""
    module_name, _, attribute = reference.partition(":")
    if not module_name or not attribute:
        raise ToolsNotFoundError(f"expected package.module:attribute, got {reference!r}")
    # Like `python -m`: modules beside the current directory are importable.
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name and module_name.startswith(error.name):
            raise ToolsNotFoundError(f"no module named {module_name!r} (from {reference!r})") from None
        raise
    try:
        found = getattr(module, attribute)
    except AttributeError:
        raise ToolsNotFoundError(f"module {module_name!r} has no attribute {attribute!r}") from None
    if callable(found) and not isinstance(found, ToolRegistry):
        found = found()
    if not isinstance(found, ToolRegistry):
        raise ToolsNotFoundError(f"{reference} is a {type(found).__name__}, not a toolledger ToolRegistry")
    return found
