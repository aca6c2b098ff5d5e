"""``classify_http_error`` against real sockets: each HTTP client's own error for a request
that surely never left (refused, unresolvable, connect timeout, TLS handshake) or that may
have arrived (no answer, closed before or in the middle of the answer), and for statuses."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import ssl
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import httpx2
import pytest
import requests
import urllib3

from tests.support.http_faults import (
    UNRESOLVABLE_HOST,
    FaultyServer,
    answers_500,
    closes_mid_answer,
    closes_without_answer,
    faulty_server,
    full_backlog_port,
    never_answers,
    not_tls,
    read_request,
    refusing_port,
)
from toolledger import (
    MaybeExecuted,
    NotExecuted,
    ToolContext,
    ToolRegistry,
    classified_http_errors,
    classify_http_error,
)

TIMEOUT = 0.5
ORDER: dict[str, Any] = {"order": "o_1", "cents": 250}
CANARY = "sk-proj-CANARYCANARYCANARY"


# ------------------------------------------------------------------------------- clients


@dataclass(frozen=True)
class Client:
    """One HTTP client as an application's handler uses it: a POST, and the status check."""

    name: str
    post: Callable[[str], Any]
    """POST an order to the URL; raises the client's own error."""

    def error_of(self, url: str) -> BaseException:
        with pytest.raises(Exception) as raised:  # noqa: PT011 - each client raises its own
            self.post(url)
        return raised.value


def _httpx_post(url: str) -> None:
    httpx.post(url, json=ORDER, timeout=TIMEOUT, verify=False).raise_for_status()  # noqa: S501 - a self-signed test server


def _httpx2_post(url: str) -> None:
    httpx2.post(url, json=ORDER, timeout=TIMEOUT, verify=False).raise_for_status()


def _httpx_async_post(url: str) -> None:
    async def post() -> None:
        async with httpx.AsyncClient(timeout=TIMEOUT, verify=False) as client:  # noqa: S501 - a self-signed test server
            (await client.post(url, json=ORDER)).raise_for_status()

    asyncio.run(post())


def _requests_post(url: str) -> None:
    requests.post(url, json=ORDER, timeout=TIMEOUT, verify=False).raise_for_status()  # noqa: S501 - a self-signed test server


def _urllib3_post(url: str) -> None:
    # No retry: the error of the one attempt made. urllib3 would retry even a POST whose
    # answer broke with a TLS error (an "other" error to it), sending it twice; a 500 is then
    # reported as "too many 500 error responses" (MaxRetryError).
    retries = urllib3.Retry(total=0, read=False, status_forcelist=[500], allowed_methods=None)
    with urllib3.PoolManager(cert_reqs="CERT_NONE") as pool:
        pool.request("POST", url, json=ORDER, timeout=TIMEOUT, retries=retries)


def _aiohttp_post(url: str) -> None:
    async def post() -> None:
        timeout = aiohttp.ClientTimeout(sock_connect=TIMEOUT, sock_read=TIMEOUT)
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.post(url, json=ORDER, ssl=False) as response,
        ):
            response.raise_for_status()
            await response.read()

    asyncio.run(post())


CLIENTS = [
    Client("httpx", _httpx_post),
    Client("httpx-async", _httpx_async_post),
    Client("httpx2", _httpx2_post),
    Client("requests", _requests_post),
    Client("urllib3", _urllib3_post),
    Client("aiohttp", _aiohttp_post),
]


# ----------------------------------------------------------------------------- scenarios


@dataclass(frozen=True)
class Scenario:
    name: str
    target: Callable[[], AbstractContextManager[tuple[str, FaultyServer | None]]]
    """The URL to POST to, and the server behind it (None: no server reads anything)."""
    expected: type[Exception]
    phrase: str


@contextlib.contextmanager
def _refused() -> Iterator[tuple[str, FaultyServer | None]]:
    with refusing_port() as port:
        yield f"http://user:{CANARY}@127.0.0.1:{port}/charge", None


@contextlib.contextmanager
def _unresolvable() -> Iterator[tuple[str, FaultyServer | None]]:
    yield f"http://{UNRESOLVABLE_HOST}/charge", None


@contextlib.contextmanager
def _connect_timeout() -> Iterator[tuple[str, FaultyServer | None]]:
    with full_backlog_port() as port:
        yield f"http://127.0.0.1:{port}/charge", None


