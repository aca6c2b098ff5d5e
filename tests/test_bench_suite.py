"""`python -m benchmarks --quick` runs every part end to end (against the test PostgreSQL and
the emulator) and writes a figure for each; it fails on errors, never on timings."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from tests.support.databases import require_postgres, server_url
from tests.support.paths import ROOT

PARTS = {"ceiling", "latency", "peer", "growth", "e2e", "recovery", "memory", "crash", "statements", "intake"}


@pytest.mark.slow
# The crash part waits out serve's default leases after a kill: up to 90 s per database.
@pytest.mark.timeout(1200)
def test_benchmarks_quick__every_part_gives_numbers(tmp_path: Path) -> None:
    server = server_url()
    require_postgres(server)
    database_url = make_url(server).set(drivername="postgresql+psycopg", database="toolledger_bench_ci")
    report = tmp_path / "bench.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks",
            "--quick",
            "--json",
            str(report),
            "--database-url",
            database_url.render_as_string(hide_password=False),
        ],
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if not k.startswith("TOOLLEDGER_")},
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    document = json.loads(report.read_text())
    assert document["mode"] == "quick"
    assert document["machine"]["cpus"] >= 1
    measured = {figure["part"] for figure in document["figures"]}
    expected = PARTS - set(document["skipped"])
    assert measured == expected, (measured, document["skipped"])
    for figure in document["figures"]:
        assert math.isfinite(figure["toolledger"]), figure
        assert figure["baseline"] is None or math.isfinite(figure["baseline"]), figure
        # None: an informational figure without a target (the statements part compares ways
        # of writing, none of them is a goal).
        assert figure["met"] is None or isinstance(figure["met"], bool), figure
    assert "toolledger benchmarks (quick)" in done.stdout
    # DBOS is not a dependency: without it the peer part says so instead of failing.
    assert set(document["skipped"]) <= {"peer"}
