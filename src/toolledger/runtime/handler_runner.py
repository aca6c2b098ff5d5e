"""Runs the application's code for a claimed call: its handler (with timeout, retries and a
lease heartbeat) and its verify hook, and turns whatever happens into the result the model
gets. What the result then becomes in the ledger is the caller's to say (``KeepOutcome``).

A claimed call may wait before its handler starts: for a handler slot
(``TOOLLEDGER_MAX_CONCURRENT_CALLS``), and a sync handler first for a thread of its own
(``handler_threads``). It waits under its lease, renewed as a running call's is; recording and
claiming it never waited for either. A sync handler's run takes its thread before its slot,
so that runs waiting for a thread hold no slot an async handler could use.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import logging
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager, suppress
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import pydantic
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    retry_if_not_exception_type,
    stop_after_attempt,
    wait_exponential,
)
from tenacity.retry import retry_base

from toolledger import metrics
from toolledger.domain.keys import CallKey
from toolledger.domain.records import CallRecord
from toolledger.domain.redaction import DEFAULT_REDACTOR, Redactor
from toolledger.domain.results import (
    FAILED_MESSAGE,
    OUTPUT_FAILED_MESSAGE,
    TIMEOUT_MESSAGE,
    FailureStage,
    InDoubt,
    MaybeExecuted,
    NotExecuted,
    Outcome,
    OutputError,
    ToolError,
    failed,
    normalize_output,
    not_executed_message,
    succeeded,
    tool_error_message,
    validation_message,
)
from toolledger.errors import TransactionLostError
from toolledger.runtime.context import ToolContext, VerifyAnswer, bind_context, reset_context
from toolledger.runtime.decider import Verified
from toolledger.runtime.handler_threads import HandlerThreads, ThreadTimeout
from toolledger.runtime.registry import RegisteredTool
from toolledger.settings import Settings
from toolledger.store.engine import write_lock
from toolledger.store.ledger import LedgerStore
from toolledger.tracing import CallSpan, call_span

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection

    KeepOutcome = Callable[[Outcome | InDoubt, AsyncConnection | None], Awaitable[CallRecord]]
    """Stores a handler's outcome: in the given connection's transaction (a transactional
    tool's, so that its writes and its result commit together), or on its own when None. An
    ``InDoubt`` (no result: the call becomes ``unknown``) is always stored on its own."""

log = logging.getLogger("toolledger.executor")


Phase = Literal["waiting for a handler thread", "waiting for a handler slot", "running"]


@dataclass
class Activity:
    """Where a claimed call's handler run is, in this process."""

    tool: str
    phase: Phase
    since: float
    """When it entered the phase (monotonic)."""
    waited: float = 0.0
    """Seconds spent waiting in earlier phases (not counted as the handler's run time)."""

    def waited_until(self, now: float) -> float:
        return self.waited + (0.0 if self.phase == "running" else now - self.since)

    def describe(self, now: float | None = None) -> str:
        now = time.monotonic() if now is None else now
        started = "" if self.phase == "running" else " (its handler not started)"
        return f"{self.phase} for {now - self.since:.1f}s{started}"


@dataclass(frozen=True)
class HandlerLoad:
    """How busy a process's handlers are: its slots and its threads."""

    slots: int
    """Handler slots (TOOLLEDGER_MAX_CONCURRENT_CALLS)."""
    running: int
    """Handlers running now."""
    waiting_for_slot: int
    """Claimed calls waiting for a handler slot (their leases renewed)."""
    threads: int
    """Handler threads (TOOLLEDGER_HANDLER_THREADS)."""
    threads_busy: int
    """Handler threads taken, timed-out ones still running included."""
    threads_timed_out: int
    """Threads whose handler timed out (or was cut off) and still runs, holding its slot."""
    waiting_for_thread: int
    """Sync handlers' runs waiting for a thread."""

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class HandlerRunner:
    def __init__(self, store: LedgerStore, settings: Settings, threads: HandlerThreads | None = None) -> None:
        """``threads``: where sync handlers run (the process's pool, shared by its executors);
        without it, a pool of ``settings.handler_threads`` of this runner's own."""
        self.store = store
        self.settings = settings
        self.threads = threads or HandlerThreads(settings.handler_threads)
        self._slots = asyncio.Semaphore(settings.max_concurrent_calls)
        self.activity: dict[CallKey, Activity] = {}
        """Calls whose handler run is under way here: waiting, or running."""

    def load(self) -> HandlerLoad:
        phases = [activity.phase for activity in self.activity.values()]
        threads = self.threads.snapshot()
        return HandlerLoad(
            slots=self.settings.max_concurrent_calls,
            running=phases.count("running"),
            waiting_for_slot=phases.count("waiting for a handler slot"),
            threads=threads.size,
            threads_busy=threads.busy,
            threads_timed_out=threads.timed_out,
            waiting_for_thread=threads.waiting,
        )

    def describe(self, key: CallKey) -> tuple[str, str] | None:
        """The call's tool, and where its handler run is, for a log line; None when none is
        under way here."""
        now = time.monotonic()
        for run in self.threads.runs():
            if run.key == key:
                return run.tool, run.describe(now)
        activity = self.activity.get(key)
        return None if activity is None else (activity.tool, activity.describe(now))

    async def run(
        self, tool: RegisteredTool, call: CallRecord, arguments: dict[str, Any], keep: KeepOutcome
    ) -> CallRecord:
        """Run the handler under the call's lease, then ``keep`` its outcome."""
        heartbeat = asyncio.create_task(self._heartbeat(call.key, call.lease_token))
        try:
            with self._activity(tool, call.key):
                outcome = (await self._invoke(tool, self.context(tool, call), arguments)).ending
        finally:
            heartbeat.cancel()
            with suppress(asyncio.CancelledError):
                await heartbeat
        return await keep(outcome, None)

    async def run_transactional(
        self, tool: RegisteredTool, call: CallRecord, arguments: dict[str, Any], keep: KeepOutcome
    ) -> CallRecord | Outcome | InDoubt:
        """The handler writes through the ledger's transaction; its result joins that commit
        (``keep`` in the transaction), and the stored call is returned. A failed (or unsure)
        handler's writes are rolled back and its outcome returned, for the caller to keep.
        Each run within the claim (``retries``) has a transaction of its own: the writes of a
        run that raised are gone before the next one starts."""
        heartbeat = asyncio.create_task(self._heartbeat(call.key, call.lease_token))
        context = self.context(tool, call)
        retried: list[str] = []
        try:
            with self._activity(tool, call.key):
                # Only a run that raised what the tool retries after is run again (``_RunAgain``):
                # a lost connection or a refused result is never retried here.
                async for attempt in self._retrying(tool, context, retried, after=(_RunAgain,)):
                    with attempt:
                        # The slot before the connection: on SQLite a transaction waiting for
                        # a slot would hold the file's write lock.
                        async with self._slot(call.key):
                            ran = await self._in_transaction(tool, call, context, arguments, keep, retried)
                        if isinstance(ran, _Ran):
                            if isinstance(ran.error, tool.retry_on):
                                raise _RunAgain(ran)
                            return _with_retries(ran.ending, retried)
                        return ran
        except _RunAgain as last:
            return _with_retries(last.ran.ending, retried)
        finally:
            heartbeat.cancel()
            with suppress(asyncio.CancelledError):
                await heartbeat
        raise AssertionError("unreachable: the retry policy re-raises")

    async def _in_transaction(
        self,
        tool: RegisteredTool,
        call: CallRecord,
        context: ToolContext,
        arguments: dict[str, Any],
        keep: KeepOutcome,
        retried: list[str],
    ) -> CallRecord | _Ran:
        """One run of a transactional handler in a transaction of its own: committed with its
        result if it succeeded (the stored call returned), else rolled back."""
        # On SQLite the tool's writes and the result are this process's writer meanwhile.
        async with write_lock(self.store.engine), self.store.engine.connect() as connection:
            transaction = await connection.begin()
            if tool.is_async:
                ran = await self._invoke(tool, replace(context, db=connection), arguments, retry=False)
            else:
                ran = await connection.run_sync(
                    lambda sync_connection: self._invoke_inline(
                        tool, replace(context, db=sync_connection), arguments
                    )
                )
            if isinstance(ran.ending, Outcome) and ran.ending.success:
                done = await keep(_with_retries(ran.ending, retried), connection)
                await transaction.commit()
                return done
            if connection.invalidated:
                # The handler failed because the database went away under it (a restart,
                # say): keeping "Tool handler failed" would answer the model for an outage.
                # The call stays running; once taken over it runs again, as is safe here.
                raise TransactionLostError(f"call {call.key}: the database connection was lost")
            await transaction.rollback()
            return ran

    async def verify(self, tool: RegisteredTool, call: CallRecord) -> Verified:
        """Ask the downstream system whether the first run happened; with its result if so."""
        assert tool.verify is not None
        try:
            answer = tool.verify(self.context(tool, call))
            verification = await answer if inspect.isawaitable(answer) else answer
        except Exception as error:
            # The traceback (redacted) goes to the audit trail; the log gets one line.
            log.warning("verify hook of %s failed for %s (%s)", tool.name, call.key, type(error).__name__)
            await self.store.flag(
                call.key,
                "verify_failed",
                "verify hook raised",
                detail=_call_redactor(self.store, call).text(traceback.format_exc()),
            )
            return Verified(VerifyAnswer.UNKNOWN)
        if verification.kind == VerifyAnswer.NOT_EXECUTED:
            return Verified(VerifyAnswer.NOT_EXECUTED)
        if verification.kind != VerifyAnswer.EXECUTED:
            return Verified(VerifyAnswer.UNKNOWN)
        try:
            output = normalize_output(verification.output, self.settings.max_output_bytes)
        except OutputError as error:
            return Verified(VerifyAnswer.EXECUTED, failed(call.key, str(error), FailureStage.OUTPUT))
        return Verified(VerifyAnswer.EXECUTED, succeeded(call.key, output))

    def context(self, tool: RegisteredTool, call: CallRecord) -> ToolContext:
        return self.context_for(tool, call.key, attempt=call.attempt_count)

    def context_for(self, tool: RegisteredTool, key: CallKey, *, attempt: int = 0) -> ToolContext:
        """A call's context before it is recorded (attempt 0), as an approval rule sees it."""
        return ToolContext(
            key=key,
            tool_name=tool.name,
            attempt=attempt,
            idempotency_key=key.idempotency_key,
            max_output_bytes=self.settings.max_output_bytes,
            logger=logging.LoggerAdapter(
                logging.getLogger(f"toolledger.tools.{tool.name}"),
                {"session_id": key.session_id, "turn_id": key.turn_id, "call_id": key.call_id},
            ),
        )

    # ------------------------------------------------------------ slots and threads

    @contextmanager
    def _activity(self, tool: RegisteredTool, key: CallKey) -> Iterator[None]:
        self.activity[key] = Activity(tool.name, "running", time.monotonic())
        try:
            yield
        finally:
            self.activity.pop(key, None)

    def _phase(self, key: CallKey, phase: Phase) -> None:
        activity = self.activity.get(key)
        if activity is not None and activity.phase != phase:
            now = time.monotonic()
            activity.waited = activity.waited_until(now)
            activity.phase, activity.since = phase, now

    def _waited(self, key: CallKey) -> float:
        activity = self.activity.get(key)
        return 0.0 if activity is None else activity.waited_until(time.monotonic())

    @asynccontextmanager
    async def _slot(self, key: CallKey) -> AsyncIterator[None]:
        """A handler slot (``max_concurrent_calls``), waited for under the call's lease."""
        if self._slots.locked():
            self._phase(key, "waiting for a handler slot")
            metrics.HANDLER_SLOT_WAITS.inc()
            try:
                await self._slots.acquire()
            finally:
                metrics.HANDLER_SLOT_WAITS.dec()
        else:
            await self._slots.acquire()
        self._phase(key, "running")
        try:
            yield
        finally:
            self._slots.release()

    async def _in_thread(
        self, tool: RegisteredTool, key: CallKey, arguments: dict[str, Any], stage: _Stage
    ) -> Any:
        """A sync handler in a thread of its own: a thread first (the tool's share of the
        process's), then a handler slot, then the timeout.

        The timeout counts from the thread's start, not from the wait for one. A call waiting
        has not begun its side effect: failing it "timed out" would tell the model that a tool
        ran too long when it never ran, because other handlers hung; and a wait is no run
        (the lease is renewed meanwhile, and status and metrics show the wait). A timed-out
        handler's thread cannot be stopped: it keeps its thread slot until it returns, and the
        call is never started again meanwhile (``HandlerThreads`` runs one thread per call)."""
        self._phase(key, "waiting for a handler thread")
        async with (
            self.threads.slot(tool=tool.name, key=key, limit=tool.threads) as thread,
            self._slot(key),
        ):
            seconds = self._timeout(tool)
            try:
                return await thread.run(
                    functools.partial(_call_in_thread, tool, arguments, stage.set), time_limit=seconds
                )
            except ThreadTimeout:
                log.warning(
                    "call %s (%s): handler timed out after %gs; its thread still runs, holding a "
                    "handler thread until it returns",
                    key,
                    tool.name,
                    seconds,
                )
                raise _HandlerTimeout from None

    def _timeout(self, tool: RegisteredTool) -> float:
        return tool.timeout if tool.timeout is not None else self.settings.handler_timeout_seconds

    def _retrying(
        self,
        tool: RegisteredTool,
        context: ToolContext,
        retried: list[str],
        after: tuple[type[BaseException], ...] | None = None,
    ) -> AsyncRetrying:
        """Runs of a handler within its claim: again after what the tool's ``retry_on`` names
        (or ``after``), up to ``retries`` times, with exponential backoff; ``retried``
        collects what each next run came after. A sync handler that timed out is not run
        again: its thread may still be at work."""

        def note_retry(state: RetryCallState) -> None:
            error = state.outcome.exception() if state.outcome is not None else None
            if isinstance(error, _RunAgain):
                error = error.ran.error
            retried.append(type(error).__name__)
            log.info(
                "call %s (%s): handler raised %s; running it again within its claim (%d of %d)",
                context.key,
                tool.name,
                type(error).__name__,
                state.attempt_number,
                tool.retries,
            )

        retry: retry_base = retry_if_exception_type(tool.retry_on if after is None else after)
        if not tool.is_async:
            retry = retry & retry_if_not_exception_type(_HandlerTimeout)
        return AsyncRetrying(
            stop=stop_after_attempt(tool.retries + 1),
            wait=wait_exponential(multiplier=0.05, max=2),
            retry=retry,
            before_sleep=note_retry,
            reraise=True,
        )

    async def _invoke(
        self, tool: RegisteredTool, context: ToolContext, arguments: dict[str, Any], *, retry: bool = True
    ) -> _Ran:
        """Run the handler and turn whatever happens into the result the model gets (or, if
        it cannot tell whether its effect happened, into an ``InDoubt``). ``retry``: run it
        again within the claim as the tool's ``retries`` say; else once."""
        stage = _Stage()
        retried: list[str] = []

        async def attempt_once() -> Any:
            if not tool.is_async:
                # The thread gets a copy of this task's context: current_context() works there.
                value = await self._in_thread(tool, context.key, arguments, stage)
                return await value if inspect.isawaitable(value) else value
            async with self._slot(context.key):
                deadline = asyncio.timeout(self._timeout(tool))
                try:
                    async with deadline:
                        value = tool.function_tool._call(arguments, stage.set)
                        return await value if inspect.isawaitable(value) else value
                except TimeoutError:
                    if deadline.expired():
                        raise _HandlerTimeout from None
                    raise

        with _handler_run(tool, context, functools.partial(self._waited, context.key)) as span:
            raised: Exception | None = None
            try:
                if retry and tool.retries:
                    async for attempt in self._retrying(tool, context, retried):
                        with attempt:
                            value = await attempt_once()
                else:
                    value = await attempt_once()
                ending: Outcome | InDoubt = succeeded(
                    context.key, normalize_output(value, self.settings.max_output_bytes)
                )
            except Exception as error:
                raised = error
                ending = _ending(context.key, error, stage, self.store.redactor.for_call(arguments))
            ending = _with_retries(ending, retried)
            _note_outcome(span, ending)
            return _Ran(ending, raised)

    def _invoke_inline(self, tool: RegisteredTool, context: ToolContext, arguments: dict[str, Any]) -> _Ran:
        """A sync transactional handler, run once: on this thread, inside the connection's
        greenlet, so that ``ctx.db`` (a sync Connection) is usable. No timeout can interrupt it."""
        stage = _Stage()
        with _handler_run(tool, context) as span:
            raised: Exception | None = None
            try:
                value = tool.function_tool._call(arguments, stage.set)
                ending: Outcome | InDoubt = succeeded(
                    context.key, normalize_output(value, self.settings.max_output_bytes)
                )
            except Exception as error:
                raised = error
                ending = _ending(context.key, error, stage, self.store.redactor.for_call(arguments))
            _note_outcome(span, ending)
            return _Ran(ending, raised)

    async def _heartbeat(self, key: CallKey, token: int) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval)
            try:
                if not await self.store.heartbeat(key, token, self.settings.lease_seconds):
                    log.warning("call %s: lease lost (fenced); its result will be refused", key)
                    return
            except Exception:
                log.exception("heartbeat for %s failed; retrying", key)


