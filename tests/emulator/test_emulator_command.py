"""`toolledger emulator` scripts as a user gives them: `--script FILE`, `--script NAME=FILE`,
and what a session without any script tells its user."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from openai import OpenAI
from openai.types.beta.persisted_agent_tool_param import PersistedAgentToolConfigParamFunction

from tests.emulator.processes import emulator_command, toolledger
from tests.support.paths import ROOT
from toolledger.emulator import Script

SEND_RECEIPT: PersistedAgentToolConfigParamFunction = {
    "type": "function",
    "name": "send_receipt",
    "description": "Email the receipt of an order.",
    "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}}},
}


def sdk(base_url: str) -> OpenAI:
    return OpenAI(
        base_url=base_url, api_key="unused", max_retries=0, timeout=10, _strict_response_validation=True
    )


def turn(client: OpenAI, agent_id: str) -> tuple[list[tuple[str, Any]], str]:
    """A session of the agent, one turn answering every call: the calls and the answer."""
    calls: list[tuple[str, Any]] = []

    def answer(name: str) -> Any:
        def handler(arguments: Any) -> str:
            calls.append((name, arguments))
            return "ok"

        return handler

    session = client.beta.agents.sessions.create(agent_id=agent_id, environment={"type": "none"})
    with client.beta.agents.sessions.stream(
        session.id,
        input="go",
        tool_handlers={name: answer(name) for name in ("send_receipt", "record_refund")},
    ) as stream:
        result = stream.get_final_result()
    return calls, result.messages[-1].output_text


def write(path: Path, script: Script) -> str:
    path.write_text(script.model_dump_json(indent=2))
    return path.name


def test_scripts__default_and_named__drive_the_agents_that_select_them(tmp_path: Path) -> None:
    default = write(tmp_path / "default.json", Script.of_calls([("send_receipt", {"order_id": "A1"})]))
    refund = write(tmp_path / "refund.json", Script.of_calls([("record_refund", {"cents": 5})]))

    with (
        emulator_command(tmp_path, "--script", default, "--script", f"refund={refund}") as base_url,
        sdk(base_url) as client,
    ):
        plain = client.beta.agents.create(model="m", tools=[SEND_RECEIPT])
        refunder = client.beta.agents.create(model="m", metadata={"emulator_script": "refund"})
        plain_calls, _ = turn(client, plain.id)
        refund_calls, _ = turn(client, refunder.id)

    assert plain_calls == [("send_receipt", {"order_id": "A1"})]
    assert refund_calls == [("record_refund", {"cents": 5})]


def test_no_script__an_agent_with_tools__is_told_in_the_answer_and_the_log_once(tmp_path: Path) -> None:
    with emulator_command(tmp_path) as base_url, sdk(base_url) as client:
        agent = client.beta.agents.create(model="m", tools=[SEND_RECEIPT])
        answers = [turn(client, agent.id) for _ in range(2)]

    log = (tmp_path / "emulator.log").read_text()
    for calls, answer in answers:
        assert calls == []
        assert "send_receipt" in answer
        assert "docs/emulator.md" in answer
    assert log.count("but no script") == 1, log
    assert "--script FILE" in log


def test_two_default_scripts__exit_2_asking_for_names(tmp_path: Path) -> None:
    first = write(tmp_path / "a.json", Script())
    second = write(tmp_path / "b.json", Script())

    result = toolledger("emulator", "--script", first, "--script", second, cwd=tmp_path)

    assert result.returncode == 2
    assert result.stdout == ""
    assert "--script" in result.stderr
    assert "NAME=FILE" in result.stderr


def test_a_missing_or_invalid_script_file__exits_2_saying_which(tmp_path: Path) -> None:
    (tmp_path / "typo.json").write_text('{"steps": [{"cals": []}]}')

    missing = toolledger("emulator", "--script", "refund=nowhere.json", cwd=tmp_path)
    invalid = toolledger("emulator", "--script", "refund=typo.json", cwd=tmp_path)

    assert missing.returncode == 2
    assert "cannot read nowhere.json" in missing.stderr
    assert invalid.returncode == 2
    assert "typo.json is not a valid script" in invalid.stderr
    assert "cals" in invalid.stderr
    assert "Traceback" not in missing.stderr + invalid.stderr


def test_a_file_whose_name_holds_an_equals_sign__is_read_as_a_default_script(tmp_path: Path) -> None:
    odd = write(tmp_path / "a=b.json", Script.of_calls([("send_receipt", {"order_id": "Q"})]))

    with emulator_command(tmp_path, "--script", odd) as base_url, sdk(base_url) as client:
        calls, _ = turn(client, client.beta.agents.create(model="m").id)

    assert calls == [("send_receipt", {"order_id": "Q"})]


def test_help__shows_the_script_format_and_points_to_its_documentation(tmp_path: Path) -> None:
    result = toolledger("emulator", "--help", cwd=tmp_path)

    assert result.returncode == 0, result.stderr
    assert "[NAME=]FILE" in result.stdout
    assert '"steps"' in result.stdout
    assert "docs/emulator.md" in result.stdout
    assert (ROOT / "docs" / "emulator.md").is_file()
