"""What every ``toolledger`` command shares: settings from flags, running a command's
coroutine with one-line errors, logging, loading the application's tools."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Coroutine
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

import click
from pydantic import ValidationError

from toolledger.errors import ToolLedgerError

if TYPE_CHECKING:
    from toolledger.runtime.composition import Runtime
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
            # The variable, then where inside its value (a map's key): TOOLLEDGER_API_TOKENS
            # (alice), not an internal field name or a variable that does not exist.
            f"TOOLLEDGER_{str(item['loc'][0]).upper()}"
            + (f" ({'.'.join(str(part) for part in item['loc'][1:])})" if len(item["loc"]) > 1 else "")
            + ": "
            + item["msg"].removeprefix("Value error, ")
            for item in error.errors(include_url=False, include_input=False, include_context=False)
        ]
        raise click.UsageError("invalid configuration:\n  " + "\n  ".join(problems)) from None
    except SettingsError as error:
        # 'error parsing value for field "api_tokens" from source ...': a list or map that is
        # not JSON. Said by the variable's name, as every other problem is.
        field = re.search(r'field "(\w+)"', str(error))
        variable = f"TOOLLEDGER_{field.group(1).upper()}" if field else "a list or map option"
        example = '{"name": "value"}'
        raise click.UsageError(
            f"invalid configuration:\n  {variable}: not valid JSON (lists and maps are JSON, e.g. {example})"
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
    from toolledger.logs import configure_logging as route_logs

    route_logs(level, redactor=settings.redactor(), log_format=settings.log_format)


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


@contextlib.asynccontextmanager
async def ledger_runtime(settings: Settings) -> AsyncIterator[Runtime]:
    """The composition root's ``Runtime`` for a command that works on the ledger: its schema
    brought to the current revision (SQLite) or found current (PostgreSQL), and everything
    the runtime built closed when the command is done."""
    from toolledger.runtime.composition import Runtime

    async with Runtime.from_settings(settings) as runtime:
        await runtime.ensure_schema()
        yield runtime


def missing_sqlite_file(url: str) -> str | None:
    """``store.engine.missing_sqlite_file``, imported when asked (the database layer is not
    loaded by commands that never touch it)."""
    from toolledger.store.engine import missing_sqlite_file as missing

    return missing(url)


def iso(moment: datetime | None) -> str | None:
    if moment is None:
        return None
    return moment.isoformat()


def masked_url(url: str) -> str:
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return "the database"


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
