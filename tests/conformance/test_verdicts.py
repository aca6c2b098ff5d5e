"""The check's verdicts from observations alone: each contradiction's sentence, and what is not one."""

from __future__ import annotations

from collections import Counter

import pytest

from toolledger.domain.states import EffectClass
from toolledger.testing.verdicts import NO_CRASH, Observation, Status, judge

BASELINE = Observation(killed=False, effects=Counter(charge=1), status="submitted", runs=1, accepted=1)


def crashed(**facts: object) -> Observation:
    """A run killed at its point and recovered: one effect before the kill, answered once."""
    values: dict[str, object] = {
        "killed": True,
        "effects": Counter(charge=1),
        "effects_at_kill": Counter(charge=1),
        "status": "submitted",
        "runs": 2,
        "accepted": 1,
    }
    return Observation(**{**values, **facts})  # type: ignore[arg-type]


def test_judge__idempotent_tool_with_two_effects_for_one_key__contradicts() -> None:
    verdict = judge(EffectClass.IDEMPOTENT, "inside_handler", crashed(effects=Counter(charge=2)), BASELINE)

    assert verdict.status is Status.CONTRADICTION
    assert verdict.problems == (
        'declared idempotent: 2 side effects "charge" seen for one key (1 without a crash): '
        "the tool does not dedupe by ctx.idempotency_key",
    )


def test_judge__effects_a_call_always_makes__are_no_repeat() -> None:
    """A tool making two effects a call makes two in every run: only more than that repeats."""
    baseline = Observation(killed=False, effects=Counter(charge=1, mail=2), status="submitted", runs=1)

    verdict = judge(
        EffectClass.IDEMPOTENT, "after_handler", crashed(effects=Counter(charge=1, mail=2)), baseline
    )

    assert verdict.status is Status.OK
    assert verdict.note == "run again; no repeated side effect"


def test_judge__verified_hook_saying_not_executed_after_the_effect__contradicts() -> None:
    run = crashed(effects=Counter(charge=2), answers=("not_executed",))

    verdict = judge(EffectClass.VERIFIED, "inside_handler", run, BASELINE)

    assert verdict.problems == ("verified: the hook said not executed after the effect",)


def test_judge__verified_hook_saying_executed_without_an_effect__contradicts() -> None:
    run = crashed(effects=Counter(), effects_at_kill=Counter(), answers=("executed",), runs=1)

    verdict = judge(EffectClass.VERIFIED, "after_claim_commit", run, BASELINE)

    assert verdict.problems == ("verified: the hook said executed but no effect was seen",)


@pytest.mark.parametrize(
    ("answers", "effects_at_kill", "note"),
    [
        (("executed",), Counter(charge=1), "the hook said executed: settled without a re-run"),
        (("not_executed",), Counter(), "the hook said not executed: run again; no repeated side effect"),
    ],
)
def test_judge__verified_hook_telling_the_truth__is_ok(
    answers: tuple[str, ...], effects_at_kill: Counter[str], note: str
) -> None:
    run = crashed(answers=answers, effects_at_kill=effects_at_kill, runs=1 if "executed" in answers else 2)

    verdict = judge(EffectClass.VERIFIED, "after_handler", run, BASELINE)

    assert (verdict.status, verdict.note) == (Status.OK, note)


def test_judge__verified_hook_that_cannot_tell__waits_and_is_no_contradiction() -> None:
    run = crashed(answers=("raised KeyError",), status="unknown", runs=1)

    verdict = judge(EffectClass.VERIFIED, "inside_handler", run, BASELINE)

    assert verdict.status is Status.OK
    assert verdict.note == (
        "the hook answered raised KeyError: unknown after the crash, waits for an operator "
        "(toolledger calls resolve)"
    )


def test_judge__transactional_effect_outliving_the_rollback__contradicts() -> None:
    verdict = judge(EffectClass.TRANSACTIONAL, "after_handler", crashed(effects=Counter(charge=2)), BASELINE)

    assert verdict.problems == (
        'transactional: an effect survived a rolled-back run (2 side effects "charge" seen, 1 without a '
        "crash): it was not written through ctx.db",
    )


