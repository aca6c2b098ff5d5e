"""Prometheus metrics: what this process did (histograms, counters), and what the ledger
holds at scrape time (a collector fed one snapshot per scrape).

A leaf module: the runtime imports it to count, the HTTP API to expose; it knows nothing of
toolledger itself, so importing it can never create a cycle.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client import Counter, Histogram
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
    "RETRIES",
    "SUBMISSIONS",
    "SUBMISSION_BATCH_SIZE",
    "SUBMISSION_DURATION",
    "LedgerCollector",
    "LedgerSnapshot",
]
