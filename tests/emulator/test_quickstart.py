"""The README's "Quickstart against the OpenAI API", run as written against the emulator.

The code is read from README.md, not copied here, so the README cannot drift from what
works: the two Python snippets run unchanged (the client finds the emulator through
OPENAI_BASE_URL and OPENAI_API_KEY, as the README's note says), the shell lines run as
commands of the installed console script, and the emulator follows the quickstart's
script from docs/emulator.md. Only what the README marks as the user's own is supplied:
``myapp.mail.mailer`` and the ``sk-...``/``sess_...`` placeholders.
"""

from __future__ import annotations

import contextlib
import json
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from openai import OpenAI

from tests.emulator.processes import TOOLLEDGER, clean_environment, emulator_command, running
from tests.support.paths import ROOT
from tests.support.polling import eventually_sync
from toolledger.emulator import EmulatorControl, Script

README = ROOT / "README.md"
EMULATOR_DOCS = ROOT / "docs" / "emulator.md"
API_KEY = "unused"

MAILER = '''\
"""The quickstart's own mail code, here a file of what was sent."""

import json


class Mailer:
    def send(self, order_id: str, idempotency_key: str) -> None:
        with open({outbox!r}, "a") as outbox:
            outbox.write(json.dumps({{"order_id": order_id, "idempotency_key": idempotency_key}}) + "\\n")


mailer = Mailer()
'''


# ------------------------------------------------------------- the documents


def section(markdown: str, heading: str) -> str:
    """The text under ``heading`` up to the next heading of the same level."""
    level = heading.split(" ", 1)[0]
    start = markdown.index(f"\n{heading}\n") + 1
    following = re.search(rf"^{level} ", markdown[start + len(heading) :], flags=re.MULTILINE)
    return markdown[start : start + len(heading) + following.start()] if following else markdown[start:]


def fenced(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```$", text, flags=re.MULTILINE | re.DOTALL)


@dataclass
class Quickstart:
    tools_module: str
    client_program: str
    shell_lines: list[str]


def readme_quickstart() -> Quickstart:
    text = section(README.read_text(encoding="utf-8"), "## Quickstart against the OpenAI API")
    tools_module, client_program = fenced(text, "python")
    [shell] = fenced(text, "bash")
    assert tools_module.startswith("# myapp/tools.py\n"), tools_module
    return Quickstart(tools_module, client_program, shell.splitlines())


def documented_script(file_name: str) -> str:
    """The JSON block the emulator's docs give right after the line naming ``file_name``."""
    docs = EMULATOR_DOCS.read_text(encoding="utf-8")
    match = re.search(rf"^`{re.escape(file_name)}`:\n\n```json\n(.*?)^```$", docs, re.MULTILINE | re.DOTALL)
    assert match, f"docs/emulator.md shows no {file_name}"
    return match[1]


# ------------------------------------------------------------ the commands


def command(line: str, session_id: str) -> tuple[list[str], bool]:
    """A shell line of the README as an argv (placeholders filled), and whether it runs in
    the background."""
    words = [
        word.replace("sk-...", API_KEY).replace("sess_...", session_id)
        for word in shlex.split(line, comments=True)
    ]
    background = words[-1:] == ["&"]
    return (words[:-1] if background else words), background


def wait_for_answer(client: OpenAI, control: EmulatorControl, session_id: str, timeout: float = 60.0) -> None:
    """Until the session's turn is over and a tool result was accepted."""
    status: list[str] = []  # the last one seen

    def answered() -> bool:
        status[:] = [client.beta.agents.sessions.retrieve(session_id).status]
        accepted = [r for r in control.tool_results(session_id) if r.outcome == "accepted"]
        return status == ["idle"] and bool(accepted)

    eventually_sync(
        answered,
        within=timeout,
        what=lambda: f"session {session_id} was not answered; it is {status[0]}",
        interval=0.1,
    )


# ----------------------------------------------------------------- the test


def test_readme_quickstart__runs_as_written_on_the_emulator_with_serve_answering(tmp_path: Path) -> None:
    quickstart = readme_quickstart()
    outbox = tmp_path / "outbox.jsonl"
    (tmp_path / "myapp").mkdir()
    (tmp_path / "myapp" / "__init__.py").write_text("")
    (tmp_path / "myapp" / "tools.py").write_text(quickstart.tools_module)
    (tmp_path / "myapp" / "mail.py").write_text(MAILER.format(outbox=str(outbox)))
    (tmp_path / "quickstart.py").write_text(quickstart.client_program)
    (tmp_path / "quickstart.json").write_text(documented_script("quickstart.json"))
    env = clean_environment()

    with emulator_command(tmp_path, "--script", "quickstart.json", env=env) as base_url:
        client_run = subprocess.run(
            [sys.executable, "quickstart.py"],
            cwd=tmp_path,
            env={**env, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": API_KEY},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert client_run.returncode == 0, client_run.stderr
        session_id = client_run.stdout.strip()
        assert re.fullmatch(r"sess_\w+", session_id), client_run.stdout

        shell_env = {**env, "TOOLLEDGER_OPENAI_BASE_URL": base_url}
        outputs: dict[str, str] = {}
        with (
            contextlib.ExitStack() as background,
            OpenAI(
                base_url=base_url, api_key=API_KEY, max_retries=0, _strict_response_validation=True
            ) as client,
            contextlib.closing(EmulatorControl(base_url)) as control,
        ):
            for line in quickstart.shell_lines:
                argv, in_background = command(line, session_id)
                if argv[0] == "export":
                    for assignment in argv[1:]:
                        name, _, value = assignment.partition("=")
                        shell_env[name] = value
                    continue
                assert argv[0] == "toolledger", line
                argv[0] = str(TOOLLEDGER)
                if in_background:
                    background.enter_context(
                        running(argv, cwd=tmp_path, env=shell_env, log=tmp_path / "serve.log")
                    )
                    continue
                if argv[1:3] == ["calls", "list"]:
                    # What ran can be listed once it has run; the README's reader waits too.
                    wait_for_answer(client, control, session_id)
                result = subprocess.run(
                    argv, cwd=tmp_path, env=shell_env, capture_output=True, text=True, timeout=60
                )
                assert result.returncode == 0, f"{line}\n{result.stdout}\n{result.stderr}"
                outputs[" ".join(argv[1:3])] = result.stdout

            session = client.beta.agents.sessions.retrieve(session_id)
            [agent] = client.beta.agents.list().data
            received = control.tool_results(session_id)

    # The agent was saved as the README's client created it, and the session runs it.
    assert agent.name == "shop"
    assert agent.instructions == "Help customers with orders."
    assert [tool.type for tool in agent.tools] == ["function"]
    assert session.agent.id == agent.id
    assert [getattr(tool, "name", None) for tool in session.agent.tools] == ["send_receipt"]
    assert session.status == "idle"
    assert session.required_actions == []

    # serve ran the user's tool once, with the call's idempotency key, and answered the model.
    sent = [json.loads(line) for line in outbox.read_text().splitlines()]
    assert [entry["order_id"] for entry in sent] == ["A1"]
    assert sent[0]["idempotency_key"]
    [receipt] = received
    assert receipt.outcome == "accepted"
    assert receipt.payload["success"] is True
    assert receipt.payload["output"] == "sent"

    # And the ledger says so.
    assert "send_receipt" in outputs["calls list"]
    assert "Traceback" not in (tmp_path / "serve.log").read_text()


def test_documented_scripts__are_valid_scripts() -> None:
    for file_name in ("quickstart.json", "checkout.json"):
        Script.model_validate_json(documented_script(file_name))
