"""The audit web view in headless Chromium (Debian's, driven by Playwright; no browser
download), served by a real `toolledger api` process over a ledger filled by real
executions through the emulator: token prompt, list and filters, an API error shown, the
unknown call highlighted, its timeline, its resolution (exactly one result submitted, the
operator recorded), and hostile text shown as text."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from tests.audit import bulk_tools
from tests.audit.test_bulk_resolve import unknown_calls
from tests.support.executor_harness import pending_actions, running_ledger
from tests.support.ledger_fill import FilledLedger, fill_ledger
from tests.support.paths import ROOT
from tests.support.polling import eventually
from tests.support.shop_tools import CANARY
from tests.support.shop_tools import registry as shop_tools
from tests.support.trail_ledger import build_trail_ledger
from toolledger.domain.alerts import call_page_url
from toolledger.domain.keys import CallKey, arguments_fingerprint
from toolledger.domain.results import DENIED_PREFIX
from toolledger.emulator import EmulatorServer
from toolledger.runtime.context import ToolContext
from toolledger.runtime.registry import ToolRegistry
from toolledger.runtime.service import Service
from toolledger.settings import Settings
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


@contextlib.contextmanager
def api_process(env: dict[str, str], log_path: Path) -> Iterator[str]:
    """`toolledger api` as a process on a free port, with ``env``; yields its address."""
    log = log_path.open("w+")
    process = subprocess.Popen(
        [sys.executable, "-m", "toolledger.cli", "api", "--port", "0"],
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT)},
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


def with_tokens(database_url: str, emulator: EmulatorServer) -> dict[str, str]:
    """The environment of an API with a full and a read-only token, sending to the emulator."""
    return {
        **os.environ,
        "TOOLLEDGER_DATABASE_URL": database_url,
        "TOOLLEDGER_OPENAI_BASE_URL": emulator.base_url,
        "TOOLLEDGER_API_TOKENS": f'{{"alice": "{ALICE}"}}',
        "TOOLLEDGER_API_READ_TOKENS": f'{{"auditor": "{READER}"}}',
    }


@pytest.fixture(scope="module")
def api_url(
    ledger: FilledLedger, emulator_server: EmulatorServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """`toolledger api` over the filled ledger, with a full and a read-only token."""
    with api_process(
        with_tokens(ledger.database_url, emulator_server), tmp_path_factory.mktemp("web-api") / "api.log"
    ) as url:
        yield url


@contextlib.asynccontextmanager
async def browser_page(url: str) -> AsyncIterator[Any]:
    """Headless Chromium on the web view at ``url``; the page's script must not fail."""
    async with playwright_api.async_playwright() as playwright:
        browser = await playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=["--no-sandbox"]
        )
        try:
            page = await browser.new_page()
            page.set_default_timeout(TIMEOUT_MS)
            errors: list[str] = []
            page.on("pageerror", lambda error: errors.append(str(error)))
            await page.goto(f"{url}/ui/")
            yield page
            assert errors == [], f"the page's script failed: {errors}"
        finally:
            await browser.close()


@pytest.fixture
async def page(api_url: str) -> AsyncIterator[Any]:
    async with browser_page(api_url) as page:
        yield page


async def _use_token(page: Any, token: str) -> None:
    await page.get_by_test_id("token").fill(token)
    await page.get_by_test_id("token-save").click()


async def _rows(page: Any) -> list[dict[str, str]]:
    rows: list[dict[str, str]] = await page.eval_on_selector_all(
        "[data-testid=call-row]",
        "rows => rows.map(r => ({id: r.dataset.callId, status: r.dataset.status,"
        " tool: r.querySelector('td.tool').textContent,"
        " unknown: String(r.classList.contains('row-unknown')),"
        " approval: String(r.classList.contains('row-approval'))}))",
    )
    return rows


async def _wait_rows(page: Any, predicate: Any) -> list[dict[str, str]]:
    rows: list[dict[str, str]] = []  # the last ones seen (the predicate may want none)

    async def matched() -> bool:
        rows[:] = await _rows(page)
        return bool(predicate(rows))

    await eventually(matched, within=TIMEOUT_MS / 1000, what=lambda: repr(rows), interval=0.1)
    return rows


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


# ------------------------------------------------------------- issue 15: operator's view

SHOTS = Path(os.environ.get("TOOLLEDGER_WEB_SHOTS", Path(tempfile.gettempdir()) / "toolledger-web-shots"))
"""Where the layout test leaves its screenshots, for a person to look at."""

