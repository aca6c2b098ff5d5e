"""``toolledger config``: the configuration in effect, or the reference of every option."""

from __future__ import annotations

import json

import click

from toolledger.cli.common import settings_from


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option(
    "--reference", is_flag=True, help="Print the Markdown reference of every option (docs/configuration.md)."
)
def config(as_json: bool, reference: bool) -> None:
    """The configuration in effect (environment, .env, defaults), secrets masked."""
    from toolledger.settings_reference import effective, reference_markdown

    if reference:
        click.echo(reference_markdown(), nl=False)
        return
    rows = effective(settings_from())
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table("Variable", "Value", "Source")
    for row in rows:
        value = row["value"]
        shown = "(none)" if value is None else value if isinstance(value, str) else json.dumps(value)
        table.add_row(row["variable"], shown, row["source"])
    Console(soft_wrap=True).print(table)
