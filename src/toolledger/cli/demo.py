"""``toolledger demo``: see the ledger survive real SIGKILLs, with no API key and no server."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

PIPED_WIDTH = 160
"""The summary tables' width when the output is not a terminal."""


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON (no progress lines).")
@click.option(
    "--keep",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Keep the ledger, the outside world and the workers' logs in this directory.",
)
def demo(as_json: bool, keep: Path | None) -> None:
    """Run a shop's session through `toolledger serve`, SIGKILL the worker twice mid-call,
    and show that nothing ran twice and nothing was lost."""
    from rich.console import Console

    from toolledger.demo import DemoError, print_summary, run_demo

    console = Console(stderr=as_json)
    if not console.is_terminal:
        # Piped or logged: lines as long as they are and tables wide enough to read, not cut
        # at an 80-column guess of a terminal that is not there.
        console = Console(stderr=as_json, width=PIPED_WIDTH, soft_wrap=True)
    try:
        summary = run_demo(console, quiet=as_json, keep=keep)
    except DemoError as error:
        raise click.ClickException(str(error)) from None
    if as_json:
        click.echo(json.dumps(summary.as_json(), indent=2))
    else:
        print_summary(console, summary)
    sys.exit(0 if summary.ok else 1)
