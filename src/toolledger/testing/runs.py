"""The runs of a conformance check: for each tool its baseline, then a run per crash point,
each one session on the emulator, a copy of the throwaway ledger, a worker process (killed
at the point) and a recovery process, and the verdict on what they left behind.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from queue import Queue
from typing import TYPE_CHECKING, Any

from toolledger.domain.states import EffectClass
from toolledger.testing.examples import ExampleError
from toolledger.testing.ledgers import ThrowawayLedgers
from toolledger.testing.verdicts import NO_CRASH, POINTS, Observation, PointResult, Status, judge
from toolledger.testing.workers import Job, JobTimeout, Workers
from toolledger.testing.world import World

if TYPE_CHECKING:
    from openai import OpenAI

    from toolledger.emulator import EmulatorControl

SESSION_SECONDS = 10.0
"""How long the emulator's model may take to call the tool."""

Progress = Callable[[PointResult], None]


@dataclass(frozen=True)
class _Tool:
    name: str
    effect: EffectClass
    arguments: dict[str, Any]
    script: str
    """The emulator's script that calls it once (by name)."""


@dataclass
class Runs:
    """Carries out a check's runs, ``jobs`` at once, and reports each verdict as it comes."""

    workdir: Path
    ledgers: ThrowawayLedgers
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
        ledger = self.ledgers.fresh(directory)
        try:
            return self._run_on(ledger, directory, workers, tool, point, baseline)
        finally:
            self.ledgers.discard(ledger)

    def _run_on(
        self,
        ledger: str,
        directory: Path,
        workers: Workers,
        tool: _Tool,
        point: str,
        baseline: Observation | None,
    ) -> tuple[PointResult, Observation]:
        world = World(directory / "world.sqlite3").create()
        session_id, turn_id, call_id = self._session(tool)
        job = Job(
            kind="run",
            database_url=ledger,
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
            raise _RunFailed(f"the worker process failed (exit code {code}): {log_tail(Path(job.log), 3)}")
        effects_at_kill: Counter[str] = Counter()
        if killed:
            effects_at_kill = world.effects()
            job = replace(
                job, kind="recover", out=str(directory / "recover.json"), log=str(directory / "recovery.log")
            )
            job = replace(job, crash_at=None)
            code = workers.do(job.as_json(), self.timeout)
            if code != 0:
                raise _RunFailed(
                    f"the recovery process failed (exit code {code}): {log_tail(Path(job.log), 3)}"
                )
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
    return PointResult(tool, effect, point, Status.NOT_APPLICABLE, (f"skipped: {reason}",), skipped=True)


def _file_name(name: str) -> str:
    """A tool's name as a directory's (a registry may name a tool anything)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name).lstrip(".") or "_"


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])
