"""How a tool tells the conformance check that it made a side effect.

The check cannot see into the systems a tool changes, so the tool's own code (or the fake of
the downstream system it calls) says so, at the moment the effect happens:

    testing.effect("charge", key=ctx.idempotency_key)   # a downstream that dedupes by key
    testing.effect("mail")                               # one that does not: every call counts
    await testing.effect_in(ctx.db, "refund")            # through a transactional tool's ctx.db

Outside a check every probe does nothing (``seen`` refuses: a verify hook must not decide
on a record that is not kept), so a probe left in a tool costs nothing in ``serve``.
Inside one, each report is kept where a SIGKILL cannot undo it, and the worker is killed
right after it when the run is armed at ``inside_handler``.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

from toolledger.crashpoints import CP_INSIDE_HANDLER, crash_point
from toolledger.runtime.context import ToolContext, current_context
from toolledger.testing.world import World

_world: World | None = None
"""The running check's world, in the check's worker processes only."""


def checking() -> bool:
    """Whether this process is a worker of ``toolledger check`` (its environment has
    ``TOOLLEDGER_CHECKING=1``): the check calls the handlers for real, so a tool (or the
    module that builds its registry) should talk to fakes of its downstream systems then."""
    return os.environ.get("TOOLLEDGER_CHECKING") == "1"


def bind(path: Path) -> None:
    """Make this process report to the world at ``path`` (a check's worker, at its start)."""
    global _world  # one per process, set once by the check's worker
    _world = World(path)


def effect(name: str = "effect", *, key: str | None = None) -> bool:
    """Report a side effect just made in the outside world.

    ``key``: the idempotency key the downstream system was given, when that system drops a
    second request with a key it has seen (as payment APIs do); the repeat is then not a
    new effect and False is returned. Without ``key`` every report is a new effect: the
    tool itself must not make it twice. Returns True for a new effect (always, outside a
    check)."""
    if _world is None:
        return True
    call = _running_call()
    made = _world.record_effect(
        name,
        key=key,
        idempotency_key=call.idempotency_key if call else None,
        attempt=call.attempt if call else None,
    )
    _inside_the_effect()
    return made


def effect_in(db: Any, name: str = "effect") -> Any:
    """Report a side effect written through ``ctx.db``, the ledger's connection that a
    transactional tool's writes go through: the report commits with the call's result, or
    is rolled back with it. ``await`` it in an async tool (``ctx.db`` is an
    ``AsyncConnection`` there); in a sync one it is done when it returns."""
    if db is None:
        raise TypeError("effect_in() needs ctx.db, the ledger's connection: only transactional tools get one")
    # SQLAlchemy, when a transactional tool reports: not for every module importing the probes.
    from toolledger.store.check_effects import is_async_connection, write_effect

    if _world is None:
        return _nothing() if is_async_connection(db) else None
    call = _running_call()
    written = write_effect(
        db,
        name=name,
        idempotency_key=call.idempotency_key if call else None,
        attempt=call.attempt if call else None,
        pid=os.getpid(),
    )
    if written is None:
        _inside_the_effect()
        return None
    return _then_inside_the_effect(written)


def seen(name: str = "effect", *, key: str) -> bool:
    """Whether an effect ``name`` was reported with ``key`` in this check run, by any of its
    processes: what a fake downstream system answers a verify hook from."""
    if _world is None:
        raise RuntimeError(
            "toolledger.testing.seen() is only for a conformance check (toolledger check, check_tools)"
        )
    return _world.seen(name, key)


def record_answer(context: ToolContext, answer: str) -> None:
    """Note what a verify hook answered (the check wraps every hook with this)."""
    if _world is not None:
        _world.record_answer(context.tool_name, context.idempotency_key, answer)


def _running_call() -> ToolContext | None:
    try:
        return current_context()
    except RuntimeError:  # reported from outside a handler (a thread of the tool's own)
        return None


def _inside_the_effect() -> None:
    # The one place CP_INSIDE_HANDLER is passed: the effect is kept, the handler still runs.
    crash_point(CP_INSIDE_HANDLER)


async def _then_inside_the_effect(written: Awaitable[Any]) -> None:
    await written
    _inside_the_effect()


async def _nothing() -> None:
    return None
