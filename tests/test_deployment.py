"""docker-compose.yml and the Dockerfile, checked without Docker (it cannot run here): the
compose file has the services, replicas, profiles, ordering and healthchecks it promises,
every toolledger command it names parses with the real CLI, and those commands run here,
outside containers, against PostgreSQL and the emulator, as they would in them."""

from __future__ import annotations

import base64
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import pytest

from tests.support.paths import ROOT
from tests.support.polling import eventually_sync
from toolledger.cli import main
from toolledger.settings import Settings

yaml = pytest.importorskip("yaml")

_VARIABLE = re.compile(r"\$\{(?P<name>\w+)(?:(?P<operator>:[-?+])(?P<default>[^}]*))?\}")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text(encoding="utf-8"))
    return loaded


def _resolved(text: str, environment: dict[str, str]) -> str:
    """Compose's ${NAME}, ${NAME:-default}, ${NAME:?message} and ${NAME:+replacement}, from
    ``environment`` (unset and empty alike, as the colon forms mean)."""

    def value(match: re.Match[str]) -> str:
        name, operator, word = match["name"], match["operator"], match["default"] or ""
        given = environment.get(name, "")
        if operator == ":+":
            return word if given else ""
        if operator == ":?" and not given:
            raise AssertionError(f"{name} is required by the compose file")
        return given or (word if operator == ":-" else "")

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


_LISTEN_PORT = 8090
"""Where each serve replica takes webhooks in the compose file, and where the balancer sends them."""
_NGINX_CONFIG = "deploy/nginx-webhooks.conf"


@dataclass
class _Directive:
    name: str
    args: list[str]
    block: list[_Directive] | None = None

    def all(self, name: str) -> list[_Directive]:
        return [child for child in self.block or [] if child.name == name]

    def one(self, name: str) -> _Directive:
        found = self.all(name)
        assert len(found) == 1, f"{self.name} {' '.join(self.args)}: {len(found)} {name} directive(s)"
        return found[0]


_NGINX_TOKEN = re.compile(r"""\s+|#[^\n]*|"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|[{};]|[^\s{};"'#]+""")


def _nginx(text: str) -> _Directive:
    """An nginx configuration file as a tree of directives, checked as nginx's own parser
    would at the level of syntax: every directive ends in ``;`` or opens a block, every
    block is closed, quotes are closed (an unknown directive is not detected here)."""
    pieces: list[str] = []
    position = 0
    while position < len(text):
        match = _NGINX_TOKEN.match(text, position)
        assert match is not None, f"unreadable from {text[position : position + 40]!r}"
        position = match.end()
        piece = match.group(0)
        if not piece.isspace() and not piece.startswith("#"):
            pieces.append(piece[1:-1] if piece[0] in "\"'" else piece)
    root = _Directive("(file)", [], [])
    open_blocks: list[tuple[_Directive, list[_Directive]]] = [(root, [])]
    words: list[str] = []
    for piece in pieces:
        children = open_blocks[-1][1]
        if piece == ";":
            assert words, "an empty directive (a stray ;)"
            children.append(_Directive(words[0], words[1:]))
            words = []
        elif piece == "{":
            assert words, "a block without a directive"
            block = _Directive(words[0], words[1:], [])
            children.append(block)
            open_blocks.append((block, []))
            words = []
        elif piece == "}":
            assert not words, f"{' '.join(words)}: no ; before }}"
            assert len(open_blocks) > 1, "a } that closes nothing"
            closed, its_children = open_blocks.pop()
            closed.block = its_children
        else:
            words.append(piece)
    assert not words, f"{' '.join(words)}: no ; at the end of the file"
    unclosed = open_blocks[-1][0]
    assert len(open_blocks) == 1, f"{unclosed.name} {' '.join(unclosed.args)}: its block is never closed"
    root.block = open_blocks[0][1]
    return root


@pytest.fixture(scope="module")
def balancer() -> _Directive:
    return _nginx((ROOT / _NGINX_CONFIG).read_text(encoding="utf-8"))


def _environment_of(compose: dict[str, Any], name: str, given: dict[str, str]) -> dict[str, str]:
    """A service's environment as compose would give it, from the variables ``given``."""
    return {
        key: _resolved(str(value), given) for key, value in compose["services"][name]["environment"].items()
    }


