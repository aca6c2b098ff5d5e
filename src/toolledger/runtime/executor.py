"""One call's life: record and claim, run the handler, store the outcome, submit, mark submitted.

Every step that matters is committed before the next one starts, so a crash anywhere leaves
the ledger saying exactly how far the call got; ``recover()`` picks it up from there.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
import traceback
import uuid
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, suppress
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

import pydantic
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    retry_if_exception_type,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential,
)

from toolledger import metrics
from toolledger.crashpoints import (
    CP_AFTER_CLAIM_COMMIT,
    CP_AFTER_HANDLER,
    CP_AFTER_RESULT_COMMIT,
    CP_AFTER_SUBMIT_RESPONSE,
    CP_DURING_RECOVERY,
    crash_point,
)
from toolledger.domain.keys import (
    ArgumentsRefused,
    CallKey,
    arguments_fingerprint,
    arguments_text,
    parse_arguments,
    refused_arguments_preview,
)
from toolledger.domain.records import CallRecord, Recorded
from toolledger.domain.redaction import DEFAULT_REDACTOR, Redactor
from toolledger.domain.results import (
    FAILED_MESSAGE,
    OUTPUT_FAILED_MESSAGE,
    POISON_MESSAGE,
    TIMEOUT_MESSAGE,
    UNKNOWN_OUTCOME_MESSAGE,
    FailureStage,
    Outcome,
    OutputError,
    ToolError,
    failed,
    normalize_output,
    succeeded,
    tool_error_message,
    validation_message,
)
from toolledger.domain.states import RESULT_STATUSES, UNCONFIRMED_ALERT_AFTER, CallStatus, EffectClass
from toolledger.errors import FencedError, SessionGoneError, SubmissionError
from toolledger.gateway.agents import AgentsGateway
from toolledger.logs import log_fields
from toolledger.runtime.context import ToolContext, bind_context, reset_context
from toolledger.runtime.registry import RegisteredTool, ToolRegistry
from toolledger.settings import Settings
from toolledger.store.engine import finished_on_sqlite, is_transient, write_lock
from toolledger.store.ledger import LedgerStore
from toolledger.store.liveness import Liveness
from toolledger.tracing import CallSpan, call_span

log = logging.getLogger("toolledger.executor")


class SubmitOutcome(StrEnum):
    SUBMITTED = "submitted"
    """Accepted by the Agents API (or found already answered there)."""
    ABANDONED = "abandoned"
    """The session is gone or no longer awaits the call."""
    FAILED = "failed"
    """Not accepted this time; the stored result waits for the reconciler."""
    NOT_SENT = "not_sent"
    """No gateway, or no stored result."""


LEASE_WAKE_MARGIN = 0.25
"""Seconds past a lease's expiry before looking again: the expiry is compared on the
database's clock, and a look exactly at the expiry could find it a hair short."""
SUBMIT_RETRY_FIRST = 1.0
SUBMIT_RETRY_MAX = 30.0
ASKED_REMEMBERED = 10_000
VERIFY_RETRY_SECONDS = 5.0
"""A verify hook that could not tell (its downstream away) is asked again after this."""


@dataclass(frozen=True)
class HandleReport:
    """What handling one delivered call did."""

    key: CallKey
    action: str
    """executed, resubmitted, rerun, settled, waiting_for_operator, running_elsewhere,
    refused_arguments_mismatch, fenced, abandoned or nothing_to_do."""
    status: CallStatus | None
    submitted: bool = False
    retry_in: float | None = None
    """Seconds after which the call should be looked at again, when it waits for something
    whose end is known: another worker's lease, an ``unknown_deadline``, a submission's
    backoff. None when nothing will change by itself."""


@dataclass
class RecoveryReport:
    expired: int = 0
    actions: Counter[str] = field(default_factory=Counter)