_ONE_LINE = """(selector) => [...document.querySelectorAll(selector)].filter((cell) => {
    const range = document.createRange();
    range.selectNodeContents(cell);
    const lines = new Set([...range.getClientRects()].map((rect) => Math.round(rect.top)));
    return lines.size > 1;
}).map((cell) => cell.textContent)"""
"""The cells of ``selector`` whose text takes more than one line."""


async def _no_horizontal_overflow(page: Any) -> None:
    widths = await page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
    assert widths[0] <= widths[1], widths


async def test_web_view__rows_stay_one_line_with_whole_ids_at_1024_and_1440(
    page: Any, ledger: FilledLedger, api_url: str
) -> None:
    await asyncio.to_thread(SHOTS.mkdir, parents=True, exist_ok=True)
    await _use_token(page, READER)
    rows = await _wait_rows(page, lambda rows: len(rows) >= 11)
    for width in (1024, 1440):
        await page.set_viewport_size({"width": width, "height": 900})
        await page.goto(f"{api_url}/ui/")
        await _wait_rows(page, lambda found: len(found) == len(rows))
        await page.get_by_test_id("counts").locator("button").first.wait_for()
        await page.screenshot(path=str(SHOTS / f"list-{width}.png"), full_page=True)
        await _no_horizontal_overflow(page)
        assert await page.evaluate(_ONE_LINE, "#rows td") == [], width
        assert await page.evaluate(_ONE_LINE, "#rows td.id") == [], width
        row_heights = await page.eval_on_selector_all(
            "[data-testid=call-row]", "rows => rows.map(r => r.getBoundingClientRect().height)"
        )
        assert max(row_heights) < 2 * min(row_heights), row_heights
        ids = await page.eval_on_selector_all("#rows td.session", "cells => cells.map(c => c.textContent)")
        assert set(ids) >= set(ledger.session_ids), "session ids are shown whole"
        table = await page.evaluate(
            "document.querySelector('[data-testid=calls]').getBoundingClientRect().width"
        )
        assert table >= 0.9 * (width - 40), ("the list uses the full width", width, table)

        # A call's detail: its heading fits, its timeline's cells are not broken mid-word,
        # and the timeline is near the top, not under the whole list.
        await page.locator(f"[data-testid=call-row][data-call-id='{rows[0]['id']}']").click()
        await page.get_by_test_id("timeline-row").first.wait_for()
        await page.screenshot(path=str(SHOTS / f"detail-{width}.png"), full_page=False)
        await _no_horizontal_overflow(page)
        heading = await page.evaluate(
            "(() => { const h = document.querySelector('#detail h2');"
            " return [h.scrollWidth, h.clientWidth]; })()"
        )
        assert heading[0] <= heading[1], heading
        assert await page.evaluate(_ONE_LINE, "#timeline-rows td:not(.reason)") == [], width
        top = await page.evaluate(
            "document.querySelector('[data-testid=timeline]').getBoundingClientRect().top + window.scrollY"
        )
        assert top < 900, top


async def test_web_view__auto_refresh_shows_a_new_call_without_a_reload(
    page: Any, ledger: FilledLedger
) -> None:
    from tests.support.calls_cli import add_unknown_call
    from toolledger.domain.keys import CallKey

    await _use_token(page, READER)
    await _wait_rows(page, lambda rows: len(rows) >= 11)
    assert await page.get_by_test_id("auto-refresh").is_checked()
    await page.get_by_test_id("refresh-every").select_option("2")
    fresh = CallKey("sess_web_refresh", "turn_1", f"call_{uuid.uuid4().hex[:12]}")
    await add_unknown_call(ledger.database_url, fresh, "charge_card", {"amount": 5})
    rows = await _wait_rows(page, lambda rows: fresh.idempotency_key in [r["id"] for r in rows])
    assert {r["status"] for r in rows if r["id"] == fresh.idempotency_key} == {"unknown"}
    counts = await page.get_by_test_id("counts").text_content()
    assert "unknown" in counts

    # Turned off, the list stays as it is.
    await page.get_by_test_id("auto-refresh").uncheck()
    later = CallKey("sess_web_refresh", "turn_2", f"call_{uuid.uuid4().hex[:12]}")
    await add_unknown_call(ledger.database_url, later, "charge_card", {"amount": 6})
    await asyncio.sleep(5)
    assert later.idempotency_key not in [r["id"] for r in await _rows(page)]


