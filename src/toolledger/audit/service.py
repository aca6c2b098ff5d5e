"""One audit service behind the CLI, the HTTP API and the web view.

Reads go through ``AuditStore``; the one write an operator makes on a call (resolving an
``unknown`` outcome) goes through the ledger's own transition, recorded with the operator's
name and reason, then submitted like any stored result.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pydantic
from sqlalchemy.ext.asyncio import AsyncEngine

from toolledger.audit.exports import (
    CSV_COLUMNS,
    FORMATS,
    ExportedHead,
    ExportLine,
    ExportWriter,
    exported_call,
    read_export,
)
from toolledger.audit.intake_report import intake_report
from toolledger.audit.trail import ExportReport, TrailCheck, TrailReport, tally, trail_state
from toolledger.audit.views import (
    CallCountsView,
    CallDetail,
    CallPage,
    CallView,
    IntakeView,
    SessionView,
    call_view,
    counts_view,
    event_view,
    intake_view,
    masked_json,
    session_view,
)
from toolledger.crashpoints import CP_AFTER_APPROVAL, crash_point
from toolledger.domain.keys import (
    ArgumentsRefused,
    CallKey,
    arguments_fingerprint,
    arguments_text,
    parse_arguments,
)
from toolledger.domain.queries import CallQuery, CallReference, QueryError
from toolledger.domain.records import CallRecord
from toolledger.domain.redaction import MASK, Redactor
from toolledger.domain.results import (
    DENIED_PREFIX,
    NOT_APPROVED_IN_TIME_MESSAGE,
    TOOL_ERROR_MAX_CHARS,
    FailureStage,
    failed,
    succeeded,
    validation_message,
)
from toolledger.domain.states import CallStatus
from toolledger.domain.submissions import SubmitOutcome
from toolledger.domain.trail import (
    TrailKey,
    TrailScope,
    check_anchor,
    check_keyed,
    check_trail,
    content_covered,
)
from toolledger.errors import AgentsAuthError, CallNotFoundError, ToolLedgerError
from toolledger.store.ledger import LedgerStore
from toolledger.store.trail import CallTrail, TrailStore

if TYPE_CHECKING:
    # The SDK (through the gateway, the executor and the registry) is needed to submit or re-run
    # a resolution, not to list, show or export: imported only then, so `calls list` starts fast.
    from toolledger.gateway.agents import AgentsGateway
    from toolledger.runtime.composition import Runtime
    from toolledger.runtime.decider import Verified
    from toolledger.runtime.executor import Executor, HandleReport
    from toolledger.runtime.registry import RegisteredTool, ToolRegistry

log = logging.getLogger(__name__)

EXPORT_BATCH = 500
"""Calls exported (or checked against an export) per read of their trails' heads."""

MAX_OPERATOR_CHARS = 100
MAX_REASON_CHARS = 2000
_WHITESPACE = "".join(char for char in map(chr, range(0x3001)) if char.isspace())
"""What str.strip() removes (nothing above U+3000 is whitespace to Python)."""
REASON_PATTERN = "[^" + "".join(f"\\u{ord(char):04x}" for char in _WHITESPACE) + "]"
"""A reason that is not blank, as a JSON Schema pattern: it holds a character strip() keeps.
Each whitespace character is spelled out, so every regex engine (a client's, a validator's)
reads it as Python does."""


class AmbiguousCallError(ToolLedgerError):
    code = "ambiguous_call"


class NotResolvableError(ToolLedgerError):
    """Only a call whose outcome is ``unknown`` can be resolved by an operator."""

    code = "not_resolvable"


class ResolutionKind(StrEnum):
    OUTPUT = "output"
    """The operator checked: it happened; this is what the model is told it returned."""
    ERROR = "error"
    """The operator checked: it did not happen (or failed); the model gets this message."""
    RERUN = "rerun"
    """The operator judged a second run safe: the call runs again."""


