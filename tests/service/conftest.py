from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def effects_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where the test tools record their side effects (inherited by `serve` subprocesses)."""
    path = tmp_path / "effects.log"
    monkeypatch.setenv("SERVICE_EFFECTS_FILE", str(path))
    return path