def test_nginx_parser__refuses_what_nginx_would() -> None:
    assert _nginx("a b;\nc { d 'e f'; } # g {")
    for broken in ("a b", "a { b; ", "a; }", "a { b }", "a 'b;", ";"):
        with pytest.raises(AssertionError):
            _nginx(broken)


def test_compose__webhooks_reach_every_replica_through_a_load_balancer(compose: dict[str, Any]) -> None:
    services = compose["services"]
    lb = services["lb"]
    # A plain `up` (and the emulator demo) publish no webhook port: the balancer is asked for.
    assert lb["profiles"] == ["webhooks"]
    # An official image (library/, no registry): nothing built or pulled from elsewhere.
    assert re.fullmatch(r"nginx:[\w.]+-alpine", lb["image"]), lb["image"]
    assert "build" not in lb
    assert lb["restart"] == "unless-stopped"
    assert f"./{_NGINX_CONFIG}:/etc/nginx/conf.d/default.conf:ro" in lb["volumes"]
    assert (ROOT / _NGINX_CONFIG).is_file()
    # It starts once the replicas are healthy (a replica is healthy only once it listens:
    # serve stops at start when its webhook address cannot be taken).
    assert lb["depends_on"]["serve"]["condition"] == "service_healthy"
    assert "lb" not in services["serve"].get("depends_on", {})
    # The replicas are not published: webhooks reach them through the balancer only.
    assert "ports" not in services["serve"]
    assert services["serve"]["expose"] == [str(_LISTEN_PORT)]
    assert services["serve"]["deploy"]["replicas"] == 2


def test_compose__the_balancer_routes_the_webhook_path_to_serve_on_its_listen_port(
    compose: dict[str, Any], balancer: _Directive
) -> None:
    from toolledger.runtime.webhook_intake import PATH

    services = compose["services"]
    (upstream,) = balancer.all("upstream")
    (server,) = balancer.all("server")
    # Round robin: nginx's default, with no other balancing method named.
    for method in ("least_conn", "ip_hash", "hash", "random", "sticky", "least_time"):
        assert not upstream.all(method), method
    backends = upstream.all("server")
    assert backends
    listening = _environment_of(compose, "serve", {"TOOLLEDGER_WEBHOOK_SECRET": "whsec_x"})
    for backend in backends:
        host, _, port = backend.args[0].rpartition(":")
        assert host in services, f"upstream {backend.args[0]}: no compose service {host!r}"
        address = _environment_of(compose, host, {"TOOLLEDGER_WEBHOOK_SECRET": "whsec_x"})[
            "TOOLLEDGER_LISTEN"
        ]
        assert address == f"0.0.0.0:{port}", f"{host} listens on {address!r}, the balancer sends to {port}"
        # Every replica behind one name: re-resolved through Docker's DNS, which needs a
        # resolver and the upstream in shared memory (nginx refuses `resolve` otherwise).
        assert "resolve" in backend.args[1:]
        assert upstream.all("zone")
    assert listening["TOOLLEDGER_LISTEN"] == f"0.0.0.0:{_LISTEN_PORT}"
    assert balancer.one("resolver").args[0] == "127.0.0.11", "Docker's embedded DNS"

    routes = {" ".join(location.args): location for location in server.all("location")}
    webhooks = routes[f"= {PATH}"]
    # No URI after the upstream's name: the request's own path (/webhooks/agents) is passed.
    assert webhooks.one("proxy_pass").args == [f"http://{upstream.args[0]}"]
    # A POST goes to another replica only when the first never answered: safe, a webhook
    # taken twice is recorded once (its webhook-id).
    retried = webhooks.one("proxy_next_upstream").args
    assert "non_idempotent" in retried
    assert not [condition for condition in retried if condition.startswith("http_4")]
    # Nothing but webhooks (and its own health) through the balancer.
    assert routes["/"].one("return").args == ["404"]
    assert set(routes) == {f"= {PATH}", "= /healthz", "/"}

    (listen,) = server.one("listen").args
    published = [str(port).rsplit(":", 1) for port in services["lb"]["ports"]]
    assert [container for _, container in published] == [listen]
    assert _resolved(published[0][0], {}) == str(_LISTEN_PORT), "the documented default port"
    probe = services["lb"]["healthcheck"]["test"]
    assert probe[0] == "CMD"
    assert probe[-1] == f"http://127.0.0.1:{listen}/healthz"
    assert routes["= /healthz"].one("return").args[0] == "200"


