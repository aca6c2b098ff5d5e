"""`toolledger calls` as the CLI tests drive it: the command in process (failing the test on a
traceback or a leaked canary), the filled ledger read back, and an `unknown` call made the way
a dead worker leaves one."""

from __future__ import annotations

import json
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from click.testing import CliRunner, Result
from sqlalchemy import Engine, select
from sqlalchemy import create_engine as create_sync_engine
from sqlalchemy.engine import Row
from sqlalchemy.pool import NullPool

from tests.support.ledger_fill import FilledLedger
from tests.support.polling import eventually
from tests.support.shop_tools import CANARY
from toolledger.cli import main
from toolledger.domain.keys import CallKey
from toolledger.domain.states import EffectClass
from toolledger.emulator import EmulatorServer
from toolledger.store.engine import create_engine, sync_url
from toolledger.store.ledger import LedgerStore
from toolledger.store.schema import tool_call_events, tool_calls

EVERY = "500"
"""A page size that holds the whole test ledger."""
FINISHED = ("submitted", "abandoned")


# ---------------------------------------------------------------------------- fixtures


@dataclass
class Ledger:
    filled: FilledLedger
    emulator: EmulatorServer
    url: str

    def engine(self) -> Engine:
        # NullPool: no connection outlives a read (PostgreSQL copies need the source idle).
        return create_sync_engine(sync_url(self.url), poolclass=NullPool)

    def rows(self) -> list[Row[Any]]:
        with self.engine().connect() as conn:
            return list(conn.execute(select(tool_calls)))

    def events(self) -> list[Row[Any]]:
        with self.engine().connect() as conn:
            return list(conn.execute(select(tool_call_events).order_by(tool_call_events.c.id)))

    def status(self, key: CallKey) -> str:
        (row,) = [r for r in self.rows() if (r.session_id, r.turn_id, r.call_id) == astuple(key)]
        return str(row.status)


def cli(
    url: str, *args: str, base_url: str | None = None, env: dict[str, str | None] | None = None
) -> Result:
    """`toolledger calls ARGS` in process; fails the test on a traceback or a leaked canary."""
    result = CliRunner().invoke(
        main,
        ["calls", *args],
        env={
            "TOOLLEDGER_DATABASE_URL": url,
            "TOOLLEDGER_OPENAI_BASE_URL": base_url,
            "TOOLLEDGER_OPENAI_API_KEY": None,
            "COLUMNS": "1000",
            **(env or {}),
        },
    )
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        assert result.exc_info is not None
        pytest.fail("".join(traceback.format_exception(*result.exc_info)))
    # (stdout may show a crashed handler's stored, redacted traceback: that is data.)
    assert "Traceback" not in result.stderr
    for text in (result.stdout, result.stderr):
        assert CANARY not in text, (args, text)
    return result


def ok(url: str, *args: str, **options: Any) -> Result:
    result = cli(url, *args, **options)
    assert result.exit_code == 0, (args, result.output)
    return result


def listed(url: str, *args: str) -> list[dict[str, Any]]:
    document = json.loads(ok(url, "list", "--json", "--limit", EVERY, *args).stdout)
    assert document["next_cursor"] is None
    calls: list[dict[str, Any]] = document["calls"]
    return calls


def ids(calls: Sequence[dict[str, Any]]) -> list[str]:
    return [call["id"] for call in calls]


def error_line(result: Result) -> str:
    """The one line a refused command explains itself with."""
    lines = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1, result.stderr
    return lines[0]


def astuple(key: CallKey) -> tuple[str, str, str]:
    return key.session_id, key.turn_id, key.call_id


async def add_unknown_call(url: str, key: CallKey, tool_name: str, arguments: dict[str, Any]) -> None:
    """A call left `unknown` the way a dead worker leaves one: recorded and claimed, then its
    lease expires without a result (real ledger transitions, no shortcut)."""
    engine = create_engine(url)
    try:
        store = LedgerStore(engine, actor="calls-cli-test")
        recorded = await store.record(
            key,
            tool_name=tool_name,
            arguments=arguments,
            effect_class=EffectClass.AT_MOST_ONCE,
            lease_seconds=0.05,
        )
        assert recorded.claimed
        await eventually(lambda: store.expire_leases(key), within=10, what=f"{key} expired")
    finally:
        await engine.dispose()
