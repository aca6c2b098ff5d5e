"""The ledger's commands start without what they don't use: the SDK, the HTTP server and
Alembic were most of the 1.3-4 s a command took before its first line."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("openai", "fastapi", "starlette", "uvicorn", "alembic", "httpx")

PROBE = """
import sys
from toolledger.cli import main
try:
    main(sys.argv[1:], standalone_mode=False)
finally:
    print(sorted(name for name in {heavy!r} if name in sys.modules), file=sys.stderr)
"""


@pytest.mark.parametrize(
    "command", [["status"], ["calls", "list"], ["sessions", "list"], ["calls", "verify-trail", "--all"]]
)
def test_ledger_command__on_a_current_ledger__imports_no_sdk_server_or_alembic(
    sqlite_url: str, command: list[str]
) -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROBE.format(heavy=HEAVY), *command],
        capture_output=True,
        text=True,
        timeout=60,
        env={"TOOLLEDGER_DATABASE_URL": sqlite_url, "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip().splitlines()[-1] == "[]", result.stderr
