"""Where the checkout is, for tests that run its files (the README, migrations, scripts)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository's top folder."""
