"""How sessions come in, as `toolledger status` and the audit API show it: the intake modes
configured, the looks due, the webhook counts of the live replicas and each agent's sweep."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from toolledger.settings import Settings
from toolledger.store.intake import IntakeStore
from toolledger.store.sessions import SessionStore


def intake_modes(settings: Settings) -> list[str]:
    """``watch`` always (registered sessions are followed); ``agents`` with agent ids (the
    sweep); ``webhooks`` with an address to take them on."""
    modes = ["watch"]
    if settings.agent_ids:
        modes.append("agents")
    if settings.listen:
        modes.append("webhooks")
    return modes


async def intake_report(
    settings: Settings,
    sessions: SessionStore,
    intake: IntakeStore,
    replica_counts: Sequence[Mapping[str, int] | None],
) -> dict[str, Any]:
    """``replica_counts``: each live replica's intake counts as of its last heartbeat (summed:
    the webhooks are spread over them by the load balancer)."""
    now = datetime.now(UTC)
    looks_due, intake_sessions = await sessions.look_backlog()
    counts: dict[str, int] = {}
    for replica in replica_counts:
        for name, count in (replica or {}).items():
            counts[name] = counts.get(name, 0) + count
    sweeps = [
        {
            "agent_id": sweep.agent_id,
            "runs": sweep.runs,
            "last_run_age_seconds": None
            if sweep.last_run_at is None
            else max(0.0, (now - sweep.last_run_at).total_seconds()),
            "last_found": sweep.last_found,
            "watermark": sweep.watermark,
            "last_error": sweep.last_error,
        }
        for sweep in await intake.sweeps()
    ]
    return {
        "modes": intake_modes(settings),
        "agent_ids": list(settings.agent_ids),
        "intake_sessions": intake_sessions,
        "looks_due": looks_due,
        "webhooks_taken": await intake.deliveries_taken(),
        "counts": dict(sorted(counts.items())),
        "sweeps": sweeps,
    }


__all__ = ["intake_modes", "intake_report"]
