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

import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from importlib.machinery import PathFinder
from pathlib import Path
from queue import Queue
from typing import TYPE_CHECKING, Any

from toolledger.domain.states import EffectClass
from toolledger.testing.examples import ExampleError, arguments_for
from toolledger.testing.verdicts import (
    CRASH_POINTS,
    NO_CRASH,
    POINTS,
    Observation,
    PointResult,
    Status,
    judge,
)
from toolledger.testing.workers import API_KEY, CheckError, Job, JobTimeout, Workers
from toolledger.testing.world import World

if TYPE_CHECKING:
    from openai import OpenAI

    from toolledger.emulator import EmulatorControl
    from toolledger.runtime.registry import ToolRegistry

DEFAULT_TIMEOUT = 60.0
"""Seconds one worker process may take (a run has two: the killed one and the recovery)."""
SESSION_SECONDS = 10.0
"""How long the emulator's model may take to call the tool."""

Progress = Callable[[PointResult], None]


@dataclass
class Report:
    """Every tool's verdict at every point, in the registry's order and a call's."""

    results: list[PointResult]
    arguments: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The arguments each tool was called with."""
    seconds: float = 0.0

    @property
    def contradictions(self) -> list[PointResult]:
        return [r for r in self.results if r.status is Status.CONTRADICTION]

    @property
    def errors(self) -> list[PointResult]:
        return [r for r in self.results if r.status is Status.ERROR]

    @property
    def ok(self) -> bool:
        """No contradiction, and every run that was meant to be made was."""
        return not self.contradictions and not self.errors

    @property
    def exit_code(self) -> int:
        """0: nothing wrong; 1: a contradiction; 3: no contradiction, but a run failed."""
        if self.contradictions:
            return 1
        return 3 if self.errors else 0

    def result(self, tool: str, point: str) -> PointResult:
        for found in self.results:
            if (found.tool, found.point) == (tool, point):
                return found
        raise KeyError(f"no result for {tool} at {point}")

    def as_json(self) -> dict[str, Any]:
        tools: dict[str, dict[str, Any]] = {}
        for result in self.results:
            entry = tools.setdefault(
                result.tool,
                {
                    "name": result.tool,
                    "effect_class": result.effect_class,
                    "arguments": self.arguments.get(result.tool),
                    "points": [],
                },
            )
            entry["points"].append(
                {k: v for k, v in result.as_json().items() if k not in ("tool", "effect_class")}
            )
        return {
            "ok": self.ok,
            "exit_code": self.exit_code,
            "contradictions": len(self.contradictions),
            "errors": len(self.errors),
            "seconds": round(self.seconds, 1),
            "tools": list(tools.values()),
        }

    def explain(self) -> str:
        """The contradictions and errors, one line each (what an assertion says)."""
        lines = [
            f"{r.tool} ({r.effect_class}) at {r.point}: {r.text()}" for r in self.contradictions + self.errors
        ]
        return "\n".join(lines) if lines else "every tool conforms to its effect class"


def check_tools(
    registry: ToolRegistry | str,
    *,
    examples: Mapping[str, Mapping[str, Any]] | None = None,
    tools: Iterable[str] | None = None,
    points: Iterable[str] | None = None,
    jobs: int = 1,
    timeout: float = DEFAULT_TIMEOUT,
    emulator_url: str | None = None,
    keep: Path | None = None,
    progress: Progress | None = None,
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
    ``keep``: a directory to keep every run's ledger, outside world and logs in.
    ``progress``: called with each result as it comes.
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
        template = _template(forkservers[0], workdir)
        check = _Check(workdir, template, base_url, control, client, timeout, progress)
        results = check.all(pool, jobs, chosen, arguments, crash_points)
    return Report(
        results,
        arguments={name: dict(a) for name, a in arguments.items() if isinstance(a, dict)},
        seconds=time.monotonic() - started,
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


def _template(workers: Workers, workdir: Path) -> Path:
    """A migrated ledger with the effects table: each run starts from a copy."""
    path = workdir / "template.sqlite3"
    for stale in (path, path.with_name(f"{path.name}-wal"), path.with_name(f"{path.name}-shm")):
        stale.unlink(missing_ok=True)
    job = Job(
        kind="prepare",
        database_url=_sqlite_url(path),
        out=str(workdir / "template.json"),
        log=str(workdir / "template.log"),
    )
    code = workers.do(job.as_json(), DEFAULT_TIMEOUT)
    if code != 0:
        raise CheckError(f"could not make the throwaway ledger:\n{_tail(Path(job.log))}")
    return path


def _file_name(name: str) -> str:
    """A tool's name as a directory's (a registry may name a tool anything)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name).lstrip(".") or "_"


