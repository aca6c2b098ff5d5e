"""docker-compose.yml and the Dockerfile, checked without Docker (it cannot run here): the
compose file has the services, replicas, profiles, ordering and healthchecks it promises,
every toolledger command it names parses with the real CLI, and those commands run here,
outside containers, against PostgreSQL and the emulator, as they would in them."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest

from tests.support.paths import ROOT
from tests.support.polling import eventually_sync
from toolledger.cli import main

yaml = pytest.importorskip("yaml")

_VARIABLE = re.compile(r"\$\{(?P<name>\w+)(?::[-?](?P<default>[^}]*))?\}")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text(encoding="utf-8"))
    return loaded


def _resolved(text: str, environment: dict[str, str]) -> str:
    """Compose's ${NAME:-default} / ${NAME:?message}, from ``environment``."""

    def value(match: re.Match[str]) -> str:
        name = match["name"]
        if name in environment:
            return environment[name]
        if match.group(0).startswith(f"${{{name}:?"):
            raise AssertionError(f"{name} is required by the compose file")
        return match["default"] or ""

    return _VARIABLE.sub(value, text)


def _parses(args: list[str]) -> click.Context:
    """The command line as the real CLI parses it (options unknown or invalid fail here)."""
    parent = main.make_context("toolledger", list(args[:1]), resilient_parsing=False)
    command = main.get_command(parent, args[0])
    assert command is not None, f"toolledger has no command {args[0]!r}"
    return command.make_context(args[0], list(args[1:]), parent=parent)


