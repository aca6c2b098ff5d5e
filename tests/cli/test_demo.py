"""`toolledger demo` really kills its workers and shows nothing ran twice and nothing was lost;
the README's first command does what it says from a fresh copy; a wheel built from the
project installs and runs `toolledger migrate` and `toolledger demo` outside the source tree."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.paths import ROOT
from tests.test_packaging import source_packages


def _clean_environment(**extra: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("TOOLLEDGER_", "PYTHONPATH", "VIRTUAL_ENV"))
    }
    return {**env, **extra}


def _check_summary(summary: dict[str, Any]) -> None:
    assert summary["ok"] is True, summary["problems"]
    assert summary["problems"] == []
    workers = summary["workers"]
    assert [w["killed"] for w in workers] == [True, True, False]
    assert [w["exit_code"] for w in workers] == [-signal.SIGKILL, -signal.SIGKILL, 0]
    assert len({w["pid"] for w in workers}) == 3, "three separate processes"
    calls = summary["calls"]
    assert sorted(c["tool"] for c in calls) == sorted(
        ["lookup_order", "lookup_order", "charge_card", "send_receipt", "record_refund"]
    )
    for call in calls:
        assert call["status"] == "submitted", call
        assert call["accepted_results"] == 1, call
        if call["effect_class"] in ("verified", "at_most_once"):
            assert call["side_effects"] == 1, call
    (charge,) = [c for c in calls if c["tool"] == "charge_card"]
    assert "verify hook" in charge["story"]
    assert any("verify hook: the first run happened" in line for line in charge["timeline"])
    assert any("resubmitted, not re-run" in c["story"] for c in calls)
    # Cut off by the kill inside charge_card every time, not by luck of timing.
    (receipt,) = [c for c in calls if c["tool"] == "send_receipt"]
    assert "re-run (idempotent: safe)" in receipt["story"], receipt
    assert receipt["side_effects"] == 2, "run twice (the mailer keeps one mail per key)"
    # Over the shop's limit: it waited for a person, whom the demo plays through the CLI.
    (refund,) = [c for c in calls if c["tool"] == "record_refund"]
    assert "waited for approval (operator:demo approved it through the CLI)" in refund["story"]
    assert refund["side_effects"] == 1
    assert any(
        "awaiting_approval -> pending" in line and "operator:demo" in line for line in refund["timeline"]
    )
    assert summary["seconds"] < 60


def test_demo__kills_its_workers_and_nothing_runs_twice_or_is_lost(tmp_path: Path) -> None:
    # Run where a user keeps their clone: a `toolledger/` folder beside, which a child started
    # with `python -m` would import instead of the installed package.
    (tmp_path / "toolledger").mkdir()
    (tmp_path / "toolledger" / "README.md").write_text("a checkout\n", encoding="utf-8")
    console_script = Path(sys.executable).with_name("toolledger")
    done = subprocess.run(
        [str(console_script), "demo", "--json", "--keep", str(tmp_path / "kept")],
        cwd=tmp_path,
        env=_clean_environment(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    _check_summary(json.loads(done.stdout))
    logs = sorted((tmp_path / "kept").glob("serve-*.log"))
    assert len(logs) == 3
    assert "crash point after_result_commit reached" in logs[0].read_text()
    assert "crash point inside_handler reached" in logs[1].read_text()


def _last_json(output: str) -> dict[str, Any]:
    """The demo's JSON summary, after whatever pip printed before it."""
    start = re.search(r"^\{$", output, re.MULTILINE)
    assert start, output[-2000:]
    summary: dict[str, Any] = json.loads(output[start.start() :])
    return summary


def _first_command() -> str:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```bash\n(.*?)```", readme, re.DOTALL)
    return str(blocks[0].strip())


def _tracked_copy(destination: Path) -> None:
    """What a fresh clone holds: the tracked files, as they are in the work tree."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


IMPORT_EVERY_SUBPACKAGE = """
import importlib, json, pkgutil, toolledger
found = pkgutil.walk_packages(toolledger.__path__, "toolledger.")
names = ["toolledger"] + [m.name for m in found if m.ispkg]
for name in names:
    importlib.import_module(name)
print(json.dumps(sorted(names)))
"""
"""Imports toolledger and every subpackage of it from wherever it is installed; prints their names."""


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_readme_first_command_and_a_wheel__work_from_a_fresh_copy_and_outside_the_tree(
    tmp_path: Path,
) -> None:
    if shutil.which("git") is None:
        pytest.skip("git is needed to list the project's files")
    command = _first_command()
    assert command == "python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/toolledger demo"
    clone = tmp_path / "clone"
    _tracked_copy(clone)
    # The README's command, as a new user types it, beside a wheel's install elsewhere (both
    # at once: each spends most of its time in pip).
    readme_run = subprocess.Popen(
        ["bash", "-c", command.replace("toolledger demo", "toolledger demo --json")],
        cwd=clone,
        env=_clean_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wheels, outside = tmp_path / "wheels", tmp_path / "outside"
    outside.mkdir()
    script = (
        f"set -e; {sys.executable} -m pip wheel -q --no-deps -w {wheels} {clone}; "
        f"python3 -m venv {outside}/venv; "
        f"{outside}/venv/bin/pip install -q {wheels}/*.whl -c {clone}/.ci/constraints.txt; "
        f"{outside}/venv/bin/toolledger migrate --database-url sqlite:///{outside}/ledger.sqlite3; "
        f"{outside}/venv/bin/python -c {shlex.quote(IMPORT_EVERY_SUBPACKAGE)}; "
        f"{outside}/venv/bin/toolledger check --help > {outside}/check-help.txt; "
        f"{outside}/venv/bin/toolledger demo --json"
    )
    wheel_run = subprocess.Popen(
        ["bash", "-c", script],
        cwd=outside,
        env=_clean_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    readme_out, readme_err = readme_run.communicate(timeout=600)
    wheel_out, wheel_err = wheel_run.communicate(timeout=600)

    assert readme_run.returncode == 0, readme_err[-3000:]
    _check_summary(_last_json(readme_out))
    assert wheel_run.returncode == 0, wheel_err[-3000:]
    assert "ledger schema: empty -> " in wheel_out
    _check_summary(_last_json(wheel_out))
    imported = set(json.loads(next(line for line in wheel_out.splitlines() if line.startswith("["))))
    assert imported == source_packages(), "the wheel ships (and imports) every package of the tree"
    assert "Usage: toolledger check" in (outside / "check-help.txt").read_text()
    installed = next((outside / "venv" / "lib").glob("python3*/site-packages/toolledger"))
    assert (installed / "py.typed").exists()
    assert (installed / "audit" / "web" / "index.html").exists()
    assert (installed / "examples" / "shop.py").exists()
