"""The ``toolledger`` command. Every flag can also be set as ``TOOLLEDGER_<COMMAND>_<FLAG>``."""

from __future__ import annotations

from pathlib import Path

import click
from pydantic import ValidationError

from toolledger import __version__


@click.group(context_settings={"auto_envvar_prefix": "TOOLLEDGER", "help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="toolledger")
def main() -> None:
    """Durable, idempotent function tools for OpenAI Agents API sessions."""


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--port", default=0, show_default=True, type=click.IntRange(0, 65535), help="Port; 0 picks a free one."
)
@click.option("--api-key", default=None, help="Refuse requests without this bearer token (default: any).")
@click.option(
    "--script",
    "script_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="JSON file with the default script for sessions that name none.",
)
@click.option(
    "--log-level",
    type=click.Choice(["critical", "error", "warning", "info", "debug"]),
    default="warning",
    show_default=True,
)
def emulator(host: str, port: int, api_key: str | None, script_path: Path | None, log_level: str) -> None:
    """Serve a local Agents API; prints the base URL to pass to OpenAI(base_url=...)."""
    from toolledger.emulator import Script, serve

    default_script = None
    if script_path is not None:
        try:
            default_script = Script.model_validate_json(script_path.read_bytes())
        except ValidationError as error:
            raise click.BadParameter(
                f"{script_path} is not a valid script:\n{error}", param_hint="--script"
            ) from None
    serve(host=host, port=port, api_key=api_key, default_script=default_script, log_level=log_level)


@main.command()
@click.option(
    "--database-url", default=None, help="Ledger database (default: TOOLLEDGER_DATABASE_URL or SQLite)."
)
@click.option("--revision", default="head", show_default=True, help="Target revision.")
@click.option("--downgrade", is_flag=True, help="Go down to --revision (e.g. base) instead of up.")
def migrate(database_url: str | None, revision: str, downgrade: bool) -> None:
    """Bring the ledger's schema to a revision (idempotent; run once per release)."""
    from toolledger.settings import Settings
    from toolledger.store import migrate as migrations

    settings = Settings() if database_url is None else Settings(database_url=database_url)
    url = settings.database_url
    before = migrations.current_revision(url)
    if downgrade:
        migrations.downgrade(url, revision)
    else:
        migrations.upgrade(url, revision)
    after = migrations.current_revision(url)
    click.echo(f"ledger schema: {before or 'empty'} -> {after or 'empty'}")


if __name__ == "__main__":
    main()