@dataclass(frozen=True)
class Resolution:
    kind: ResolutionKind
    operator: str
    reason: str
    text: str | None = None
    """The output (OUTPUT) or the error message (ERROR)."""

    def __post_init__(self) -> None:
        if not self.operator.strip() or len(self.operator) > MAX_OPERATOR_CHARS:
            raise QueryError(f"operator must be 1 to {MAX_OPERATOR_CHARS} characters")
        if not self.reason.strip() or len(self.reason) > MAX_REASON_CHARS:
            raise QueryError(f"a reason (1 to {MAX_REASON_CHARS} characters) is required")
        if self.kind is ResolutionKind.RERUN and self.text is not None:
            raise QueryError("a re-run takes no output or error text")
        if self.kind is not ResolutionKind.RERUN and self.text is None:
            raise QueryError(f"a resolution by {self.kind.value} needs its text")
        if self.kind is ResolutionKind.ERROR and (not self.text or len(self.text) > TOOL_ERROR_MAX_CHARS):
            raise QueryError(f"an error message must be 1 to {TOOL_ERROR_MAX_CHARS} characters")


class NotAwaitingApprovalError(ToolLedgerError):
    """Only a call awaiting approval can be approved or denied (or the approval names other
    arguments than the call's)."""

    code = "not_awaiting_approval"


class NotApprovedInTimeError(NotAwaitingApprovalError):
    """The call's approval deadline (its tool's ``approval_timeout``) passed before the
    approval, on the database's clock: it never runs, whether or not `serve` has told the
    model so yet."""

    code = "not_approved_in_time"


APPROVAL_NEEDS_SHA256 = (
    "an approval names the arguments the person saw: give their sha256 (`toolledger calls show` "
    "prints it beside them; the HTTP API's arguments_sha256)"
)
SHOWN_ARGUMENTS_CHARS = 300
"""Of a call's arguments, quoted (masked) in a refusal: enough to see they are not those."""


@dataclass(frozen=True)
class Decision:
    """A person's approval or denial of a call awaiting approval."""

    operator: str
    reason: str
    arguments_sha256: str | None = None
    """The fingerprint of the arguments the person saw (``CallView.arguments_sha256``): the
    decision is refused if the call's are other. Required to approve (``APPROVAL_NEEDS_SHA256``):
    an approval is bound to what was seen; a denial, which runs nothing, may leave it out."""
    amended_arguments: str | None = None
    """Approval only: JSON arguments the handler receives instead of the model's. Refused
    before anything is stored unless they fit the tool's parameters (which needs the tools in
    this process) and hold no masked value."""

    def __post_init__(self) -> None:
        if not self.operator.strip() or len(self.operator) > MAX_OPERATOR_CHARS:
            raise QueryError(f"operator must be 1 to {MAX_OPERATOR_CHARS} characters")
        if not self.reason.strip() or len(self.reason) > MAX_REASON_CHARS:
            raise QueryError(f"a reason (1 to {MAX_REASON_CHARS} characters) is required")


class ResolveAction(StrEnum):
    """What resolving an ``unknown`` call came to: every value a ``ResolveReport`` carries."""

    SUBMITTED = "submitted"
    """The operator's outcome was sent: the session has it."""
    ABANDONED = "abandoned"
    """The session no longer awaits the call: the outcome is kept, and the call abandoned."""
    SUBMIT_FAILED = "submit_failed"
    """Sending failed for now (or the key was refused): the reconciler sends it later."""
    NOT_SENT = "not_sent"
    """No Agents API is configured here: ``serve`` sends it."""
    RERUN = "rerun"
    """Run again here, and its result sent."""
    RERUNNING = "rerunning"
    """Re-opened, and being run again here in the background: follow the call to its end."""
    LEFT_FOR_SERVICE = "left_for_service"
    """Re-opened (or approved) for ``serve`` to run (no tools here, or another worker took it first)."""
    RAN = "ran"
    """Approved, run here, and its result sent."""


@dataclass(frozen=True)
class ResolveReport:
    call: CallView
    action: ResolveAction


