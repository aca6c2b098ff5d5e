"""What every ``toolledger`` command shares: settings from flags, running a command's
coroutine with one-line errors, logging, loading the application's tools."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeVar

import click
from pydantic import ValidationError

from toolledger.errors import SchemaNotCurrentError, ToolLedgerError

if TYPE_CHECKING:
    from toolledger.runtime.registry import ToolRegistry
    from toolledger.settings import Settings

T = TypeVar("T")

LOG_LEVELS = click.Choice(["critical", "error", "warning", "info", "debug"])


def settings_from(**overrides: Any) -> Settings:
    """Settings from the environment, with the command line's flags on top."""
    from pydantic_settings import SettingsError

    from toolledger.settings import Settings

    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as error:
        # Each problem by its variable, without the value given: it may be a token or a key.
        problems = [
            f"TOOLLEDGER_{'_'.join(str(part) for part in item['loc']).upper()}: {item['msg']}"
            for item in error.errors(include_url=False, include_input=False, include_context=False)
        ]
        raise click.UsageError("invalid configuration:\n  " + "\n  ".join(problems)) from None
    except SettingsError as error:
        # "error parsing value for field "api_tokens" ...": a list or map that is not JSON.
        raise click.UsageError(
            f"invalid configuration: {first_line(error)} (lists and maps are JSON)"
        ) from None


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run a command's coroutine; toolledger's own errors and an unreachable database end it
    with a one-line message, no traceback."""
    from sqlalchemy.exc import SQLAlchemyError

    from toolledger.domain.queries import QueryError
    from toolledger.domain.redaction import redact_text

    try:
        return asyncio.run(coroutine)
    except QueryError as error:
        # Bad filters, cursors or ids are the caller's input: a usage error (exit 2).
        raise click.UsageError(str(error)) from None
    except ToolLedgerError as error:
        raise click.ClickException(str(error)) from None
    except SQLAlchemyError as error:
        reason = redact_text(first_line(getattr(error, "orig", None) or error))
        raise click.ClickException(f"the ledger database is unavailable: {reason}") from None


def configure_logging(level: str, settings: Settings) -> None:
    """Every log line through one handler that masks the configured secrets."""
    from toolledger.ledger import configured_redactor
    from toolledger.logs import configure_logging as route_logs

    route_logs(level, redactor=configured_redactor(settings), log_format=settings.log_format)


def load_tools(reference: str | None) -> ToolRegistry:
    from toolledger.runtime.loading import load_registry
    from toolledger.runtime.registry import ToolRegistry

    if reference is None:
        return ToolRegistry()
    try:
        return load_registry(reference)
    except ToolLedgerError as error:
        raise click.BadParameter(str(error), param_hint="--tools") from None


database_option = click.option(
    "--database-url", default=None, help="Ledger database (default: TOOLLEDGER_DATABASE_URL or SQLite)."
)
base_url_option = click.option(
    "--base-url", default=None, help="Agents API base URL (default: TOOLLEDGER_OPENAI_BASE_URL or OpenAI)."
)


async def ensure_schema(settings: Settings) -> None:
    from sqlalchemy.engine import make_url

    from toolledger.store import migrate as migrations

    url = settings.database_url
    if make_url(url).get_backend_name() == "sqlite":
        await asyncio.to_thread(migrations.upgrade, url)
    elif not await asyncio.to_thread(migrations.is_current, url):
        raise SchemaNotCurrentError(
            "the ledger database is not at the current schema revision: run `toolledger migrate`"
        )


def iso(moment: datetime | None) -> str | None:
    if moment is None:
        return None
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).isoformat()


def masked_url(url: str) -> str:
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return "the database"


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def aware(moment: datetime) -> datetime:
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)
