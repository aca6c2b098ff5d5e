"""What one run of the conformance check says about a tool: its observations held against
the effect class the tool declares. Pure: no processes, no files, no clock.

A run is one call of the tool, its worker killed at a crash point (or not: ``no_crash``),
then recovered by a fresh process. Its side effects are compared with those of the run
without a crash (the baseline): a tool that makes two effects a call makes two in every
run, and only what goes beyond that is a repeat.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from toolledger.crashpoints import (
    CP_AFTER_CLAIM_COMMIT,
    CP_AFTER_HANDLER,
    CP_AFTER_RESULT_COMMIT,
    CP_AFTER_SUBMIT_RESPONSE,
    CP_INSIDE_HANDLER,
)
from toolledger.domain.states import EffectClass

NO_CRASH = "no_crash"
"""The run without a crash: the baseline every other run is compared with."""
CRASH_POINTS = (
    CP_AFTER_CLAIM_COMMIT,
    CP_INSIDE_HANDLER,
    CP_AFTER_HANDLER,
    CP_AFTER_RESULT_COMMIT,
    CP_AFTER_SUBMIT_RESPONSE,
)
"""Where a run's worker is killed, in the order of a call's life."""
POINTS = (NO_CRASH, *CRASH_POINTS)

ANSWERED = "submitted"
WAITING = "unknown"


class Status(StrEnum):
    OK = "ok"
    """Nothing observed contradicts the declared effect class."""
    CONTRADICTION = "contradiction"
    """Observed behaviour contradicts it: the problems say how."""
    NOT_APPLICABLE = "not_applicable"
    """Nothing to judge here: the point was not reached, or the run was not worth making."""
    ERROR = "error"
    """The run could not be carried out (the tool hung, a worker failed): nothing is known."""


@dataclass(frozen=True)
class PointResult:
    """The verdict on one tool at one point."""

    tool: str
    effect_class: str
    point: str
    status: Status
    problems: tuple[str, ...] = ()
    """For a contradiction, one sentence each; for an error or not_applicable, the reason."""
    note: str | None = None
    """What happened, in a few words (an ``ok``'s story)."""
    seconds: float = 0.0
    skipped: bool = False
    """The run was not made (``not_applicable``: it would have told nothing)."""

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "status": self.status.value, "problems": list(self.problems)}

    def text(self) -> str:
        """The result in one line of words: its status, then its problems or note."""
        said = "; ".join(self.problems) if self.problems else (self.note or "")
        return f"{self.status.value}: {said}" if said else self.status.value


@dataclass(frozen=True)
class Observation:
    """What one run came to, once its recovery (if any) was done."""

    killed: bool
    """The worker died by SIGKILL at the armed point (always False for ``no_crash``)."""
    effects: Counter[str] = field(default_factory=Counter)
    """Side effects by name, in the end (the outside world's and the ledger's committed ones)."""
    effects_at_kill: Counter[str] = field(default_factory=Counter)
    """Side effects by name that outlived the killed worker, before the recovery ran."""
    answers: tuple[str, ...] = ()
    """What the verify hook answered during the recovery (``raised <Error>`` if it raised)."""
    status: str | None = None
    """The call's status in the ledger, in the end."""
    runs: int = 0
    """Claims of the call: times a handler run was started (or about to be)."""
    accepted: int = 0
    """Results the session accepted for the call (an idempotent replay is not another)."""
    accepted_is_stored: bool = True
    """The accepted result is the one the ledger stored, byte for byte."""
    success: bool | None = None
    """The stored result's success flag."""
    told: str | None = None
    """What the model was told when the result is a failure."""


def judge(effect: EffectClass, point: str, run: Observation, baseline: Observation | None) -> PointResult:
    """The verdict on a tool declared ``effect`` at ``point``: a ``PointResult`` without its
    tool name, class or time (the caller's to fill)."""
    if point != NO_CRASH and not run.killed:
        return _result(Status.NOT_APPLICABLE, point, (_not_reached(point, effect),))
    problems = _toolledger_problems(run)
    if run.status not in (ANSWERED, WAITING) or (point == NO_CRASH and run.status != ANSWERED):
        return _result(Status.ERROR, point, (f"the call was left {run.status or 'unrecorded'}",))
    expected = baseline.effects if baseline is not None else run.effects
    problems += _class_problems(effect, run, expected)
    if problems:
        return _result(Status.CONTRADICTION, point, tuple(problems))
    if point == NO_CRASH and run.success is False:
        return _result(
            Status.ERROR,
            point,
            (
                f"the call failed without a crash ({run.told}): nothing to compare the crashes with; "
                "give arguments it succeeds with (--examples, examples=)",
            ),
        )
    return _result(Status.OK, point, note=_story(effect, point, run))