class Executor:
    def __init__(
        self,
        registry: ToolRegistry,
        store: LedgerStore,
        gateway: AgentsGateway | None,
        settings: Settings,
        *,
        run_handlers: bool = True,
        liveness: Liveness | None = None,
    ) -> None:
        """``run_handlers=False``: a process without the application's tools (``toolledger
        reconcile`` with no ``--tools``) resubmits and confirms, but never runs or settles a
        call: that needs the tool's code and declaration. ``liveness`` tells which lease
        owners are provably gone, so their calls are taken without waiting for the lease."""
        self.registry = registry
        self.store = store
        self.gateway = gateway
        self.settings = settings
        self.run_handlers = run_handlers
        self.liveness = liveness
        self._asked: OrderedDict[CallKey, None] = OrderedDict()

    # ------------------------------------------------------------------ entry

    async def handle(self, session_id: str, action: Any, known: CallRecord | None = None) -> HandleReport:
        """Handle one ``function_call`` entry of a session's ``required_actions``.

        ``known``: the call as the ledger held it moments ago (a reconciler's snapshot). A
        stored result there is sent without recording the call again: results never change,
        and a submission that raced another process's is harmless (same bytes, same key).
        """
        turn_id, call_id, name, arguments = _action_fields(action)
        key = CallKey(session_id, turn_id, call_id)
        with (
            log_fields(session_id=session_id, turn_id=turn_id, call_id=call_id),
            call_span("toolledger.call", key, tool=name) as span,
        ):
            if (
                known is not None
                and known.key == key
                and known.status in RESULT_STATUSES
                and known.arguments_sha256 == arguments_fingerprint(arguments)
            ):
                report = await self._continue(known)
            else:
                report = await self._handle(key, name, arguments)
            _note_report(span, report)
            log.debug("call %s (%s): %s, now %s", call_id, name, report.action, report.status)
            return report

    async def _handle(self, key: CallKey, name: str, arguments: Any) -> HandleReport:
        if not self.run_handlers:
            known = await self.store.get(key)
            if known is None:
                return HandleReport(key, "left_for_service", None)
            return await self._continue(known)
        tool = self.registry.get(name)
        refused: ArgumentsRefused | None = None
        try:
            parse_arguments(arguments_text(arguments), self.settings.max_arguments_bytes)
        except ArgumentsRefused as error:
            refused = error
        claim_id = uuid.uuid4().hex
        recorded = await self._retried_claim(
            key,
            self.store.record,
            key,
            tool_name=name,
            arguments=arguments,
            effect_class=tool.effect if tool is not None else EffectClass.UNREGISTERED,
            lease_seconds=self.settings.lease_seconds,
            # Arguments no handler will see are not kept whole (they may be huge, or hold
            # what was meant for nobody): a redacted preview, beside the full fingerprint.
            stored_arguments=(
                refused_arguments_preview(arguments_text(arguments), self.store.redactor) if refused else None
            ),
            claim_id=claim_id,
        )
        if recorded.arguments_mismatch:
            log.warning("call %s redelivered with other arguments: refused", key)
            return HandleReport(key, "refused_arguments_mismatch", recorded.call.status)
        if recorded.claimed:
            crash_point(CP_AFTER_CLAIM_COMMIT)
            return await self._run_and_submit(tool, recorded.call, "executed", refused)
        return await self._continue(recorded.call)

    async def recover(self) -> RecoveryReport:
        """Pick up every call a crash or a lost connection left behind."""
        report = RecoveryReport()
        report.expired = len(await self.store.expire_leases(gone_owners=await self.gone_owners()))
        crash_point(CP_DURING_RECOVERY)
        for call in await self.store.in_states([CallStatus.UNKNOWN, CallStatus.PENDING]):
            report.actions[(await self._continue(call)).action] += 1
        for call in await self.store.in_states(RESULT_STATUSES):
            outcome = await self.submit(call)
            report.actions["resubmitted" if outcome is SubmitOutcome.SUBMITTED else f"submit_{outcome}"] += 1
        return report

    async def gone_owners(self) -> frozenset[str]:
        """Owners of running calls that are provably gone (their leases can be taken now)."""
        if self.liveness is None:
            return frozenset()
        return await self.liveness.gone(await self.store.running_owners())

    async def handle_recorded(self, call: CallRecord) -> HandleReport:
        """Carry on with a call already in the ledger, as if the session had just listed it
        (an operator's re-run of an ``unknown`` call starts here)."""
        with _call_log_fields(call), call_span("toolledger.call", call.key, tool=call.tool_name) as span:
            report = await self._continue(call)
            _note_report(span, report)
            return report

    async def submit(self, call: CallRecord, *, listed: bool = True) -> SubmitOutcome:
        """Send the stored result, byte for byte, with the call's stable Idempotency-Key.

        ``listed``: the call was in the session's ``required_actions`` just now. A call that
        was not is abandoned if the session refuses it as not pending.
        """
        with _call_log_fields(call), call_span("toolledger.submit", call.key, tool=call.tool_name) as span:
            outcome = await self._submit(call, listed)
            span.set("outcome", outcome.value)
        metrics.SUBMISSIONS.labels(outcome.value).inc()
        return outcome

    async def _submit(self, call: CallRecord, listed: bool) -> SubmitOutcome:
        if self.gateway is None or call.payload is None:
            return SubmitOutcome.NOT_SENT
        try:
            with metrics.SUBMISSION_DURATION.time():
                await self.gateway.submit_tool_result(
                    call.key.session_id, call.payload, call.idempotency_key, expect_pending=listed
                )
        except SessionGoneError as error:
            await self.store.abandon(call.key, f"session gone: {error}")
            return SubmitOutcome.ABANDONED
        except SubmissionError as error:
            if error.kind == "already_answered":
                # An earlier submission of this call landed but its answer never reached us.
                await self.store.mark_submitted(call.key, reason=f"already answered: {error}")
                return SubmitOutcome.SUBMITTED
            if error.kind == "not_pending" and not listed:
                await self.store.abandon(call.key, "no longer awaited by the session")
                return SubmitOutcome.ABANDONED
            await self.store.record_submission_failure(call.key, str(error))
            log.warning(
                "submitting %s failed (%s); left for the reconciler",
                call.key,
                self.store.redactor.text(str(error)),
            )
            return SubmitOutcome.FAILED
        crash_point(CP_AFTER_SUBMIT_RESPONSE)
        async for attempt in self._database_retrying():
            with attempt:
                await self.store.mark_submitted(call.key)
        return SubmitOutcome.SUBMITTED

    # ------------------------------------------------------------ existing calls

    async def _continue(self, call: CallRecord) -> HandleReport:
        if call.status in RESULT_STATUSES:
            return await self._submitted_report(call, "resubmitted")
        if call.status is CallStatus.SUBMITTED:
            if call.submitted_at is not None and (
                _seconds_since(call.submitted_at) < self.settings.resubmit_after_seconds
            ):
                # Listed in an event sent before our submission landed: nothing to do.
                return HandleReport(call.key, "already_submitted", call.status, True)
            # Still awaited well after an accepted submission: send the same bytes again;
            # the Idempotency-Key makes the service apply them once at most.
            report = await self._submitted_report(call, "resubmitted")
            if report.submitted:
                await self._note_unconfirmed(call)
            return report
        if not self.run_handlers and call.status in (
            CallStatus.PENDING,
            CallStatus.UNKNOWN,
            CallStatus.RUNNING,
        ):
            return HandleReport(call.key, "left_for_service", call.status)
        if call.status is CallStatus.RUNNING:
            expired = await self.take_over(call)
            if not expired:
                wait = await self.store.lease_remaining(call.key)
                retry_in = None if wait is None else wait + LEASE_WAKE_MARGIN
                return HandleReport(call.key, "running_elsewhere", call.status, retry_in=retry_in)
            call = expired[0]
        if call.status is CallStatus.PENDING:
            claimed = await self._claim(call.key, CallStatus.PENDING, "claimed")
            if claimed is None:
                return HandleReport(call.key, "running_elsewhere", None)
            return await self._run_and_submit(self._tool_of(call), claimed, "executed")
        if call.status is CallStatus.UNKNOWN:
            return await self._settle_unknown(call)
        return HandleReport(call.key, "nothing_to_do", call.status)

    def _tool_of(self, call: CallRecord) -> RegisteredTool | None:
        """The handler for a recorded call. A call that arrived for a tool no one had registered
        keeps its lookup failure even if a later deployment registers the name: its answer
        must not depend on when a crash let it be retried."""
        if call.effect_class is EffectClass.UNREGISTERED:
            return None
        return self.registry.get(call.tool_name)

    async def take_over(self, call: CallRecord) -> list[CallRecord]:
        """A running call whose lease ran out, or whose owner is provably gone, becomes
        ``unknown`` (to be settled by its effect class); [] while its owner may still run it."""
        expired = await self.store.expire_leases(call.key)
        owner = call.lease_owner
        if expired or self.liveness is None or owner is None or owner == self.store.owner:
            return expired
        if not await self.liveness.gone([owner]):
            return []
        log.info("call %s: its lease owner %s is gone; taking the call over", call.key, owner)
        return await self.store.expire_leases(call.key, gone_owners=[owner])

    async def _note_unconfirmed(self, call: CallRecord) -> None:
        """Accepted again and again, yet still awaited: the service says "accepted" but does
        not consume it. Nothing toolledger can do beyond resubmitting; an operator should know."""
        count = await self.store.note_resubmission(call.key)
        if count == UNCONFIRMED_ALERT_AFTER:
            log.warning(
                "call %s: accepted %d times but still awaited by the session (unconfirmed)", call.key, count
            )
            await self.store.flag(
                call.key, "unconfirmed", f"accepted {count} times but still in required_actions"
            )

    async def _settle_unknown(self, call: CallRecord) -> HandleReport:
        """An interrupted run left no result: decide by the tool's effect class, never by guessing."""
        tool = self._tool_of(call)
        effect = tool.effect if tool is not None else call.effect_class
        if effect is EffectClass.VERIFIED and tool is not None:
            kind, outcome = await self._verify(tool, call)
            if outcome is not None:
                settled = await self.store.settle(
                    call.key, outcome, reason="verify hook: the first run happened"
                )
                return await self._submitted_report(settled, "settled")
            if kind != "not_executed":
                waiting = await self._wait_or_give_up(tool, call)
                if waiting.action != "waiting_for_operator":
                    return waiting
                # The hook could not tell (its downstream away, say): ask it again soon.
                retry_in = min(waiting.retry_in or VERIFY_RETRY_SECONDS, VERIFY_RETRY_SECONDS)
                return replace(waiting, retry_in=retry_in)
        elif not effect.rerun_is_safe:
            return await self._wait_or_give_up(tool, call)
        max_attempts = (tool.max_attempts if tool else None) or self.settings.max_attempts
        if call.attempt_count >= max_attempts:
            outcome = failed(call.key, POISON_MESSAGE, FailureStage.RECOVERY)
            settled = await self.store.settle(
                call.key, outcome, reason=f"gave up after {call.attempt_count} attempts"
            )
            return await self._submitted_report(settled, "settled")
        claimed = await self._claim(
            call.key, CallStatus.UNKNOWN, f"re-run after an unknown outcome ({effect.value})"
        )
        if claimed is None:
            return HandleReport(call.key, "running_elsewhere", None)
        return await self._run_and_submit(tool, claimed, "rerun")

    async def _verify(self, tool: RegisteredTool, call: CallRecord) -> tuple[str, Outcome | None]:
        """Ask the downstream system whether the first run happened; with its result if so."""
        assert tool.verify is not None
        try:
            answer = tool.verify(self._context(tool, call))
            verification = await answer if inspect.isawaitable(answer) else answer
        except Exception as error:
            # The traceback (redacted) goes to the audit trail; the log gets one line.
            log.warning("verify hook of %s failed for %s (%s)", tool.name, call.key, type(error).__name__)
            await self.store.flag(
                call.key, "verify_failed", "verify hook raised", detail=traceback.format_exc()
            )
            return "unknown", None
        if verification.kind != "executed":
            return verification.kind, None
        try:
            output = normalize_output(verification.output, self.settings.max_output_bytes)
        except OutputError as error:
            return "executed", failed(call.key, str(error), FailureStage.OUTPUT)
        return "executed", succeeded(call.key, output)

    async def _wait_or_give_up(self, tool: RegisteredTool | None, call: CallRecord) -> HandleReport:
        deadline = tool.unknown_deadline if tool is not None else None
        if deadline is None:
            self._ask_operator(call, None)
            return HandleReport(call.key, "waiting_for_operator", call.status)
        waited = _seconds_since(call.lease_expires_at or call.created_at)
        if waited >= deadline:
            outcome = failed(call.key, UNKNOWN_OUTCOME_MESSAGE, FailureStage.RECOVERY)
            settled = await self.store.settle(
                call.key, outcome, reason=f"unknown for more than {deadline:g}s: fixed failure submitted"
            )
            return await self._submitted_report(settled, "settled")
        self._ask_operator(call, deadline - waited)
        return HandleReport(call.key, "waiting_for_operator", call.status, retry_in=deadline - waited)

    def _ask_operator(self, call: CallRecord, deadline_in: float | None) -> None:
        """Once per call and process: a warning an operator can act on, with the command."""
        if call.key in self._asked:
            return
        self._asked[call.key] = None
        if len(self._asked) > ASKED_REMEMBERED:
            self._asked.popitem(last=False)
        until = (
            f"; unless settled, a fixed failure is sent in {deadline_in:.0f}s (unknown_deadline)"
            if deadline_in is not None
            else "; the session waits until then"
        )
        log.warning(
            "call %s (%s, %s) has an unknown outcome: its handler may have run. Settle it: "
            "toolledger calls resolve %s --output TEXT | --error TEXT | --rerun --reason WHY%s",
            call.key,
            call.tool_name,
            call.effect_class.value,
            call.key,
            until,
        )

    async def _submitted_report(self, call: CallRecord | None, action: str) -> HandleReport:
        if call is None:
            return HandleReport(CallKey("", "", ""), "running_elsewhere", None)
        return _submission_report(call, action, await self.submit(call))

    # ------------------------------------------------------------------ running

    async def _run_and_submit(
        self,
        tool: RegisteredTool | None,
        call: CallRecord,
        action: str,
        refused: ArgumentsRefused | None = None,
    ) -> HandleReport:
        try:
            done = await self._run(tool, call, refused)
        except FencedError:
            log.warning("call %s: lease lost while running; result refused (fenced)", call.key)
            return HandleReport(call.key, "fenced", None)
        crash_point(CP_AFTER_RESULT_COMMIT)
        return _submission_report(done, action, await self.submit(done))

    async def _run(
        self, tool: RegisteredTool | None, call: CallRecord, refused: ArgumentsRefused | None = None
    ) -> CallRecord:
        token = call.lease_token
        if tool is None:
            outcome = failed(call.key, f"Unknown tool: {call.tool_name}", FailureStage.LOOKUP)
            return await self.store.complete(call.key, token, outcome)
        try:
            if refused is not None:
                raise refused
            # After a crash only the stored text is left: a refused call's preview is refused too.
            arguments = parse_arguments(call.arguments, self.settings.max_arguments_bytes)
        except ArgumentsRefused as error:
            outcome = failed(call.key, str(error), FailureStage.ARGUMENTS)
            return await self.store.complete(call.key, token, outcome)
        if tool.effect is EffectClass.TRANSACTIONAL:
            # On SQLite its transaction holds the file's write lock: it ends by commit or
            # rollback, never cut off mid-statement (see run_to_completion). Its handler's
            # timeout bounds the wait at shutdown.
            return await finished_on_sqlite(self.store.engine, self._run_transactional(tool, call, arguments))
        heartbeat = asyncio.create_task(self._heartbeat(call.key, token))
        try:
            outcome = await self._invoke(tool, self._context(tool, call), arguments)
        finally:
            heartbeat.cancel()
            with suppress(asyncio.CancelledError):
                await heartbeat
        crash_point(CP_AFTER_HANDLER)
        return await self._store_outcome(call.key, token, outcome)

    async def _store_outcome(self, key: CallKey, token: int, outcome: Outcome) -> CallRecord:
        """Commit point 2, for an outcome that exists only in this process: a database away
        for a moment (a restart, a lock) must not turn it into an unknown."""
        ambiguous = False
        async for attempt in self._database_retrying():
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

    async def _claim(self, key: CallKey, source: CallStatus, reason: str) -> CallRecord | None:
        claimed: CallRecord | None = await self._retried_claim(
            key,
            self.store.claim,
            key,
            from_statuses=[source],
            lease_seconds=self.settings.lease_seconds,
            reason=reason,
            claim_id=uuid.uuid4().hex,
        )
        return claimed

    async def _retried_claim(
        self, key: CallKey, write: Callable[..., Awaitable[Any]], *args: Any, claim_id: str, **kwargs: Any
    ) -> Any:
        """A claiming write (record, claim), retried while the database is away. When a try
        fails after its commit may have happened (the answer lost on the way back), the next
        try finds the call taken; ``claim_id``, written in the claim's audit event, tells
        whether it was taken by that lost try, which makes the claim ours, as it is."""
        ambiguous = False
        async for attempt in self._database_retrying():
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

    def _database_retrying(self) -> AsyncRetrying:
        return AsyncRetrying(
            retry=retry_if_exception(is_transient),
            wait=wait_exponential(multiplier=0.1, max=2.0),
            stop=stop_after_delay(self.settings.database_retry_seconds),
            before_sleep=_log_database_retry,
            reraise=True,
        )

    async def _run_transactional(
        self, tool: RegisteredTool, call: CallRecord, arguments: dict[str, Any]
    ) -> CallRecord:
        """The handler writes through the ledger's transaction; its result joins that commit."""
        heartbeat = asyncio.create_task(self._heartbeat(call.key, call.lease_token))
        try:
            # On SQLite the tool's writes and the result are this process's writer meanwhile.
            async with write_lock(self.store.engine), self.store.engine.connect() as connection:
                transaction = await connection.begin()
                context = self._context(tool, call)
                if tool.is_async:
                    outcome = await self._invoke(tool, replace(context, db=connection), arguments)
                else:
                    outcome = await connection.run_sync(
                        lambda sync_connection: self._invoke_inline(
                            tool, replace(context, db=sync_connection), arguments
                        )
                    )
                if outcome.success:
                    crash_point(CP_AFTER_HANDLER)
                    done = await self.store.complete(
                        call.key, call.lease_token, outcome, connection=connection
                    )
                    await transaction.commit()
                    return done
                # A failed handler's writes are rolled back; its failure result is still kept.
                await transaction.rollback()
        finally:
            heartbeat.cancel()
            with suppress(asyncio.CancelledError):
                await heartbeat
        return await self.store.complete(call.key, call.lease_token, outcome)

    async def _invoke(self, tool: RegisteredTool, context: ToolContext, arguments: dict[str, Any]) -> Outcome:
        """Run the handler and turn whatever happens into the result the model gets."""
        stage = _Stage()

        async def attempt_once() -> Any:
            deadline = asyncio.timeout(
                tool.timeout if tool.timeout is not None else self.settings.handler_timeout_seconds
            )
            try:
                async with deadline:
                    if tool.is_async:
                        value = tool.function_tool._call(arguments, stage.set)
                    else:
                        # to_thread copies the context, so current_context() works in the thread.
                        value = await asyncio.to_thread(_call_in_thread, tool, arguments, stage.set)
                    return await value if inspect.isawaitable(value) else value
            except TimeoutError:
                if deadline.expired():
                    raise _HandlerTimeout from None
                raise

        with _handler_run(tool, context) as span:
            try:
                if tool.retries:
                    async for attempt in AsyncRetrying(
                        stop=stop_after_attempt(tool.retries + 1),
                        wait=wait_exponential(multiplier=0.05, max=2),
                        retry=retry_if_exception_type(tool.retry_on),
                        reraise=True,
                    ):
                        with attempt:
                            value = await attempt_once()
                else:
                    value = await attempt_once()
                outcome = succeeded(context.key, normalize_output(value, self.settings.max_output_bytes))
            except Exception as error:
                outcome = _failure(context.key, error, stage, self.store.redactor)
            _note_outcome(span, outcome)
            return outcome

    def _invoke_inline(
        self, tool: RegisteredTool, context: ToolContext, arguments: dict[str, Any]
    ) -> Outcome:
        """A sync transactional handler: run on this thread, inside the connection's greenlet,
        so that ``ctx.db`` (a sync Connection) is usable. No timeout can interrupt it."""
        stage = _Stage()
        with _handler_run(tool, context) as span:
            try:
                for attempt in range(tool.retries + 1):
                    try:
                        value = tool.function_tool._call(arguments, stage.set)
                        break
                    except tool.retry_on:
                        if attempt == tool.retries:
                            raise
                outcome = succeeded(context.key, normalize_output(value, self.settings.max_output_bytes))
            except Exception as error:
                outcome = _failure(context.key, error, stage, self.store.redactor)
            _note_outcome(span, outcome)
            return outcome

    async def _heartbeat(self, key: CallKey, token: int) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval)
            try:
                if not await self.store.heartbeat(key, token, self.settings.lease_seconds):
                    log.warning("call %s: lease lost (fenced); its result will be refused", key)
                    return
            except Exception:
                log.exception("heartbeat for %s failed; retrying", key)

    def _context(self, tool: RegisteredTool, call: CallRecord) -> ToolContext:
        return ToolContext(
            key=call.key,
            tool_name=tool.name,
            attempt=call.attempt_count,
            idempotency_key=call.idempotency_key,
            max_output_bytes=self.settings.max_output_bytes,
            logger=logging.LoggerAdapter(
                logging.getLogger(f"toolledger.tools.{tool.name}"),
                {"session_id": call.key.session_id, "turn_id": call.key.turn_id, "call_id": call.key.call_id},
            ),
        )


