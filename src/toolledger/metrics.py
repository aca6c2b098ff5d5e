"""Prometheus metrics: what this process did (histograms, counters), and what the ledger
holds at scrape time (a collector fed one snapshot per scrape).

A leaf module: the runtime imports it to count, the HTTP API to expose; it knows nothing of
toolledger itself, so importing it can never create a cycle.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# Handlers range from a cache lookup to a slow payment API; submissions are one HTTP round trip.
_HANDLER_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
_SUBMISSION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)

HANDLER_DURATION = Histogram(
    "toolledger_handler_duration_seconds",
    "Time a tool's handler ran (every attempt of one claim, timeouts included).",
    ["tool"],
    buckets=_HANDLER_BUCKETS,
)
SUBMISSION_DURATION = Histogram(
    "toolledger_submission_duration_seconds",
    "Time to submit one stored result to the Agents API, retries included.",
    buckets=_SUBMISSION_BUCKETS,
)
SUBMISSION_BATCH_SIZE = Histogram(
    "toolledger_submission_batch_results",
    "Results sent together in one request of several (a session's results that became ready "
    "while its previous request was in flight).",
    buckets=(2, 3, 4, 6, 8, 12, 16, 32, 64, 128),
)
SUBMISSIONS = Counter(
    "toolledger_submissions",
    "Submissions of stored results, by outcome (submitted, abandoned, failed, not_sent).",
    ["outcome"],
)
RETRIES = Counter(
    "toolledger_retries",
    "Operations tried again after a transient failure, by operation (database, submission).",
    ["operation"],
)
ALERT_POSTS = Counter(
    "toolledger_alert_posts",
    "POSTs of alerts to the alert webhook, by outcome (delivered, failed): a failed one is tried "
    "again until it is delivered.",
    ["outcome"],
)

WEBHOOKS = Counter(
    "toolledger_webhooks",
    "Webhooks received at /webhooks/agents, by outcome (accepted, duplicate, ignored, "
    "unavailable, refused_<reason>).",
    ["outcome"],
)
WEBHOOK_ACK_DURATION = Histogram(
    "toolledger_webhook_ack_seconds",
    "Time from a webhook's arrival to its answer (verified and committed, or refused).",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5),
)
LOOKS = Counter(
    "toolledger_looks",
    "Looks at intake sessions (served without an event stream), by result (reconciled, "
    "other_agent, gone, failed).",
    ["result"],
)
SWEEPS = Counter(
    "toolledger_sweeps",
    "Sweeps of an agent's sessions, by outcome (done, failed).",
    ["outcome"],
)
SWEPT_SESSIONS = Counter(
    "toolledger_swept_sessions",
    "Sessions a sweep found requiring an action (each then looked at).",
)

HANDLER_THREAD_WAIT = Histogram(
    "toolledger_handler_thread_wait_seconds",
    "Time a sync handler's run waited for a thread of its own (TOOLLEDGER_HANDLER_THREADS, or its "
    "tool's threads=) before it started; its timeout counts from the start.",
    buckets=(0.001, 0.01, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 1800),
)
HANDLER_SLOT_WAITS = Gauge(
    "toolledger_calls_waiting_for_handler_slot",
    "Calls recorded and claimed (their leases renewed) that wait for a handler slot "
    "(TOOLLEDGER_MAX_CONCURRENT_CALLS) before their handler starts.",
)


@dataclass(frozen=True)
class HandlerThreadsSnapshot:
    """How a pool of handler threads stands."""

    size: int
    busy: int
    """Slots taken: threads running a handler (timed-out ones included)."""
    timed_out: int
    """Threads whose run was given up (it timed out, or was cut off) and that still run: each
    keeps its slot until its handler returns."""
    waiting: int
    """Runs waiting for a thread."""


class _ThreadPool(Protocol):
    def snapshot(self) -> HandlerThreadsSnapshot: ...


class HandlerThreadsCollector(Collector):
    """Gauges of this process's handler threads, summed over its pools (read at scrape time)."""

    def __init__(self) -> None:
        self._pools: weakref.WeakSet[_ThreadPool] = weakref.WeakSet()

    def track(self, pool: _ThreadPool) -> None:
        self._pools.add(pool)

    def snapshot(self) -> HandlerThreadsSnapshot:
        snapshots = [pool.snapshot() for pool in list(self._pools)]
        return HandlerThreadsSnapshot(
            size=sum(s.size for s in snapshots),
            busy=sum(s.busy for s in snapshots),
            timed_out=sum(s.timed_out for s in snapshots),
            waiting=sum(s.waiting for s in snapshots),
        )

    def collect(self) -> Iterator[Metric]:
        now = self.snapshot()
        yield GaugeMetricFamily(
            "toolledger_handler_threads",
            "Threads this process may run sync handlers in at once (TOOLLEDGER_HANDLER_THREADS).",
            now.size,
        )
        yield GaugeMetricFamily(
            "toolledger_handler_threads_busy",
            "Handler threads taken now, timed-out ones still running included.",
            now.busy,
        )
        yield GaugeMetricFamily(
            "toolledger_handler_threads_timed_out",
            "Handler threads whose run timed out (or was cut off at shutdown) and that still run, "
            "each holding its slot until the handler returns.",
            now.timed_out,
        )
        yield GaugeMetricFamily(
            "toolledger_calls_waiting_for_handler_thread",
            "Sync handlers' runs waiting for a handler thread.",
            now.waiting,
        )