def _served(
    behaviour: Callable[..., None], scheme: str = "http"
) -> Callable[[], AbstractContextManager[tuple[str, FaultyServer | None]]]:
    @contextlib.contextmanager
    def target() -> Iterator[tuple[str, FaultyServer | None]]:
        with faulty_server(behaviour) as server:
            yield server.url(scheme=scheme), server

    return target


NOT_SENT = [
    Scenario("refused", _refused, NotExecuted, "the connection was refused"),
    Scenario("unresolvable", _unresolvable, NotExecuted, "the host name could not be resolved"),
    Scenario("connect-timeout", _connect_timeout, NotExecuted, "connecting timed out"),
    Scenario("tls-handshake", _served(not_tls, "https"), NotExecuted, "the TLS handshake failed"),
]
MAYBE_SENT = [
    Scenario("never-answers", _served(never_answers), MaybeExecuted, "the answer timed out"),
    Scenario("closes-without-answer", _served(closes_without_answer), MaybeExecuted, "closed or broke"),
    Scenario("closes-mid-answer", _served(closes_mid_answer), MaybeExecuted, ""),
]


@pytest.mark.parametrize("client", CLIENTS, ids=lambda c: c.name)
@pytest.mark.parametrize("scenario", NOT_SENT + MAYBE_SENT, ids=lambda s: s.name)
def test_classify_http_error__each_clients_own_error__says_whether_the_request_can_have_arrived(
    client: Client, scenario: Scenario
) -> None:
    with scenario.target() as (url, server):
        error = client.error_of(url)
        arrived = len(server.requests) if server is not None else 0

    outcome = classify_http_error(error)

    assert type(outcome) is scenario.expected, repr(error)
    assert outcome is not None
    assert outcome.__cause__ is error
    assert scenario.phrase in outcome.message
    if scenario.expected is NotExecuted:
        assert arrived == 0, "a request classified not executed never reached a server"
        assert outcome.message.startswith("The request could not be sent")
    else:
        assert arrived == 1, "each doubtful request really reached the server"


@pytest.mark.parametrize("client", CLIENTS, ids=lambda c: c.name)
def test_classify_http_error__the_message_never_quotes_the_error(client: Client) -> None:
    """The model reads a NotExecuted's message: neither the URL's password nor its host and
    port (both in the client's own text) reach it."""
    with refusing_port() as port:
        error = client.error_of(f"http://user:{CANARY}@127.0.0.1:{port}/charge")

    outcome = classify_http_error(error)

    assert isinstance(outcome, NotExecuted)
    assert CANARY not in outcome.message
    assert str(port) not in outcome.message
    assert "127.0.0.1" not in outcome.message


@pytest.mark.parametrize("client", CLIENTS, ids=lambda c: c.name)
def test_classify_http_error__an_http_status__is_not_its_business(client: Client) -> None:
    with faulty_server(answers_500) as server:
        error = client.error_of(server.url())
        arrived = len(server.requests)

    assert arrived >= 1
    assert classify_http_error(error) is None


