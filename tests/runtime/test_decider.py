"""The decider alone: a call record, a tool's policy and a moment in, a decision out. No database."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from toolledger.domain.keys import CallKey
from toolledger.domain.records import CallRecord
from toolledger.domain.results import (
    POISON_MESSAGE,
    UNKNOWN_OUTCOME_MESSAGE,
    FailureStage,
    failed,
    succeeded,
)
from toolledger.domain.states import CallStatus, EffectClass
from toolledger.runtime.context import ToolContext, Verification, VerifyAnswer
from toolledger.runtime.decider import (
    VERIFY_RETRY_SECONDS,
    AskOperator,
    Claim,
    HandleAction,
    Policy,
    Report,
    Resubmit,
    Settle,
    TakeOver,
    Verified,
    Verify,
    decide,
    tool_for,
)
from toolledger.runtime.executor import HandleReport
from toolledger.runtime.registry import RegisteredTool, ToolRegistry

KEY = CallKey("s", "t", "c")
NOW = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)
POLICY = Policy(run_handlers=True, resubmit_after_seconds=10.0, max_attempts=3)


def call(status: CallStatus, **changes: Any) -> CallRecord:
    record = CallRecord(
        key=KEY,
        tool_name="charge",
        arguments="{}",
        arguments_sha256="0" * 64,
        status=status,
        effect_class=EffectClass.AT_MOST_ONCE,
        idempotency_key=KEY.idempotency_key,
        attempt_count=1,
        lease_owner="worker",
        lease_token=1,
        lease_expires_at=NOW - timedelta(seconds=1),
        result=None,
        error_stage=None,
        error_detail=None,
        created_at=NOW - timedelta(seconds=30),
        started_at=NOW - timedelta(seconds=30),
        finished_at=None,
        submitted_at=None,
        confirmed_at=None,
        submission_count=0,
        last_submission_error=None,
        abandoned_reason=None,
    )
    return replace(record, **changes)


def tool(effect: str = "at_most_once", **policy: Any) -> RegisteredTool:
    registry = ToolRegistry()

    def verify(ctx: ToolContext) -> Verification:
        return Verification.unknown()

    @registry.tool(name="charge", effect=effect, verify=verify if effect == "verified" else None, **policy)
    def charge(amount: int) -> str:
        return "done"

    found = registry.get("charge")
    assert found is not None
    return found


# --------------------------------------------------------------- a stored result


@pytest.mark.parametrize("status", [CallStatus.SUCCEEDED, CallStatus.FAILED])
def test_a_stored_result_is_submitted(status: CallStatus) -> None:
    assert decide(call(status), tool(), POLICY, NOW) == Resubmit()


def test_a_stored_result_is_submitted_even_by_a_process_without_handlers() -> None:
    policy = replace(POLICY, run_handlers=False)
    assert decide(call(CallStatus.SUCCEEDED), None, policy, NOW) == Resubmit()


def test_submitted_moments_ago__the_listing_predates_it__nothing_to_do() -> None:
    submitted = call(CallStatus.SUBMITTED, submitted_at=NOW - timedelta(seconds=9.9))

    assert decide(submitted, tool(), POLICY, NOW) == Report(HandleAction.ALREADY_SUBMITTED, submitted=True)


def test_submitted_long_ago_and_still_awaited__resubmitted_and_noted_unconfirmed() -> None:
    submitted = call(CallStatus.SUBMITTED, submitted_at=NOW - timedelta(seconds=10))

    assert decide(submitted, tool(), POLICY, NOW) == Resubmit(unconfirmed=True)


def test_submitted_long_ago_and_listed_by_an_event__not_sent_again_but_looked_at_now() -> None:
    """An event may have waited any time to be read: its listing is no evidence the
    submission was lost, so a read of the session (retry_in=0) decides, not the event."""
    submitted = call(CallStatus.SUBMITTED, submitted_at=NOW - timedelta(seconds=60))

    assert decide(submitted, tool(), POLICY, NOW, listing_may_be_stale=True) == Report(
        HandleAction.ALREADY_SUBMITTED, submitted=True, retry_in=0.0
    )


def test_submitted_moments_ago_and_listed_by_an_event__nothing_to_do() -> None:
    submitted = call(CallStatus.SUBMITTED, submitted_at=NOW - timedelta(seconds=1))

    assert decide(submitted, tool(), POLICY, NOW, listing_may_be_stale=True) == Report(
        HandleAction.ALREADY_SUBMITTED, submitted=True
    )


def test_submitted_without_a_time__resubmitted() -> None:
    assert decide(call(CallStatus.SUBMITTED), tool(), POLICY, NOW) == Resubmit(unconfirmed=True)


# --------------------------------------------------------------- no handlers here


@pytest.mark.parametrize("status", [CallStatus.PENDING, CallStatus.UNKNOWN, CallStatus.RUNNING])
def test_without_handlers__a_call_needing_a_run_is_left_for_the_service(status: CallStatus) -> None:
    policy = replace(POLICY, run_handlers=False)

    assert decide(call(status), tool("idempotent"), policy, NOW) == Report(HandleAction.LEFT_FOR_SERVICE)


# --------------------------------------------------------------- running, pending, over


def test_running__its_lease_is_looked_at() -> None:
    assert decide(call(CallStatus.RUNNING), tool(), POLICY, NOW) == TakeOver()


def test_pending__claimed_and_executed() -> None:
    assert decide(call(CallStatus.PENDING), tool(), POLICY, NOW) == Claim(
        CallStatus.PENDING, "claimed", HandleAction.EXECUTED
    )


def test_pending_for_an_unregistered_tool__claimed_too_so_its_lookup_failure_is_stored() -> None:
    assert decide(call(CallStatus.PENDING), None, POLICY, NOW) == Claim(
        CallStatus.PENDING, "claimed", HandleAction.EXECUTED
    )


def test_abandoned__nothing_to_do() -> None:
    assert decide(call(CallStatus.ABANDONED), tool(), POLICY, NOW) == Report(HandleAction.NOTHING_TO_DO)


# --------------------------------------------------------------- unknown: re-runnable


@pytest.mark.parametrize("effect", ["idempotent", "read_only", "transactional"])
def test_unknown_and_safe_to_run_again__rerun(effect: str) -> None:
    unknown = call(CallStatus.UNKNOWN, effect_class=EffectClass(effect))

    assert decide(unknown, tool(effect), POLICY, NOW) == Claim(
        CallStatus.UNKNOWN, f"re-run after an unknown outcome ({effect})", HandleAction.RERUN
    )


def test_unknown_after_max_attempts__given_up_with_the_poison_failure() -> None:
    unknown = call(CallStatus.UNKNOWN, attempt_count=3)

    assert decide(unknown, tool("idempotent"), POLICY, NOW) == Settle(
        failed(KEY, POISON_MESSAGE, FailureStage.RECOVERY), "gave up after 3 attempts"
    )


def test_unknown__the_tools_own_max_attempts_wins_over_the_setting() -> None:
    unknown = call(CallStatus.UNKNOWN, attempt_count=3)

    assert isinstance(decide(unknown, tool("idempotent", max_attempts=4), POLICY, NOW), Claim)
    assert isinstance(decide(unknown, tool("idempotent", max_attempts=2), POLICY, NOW), Settle)


def test_unknown_for_an_unregistered_tool__rerun_to_store_its_lookup_failure() -> None:
    """Its effect class, as recorded, is 'unregistered': a run only stores 'Unknown tool'."""
    unknown = call(CallStatus.UNKNOWN, effect_class=EffectClass.UNREGISTERED)

    assert decide(unknown, None, POLICY, NOW) == Claim(
        CallStatus.UNKNOWN, "re-run after an unknown outcome (unregistered)", HandleAction.RERUN
    )


def test_an_unregistered_call_keeps_its_lookup_failure_once_the_name_is_registered() -> None:
    registry = ToolRegistry()

    @registry.tool(name="charge", effect="idempotent")
    def charge(amount: int) -> str:
        return "done"

    assert tool_for(call(CallStatus.UNKNOWN, effect_class=EffectClass.UNREGISTERED), registry) is None
    assert tool_for(call(CallStatus.UNKNOWN, effect_class=EffectClass.IDEMPOTENT), registry) is not None
    assert tool_for(call(CallStatus.UNKNOWN, tool_name="gone"), registry) is None


def test_unknown_whose_tool_is_no_longer_registered__decided_by_its_recorded_effect_class() -> None:
    assert isinstance(decide(call(CallStatus.UNKNOWN), None, POLICY, NOW), AskOperator)
    rerunnable = call(CallStatus.UNKNOWN, effect_class=EffectClass.IDEMPOTENT)
    assert isinstance(decide(rerunnable, None, POLICY, NOW), Claim)


# --------------------------------------------------------------- unknown: at most once


def test_unknown_at_most_once_without_a_deadline__waits_for_an_operator_for_ever() -> None:
    assert decide(call(CallStatus.UNKNOWN), tool(), POLICY, NOW) == AskOperator(
        deadline_in=None, retry_in=None
    )


def test_unknown_at_most_once_before_its_deadline__waits_until_then() -> None:
    """The deadline counts from the lease's end (1 s ago here)."""
    decision = decide(call(CallStatus.UNKNOWN), tool(unknown_deadline=60), POLICY, NOW)

    assert decision == AskOperator(deadline_in=59.0, retry_in=59.0)


