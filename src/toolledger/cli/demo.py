"""``toolledger demo``: see the ledger survive real SIGKILLs, with no API key and no server."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click


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
    try:
        summary = run_demo(console, quiet=as_json, keep=keep)
    except DemoError as error:
        raise click.ClickException(str(error)) from None
    if as_json:
        click.echo(json.dumps(summary.as_json(), indent=2))
    else:
        print_summary(console, summary)
    sys.exit(0 if summary.ok else 1)