def _call_in_thread(tool: RegisteredTool, arguments: dict[str, Any], on_stage: Any) -> Any:
    try:
        return tool.function_tool._call(arguments, on_stage)
    except StopIteration as error:
        # A StopIteration cannot cross into a Future (asyncio would hang until the timeout).
        raise RuntimeError("the handler raised StopIteration") from error


class _HandlerTimeout(Exception):
    pass


class _Ran(NamedTuple):
    """How a run of a handler (with its retries, if it had them) ended."""

    ending: Outcome | InDoubt
    error: Exception | None
    """What it raised, if it did."""


class _RunAgain(Exception):
    """A transactional run that raised what its tool retries after: its transaction is rolled
    back, and the next run gets a new one."""

    def __init__(self, ran: _Ran) -> None:
        super().__init__(type(ran.error).__name__)
        self.ran = ran


class _Stage:
    """Where a handler call is: the SDK reports 'arguments' until validation passed."""

    def __init__(self) -> None:
        self.value = "arguments"

    def set(self, value: str) -> None:
        self.value = value


@contextmanager
def _handler_run(
    tool: RegisteredTool, context: ToolContext, waited: Callable[[], float] = lambda: 0.0
) -> Iterator[CallSpan]:
    """The handler's run as the tool sees it (its context bound) and as operators measure it
    (a duration per tool, a span). ``waited``: seconds the call has waited for slots and
    threads so far, left out of the duration."""
    reset = bind_context(context)
    started, waited_before = time.perf_counter(), waited()
    try:
        with call_span(
            "toolledger.handler", context.key, tool=tool.name, effect_class=tool.effect.value
        ) as span:
            yield span
    finally:
        ran = time.perf_counter() - started - (waited() - waited_before)
        metrics.HANDLER_DURATION.labels(tool.name).observe(max(ran, 0.0))
        reset_context(reset)