async def test_web_view__deep_links_pages_outcomes_and_sessions(
    page: Any, ledger: FilledLedger, api_url: str
) -> None:
    await _use_token(page, READER)
    rows = await _wait_rows(page, lambda rows: len(rows) >= 11)

    # A link opens the call's detail directly (the link alerts carry: domain.alerts).
    target = rows[-1]["id"]
    await page.goto(call_page_url(api_url, target))
    await playwright_api.expect(page.get_by_test_id("detail-id")).to_have_text(target)
    assert target in await page.get_by_test_id("detail-link").get_attribute("href")

    # Failures stay visible after their submission: the outcome filter finds them.
    await page.get_by_test_id("filter-outcome").select_option("failed")
    await page.get_by_test_id("apply").click()
    failed = await _wait_rows(page, lambda rows: rows and all(r["status"] == "submitted" for r in rows))
    outcomes = await page.eval_on_selector_all("#rows td.outcome", "cells => cells.map(c => c.textContent)")
    # Every row a failure; the ledger's own (2 a session, in execution) all there. Other tests
    # of this module may have added failures of their own to the shared ledger (a call
    # resolved or denied as failed), so they are not counted out.
    assert len(outcomes) == len(failed)
    assert all(outcome.startswith("failed") for outcome in outcomes), outcomes
    assert outcomes.count("failed: execution") == 2 * len(ledger.session_ids), outcomes
    await page.get_by_test_id("filter-outcome").select_option("")

    # Next and previous page (with auto-refresh off: another test's new calls would move
    # the pages).
    await page.get_by_test_id("auto-refresh").uncheck()
    await page.get_by_test_id("filter-limit").fill("4")
    await page.get_by_test_id("apply").click()
    # (The failures listed before are 4 rows too: this page is the one with a next page.)
    await page.get_by_test_id("more").wait_for()
    first = await _wait_rows(page, lambda rows: len(rows) == 4)
    await page.get_by_test_id("more").click()
    second = await _wait_rows(page, lambda rows: len(rows) == 4 and rows != first)
    assert not {r["id"] for r in second} & {r["id"] for r in first}
    await page.get_by_test_id("previous").click()
    assert await _wait_rows(page, lambda rows: rows == first)
    assert await page.get_by_test_id("previous").is_hidden()

    # The sessions page; a session opens its calls.
    await page.get_by_test_id("nav-sessions").click()
    await page.get_by_test_id("session-row").first.wait_for()
    listed = await page.eval_on_selector_all(
        "[data-testid=session-row]", "rows => rows.map(r => r.dataset.sessionId)"
    )
    assert set(listed) >= set(ledger.session_ids)
    # A session with calls a person must act on (unknown, awaiting approval) is marked; no other.
    marks = await page.eval_on_selector_all(
        "[data-testid=session-row]",
        """rows => rows.map(r => [
            r.classList.contains('needs-person'),
            r.cells[5].textContent,
        ])""",
    )
    waits = re.compile(r"\b(unknown|awaiting_approval) [1-9]")
    assert all(marked == bool(waits.search(calls)) for marked, calls in marks), marks
    # The header stays in view on a long page.
    assert await page.eval_on_selector("header", "h => getComputedStyle(h).position") == "sticky"
    # The session's id is a link to its calls.
    link = page.locator(
        f"[data-testid=session-row][data-session-id='{ledger.session_ids[0]}'] [data-testid=session-link]"
    )
    assert await link.get_attribute("href") == "#calls"
    await link.click()
    await page.get_by_test_id("filter-limit").fill("50")
    await page.get_by_test_id("apply").click()
    await _wait_rows(page, lambda rows: len(rows) == 5)


@pytest.fixture(scope="module")
def local_api_url(ledger: FilledLedger, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`toolledger api` with no token at all: loopback only, anyone on the machine."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("TOOLLEDGER_API_TOKENS", "TOOLLEDGER_API_READ_TOKENS", "TOOLLEDGER_OPENAI_BASE_URL")
    }
    env["TOOLLEDGER_DATABASE_URL"] = ledger.database_url
    with api_process(env, tmp_path_factory.mktemp("web-local-api") / "api.log") as url:
        yield url


