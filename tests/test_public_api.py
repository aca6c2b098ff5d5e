from __future__ import annotations

import subprocess
import sys

import toolledger


def test_public_api__every_exported_name_resolves() -> None:
    for name in toolledger.__all__:
        assert getattr(toolledger, name) is not None


def test_public_api__cli_starts_without_importing_the_sdk() -> None:
    code = "import sys, toolledger.cli; print('openai' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=30
    )
    assert result.stdout.strip() == "False"