def _call_in_thread(tool: RegisteredTool, arguments: dict[str, Any], on_stage: Any) -> Any:
    try:
        return tool.function_tool._call(arguments, on_stage)
    except StopIteration as error:
        # A StopIteration cannot cross into a Future (asyncio would hang until the timeout).
        raise RuntimeError("the handler raised StopIteration") from error


def _log_database_retry(state: RetryCallState) -> None:
    error = state.outcome.exception() if state.outcome is not None else None
    metrics.RETRIES.labels("database").inc()
    log.warning("database unavailable (%s); retrying attempt %d", type(error).__name__, state.attempt_number)


class _HandlerTimeout(Exception):
    pass


class _Stage:
    """Where a handler call is: the SDK reports 'arguments' until validation passed."""

    def __init__(self) -> None:
        self.value = "arguments"

    def set(self, value: str) -> None:
        self.value = value


@contextmanager
def _handler_run(tool: RegisteredTool, context: ToolContext) -> Iterator[CallSpan]:
    """The handler's run as the tool sees it (its context bound) and as operators measure it
    (a duration per tool, a span)."""
    reset = bind_context(context)
    started = time.perf_counter()
    try:
        with call_span(
            "toolledger.handler", context.key, tool=tool.name, effect_class=tool.effect.value
        ) as span:
            yield span
    finally:
        metrics.HANDLER_DURATION.labels(tool.name).observe(time.perf_counter() - started)
        reset_context(reset)


