"""What every chaos run draws and counts the same way (tests/chaos/test_chaos.py, the
stream-following service; tests/chaos/test_chaos_webhooks.py, the webhook intake)."""

from __future__ import annotations

import random

from toolledger import crashpoints as cp
from toolledger.emulator import ALREADY_ANSWERED_STYLES, EmulatorServer
from toolledger.emulator.behaviour import IdempotencyKeys

# Points `serve` passes. after_approval is the approver's (the CLI's, the API's), killed there
# in tests/runtime/test_approval_crashes.py; armed in serve it would never fire.
INSIDE_POINTS = sorted(cp.ALL_POINTS - {cp.CP_DURING_RECOVERY, cp.CP_AFTER_APPROVAL})


def draw_api_behaviour(chance: random.Random, emulator: EmulatorServer) -> str:
    """This trial's API: how it refuses an answered call, whether it keeps keys, and whether
    the answers of its next submissions are lost (their retries then meet the refusal)."""
    style = chance.choice(ALREADY_ANSWERED_STYLES)
    keys: IdempotencyKeys = chance.choice(("honoured", "ignored"))
    emulator.control.set_behaviour(already_answered=style, idempotency_keys=keys)
    emulator.control.clear_faults()
    if chance.random() < 0.5:
        emulator.control.accept_then_drop(chance.randint(1, 2))
    return f"{style}/{keys}"


def refused_replays(emulator: EmulatorServer, session_ids: list[str]) -> int:
    """Posts of an answered call's request that the API refused (it had forgotten the key)."""
    ours = set(session_ids)
    answered: set[tuple[str, str, str]] = set()
    refused = 0
    for receipt in emulator.control.tool_results():
        if receipt.session_id not in ours:
            continue
        key = (receipt.session_id, receipt.turn_id, receipt.call_id)
        if receipt.outcome == "accepted":
            answered.add(key)
        elif receipt.outcome == "rejected" and key in answered:
            refused += 1
    return refused
