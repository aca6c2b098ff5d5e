"""Running tools through a real ToolLedger against the emulator, over HTTP with the real SDK."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from openai import AsyncOpenAI
from openai.types.beta.agent_session import RequiredActionSessionRequiredActionResourceFunctionCall

from toolledger.emulator import EmulatorServer, Script
from toolledger.runtime.registry import ToolRegistry
from toolledger.runtime.tool_ledger import ToolLedger
from toolledger.settings import Settings

FunctionCallAction = RequiredActionSessionRequiredActionResourceFunctionCall


@asynccontextmanager
async def running_ledger(
    registry: ToolRegistry, database_url: str, emulator: EmulatorServer, **settings: Any
) -> AsyncIterator[ToolLedger]:
    config = Settings(
        database_url=database_url, openai_base_url=emulator.base_url, worker_id="test-worker", **settings
    )
    async with ToolLedger(registry, config, auto_migrate=False) as ledger:
        yield ledger


async def pending_actions(
    emulator: EmulatorServer, *steps: list[tuple[str, Any]]
) -> tuple[str, list[FunctionCallAction]]:
    """A new session whose first step's calls are pending."""
    async with AsyncOpenAI(base_url=emulator.base_url, api_key="sk-test") as client:
        session = await client.beta.agents.sessions.create(
            environment={"type": "none"},
            agent={"model": "emulated"},
            metadata={"emulator_script": Script.of_calls(*steps).model_dump_json()},
            input="go",
        )
        return session.id, await wait_for_actions(client, session.id)


async def wait_for_actions(client: AsyncOpenAI, session_id: str) -> list[FunctionCallAction]:
    async with asyncio.timeout(5.0):
        while True:
            session = await client.beta.agents.sessions.retrieve(session_id)
            actions = [a for a in session.required_actions if isinstance(a, FunctionCallAction)]
            if actions:
                return actions
            await asyncio.sleep(0.01)


async def current_actions(emulator: EmulatorServer, session_id: str) -> list[FunctionCallAction]:
    async with AsyncOpenAI(base_url=emulator.base_url, api_key="sk-test") as client:
        session = await client.beta.agents.sessions.retrieve(session_id)
        return [a for a in session.required_actions if isinstance(a, FunctionCallAction)]