def _note_outcome(span: CallSpan, outcome: Outcome) -> None:
    span.set("outcome", "succeeded" if outcome.success else "failed")
    if outcome.stage is not None:
        span.failed(f"handler failed at {outcome.stage.value}")


def _note_report(span: CallSpan, report: HandleReport) -> None:
    span.set("action", report.action)
    span.set("status", None if report.status is None else str(report.status))


def _call_log_fields(call: CallRecord) -> AbstractContextManager[None]:
    return log_fields(session_id=call.key.session_id, turn_id=call.key.turn_id, call_id=call.key.call_id)


def _failure(key: CallKey, error: Exception, stage: _Stage, redactor: Redactor = DEFAULT_REDACTOR) -> Outcome:
    """The result the model gets for a failure: never the exception's own text."""
    if isinstance(error, ToolError):
        return failed(key, tool_error_message(error, redactor), FailureStage.EXECUTION)
    if isinstance(error, pydantic.ValidationError) and stage.value == "arguments":
        return failed(key, validation_message(error, redactor), FailureStage.ARGUMENTS)
    if isinstance(error, _HandlerTimeout):
        return failed(key, TIMEOUT_MESSAGE, FailureStage.TIMEOUT)
    try:
        detail = "".join(traceback.format_exception(error))
    except Exception:  # an exception whose own __str__ or __repr__ fails
        detail = f"{type(error).__qualname__} (its text could not be rendered)"
    if isinstance(error, OutputError):
        return failed(key, str(error), FailureStage.OUTPUT, detail=detail)
    if stage.value == "output":  # the SDK failed to serialise what the handler returned
        return failed(key, OUTPUT_FAILED_MESSAGE, FailureStage.OUTPUT, detail=detail)
    # The (redacted) traceback stays in the audit trail only.
    return failed(key, FAILED_MESSAGE, FailureStage.EXECUTION, detail=detail)


def submission_backoff(call: CallRecord) -> float:
    """When to send a stored result again after a failed try: sooner than the next periodic
    reconcile, later with each try the call has had."""
    return min(SUBMIT_RETRY_FIRST * 2.0 ** min(call.submission_count, 16), SUBMIT_RETRY_MAX)


def _submission_report(call: CallRecord, action: str, outcome: SubmitOutcome) -> HandleReport:
    retry_in = submission_backoff(call) if outcome is SubmitOutcome.FAILED else None
    return HandleReport(call.key, action, call.status, outcome is SubmitOutcome.SUBMITTED, retry_in)


def _action_fields(action: Any) -> tuple[str, str, str, Any]:
    if isinstance(action, Mapping):
        return action["turn_id"], action["call_id"], action["name"], action.get("arguments")
    return action.turn_id, action.call_id, action.name, action.arguments


def _seconds_since(moment: datetime) -> float:
    aware = moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)
    return (datetime.now(UTC) - aware).total_seconds()
