"""The audit API's and `toolledger calls`' edge cases: filter values past what a parser
takes, forged cursors, oversized bodies, resolving with no Agents API configured, search
beyond ASCII, the docs page, and a closed /metrics. Each runs on SQLite and PostgreSQL where
a database is involved, through real requests to the app (in process, ASGI) and the real
command (click), against real ledgers.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import re
import time
from collections.abc import AsyncIterator
from html.parser import HTMLParser
from typing import Any

import httpx
import pytest
from click.testing import CliRunner, Result
from fastapi.routing import APIRoute
from pydantic import SecretStr

from tests.support.api_server import (
    ALICE,
    FULL,
    READ,
    READ_TOKENS,
    READER,
    TOKENS,
    api_settings,
    serving,
)
from tests.support.calls_cli import add_unknown_call, cli
from tests.support.polling import eventually
from tests.support.shop_tools import registry as shop_tools
from toolledger.audit.api import MAX_BODY_DEPTH, _StrictJsonRoute, create_app
from toolledger.audit.auth import ApiConfigurationError
from toolledger.audit.service import ResolveAction
from toolledger.cli import main
from toolledger.cli.calls import RESOLVE_MESSAGES
from toolledger.domain.keys import CallKey, arguments_fingerprint
from toolledger.domain.queries import Cursor
from toolledger.domain.states import EffectClass
from toolledger.emulator import EmulatorServer
from toolledger.settings import Settings
from toolledger.store.engine import create_engine
from toolledger.store.ledger import LedgerStore

BEYOND_INT_PARSING = "9" * 4301 + "h"
"""A duration whose number int() refuses to parse (Python limits it to 4,300 digits)."""
SCRAPER = "metrics-scraper-token-0123456789"
CHARGE = {"amount": 1, "card_number": "4242"}
"""Arguments of an unknown ``charge_card`` call (tests.support.shop_tools)."""


def b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


FORGED_CURSORS: list[tuple[str, dict[str, str]]] = [
    ("deeply nested JSON", {"cursor": b64(b"[" * 3000)}),
    ("deeply nested JSON, closed", {"cursor": b64(b"[" * 3000 + b"]" * 3000)}),
    ("a lone surrogate", {"cursor": b64(json.dumps(["x", "\ud800", "t", "c"]).encode()), "sort": "tool"}),
    ("a lone surrogate in the key", {"cursor": b64(json.dumps([None, "s", "\udfff", "c"]).encode())}),
    ("another spelling", {"cursor": b64(b'["x", "s", "t", "c"]'), "sort": "tool"}),
    ("bytes outside base64", {"cursor": Cursor("x", CallKey("s", "t", "c")).encode() + "!*", "sort": "tool"}),
    ("too long to be one", {"cursor": "A" * 20_000}),
]


def refused_in_one_line(result: Result) -> str:
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1, result.stderr
    assert len(lines[0]) < 400, "the reason is one short line, not the value echoed back"
    return lines[0]


@pytest.fixture
async def client(database_url: str) -> AsyncIterator[httpx.AsyncClient]:
    async with serving(create_app(api_settings(database_url))) as client:
        yield client


def server_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR]


# ------------------------------------------------------------------- 1: filter values


async def test_bad_filter_values__400_with_one_line_and_nothing_logged_as_an_error(
    client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    for params in (
        {"since": BEYOND_INT_PARSING},
        {"until": BEYOND_INT_PARSING},
        {"since": "0" * 10_000 + "1h"},
        {"since": "1" * 5_000},
        {"until": "2026-12-01T09:00:00" + "0" * 10_000},
        {"since": "100001h"},
        {"since": "yesterday"},
        {"status": "exploded"},
        {"sort": "-price"},
        {"limit": "0"},
        {"limit": "many"},
        {"limit": "9" * 5000},
        {"unknown_only": "perhaps"},
        {"q": "x" * 201},
        {"cursor": "not-a-cursor"},
    ):
        response = await client.get("/api/calls", params=params, headers=READ)
        assert response.status_code == 400, (str(params)[:80], response.status_code, response.text[:200])
        detail = response.json()["detail"]
        assert isinstance(detail, str)
        assert detail
        assert len(detail) <= 503
    assert server_errors(caplog) == []
    leading_zeros = await client.get("/api/calls", params={"since": "0" * 60 + "2h"}, headers=READ)
    assert leading_zeros.status_code == 200


def test_cli__a_duration_beyond_int_parsing_exits_2_in_one_line(database_url: str) -> None:
    for option in ("--since", "--until"):
        line = refused_in_one_line(cli(database_url, "list", option, BEYOND_INT_PARSING))
        assert "too long" in line
        assert option in line
    line = refused_in_one_line(cli(database_url, "export", "--since", BEYOND_INT_PARSING))
    assert "too long" in line


# ------------------------------------------------------------------- 2: forged cursors


async def test_forged_cursors__400(client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture) -> None:
    for what, params in FORGED_CURSORS:
        response = await client.get("/api/calls", params=params, headers=READ)
        assert response.status_code == 400, (what, response.status_code, response.text[:200])
        assert "invalid cursor" in response.json()["detail"], what
    assert server_errors(caplog) == []
    # The server's own cursors still work, whatever their text holds.
    real = Cursor("\U0001f642" * 255, CallKey("\x01" * 255, "t" * 255, "é" * 255)).encode()
    page = await client.get("/api/calls", params={"cursor": real, "sort": "tool"}, headers=READ)
    assert page.status_code == 200, page.text


def test_cli__forged_cursors_exit_2_in_one_line(database_url: str) -> None:
    for what, params in FORGED_CURSORS:
        args = ["list", "--cursor", params["cursor"]]
        if "sort" in params:
            args += ["--sort", params["sort"]]
        line = refused_in_one_line(cli(database_url, *args))
        assert "invalid cursor" in line, what


async def test_bodies_with_a_lone_surrogate__400_and_nothing_recorded(database_url: str) -> None:
    """JSON can spell a lone surrogate; the text it makes can be neither stored nor sent on."""
    key = CallKey("sess_surrogate", "turn_1", "call_1")
    await add_unknown_call(database_url, key, "charge_card", CHARGE)
    async with serving(create_app(api_settings(database_url))) as client:
        for field, body in (
            ("text", '{"kind": "output", "text": "\\ud800", "reason": "seen"}'),
            ("reason", '{"kind": "error", "text": "no", "reason": "\\udfff"}'),
        ):
            response = await client.post(
                f"/api/calls/{key}/resolve",
                content=body.encode(),
                headers={**FULL, "Content-Type": "application/json"},
            )
            assert response.status_code == 400, (body, response.text)
            assert field in response.json()["detail"]
        shown = await client.get(f"/api/calls/{key}", headers=READ)
        assert shown.json()["call"]["status"] == "unknown", "nothing was recorded"
        await client.post("/api/sessions/sess_surrogate/watch", headers=FULL)
        unwatch = await client.post(
            "/api/sessions/sess_surrogate/unwatch",
            content=b'{"reason": "\\ud83d"}',
            headers={**FULL, "Content-Type": "application/json"},
        )
        assert unwatch.status_code == 400, unwatch.text
        assert (await client.get("/api/sessions/sess_surrogate", headers=READ)).json()["watched"] is True


# ------------------------------------------------------------------- 3: a body too large


async def test_body_over_64_kib__413_without_a_token_and_no_error_logged(
    sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    app = create_app(api_settings(sqlite_url))
    huge = json.dumps({"kind": "output", "text": "x" * (70 * 1024), "reason": "r"}).encode()

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(70):
            yield b"x" * 1024

    caplog.set_level(logging.DEBUG)
    async with serving(app) as client:
        for headers in ({}, FULL):
            sized = await client.post(
                "/api/calls/tl_0123456789abcdef/resolve",
                content=huge,
                headers={**headers, "Content-Type": "application/json"},
            )
            assert sized.status_code == 413, sized.text
            assert "64 KiB" in sized.json()["detail"]
            streamed = await client.post(
                "/api/sessions/sess_x/unwatch",
                content=chunks(),
                headers={**headers, "Content-Type": "application/json"},
            )
            assert streamed.status_code == 413, streamed.text
            assert "64 KiB" in streamed.json()["detail"]
    assert server_errors(caplog) == []
    assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]


# ------------------------------------------------- 4: resolving with no Agents API here


@pytest.mark.parametrize("blank", [None, ""], ids=["unset", "empty"])
async def test_resolve__with_no_agents_api_configured_nothing_is_sent(
    database_url: str, blank: str | None
) -> None:
    key = CallKey("sess_nowhere", "turn_1", "call_1")
    await add_unknown_call(database_url, key, "charge_card", CHARGE)
    settings = Settings(
        database_url=database_url,
        api_tokens=TOKENS,
        openai_api_key=blank,
        openai_base_url=blank,
    )
    app = create_app(settings)
    assert app.state.api.service.gateway is None, "no gateway to anywhere that was not configured"
    async with serving(app) as client:
        started = time.monotonic()
        response = await client.post(
            f"/api/calls/{key}/resolve",
            json={"kind": "output", "text": '{"charged": 1}', "reason": "seen at the PSP"},
            headers=FULL,
        )
        elapsed = time.monotonic() - started
    assert response.status_code == 200, response.text
    assert response.json()["action"] == "not_sent"
    assert response.json()["call"]["status"] == "succeeded"
    assert response.json()["call"]["submissions"] == 0
    assert elapsed < 3, "nothing was tried"


def test_cli_resolve__a_blank_key_and_address_are_not_an_agents_api(database_url: str) -> None:
    key = CallKey("sess_blank", "turn_1", "call_1")
    asyncio.run(add_unknown_call(database_url, key, "charge_card", CHARGE))
    result = cli(
        database_url,
        "resolve",
        str(key),
        "--output",
        '{"charged": 1}',
        "--reason",
        "seen at the PSP",
        "--json",
        env={"TOOLLEDGER_OPENAI_API_KEY": "", "TOOLLEDGER_OPENAI_BASE_URL": ""},
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["action"] == "not_sent"
    assert report["call"]["status"] == "succeeded"
    assert report["call"]["submissions"] == 0


async def test_resolve_rerun__a_session_that_no_longer_awaits_the_call__told_as_abandoned(
    database_url: str, emulator: EmulatorServer
) -> None:
    """A re-run whose result the session no longer takes is one of the answers the API
    documents (it used to pass the executor's own word, `executed`, and fail with a 500)."""
    key = CallKey("sess_gone_from_the_api", "turn_1", "call_api")
    await add_unknown_call(database_url, key, "charge_card", CHARGE)
    app = create_app(api_settings(database_url, emulator.base_url), registry=shop_tools)
    async with serving(app) as client:
        body = {"kind": "rerun", "reason": "the PSP has no record of it"}
        response = await client.post(f"/api/calls/{key}/resolve", json=body, headers=FULL)
        assert response.status_code == 202, response.text
        assert response.json()["action"] == "rerunning"

        async def ended() -> dict[str, Any] | None:
            call: dict[str, Any] = (await client.get(f"/api/calls/{key}", headers=FULL)).json()["call"]
            return call if call["status"] in ("submitted", "abandoned", "unknown") else None

        call = await eventually(ended, within=30, what="the re-run call ended")
    assert call["status"] == "abandoned"
    assert call["attempts"] == 2, "the handler ran again here"

    cli_key = CallKey("sess_gone_from_the_api", "turn_1", "call_cli")
    await add_unknown_call(database_url, cli_key, "charge_card", CHARGE)
    result = await asyncio.to_thread(
        cli,
        database_url,
        "resolve",
        str(cli_key),
        "--rerun",
        "--reason",
        "the PSP has no record of it",
        "--tools",
        "tests.support.shop_tools:registry",
        env={"TOOLLEDGER_OPENAI_BASE_URL": emulator.base_url},
    )
    assert result.exit_code == 0, result.output
    assert "the session no longer awaits it" in result.stdout
    assert "action: abandoned; status: abandoned" in result.stdout


def test_resolve_actions__each_has_its_message_in_the_cli() -> None:
    assert set(RESOLVE_MESSAGES) == {action.value for action in ResolveAction}


# ------------------------------------------------------ 5: case folding beyond ASCII


NAMES = ["CAFÉ_Tool", "straße_tool", "ΣΊΣΥΦΟΣ_tool", "plain_tool", "ÅNGSTRÖM"]
SEARCHES = {
    "café": {"CAFÉ_Tool"},
    "CAFÉ": {"CAFÉ_Tool"},
    "Café_": {"CAFÉ_Tool"},
    "STRASSE": set(),
    "STRAẞE": {"straße_tool"},
    # Letter by letter, as PostgreSQL folds (Python's lower() would end the word in ς).
    "ΣΊΣΥΦΟΣ": {"ΣΊΣΥΦΟΣ_tool"},
    "σίσυφοσ": {"ΣΊΣΥΦΟΣ_tool"},
    "İ": {"plain_tool"},  # İ folds to i, one letter for one
    "ångström": {"ÅNGSTRÖM"},
    "sess_é": set(NAMES),
    "_TOOL": {"CAFÉ_Tool", "straße_tool", "ΣΊΣΥΦΟΣ_tool", "plain_tool"},
}
"""What a search finds among calls of the tools NAMES (sessions sess_É0, sess_É1, ...)."""


async def record_named_calls(url: str) -> None:
    engine = create_engine(url)
    try:
        store = LedgerStore(engine, actor="edge-test")
        for number, name in enumerate(NAMES):
            await store.record(
                CallKey(f"sess_É{number}", "turn_1", f"call_{number}"),
                tool_name=name,
                arguments={},
                effect_class=EffectClass.READ_ONLY,
                lease_seconds=30,
            )
    finally:
        await engine.dispose()


async def test_search__folds_case_beyond_ascii_on_both_databases(database_url: str) -> None:
    await record_named_calls(database_url)
    async with serving(create_app(api_settings(database_url))) as client:
        for text, expected in SEARCHES.items():
            response = await client.get("/api/calls", params={"q": text, "limit": "500"}, headers=READ)
            assert response.status_code == 200, response.text
            assert {call["tool_name"] for call in response.json()["calls"]} == expected, text


def test_cli_search__folds_case_beyond_ascii_on_both_databases(database_url: str) -> None:
    asyncio.run(record_named_calls(database_url))
    for text, expected in SEARCHES.items():
        listed = cli(database_url, "list", "--json", "--limit", "500", "--search", text)
        assert listed.exit_code == 0, listed.output
        assert {call["tool_name"] for call in json.loads(listed.stdout)["calls"]} == expected, text


# ----------------------------------------------------------------------- 7: the docs


class _Assets(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []
        self.inline_scripts = 0
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if name in ("src", "href") and value:
                self.urls.append(value)
        self._in_script = tag == "script"

    def handle_data(self, data: str) -> None:
        if self._in_script and data.strip():
            self.inline_scripts += 1

    def handle_endtag(self, tag: str) -> None:
        self._in_script = False


EXTERNAL = re.compile(r"(?:https?:)?//[a-z0-9.-]+", re.IGNORECASE)


async def test_docs__off_unless_asked_and_then_only_from_this_origin(sqlite_url: str) -> None:
    async with serving(create_app(api_settings(sqlite_url))) as client:
        assert (await client.get("/docs")).status_code == 404
        assert (await client.get("/openapi.json")).status_code == 200

    async with serving(create_app(api_settings(sqlite_url, api_docs=True))) as client:
        page = await client.get("/docs")
        assert page.status_code == 200
        assert page.headers["content-type"].startswith("text/html")
        policy = page.headers["content-security-policy"]
        for directive in ("default-src 'none'", "script-src 'self'", "connect-src 'self'"):
            assert directive in policy
        assert "unsafe-eval" not in policy
        assert "http" not in policy
        assert not EXTERNAL.search(page.text), EXTERNAL.findall(page.text)
        parsed = _Assets()
        parsed.feed(page.text)
        assert parsed.inline_scripts == 0, "script-src 'self' would block it"
        assert len(parsed.urls) >= 3
        for url in parsed.urls:
            assert url.startswith("/"), url
            asset = await client.get(url)
            assert asset.status_code == 200, url
            assert "content-security-policy" in asset.headers
        initializer = next(url for url in parsed.urls if url.endswith("init.js"))
        script = (await client.get(initializer)).text
        assert not EXTERNAL.search(script), "the initializer names no other host (not a validator either)"
        assert "/openapi.json" in script


# ------------------------------------------------------------------- 8: /metrics token


async def test_metrics__a_metrics_token_closes_it(database_url: str) -> None:
    async with serving(create_app(api_settings(database_url))) as client:
        assert (await client.get("/metrics")).status_code == 200, "open unless a token is set"

    settings = api_settings(database_url, metrics_token=SCRAPER)
    async with serving(create_app(settings)) as client:
        for headers in (
            {},
            {"Authorization": "Bearer not-the-metrics-token-at-all"},
            {"Authorization": f"Bearer {SCRAPER}x"},
            {"Authorization": f"Basic {SCRAPER}"},
            {"Authorization": SCRAPER},
        ):
            denied = await client.get("/metrics", headers=headers)
            assert denied.status_code == 401, headers
            assert denied.headers["www-authenticate"].startswith("Bearer")
            assert "toolledger_calls" not in denied.text
            assert SCRAPER not in denied.text
        for token in (SCRAPER, READER, ALICE):
            scraped = await client.get("/metrics", headers={"Authorization": f"Bearer {token}"})
            assert scraped.status_code == 200
            assert "toolledger_ledger_up" in scraped.text
        # The metrics token reads metrics only.
        assert (
            await client.get("/api/calls", headers={"Authorization": f"Bearer {SCRAPER}"})
        ).status_code == 401
        assert (await client.get("/healthz")).status_code == 200


def test_metrics_token__weak_or_shared_is_refused(sqlite_url: str) -> None:
    with pytest.raises(ApiConfigurationError, match="shorter than"):
        create_app(api_settings(sqlite_url, metrics_token=SecretStr("short")))
    with pytest.raises(ApiConfigurationError, match="same value"):
        create_app(api_settings(sqlite_url, metrics_token=READ_TOKENS["auditor"]))


def test_metrics_token__masked_in_logs_and_config(sqlite_url: str) -> None:
    # The redaction every command's log and the API use.
    settings = api_settings(sqlite_url, metrics_token=SCRAPER)
    assert SCRAPER not in settings.redactor().text(f"scraped with {SCRAPER}")
    shown = CliRunner().invoke(main, ["config", "--json"], env={"TOOLLEDGER_METRICS_TOKEN": SCRAPER}).stdout
    assert "TOOLLEDGER_METRICS_TOKEN" in shown
    assert SCRAPER not in shown


# ------------------------------------- 8: bodies nested too deeply, keys given twice (issue 31)


async def gated_and_unknown_calls(url: str, session_id: str) -> tuple[CallKey, CallKey]:
    """A call awaiting approval and an unknown one, in one session (watched)."""
    gated, unknown = (
        CallKey(session_id, "turn_1", "call_gated"),
        CallKey(session_id, "turn_1", "call_unknown"),
    )
    await add_unknown_call(url, unknown, "charge_card", CHARGE)
    engine = create_engine(url)
    try:
        await LedgerStore(engine, actor="edges-test").record_for_approval(
            gated,
            tool_name="refund",
            arguments={"order_id": "A1", "cents": 900},
            effect_class=EffectClass.AT_MOST_ONCE,
            approval_seconds=None,
        )
    finally:
        await engine.dispose()
    return gated, unknown


def nested_object(depth: int) -> str:
    """A JSON object ``depth`` levels deep: {"a": {"a": ... 1 ...}}."""
    return '{"a":' * depth + "1" + "}" * depth


def nested_array(depth: int) -> str:
    return "[" * depth + "]" * depth


def body_routes(gated: CallKey, unknown: CallKey, session_id: str) -> dict[str, str]:
    """Every route that reads a JSON body, by name: its path."""
    return {
        "resolve": f"/api/calls/{unknown}/resolve",
        "approve": f"/api/calls/{gated}/approve",
        "deny": f"/api/calls/{gated}/deny",
        "bulk": f"/api/bulk/resolve?session_id={session_id}",
        "unwatch": f"/api/sessions/{session_id}/unwatch",
    }


def deep_bodies(route: str, depth: int) -> list[str]:
    """Bodies ``depth`` levels deep in all (the body's own object counts as one): nested in a
    field the route takes (the approval's arguments, a resolution's text), and a bare array."""
    if route == "approve":
        field = f'"arguments": {nested_object(depth - 1)}'
    else:
        field = f'"text": {nested_array(depth - 1)}'
    return [f'{{"reason": "r", {field}}}', nested_array(depth)]


async def post_raw(client: httpx.AsyncClient, path: str, body: str) -> httpx.Response:
    return await client.post(
        path, content=body.encode(), headers={**FULL, "Content-Type": "application/json"}
    )


async def test_bodies_nested_too_deeply__400_on_every_body_route__never_500(
    database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The probe's 500: an approval's body nested 952-955 levels deep raised RecursionError
    after FastAPI had parsed it (deeper, FastAPI's own parse failed: 400). Every body deeper
    than MAX_BODY_DEPTH is now refused, in so many words, before anything walks it."""
    gated, unknown = await gated_and_unknown_calls(database_url, "sess_deep")
    routes = body_routes(gated, unknown, "sess_deep")
    depths = [MAX_BODY_DEPTH + 1, 200, *range(940, 1001), 3_000, 10_000]
    caplog.set_level(logging.INFO)
    async with serving(create_app(api_settings(database_url))) as client:
        await client.post("/api/sessions/sess_deep/watch", headers=FULL)
        answers = {
            (route, depth, shape): await post_raw(client, path, body)
            for route, path in routes.items()
            for depth in depths
            if route == "approve" or depth in (MAX_BODY_DEPTH + 1, 953, 10_000)
            for shape, body in enumerate(deep_bodies(route, depth))
        }
        gated_after = (await client.get(f"/api/calls/{gated}", headers=READ)).json()["call"]["status"]
        unknown_after = (await client.get(f"/api/calls/{unknown}", headers=READ)).json()["call"]["status"]
        watched = (await client.get("/api/sessions/sess_deep", headers=READ)).json()["watched"]

    wrong = {
        where: (answer.status_code, answer.text[:120])
        for where, answer in answers.items()
        if answer.status_code != 400 or "nested more than 64 levels deep" not in answer.json()["detail"]
    }
    assert wrong == {}
    assert (gated_after, unknown_after, watched) == ("awaiting_approval", "unknown", True)
    assert server_errors(caplog) == []


async def test_a_body_at_the_depth_limit__taken(database_url: str) -> None:
    """Parsed and handed to the route: what it answers is the route's own say (amended
    arguments need the tools here), not the parser's refusal of the depth."""
    gated, _ = await gated_and_unknown_calls(database_url, "sess_at_limit")
    seen = arguments_fingerprint({"order_id": "A1", "cents": 900})
    body = (
        f'{{"reason": "checked", "arguments_sha256": "{seen}", '
        f'"arguments": {nested_object(MAX_BODY_DEPTH - 1)}}}'
    )
    async with serving(create_app(api_settings(database_url))) as client:
        answered = await post_raw(client, f"/api/calls/{gated}/approve", body)
    assert answered.status_code == 400, answered.text
    assert "amended arguments refused" in answered.json()["detail"], answered.text
    assert "nested" not in answered.text


REPEATED_KEYS = {
    # The probe's case: the dry run said true, the last key false, and five calls were resolved.
    "bulk": ('{"kind": "error", "text": "no", "reason": "r", "dry_run": true, "dry_run": false}', "dry_run"),
    "resolve": ('{"kind": "error", "text": "no", "reason": "first", "reason": "second"}', "reason"),
    "approve": ('{"reason": "r", "arguments": {"order_id": "A1", "cents": 9, "cents": 900}}', "cents"),
    "deny": ('{"reason": "r", "arguments_sha256": null, "reason": "s"}', "reason"),
    "unwatch": ('{"reason": "one", "reason": "two"}', "reason"),
}


async def test_a_key_given_twice__400_naming_it_on_every_body_route__nothing_changes(
    database_url: str, emulator: EmulatorServer
) -> None:
    gated, unknown = await gated_and_unknown_calls(database_url, "sess_twice")
    others = [CallKey("sess_twice", "turn_2", f"call_{n}") for n in range(3)]
    for key in others:
        await add_unknown_call(database_url, key, "charge_card", CHARGE)
    routes = body_routes(gated, unknown, "sess_twice")
    assert set(routes) == set(REPEATED_KEYS)
    async with serving(create_app(api_settings(database_url, emulator.base_url))) as client:
        await client.post("/api/sessions/sess_twice/watch", headers=FULL)
        answers = {
            route: await post_raw(client, routes[route], body) for route, (body, _) in REPEATED_KEYS.items()
        }
        nested = await post_raw(
            client,
            routes["bulk"],
            '{"kind": "error", "text": "no", "reason": "r", "dry_run": true, "x": {"k": 1, "k": 2}}',
        )
        after = {
            key: (await client.get(f"/api/calls/{key}", headers=READ)).json()["call"]["status"]
            for key in (gated, unknown, *others)
        }
        watched = (await client.get("/api/sessions/sess_twice", headers=READ)).json()["watched"]

    for route, (_, name) in REPEATED_KEYS.items():
        answer = answers[route]
        assert answer.status_code == 400, (route, answer.text)
        assert f'"{name}" is given twice' in answer.json()["detail"], (route, answer.text)
    assert nested.status_code == 400
    assert '"k" is given twice' in nested.json()["detail"]
    assert after == {gated: "awaiting_approval", unknown: "unknown", **{key: "unknown" for key in others}}
    assert watched is True
    assert emulator.control.tool_results("sess_twice") == []


async def test_bodies_json_cannot_hold__400_in_one_line(database_url: str) -> None:
    """Not JSON as RFC 8259 has it (NaN, Infinity, bytes that are not UTF-8), or a number no
    parser should be asked to build: refused in one line, like any body the API cannot use."""
    _, unknown = await gated_and_unknown_calls(database_url, "sess_odd")
    path = f"/api/calls/{unknown}/resolve"
    async with serving(create_app(api_settings(database_url))) as client:
        for body, says in (
            (b'{"kind": "output", "text": "t", "reason": "r", "x": NaN}', "NaN"),
            (b'{"kind": "output", "text": "t", "reason": "r", "x": -Infinity}', "Infinity"),
            (b'{"kind": "output", "text": "t", "reason": "\xff\xfe"}', "UTF-8"),
            (b'{"kind": "output", "text": "t", "reason": "r", "x": ' + b"9" * 5000 + b"}", "number"),
        ):
            answer = await client.post(
                path, content=body, headers={**FULL, "Content-Type": "application/json"}
            )
            assert answer.status_code == 400, (body[:60], answer.text)
            assert says in answer.json()["detail"], (body[:60], answer.text)
        shown = await client.get(f"/api/calls/{unknown}", headers=READ)
    assert shown.json()["call"]["status"] == "unknown"


def test_every_route_parses_its_body_strictly(sqlite_url: str) -> None:
    """One mechanism for every body: the router's route class. A route added another way
    (and so parsing its body as FastAPI does, keeping the last of a repeated key) fails here."""
    app = create_app(api_settings(sqlite_url))
    routes = [route for route in app.routes if isinstance(route, APIRoute)]
    with_body = {route.path for route in routes if route.body_field is not None}
    assert with_body == {
        "/api/calls/{ref:path}/resolve",
        "/api/calls/{ref:path}/approve",
        "/api/calls/{ref:path}/deny",
        "/api/bulk/resolve",
        "/api/sessions/{session_id}/unwatch",
    }
    assert [route.path for route in routes if not isinstance(route, _StrictJsonRoute)] == []