class AuditService:
    """List, show, export, resolve and prune calls; list and watch sessions."""

    def __init__(self, runtime: Runtime, *, registry: ToolRegistry | None = None) -> None:
        """Over ``runtime``'s ledger; a resolution is submitted to its Agents API only when
        one is configured (``Runtime.configured_gateway``), and re-run here only with a
        ``registry`` (without one `serve` runs it)."""
        self.runtime = runtime
        self.settings = runtime.settings
        self.redactor = runtime.redactor
        self.registry = registry
        self.store = runtime.audit_store()
        self.sessions = runtime.session_store()
        self.trails = TrailStore(runtime.engine)
        self._reruns: dict[CallKey, asyncio.Task[None]] = {}
        """Re-runs started by ``resolve(..., wait=False)`` and not over yet."""

    @property
    def engine(self) -> AsyncEngine:
        return self.runtime.engine

    @property
    def gateway(self) -> AgentsGateway | None:
        """Where a resolution is submitted: the runtime's Agents API when one is configured
        (built, and the SDK imported, on first use), else none."""
        return self.runtime.configured_gateway()

    # ------------------------------------------------------------------ reads

    async def list_calls(self, query: CallQuery) -> CallPage:
        page = await self.store.list_calls(query)
        return CallPage(
            calls=[call_view(c, self.redactor) for c in page.calls],
            next_cursor=page.next_cursor.encode() if page.next_cursor else None,
        )

    async def counts(self, query: CallQuery) -> CallCountsView:
        return counts_view(await self.store.count_by(query))

    async def iter_calls(self, query: CallQuery) -> AsyncIterator[CallView]:
        async for call in self.store.iter_calls(query):
            yield call_view(call, self.redactor)

    async def export(self, query: CallQuery, fmt: str, *, digest: bool = True) -> AsyncIterator[ExportLine]:
        """Lines of JSON or CSV (header first), one call each with its trail's chain head,
        streamed in batches; then, with ``digest``, the line that closes the export
        (``audit.exports``)."""
        if fmt not in FORMATS:
            raise QueryError(f"unknown export format {fmt!r}: choose jsonl or csv")
        writer = ExportWriter(fmt)
        header = writer.header()
        if header is not None:
            yield header
        batch: list[CallRecord] = []
        async for call in self.store.iter_calls(query, batch=EXPORT_BATCH):
            batch.append(call)
            if len(batch) == EXPORT_BATCH:
                for line in await self._exported(writer, batch):
                    yield line
                batch = []
        for line in await self._exported(writer, batch):
            yield line
        if digest:
            yield writer.digest()

    async def _exported(self, writer: ExportWriter, calls: list[CallRecord]) -> list[ExportLine]:
        heads = await self.trails.heads([call.key for call in calls])
        return [writer.call(exported_call(call_view(c, self.redactor), heads.get(c.key))) for c in calls]

    # ------------------------------------------------------------------ trail

    async def trail_scope(self, reference: str | None = None, *, session_id: str | None = None) -> TrailScope:
        """The trails a verification covers: the call ``reference`` names, a session's calls,
        or (neither) every call. A reference must name one call; a session, some call."""
        if reference is not None and session_id is not None:
            raise QueryError("verify one call or one session, not both")
        if reference is not None:
            return TrailScope(key=(await self.find_one(reference)).key)
        if session_id is not None:
            scope = TrailScope(session_id=session_id)
            if await self.trails.count_calls(scope) == 0:
                raise CallNotFoundError(f"no call of session {session_id!r} in the ledger")
            return scope
        return TrailScope()

    def trail_key(self, keyed: bool) -> TrailKey | None:
        """The key a keyed verification checks the MACs with (None: not keyed)."""
        if not keyed:
            return None
        if self.runtime.trail_key is None:
            raise QueryError("keyed verification needs the trail's key: set TOOLLEDGER_TRAIL_KEY")
        return self.runtime.trail_key

    async def check_trails(self, scope: TrailScope, *, keyed: bool = False) -> AsyncIterator[TrailCheck]:
        """Each call of ``scope``, its trail recomputed (its MACs too, ``keyed``) and its content
        held to it: its first broken link, if any."""
        key = self.trail_key(keyed)
        async for trail in self.trails.trails(scope):
            yield _checked(trail, key)

    async def verify_trail(
        self,
        scope: TrailScope,
        *,
        keyed: bool = False,
        max_listed: int | None = None,
        on_check: Callable[[TrailCheck], None] | None = None,
    ) -> TrailReport:
        """Every trail of ``scope`` recomputed: the counts, and the first broken link of each
        broken call (the first ``max_listed`` of them, if given). ``keyed``: every event's MAC
        checked too, with the runtime's trail key."""
        report = TrailReport(
            scope=str(scope), intact=True, calls=0, events=0, broken=0, breaks=[], keyed=keyed
        )
        async for check in self.check_trails(scope, keyed=keyed):
            tally(report, check, max_listed)
            if on_check is not None:
                on_check(check)
        return report

    async def verify_export(
        self,
        path: Path,
        *,
        keyed: bool = False,
        max_listed: int | None = None,
        on_check: Callable[[TrailCheck], None] | None = None,
    ) -> ExportReport:
        """An export read back (``audit.exports``): is the file whole (its digest line), and
        does every call's trail, recomputed, still begin with the head the export recorded?
        A call no longer in the ledger (pruned since, or deleted) is listed apart."""
        key = self.trail_key(keyed)
        export = read_export(path)
        report = ExportReport(
            scope=f"the calls of {path.name}",
            intact=export.whole,
            calls=0,
            events=0,
            broken=0,
            breaks=[],
            file_whole=export.whole,
            export_sha256=export.recorded.export_sha256,
            computed_sha256=export.computed_sha256,
            exported_calls=export.recorded.calls,
            missing=[],
            keyed=keyed,
        )
        batch: list[ExportedHead] = []
        for exported in export.heads():
            batch.append(exported)
            if len(batch) == EXPORT_BATCH:
                await self._check_exported(batch, report, key, max_listed, on_check)
                batch = []
        await self._check_exported(batch, report, key, max_listed, on_check)
        if report.calls + len(report.missing) != export.recorded.calls:
            report.intact = report.file_whole = False
        return report

    async def _check_exported(
        self,
        batch: list[ExportedHead],
        report: ExportReport,
        key: TrailKey | None,
        max_listed: int | None,
        on_check: Callable[[TrailCheck], None] | None,
    ) -> None:
        trails = {trail.key: trail for trail in await self.trails.trails_of([e.key for e in batch])}
        for exported in batch:
            trail = trails.get(exported.key)
            if trail is None:
                report.missing.append(str(exported.key))
                continue
            check = _checked(trail, key)
            if check.found is None:
                check = dataclasses.replace(check, found=check_anchor(trail.events, exported.head))
            tally(report, check, max_listed)
            if on_check is not None:
                on_check(check)

    async def show(self, reference: str | CallReference) -> CallDetail:
        """One call with its timeline, and whether its trail holds what is shown: the row and
        its events read together (one statement), the trail verified, the content held to its
        last event, and (with the trail's key here) every event's MAC checked."""
        found = await self.find_one(reference)
        trails = await self.trails.trails_of([found.key])
        if not trails:
            raise CallNotFoundError(f"call {found.key} is no longer in the ledger (pruned meanwhile)")
        (trail,) = trails
        key = self.runtime.trail_key
        broken = check_trail(trail.events, trail.status, trail.content)
        keyed = None if key is None else check_keyed(trail.events, trail.content, key)
        return CallDetail(
            call=call_view(trail.call, self.redactor),
            timeline=[event_view(e, self.redactor) for e in trail.events],
            trail=trail_state(broken, content_covered(trail.events), keyed, key is not None),
        )

    async def find_one(self, reference: str | CallReference) -> CallRecord:
        ref = CallReference.parse(reference) if isinstance(reference, str) else reference
        found = await self.store.find(ref)
        if not found:
            raise CallNotFoundError(f"no call matches {_named(ref)}")
        if len(found) > 1:
            keys = ", ".join(str(c.key) for c in found[:5])
            raise AmbiguousCallError(
                f"{_named(ref)} names {len(found)} calls ({keys}): give SESSION/TURN/CALL"
            )
        return found[0]

    async def session_list(self, *, watched: bool | None = None, limit: int = 100) -> list[SessionView]:
        return [
            session_view(s, self.redactor)
            for s in await self.store.session_summaries(watched=watched, limit=limit)
        ]

    async def session(self, session_id: str) -> SessionView:
        found = await self.store.session_summaries([session_id])
        if not found:
            raise CallNotFoundError(f"no session {session_id!r} in the ledger")
        return session_view(found[0], self.redactor)

    async def intake(self) -> IntakeView:
        """How sessions come in, as `toolledger status` reports it: the webhook counts are
        those the live replicas' last heartbeats carried (a dead replica's are gone with it)."""
        replicas = await self.sessions.live_replicas()
        report = await intake_report(
            self.settings,
            self.sessions,
            self.runtime.intake_store(),
            [replica.intake_counts for replica in replicas],
        )
        return intake_view(report, self.redactor)

    async def watch(self, session_id: str) -> bool:
        return await self.sessions.watch(session_id)

    async def unwatch(self, session_id: str, reason: str) -> bool:
        return await self.sessions.unwatch(session_id, reason)

    # ----------------------------------------------------------------- writes

    async def resolve(
        self, reference: str | CallReference, resolution: Resolution, *, wait: bool = True
    ) -> ResolveReport:
        """Settle an ``unknown`` call as the operator says, on the record, then submit it.

        A re-run (with the tools here) runs the handler: ``wait`` for it, or (``wait=False``,
        the HTTP API) answer once the call is re-opened, ``RERUNNING``, and run it in the
        background (``rerunning``, ``stop_reruns``): a handler may run for minutes, and a
        request held that long is cut by proxies (the call, not the answer, says how it ends)."""
        call = await self.find_one(reference)
        if call.status is not CallStatus.UNKNOWN:
            raise NotResolvableError(
                f"call {call.key} is {call.status.value}: only an unknown outcome can be resolved"
            )
        operator_store = self.runtime.ledger_store(actor=f"operator:{resolution.operator}")
        why = f"resolved by operator ({resolution.kind.value}): {resolution.reason}"
        if resolution.kind is ResolutionKind.RERUN:
            reopened = await operator_store.reopen(call.key, reason=why)
            if reopened is None:
                raise NotResolvableError(f"call {call.key} changed while being resolved: look again")
            if self.registry is None:
                return ResolveReport(call_view(reopened, self.redactor), ResolveAction.LEFT_FOR_SERVICE)
            if not wait:
                self._rerun_in_background(reopened, operator_store)
                return ResolveReport(call_view(reopened, self.redactor), ResolveAction.RERUNNING)
            try:
                action = _rerun_action(await self._executor(operator_store).handle_recorded(reopened))
            except AgentsAuthError as error:
                action = _refused_submission(call, error)
            latest = await self.find_one(CallReference(key=call.key))
            return ResolveReport(call_view(latest, self.redactor), action)
        assert resolution.text is not None
        outcome = (
            succeeded(call.key, resolution.text)
            if resolution.kind is ResolutionKind.OUTPUT
            else failed(call.key, resolution.text, FailureStage.RECOVERY)
        )
        settled = await operator_store.settle(call.key, outcome, reason=why)
        if settled is None:
            raise NotResolvableError(f"call {call.key} changed while being resolved: look again")
        try:
            action = _RESOLVE_ACTIONS[await self._executor(operator_store).submit(settled, listed=False)]
        except AgentsAuthError as error:
            action = _refused_submission(call, error)
        latest = await self.find_one(CallReference(key=call.key))
        return ResolveReport(call_view(latest, self.redactor), action)

    def _rerun_in_background(self, call: CallRecord, store: LedgerStore) -> None:
        key = call.key

        async def rerun() -> None:
            from toolledger.runtime.loop_logging import log_failure

            try:
                report = await self._executor(store).handle_recorded(call)
                log.info("call %s: re-run by operator: %s", key, _rerun_action(report).value)
            except asyncio.CancelledError:
                log.warning(
                    "call %s: the operator's re-run was cut off (shutting down); it becomes unknown "
                    "again once its lease runs out",
                    key,
                )
                raise
            except AgentsAuthError as error:
                _refused_submission(call, error)
            except Exception:
                log_failure(log, "call %s: the operator's re-run stopped; the ledger says how far", key)

        task = asyncio.create_task(rerun(), name=f"operator re-run {key}")
        self._reruns[key] = task
        task.add_done_callback(lambda _: self._reruns.pop(key, None))

    @property
    def rerunning(self) -> frozenset[CallKey]:
        """Calls this service is re-running in the background now."""
        return frozenset(self._reruns)

    async def stop_reruns(self, grace: float) -> list[CallKey]:
        """Let background re-runs finish within ``grace`` seconds, then cancel the rest (their
        leases run out: unknown again, as after a crash); the calls cut off."""
        running = dict(self._reruns)
        if not running:
            return []
        _, left = await asyncio.wait(running.values(), timeout=grace)
        for task in left:
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)
        return [key for key, task in running.items() if task in left]

    def has_verify_hook(self, call: CallRecord) -> bool:
        """Whether this process can ask ``call``'s verify hook: it was given the tools (``--tools``,
        or ``serve --api``) and the call's tool has one."""
        tool = self.registry.get(call.tool_name) if self.registry is not None else None
        return tool is not None and tool.verify is not None

    async def ask_verify_hook(self, call: CallRecord, resolution: Resolution) -> Verified | None:
        """A ``verified`` call's hook asked whether its run happened, on behalf of the operator
        behind ``resolution``; None when this process has no such tool (no ``--tools``)."""
        tool = self.registry.get(call.tool_name) if self.registry is not None else None
        if tool is None or tool.verify is None:
            return None
        store = self.runtime.ledger_store(actor=f"operator:{resolution.operator}")
        return await self._executor(store).handlers.verify(tool, call)

    async def settle_verified(
        self, call: CallRecord, verified: Verified, resolution: Resolution
    ) -> ResolveReport:
        """Settle an unknown call with the outcome its verify hook found, then submit it."""
        assert verified.outcome is not None, "an executed verification carries its outcome"
        store = self.runtime.ledger_store(actor=f"operator:{resolution.operator}")
        why = f"resolved by operator (verify hook asked first: it happened): {resolution.reason}"
        settled = await store.settle(call.key, verified.outcome, reason=why)
        if settled is None:
            raise NotResolvableError(f"call {call.key} changed while being resolved: look again")
        try:
            action = _RESOLVE_ACTIONS[await self._executor(store).submit(settled, listed=False)]
        except AgentsAuthError as error:
            action = _refused_submission(call, error)
        latest = await self.find_one(CallReference(key=call.key))
        return ResolveReport(call_view(latest, self.redactor), action)

    async def approve(self, reference: str | CallReference, decision: Decision) -> ResolveReport:
        """Let a call awaiting approval run, on the record: bound to the arguments the person
        saw (``decision.arguments_sha256``, required), with amended arguments if given (checked
        before anything is stored: ``_amendment``), and only before its deadline on the
        database's clock (else ``NotApprovedInTimeError``). Then run it here when this process
        has the tools, else ``serve`` runs it."""
        seen = decision.arguments_sha256
        if seen is None:
            raise QueryError(APPROVAL_NEEDS_SHA256)
        call = await self._awaiting(reference, decision, "approved")
        amended_text = amended_sha256 = None
        if decision.amended_arguments is not None:
            amended_text, amended_sha256 = self._amendment(call, decision.amended_arguments)
        store = self.runtime.ledger_store(actor=f"operator:{decision.operator}")
        approved = await store.approve(
            call.key,
            arguments_sha256=seen,
            decided_by=decision.operator,
            reason=f"approved by {decision.operator}: {decision.reason}",
            amended_arguments=amended_text,
            amended_sha256=amended_sha256,
        )
        if approved is None:
            raise await self._not_approved(call.key, seen)
        crash_point(CP_AFTER_APPROVAL)
        if self.registry is None:
            return ResolveReport(call_view(approved, self.redactor), ResolveAction.LEFT_FOR_SERVICE)
        try:
            report = await self._executor(store).handle_recorded(approved)
            action = _rerun_action(report, ran=ResolveAction.RAN)
        except AgentsAuthError as error:
            action = _refused_submission(call, error)
        latest = await self.find_one(CallReference(key=call.key))
        return ResolveReport(call_view(latest, self.redactor), action)

    async def deny(self, reference: str | CallReference, decision: Decision) -> ResolveReport:
        """Answer a call awaiting approval with the person's reason as a failure the model can
        act on, on the record, and send it."""
        if decision.amended_arguments is not None:
            raise QueryError("a denial takes no arguments")
        most = TOOL_ERROR_MAX_CHARS - len(DENIED_PREFIX)
        if len(decision.reason) > most:
            raise QueryError(f"a denial's reason is sent to the model: at most {most} characters")
        call = await self._awaiting(reference, decision, "denied")
        store = self.runtime.ledger_store(actor=f"operator:{decision.operator}")
        outcome = failed(call.key, DENIED_PREFIX + self.redactor.text(decision.reason), FailureStage.APPROVAL)
        denied = await store.deny(
            call.key,
            outcome,
            decided_by=decision.operator,
            reason=f"denied by {decision.operator}: {decision.reason}",
        )
        if denied is None:
            raise NotAwaitingApprovalError(f"call {call.key} was decided by someone else first: look again")
        try:
            action = _RESOLVE_ACTIONS[await self._executor(store).submit(denied, listed=False)]
        except AgentsAuthError as error:
            action = _refused_submission(call, error)
        latest = await self.find_one(CallReference(key=call.key))
        return ResolveReport(call_view(latest, self.redactor), action)

    async def _awaiting(self, reference: str | CallReference, decision: Decision, verb: str) -> CallRecord:
        call = await self.find_one(reference)
        if call.status is not CallStatus.AWAITING_APPROVAL:
            if _expired(call):
                raise _late(call)
            raise NotAwaitingApprovalError(
                f"call {call.key} is {call.status.value}: only a call awaiting approval can be {verb}"
            )
        if decision.arguments_sha256 is not None and decision.arguments_sha256 != call.arguments_sha256:
            raise self._other_arguments(call, decision.arguments_sha256, verb)
        return call

    def _other_arguments(self, call: CallRecord, given: str, verb: str) -> NotAwaitingApprovalError:
        """The sha256 given is not that of the call's arguments. The call's own fingerprint
        is not quoted (copied back, it would approve what nobody read): its arguments are,
        masked as every view masks them, for the person to look at again."""
        shown = json.dumps(masked_json(call.arguments, self.redactor), ensure_ascii=False, sort_keys=True)
        if len(shown) > SHOWN_ARGUMENTS_CHARS:
            shown = shown[:SHOWN_ARGUMENTS_CHARS] + "... (`toolledger calls show` has them whole)"
        return NotAwaitingApprovalError(
            f"call {call.key}: its arguments differ from those the sha256 given ({given}) names, "
            f"so they are not those {verb}: nothing was {verb}; look again at them before you "
            f"decide: {shown}"
        )

    async def _not_approved(self, key: CallKey, seen: str) -> NotAwaitingApprovalError:
        """Why the approval's compare-and-set found nothing to approve, read afterwards."""
        call = await self.find_one(CallReference(key=key))
        if call.status is CallStatus.AWAITING_APPROVAL:
            if call.arguments_sha256 != seen:
                return self._other_arguments(call, seen, "approved")
            # Still awaiting, its arguments those seen: the deadline had passed, on the
            # database's clock (`serve` has not answered the model yet).
            return _late(call)
        if _expired(call):
            return _late(call)
        return NotAwaitingApprovalError(
            f"call {key} was decided by someone else first (it is {call.status.value}): look again"
        )

    def _amendment(self, call: CallRecord, text: str) -> tuple[str, str]:
        """Amended arguments as stored (text, sha256), once they are known to be what the
        handler can run: strict JSON (as the model's are held to), no value the views masked,
        and fitting the tool's parameters. Anything else is refused (``QueryError``) before
        the approval is stored, so it is not used up."""
        try:
            amended = parse_arguments(text, self.settings.max_arguments_bytes)
        except ArgumentsRefused as error:
            raise QueryError(f"amended arguments refused: {error}") from None
        masked_at = _mask_in(amended)
        if masked_at is not None:
            raise QueryError(
                f"amended arguments refused: {masked_at} holds {MASK}, a value the views masked, "
                "not the real one: type the real value, or approve without amending"
            )
        tool = self.registry.get(call.tool_name) if self.registry is not None else None
        if tool is None:
            where = (
                "this process was not given the tools"
                if self.registry is None
                else f"this process's tools have no {call.tool_name!r}"
            )
            raise QueryError(
                "amended arguments refused: they are checked against the tool's parameters before "
                f"they are stored, and {where}: approve with --tools (the CLI) or through "
                "`toolledger serve --api` (the HTTP API and web view), or approve without amending"
            )
        problem = _parameters_problem(tool, amended, self.redactor)
        if problem is not None:
            raise QueryError(
                f"amended arguments refused: they do not fit {tool.name}'s parameters: {problem}"
            )
        return arguments_text(amended), arguments_fingerprint(amended)

    async def prune(self, older_than: timedelta, *, dry_run: bool = False, progress: Any = None) -> int:
        if older_than <= timedelta(0):
            raise QueryError("older-than must be a positive duration")
        before = datetime.now(UTC) - older_than
        return await self.store.prune(before, dry_run=dry_run, progress=progress)

    def _executor(self, store: LedgerStore) -> Executor:
        from toolledger.runtime.executor import Executor
        from toolledger.runtime.registry import ToolRegistry

        return Executor(
            self.registry or ToolRegistry(),
            store,
            self.gateway,
            self.settings,
            run_handlers=self.registry is not None,
            threads=self.runtime.handler_threads(),
        )