@pytest.mark.parametrize(
    "error",
    [
        ValueError("not an HTTP client's"),
        TimeoutError("whose timeout?"),
        ConnectionRefusedError(111, "refused, but not by a known client"),
        RuntimeError("boom"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_classify_http_error__an_error_of_no_known_client__is_none(error: Exception) -> None:
    assert classify_http_error(error) is None


def test_classify_http_error__a_malformed_request__is_none() -> None:
    """Nothing was sent, but it is a bug of the application's, not an outage to retry."""
    with pytest.raises(httpx.UnsupportedProtocol) as raised:
        httpx.post("ftp://127.0.0.1/charge")

    assert classify_http_error(raised.value) is None


def test_classify_http_error__a_raw_urllib3_retry_of_a_refused_connection__is_still_not_executed() -> None:
    """urllib3 retries connecting (a POST is not retried once sent): the MaxRetryError's
    reason is a connection that never opened."""
    with refusing_port() as port, pytest.raises(urllib3.exceptions.MaxRetryError) as raised:
        urllib3.request("POST", f"http://127.0.0.1:{port}/charge", json=ORDER, retries=urllib3.Retry(2))

    outcome = classify_http_error(raised.value)

    assert isinstance(outcome, NotExecuted)
    assert "the connection was refused" in outcome.message


# ------------------------------------------------------------------ TLS after the handshake


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1, made by the openssl command."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("the openssl command is not installed")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
        timeout=60,
    )  # fmt: skip
    return cert, key


@pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")
@pytest.mark.parametrize("client", CLIENTS, ids=lambda c: c.name)
def test_classify_http_error__a_tls_error_after_the_handshake__is_maybe_executed(
    client: Client, certificate: tuple[Path, Path]
) -> None:
    """The handshake succeeded and the request was read; then the answer is not TLS at all.
    A TLS error is "not sent" only when the handshake itself failed."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(*certificate)

    def breaks_after_the_request(connection: socket.socket, server: FaultyServer) -> None:
        with context.wrap_socket(connection, server_side=True) as tls:
            read_request(tls, server)
            os.write(tls.fileno(), b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")  # not a TLS record

    with faulty_server(breaks_after_the_request) as server:
        error = client.error_of(server.url(scheme="https"))
        arrived = len(server.requests)

    outcome = classify_http_error(error)

    assert arrived == 1
    assert isinstance(outcome, MaybeExecuted), repr(error)


def test_classify_http_error__a_raw_tls_handshake_failure__is_not_executed() -> None:
    """Some clients let the ssl module's own error through: a failed handshake is still
    known to have sent nothing."""
    context = ssl.create_default_context()
    with (
        faulty_server(not_tls) as server,
        socket.create_connection(("127.0.0.1", server.port), timeout=5) as raw,
        pytest.raises(ssl.SSLError) as raised,
    ):
        context.wrap_socket(raw, server_hostname="127.0.0.1")

    outcome = classify_http_error(raised.value)

    assert isinstance(outcome, NotExecuted)
    assert "the TLS handshake failed" in outcome.message


# --------------------------------------------------------------------- the context manager


def test_classified_http_errors__re_raises_a_client_error_as_its_outcome() -> None:
    with refusing_port() as port, pytest.raises(NotExecuted) as raised, classified_http_errors():
        httpx.post(f"http://127.0.0.1:{port}/charge", json=ORDER, timeout=TIMEOUT)

    assert isinstance(raised.value.__cause__, httpx.ConnectError)


async def test_classified_http_errors__works_around_an_await() -> None:
    with faulty_server(never_answers) as server:
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            with pytest.raises(MaybeExecuted) as raised, classified_http_errors():
                await client.post(server.url(), json=ORDER)

    assert isinstance(raised.value.__cause__, httpx.ReadTimeout)


async def test_classified_http_errors__beside_the_client_in_async_with() -> None:
    with refusing_port() as port, pytest.raises(NotExecuted):
        async with httpx.AsyncClient(timeout=TIMEOUT) as client, classified_http_errors():
            await client.post(f"http://127.0.0.1:{port}/charge", json=ORDER)


async def test_classified_http_errors__decorates_sync_and_async_handlers_keeping_their_schema() -> None:
    charge_sync = classified_http_errors()(_charge_sync)
    charge_async = classified_http_errors()(_charge_async)
    registry = ToolRegistry()
    registry.tool(name="charge_sync", retries=1)(charge_sync)
    registry.tool(name="charge_async", retries=1)(charge_async)

    for name, is_async in (("charge_sync", False), ("charge_async", True)):
        tool = registry.get(name)
        assert tool is not None
        assert set(tool.definition["parameters"]["properties"]) == {"url", "cents"}
        assert tool.is_async is is_async
    with refusing_port() as port:
        url = f"http://127.0.0.1:{port}/charge"
        with pytest.raises(NotExecuted):
            charge_sync(url, 1)
        with pytest.raises(NotExecuted):
            await charge_async(url, 1)


def _charge_sync(url: str, cents: int) -> str:
    return httpx.post(url, json={"cents": cents}, timeout=TIMEOUT).text


async def _charge_async(url: str, cents: int, ctx: ToolContext | None = None) -> str:
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        return (await client.post(url, json={"cents": cents})).text


def test_classified_http_errors__lets_any_other_exception_through_unchanged() -> None:
    original = KeyError("not an HTTP error")
    with pytest.raises(KeyError) as raised, classified_http_errors():
        raise original
    assert raised.value is original

    with faulty_server(answers_500) as server, pytest.raises(httpx.HTTPStatusError), classified_http_errors():
        httpx.post(server.url(), json=ORDER, timeout=TIMEOUT).raise_for_status()


def test_classify_http_error__imports_no_http_client() -> None:
    """A client's error can only exist once the client is loaded: nothing is imported to ask."""
    code = (
        "import sys; from toolledger import classify_http_error, classified_http_errors\n"
        "assert classify_http_error(ValueError('x')) is None\n"
        "with classified_http_errors(): pass\n"
        "print(sorted(m for m in ('httpx', 'httpx2', 'requests', 'urllib3', 'aiohttp') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == "[]"