def _note_outcome(span: CallSpan, outcome: Outcome | InDoubt) -> None:
    if isinstance(outcome, InDoubt):
        span.set("outcome", "unknown")
        return
    span.set("outcome", "succeeded" if outcome.success else "failed")
    if outcome.stage is not None:
        span.failed(f"handler failed at {outcome.stage.value}")


def _with_retries(ending: Outcome | InDoubt, retried: list[str]) -> Outcome | InDoubt:
    """``ending`` saying what the handler was run again after within its claim, if anything."""
    if not retried:
        return ending
    if isinstance(ending, InDoubt):
        again = ", ".join(retried)
        return replace(ending, reason=f"{ending.reason} (run {len(retried) + 1} times; again after {again})")
    return replace(ending, retried=tuple(retried))


def _ending(
    key: CallKey, error: Exception, stage: _Stage, redactor: Redactor = DEFAULT_REDACTOR
) -> Outcome | InDoubt:
    """How a run that raised ends: in doubt if the handler said it cannot tell whether its
    effect happened, else the failure the model is told. ``redactor``: the call's own
    (``Redactor.for_call``), so that what the handler quotes of its secret arguments is
    masked in every text kept or sent: the model's message, the audit reason, the traceback."""
    if isinstance(error, MaybeExecuted):
        return InDoubt(
            redactor.text(f"handler raised MaybeExecuted: {_audit_message(error)}"),
            detail=redactor.text(_traceback_of(error)),
        )
    outcome = _failure(key, error, stage, redactor)
    return replace(outcome, detail=redactor.text(outcome.detail)) if outcome.detail else outcome