def _expired(call: CallRecord) -> bool:
    """The call was answered "not approved in time" (its deadline passed before anyone decided)."""
    if call.error_stage != FailureStage.APPROVAL.value or call.result is None:
        return False
    try:
        payload = json.loads(call.result)
    except ValueError:
        return False
    return isinstance(payload, dict) and payload.get("error") == NOT_APPROVED_IN_TIME_MESSAGE


def _late(call: CallRecord) -> NotApprovedInTimeError:
    deadline = call.approval_expires_at
    when = f" ({deadline.astimezone(UTC):%Y-%m-%d %H:%M:%S} UTC)" if deadline is not None else ""
    return NotApprovedInTimeError(
        f"call {call.key} was not approved in time: its approval deadline{when} has passed, so it "
        "will not run; the model is told it was not approved in time"
    )


def _mask_in(value: Any, where: str = "arguments") -> str | None:
    """Where ``value`` holds the mask the views show for a secret (a key or a text, at any
    depth, alone or within a longer text: a masked URL keeps its scheme and host), if it does."""
    if isinstance(value, str):
        return where if MASK in value else None
    if isinstance(value, dict):
        for key, item in value.items():
            at = f"{where}.{key}"
            if MASK in key:
                return at
            found = _mask_in(item, at)
            if found is not None:
                return found
    if isinstance(value, list):
        for index, item in enumerate(value):
            found = _mask_in(item, f"{where}[{index}]")
            if found is not None:
                return found
    return None


