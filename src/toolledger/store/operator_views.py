"""What an operator's probes read from the ledger database: its schema revision (readiness)
and one snapshot of the calls by status and tool (the metrics' gauges)."""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from toolledger.domain.states import RESULT_STATUSES
from toolledger.metrics import LedgerSnapshot
from toolledger.store.migrate import revision_of
from toolledger.store.schema import sessions, tool_calls


class OperatorViews:
    """Read-only: the queries behind ``/readyz`` and ``/metrics``."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def schema_revision(self) -> str | None:
        """The revision the database's schema is at (None: never migrated)."""
        async with self.engine.connect() as conn:
            return await conn.run_sync(revision_of)

    async def ledger_snapshot(self) -> LedgerSnapshot:
        """One GROUP BY over the calls (the oldest waiting result rides along as a MIN), and
        one count of the watched sessions."""
        by_status_and_tool = select(
            tool_calls.c.status, tool_calls.c.tool_name, func.count(), func.min(tool_calls.c.finished_at)
        ).group_by(tool_calls.c.status, tool_calls.c.tool_name)
        watched = select(func.count()).select_from(sessions).where(sessions.c.watched.is_(True))
        async with self.engine.connect() as conn:
            rows = list(await conn.execute(by_status_and_tool))
            watched_count = int((await conn.execute(watched)).scalar_one())
        waiting_since = [
            finished for status, _, _, finished in rows if status in RESULT_STATUSES and finished
        ]
        oldest = (datetime.now(UTC) - min(waiting_since)).total_seconds() if waiting_since else 0.0
        return LedgerSnapshot(
            calls={(status, tool): int(count) for status, tool, count, _ in rows},
            oldest_unsubmitted_result_age_seconds=max(oldest, 0.0),
            watched_sessions=watched_count,
        )


__all__ = ["OperatorViews"]
