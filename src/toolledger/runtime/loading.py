"""Finds the application's tool registry from a ``package.module:attribute`` reference."""

from __future__ import annotations

import importlib
import sys
import traceback
from pathlib import Path

from toolledger.errors import ToolLedgerError
from toolledger.runtime.registry import ToolRegistry


class ToolsNotFoundError(ToolLedgerError):
    code = "tools_not_found"


def load_registry(reference: str) -> ToolRegistry:
    """``package.module:registry`` (a ToolRegistry, or a function returning one).

    Whatever goes wrong is a ToolsNotFoundError with one line that says what and where: the
    operator starting `serve` needs the reason, not a traceback through toolledger's code."""
    module_name, _, attribute = reference.partition(":")
    if not module_name or not attribute:
        raise ToolsNotFoundError(f"expected package.module:attribute, got {reference!r}")
    if module_name.endswith(".py") or "/" in module_name or "\\" in module_name:
        dotted = ".".join(Path(module_name.removesuffix(".py")).parts).strip(".")
        raise ToolsNotFoundError(
            f"{reference!r} names a file: use a module name, as for `python -m` "
            f"({dotted or 'package.module'}:{attribute}, run from the folder that holds it or with "
            "that folder on PYTHONPATH)"
        )
    # Like `python -m`: modules beside the current directory are importable.
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name and module_name.startswith(error.name):
            raise ToolsNotFoundError(f"no module named {module_name!r} (from {reference!r})") from None
        raise ToolsNotFoundError(
            f"importing {module_name!r} failed: it needs the module {error.name!r}, which is not "
            f"installed{_where(error)}"
        ) from None
    except SyntaxError as error:
        raise ToolsNotFoundError(
            f"importing {module_name!r} failed: {error.msg} ({error.filename}, line {error.lineno})"
        ) from None
    except Exception as error:
        raise ToolsNotFoundError(
            f"importing {module_name!r} raised {_described(error)}{_where(error)}"
        ) from None
    try:
        found = getattr(module, attribute)
    except AttributeError:
        raise ToolsNotFoundError(f"module {module_name!r} has no attribute {attribute!r}") from None
    if callable(found) and not isinstance(found, ToolRegistry):
        try:
            found = found()
        except Exception as error:
            raise ToolsNotFoundError(
                f"calling {reference}() raised {_described(error)}{_where(error)}"
            ) from None
    if not isinstance(found, ToolRegistry):
        raise ToolsNotFoundError(
            f"{reference} is not a toolledger ToolRegistry (it is of type {type(found).__name__})"
        )
    return found


def _described(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def _where(error: BaseException) -> str:
    """The innermost frame of the application's code, where the error was raised."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith("<frozen")]
    if not frames:
        return ""
    last = frames[-1]
    return f" (at {last.filename}, line {last.lineno})"
