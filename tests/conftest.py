from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
from openai import AsyncOpenAI, OpenAI

from toolledger.emulator import EmulatorServer


@pytest.fixture(scope="session")
def emulator_server() -> Iterator[EmulatorServer]:
    with EmulatorServer() as server:
        yield server


@pytest.fixture
def emulator(emulator_server: EmulatorServer) -> Iterator[EmulatorServer]:
    """A running emulator with no sessions, scripts or faults left from another test."""
    emulator_server.control.reset()
    yield emulator_server
    emulator_server.control.reset()


@pytest.fixture
def client(emulator: EmulatorServer) -> Iterator[OpenAI]:
    """The real SDK, validating every response strictly, retrying nothing unless asked."""
    with OpenAI(
        base_url=emulator.base_url, api_key="sk-test", max_retries=0, _strict_response_validation=True
    ) as sdk:
        yield sdk


@pytest.fixture
async def async_client(emulator: EmulatorServer) -> AsyncIterator[AsyncOpenAI]:
    async with AsyncOpenAI(
        base_url=emulator.base_url, api_key="sk-test", max_retries=0, _strict_response_validation=True
    ) as sdk:
        yield sdk
