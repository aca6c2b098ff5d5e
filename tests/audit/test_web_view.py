"""The audit web view in headless Chromium (Debian's, driven by Playwright; no browser
download), served by a real `toolledger api` process over a ledger filled by real
executions through the emulator: token prompt, list and filters, an API error shown, the
unknown call highlighted, its timeline, its resolution (exactly one result submitted, the
operator recorded), and hostile text shown as text."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.audit.ledger_fill import ROOT, FilledLedger, fill_ledger
from tests.audit.tools import CANARY
from tests.audit.tools import registry as shop_tools
from tests.ledger.executor_harness import pending_actions, running_ledger
from toolledger.emulator import EmulatorServer
from toolledger.store import migrate

CHROMIUM = Path("/usr/bin/chromium")
if not CHROMIUM.exists():
    pytest.skip("Debian's chromium is not installed (/usr/bin/chromium)", allow_module_level=True)
playwright_api = pytest.importorskip("playwright.async_api")

ALICE = "alice-web-view-token-0123456"
READER = "reader-web-view-token-9876543"
HOSTILE = '<img src=x onerror="window.__pwned=1">'
TIMEOUT_MS = 15_000


@pytest.fixture(scope="module")
def ledger(emulator_server: EmulatorServer, tmp_path_factory: pytest.TempPathFactory) -> FilledLedger:
    workdir = tmp_path_factory.mktemp("web-view")
    url = f"sqlite+aiosqlite:///{workdir / 'ledger.sqlite3'}"
    migrate.upgrade(url)
    filled = asyncio.run(fill_ledger(url, emulator_server, workdir, sessions=2))
    asyncio.run(_hostile_call(url, emulator_server))
    return filled


async def _hostile_call(database_url: str, emulator: EmulatorServer) -> None:
    """A real execution whose arguments are markup that would run if parsed as HTML."""
    session_id, actions = await pending_actions(emulator, [("lookup_order", {"order_id": HOSTILE})])
    async with running_ledger(shop_tools, database_url, emulator) as running:
        for action in actions:
            await running.handle(session_id, action)


@pytest.fixture(scope="module")
def api_url(
    ledger: FilledLedger, emulator_server: EmulatorServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """`toolledger api` as a process, on a free port, with a full and a read-only token."""
    log = (tmp_path_factory.mktemp("web-api") / "api.log").open("w+")
    env = {
        **os.environ,
        "TOOLLEDGER_DATABASE_URL": ledger.database_url,
        "TOOLLEDGER_OPENAI_BASE_URL": emulator_server.base_url,
        "TOOLLEDGER_API_TOKENS": f'{{"alice": "{ALICE}"}}',
        "TOOLLEDGER_API_READ_TOKENS": f'{{"auditor": "{READER}"}}',
        "PYTHONPATH": str(ROOT),
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "toolledger.cli", "api", "--port", "0"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        match = re.search(r"audit API: (http://\S+)", line)
        assert match, f"no address in {line!r}; log: {log.seek(0) or log.read()}"
        yield match.group(1)
    finally:
        process.terminate()
        process.wait(timeout=20)
        log.close()


@pytest.fixture
async def page(api_url: str) -> AsyncIterator[Any]:
    async with playwright_api.async_playwright() as playwright:
        browser = await playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=["--no-sandbox"]
        )
        try:
            page = await browser.new_page()
            page.set_default_timeout(TIMEOUT_MS)
            errors: list[str] = []
            page.on("pageerror", lambda error: errors.append(str(error)))
            await page.goto(f"{api_url}/ui/")
            yield page
            assert errors == [], f"the page's script failed: {errors}"
        finally:
            await browser.close()


async def _use_token(page: Any, token: str) -> None:
    await page.get_by_test_id("token").fill(token)
    await page.get_by_test_id("token-save").click()


async def _rows(page: Any) -> list[dict[str, str]]:
    rows: list[dict[str, str]] = await page.eval_on_selector_all(
        "[data-testid=call-row]",
        "rows => rows.map(r => ({id: r.dataset.callId, status: r.dataset.status,"
        " tool: r.querySelector('td.tool').textContent,"
        " unknown: String(r.classList.contains('row-unknown'))}))",
    )
    return rows


async def _wait_rows(page: Any, predicate: Any) -> list[dict[str, str]]:
    deadline = asyncio.get_running_loop().time() + TIMEOUT_MS / 1000
    while True:
        rows = await _rows(page)
        if predicate(rows):
            return rows
        assert asyncio.get_running_loop().time() < deadline, rows
        await asyncio.sleep(0.1)


async def test_web_view__lists_filters_opens_and_resolves_an_unknown_call(
    page: Any, ledger: FilledLedger, emulator_server: EmulatorServer
) -> None:
    # No token: the API refuses, and the page says so instead of showing an empty list.
    error = page.get_by_test_id("error")
    await error.wait_for(state="visible")
    assert "401" in await error.text_content()
    assert await _rows(page) == []

    await _use_token(page, READER)
    rows = await _wait_rows(page, lambda rows: len(rows) >= 11)
    assert await error.is_hidden()
    assert {row["tool"] for row in rows} >= {"charge_card", "lookup_order", "send_receipt"}
    unknown = [row for row in rows if row["status"] == "unknown"]
    assert len(unknown) == 1
    assert unknown[0]["unknown"] == "true", "the unknown call is highlighted"
    assert all(row["unknown"] == "false" for row in rows if row["status"] != "unknown")
    assert CANARY not in await page.content(), "secret fields are masked in the list"

    # A filter narrows the list (the API does the filtering).
    await page.get_by_test_id("filter-tool").fill("send_receipt")
    await page.get_by_test_id("apply").click()
    narrowed = await _wait_rows(page, lambda rows: rows and all(r["tool"] == "send_receipt" for r in rows))
    assert len(narrowed) == 2

    # A bad filter: the API's own message, shown.
    await page.get_by_test_id("filter-tool").fill("")
    await page.get_by_test_id("filter-since").fill("not-a-date")
    await page.get_by_test_id("apply").click()
    await error.wait_for(state="visible")
    assert "invalid time 'not-a-date'" in await error.text_content()
    await page.get_by_test_id("filter-since").fill("")
    await page.get_by_test_id("filter-unknown_only").check()
    await page.get_by_test_id("apply").click()
    (only,) = await _wait_rows(page, lambda rows: len(rows) == 1)
    assert only["status"] == "unknown"

    # The unknown call's timeline, with the resolve form; the read-only token may not resolve.
    await page.locator("[data-testid=call-row].row-unknown").click()
    await page.get_by_test_id("detail").wait_for(state="visible")
    assert await page.get_by_test_id("detail-id").text_content() == only["id"]
    events = await page.locator("[data-testid=timeline-row]").all_text_contents()
    assert any("recorded" in event or "claimed" in event for event in events), events
    assert "[REDACTED]" in await page.get_by_test_id("detail-arguments").text_content()
    resolve = page.get_by_test_id("resolve")
    await resolve.wait_for(state="visible")
    await page.get_by_test_id("resolve-text").fill('{"charged": 99, "checked": "by phone"}')
    await page.get_by_test_id("resolve-reason").fill("bank confirmed it")
    await page.get_by_test_id("resolve-submit").click()
    await error.wait_for(state="visible")
    assert "403" in await error.text_content()
    assert emulator_server.control.tool_results(ledger.unknown_session) == []

    # With the full token: one result submitted, the operator and reason on the record.
    await _use_token(page, ALICE)
    await page.locator("[data-testid=call-row].row-unknown").click()
    await resolve.wait_for(state="visible")
    await page.get_by_test_id("resolve-text").fill('{"charged": 99, "checked": "by phone"}')
    await page.get_by_test_id("resolve-reason").fill("bank confirmed it")
    await page.get_by_test_id("resolve-submit").click()
    result = page.get_by_test_id("resolve-result")
    await playwright_api.expect(result).to_contain_text("submitted", timeout=TIMEOUT_MS)
    assert "now submitted" in await result.text_content()
    assert await resolve.is_hidden()
    assert await page.get_by_test_id("field-status").text_content() == "submitted"
    events = await page.locator("[data-testid=timeline-row]").all_text_contents()
    assert any("alice" in event and "bank confirmed it" in event for event in events), events

    received = emulator_server.control.tool_results(ledger.unknown_session)
    assert len(received) == 1
    assert received[0].payload["output"] == '{"charged": 99, "checked": "by phone"}'
    await _wait_rows(page, lambda rows: rows == [])  # only-unknown: nothing left to settle


async def test_web_view__hostile_text_in_arguments_is_shown_as_text(page: Any, ledger: FilledLedger) -> None:
    await _use_token(page, READER)
    await page.get_by_test_id("filter-tool").fill("lookup_order")
    await page.get_by_test_id("apply").click()
    rows = await _wait_rows(page, lambda rows: len(rows) >= 1)
    for row in rows:
        await page.locator(f"[data-testid=call-row][data-call-id='{row['id']}']").click()
        await page.get_by_test_id("detail-id").wait_for(state="visible")
        await playwright_api.expect(page.get_by_test_id("detail-id")).to_have_text(row["id"])
        # Shown as JSON: the markup's own quotes escaped, its tags as typed.
        if "<img src=x onerror=" in await page.get_by_test_id("detail-arguments").text_content():
            break
    else:
        raise AssertionError("the hostile call is not listed")
    assert await page.locator("img").count() == 0
    assert await page.evaluate("window.__pwned") is None
