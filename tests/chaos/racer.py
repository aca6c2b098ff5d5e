"""A worker that races others over the same sessions: it answers every listed function call
of every session through its own ToolLedger, as fast as it can, until all are idle.

    python -m tests.chaos.racer DATABASE_URL BASE_URL SESSION_ID...
"""

from __future__ import annotations

import asyncio
import sys
import time

from openai import AsyncOpenAI
from openai.types.beta.agent_session import RequiredActionSessionRequiredActionResourceFunctionCall

from tests.support.service_tools import registry
from toolledger.runtime.tool_ledger import ToolLedger
from toolledger.settings import Settings

FunctionCallAction = RequiredActionSessionRequiredActionResourceFunctionCall
GIVE_UP_AFTER = 60.0


async def main(database_url: str, base_url: str, session_ids: list[str]) -> None:
    settings = Settings(database_url=database_url, openai_base_url=base_url, lease_seconds=2.0)
    deadline = time.monotonic() + GIVE_UP_AFTER
    async with (
        AsyncOpenAI(base_url=base_url, api_key="sk-test") as client,
        ToolLedger(registry, settings, auto_migrate=False) as ledger,
    ):
        while time.monotonic() < deadline:
            sessions = await asyncio.gather(*(client.beta.agents.sessions.retrieve(s) for s in session_ids))
            busy = [s for s in sessions if s.status != "idle"]
            if not busy:
                return
            await asyncio.gather(
                *(
                    ledger.handle(session.id, action)
                    for session in busy
                    for action in session.required_actions
                    if isinstance(action, FunctionCallAction)
                )
            )
            await asyncio.sleep(0.02)
    raise SystemExit("sessions still busy when the racer gave up")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3:]))
