"""The conformance check on real processes: the tools of tests/conformance/tools.py run through
crash points (their workers SIGKILLed, a fresh process recovering) against the emulator over
HTTP; the check names exactly the tools that break their word, in the expected sentences.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conformance import tools
from tests.support.databases import connect, drop_databases_named, require_postgres, server_url
from tests.support.paths import ROOT
from toolledger.emulator import EmulatorServer
from toolledger.testing import CheckError, Report, Status, assert_conforms, check_tools, reference_of

POINTS = ["inside_handler"]

IDEMPOTENT_REPEAT = (
    'declared idempotent: 2 side effects "charge" seen for one key (1 without a crash): '
    "the tool does not dedupe by ctx.idempotency_key"
)
EXPECTED = {
    ("double_charge", "inside_handler"): (IDEMPOTENT_REPEAT,),
    ("blind_charge", "inside_handler"): ("verified: the hook said not executed after the effect",),
    ("leaky_refund", "inside_handler"): (
        'transactional: an effect survived a rolled-back run (2 side effects "refund" seen, 1 without a '
        "crash): it was not written through ctx.db",
    ),
    **{
        ("noisy_lookup", point): ('read_only: a side effect was reported ("audit record")',)
        for point in ("no_crash", *POINTS)
    },
}
"""Every contradiction the check must report, and no other."""


@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
def test_check_tools__every_tool_killed_mid_side_effect__each_judged_by_its_effect_class(
    database: str, emulator_server: EmulatorServer
) -> None:
    """One check of every tool (the registry passed as the object), on throwaway SQLite files
    and on throwaway databases of the PostgreSQL server. One test per check, not a module
    fixture shared by several: under xdist each worker would make the check again."""
    database_url = None
    if database == "postgresql":
        database_url = server_url()
        require_postgres(database_url)

    report = check_tools(
        tools.registry,
        points=POINTS,
        jobs=2,
        emulator_url=emulator_server.base_url,
        database_url=database_url,
    )

    _reports_exactly_the_tools_that_break_their_word(report)
    _passes_each_effect_class_s_correct_tool(report)
    _asks_for_an_example_for_a_tool_failing_with_schema_arguments(report)
    _runs_each_in_about_a_second_or_two(report)


def _reports_exactly_the_tools_that_break_their_word(report: Report) -> None:
    found = {(r.tool, r.point): r.problems for r in report.results if r.status is Status.CONTRADICTION}

    assert found == EXPECTED
    assert report.exit_code == 1
    assert not report.ok


def _passes_each_effect_class_s_correct_tool(report: Report) -> None:
    correct = {tool.name for tool in tools.correct}
    statuses = {(r.tool, r.point): r.status for r in report.results if r.tool in correct}

    assert statuses == {
        **{(name, point): Status.OK for name in correct for point in ("no_crash", *POINTS)},
        ("lookup", "inside_handler"): Status.NOT_APPLICABLE,  # no side effect to be killed in
    }
    notes = {(r.tool, r.point): r.note for r in report.results}
    assert notes[("charge", "inside_handler")] == "the hook said executed: settled without a re-run"
    assert notes[("ship", "inside_handler")] == (
        "unknown after the crash, waits for an operator (toolledger calls resolve)"
    )
    assert notes[("refund", "inside_handler")] == "run again; no repeated side effect"
    # Approved by the check, then run (a tool that needs approval is checked all the same).
    assert notes[("refund_large", "inside_handler")] == "run again; no repeated side effect"


def _asks_for_an_example_for_a_tool_failing_with_schema_arguments(report: Report) -> None:
    picky = [r for r in report.results if r.tool == "picky"]

    assert [(r.point, r.status) for r in picky] == [
        ("no_crash", Status.ERROR),
        *[(point, Status.NOT_APPLICABLE) for point in POINTS],
    ]
    assert picky[0].problems == (
        "the call failed without a crash (No order example.): nothing to compare the crashes with; "
        "give arguments it succeeds with (--examples, examples=)",
    )
    assert report.arguments["picky"] == {"order_id": "example"}


def _runs_each_in_about_a_second_or_two(report: Report) -> None:
    runs = [r.seconds for r in report.results if r.status is not Status.NOT_APPLICABLE]

    assert len(runs) == 22  # a baseline each, and the killed runs of all but picky (and lookup's n/a)
    assert sum(runs) / len(runs) < 10, runs  # generous: the machine may be shared


def test_check_tools__on_postgresql__a_transactional_tool_s_killed_run_rolls_back_there(
    emulator_server: EmulatorServer, tmp_path: Path
) -> None:
    server = server_url()
    require_postgres(server)

    report = check_tools(
        "tests.conformance.tools:correct",
        tools=["refund"],
        points=["inside_handler"],
        emulator_url=emulator_server.base_url,
        database_url=server,
        keep=tmp_path,
    )

    run = tmp_path / "refund" / "inside_handler"
    database = (run / "ledger.txt").read_text().removeprefix("PostgreSQL database ").strip()
    try:
        assert [(r.point, r.status) for r in report.results] == [
            ("no_crash", Status.OK),
            ("inside_handler", Status.OK),
        ]
        assert not (run / "ledger.sqlite3").exists()
        # Kept: the killed run's refund row was rolled back by PostgreSQL, the re-run's committed.
        with connect(server, database) as connection:
            assert connection.execute("SELECT count(*) FROM conformance_refunds").fetchone() == (1,)
            assert connection.execute("SELECT status FROM tool_calls").fetchall() == [("submitted",)]
    finally:
        drop_databases_named(server, f"{database.rpartition('_')[0]}_")


def test_reference_of__finds_the_module_holding_the_registry() -> None:
    assert reference_of(tools.registry) == "tests.conformance.tools:registry"
    with pytest.raises(CheckError, match="held by no module's top level"):
        reference_of(type(tools.registry)())


def test_check_tools__unknown_crash_point__is_refused_before_anything_starts() -> None:
    with pytest.raises(CheckError, match="unknown crash point during_reconcile") as raised:
        check_tools(tools.registry, points=["during_reconcile"])

    assert raised.value.param == "--point"


# ----------------------------------------------------------------------- the CLI


def toolledger(*arguments: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("TOOLLEDGER_")}
    environment["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [sys.executable, "-m", "toolledger.cli", "check", *arguments],
        cwd=cwd,
        env=environment,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def test_cli_check__contradiction_exits_1_with_a_json_report() -> None:
    completed = toolledger(
        "--tools",
        "tests.conformance.tools:registry",
        *("--tool", "eager_charge", "--tool", "charge", "--tool", "double_charge"),
        *("--point", "after_claim_commit", "--point", "after_handler"),
        "--json",
    )

    assert completed.returncode == 1, completed.stderr
    report: dict[str, Any] = json.loads(completed.stdout)
    assert (report["ok"], report["exit_code"], report["contradictions"], report["errors"]) == (False, 1, 2, 0)
    names = [[t["name"]] for t in report["tools"]]
    assert names == [["eager_charge"], ["charge"], ["double_charge"]]
    double = report["tools"][2]
    assert (double["effect_class"], double["arguments"]) == ("idempotent", {"cents": 1})
    verdicts = {
        (tool["name"], point["point"]): (point["status"], point["problems"] or point["note"])
        for tool in report["tools"]
        for point in tool["points"]
    }
    assert verdicts == {
        ("eager_charge", "no_crash"): ("ok", "1 side effect, answered"),
        ("eager_charge", "after_claim_commit"): (
            "contradiction",
            ["verified: the hook said executed but no effect was seen"],
        ),
        ("eager_charge", "after_handler"): ("ok", "the hook said executed: settled without a re-run"),
        ("charge", "no_crash"): ("ok", "1 side effect, answered"),
        ("charge", "after_claim_commit"): (
            "ok",
            "the hook said not executed: run again; no repeated side effect",
        ),
        ("charge", "after_handler"): ("ok", "the hook said executed: settled without a re-run"),
        ("double_charge", "no_crash"): ("ok", "1 side effect, answered"),
        ("double_charge", "after_claim_commit"): ("ok", "run again; no repeated side effect"),
        ("double_charge", "after_handler"): ("contradiction", [IDEMPOTENT_REPEAT]),
    }
    # Progress, one line per tool and point, goes to stderr beside the JSON.
    progress = [line.split()[:3] for line in completed.stderr.splitlines() if line.split()[:1] in names]
    assert sorted((tool, point) for tool, point, _ in progress) == sorted(verdicts)
    assert {(tool, point): status for tool, point, status in progress} == {
        key: status for key, (status, _) in verdicts.items()
    }
    assert all(point["seconds"] > 0 for tool in report["tools"] for point in tool["points"])


def test_cli_check__tools_keeping_their_word_exit_0(tmp_path: Path) -> None:
    examples = tmp_path / "examples.json"
    # An example for a tool not checked this time is fine (one file serves the whole registry).
    examples.write_text(json.dumps({"ship": {"order_id": "B2"}, "charge": {"cents": 5}}), encoding="utf-8")

    completed = toolledger(
        "--tools",
        "tests.conformance.tools:correct",
        "--tool",
        "ship",
        *("--point", "after_result_commit", "--point", "after_submit_response"),
        "--examples",
        str(examples),
        "--keep",
        str(tmp_path / "runs"),
    )

    assert completed.returncode == 0, completed.stdout + completed.stderr
    lines = completed.stdout.splitlines()
    assert lines[0].split() == ["ship", "no_crash", "ok", "1", "side", "effect,", "answered"]
    assert sorted(line.split()[1] for line in lines[1:3]) == ["after_result_commit", "after_submit_response"]
    assert lines[1].endswith("ok             the stored result was sent again; the tool was not re-run")
    assert lines[-1].startswith("every tool keeps its word: 3 ok in ")
    # --keep: the killed worker's and the recovery's logs, the ledger and the outside world.
    kept = tmp_path / "runs" / "ship" / "after_result_commit"
    assert {p.name for p in kept.iterdir()} >= {
        "ledger.sqlite3",
        "world.sqlite3",
        "worker.log",
        "recovery.log",
    }
    assert "crash point after_result_commit reached" in (kept / "worker.log").read_text()


def test_assert_conforms__tool_that_never_returns__is_killed_at_the_timeout(
    emulator_server: EmulatorServer,
) -> None:
    with pytest.raises(AssertionError) as raised:
        assert_conforms(
            "tests.conformance.tools:stalled",
            timeout=3,
            points=["after_handler"],
            emulator_url=emulator_server.base_url,
        )

    assert str(raised.value) == "stuck (idempotent) at no_crash: error: did not finish within 3s (killed)"


def test_check_tools__unknown_tool__is_refused_naming_the_registry_s_tools(
    emulator_server: EmulatorServer,
) -> None:
    with pytest.raises(CheckError) as raised:
        check_tools(
            "tests.conformance.tools:correct", tools=["refnud"], emulator_url=emulator_server.base_url
        )

    assert str(raised.value) == (
        "no tool named refnud in the registry (it has: lookup, send_mail, charge, refund, ship, refund_large)"
    )
    assert raised.value.param == "--tool"


def test_check_tools__tools_that_cannot_be_loaded__are_refused_with_the_reason(
    emulator_server: EmulatorServer,
) -> None:
    with pytest.raises(CheckError) as raised:
        check_tools("tests.conformance.tools:nothing", emulator_url=emulator_server.base_url)

    assert str(raised.value) == "module 'tests.conformance.tools' has no attribute 'nothing'"
    assert raised.value.param == "--tools"


@pytest.mark.parametrize(
    ("arguments", "said"),
    [
        (["--tools", "tests.conformance.nowhere:registry"], "no module named 'tests.conformance.nowhere'"),
        (
            ["--tools", "tests.conformance.tools:registry", "--point", "somewhere"],
            "'somewhere' is not one of",
        ),
        (
            ["--tools", "tests.conformance.tools:registry", "--database-url", "sqlite:///ledger.sqlite3"],
            "Invalid value for --database-url: expected a PostgreSQL server",
        ),
    ],
)
def test_cli_check__bad_input__exits_2_saying_what_is_wrong(arguments: list[str], said: str) -> None:
    completed = toolledger(*arguments)

    assert completed.returncode == 2, completed.stdout + completed.stderr
    assert said in completed.stderr


def test_cli_check__examples_that_are_not_an_object__exit_2(tmp_path: Path) -> None:
    examples = tmp_path / "examples.json"
    examples.write_text("[1, 2]", encoding="utf-8")

    completed = toolledger("--tools", "tests.conformance.tools:registry", "--examples", str(examples))

    assert completed.returncode == 2
    assert "expected an object of arguments per tool" in completed.stderr


def test_cli_check__offers_exactly_the_kit_s_crash_points() -> None:
    from toolledger.cli.check import POINT_NAMES
    from toolledger.testing import CRASH_POINTS

    assert POINT_NAMES == CRASH_POINTS


def test_cli_check__tools_that_report_no_side_effect__exit_4_untested_unless_allowed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Uninstrumented, a tool's crash runs are all skipped: nothing of its promise is checked,
    and the check must not say "every tool keeps its word"."""
    writes = tmp_path / "writes.log"
    monkeypatch.setenv("CHECKED_WRITES", str(writes))
    refused = toolledger("--tools", "tests.conformance.tools:uninstrumented", "--json")
    allowed = toolledger("--tools", "tests.conformance.tools:uninstrumented", "--allow-untested")

    assert refused.returncode == 4, refused.stdout + refused.stderr
    report = json.loads(refused.stdout)
    assert (report["ok"], report["exit_code"], report["untested"]) == (False, 4, ["write_row"])
    first = refused.stderr.splitlines()[0]
    assert first.startswith("toolledger check calls each tool's handler for real"), first
    assert "TOOLLEDGER_CHECKING=1" in first
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr
    assert "untested (allowed)" in allowed.stdout
    assert "untested: write_row: they reported no side effect" in allowed.stdout
    # Its handler ran for real, once per check (the baseline), and knew the check was running.
    assert len(writes.read_text().splitlines()) == 2