async def test_web_view__without_tokens_the_operator_names_themselves_and_no_dead_lease_shows(
    page: Any, ledger: FilledLedger, local_api_url: str
) -> None:
    from tests.support.calls_cli import add_unknown_call
    from toolledger.domain.keys import CallKey

    stuck = CallKey("sess_web_local", "turn_1", f"call_{uuid.uuid4().hex[:12]}")
    await add_unknown_call(ledger.database_url, stuck, "charge_card", {"amount": 7})
    await page.goto(f"{local_api_url}/ui/#call={stuck.idempotency_key}")
    await playwright_api.expect(page.get_by_test_id("detail-id")).to_have_text(stuck.idempotency_key)
    assert await page.get_by_test_id("field-status").text_content() == "unknown"
    # The worker that held it is gone: it is nobody's "lease owner".
    assert await page.get_by_test_id("field-lease_owner").count() == 0

    await page.get_by_test_id("resolve-kind").select_option("error")
    await page.get_by_test_id("resolve-text").fill("not charged")
    await page.get_by_test_id("resolve-reason").fill("checked the PSP")
    await page.get_by_test_id("resolve-operator").fill("carol")
    await page.get_by_test_id("resolve-submit").click()
    await playwright_api.expect(page.get_by_test_id("resolve-result")).to_contain_text("Resolved")
    events = await page.locator("[data-testid=timeline-row]").all_text_contents()
    assert any("operator:carol" in event and "checked the PSP" in event for event in events), events


# ------------------------------------------------------------------ approval gates

REFUND_A = {"order_id": "A1", "cents": 90_000}
REFUND_B = {"order_id": "B2", "cents": 70_000}


def gated_refunds(runs: list[dict[str, Any]]) -> ToolRegistry:
    registry = ToolRegistry()

    @registry.tool(approval=True, approval_timeout=3600)
    async def refund(order_id: str, cents: int, ctx: ToolContext) -> str:
        runs.append({"order_id": order_id, "cents": cents})
        return f"refunded {cents}"

    return registry


@dataclass(frozen=True)
class ApprovalsApi:
    url: str
    database_url: str


@pytest.fixture(scope="module")
def approvals_api(
    emulator_server: EmulatorServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ApprovalsApi]:
    """`toolledger api` (no tools: `serve` runs what is approved) over a ledger of its own."""
    workdir = tmp_path_factory.mktemp("web-approvals")
    database_url = f"sqlite+aiosqlite:///{workdir / 'ledger.sqlite3'}"
    migrate.upgrade(database_url)
    with api_process(with_tokens(database_url, emulator_server), workdir / "api.log") as url:
        yield ApprovalsApi(url, database_url)


