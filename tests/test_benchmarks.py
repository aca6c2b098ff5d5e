"""The audit benchmark (``python -m benchmarks.audit``) in its quick mode, on the real PostgreSQL.

Only that it runs to the end and reports every figure, consistently: timings are not asserted,
the machine is shared.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from benchmarks.audit import QUERY_NAMES, QUICK_CALLS
from sqlalchemy.engine import make_url

from tests.support.databases import require_postgres, server_url
from tests.support.paths import ROOT

AUDIT_INDEXES = {
    "ix_tool_calls_call_id",
    "ix_tool_calls_status_key",
    "ix_tool_calls_tool_name_key",
    "ix_tool_calls_prunable",
    "ix_tool_calls_search",
}
FIGURES = r"\s+(\d+\.\d\d)\s+(\d+\.\d\d)\s+(\d+\.\d\d)\s+(\d+\.\d\d)\s+(\d+)\s+(\S.*)$"
"""median, p95, store median, db ms, rows, then the plan summary."""


def run_benchmark(*arguments: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.audit", *arguments],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


def databases_named(prefix: str) -> list[str]:
    admin = make_url(server_url()).set(drivername="postgresql", database="postgres")
    with psycopg.connect(admin.render_as_string(hide_password=False), autocommit=True) as conn:
        rows = conn.execute("SELECT datname FROM pg_database WHERE datname LIKE %s", [prefix + "%"])
        return [str(row[0]) for row in rows]


@pytest.fixture
def bench_url() -> str:
    require_postgres(server_url())
    name = f"toolledger_bench_test_{uuid.uuid4().hex[:10]}"
    return make_url(server_url()).set(database=name).render_as_string(hide_password=False)


def test_audit_benchmark__quick_run__prints_every_query_figure_and_writes_them_as_json(
    bench_url: str, tmp_path: Path
) -> None:
    report = tmp_path / "audit.json"

    result = run_benchmark("--quick", "--database-url", bench_url, "--json", str(report), "--drop")

    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    lines = result.stdout.splitlines()
    printed: dict[str, re.Match[str]] = {}
    for name in QUERY_NAMES:
        matches = [m for line in lines if (m := re.match(re.escape(name) + FIGURES, line))]
        assert len(matches) == 1, f"no figure line for {name!r}"
        printed[name] = matches[0]
        assert f"-- {name}" in lines, f"no plan printed for {name!r}"
    assert f"seeded {QUICK_CALLS:,} calls" in result.stdout
    assert "write path on a new, empty ledger" in result.stdout
    assert "write path on a seeded ledger" in result.stdout

    figures: dict[str, Any] = json.loads(report.read_text())
    queries = {query["name"]: query for query in figures["queries"]}
    assert list(queries) == list(QUERY_NAMES)
    for name, query in queries.items():
        assert query["median_ms"] > 0, name
        assert query["p95_ms"] >= query["median_ms"], name
        assert query["plans"], name
        assert all(plan[-1].startswith("Execution Time:") for plan in query["plans"]), name
        assert printed[name].group(5) == str(query["rows"])
    assert figures["seed"]["calls"] == QUICK_CALLS
    assert 3 * QUICK_CALLS < figures["seed"]["events"] < 5 * QUICK_CALLS

    # The figures agree with one another and with the seeded ledger's shape.
    rows = {name: query["rows"] for name, query in queries.items()}
    assert rows["list: first page (-created, 50)"] == rows["list: page 21 via cursor"] == 50
    assert rows["filter: status=unknown"] == min(50, rows["count: status=unknown"]) > 0
    assert rows["filter: tool"] == min(50, rows["count: tool"]) > 0
    assert rows["search: call id substring (1 call)"] == 1
    assert rows["show: SESSION/TURN/CALL"] == rows["show: tl_ prefix"] == rows["show: bare call id"] == 4
    assert 0 < rows["prune --dry-run (older than 30 days)"] < QUICK_CALLS
    # The lookups the audit indexes exist for are answered from them, not by scanning the table.
    assert "ix_tool_calls_search" in queries["search: call id substring (1 call)"]["plan_summary"]
    assert "ix_tool_calls_call_id" in queries["show: bare call id"]["plan_summary"]

    added = {size["name"] for size in figures["sizes"] if size["added"]}
    assert added == AUDIT_INDEXES
    assert [cost["ledger"] for cost in figures["write_path"]] == [
        "new, empty ledger",
        f"seeded ledger ({QUICK_CALLS:,} calls)",
    ]
    database = make_url(bench_url).database
    assert database is not None
    assert databases_named(database) == []  # --drop, and the write-path ledgers are always dropped


def test_audit_benchmark__database_name_without_bench__is_refused_before_anything_is_dropped() -> None:
    result = run_benchmark("--quick", "--database-url", "postgresql+psycopg://postgres@127.0.0.1:5432/test")

    assert result.returncode != 0
    assert "refusing to drop 'test'" in result.stderr
    assert "Traceback" not in result.stderr
