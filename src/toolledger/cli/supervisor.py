"""`toolledger serve --processes N`: N serve processes on one machine.

One Python process runs on one core; a machine with more cores runs more processes. They share
the watched sessions through the session leases, exactly as replicas on several machines do
(each takes a fair share; a dead one's sessions are taken over). This process only starts
them, passes SIGTERM/SIGINT on, and starts again one that was killed (a crash point, the OOM
killer); one that exits with an error of its own (refused credentials, a bad option) stops
them all with its code, since starting it again would fail the same way.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

log = logging.getLogger("toolledger.supervisor")

POLL_SECONDS = 0.2
RESTART_BACKOFF_FIRST = 0.5
RESTART_BACKOFF_MAX = 30.0


@dataclass
class _Child:
    index: int
    arguments: list[str]
    process: subprocess.Popen[bytes]
    restarts: int = 0
    started: float = field(default_factory=time.monotonic)


STOP_MARGIN_SECONDS = 15.0
"""Beyond a child's grace period, how long it may take to stop before it is killed: its
shutdown's own writes, its audit API's, its interpreter's exit."""


def supervise(child_arguments: Sequence[Sequence[str]], *, grace: float | None = None) -> int:
    """Run one `toolledger serve` per entry (its arguments), until a signal; the exit code.

    ``grace``: the children's shutdown grace period. A child still running
    ``STOP_MARGIN_SECONDS`` after it (it should have exited by then, cutting off its
    handlers) is killed, so that a stop always ends; its calls are taken over as after a
    crash. None: wait for the children however long they take."""
    stopping: list[int] = []

    def stop(signum: int, _frame: object) -> None:
        stopping.append(signum)

    previous = {signum: signal.signal(signum, stop) for signum in (signal.SIGTERM, signal.SIGINT)}
    children = [_start(index, list(arguments)) for index, arguments in enumerate(child_arguments)]
    log.info(
        "serving with %d processes: pids %s", len(children), ", ".join(str(c.process.pid) for c in children)
    )
    failure = 0
    try:
        while not stopping and not failure:
            time.sleep(POLL_SECONDS)
            for position, child in enumerate(children):
                code = child.process.poll()
                if code is None or stopping:
                    continue
                if code >= 0:
                    # Its own error (or a clean exit nobody asked for): the same again would fail.
                    log.error(
                        "serve process %d (pid %d) exited with %d: stopping",
                        child.index,
                        child.process.pid,
                        code,
                    )
                    failure = code or 1
                    break
                children[position] = _restart(child, -code)
    finally:
        for child in children:
            if child.process.poll() is None:
                child.process.send_signal(stopping[0] if stopping else signal.SIGTERM)
        codes = _wait_all(children, None if grace is None else grace + STOP_MARGIN_SECONDS)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if failure:
        return failure
    return max((code for code in codes if code > 0), default=0)


def _wait_all(children: list[_Child], within: float | None) -> list[int]:
    """The children's exit codes, once they exited; those still running after ``within``
    seconds are killed (SIGKILL)."""
    deadline = None if within is None else time.monotonic() + within
    codes = []
    for child in children:
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        try:
            codes.append(child.process.wait(timeout=left))
        except subprocess.TimeoutExpired:
            log.error(
                "serve process %d (pid %d) did not stop within %.0fs: killing it (its calls are "
                "taken over as after a crash)",
                child.index,
                child.process.pid,
                within or 0.0,
            )
            child.process.kill()
            codes.append(child.process.wait())
    return codes


def _start(index: int, arguments: list[str]) -> _Child:
    process = subprocess.Popen(  # noqa: S603 - this interpreter, this package, the caller's options
        [sys.executable, "-m", "toolledger.cli", "serve", *arguments],
        preexec_fn=_stop_with_parent,
    )
    return _Child(index, arguments, process)


def _restart(child: _Child, signum: int) -> _Child:
    """Start a killed child again, after a pause that grows while it keeps dying young."""
    lived = time.monotonic() - child.started
    restarts = 0 if lived > RESTART_BACKOFF_MAX else child.restarts + 1
    pause = min(RESTART_BACKOFF_FIRST * 2.0 ** (restarts - 1), RESTART_BACKOFF_MAX) if restarts else 0.0
    name = signal.Signals(signum).name if signum in signal.Signals._value2member_map_ else str(signum)
    log.warning(
        "serve process %d (pid %d) was killed (%s); starting it again%s",
        child.index,
        child.process.pid,
        name,
        f" in {pause:.1f}s" if pause else "",
    )
    time.sleep(pause)
    started = _start(child.index, child.arguments)
    started.restarts = restarts
    return started


def _stop_with_parent() -> None:
    """In the child before exec: SIGTERM it when this supervisor dies, even by SIGKILL, so no
    serve process is left behind holding sessions (Linux; elsewhere it is left running)."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGTERM)