async def test_web_view__approves_a_call_shown_in_its_box_and_denies_another(
    approvals_api: ApprovalsApi, emulator_server: EmulatorServer
) -> None:
    runs: list[dict[str, Any]] = []
    session_id, actions = await pending_actions(emulator_server, [("refund", REFUND_A), ("refund", REFUND_B)])
    approved, denied = (CallKey(session_id, a.turn_id, a.call_id).idempotency_key for a in actions)
    settings = Settings(
        database_url=approvals_api.database_url,
        openai_base_url=emulator_server.base_url,
        worker_id="web-serve",
        reconcile_interval_seconds=300.0,
        decision_poll_seconds=0.2,
    )
    # `serve`, following the session: it records both calls awaiting approval, runs what is
    # approved.
    async with browser_page(approvals_api.url) as page:
        async with Service(gated_refunds(runs), settings, auto_migrate=False) as service:
            await service.watch(session_id)
            await _use_token(page, ALICE)
            await page.get_by_test_id("refresh-every").select_option("2")
            await page.get_by_test_id("filter-status").select_option("awaiting_approval")
            await page.get_by_test_id("apply").click()
            rows = await _wait_rows(page, lambda rows: len(rows) == 2)
            assert {row["id"] for row in rows} == {approved, denied}
            assert all(row["approval"] == "true" for row in rows), "calls awaiting approval are highlighted"
            assert "awaiting_approval 2" in await page.get_by_test_id("counts").text_content()

            # The call, its arguments and their fingerprint, its deadline, and the form.
            await page.locator(f"[data-testid=call-row][data-call-id='{approved}']").click()
            await playwright_api.expect(page.get_by_test_id("detail-id")).to_have_text(approved)
            form = page.get_by_test_id("approval")
            await form.wait_for(state="visible")
            assert await page.get_by_test_id("resolve").is_hidden()
            assert '"cents": 90000' in await page.get_by_test_id("detail-arguments").text_content()
            # The arguments are in the approval box itself, before its buttons: what is approved
            # is read where it is approved.
            in_box = page.get_by_test_id("approval-shown-arguments")
            assert await in_box.is_visible()
            assert '"cents": 90000' in await in_box.text_content()
            assert await page.evaluate(
                """() => {
                  const shown = document.getElementById('approval-shown-arguments');
                  const approve = document.getElementById('approval-approve');
                  return document.getElementById('approval').contains(shown)
                    && Boolean(shown.compareDocumentPosition(approve) & Node.DOCUMENT_POSITION_FOLLOWING);
                }"""
            )
            sha256 = await page.get_by_test_id("approval-sha256").text_content()
            assert sha256 == arguments_fingerprint(REFUND_A)
            assert "not approved in time" in await page.get_by_test_id("approval-deadline").text_content()
            await asyncio.to_thread(SHOTS.mkdir, parents=True, exist_ok=True)
            await page.screenshot(path=str(SHOTS / "approval.png"), full_page=True)

            # Amended arguments are checked before anything is sent.
            error = page.get_by_test_id("error")
            await page.get_by_test_id("approval-reason").fill("cap at 90 euros")
            for typed, problem in (
                ("[1, 2]", "must be a JSON object"),
                ("{not json", "are not JSON"),
                ('{"order_id": "[REDACTED]", "cents": 9000}', "a masked value"),
                (
                    '{"order_id": "A1", "cents": 9000, "note": {"url": "https://u:[REDACTED]@x"}}',
                    "a masked value",
                ),
            ):
                await page.get_by_test_id("approval-arguments").fill(typed)
                await page.get_by_test_id("approval-approve").click()
                await playwright_api.expect(error).to_contain_text(problem)
                assert "nothing was sent" in (await error.text_content()).lower()
            assert await page.get_by_test_id("field-status").text_content() == "awaiting_approval"

            # This API (`toolledger api`) has no tools to check amended arguments against: the page
            # shows the API's refusal, and nothing was decided.
            await page.get_by_test_id("approval-arguments").fill('{"order_id": "A1", "cents": 9000}')
            await page.get_by_test_id("approval-approve").click()
            await playwright_api.expect(error).to_contain_text("this process was not given the tools")
            assert "serve --api" in await error.text_content()
            assert await page.get_by_test_id("field-status").text_content() == "awaiting_approval"

            await page.get_by_test_id("approval-arguments").fill("")
            await page.get_by_test_id("approval-approve").click()
            result = page.get_by_test_id("approval-result")
            await playwright_api.expect(result).to_contain_text("Approved: `toolledger serve` runs it now")
            assert await error.is_hidden()
            # `serve` runs it within a poll; the page, refreshing, shows it answered.
            await playwright_api.expect(page.get_by_test_id("field-status")).to_have_text("submitted")
            assert await form.is_hidden()
            assert await page.get_by_test_id("field-approval_decided_by").text_content() == "alice"
            events = await page.locator("[data-testid=timeline-row]").all_text_contents()
            assert any("operator:alice" in e and "approved by alice: cap at 90 euros" in e for e in events), (
                events
            )
            assert runs == [{"order_id": "A1", "cents": 90_000}]

        # The other call, `serve` stopped (so the API sends the denial itself: with `serve`
        # following the session, whichever sends it first, the other is told it raced): a page
        # whose fingerprint is not the call's decides nothing (as if the arguments had changed
        # since it was shown); then denied with a reason.
        await page.get_by_test_id("auto-refresh").uncheck()
        await asyncio.sleep(0.5)  # a refresh already under way finishes
        await page.locator(f"[data-testid=call-row][data-call-id='{denied}']").click()
        await playwright_api.expect(page.get_by_test_id("detail-id")).to_have_text(denied)
        await form.wait_for(state="visible")
        await page.evaluate("document.getElementById('approval').dataset.sha256 = '0'.repeat(64)")
        reason = "over the limit: ask a manager"
        await page.get_by_test_id("approval-reason").fill(reason)
        await page.get_by_test_id("approval-deny").click()
        await playwright_api.expect(error).to_contain_text("look again")
        assert await page.get_by_test_id("field-status").text_content() == "awaiting_approval"
        # Refused, the page read the call again: its fingerprint is the call's once more.
        await playwright_api.expect(form).to_have_attribute("data-sha256", arguments_fingerprint(REFUND_B))

        await page.get_by_test_id("approval-deny").click()
        await playwright_api.expect(result).to_contain_text("Denied: the model has been told")
        assert await page.get_by_test_id("field-status").text_content() == "submitted"
        assert await page.get_by_test_id("field-error_stage").text_content() == "approval"
        # It never ran: it waited (for a person), it did not "take" anything.
        assert (await page.get_by_test_id("field-duration").text_content() or "").startswith("waited ")
        events = await page.locator("[data-testid=timeline-row]").all_text_contents()
        assert any("operator:alice" in e and f"denied by alice: {reason}" in e for e in events), events
        await _wait_rows(page, lambda rows: rows == [])  # nothing awaits approval any more

    assert runs == [{"order_id": "A1", "cents": 90_000}], "the approved call ran once, the denied one never"
    accepted = emulator_server.control.accepted_results(session_id)
    [approved_answer], [denial] = (accepted[(session_id, a.turn_id, a.call_id)] for a in actions)
    assert approved_answer["output"] == "refunded 90000"
    assert (denial["success"], denial["error"]) == (False, DENIED_PREFIX + reason)


