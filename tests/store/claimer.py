"""A separate worker process for the concurrent-claim tests; it prints one JSON line per step.

    python -m tests.store.claimer race DATABASE_URL --ops record[,claim] --actor NAME --session S
        --rounds N --index I --barrier DIR [--lease-seconds S]
    python -m tests.store.claimer hold DATABASE_URL --actor NAME --session S --lease-seconds 0.3
        --go FILE

``race``: for each step s (each op, for each round r), touch ``DIR/ready-s-I``, wait for
``DIR/go-s`` (it holds a start time, seconds since the epoch), sleep until that moment, then
record (or claim from unknown) round r's call and print what it got (or the error it met).

``hold``: record and claim a call, print its token, wait for FILE to appear (meanwhile the
test may SIGSTOP this process and let the lease run out), then heartbeat and try to complete
with the old token and print whether that was fenced.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from sqlalchemy import text

from tests.support.polling import eventually
from toolledger.domain.keys import CallKey
from toolledger.domain.results import succeeded
from toolledger.domain.states import CallStatus, EffectClass
from toolledger.errors import FencedError
from toolledger.store.engine import create_engine
from toolledger.store.ledger import LedgerStore

ARGUMENTS: dict[str, Any] = {"amount": 7, "currency": "EUR"}
TOOL_NAME = "charge_card"
RACE_LEASE_SECONDS = 30.0
WAIT_TIMEOUT = 30.0
"""No wait in this process lasts longer: a stuck test ends instead of hanging."""
POLL_SECONDS = 0.002


def race_key(session_id: str, round_number: int) -> CallKey:
    return CallKey(session_id, f"turn_{round_number}", "call_1")


def hold_key(session_id: str) -> CallKey:
    return CallKey(session_id, "turn_hold", "call_1")


def emit(payload: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(payload) + "\n")
    sys.stdout.flush()


def present(path: Path) -> bool:
    return path.exists()  # a stat: too quick to be worth a thread


async def wait_for(path: Path) -> None:
    await eventually(
        lambda: present(path),
        within=WAIT_TIMEOUT,
        what=f"{path} did not appear within {WAIT_TIMEOUT} s",
        interval=POLL_SECONDS,
    )


async def race(args: argparse.Namespace) -> None:
    engine = create_engine(args.database_url)
    store = LedgerStore(engine, actor=args.actor)
    barrier = Path(args.barrier)
    steps = [(op, round_number) for op in args.ops.split(",") for round_number in range(args.rounds)]
    try:
        # Connect before the start signal, so the race is between statements, not connects.
        async with engine.connect() as conn:
            await conn.execute(text("SELECT 1"))
        for step, (op, round_number) in enumerate(steps):
            key = race_key(args.session, round_number)
            (barrier / f"ready-{step}-{args.index}").touch()
            go = barrier / f"go-{step}"
            await wait_for(go)
            start_at = float(go.read_text())
            await asyncio.sleep(max(0.0, start_at - time.time()))
            started = time.time()
            report: dict[str, Any] = {
                "actor": args.actor,
                "op": op,
                "round": round_number,
                "started": started,
            }
            try:
                report |= await race_step(store, key, op, args)
            except Exception as error:  # reported, so that the test can tell what went wrong
                report |= {"error": type(error).__name__, "message": str(error)[:2000]}
            emit(report)
    finally:
        await engine.dispose()


async def race_step(store: LedgerStore, key: CallKey, op: str, args: argparse.Namespace) -> dict[str, Any]:
    if op == "record":
        recorded = await store.record(
            key,
            tool_name=TOOL_NAME,
            arguments=ARGUMENTS,
            effect_class=EffectClass.IDEMPOTENT,
            lease_seconds=args.lease_seconds,
        )
        call = recorded.call
        claimed = recorded.claimed
        mismatch = recorded.arguments_mismatch
    else:
        taken = await store.claim(
            key,
            from_statuses=[CallStatus.UNKNOWN],
            lease_seconds=RACE_LEASE_SECONDS,
            reason=f"re-run by {args.actor}",
        )
        found = taken if taken is not None else await store.get(key)
        if found is None:
            raise LookupError(f"{key} is not in the ledger")
        call, claimed, mismatch = found, taken is not None, False
    return {
        "claimed": claimed,
        "arguments_mismatch": mismatch,
        "status": call.status.value,
        "lease_token": call.lease_token,
        "attempt_count": call.attempt_count,
        "lease_owner": call.lease_owner,
        "idempotency_key": call.idempotency_key,
    }


async def hold(args: argparse.Namespace) -> None:
    engine = create_engine(args.database_url)
    store = LedgerStore(engine, actor=args.actor)
    key = hold_key(args.session)
    try:
        recorded = await store.record(
            key,
            tool_name=TOOL_NAME,
            arguments=ARGUMENTS,
            effect_class=EffectClass.IDEMPOTENT,
            lease_seconds=args.lease_seconds,
        )
        token = recorded.call.lease_token
        emit({"step": "claimed", "claimed": recorded.claimed, "lease_token": token})
        await wait_for(Path(args.go))
        heartbeat = await store.heartbeat(key, token, RACE_LEASE_SECONDS)
        try:
            call = await store.complete(key, token, succeeded(key, f"result of {args.actor}"))
        except FencedError as error:
            emit({"step": "complete", "outcome": "fenced", "heartbeat": heartbeat, "error": str(error)})
        else:
            emit({"step": "complete", "outcome": "completed", "heartbeat": heartbeat, "status": call.status})
    finally:
        await engine.dispose()


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.store.claimer")
    commands = parser.add_subparsers(dest="command", required=True)
    race_parser = commands.add_parser("race")
    race_parser.add_argument("database_url")
    race_parser.add_argument("--ops", required=True, help="record, claim or record,claim")
    race_parser.add_argument("--lease-seconds", type=float, default=RACE_LEASE_SECONDS)
    race_parser.add_argument("--actor", required=True)
    race_parser.add_argument("--session", required=True)
    race_parser.add_argument("--rounds", type=int, required=True)
    race_parser.add_argument("--index", type=int, required=True)
    race_parser.add_argument("--barrier", required=True)
    hold_parser = commands.add_parser("hold")
    hold_parser.add_argument("database_url")
    hold_parser.add_argument("--actor", required=True)
    hold_parser.add_argument("--session", required=True)
    hold_parser.add_argument("--lease-seconds", type=float, required=True)
    hold_parser.add_argument("--go", required=True)
    return parser.parse_args(argv)


def main(argv: list[str]) -> None:
    args = parse(argv)
    asyncio.run(race(args) if args.command == "race" else hold(args))


if __name__ == "__main__":
    main(sys.argv[1:])
