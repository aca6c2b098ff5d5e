"""``toolledger api``: the audit HTTP API and web view on their own."""

from __future__ import annotations

import asyncio
import signal
from typing import TYPE_CHECKING

import click

from toolledger.cli.common import (
    LOG_LEVELS,
    base_url_option,
    configure_logging,
    database_option,
    run,
    settings_from,
)

if TYPE_CHECKING:
    from fastapi import FastAPI

    from toolledger.runtime.composition import Runtime
    from toolledger.settings import Settings


@click.command()
@click.option(
    "--host", default=None, help="Address to listen on (default: TOOLLEDGER_API_HOST or 127.0.0.1)."
)
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=None,
    help="Port; 0 picks a free one (default: TOOLLEDGER_API_PORT or 8700).",
)
@database_option
@base_url_option
@click.option("--log-level", type=LOG_LEVELS, default="info", show_default=True)
def api(
    host: str | None, port: int | None, database_url: str | None, base_url: str | None, log_level: str
) -> None:
    """Serve the audit HTTP API and web view until SIGTERM/SIGINT.

    Clients send `Authorization: Bearer <token>` with a token of TOOLLEDGER_API_TOKENS (read,
    resolve, watch) or TOOLLEDGER_API_READ_TOKENS (read only). Without any token configured it
    serves loopback only.
    """
    from toolledger.audit.api import create_app
    from toolledger.audit.auth import ApiConfigurationError
    from toolledger.runtime.composition import Runtime

    settings = settings_from(
        api_host=host, api_port=port, database_url=database_url, openai_base_url=base_url
    )
    configure_logging(log_level, settings)
    runtime = Runtime.from_settings(settings)  # builds nothing yet: the database is opened in _serve
    try:
        app = create_app(settings, runtime=runtime)
    except ApiConfigurationError as error:
        raise click.UsageError(str(error)) from None
    run(_serve(app, runtime, log_level))


async def _serve(app: FastAPI, runtime: Runtime, log_level: str) -> None:
    async with runtime:
        await runtime.ensure_schema()
        await _listen(app, runtime.settings, log_level)


async def _listen(app: FastAPI, settings: Settings, log_level: str) -> None:
    from toolledger.audit.api import serve_api

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)

    def listening(host: str, port: int) -> None:
        shown = f"[{host}]" if ":" in host else host
        click.echo(f"audit API: http://{shown}:{port}")

    try:
        await serve_api(
            app, settings.api_host, settings.api_port, stop=stop, on_listening=listening, log_level=log_level
        )
    except OSError as error:
        raise click.ClickException(
            f"cannot listen on {settings.api_host}:{settings.api_port}: {error.strerror or error}"
        ) from None
