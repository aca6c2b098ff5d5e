"""One audit service behind the CLI, the HTTP API and the web view.

Reads go through ``AuditStore``; the one write an operator makes on a call (resolving an
``unknown`` outcome) goes through the ledger's own transition, recorded with the operator's
name and reason, then submitted like any stored result.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
from toolledger.audit.trail import ExportReport, TrailCheck, TrailReport, tally, trail_state
from toolledger.audit.views import (
    CallCountsView,
    CallDetail,
    CallPage,
    CallView,
    SessionView,
    call_view,
    counts_view,
    event_view,
    session_view,
)
from toolledger.crashpoints import CP_AFTER_APPROVAL, crash_point
from toolledger.domain.keys import ArgumentsRefused, arguments_fingerprint, arguments_text, parse_arguments
from toolledger.domain.queries import CallQuery, CallReference, QueryError
from toolledger.domain.records import CallRecord
from toolledger.domain.results import (
    DENIED_PREFIX,
    TOOL_ERROR_MAX_CHARS,
    FailureStage,
    failed,
    succeeded,
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
    from toolledger.runtime.registry import ToolRegistry

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


@dataclass(frozen=True)
class Decision:
    """A person's approval or denial of a call awaiting approval."""

    operator: str
    reason: str
    arguments_sha256: str | None = None
    """The fingerprint of the arguments the person saw (``CallView.arguments_sha256``): the
    decision is refused if the call's are other. None: whatever the call holds."""
    amended_arguments: str | None = None
    """Approval only: JSON arguments the handler receives instead of the model's."""

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

    async def watch(self, session_id: str) -> bool:
        return await self.sessions.watch(session_id)

    async def unwatch(self, session_id: str, reason: str) -> bool:
        return await self.sessions.unwatch(session_id, reason)

    # ----------------------------------------------------------------- writes

    async def resolve(self, reference: str | CallReference, resolution: Resolution) -> ResolveReport:
        """Settle an ``unknown`` call as the operator says, on the record, then submit it."""
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
        """Let a call awaiting approval run (with amended arguments, if given), on the record;
        then run it here when this process has the tools, else ``serve`` runs it."""
        call = await self._awaiting(reference, decision, "approved")
        amended_text = amended_sha256 = None
        if decision.amended_arguments is not None:
            try:
                amended = parse_arguments(decision.amended_arguments, self.settings.max_arguments_bytes)
            except ArgumentsRefused as error:
                raise QueryError(f"amended arguments refused: {error}") from None
            amended_text, amended_sha256 = arguments_text(amended), arguments_fingerprint(amended)
        store = self.runtime.ledger_store(actor=f"operator:{decision.operator}")
        approved = await store.approve(
            call.key,
            decided_by=decision.operator,
            reason=f"approved by {decision.operator}: {decision.reason}",
            amended_arguments=amended_text,
            amended_sha256=amended_sha256,
        )
        if approved is None:
            raise NotAwaitingApprovalError(f"call {call.key} was decided by someone else first: look again")
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
            raise NotAwaitingApprovalError(
                f"call {call.key} is {call.status.value}: only a call awaiting approval can be {verb}"
            )
        if decision.arguments_sha256 is not None and decision.arguments_sha256 != call.arguments_sha256:
            raise NotAwaitingApprovalError(
                f"call {call.key}: its arguments (sha256 {call.arguments_sha256}) are not those "
                f"{verb} (sha256 {decision.arguments_sha256}): look again"
            )
        return call

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
        )


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
    "NotResolvableError",
    "Resolution",
    "ResolutionKind",
    "ResolveAction",
    "ResolveReport",
]
