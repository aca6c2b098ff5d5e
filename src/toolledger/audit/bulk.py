"""Bulk operator actions: resolve every ``unknown`` call a filter selects, at a bounded rate.

After an incident an operator may face hundreds of calls with unknown outcomes (a payment
provider down for an hour, say). Resolving them one by one is slow; a blind bulk re-run is
how peers repeat charges. Here a bulk resolution is the single resolution applied call by
call, each on the record with its own audit event (its reason names the bulk run), with
three guards:

- a ``verified`` tool's hook is asked first: what the downstream system says happened wins
  over the operator's blanket answer (a call the hook finds executed gets its true outcome;
  one it finds not executed is never told it happened);
- a rate limit (calls per second), so that re-runs or submissions do not stampede the tools'
  downstream systems or the Agents API;
- ``dry_run``: the calls that would be resolved, and how, with nothing changed.

A run may be given a time to end by (``stop_at``, the HTTP API's cap): no call is started
that, taking as long as the slowest so far, would end after it; a call under way is always
finished, never cut in the middle. The report then says it stopped early, and how many calls
it did not reach (still unknown, untouched): running it again takes them up.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from toolledger.audit.views import CallView, call_view
from toolledger.domain.queries import CallQuery, CallReference, QueryError
from toolledger.domain.records import CallRecord
from toolledger.domain.states import CallStatus, EffectClass
from toolledger.runtime.context import VerifyAnswer

if TYPE_CHECKING:
    from toolledger.audit.service import AuditService, Resolution

DEFAULT_RATE = 5.0
"""Calls resolved per second unless told otherwise."""
MAX_CALLS = 10_000
"""Calls one bulk resolution may touch: more is a filter that says too little."""

# What happened to each call, besides the ResolveAction values a resolution reports.
WOULD_RESOLVE = "would_resolve"
WOULD_VERIFY = "would_ask_verify_hook"
WOULD_SKIP_NO_HOOK = "would_skip_verify_hook_unavailable"
SETTLED_BY_HOOK = "settled_by_verify_hook"
SKIPPED_NO_HOOK = "skipped_verify_hook_unavailable"
SKIPPED_CONTRADICTED = "skipped_hook_says_not_executed"
SKIPPED_CHANGED = "skipped_no_longer_unknown"
SKIPPED = frozenset({SKIPPED_NO_HOOK, SKIPPED_CONTRADICTED, SKIPPED_CHANGED})
"""The actions that leave a call as it was (unknown, or settled by someone else)."""


@dataclass(frozen=True)
class BulkItem:
    call: CallView
    action: str
    note: str | None = None


@dataclass
class BulkReport:
    """A run, as far as it went: filled in call by call (``items``), so that whoever stops
    it (Ctrl-C) can still say what was done."""

    run_id: str
    dry_run: bool
    matched: int
    items: list[BulkItem] = field(default_factory=list)
    stopped_early: bool = False
    """The run's time ran out (``stop_at``) before every matched call was reached."""
    elapsed_seconds: float = 0.0

    @property
    def counts(self) -> dict[str, int]:
        return dict(Counter(item.action for item in self.items))

    @property
    def done(self) -> int:
        """Calls gone through, each with its item (resolved, settled by a hook, or skipped)."""
        return len(self.items)

    @property
    def left(self) -> int:
        """Matched calls the run did not reach: untouched, still unknown unless someone else
        settled them."""
        return self.matched - len(self.items)

    @property
    def skipped(self) -> int:
        return sum(item.action in SKIPPED for item in self.items)


Progress = Callable[[int, int, BulkItem], None]
"""Told after each call: how many are done, of how many, and what the last one came to."""


MAX_RATE = 1000.0
NO_HOOK_HINT = "verified: give --tools so its hook can be asked first"
"""Why a verified call is skipped, told where the tools are given: the CLI's flag."""