def _parameters_problem(tool: RegisteredTool, arguments: dict[str, Any], redactor: Redactor) -> str | None:
    """What makes ``arguments`` not fit ``tool``'s parameters, or None when they fit. Checked
    with the tool's own argument model (the one its JSON schema is made from, and that the SDK
    runs before the handler): strictly, as JSON (no "9000" for an integer), then as the handler
    will (what it refuses, the model would be told are its own invalid arguments)."""
    model = getattr(tool.function_tool, "_model", None)
    if not (isinstance(model, type) and issubclass(model, pydantic.BaseModel)):
        return "the tool declares no argument model to check them against"
    try:
        model.model_validate_json(json.dumps(arguments), strict=True)
        model.model_validate(arguments)
    except pydantic.ValidationError as error:
        return validation_message(error, redactor).removeprefix("Invalid arguments: ")
    return None


def _rerun_action(report: HandleReport, *, ran: ResolveAction = ResolveAction.RERUN) -> ResolveAction:
    """A re-run's (or an approved run's: ``ran``) handling told as a resolution: every
    ``HandleAction`` lands on one."""
    if report.submission is SubmitOutcome.SUBMITTED:
        return ran
    if report.submission is not None:
        return _RESOLVE_ACTIONS[report.submission]
    if report.status is CallStatus.ABANDONED:
        return ResolveAction.ABANDONED
    # Not sent by this handling: another worker claimed the re-opened call first (or fenced
    # this run), and its result is that worker's to send.
    return ResolveAction.LEFT_FOR_SERVICE


