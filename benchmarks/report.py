"""Figures of the benchmark suite: each a ratio against a baseline measured in the same run
(these machines are noisy; absolute times drift), printed as a table and written as JSON."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


@dataclass
class Figure:
    part: str
    name: str
    unit: str
    toolledger: float
    baseline: float | None
    baseline_name: str
    target: str
    met: bool | None
    note: str = ""
    lower_bound: bool = False
    """The measurement ran out of time: the true figure is larger (printed as ">N")."""

    @property
    def ratio(self) -> float | None:
        if self.baseline in (None, 0):
            return None
        return self.toolledger / self.baseline


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(share * (len(ordered) - 1))))
    return ordered[index]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def machine() -> dict[str, Any]:
    try:
        server = subprocess.run(
            ["psql", "-h", "127.0.0.1", "-U", "postgres", "-Atc", "show server_version", "postgres"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout.strip()
    except OSError:
        server = "unknown"
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "postgresql": server,
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def _number(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 100:
        return f"{value:,.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def print_table(console: Console, figures: list[Figure], title: str) -> None:
    table = Table(title=title)
    for column in ("part", "figure", "toolledger", "baseline", "ratio", "target", "met"):
        table.add_column(column)
    for figure in figures:
        met = "-" if figure.met is None else ("[green]yes[/green]" if figure.met else "[red]no[/red]")
        ratio = figure.ratio
        table.add_row(
            figure.part,
            f"{figure.name} ({figure.unit})",
            (">" if figure.lower_bound else "") + _number(figure.toolledger),
            f"{_number(figure.baseline)} {figure.baseline_name}".strip(),
            "-" if ratio is None else f"{ratio:.2f}x",
            figure.target,
            met,
        )
    console.print(table)
    for figure in figures:
        if figure.note:
            console.print(f"  {figure.part} / {figure.name}: {figure.note}", highlight=False)


def write_json(path: Path, figures: list[Figure], mode: str, skipped: dict[str, str]) -> None:
    document = {
        "mode": mode,
        "machine": machine(),
        "figures": [{**asdict(figure), "ratio": figure.ratio} for figure in figures],
        "skipped": skipped,
    }
    path.write_text(json.dumps(document, indent=2), encoding="utf-8")