def test_compose__no_webhook_secret_or_agent_is_made_up(compose: dict[str, Any]) -> None:
    text = (ROOT / "docker-compose.yml").read_text(encoding="utf-8")
    assert not re.search(r"whsec_[A-Za-z0-9+/=]", text), "a signing secret in the compose file"
    assert not re.search(r"agt_[A-Za-z0-9]", text), "an agent id in the compose file"
    environment = compose["services"]["serve"]["environment"]
    for name in ("TOOLLEDGER_AGENT_IDS", "TOOLLEDGER_WEBHOOK_SECRET", "TOOLLEDGER_WEBHOOK_PREVIOUS_SECRET"):
        assert environment[name] == f"${{{name}:-}}", name
    # The audit API, migrate and the emulator have no use for them.
    for name in ("migrate", "api", "emulator"):
        assert "TOOLLEDGER_WEBHOOK_SECRET" not in compose["services"][name]["environment"], name


_SECRET = "whsec_" + base64.b64encode(b"test-only-signing-secret-0123456").decode()


@pytest.mark.parametrize(
    ("given", "mode"),
    [
        ({}, "watch"),
        ({"TOOLLEDGER_AGENT_IDS": "agt_a, agt_b"}, "agents"),
        ({"TOOLLEDGER_AGENT_IDS": "agt_a", "TOOLLEDGER_WEBHOOK_SECRET": _SECRET}, "webhooks"),
        ({"TOOLLEDGER_WEBHOOK_SECRET": _SECRET}, "refused"),
    ],
)
def test_compose__serve_listens_only_with_a_secret(
    compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch, given: dict[str, str], mode: str
) -> None:
    """serve's settings, from the environment the compose file gives it: without the intake's
    variables it follows watched sessions only, as before; with agents it sweeps; with a
    secret too it listens; a secret without agents stops serve at start, saying why."""
    for name, value in _environment_of(compose, "serve", given).items():
        monkeypatch.setenv(name, value)
    settings = Settings(_env_file=None)
    if mode == "watch":
        assert (settings.agent_ids, settings.listen, settings.webhook_secret) == ((), None, None)
    if mode == "agents":
        assert (settings.agent_ids, settings.listen) == (("agt_a", "agt_b"), None)
    if mode == "webhooks":
        assert settings.listen_address == ("0.0.0.0", _LISTEN_PORT)
        assert settings.webhook_secret is not None
        assert settings.webhook_secret.get_secret_value() == _SECRET
    if mode == "refused":
        assert "TOOLLEDGER_AGENT_IDS" in (settings.intake_problem() or "")
    else:
        assert settings.intake_problem() is None
    assert settings.webhook_previous_secret is None


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
                "--profile",
                "webhooks",
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
        # postgres and the load balancer run images of their own.
        assert "build" not in service or commands, f"{name} runs no toolledger command"
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


def test_deploying_doc__names_real_events_settings_and_files() -> None:
    """docs/deploying.md against what it describes: the SDK's session events, toolledger's
    variables, the files it links to."""
    import openai

    from toolledger.runtime.webhook_intake import LOOK_EVENTS, PATH
    from toolledger.settings_reference import options

    doc = (ROOT / "docs" / "deploying.md").read_text(encoding="utf-8")
    events = Path(openai.__file__).parent / "types" / "webhooks"
    sdk_events = {
        match
        for path in events.glob("agent_session_*_webhook_event.py")
        for match in re.findall(r'type: Literal\["(agent\.session\.[a-z_]+)"\]', path.read_text("utf-8"))
    }
    assert sdk_events >= LOOK_EVENTS
    for event in sdk_events:
        assert f"`{event}`" in doc, event
    assert f"https://<your host>{PATH}" in doc
    known = {option.variable for option in options()} | {"TOOLLEDGER_TOOLS", "TOOLLEDGER_WEBHOOK_PORT"}
    named = set(re.findall(r"TOOLLEDGER_[A-Z_]+", doc))
    assert named <= known, named - known
    compose_text = (ROOT / "docker-compose.yml").read_text(encoding="utf-8")
    assert "${TOOLLEDGER_WEBHOOK_PORT:-8090}" in compose_text
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", doc):
        if "://" not in target:
            assert (ROOT / "docs" / target).resolve().exists(), target