# ------------------------------------------------------------------ bulk resolution


@pytest.fixture(scope="module")
def bulk_api(
    emulator_server: EmulatorServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ApprovalsApi]:
    """`toolledger api` (no tools: verified calls are skipped) over a ledger of its own."""
    workdir = tmp_path_factory.mktemp("web-bulk")
    database_url = f"sqlite+aiosqlite:///{workdir / 'ledger.sqlite3'}"
    migrate.upgrade(database_url)
    with api_process(with_tokens(database_url, emulator_server), workdir / "api.log") as url:
        yield ApprovalsApi(url, database_url)


async def test_web_view__resolves_all_matching_unknown_calls__dry_run_first_then_confirmed(
    bulk_api: ApprovalsApi, emulator_server: EmulatorServer
) -> None:
    async with running_ledger(bulk_tools.registry, bulk_api.database_url, emulator_server) as ledger:
        session_id, [charge_1, charge_2, pay] = await unknown_calls(
            ledger,
            emulator_server,
            [("charge", {"cents": 1}), ("charge", {"cents": 2}), ("pay", {"cents": 3})],
        )
        other_session, [ship] = await unknown_calls(ledger, emulator_server, [("ship", {"order": "A1"})])
    not_charged = "the provider was down: not charged"

    async with browser_page(bulk_api.url) as page:
        await _use_token(page, ALICE)
        await page.get_by_test_id("auto-refresh").uncheck()
        await _wait_rows(page, lambda rows: len(rows) == 4)
        await page.get_by_test_id("bulk-open").click()
        await page.get_by_test_id("bulk-kind").select_option("error")
        await page.get_by_test_id("bulk-text").fill(not_charged)
        await page.get_by_test_id("bulk-reason").fill("incident 42")
        await page.get_by_test_id("bulk-rate").fill("20")

        # No filter: every unknown call in the ledger is not a selection; the API's word, shown.
        error = page.get_by_test_id("error")
        await page.get_by_test_id("bulk-dry-run").click()
        await playwright_api.expect(error).to_contain_text("at least one filter besides the status")
        confirm = page.get_by_test_id("bulk-confirm")
        assert await confirm.is_hidden()

        # The session's calls: a dry run says how many and what would become of them.
        await page.get_by_test_id("filter-session_id").fill(session_id)
        await page.get_by_test_id("apply").click()
        await _wait_rows(page, lambda rows: len(rows) == 3)
        await page.get_by_test_id("bulk-dry-run").click()
        headline = page.get_by_test_id("bulk-headline")
        await playwright_api.expect(headline).to_contain_text("Dry run: 3 unknown call(s) match")
        assert await error.is_hidden()
        assert "Nothing has changed" in await headline.text_content()
        counts = await page.get_by_test_id("bulk-counts").locator("li").all_text_contents()
        assert [c.split(" (")[0] for c in counts] == [
            "would_resolve: 2",
            "would_skip_verify_hook_unavailable: 1",
        ]
        await playwright_api.expect(confirm).to_have_text("Resolve these 3 call(s) by error")
        assert emulator_server.control.tool_results(session_id) == []
        assert {row["status"] for row in await _rows(page)} == {"unknown"}
        await asyncio.to_thread(SHOTS.mkdir, parents=True, exist_ok=True)
        await page.screenshot(path=str(SHOTS / "bulk-dry-run.png"), full_page=True)

        # What the dry run showed is what is confirmed: a changed resolution needs another one.
        await page.get_by_test_id("bulk-reason").fill("incident 42, confirmed")
        assert await confirm.is_hidden()
        await page.get_by_test_id("bulk-dry-run").click()
        await playwright_api.expect(confirm).to_be_visible()

        await confirm.click()
        await playwright_api.expect(headline).to_contain_text("Done (bulk ")
        counts = await page.get_by_test_id("bulk-counts").locator("li").all_text_contents()
        assert [c.split(" (")[0] for c in counts] == ["skipped_verify_hook_unavailable: 1", "submitted: 2"]
        assert await confirm.is_hidden()
        rows = await _wait_rows(page, lambda rows: sum(r["status"] == "submitted" for r in rows) == 2)
        assert {r["id"]: r["status"] for r in rows} == {
            charge_1.idempotency_key: "submitted",
            charge_2.idempotency_key: "submitted",
            pay.idempotency_key: "unknown",
        }
        await page.screenshot(path=str(SHOTS / "bulk-done.png"), full_page=True)

        # Each call's timeline: the operator (the token's name), the reason and the run.
        await page.locator(f"[data-testid=call-row][data-call-id='{charge_1.idempotency_key}']").click()
        await playwright_api.expect(page.get_by_test_id("field-status")).to_have_text("submitted")
        events = await page.locator("[data-testid=timeline-row]").all_text_contents()
        assert any("operator:alice" in e and "incident 42, confirmed (bulk " in e for e in events), events

    received = {r.payload["call_id"]: r.payload for r in emulator_server.control.tool_results(session_id)}
    assert set(received) == {charge_1.call_id, charge_2.call_id}
    assert all(payload["error"] == not_charged for payload in received.values())
    assert emulator_server.control.tool_results(other_session) == []
    assert ship.session_id == other_session


