"""The ledger writes of a call's life that must outlast a database away for a moment.

A database restart, a failover or a dropped connection must not turn a call into an
``unknown``: these writes are retried while the database is away (``database_retry_seconds``).
A try that failed after its commit may have happened (the answer lost on the way back) is
an ambiguous commit; the next try then finds the call already moved on, and this module
tells whether that was its own lost try, which makes the write done, as it is.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_delay, wait_exponential

from toolledger import metrics
from toolledger.domain.delivered import DeliveredCall
from toolledger.domain.keys import CallKey, refused_arguments_preview
from toolledger.domain.records import CallRecord, Recorded
from toolledger.domain.results import InDoubt, Outcome
from toolledger.domain.states import RESULT_STATUSES, CallStatus, EffectClass
from toolledger.errors import FencedError
from toolledger.settings import Settings
from toolledger.store.engine import is_transient
from toolledger.store.ledger import LedgerStore

log = logging.getLogger("toolledger.executor")


class RetriedLedger:
    def __init__(self, store: LedgerStore, settings: Settings) -> None:
        self.store = store
        self.settings = settings

    def retrying(self) -> AsyncRetrying:
        """The one policy for a database away: exponential waits, bounded in total."""
        return AsyncRetrying(
            retry=retry_if_exception(is_transient),
            wait=wait_exponential(multiplier=0.1, max=2.0),
            stop=stop_after_delay(self.settings.database_retry_seconds),
            before_sleep=_log_database_retry,
            reraise=True,
        )

    async def record(self, delivered: DeliveredCall, effect_class: EffectClass) -> Recorded:
        """Record a delivered call and claim it in one commit (commit point 1)."""
        recorded: Recorded = await self._claiming(
            delivered.key,
            self.store.record,
            delivered.key,
            tool_name=delivered.tool_name,
            arguments=delivered.text,
            fingerprint=delivered.fingerprint,
            effect_class=effect_class,
            lease_seconds=self.settings.lease_seconds,
            # Arguments no handler will see are not kept whole (they may be huge, or hold
            # what was meant for nobody): a redacted preview, beside the full fingerprint.
            stored_arguments=(
                refused_arguments_preview(delivered.text, self.store.redactor) if delivered.refused else None
            ),
        )
        return recorded

    async def record_for_approval(
        self, delivered: DeliveredCall, effect_class: EffectClass, approval_seconds: float | None
    ) -> Recorded:
        """Record a delivered call that waits for a person's approval (nothing is claimed: a
        retry after an ambiguous commit simply finds it recorded)."""
        async for attempt in self.retrying():
            with attempt:
                return await self.store.record_for_approval(
                    delivered.key,
                    tool_name=delivered.tool_name,
                    arguments=delivered.text,
                    fingerprint=delivered.fingerprint,
                    effect_class=effect_class,
                    approval_seconds=approval_seconds,
                )
        raise AssertionError("unreachable: the retry policy re-raises")

    async def claim(self, key: CallKey, source: CallStatus, reason: str) -> CallRecord | None:
        """A new lease on a recorded call; None when another worker has it."""
        claimed: CallRecord | None = await self._claiming(
            key,
            self.store.claim,
            key,
            from_statuses=[source],
            lease_seconds=self.settings.lease_seconds,
            reason=reason,
        )
        return claimed

    async def store_outcome(self, key: CallKey, token: int, outcome: Outcome) -> CallRecord:
        """Commit point 2, for an outcome that exists only in this process."""
        ambiguous = False
        async for attempt in self.retrying():
            with attempt:
                try:
                    return await self.store.complete(key, token, outcome)
                except FencedError:
                    if ambiguous:
                        # The earlier try may have committed before its connection broke.
                        current = await self.store.get(key)
                        if (
                            current is not None
                            and current.status in RESULT_STATUSES
                            and (current.lease_token == token)
                        ):
                            return current
                    raise
                except Exception as error:
                    ambiguous = ambiguous or is_transient(error)
                    raise
        raise AssertionError("unreachable: the retry policy re-raises")

    async def mark_unknown(self, key: CallKey, token: int, doubt: InDoubt) -> CallRecord:
        """The run cannot tell whether its effect happened: the call becomes ``unknown``. A
        retry after an ambiguous commit finds it so under this token, which is the same end
        (``LedgerStore.mark_unknown``)."""
        async for attempt in self.retrying():
            with attempt:
                return await self.store.mark_unknown(key, token, reason=doubt.reason, detail=doubt.detail)
        raise AssertionError("unreachable: the retry policy re-raises")

    async def record_request(
        self, keys: Sequence[CallKey], request_key: str, *, reason: str, replacing: str | None = None
    ) -> list[CallRecord] | None:
        """Record the request stored results go out in, before its first post (see
        ``LedgerStore.record_request``). A retry after an ambiguous commit finds them in a
        request already and gets None: the caller reads which one, as after any lost race."""
        return await self.record_requests(
            [(key, request_key) for key in keys], reason=reason, replacing=replacing
        )

    async def record_requests(
        self, assignments: Sequence[tuple[CallKey, str]], *, reason: str, replacing: str | None = None
    ) -> list[CallRecord] | None:
        """``record_request`` with a request key per call, in one commit."""
        async for attempt in self.retrying():
            with attempt:
                return await self.store.record_requests(assignments, reason=reason, replacing=replacing)
        raise AssertionError("unreachable: the retry policy re-raises")

    async def mark_submitted(self, key: CallKey) -> None:
        """Commit point 3: the Agents API accepted the result."""
        async for attempt in self.retrying():
            with attempt:
                await self.store.mark_submitted(key)

    async def mark_submitted_many(self, keys: Sequence[CallKey]) -> None:
        """Commit point 3 for a batch the Agents API accepted (a retry after an ambiguous
        commit finds the calls submitted already, which is the same end)."""
        async for attempt in self.retrying():
            with attempt:
                await self.store.mark_submitted_many(keys)

    async def _claiming(
        self, key: CallKey, write: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any
    ) -> Any:
        """A claiming write (record, claim). When a try fails after its commit may have
        happened, the next try finds the call taken; the claim id, written in the claim's
        audit event, tells whether it was taken by that lost try."""
        claim_id = uuid.uuid4().hex
        ambiguous = False
        async for attempt in self.retrying():
            with attempt:
                try:
                    done = await write(*args, claim_id=claim_id, **kwargs)
                except Exception as error:
                    ambiguous = ambiguous or is_transient(error)
                    raise
                taken = done is None or (isinstance(done, Recorded) and not done.claimed)
                if ambiguous and taken:
                    mine = await self.store.claimed_by(key, claim_id)
                    if mine is not None:
                        log.info("call %s: a claim whose commit was not confirmed had committed", key)
                        return Recorded(call=mine, claimed=True) if isinstance(done, Recorded) else mine
                return done
        raise AssertionError("unreachable: the retry policy re-raises")


def _log_database_retry(state: RetryCallState) -> None:
    error = state.outcome.exception() if state.outcome is not None else None
    metrics.RETRIES.labels("database").inc()
    log.warning("database unavailable (%s); retrying attempt %d", type(error).__name__, state.attempt_number)
