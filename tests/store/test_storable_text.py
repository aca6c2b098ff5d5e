"""Every free-text column takes the same storable-text rule, whoever writes it: PostgreSQL's
text holds neither NUL nor lone surrogates (SQLite holds both), so both databases store them
spelled as escapes and give the same answer."""

from __future__ import annotations

import uuid

from sqlalchemy.ext.asyncio import AsyncEngine

from toolledger.domain.keys import CallKey
from toolledger.domain.states import EffectClass
from toolledger.store.ledger import LedgerStore
from toolledger.store.schema import storable_text
from toolledger.store.sessions import SessionStore

HOSTILE = "a\x00b\ud800c"
STORED = "a\\u0000b\\ud800c"


def test_the_rule__escapes_only_what_postgresql_refuses() -> None:
    assert storable_text(HOSTILE) == STORED
    assert storable_text("café ✓ plain") == "café ✓ plain"
    assert storable_text(STORED) == STORED, "applied twice, the same"


async def test_a_session_unwatched_with_nul_and_a_lone_surrogate_in_its_reason(engine: AsyncEngine) -> None:
    sessions = SessionStore(engine)
    await sessions.watch("sess_text")
    assert await sessions.unwatch("sess_text", f"reason {HOSTILE}")
    record = await sessions.get("sess_text")
    assert record is not None
    assert record.reason == f"reason {STORED}"


async def test_ledger_texts__arguments_reasons_and_details(engine: AsyncEngine) -> None:
    store = LedgerStore(engine, actor="worker")
    key = CallKey("sess_text", "turn_1", f"call_{uuid.uuid4().hex[:8]}")
    recorded = await store.record(
        key,
        tool_name="notify",
        arguments={"x": 1},
        effect_class=EffectClass.IDEMPOTENT,
        lease_seconds=30,
        stored_arguments=f"preview {HOSTILE}",
    )
    assert recorded.call.arguments == f"preview {STORED}"
    await store.flag(key, "note", f"why {HOSTILE}", detail=f"detail {HOSTILE}")
    await store.record_submission_failure(key, f"failed {HOSTILE}")
    abandoned = await store.abandon(key, f"gone {HOSTILE}")
    assert abandoned is not None
    assert abandoned.abandoned_reason == f"gone {STORED}"
    assert abandoned.last_submission_error == f"failed {STORED}"
    (note,) = [e for e in await store.events(key) if e.kind == "note"]
    assert (note.reason, note.detail) == (f"why {STORED}", f"detail {STORED}")
    (gone,) = [e for e in await store.events(key) if e.to_status == "abandoned"]
    assert gone.reason == f"gone {STORED}"
