"""The order a listing of calls must come in, worked out from the rows themselves: the
oracle of the API's and the CLI's sorting and paging tests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy.engine import Row


def listing_order(
    rows: Sequence[Row[Any]], column: str = "created_at", *, descending: bool = True
) -> list[str]:
    """The calls' keys sorted by ``column``, ties broken by session, turn and call id."""
    ordered = sorted(
        rows,
        key=lambda r: (getattr(r, column), r.session_id, r.turn_id, r.call_id),
        reverse=descending,
    )
    return [r.idempotency_key for r in ordered]
