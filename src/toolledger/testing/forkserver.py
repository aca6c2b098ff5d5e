"""The process a conformance check forks its workers from.

    python -m toolledger.testing.forkserver package.module:registry

It imports toolledger and the application's tools once, says which tools it found, then
for each job read from its stdin (a JSON line) forks a child that does the job and exits,
and reports the child's pid and how it ended. The child is a process of its own: a crash
point's SIGKILL ends it alone, and the recovery runs in another child that never ran the
tool. Starting Python afresh for each would cost seconds of imports per process (the same
reason multiprocessing has a forkserver); this process starts no thread, so forking it is
safe.

Its stdout is the check's channel alone: whatever the application prints goes to stderr.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
import time
import traceback
from typing import Any, TextIO

from toolledger import crashpoints
from toolledger.errors import ToolLedgerError
from toolledger.runtime.loading import load_registry
from toolledger.runtime.registry import ToolRegistry
from toolledger.testing.jobs import recording_answers, run_job
from toolledger.testing.workers import Job

PRELOADED = (
    "toolledger.gateway.agents",
    "toolledger.store.ledger_sqlite",
    "toolledger.store.ledger_postgres",
    "sqlalchemy.dialects.postgresql.psycopg",
    "toolledger.migrations",
    "aiosqlite",
    "anyio._backends._asyncio",
    "httpcore2",
    "h11",
)
"""Imported here once rather than in every child: what a job imports on first use."""


def main(argv: list[str]) -> int:
    channel = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)
    if len(argv) != 2:
        _send(channel, {"error": "usage: python -m toolledger.testing.forkserver package.module:registry"})
        return 2
    for module in PRELOADED:
        importlib.import_module(module)
    try:
        registry = recording_answers(load_registry(argv[1]))
    except ToolLedgerError as error:
        _send(channel, {"error": str(error)})
        return 2
    _send(
        channel, {"tools": [_described(tool.name, tool.effect.value, tool.definition) for tool in registry]}
    )
    for line in sys.stdin:
        job = Job(**json.loads(line))
        pid = os.fork()
        if pid == 0:
            _child(job, registry, channel)
        _send(channel, {"started": pid})
        _, status = os.waitpid(pid, 0)
        _send(channel, {"exit": os.waitstatus_to_exitcode(status)})
    return 0


def _described(name: str, effect: str, definition: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "effect": effect, "parameters": definition.get("parameters") or {}}


def _child(job: Job, registry: ToolRegistry, channel: TextIO) -> None:
    """Do the job in this forked child, then exit without returning (os._exit: nothing of
    the parent's, buffered or registered at exit, is run twice)."""
    code = 1
    try:
        os.close(channel.fileno())
        log = os.open(job.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        logging.basicConfig(
            level=logging.INFO,
            format="%(asctime)s %(process)d %(name)s %(levelname)s %(message)s",
            force=True,
        )
        logging.getLogger(__name__).info("job %s (crash at %s)", job.kind, job.crash_at or "no point")
        crashpoints.arm(job.crash_at or "")
        started = time.monotonic()
        run_job(job, registry)
        logging.getLogger(__name__).info(
            "job %s done in %.2fs (%.2fs of CPU)", job.kind, time.monotonic() - started, time.process_time()
        )
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _send(channel: TextIO, message: dict[str, Any]) -> None:
    channel.write(json.dumps(message) + "\n")
    channel.flush()


if __name__ == "__main__":
    # Arming comes per job: a TOOLLEDGER_CRASH_AT the check inherited must not kill this one.
    crashpoints.arm("")
    sys.exit(main(sys.argv))
