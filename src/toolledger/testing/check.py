"""The conformance check: each tool run through the named crash points, against a throwaway
ledger and the emulator, its observed side effects held against its declared effect class.

For each tool: one run without a crash (the baseline), then one per crash point. A run is a
session of its own on the emulator whose model calls the tool once; a worker process handles
the call (and is SIGKILLed at the point), then a fresh process recovers, as after a real
crash. Workers are forked from a process that imported the tools once (``forkserver``), so
a run takes about a second, most of it the dead worker's lease running out.

``toolledger check`` is this, on the command line.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from contextlib import ExitStack
from importlib.machinery import PathFinder
from pathlib import Path
from queue import Queue
from typing import TYPE_CHECKING, Any

from toolledger.testing.examples import ExampleError, arguments_for
from toolledger.testing.ledgers import ThrowawayLedgers, throwaway_ledgers
from toolledger.testing.report import Report
from toolledger.testing.runs import Progress, Runs, log_tail
from toolledger.testing.verdicts import (
    CRASH_POINTS,
    NO_CRASH,
    POINTS,
)
from toolledger.testing.workers import API_KEY, CheckError, Job, Workers

if TYPE_CHECKING:
    from openai import OpenAI

    from toolledger.emulator import EmulatorControl
    from toolledger.runtime.registry import ToolRegistry

DEFAULT_TIMEOUT = 60.0
"""Seconds one worker process may take (a run has two: the killed one and the recovery)."""


def check_tools(
    registry: ToolRegistry | str,
    *,
    examples: Mapping[str, Mapping[str, Any]] | None = None,
    tools: Iterable[str] | None = None,
    points: Iterable[str] | None = None,
    jobs: int = 1,
    timeout: float = DEFAULT_TIMEOUT,
    emulator_url: str | None = None,
    database_url: str | None = None,
    keep: Path | None = None,
    progress: Progress | None = None,
    allow_untested: bool = False,
) -> Report:
    """Run every tool of ``registry`` through the crash points and judge what it did.

    ``registry``: ``"package.module:attribute"`` or the ToolRegistry itself, if a module
    holds it at its top level (the worker processes import it from there).
    ``examples``: arguments per tool name; other tools get arguments built from their schema.
    ``tools``: only these; ``points``: only these crash points (the run without a crash is
    always made: the others are compared with it).
    ``jobs``: runs at once (each in a worker process of its own).
    ``timeout``: seconds a worker process may take before it is killed and the run failed.
    ``emulator_url``: the base URL of a running emulator to use (default: one started here).
    ``database_url``: a PostgreSQL server to make the throwaway ledgers on, as databases
    beside the one named (its role needs CREATEDB); they are dropped at the end. Default:
    SQLite files.
    ``keep``: a directory to keep every run's ledger, outside world and logs in.
    ``progress``: called with each result as it comes.
    ``allow_untested``: a tool none of whose crash runs could be made (it reported no side
    effect) does not fail the report (``Report.untested``).

    The tools' handlers are called for real, in worker processes whose environment has
    ``TOOLLEDGER_CHECKING=1`` (``toolledger.testing.checking()``): point them at fakes.
    """
    if not hasattr(os, "fork"):
        raise CheckError("the check forks and SIGKILLs its workers: it runs on Linux or macOS only")
    if jobs < 1:
        raise CheckError("jobs must be at least 1", param="--jobs")
    if timeout <= 0:
        raise CheckError("timeout must be positive", param="--timeout")
    reference = registry if isinstance(registry, str) else reference_of(registry)
    _findable(reference)
    crash_points = _chosen_points(points)
    started = time.monotonic()
    with ExitStack() as stack:
        workdir = _workdir(stack, keep)
        # Made first: a server that refuses is said at once, not after the tools' imports.
        ledgers = stack.enter_context(throwaway_ledgers(workdir, database_url, keep=keep is not None))
        # Started first: importing the tools takes the forkservers seconds, the emulator meanwhile.
        forkservers = [
            stack.enter_context(Workers(reference, workdir / f"forkserver-{number + 1}.log"))
            for number in range(jobs)
        ]
        base_url, control, client = _agents_api(stack, emulator_url)
        pool: Queue[Workers] = Queue()
        for workers in forkservers:
            workers.ready()
            pool.put(workers)
        chosen = _chosen_tools(forkservers[0].ready(), tools)
        if not chosen:
            raise CheckError(f"{reference} holds no tools to check", param="--tools")
        arguments = _arguments(chosen, examples, {tool["name"] for tool in forkservers[0].ready()})
        _prepare(forkservers[0], workdir, ledgers)
        runs = Runs(workdir, ledgers, base_url, control, client, timeout, progress)
        results = runs.all(pool, jobs, chosen, arguments, crash_points)
    return Report(
        results,
        arguments={name: dict(a) for name, a in arguments.items() if isinstance(a, dict)},
        seconds=time.monotonic() - started,
        allow_untested=allow_untested,
    )


def assert_conforms(registry: ToolRegistry | str, **options: Any) -> Report:
    """``check_tools``, raising AssertionError with every contradiction and failed run."""
    report = check_tools(registry, **options)
    if not report.ok:
        raise AssertionError(report.explain())
    return report


def reference_of(registry: ToolRegistry) -> str:
    """``module:attribute`` of a module holding ``registry`` at its top level."""
    found = []
    for name, module in list(sys.modules.items()):
        if name == "__main__" or name.startswith("__mp_") or module is None:
            continue
        try:
            attributes = list(vars(module).items())
        except TypeError:
            continue
        found += [f"{name}:{attribute}" for attribute, value in attributes if value is registry]
    if not found:
        raise CheckError(
            "the registry is held by no module's top level, and the check's worker processes "
            "import it from one: define it in a module, or pass 'package.module:attribute'"
        )
    # A test module re-exporting the registry imports fine, but its own module is plainer.
    found.sort(key=lambda ref: ref.split(":")[0].rpartition(".")[2].startswith(("test_", "conftest")))
    return found[0]


# ------------------------------------------------------------------ set-up


def _findable(reference: str) -> None:
    """Refuse at once a reference whose module is nowhere to be found (a typo, mostly),
    without importing it: the worker processes do that, and take seconds to say so."""
    module, _, attribute = reference.partition(":")
    if not module or not attribute:
        raise CheckError(f"expected package.module:attribute, got {reference!r}", param="--tools")
    parts = module.split(".")
    # As the tools' loading does: the current directory is importable too.
    locations = [*sys.path, os.getcwd()]
    for depth in range(1, len(parts) + 1):
        name = ".".join(parts[:depth])
        loaded = sys.modules.get(name)
        if loaded is not None and loaded.__spec__ is None:
            return  # cannot tell without importing: the worker processes will
        spec = loaded.__spec__ if loaded is not None else PathFinder.find_spec(name, locations)
        if spec is None:
            raise CheckError(f"no module named {module!r} (from {reference!r})", param="--tools")
        if depth < len(parts):
            locations = list(spec.submodule_search_locations or [])
            if not locations:
                raise CheckError(f"{name!r} is not a package (from {reference!r})", param="--tools")


def _chosen_points(points: Iterable[str] | None) -> tuple[str, ...]:
    if points is None:
        return CRASH_POINTS
    asked = set(points) - {NO_CRASH}
    unknown = sorted(asked - set(CRASH_POINTS))
    if unknown:
        raise CheckError(
            f"unknown crash point {', '.join(unknown)} (known: {', '.join(POINTS)})", param="--point"
        )
    return tuple(p for p in CRASH_POINTS if p in asked)


def _chosen_tools(described: list[dict[str, Any]], tools: Iterable[str] | None) -> list[dict[str, Any]]:
    if tools is None:
        return described
    asked = list(dict.fromkeys(tools))
    known = {tool["name"]: tool for tool in described}
    unknown = [name for name in asked if name not in known]
    if unknown:
        raise CheckError(
            f"no tool named {', '.join(unknown)} in the registry (it has: {', '.join(known) or 'none'})",
            param="--tool",
        )
    return [known[name] for name in asked]


def _arguments(
    tools: list[dict[str, Any]], examples: Mapping[str, Mapping[str, Any]] | None, registered: set[str]
) -> dict[str, dict[str, Any] | ExampleError]:
    """Each tool's arguments: its example, or the simplest its schema accepts (or why none).
    An example for a tool the registry does not have is a typo, refused."""
    examples = examples or {}
    strays = sorted(set(examples) - registered)
    if strays:
        raise CheckError(
            f"examples for tools the registry does not have: {', '.join(strays)}", param="--examples"
        )
    chosen: dict[str, dict[str, Any] | ExampleError] = {}
    for tool in tools:
        name = tool["name"]
        if name in examples:
            example = examples[name]
            if not isinstance(example, Mapping):
                raise CheckError(f"the example for {name} is not an object of arguments", param="--examples")
            chosen[name] = dict(example)
            continue
        try:
            chosen[name] = arguments_for(tool["parameters"])
        except ExampleError as error:
            chosen[name] = error
    return chosen


def _workdir(stack: ExitStack, keep: Path | None) -> Path:
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        return keep
    return Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="toolledger-check-")))


def _agents_api(stack: ExitStack, url: str | None) -> tuple[str, EmulatorControl, OpenAI]:
    """The emulator's base URL, its control client, and the SDK the "application" uses."""
    from openai import OpenAI

    from toolledger.emulator import EmulatorControl, EmulatorServer

    if url is None:
        server = stack.enter_context(EmulatorServer())
        url, control = server.base_url, server.control
    else:
        control = EmulatorControl(url)
        stack.callback(control.close)
    client = stack.enter_context(OpenAI(base_url=url, api_key=API_KEY, max_retries=2))
    # The SDK builds its session types on first use (a second or more): now, while the
    # forkservers import, rather than in the first run. The empty script calls nothing.
    client.beta.agents.sessions.create(
        environment={"type": "none"},
        agent={"model": "emulated"},
        metadata={"emulator_script": '{"steps": []}'},
        input="toolledger check: warming up",
    )
    return url, control, client


def _prepare(workers: Workers, workdir: Path, ledgers: ThrowawayLedgers) -> None:
    """Migrate the template ledger and give it the effects table: each run starts from a copy."""
    job = Job(
        kind="prepare",
        database_url=ledgers.template_url,
        out=str(workdir / "template.json"),
        log=str(workdir / "template.log"),
    )
    code = workers.do(job.as_json(), DEFAULT_TIMEOUT)
    if code != 0:
        raise CheckError(f"could not make the throwaway ledger:\n{log_tail(Path(job.log))}")