def test_compose__services_order_health_and_scale(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) >= {"postgres", "migrate", "serve", "api", "emulator"}
    assert services["migrate"]["command"] == ["migrate"]
    assert services["migrate"]["restart"] == "no"
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name in ("serve", "api"):
        assert services[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert services["serve"]["deploy"]["replicas"] == 2
    assert services["emulator"]["profiles"] == ["emulator"]
    assert services["api"]["profiles"] == ["api"], "a plain `up` needs no API token"
    for name in ("postgres", "serve", "api", "emulator"):
        assert services[name]["healthcheck"]["test"][0] == "CMD", name
    # The process, not only the database: this container's replica must be alive.
    assert services["serve"]["healthcheck"]["test"][1:] == ["toolledger", "status", "--replica-here"]
    # The user's tools are importable, and the demo's world is one for every replica.
    assert "${TOOLLEDGER_APP_DIR:-.}:/srv/app:ro" in services["serve"]["volumes"]
    assert services["serve"]["environment"]["PYTHONPATH"] == "/srv/app"
    world = services["serve"]["environment"]["TOOLLEDGER_DEMO_WORLD"]
    assert any(
        v.startswith("shop-world:") and world.startswith(v.split(":")[1])
        for v in services["serve"]["volumes"]
    )
    assert "shop-world" in compose["volumes"]
    for name in ("migrate", "serve", "api", "emulator"):
        environment = services[name]["environment"]
        assert environment["TOOLLEDGER_DATABASE_URL"].startswith("postgresql://"), name
        assert services[name]["build"] == "."
    assert "TOOLLEDGER_API_TOKENS" in services["api"]["environment"], "the API listens on 0.0.0.0"


def test_compose__no_variable_is_required_and_no_key_is_made_up() -> None:
    """A `${NAME:?}` breaks every compose command until it is set; a default key would be
    sent to the public API by whoever forgot theirs."""
    text = (ROOT / "docker-compose.yml").read_text(encoding="utf-8")
    assert not [m.group(0) for m in _VARIABLE.finditer(text) if m.group(0).startswith(f"${{{m['name']}:?")]
    assert "${OPENAI_API_KEY:-}" in text
    assert "sk-" not in text.replace("OPENAI_API_KEY=sk-...", "")


def test_compose__config_is_valid_for_compose_itself(tmp_path: Path) -> None:
    """Where a compose binary exists (CI machines may have one), it parses the file."""
    for command in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(command[0]) is None:
            continue
        probe = subprocess.run([*command, "version"], capture_output=True, text=True, check=False)
        if probe.returncode != 0:
            continue
        checked = subprocess.run(
            [
                *command,
                "-f",
                str(ROOT / "docker-compose.yml"),
                "--profile",
                "emulator",
                "--profile",
                "api",
                "config",
                "-q",
            ],
            capture_output=True,
            text=True,
            check=False,
            cwd=tmp_path,
        )
        assert checked.returncode == 0, checked.stderr
        return
    pytest.skip("no compose binary on this machine")


def test_dockerfile__installs_the_tested_versions() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text(encoding="utf-8")
    assert "COPY .ci/constraints.txt ./constraints.txt" in dockerfile
    assert "pip install . -c constraints.txt" in dockerfile


def test_compose__every_toolledger_command_parses(compose: dict[str, Any]) -> None:
    environment = {"TOOLLEDGER_API_TOKENS": '{"ops": "t"}'}
    checked = 0
    for name, service in compose["services"].items():
        commands = []
        if "command" in service:
            commands.append([_resolved(part, environment) for part in service["command"]])
        probe = service.get("healthcheck", {}).get("test", [])
        if probe[1:2] == ["toolledger"]:
            commands.append(probe[2:])
        for args in commands:
            _parses(args)
            checked += 1
        assert name == "postgres" or commands, f"{name} runs no toolledger command"
    assert checked >= 5


def test_dockerfile__copies_what_exists_and_runs_toolledger() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text(encoding="utf-8")
    for line in dockerfile.splitlines():
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), f"COPY {source}: no such file"
    assert 'ENTRYPOINT ["toolledger"]' in dockerfile
    assert re.search(r"^USER \w+", dockerfile, re.MULTILINE), "the service does not run as root"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class _Service:
    """One compose service's command, run here as a process with the compose environment,
    host names and ports rewritten to this machine's."""

    def __init__(self, args: list[str], environment: dict[str, str], log_path: Path) -> None:
        self.log_path = log_path
        self._log = log_path.open("wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "toolledger.cli", *args],
            cwd=ROOT,
            env={**os.environ, **environment, "PYTHONPATH": str(ROOT)},
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        code = self.process.wait(timeout=40)
        self._log.close()
        return code

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")


def _wait_http(url: str, service: _Service, timeout: float = 30.0) -> None:

    def answered() -> bool:
        assert service.process.poll() is None, service.log()
        try:
            with urllib.request.urlopen(url, timeout=2) as answer:  # noqa: S310 - loopback
                return bool(answer.status == 200)
        except OSError:
            return False

    eventually_sync(
        answered, within=timeout, what=lambda: f"{url} never answered:\n{service.log()}", interval=0.2
    )


@pytest.fixture
def services() -> Iterator[list[_Service]]:
    started: list[_Service] = []
    yield started
    for service in started:
        service.stop()


def _run_here(args: list[str], ports: dict[str, str]) -> list[str]:
    return [ports.get(arg, arg) for arg in args]


def test_compose__commands_run_outside_docker(
    compose: dict[str, Any], postgres_url: str, tmp_path: Path, services: list[_Service]
) -> None:
    emulator_port, api_port = str(_free_port()), str(_free_port())
    ports = {"8080": emulator_port, "8700": api_port, "0.0.0.0": "127.0.0.1"}
    base_url = f"http://127.0.0.1:{emulator_port}/v1"
    here = {
        "TOOLLEDGER_DATABASE_URL": postgres_url,
        "TOOLLEDGER_OPENAI_BASE_URL": base_url,
        "TOOLLEDGER_OPENAI_API_KEY": "sk-local-emulator",
        "TOOLLEDGER_API_TOKENS": '{"ops": "a-long-random-token"}',
        "TOOLLEDGER_LOG_FORMAT": "json",
    }

    def command(name: str) -> list[str]:
        return _run_here([_resolved(part, here) for part in compose["services"][name]["command"]], ports)

    migrated = subprocess.run(
        [sys.executable, "-m", "toolledger.cli", *command("migrate")],
        cwd=ROOT,
        env={**os.environ, **here},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert migrated.returncode == 0, migrated.stderr
    assert "ledger schema:" in migrated.stdout

    emulator = _Service(command("emulator"), here, tmp_path / "emulator.log")
    services.append(emulator)
    _wait_http(f"http://127.0.0.1:{emulator_port}/_emulator/health", emulator)

    api = _Service(command("api"), here, tmp_path / "api.log")
    services.append(api)
    _wait_http(f"http://127.0.0.1:{api_port}/readyz", api)

    replicas = [
        _Service(command("serve"), here, tmp_path / f"serve-{n}.log")
        for n in range(compose["services"]["serve"]["deploy"]["replicas"])
    ]
    services.extend(replicas)

    def all_serving() -> bool:
        if all("serving" in replica.log() for replica in replicas):
            return True
        for replica in replicas:
            assert replica.process.poll() is None, replica.log()
        return False

    eventually_sync(
        all_serving, within=40, what=lambda: str([replica.log() for replica in replicas]), interval=0.2
    )

    probe = compose["services"]["serve"]["healthcheck"]["test"][2:]
    status = subprocess.run(
        [sys.executable, "-m", "toolledger.cli", *probe],
        cwd=ROOT,
        env={**os.environ, **here},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert status.returncode == 0, status.stdout + status.stderr
    assert status.stdout.startswith("alive: "), status.stdout

    for replica in replicas:
        assert replica.stop() == 0, replica.log()
    gone = subprocess.run(
        [sys.executable, "-m", "toolledger.cli", *probe],
        cwd=ROOT,
        env={**os.environ, **here},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert gone.returncode == 1, "a host whose serve stopped is not healthy, whatever the database"
    assert "no live replica of" in gone.stdout
