from __future__ import annotations

import subprocess
import sys

import toolledger


def test_public_api__every_exported_name_is_that_class_or_function_of_toolledger() -> None:
    """A lazy export that pointed at the wrong module, or at an alias, would resolve to
    something else (or raise) here."""
    assert len(set(toolledger.__all__)) == len(toolledger.__all__)
    for name in toolledger.__all__:
        exported = getattr(toolledger, name)
        assert (exported.__name__, exported.__module__.split(".")[0]) == (name, "toolledger")


def test_public_api__cli_starts_without_importing_the_sdk() -> None:
    code = "import sys, toolledger.cli; print('openai' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=30
    )
    assert result.stdout.strip() == "False"
