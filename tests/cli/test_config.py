"""The configuration reference is generated from the settings model and kept in step with it;
`toolledger config` shows what is in effect without showing a secret; a bad value is refused
by its variable's name, without echoing it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import ROOT
from toolledger.settings import Settings
from toolledger.settings_reference import options, reference_markdown


def _toolledger(*args: str, **environment: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOOLLEDGER_")}
    return subprocess.run(
        [sys.executable, "-m", "toolledger.cli", *args],
        env={**env, **environment},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _config(*args: str, **environment: str) -> subprocess.CompletedProcess[str]:
    return _toolledger("config", *args, **environment)


def test_docs_configuration__is_what_the_model_generates() -> None:
    written = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    regenerate = "toolledger config --reference > docs/configuration.md"
    assert written == reference_markdown(), regenerate


def test_reference__lists_every_option_with_its_variable_default_and_meaning() -> None:
    reference = reference_markdown()
    assert {option.name for option in options()} == set(Settings.model_fields)
    for option in options():
        assert option.meaning, f"{option.name} has no description"
        assert f"| `{option.variable}` |" in reference
    lease = next(option for option in options() if option.name == "lease_seconds")
    assert (lease.variable, lease.default) == ("TOOLLEDGER_LEASE_SECONDS", "30.0")


def test_config_json__shows_values_and_their_source_and_masks_every_secret() -> None:
    secrets = {
        "TOOLLEDGER_OPENAI_API_KEY": "sk-config-canary-0001",
        "TOOLLEDGER_API_TOKENS": json.dumps({"alice": "config-canary-token-0002"}),
        "TOOLLEDGER_DATABASE_URL": "postgresql://app:config-canary-pw-0003@db.example/ledger",
        "TOOLLEDGER_TRAIL_KEY": "config-canary-trail-key-0005-0123456789",
    }
    shown = _config("--json", TOOLLEDGER_LEASE_SECONDS="12.5", **secrets)
    assert shown.returncode == 0, shown.stderr
    for canary in (
        "sk-config-canary-0001",
        "config-canary-token-0002",
        "config-canary-pw-0003",
        "trail-key-0005",
    ):
        assert canary not in shown.stdout
    rows = {row["name"]: row for row in json.loads(shown.stdout)}
    assert rows["lease_seconds"] == {
        "name": "lease_seconds",
        "variable": "TOOLLEDGER_LEASE_SECONDS",
        "value": 12.5,
        "source": "set",
    }
    assert rows["max_attempts"]["source"] == "default"
    assert rows["api_tokens"]["value"] == {"alice": "[REDACTED]"}
    assert rows["database_url"]["value"] == "postgresql+psycopg://app:[REDACTED]@db.example/ledger"
    assert rows["trail_key"]["value"] == "[REDACTED]"
    redactor = Settings(trail_key=secrets["TOOLLEDGER_TRAIL_KEY"]).redactor()
    assert "trail-key-0005" not in redactor.text(f"a log line quoting {secrets['TOOLLEDGER_TRAIL_KEY']}")

    table = _config(**secrets)
    assert table.returncode == 0, table.stderr
    assert "TOOLLEDGER_LEASE_SECONDS" in table.stdout
    assert "sk-config-canary-0001" not in table.stdout


def test_config__bad_values__exit_2_naming_the_variable_without_echoing_the_value() -> None:
    refused = _config(
        TOOLLEDGER_LEASE_SECONDS="-1",
        TOOLLEDGER_API_TOKENS='{"alice": 7}',
        TOOLLEDGER_TRAIL_KEY="short-canary",
    )
    assert refused.returncode == 2
    assert "TOOLLEDGER_LEASE_SECONDS: Input should be greater than 0" in refused.stderr
    assert "TOOLLEDGER_TRAIL_KEY: the trail key must be at least 32 bytes" in refused.stderr
    assert "short-canary" not in refused.stderr
    assert "TOOLLEDGER_API_TOKENS (alice): Input should be a valid string" in refused.stderr
    assert "-1" not in refused.stderr

    not_json = _config(TOOLLEDGER_API_TOKENS='{"bob": "config-canary-token-0004"')
    assert not_json.returncode == 2
    assert "TOOLLEDGER_API_TOKENS: not valid JSON" in not_json.stderr
    assert "api_tokens" not in not_json.stderr, "the variable, not the internal field"
    assert "lists and maps are JSON" in not_json.stderr
    assert "config-canary-token-0004" not in not_json.stderr
    assert "Traceback" not in not_json.stderr


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("nonsense", "not a database URL (or its port is not a number)"),
        ("postgresql://u:pw-s3cret@host:notaport/db", "not a database URL (or its port is not a number)"),
        ("mysql://u:pw-s3cret@h/db", "mysql is not supported: the ledger lives in SQLite or PostgreSQL"),
        ("postgresql+asyncpg://u:pw-s3cret@h/db", "the asyncpg driver is not supported"),
    ],
)
@pytest.mark.parametrize(
    "command",
    [
        ("config",),
        ("status",),
        ("calls", "list"),
        ("migrate",),
        ("serve", "--tools", "tests.support.service_tools:registry"),
    ],
)
def test_a_database_url_no_command_can_open__one_line_naming_the_variable(
    url: str, reason: str, command: tuple[str, ...]
) -> None:
    done = _toolledger(
        *command, TOOLLEDGER_DATABASE_URL=url, TOOLLEDGER_OPENAI_BASE_URL="http://127.0.0.1:1/v1"
    )
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert f"TOOLLEDGER_DATABASE_URL: {reason}" in done.stderr
    assert "Traceback" not in output
    assert "s3cret" not in output, "the URL (its password) is never echoed"


def test_a_map_that_is_not_json__named_by_its_variable() -> None:
    done = _config(TOOLLEDGER_API_TOKENS="alice:abc")
    assert done.returncode == 2
    assert "TOOLLEDGER_API_TOKENS: not valid JSON" in done.stderr
    assert "api_tokens" not in done.stderr, "the variable, not the internal field"
    assert "alice:abc" not in done.stderr, "the value is never echoed"


@pytest.mark.parametrize("command", [("status",), ("sessions", "list"), ("config",), ("calls", "list")])
def test_commands_that_never_talk_to_the_agents_api__do_not_import_openai(
    command: tuple[str, ...], tmp_path: Path
) -> None:
    """Importing the SDK costs about a second at every start of a command that never uses it."""
    probe = (
        "import sys\n"
        "from toolledger.cli import main\n"
        f"main({list(command)!r}, standalone_mode=False)\n"
        "print('openai imported' if 'openai' in sys.modules else 'openai not imported')\n"
    )
    ledger = tmp_path / "ledger.sqlite3"
    migrated = _toolledger("migrate", TOOLLEDGER_DATABASE_URL=f"sqlite:///{ledger}")
    assert migrated.returncode == 0, migrated.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOOLLEDGER_")}
    done = subprocess.run(
        [sys.executable, "-c", probe],
        env={**env, "TOOLLEDGER_DATABASE_URL": f"sqlite:///{ledger}"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("openai not imported")