def test_judge__read_only_tool_reporting_an_effect__contradicts_even_without_a_crash() -> None:
    run = Observation(killed=False, effects=Counter({"audit record": 1}), status="submitted", runs=1)

    verdict = judge(EffectClass.READ_ONLY, NO_CRASH, run, None)

    assert verdict.problems == ('read_only: a side effect was reported ("audit record")',)


@pytest.mark.parametrize("run", [crashed(runs=2), crashed(effects=Counter(charge=2), runs=1)])
def test_judge__at_most_once_tool_run_twice__is_a_toolledger_bug(run: Observation) -> None:
    verdict = judge(EffectClass.AT_MOST_ONCE, "after_handler", run, BASELINE)

    assert verdict.problems == ("at_most_once: ran twice (a toolledger bug: please report it)",)


def test_judge__at_most_once_tool_left_unknown__waits_for_an_operator() -> None:
    verdict = judge(EffectClass.AT_MOST_ONCE, "inside_handler", crashed(status="unknown", runs=1), BASELINE)

    assert verdict.status is Status.OK
    assert verdict.note == "unknown after the crash, waits for an operator (toolledger calls resolve)"


def test_judge__two_results_accepted_for_one_call__is_a_toolledger_bug() -> None:
    run = crashed(accepted=2, accepted_is_stored=False, runs=1)

    verdict = judge(EffectClass.IDEMPOTENT, "after_submit_response", run, BASELINE)

    assert verdict.problems == (
        "the session accepted 2 results for one call (a toolledger bug: please report it)",
        "the session accepted another result than the ledger stored (a toolledger bug: please report it)",
    )


@pytest.mark.parametrize(
    ("effect", "point", "reason"),
    [
        (
            EffectClass.IDEMPOTENT,
            "inside_handler",
            "the tool reported no side effect to be killed in (see toolledger.testing.effect)",
        ),
        (EffectClass.READ_ONLY, "inside_handler", "a read_only tool makes no side effect to be killed in"),
        (EffectClass.IDEMPOTENT, "after_submit_response", "the run never reached after_submit_response"),
    ],
)
def test_judge__point_never_reached__is_not_applicable(effect: EffectClass, point: str, reason: str) -> None:
    verdict = judge(effect, point, crashed(killed=False), BASELINE)

    assert (verdict.status, verdict.problems) == (Status.NOT_APPLICABLE, (reason,))


@pytest.mark.parametrize("status", ["running", "succeeded", None])
def test_judge__call_left_unanswered__is_an_error_not_a_verdict(status: str | None) -> None:
    verdict = judge(EffectClass.IDEMPOTENT, "after_handler", crashed(status=status), BASELINE)

    assert verdict.status is Status.ERROR
    assert verdict.problems == (f"the call was left {status or 'unrecorded'}",)


def test_judge__call_failing_without_a_crash__asks_for_an_example() -> None:
    run = Observation(killed=False, status="submitted", runs=1, success=False, told="No order example.")

    verdict = judge(EffectClass.IDEMPOTENT, NO_CRASH, run, None)

    assert verdict.status is Status.ERROR
    assert verdict.problems == (
        "the call failed without a crash (No order example.): nothing to compare the crashes with; "
        "give arguments it succeeds with (--examples, examples=)",
    )


def test_judge__call_settled_as_failed_after_a_crash__says_so() -> None:
    """An at_most_once tool with an unknown_deadline of 0: the fixed failure is its answer."""
    run = crashed(runs=1, success=False, told="The outcome of this call is unknown.")

    verdict = judge(EffectClass.AT_MOST_ONCE, "inside_handler", run, BASELINE)

    assert (verdict.status, verdict.note) == (
        Status.OK,
        "answered with a failure: The outcome of this call is unknown.",
    )
