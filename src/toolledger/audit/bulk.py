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


@dataclass(frozen=True)
class BulkItem:
    call: CallView
    action: str
    note: str | None = None


@dataclass
class BulkReport:
    run_id: str
    dry_run: bool
    matched: int
    items: list[BulkItem] = field(default_factory=list)

    @property
    def counts(self) -> dict[str, int]:
        return dict(Counter(item.action for item in self.items))


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
    ) -> BulkReport:
        return await self.resolve_calls(
            await self.matching(query), resolution, dry_run=dry_run, progress=progress
        )

    async def resolve_calls(
        self,
        calls: list[CallRecord],
        resolution: Resolution,
        *,
        dry_run: bool = False,
        progress: Progress | None = None,
    ) -> BulkReport:
        """``resolve`` over calls already selected by ``matching`` (whoever first looked at how
        many there are, and how long they take, need not read them twice)."""
        report = BulkReport(run_id=uuid.uuid4().hex[:12], dry_run=dry_run, matched=len(calls))
        loop = asyncio.get_running_loop()
        started = loop.time()
        for number, call in enumerate(calls, start=1):
            if not dry_run:
                # Paced from the start, not from the last call: a slow call does not slow the rest.
                await asyncio.sleep(max(0.0, started + (number - 1) / self.rate - loop.time()))
            item = await self._one(call, resolution, report, number) if not dry_run else self._planned(call)
            report.items.append(item)
            if progress is not None:
                progress(number, len(calls), item)
        return report

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