def _refused_submission(call: CallRecord, error: AgentsAuthError) -> ResolveAction:
    """The resolution is on the record; only its submission was refused (the key): say so,
    and leave it for `serve` to submit once the credentials are fixed."""
    log.warning("call %s: resolved, but not submitted: %s", call.key, error)
    return ResolveAction.SUBMIT_FAILED


_RESOLVE_ACTIONS = {
    SubmitOutcome.SUBMITTED: ResolveAction.SUBMITTED,
    SubmitOutcome.ABANDONED: ResolveAction.ABANDONED,
    SubmitOutcome.FAILED: ResolveAction.SUBMIT_FAILED,
    SubmitOutcome.NOT_SENT: ResolveAction.NOT_SENT,
}


def _checked(trail: CallTrail, key: TrailKey | None) -> TrailCheck:
    """``trail`` recomputed, its content held to it (and its MACs checked with ``key``)."""
    found = check_trail(trail.events, trail.status, trail.content, key=key)
    return TrailCheck(trail.key, len(trail.events), found, content_covered(trail.events))


def _named(ref: CallReference) -> str:
    if ref.key is not None:
        return str(ref.key)
    return repr(ref.idempotency_prefix or ref.call_id)


__all__ = [
    "CSV_COLUMNS",
    "AmbiguousCallError",
    "AuditService",
    "Decision",
    "NotApprovedInTimeError",
    "NotAwaitingApprovalError",
    "NotResolvableError",
    "Resolution",
    "ResolutionKind",
    "ResolveAction",
    "ResolveReport",
]