def _sqlite_url(path: Path) -> str:
    return f"sqlite+aiosqlite:///{path}"


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])


# ------------------------------------------------------------------ the runs


@dataclass(frozen=True)
class _Tool:
    name: str
    effect: EffectClass
    arguments: dict[str, Any]
    script: str
    """The emulator's script that calls it once (by name)."""


@dataclass
class _Check:
    workdir: Path
    template: Path
    base_url: str
    control: EmulatorControl
    client: OpenAI
    timeout: float
    progress: Progress | None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def all(
        self,
        pool: Queue[Workers],
        jobs: int,
        tools: list[dict[str, Any]],
        arguments: Mapping[str, dict[str, Any] | ExampleError],
        crash_points: tuple[str, ...],
    ) -> list[PointResult]:
        results: dict[tuple[str, str], PointResult] = {}
        runnable: list[_Tool] = []
        for described in tools:
            given = arguments[described["name"]]
            if isinstance(given, ExampleError):
                self._skip_tool(results, described, crash_points, given)
            else:
                runnable.append(self._scripted(described, given))
        runs = ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="toolledger-check")
        try:
            baselines = [(tool, runs.submit(self._run_with, pool, tool, NO_CRASH, None)) for tool in runnable]
            crash_runs = []
            # A tool's crash runs start as soon as its baseline is in, beside the others' baselines.
            for tool, pending in baselines:
                result, baseline = pending.result()
                results[(tool.name, NO_CRASH)] = result
                reason = _not_worth_crashing(tool, result, baseline)
                for point in crash_points:
                    if reason is None:
                        crash_runs.append(runs.submit(self._run_with, pool, tool, point, baseline))
                    else:
                        results[(tool.name, point)] = self._report(
                            _skipped(tool.name, tool.effect.value, point, reason)
                        )
            for pending in crash_runs:
                result, _ = pending.result()
                results[(result.tool, result.point)] = result
        finally:
            # After whatever stopped the check (its forkserver gone, Ctrl-C) no run starts.
            runs.shutdown(wait=True, cancel_futures=True)
        order = {described["name"]: number for number, described in enumerate(tools)}
        return sorted(results.values(), key=lambda r: (order[r.tool], POINTS.index(r.point)))

    def _skip_tool(
        self,
        results: dict[tuple[str, str], PointResult],
        tool: dict[str, Any],
        crash_points: tuple[str, ...],
        why: ExampleError,
    ) -> None:
        name, effect = tool["name"], tool["effect"]
        results[(name, NO_CRASH)] = self._report(
            PointResult(
                name,
                effect,
                NO_CRASH,
                Status.ERROR,
                (f"no arguments to call it with ({why}): give an example (--examples, examples=)",),
            )
        )
        for point in crash_points:
            results[(name, point)] = self._report(_skipped(name, effect, point, "no arguments"))

    def _scripted(self, tool: dict[str, Any], arguments: dict[str, Any]) -> _Tool:
        from toolledger.emulator import Script

        script = f"toolledger-check-{uuid.uuid4().hex[:12]}"
        self.control.register_script(script, Script.of_calls([(tool["name"], arguments)]))
        return _Tool(tool["name"], EffectClass(tool["effect"]), arguments, script)

    def _run_with(
        self, pool: Queue[Workers], tool: _Tool, point: str, baseline: Observation | None
    ) -> tuple[PointResult, Observation | None]:
        workers = pool.get()
        try:
            started = time.monotonic()
            try:
                result, observation = self._run(workers, tool, point, baseline)
            except (JobTimeout, _RunFailed) as error:
                result, observation = PointResult("", "", point, Status.ERROR, (str(error),)), None
            result = replace(
                result,
                tool=tool.name,
                effect_class=tool.effect.value,
                seconds=round(time.monotonic() - started, 2),
            )
            return self._report(result), observation
        finally:
            pool.put(workers)

    def _run(
        self, workers: Workers, tool: _Tool, point: str, baseline: Observation | None
    ) -> tuple[PointResult, Observation]:
        directory = self.workdir / _file_name(tool.name) / point
        shutil.rmtree(directory, ignore_errors=True)  # a kept directory's earlier check
        directory.mkdir(parents=True)
        ledger = directory / "ledger.sqlite3"
        shutil.copyfile(self.template, ledger)
        wal = self.template.with_name(f"{self.template.name}-wal")
        if wal.exists():  # closed, so normally folded into the file; if not, it is part of it
            shutil.copyfile(wal, ledger.with_name(f"{ledger.name}-wal"))
        world = World(directory / "world.sqlite3").create()
        session_id, turn_id, call_id = self._session(tool)
        job = Job(
            kind="run",
            database_url=_sqlite_url(ledger),
            out=str(directory / "run.json"),
            log=str(directory / "worker.log"),
            base_url=self.base_url,
            session_id=session_id,
            turn_id=turn_id,
            call_id=call_id,
            world=str(world.path),
            crash_at=None if point == NO_CRASH else point,
        )
        code = workers.do(job.as_json(), self.timeout)
        killed = code == -signal.SIGKILL
        if code not in (0, -signal.SIGKILL):
            raise _RunFailed(f"the worker process failed (exit code {code}): {_tail(Path(job.log), 3)}")
        effects_at_kill: Counter[str] = Counter()
        if killed:
            effects_at_kill = world.effects()
            job = replace(
                job, kind="recover", out=str(directory / "recover.json"), log=str(directory / "recovery.log")
            )
            job = replace(job, crash_at=None)
            code = workers.do(job.as_json(), self.timeout)
            if code != 0:
                raise _RunFailed(f"the recovery process failed (exit code {code}): {_tail(Path(job.log), 3)}")
        found: dict[str, Any] = json.loads(Path(job.out).read_text(encoding="utf-8"))
        observation = self._observation(found, killed, world, effects_at_kill, session_id, call_id)
        return judge(tool.effect, point, observation, baseline), observation

    def _observation(
        self,
        found: dict[str, Any],
        killed: bool,
        world: World,
        effects_at_kill: Counter[str],
        session_id: str,
        call_id: str,
    ) -> Observation:
        payload = found.get("payload")
        accepted = [
            r.payload
            for r in self.control.tool_results(session_id)
            if r.call_id == call_id and r.outcome == "accepted"
        ]
        return Observation(
            killed=killed,
            effects=world.effects() + Counter(found.get("ledger_effects") or {}),
            effects_at_kill=effects_at_kill + Counter(found.get("ledger_effects_before") or {}),
            answers=tuple(world.answers()),
            status=found.get("status"),
            runs=int(found.get("runs") or 0),
            accepted=len(accepted),
            accepted_is_stored=all(a == payload for a in accepted),
            success=None if payload is None else bool(payload.get("success")),
            told=None if payload is None else payload.get("error"),
        )

    def _session(self, tool: _Tool) -> tuple[str, str, str]:
        """A session whose model calls the tool once: its id, and the call's turn and call ids."""
        session = self.client.beta.agents.sessions.create(
            environment={"type": "none"},
            agent={"model": "emulated"},
            metadata={"emulator_script": tool.script},
            input=f"toolledger check: call {tool.name}",
        )
        deadline = time.monotonic() + SESSION_SECONDS
        while time.monotonic() < deadline:
            for action in self.client.beta.agents.sessions.retrieve(session.id).required_actions:
                if getattr(action, "type", None) == "function_call":
                    return session.id, str(getattr(action, "turn_id")), str(getattr(action, "call_id"))  # noqa: B009
            time.sleep(0.02)
        raise _RunFailed(f"the emulator's model did not call {tool.name} within {SESSION_SECONDS:g}s")

    def _report(self, result: PointResult) -> PointResult:
        if self.progress is not None:
            with self._lock:
                self.progress(result)
        return result


class _RunFailed(Exception):
    """A run could not be carried out."""


def _not_worth_crashing(tool: _Tool, result: PointResult, baseline: Observation | None) -> str | None:
    """Why the crash runs would tell nothing about this tool, if they would not."""
    if baseline is not None and baseline.success is False:
        return f"the call failed without a crash ({baseline.told})"
    if baseline is None or result.status is Status.ERROR:
        return "the run without a crash failed"
    if tool.effect is not EffectClass.READ_ONLY and not baseline.effects:
        return "the tool reported no side effect without a crash (see toolledger.testing.effect)"
    return None


def _skipped(tool: str, effect: str, point: str, reason: str) -> PointResult:
    return PointResult(tool, effect, point, Status.NOT_APPLICABLE, (f"skipped: {reason}",))
