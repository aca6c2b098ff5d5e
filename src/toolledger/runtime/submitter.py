"""Sends a stored result to the Agents API and writes down what became of it."""

from __future__ import annotations

import logging

from toolledger import metrics
from toolledger.crashpoints import CP_AFTER_SUBMIT_RESPONSE, crash_point
from toolledger.domain.records import CallRecord
from toolledger.domain.submissions import SubmissionFailure, SubmitOutcome
from toolledger.errors import SessionGoneError, SubmissionError
from toolledger.gateway.agents import AgentsGateway
from toolledger.logs import log_fields
from toolledger.runtime.retried_ledger import RetriedLedger
from toolledger.tracing import call_span

log = logging.getLogger("toolledger.executor")

SUBMIT_RETRY_FIRST = 1.0
SUBMIT_RETRY_MAX = 30.0


class Submitter:
    def __init__(self, gateway: AgentsGateway | None, ledger: RetriedLedger) -> None:
        self.gateway = gateway
        self.ledger = ledger

    async def submit(self, call: CallRecord, *, listed: bool = True) -> SubmitOutcome:
        """Send the stored result, byte for byte, with the call's stable Idempotency-Key.

        ``listed``: the call was in the session's ``required_actions`` just now. A call that
        was not is abandoned if the session refuses it as not pending.
        """
        key = call.key
        with (
            log_fields(session_id=key.session_id, turn_id=key.turn_id, call_id=key.call_id),
            call_span("toolledger.submit", key, tool=call.tool_name) as span,
        ):
            outcome = await self._submit(call, listed)
            span.set("outcome", outcome.value)
        metrics.SUBMISSIONS.labels(outcome.value).inc()
        return outcome

    async def _submit(self, call: CallRecord, listed: bool) -> SubmitOutcome:
        if self.gateway is None or call.payload is None:
            return SubmitOutcome.NOT_SENT
        store = self.ledger.store
        try:
            with metrics.SUBMISSION_DURATION.time():
                await self.gateway.submit_tool_result(
                    call.key.session_id, call.payload, call.idempotency_key, expect_pending=listed
                )
        except SessionGoneError as error:
            await store.abandon(call.key, f"session gone: {error}")
            return SubmitOutcome.ABANDONED
        except SubmissionError as error:
            outcome = await self._refused(call, error, listed)
            if outcome is not SubmitOutcome.FAILED:
                return outcome
            await store.record_submission_failure(call.key, str(error))
            log.warning(
                "submitting %s failed (%s); left for the reconciler",
                call.key,
                store.redactor.text(str(error)),
            )
            return SubmitOutcome.FAILED
        crash_point(CP_AFTER_SUBMIT_RESPONSE)
        await self.ledger.mark_submitted(call.key)
        return SubmitOutcome.SUBMITTED

    async def _refused(self, call: CallRecord, error: SubmissionError, listed: bool) -> SubmitOutcome:
        """A refusal that settles the call: answered already, or not awaited any more."""
        store = self.ledger.store
        if error.kind is SubmissionFailure.ALREADY_ANSWERED:
            # An earlier submission of this call landed but its answer never reached us.
            await store.mark_submitted(call.key, reason=f"already answered: {error}")
            return SubmitOutcome.SUBMITTED
        if error.kind is SubmissionFailure.NOT_PENDING and not listed:
            await store.abandon(call.key, "no longer awaited by the session")
            return SubmitOutcome.ABANDONED
        return SubmitOutcome.FAILED


def submission_backoff(call: CallRecord) -> float:
    """When to send a stored result again after a failed try: sooner than the next periodic
    reconcile, later with each try the call has had."""
    return min(SUBMIT_RETRY_FIRST * 2.0 ** min(call.submission_count, 16), SUBMIT_RETRY_MAX)