def _result(
    status: Status, point: str, problems: tuple[str, ...] = (), note: str | None = None
) -> PointResult:
    return PointResult(tool="", effect_class="", point=point, status=status, problems=problems, note=note)


def _not_reached(point: str, effect: EffectClass) -> str:
    if point == CP_INSIDE_HANDLER:
        if effect is EffectClass.READ_ONLY:
            return "a read_only tool makes no side effect to be killed in"
        return "the tool reported no side effect to be killed in (see toolledger.testing.effect)"
    return f"the run never reached {point}"


def _toolledger_problems(run: Observation) -> list[str]:
    """Promises that are toolledger's, whatever the tool does: a break is a toolledger bug."""
    problems = []
    if run.accepted > 1:
        problems.append(
            f"the session accepted {run.accepted} results for one call (a toolledger bug: please report it)"
        )
    if run.accepted and not run.accepted_is_stored:
        problems.append(
            "the session accepted another result than the ledger stored (a toolledger bug: please report it)"
        )
    return problems


def _class_problems(effect: EffectClass, run: Observation, expected: Counter[str]) -> list[str]:
    repeats = {name: count for name, count in sorted(run.effects.items()) if count > expected[name]}
    if effect is EffectClass.READ_ONLY:
        if run.effects:
            return [f"read_only: a side effect was reported ({_names(run.effects)})"]
        return []
    if effect is EffectClass.AT_MOST_ONCE:
        if run.runs > 1 or repeats:
            return ["at_most_once: ran twice (a toolledger bug: please report it)"]
        return []
    if effect is EffectClass.IDEMPOTENT:
        return [
            f"declared idempotent: {_seen(name, count)} for one key ({expected[name]} without a crash): "
            "the tool does not dedupe by ctx.idempotency_key"
            for name, count in repeats.items()
        ]
    if effect is EffectClass.TRANSACTIONAL:
        return [
            f"transactional: an effect survived a rolled-back run ({_seen(name, count)}, "
            f"{expected[name]} without a crash): it was not written through ctx.db"
            for name, count in repeats.items()
        ]
    if effect is EffectClass.VERIFIED:
        return _verified_problems(run, repeats, expected)
    return []


def _verified_problems(run: Observation, repeats: dict[str, int], expected: Counter[str]) -> list[str]:
    problems = []
    made = sum(run.effects_at_kill.values())
    if "not_executed" in run.answers and made:
        problems.append("verified: the hook said not executed after the effect")
    if "executed" in run.answers and not made:
        problems.append("verified: the hook said executed but no effect was seen")
    if not problems:
        problems += [
            f"verified: {_seen(name, count)} for one key ({expected[name]} without a crash)"
            for name, count in repeats.items()
        ]
    return problems


def _seen(name: str, count: int) -> str:
    return f'{count} side effects "{name}" seen'


def _names(effects: Counter[str]) -> str:
    return ", ".join(f'"{name}"' for name in sorted(effects))


def _story(effect: EffectClass, point: str, run: Observation) -> str:
    if point == NO_CRASH:
        made = sum(run.effects.values())
        return f"{made} side effect{'s' if made != 1 else ''}, answered"
    if run.status == WAITING:
        hook = f"the hook answered {run.answers[-1]}: " if run.answers else ""
        return f"{hook}unknown after the crash, waits for an operator (toolledger calls resolve)"
    if "executed" in run.answers:
        return "the hook said executed: settled without a re-run"
    if run.success is False:
        return f"answered with a failure: {run.told}"
    if run.runs > 1:
        because = "the hook said not executed: " if "not_executed" in run.answers else ""
        return f"{because}run again; no repeated side effect"
    return "the stored result was sent again; the tool was not re-run"