# ------------------------------------------------------ issue 31: content off its trail


async def test_web_view__a_call_whose_content_was_changed_by_sql__says_so_above_its_fields(
    tmp_path: Path,
) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'ledger.sqlite3'}"
    migrate.upgrade(url)
    trail = await asyncio.to_thread(build_trail_ledger, url, 2)
    forged, untouched = trail.keys
    with trail.tampering() as sql:
        sql.execute(
            text("UPDATE tool_calls SET result = :forged WHERE call_id = :call"),
            {
                "forged": '{"type": "function_call_output", "output": "refund approved"}',
                "call": forged.call_id,
            },
        )
    env = {
        **os.environ,
        "TOOLLEDGER_DATABASE_URL": url,
        "TOOLLEDGER_API_READ_TOKENS": f'{{"auditor": "{READER}"}}',
    }
    env.pop("TOOLLEDGER_API_TOKENS", None)
    with api_process(env, tmp_path / "api.log") as api:
        async with browser_page(api) as page:
            await _use_token(page, READER)
            await page.goto(call_page_url(api, forged.idempotency_key))
            banner = page.get_by_test_id("detail-trail")
            await playwright_api.expect(banner).to_be_visible()
            await playwright_api.expect(banner).to_contain_text("Trail BROKEN: the call's stored content (")
            await playwright_api.expect(banner).to_contain_text("NOT what the call's trail recorded")
            await _no_horizontal_overflow(page)
            await page.goto(call_page_url(api, untouched.idempotency_key))
            await playwright_api.expect(page.get_by_test_id("detail-id")).to_have_text(
                untouched.idempotency_key
            )
            await playwright_api.expect(banner).to_be_hidden()


# ------------------------------------------------------------------ the intake


INTAKE_AGENTS = "agent_billing,agent_support"
HOSTILE_SESSION = 'sess_<b id="pwn">x</b>'
"""A webhook's data.id is the sender's text: shown as text, like every ledger value."""


