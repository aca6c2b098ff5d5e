"""A worker process for the SIGKILL tests: handles a session's pending calls, then exits.

    python -m tests.runtime.crash_worker DATABASE_URL BASE_URL SESSION_ID

TOOLLEDGER_CRASH_AT in its environment makes it kill itself at that crash point.
"""

from __future__ import annotations

import asyncio
import sys

from openai import AsyncOpenAI
from openai.types.beta.agent_session import RequiredActionSessionRequiredActionResourceFunctionCall

from tests.runtime.crash_tools import registry
from toolledger.runtime.tool_ledger import ToolLedger
from toolledger.settings import Settings

LEASE_SECONDS = 0.5


async def main(database_url: str, base_url: str, session_id: str) -> None:
    settings = Settings(
        database_url=database_url,
        openai_base_url=base_url,
        lease_seconds=LEASE_SECONDS,
        worker_id="crash-worker",
    )
    async with AsyncOpenAI(base_url=base_url, api_key="sk-test") as client:
        session = await client.beta.agents.sessions.retrieve(session_id)
    actions = [
        a
        for a in session.required_actions
        if isinstance(a, RequiredActionSessionRequiredActionResourceFunctionCall)
    ]
    async with ToolLedger(registry, settings, auto_migrate=False) as ledger:
        for action in actions:
            await ledger.handle(session_id, action)


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