HANDLER_THREADS = HandlerThreadsCollector()
REGISTRY.register(HANDLER_THREADS)

MAX_TOOL_LABELS = 100
"""Tool names come from the model too (an unknown tool is recorded under the name it used):
past this many, the rarest are counted under ``OTHER_TOOLS`` so a scrape stays small."""
OTHER_TOOLS = "_other"


@dataclass(frozen=True)
class LedgerSnapshot:
    """What the ledger holds, read once per scrape."""

    calls: Mapping[tuple[str, str], int] = field(default_factory=dict)
    """Calls by (status, tool name)."""
    oldest_unsubmitted_result_age_seconds: float = 0.0
    """Age of the oldest stored result not yet submitted; 0 when none waits."""
    watched_sessions: int = 0


class LedgerCollector(Collector):
    """Gauges of one ledger snapshot (a fresh collector per scrape: no state between scrapes).

    ``None``: the ledger could not be read; only ``toolledger_ledger_up 0`` is reported, so the
    process's own metrics still reach Prometheus and an alert can fire on the database.
    """

    def __init__(self, snapshot: LedgerSnapshot | None) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "toolledger_ledger_up",
            "1 if the ledger database answered this scrape, else 0.",
            0 if self.snapshot is None else 1,
        )
        if self.snapshot is not None:
            yield from self._gauges(self.snapshot)

    def _gauges(self, snapshot: LedgerSnapshot) -> Iterator[Metric]:
        calls = GaugeMetricFamily(
            "toolledger_calls", "Calls in the ledger, by status and tool.", labels=["status", "tool"]
        )
        for (status, tool), count in sorted(_capped_tools(snapshot.calls).items()):
            calls.add_metric([status, tool], count)
        yield calls
        unknown = sum(count for (status, _), count in snapshot.calls.items() if status == "unknown")
        yield GaugeMetricFamily(
            "toolledger_unknown_calls", "Calls whose outcome is unknown: an operator must look.", unknown
        )
        yield GaugeMetricFamily(
            "toolledger_oldest_unsubmitted_result_age_seconds",
            "Age of the oldest stored result not yet accepted by the Agents API (0: none waits).",
            snapshot.oldest_unsubmitted_result_age_seconds,
        )
        yield GaugeMetricFamily(
            "toolledger_watched_sessions", "Sessions the service follows.", snapshot.watched_sessions
        )


def _capped_tools(calls: Mapping[tuple[str, str], int]) -> dict[tuple[str, str], int]:
    totals: dict[str, int] = {}
    for (_, tool), count in calls.items():
        totals[tool] = totals.get(tool, 0) + count
    kept = set(sorted(totals, key=lambda tool: (-totals[tool], tool))[:MAX_TOOL_LABELS])
    capped: dict[tuple[str, str], int] = {}
    for (status, tool), count in calls.items():
        label = (status, tool if tool in kept else OTHER_TOOLS)
        capped[label] = capped.get(label, 0) + count
    return capped


__all__ = [
    "ALERT_POSTS",
    "HANDLER_DURATION",
    "HANDLER_SLOT_WAITS",
    "HANDLER_THREADS",
    "HANDLER_THREAD_WAIT",
    "RETRIES",
    "SUBMISSIONS",
    "SUBMISSION_BATCH_SIZE",
    "SUBMISSION_DURATION",
    "HandlerThreadsCollector",
    "HandlerThreadsSnapshot",
    "LedgerCollector",
    "LedgerSnapshot",
]