async def _intake_ledger(url: str) -> None:
    """What the intake writes, through its own stores: two sessions found by a sweep (one
    looked at now), one brought by a webhook (sent twice), one registered; each agent's sweep
    run once (one failed); two live replicas' counts."""
    from toolledger.store.engine import create_engine
    from toolledger.store.intake import IntakeStore
    from toolledger.store.sessions import SessionStore

    engine = create_engine(url)
    try:
        sessions, intake = SessionStore(engine), IntakeStore(engine)
        await sessions.request_looks(["sess_swept"], intake="sweep", agent_id="agent_billing")
        await intake.take_webhook("wh_1", "agent.session.requires_action", HOSTILE_SESSION, look=True)
        await intake.take_webhook("wh_1", "agent.session.requires_action", HOSTILE_SESSION, look=True)
        await sessions.watch("sess_registered")
        (held,) = await sessions.claim_looks("replica_a", 1, lease_seconds=3600)
        assert held.session_id == "sess_swept"
        billing = await intake.claim_sweep("agent_billing", "replica_a", every_seconds=0, lease_seconds=60)
        support = await intake.claim_sweep("agent_support", "replica_b", every_seconds=0, lease_seconds=60)
        assert billing is not None
        assert support is not None
        await intake.finish_sweep(billing, "replica_a", watermark=1_767_225_600, found=1)
        await intake.finish_sweep(support, "replica_b", watermark=None, found=0, error=HOSTILE)
        for replica, counts in (
            ("replica_a", {"webhook_accepted": 3, "webhook_refused_bad_signature": 2}),
            ("replica_b", {"webhook_accepted": 1, "webhook_duplicate": 1}),
        ):
            await sessions.heartbeat_replica(
                replica, hostname="web-test", pid=1, lease_seconds=3600, intake_counts=counts
            )
    finally:
        await engine.dispose()


async def test_web_view__the_sessions_page_shows_the_intake_and_how_each_session_came(
    tmp_path: Path,
) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'ledger.sqlite3'}"
    migrate.upgrade(url)
    await _intake_ledger(url)
    env = {
        **os.environ,
        "TOOLLEDGER_DATABASE_URL": url,
        "TOOLLEDGER_API_READ_TOKENS": f'{{"auditor": "{READER}"}}',
        "TOOLLEDGER_AGENT_IDS": INTAKE_AGENTS,
        "TOOLLEDGER_LISTEN": "127.0.0.1:8780",
    }
    env.pop("TOOLLEDGER_API_TOKENS", None)
    with api_process(env, tmp_path / "api.log") as api:
        async with browser_page(api) as page:
            await _use_token(page, READER)
            await page.get_by_test_id("nav-sessions").click()
            box = page.get_by_test_id("intake")
            await playwright_api.expect(box).to_be_visible()
            expect_text = playwright_api.expect
            await expect_text(page.get_by_test_id("intake-modes")).to_have_text("watch + agents + webhooks")
            await expect_text(page.get_by_test_id("intake-agents")).to_have_text(
                "agent_billing, agent_support"
            )
            await expect_text(page.get_by_test_id("intake-looks")).to_contain_text("1 due; 2 session(s)")
            webhooks = page.get_by_test_id("intake-webhooks")
            await expect_text(webhooks).to_contain_text("accepted 4, duplicate 1")
            await expect_text(webhooks).to_contain_text("refused: bad_signature 2")
            await expect_text(webhooks).to_contain_text("1 id(s) kept")
            sweeps = page.get_by_test_id("intake-sweep")
            await expect_text(sweeps).to_have_count(2)
            billing = sweeps.and_(page.locator("[data-agent-id=agent_billing]"))
            await expect_text(billing).to_contain_text("s ago, found 1, watermark 2026-01-01 00:00:00 UTC")
            support = sweeps.and_(page.locator("[data-agent-id=agent_support]"))
            await expect_text(support).to_contain_text("last run ")
            await expect_text(support.get_by_test_id("intake-sweep-error")).to_contain_text(HOSTILE)

            # The Came-by column and the agent, one row each.
            await page.get_by_test_id("session-row").first.wait_for()
            came = await page.eval_on_selector_all(
                "[data-testid=session-row]",
                """rows => Object.fromEntries(rows.map(r => [r.dataset.sessionId, [
                    r.querySelector('[data-testid=came-by]').dataset.cameBy,
                    r.querySelector('[data-testid=agent-id]').textContent,
                    Boolean(r.querySelector('[data-testid=looking]')),
                ]]))""",
            )
            assert came == {
                "sess_swept": ["sweep", "agent_billing", True],
                HOSTILE_SESSION: ["webhook", "", False],
                "sess_registered": ["watched", "", False],
            }
            # Markup in a session id or an error is text: nothing of it became an element.
            assert await page.locator("#pwn").count() == 0
            assert await page.evaluate("window.__pwned") is None