class BulkResolver:
    def __init__(
        self, service: AuditService, *, rate: float = DEFAULT_RATE, no_hook_hint: str = NO_HOOK_HINT
    ) -> None:
        if not 0 < rate <= MAX_RATE:
            raise QueryError(f"rate must be more than 0 and at most {MAX_RATE:g} calls per second")
        self.service = service
        self.rate = rate
        self.no_hook_hint = no_hook_hint
        self.report: BulkReport | None = None
        """The run under way (or the last one), as far as it went."""

    async def matching(self, query: CallQuery) -> list[CallRecord]:
        """The unknown calls the filter selects (a status filter may only say unknown)."""
        if query.statuses and set(query.statuses) != {CallStatus.UNKNOWN}:
            raise QueryError("only calls whose outcome is unknown can be resolved: filter on status unknown")
        calls: list[CallRecord] = []
        async for call in self.service.store.iter_calls(replace(query, statuses=(CallStatus.UNKNOWN,))):
            calls.append(call)
            if len(calls) > MAX_CALLS:
                raise QueryError(f"the filter selects more than {MAX_CALLS} unknown calls: narrow it")
        return calls

    async def resolve(
        self,
        query: CallQuery,
        resolution: Resolution,
        *,
        dry_run: bool = False,
        progress: Progress | None = None,
        stop_at: float | None = None,
    ) -> BulkReport:
        return await self.resolve_calls(
            await self.matching(query), resolution, dry_run=dry_run, progress=progress, stop_at=stop_at
        )

    async def resolve_calls(
        self,
        calls: list[CallRecord],
        resolution: Resolution,
        *,
        dry_run: bool = False,
        progress: Progress | None = None,
        stop_at: float | None = None,
    ) -> BulkReport:
        """``resolve`` over calls already selected by ``matching`` (whoever first looked at how
        many there are, and how long they take, need not read them twice).

        ``stop_at`` (the event loop's clock, ``loop.time()``): start no call that would end
        after it, were it as slow as the slowest so far; the report then says it stopped
        early. Cancelled (Ctrl-C), the call under way is finished first; ``self.report`` says
        how far the run went."""
        report = BulkReport(run_id=uuid.uuid4().hex[:12], dry_run=dry_run, matched=len(calls))
        self.report = report
        loop = asyncio.get_running_loop()
        started = loop.time()
        slowest = 0.0
        try:
            for number, call in enumerate(calls, start=1):
                if dry_run:
                    item = self._planned(call)
                else:
                    # Paced from the start, not from the last call: a slow call does not slow the rest.
                    begin = max(loop.time(), started + (number - 1) / self.rate)
                    if stop_at is not None and begin + slowest > stop_at:
                        report.stopped_early = True
                        break
                    await asyncio.sleep(begin - loop.time())
                    began = loop.time()
                    resolving = asyncio.ensure_future(self._one(call, resolution, report, number))
                    try:
                        item = await asyncio.shield(resolving)
                    except asyncio.CancelledError:
                        # Ctrl-C: the call under way is resolved whole (never cut between its
                        # record and its submission) and on the report before the run stops.
                        self._note(report, number, await resolving, progress)
                        raise
                    slowest = max(slowest, loop.time() - began)
                self._note(report, number, item, progress)
        finally:
            report.elapsed_seconds = loop.time() - started
        return report

    @staticmethod
    def _note(report: BulkReport, number: int, item: BulkItem, progress: Progress | None) -> None:
        report.items.append(item)
        if progress is not None:
            progress(number, report.matched, item)

    def _planned(self, call: CallRecord) -> BulkItem:
        view = call_view(call, self.service.redactor)
        if call.effect_class is EffectClass.VERIFIED:
            # What the run would really do: without the tools here, the hook cannot be asked.
            if not self.service.has_verify_hook(call):
                return BulkItem(view, WOULD_SKIP_NO_HOOK, self.no_hook_hint)
            return BulkItem(view, WOULD_VERIFY, "its verify hook is asked first")
        return BulkItem(view, WOULD_RESOLVE)

    async def _one(
        self, call: CallRecord, resolution: Resolution, report: BulkReport, number: int
    ) -> BulkItem:
        from toolledger.audit.service import NotResolvableError, ResolutionKind

        tagged = replace(
            resolution, reason=f"{resolution.reason} (bulk {report.run_id}, {number}/{report.matched})"
        )
        if call.effect_class is EffectClass.VERIFIED:
            verified = await self.service.ask_verify_hook(call, tagged)
            if verified is None:
                view = call_view(call, self.service.redactor)
                return BulkItem(view, SKIPPED_NO_HOOK, self.no_hook_hint)
            if verified.answer is VerifyAnswer.EXECUTED:
                settled = await self.service.settle_verified(call, verified, tagged)
                return BulkItem(settled.call, SETTLED_BY_HOOK, f"verify hook: it happened ({settled.action})")
            if verified.answer is VerifyAnswer.NOT_EXECUTED and resolution.kind is ResolutionKind.OUTPUT:
                view = call_view(call, self.service.redactor)
                return BulkItem(view, SKIPPED_CONTRADICTED, "the verify hook says it did not happen")
        try:
            resolved = await self.service.resolve(CallReference(key=call.key), tagged)
        except NotResolvableError:
            latest = await self.service.find_one(CallReference(key=call.key))
            return BulkItem(call_view(latest, self.service.redactor), SKIPPED_CHANGED, latest.status.value)
        return BulkItem(resolved.call, resolved.action.value)