def test_unknown_at_most_once_past_its_deadline__the_fixed_failure_is_settled() -> None:
    decision = decide(call(CallStatus.UNKNOWN), tool(unknown_deadline=1), POLICY, NOW)

    assert decision == Settle(
        failed(KEY, UNKNOWN_OUTCOME_MESSAGE, FailureStage.RECOVERY),
        "unknown for more than 1s: fixed failure submitted",
    )


def test_unknown_without_a_lease_end__the_deadline_counts_from_its_creation() -> None:
    unknown = call(CallStatus.UNKNOWN, lease_expires_at=None)

    assert decide(unknown, tool(unknown_deadline=60), POLICY, NOW) == AskOperator(30.0, 30.0)


def test_unknown_at_most_once__never_rerun_however_few_its_attempts() -> None:
    unknown = call(CallStatus.UNKNOWN, attempt_count=0)

    assert not isinstance(decide(unknown, tool(), POLICY, NOW), Claim)


# --------------------------------------------------------------- unknown: verified


def test_unknown_verified__the_hook_is_asked_first() -> None:
    unknown = call(CallStatus.UNKNOWN, effect_class=EffectClass.VERIFIED)

    assert decide(unknown, tool("verified"), POLICY, NOW) == Verify()


def test_verified_executed__its_outcome_is_settled() -> None:
    unknown = call(CallStatus.UNKNOWN, effect_class=EffectClass.VERIFIED)
    outcome = succeeded(KEY, "it happened")

    decision = decide(unknown, tool("verified"), POLICY, NOW, Verified(VerifyAnswer.EXECUTED, outcome))

    assert decision == Settle(outcome, "verify hook: the first run happened")


