"""What a handler is given about the call it runs, and what a verify hook answers."""

from __future__ import annotations

import logging
from contextvars import ContextVar, Token
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from toolledger.domain.keys import CallKey

DEFAULT_OUTPUT_LIMIT = 1024 * 1024


@dataclass(frozen=True)
class ToolContext:
    """The call a handler runs. Declare a parameter annotated ``ToolContext`` to receive it."""

    key: CallKey
    tool_name: str
    attempt: int
    """1 for the first run; more when a re-runnable tool is run again after an interruption."""
    idempotency_key: str
    """Stable for this call across crashes and replicas: pass it to downstream APIs."""
    logger: logging.LoggerAdapter[logging.Logger]
    max_output_bytes: int = DEFAULT_OUTPUT_LIMIT
    """The largest output that will be sent; an iterator result is read no further."""
    db: Any = None
    """For transactional tools: the ledger's open connection (an ``AsyncConnection`` for
    async handlers, a synchronous ``Connection`` for sync ones). Writes made through it commit
    together with the call's result, or not at all."""

    @property
    def session_id(self) -> str:
        return self.key.session_id

    @property
    def turn_id(self) -> str:
        return self.key.turn_id

    @property
    def call_id(self) -> str:
        return self.key.call_id


_current: ContextVar[ToolContext] = ContextVar("toolledger_tool_context")


def output_limit() -> int:
    """The running call's output limit (the default outside a call)."""
    context = _current.get(None)
    return context.max_output_bytes if context is not None else DEFAULT_OUTPUT_LIMIT


def current_context() -> ToolContext:
    """The context of the call being run; also for SDK ``FunctionTool`` handlers."""
    try:
        return _current.get()
    except LookupError:
        raise RuntimeError("current_context() is only available while toolledger runs a handler") from None


def bind_context(context: ToolContext) -> Token[ToolContext]:
    return _current.set(context)


def reset_context(token: Token[ToolContext]) -> None:
    _current.reset(token)


class VerifyAnswer(StrEnum):
    EXECUTED = "executed"
    NOT_EXECUTED = "not_executed"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class Verification:
    """A verify hook's answer: did the first run of this call happen downstream?"""

    kind: VerifyAnswer
    """Anything else a hook may spell here counts as ``unknown``."""
    output: Any = None

    @classmethod
    def executed(cls, output: Any) -> Verification:
        """It happened; ``output`` is the result to give the model."""
        return cls(VerifyAnswer.EXECUTED, output)

    @classmethod
    def not_executed(cls) -> Verification:
        """It did not happen: running the call now is safe."""
        return cls(VerifyAnswer.NOT_EXECUTED)

    @classmethod
    def unknown(cls) -> Verification:
        """Cannot tell: the call waits for an operator."""
        return cls(VerifyAnswer.UNKNOWN)
