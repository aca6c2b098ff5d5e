"""docs/typed-outcomes.md's example runs as it is and prints what the page says it prints."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tests.support.paths import ROOT

DOC = ROOT / "docs" / "typed-outcomes.md"


def example_code() -> str:
    blocks: list[str] = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.DOTALL)
    [example] = [b for b in blocks if b.startswith('"""Typed outcomes: a payment tool')]
    return example


def test_typed_outcomes_doc__the_example_runs_and_prints_what_the_page_shows(tmp_path: Path) -> None:
    script = tmp_path / "typed_outcomes_example.py"
    script.write_text(example_code(), encoding="utf-8")

    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=180, check=False
    )

    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 5, result.stdout
    assert lines[0].startswith("charge_card A1: executed; the model is told {")
    assert "'success': True, 'output': '{\"charge\": \"ch_A1\"}'}" in lines[0]
    assert lines[1] == "charge_card slow: waiting_for_operator; the model is told nothing yet: unknown"
    assert re.fullmatch(
        r"  settle it: toolledger calls resolve sess_\w+/turn_\w+/call_\w+ --output \.\.\. --reason \.\.\.",
        lines[2],
    )
    assert lines[3].startswith("refund_card B2: executed; the model is told {")
    assert lines[3].endswith(
        "'success': False, 'error': 'The request could not be sent (the connection was refused); "
        "it did not take effect.'}"
    )
    assert lines[4] == "the payment service charged: ['A1', 'slow']"
    assert "toolledger calls resolve" in result.stderr, "the operator is told how to settle it"