def test_verified_not_executed__rerun() -> None:
    unknown = call(CallStatus.UNKNOWN, effect_class=EffectClass.VERIFIED)

    decision = decide(unknown, tool("verified"), POLICY, NOW, Verified(VerifyAnswer.NOT_EXECUTED))

    assert decision == Claim(
        CallStatus.UNKNOWN, "re-run after an unknown outcome (verified)", HandleAction.RERUN
    )


def test_verified_not_executed_after_max_attempts__given_up() -> None:
    unknown = call(CallStatus.UNKNOWN, effect_class=EffectClass.VERIFIED, attempt_count=3)

    decision = decide(unknown, tool("verified"), POLICY, NOW, Verified(VerifyAnswer.NOT_EXECUTED))

    assert isinstance(decision, Settle)
    assert decision.reason == "gave up after 3 attempts"


def test_verified_unknown__waits_for_an_operator_and_asks_the_hook_again_soon() -> None:
    unknown = call(CallStatus.UNKNOWN, effect_class=EffectClass.VERIFIED)

    decision = decide(unknown, tool("verified"), POLICY, NOW, Verified(VerifyAnswer.UNKNOWN))

    assert decision == AskOperator(deadline_in=None, retry_in=VERIFY_RETRY_SECONDS)


def test_verified_unknown_with_a_deadline__asked_again_before_the_deadline() -> None:
    unknown = call(CallStatus.UNKNOWN, effect_class=EffectClass.VERIFIED)
    close, far = tool("verified", unknown_deadline=3), tool("verified", unknown_deadline=60)

    assert decide(unknown, close, POLICY, NOW, Verified(VerifyAnswer.UNKNOWN)) == AskOperator(2.0, 2.0)
    assert decide(unknown, far, POLICY, NOW, Verified(VerifyAnswer.UNKNOWN)) == AskOperator(
        59.0, VERIFY_RETRY_SECONDS
    )


def test_verified_unknown_past_its_deadline__the_fixed_failure_is_settled() -> None:
    unknown = call(CallStatus.UNKNOWN, effect_class=EffectClass.VERIFIED)

    decision = decide(
        unknown, tool("verified", unknown_deadline=1), POLICY, NOW, Verified(VerifyAnswer.UNKNOWN)
    )

    assert isinstance(decision, Settle)
    assert decision.outcome == failed(KEY, UNKNOWN_OUTCOME_MESSAGE, FailureStage.RECOVERY)


def test_verified_call_whose_tool_is_gone__waits_for_an_operator_without_asking() -> None:
    unknown = call(CallStatus.UNKNOWN, effect_class=EffectClass.VERIFIED)

    assert decide(unknown, None, POLICY, NOW) == AskOperator(deadline_in=None, retry_in=None)


# --------------------------------------------------------------- the report's actions


def test_handle_actions_compare_equal_to_their_strings() -> None:
    """Callers (the reconciler's counters, the audit service, tests) still compare strings."""
    report = HandleReport(KEY, HandleAction.RESUBMITTED, CallStatus.SUBMITTED, True)

    assert report.action == "resubmitted"
    assert {report.action: 1} == {"resubmitted": 1}
    assert [action.value for action in HandleAction] == [
        "executed",
        "rerun",
        "resubmitted",
        "settled",
        "already_submitted",
        "waiting_for_operator",
        "running_elsewhere",
        "refused_arguments_mismatch",
        "fenced",
        "left_for_service",
        "waiting_for_approval",
        "approval_expired",
        "nothing_to_do",
        "error",
        "interrupted",
    ]


def test_the_reports_action_is_one_of_the_actions_handling_produces() -> None:
    """It was a string whose docstring listed 'abandoned' (never a report's action) and
    missed 'already_submitted', 'left_for_service', 'error' and 'interrupted'."""
    annotation = HandleReport.__dataclass_fields__["action"].type

    assert annotation in ("HandleAction", HandleAction)
