"""The audit app as the API tests drive it: tokens with full and read-only rights, settings
that carry them, and the app served in process (ASGI) with its lifespan."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI

from toolledger.settings import Settings

ALICE = "alice-full-rights-token-0123"
READER = "reader-only-token-456789abc"
TOKENS = {"alice": ALICE}
READ_TOKENS = {"auditor": READER}
FULL = {"Authorization": f"Bearer {ALICE}"}
READ = {"Authorization": f"Bearer {READER}"}


def api_settings(database_url: str, base_url: str | None = None, **overrides: Any) -> Settings:
    return Settings(
        database_url=database_url,
        openai_base_url=base_url,
        api_tokens=TOKENS,
        api_read_tokens=READ_TOKENS,
        **overrides,
    )


@contextlib.asynccontextmanager
async def serving(app: FastAPI, base_url: str = "http://testserver") -> AsyncIterator[httpx.AsyncClient]:
    """The app with its lifespan (which closes its engine and gateway), and a client for it."""
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=base_url) as client,
    ):
        yield client
