"""``toolledger check``: the conformance check of the application's tools (``toolledger.testing``)."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from toolledger.testing import PointResult, Report

STATUS_COLOURS = {"ok": "green", "contradiction": "red", "not_applicable": "yellow", "error": "magenta"}
# The names of toolledger.testing.CRASH_POINTS, spelt here so `--help` imports nothing.
POINT_NAMES = (
    "after_claim_commit",
    "inside_handler",
    "after_handler",
    "after_result_commit",
    "after_submit_response",
)


REAL_HANDLERS_WARNING = (
    "toolledger check calls each tool's handler for real (with --examples or made-up arguments): "
    "point your tools at fakes while TOOLLEDGER_CHECKING=1 (toolledger.testing.checking()), "
    "see docs/conformance.md, 'Before you run it'"
)
UNTESTED_REASON = (
    "they reported no side effect, so no crash run was made: report each effect with "
    "toolledger.testing.effect (docs/conformance.md), or pass --allow-untested"
)


class CheckFailed(click.ClickException):
    """The check itself could not run: exit 3, as a run that could not be made (1 means a
    contradiction was found, and this found nothing)."""

    exit_code = 3


@click.command()
@click.option(
    "--tools",
    "tools_reference",
    required=True,
    envvar="TOOLLEDGER_TOOLS",
    help="The application's tools: package.module:registry (a ToolRegistry or a function returning one).",
)
@click.option(
    "--examples",
    "examples_file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help='A JSON file of arguments per tool, {"tool": {"argument": value}}; other tools get '
    "arguments built from their schema.",
)
@click.option("--tool", "tool_names", multiple=True, help="Only this tool (repeatable).")
@click.option(
    "--point",
    "points",
    multiple=True,
    type=click.Choice(POINT_NAMES),
    help="Only this crash point (repeatable; default: all). The run without a crash is always made.",
)
@click.option("--jobs", type=click.IntRange(1), default=1, show_default=True, help="Runs at once.")
@click.option(
    "--timeout",
    type=click.FloatRange(0, min_open=True),
    default=60.0,
    show_default=True,
    help="Seconds a worker process may take before it is killed and its run failed.",
)
@click.option(
    "--database-url",
    envvar="TOOLLEDGER_CHECK_DATABASE_URL",
    default=None,
    help="Make the throwaway ledgers on this PostgreSQL server (databases named toolledger_check_*, "
    "dropped at the end; the role needs CREATEDB) instead of SQLite files, so that transactional "
    "tools run their SQL on PostgreSQL.",
)
@click.option(
    "--keep",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Keep every run's ledger, outside world and logs in this directory.",
)
@click.option(
    "--allow-untested",
    is_flag=True,
    help="Pass even when a tool's crash runs were all skipped (it reported no side effect).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON (progress goes to stderr).")
def check(
    tools_reference: str,
    examples_file: Path | None,
    tool_names: tuple[str, ...],
    points: tuple[str, ...],
    jobs: int,
    timeout: float,
    database_url: str | None,
    keep: Path | None,
    allow_untested: bool,
    as_json: bool,
) -> None:
    """Run each tool through the crash points and report where it contradicts its effect class.

    \b
    For each tool: one call without a crash, then one per crash point, each against a
    throwaway ledger (SQLite, or PostgreSQL with --database-url) and the built-in
    emulator: a worker process handles the call and is SIGKILLed at the point, then a
    fresh process recovers. The tool's side effects,
    reported by its own code with toolledger.testing.effect(), are held against what its
    effect class promises (e.g. "declared idempotent: 2 side effects seen for one key").

    \b
    The handlers are called for real, with --examples or made-up arguments: point your
    tools at fakes when TOOLLEDGER_CHECKING=1 (toolledger.testing.checking()).

    \b
    Exit status: 0 nothing contradicts, 1 a contradiction, 3 a run (or the check) could
    not be made, 4 a tool could not be tested (it reported no side effect: its crash runs
    were skipped; --allow-untested passes anyway), 2 bad usage. Details: docs/conformance.md.
    """
    from toolledger.testing import CheckError, check_tools

    examples = _examples(examples_file)
    click.echo(REAL_HANDLERS_WARNING, err=True)
    try:
        report = check_tools(
            tools_reference,
            examples=examples,
            tools=tool_names or None,
            points=points or None,
            jobs=jobs,
            timeout=timeout,
            database_url=database_url,
            keep=keep,
            progress=lambda result: click.echo(_line(result), err=as_json),
            allow_untested=allow_untested,
        )
    except CheckError as error:
        if error.param is not None:
            raise click.BadParameter(str(error), param_hint=error.param) from None
        raise CheckFailed(str(error)) from None
    if as_json:
        click.echo(json.dumps(report.as_json(), indent=2))
    else:
        click.echo(_summary(report))
    sys.exit(report.exit_code)


def _examples(path: Path | None) -> dict[str, Any] | None:
    if path is None:
        return None
    try:
        examples = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise click.BadParameter(f"{path}: not readable JSON ({error})", param_hint="--examples") from None
    if not isinstance(examples, dict):
        raise click.BadParameter(
            f'{path}: expected an object of arguments per tool, {{"tool": {{...}}}}', param_hint="--examples"
        )
    return examples


def _line(result: PointResult) -> str:
    status = click.style(f"{result.status.value:<14}", fg=STATUS_COLOURS[result.status.value])
    said = "; ".join(result.problems) if result.problems else (result.note or "")
    return f"{result.tool:<24} {result.point:<22} {status} {said}".rstrip()


def _summary(report: Report) -> str:
    counts = Counter(result.status.value for result in report.results)
    said = ", ".join(_counted(counts[status], status) for status in STATUS_COLOURS if counts[status])
    untested = report.untested
    if report.contradictions:
        verdict = click.style(_counted(len(report.contradictions), "contradiction"), fg="red")
    elif report.errors:
        verdict = click.style(f"{_counted(len(report.errors), 'run')} could not be made", fg="magenta")
    elif untested and not report.allow_untested:
        verdict = click.style(f"{_counted(len(untested), 'tool')} untested", fg="magenta")
    elif untested:
        verdict = click.style(
            f"no contradiction, {_counted(len(untested), 'tool')} untested (allowed)", fg="yellow"
        )
    else:
        verdict = click.style("every tool keeps its word", fg="green")
    lines = [f"\n{verdict}: {said} in {report.seconds:.1f}s"]
    if untested:
        lines.append(f"untested: {', '.join(untested)}: {UNTESTED_REASON}")
    return "\n".join(lines)


def _counted(count: int, status: str) -> str:
    if status in ("ok", "not_applicable"):
        return f"{count} {status.replace('_', ' ')}"
    return f"{count} {status}{'' if count == 1 else 's'}"
