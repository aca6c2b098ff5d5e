"""How the runtime's long-running loops report a failure they survive."""

from __future__ import annotations

import asyncio
import logging
import sys

from toolledger.domain.redaction import redact_text
from toolledger.errors import ToolLedgerError
from toolledger.store.engine import is_transient


def log_failure(logger: logging.Logger, message: str, *args: object) -> None:
    """Inside an ``except``: one line for the expected outages (the database restarting,
    the Agents API unreachable), the traceback for anything else."""

    error = sys.exc_info()[1]
    if error is not None and (is_transient(error) or isinstance(error, ToolLedgerError)):
        logger.warning(message + " (%s: %s)", *args, type(error).__name__, _first_line(error))
    else:
        logger.exception(message, *args)


def _first_line(error: BaseException) -> str:
    text = redact_text(str(error)).strip()
    return text.splitlines()[0][:200] if text else ""


_EXITS = (asyncio.CancelledError, KeyboardInterrupt, SystemExit)


def note_interruption(logger: logging.Logger, message: str, *args: object) -> None:
    """Inside an ``except BaseException``: cancellation and exits go on; anything else that is
    not an Exception (a handler's own BaseException) is noted in one line, without its text,
    and survived, as the SDK's runner treats it."""
    error = sys.exc_info()[1]
    if isinstance(error, _EXITS):
        raise
    logger.warning(message + " (%s)", *args, type(error).__qualname__)