def _call_redactor(store: LedgerStore, call: CallRecord) -> Redactor:
    """The store's redactor, also masking the secret-field values of ``call``'s arguments (as
    the model sent them, and as an approver amended them)."""
    given = []
    for text in (call.arguments, call.approved_arguments):
        with suppress(ValueError, TypeError, RecursionError):
            given.append(json.loads(text) if text else None)
    return store.redactor.for_call(given)


def _audit_message(error: MaybeExecuted) -> str:
    """A MaybeExecuted's message for the audit trail (the store redacts it), capped."""
    try:
        message = error.message if isinstance(getattr(error, "message", None), str) else str(error)
    except Exception:  # an evil __str__
        message = ""
    message = message or "(no message)"
    return message if len(message) <= 300 else message[:299] + "…"


def _traceback_of(error: BaseException) -> str:
    try:
        return "".join(traceback.format_exception(error))
    except Exception:  # an exception whose own __str__ or __repr__ fails
        return f"{type(error).__qualname__} (its text could not be rendered)"


def _failure(key: CallKey, error: Exception, stage: _Stage, redactor: Redactor = DEFAULT_REDACTOR) -> Outcome:
    """The result the model gets for a failure: never the exception's own text."""
    if isinstance(error, ToolError):
        return failed(key, tool_error_message(error, redactor), FailureStage.EXECUTION)
    if isinstance(error, NotExecuted):
        # Meant for the model, as a ToolError's message; the traceback (with what it was
        # raised from) stays in the audit trail.
        return failed(
            key, not_executed_message(error, redactor), FailureStage.NOT_EXECUTED, _traceback_of(error)
        )
    if isinstance(error, pydantic.ValidationError) and stage.value == "arguments":
        return failed(key, validation_message(error, redactor), FailureStage.ARGUMENTS)
    if isinstance(error, _HandlerTimeout):
        return failed(key, TIMEOUT_MESSAGE, FailureStage.TIMEOUT)
    detail = _traceback_of(error)
    if isinstance(error, OutputError):
        return failed(key, str(error), FailureStage.OUTPUT, detail=detail)
    if stage.value == "output":  # the SDK failed to serialise what the handler returned
        return failed(key, OUTPUT_FAILED_MESSAGE, FailureStage.OUTPUT, detail=detail)
    # The (redacted) traceback stays in the audit trail only.
    return failed(key, FAILED_MESSAGE, FailureStage.EXECUTION, detail=detail)
