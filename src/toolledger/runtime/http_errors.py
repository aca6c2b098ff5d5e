"""What a failed HTTP request says about its side effect, for a handler to raise:

    with classified_http_errors():
        response = await client.post(url, json=order, headers={"Idempotency-Key": ctx.idempotency_key})

- **surely not executed** (``NotExecuted``): the request never left this process. The
  connection was refused, the host name did not resolve, connecting timed out, the TLS
  handshake failed, no pooled connection came free, the proxy could not be used.
- **maybe executed** (``MaybeExecuted``): the request may have reached the server. The answer
  timed out, the connection dropped or broke while sending or after, the answer came back
  broken.
- **nothing to say** (None): an HTTP status (the application reads it), a malformed URL or a
  client-side protocol error, any exception not from a known client (but a raw
  ``ssl.SSLError``, which some clients let through, is classified as a TLS failure).

The clients known are httpx (and httpx2, the openai SDK's), requests, urllib3 and aiohttp.
None of them is imported here: an exception of a client can only exist once its module is
loaded, so only loaded modules are consulted (``sys.modules``).

A client that retries on its own raises its LAST attempt's error: "connection refused" then
says nothing of an earlier attempt whose answer timed out. Turn such retries off (the openai
SDK's ``max_retries=0``; urllib3's ``Retry`` for non-idempotent methods) and let toolledger
retry (``retries``). httpx's transport ``retries`` are safe: it retries connecting only.
"""

from __future__ import annotations

import functools
import inspect
import socket
import ssl
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType, TracebackType
from typing import Any, ParamSpec, TypeVar, cast

from toolledger.domain.results import MaybeExecuted, NotExecuted

_P = ParamSpec("_P")
_R = TypeVar("_R")

_CHAIN_LIMIT = 16
"""Exceptions looked at below the one classified (its causes, a wrapper's reason), at most."""


@dataclass(frozen=True)
class _Finding:
    sent: bool
    """False: the request surely never left; True: it may have reached the server."""
    what: str
    """What happened, in a fixed phrase (never the exception's text: it may name hosts or
    carry credentials)."""


# Fixed phrases: what the model (not executed) or the audit trail (maybe executed) is told.
_REFUSED = "the connection was refused"
_DNS = "the host name could not be resolved"
_CONNECT_TIMEOUT = "connecting timed out"
_TLS = "the TLS handshake failed"
_NOT_CONNECTED = "the connection could not be opened"
_POOL = "no connection of the client's pool came free"
_PROXY = "the proxy could not be used"
_READ_TIMEOUT = "the request was sent, then the answer timed out"
_WRITE_TIMEOUT = "sending the request timed out partway"
_DISCONNECTED = "the connection closed or broke before a complete answer came back"
_BROKEN_ANSWER = "an answer came back but could not be read"
_TLS_LATER = "a TLS error broke the connection after it was set up"
_TRANSPORT = "the connection failed after the request may have been sent"


def classify_http_error(error: BaseException) -> NotExecuted | MaybeExecuted | None:
    """``NotExecuted`` if ``error`` (raised by an HTTP client) means the request surely never
    left, ``MaybeExecuted`` if it may have reached the server, None if it says nothing of
    that (an HTTP status, a bad URL, not an HTTP client's error). Returned, not raised, with
    ``error`` as its cause: ``raise outcome from error``. A ``NotExecuted``'s message is
    meant for the model: a fixed text, never ``error``'s own."""
    finding = _finding(error)
    if finding is None:
        return None
    outcome: NotExecuted | MaybeExecuted
    if finding.sent:
        outcome = MaybeExecuted(f"The request may have taken effect: {finding.what}.")
    else:
        outcome = NotExecuted(f"The request could not be sent ({finding.what}); it did not take effect.")
    outcome.__cause__ = error
    return outcome


def classified_http_errors() -> ClassifiedHttpErrors:
    """Re-raise an HTTP client's error as ``NotExecuted`` or ``MaybeExecuted``
    (``classify_http_error``); any other exception passes through unchanged. A context
    manager, sync or async (``with``, or beside the client in ``async with``; either works
    around ``await``), or a decorator of a handler, sync or async."""
    return ClassifiedHttpErrors()


class ClassifiedHttpErrors:
    """What ``classified_http_errors()`` returns."""

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if isinstance(error, Exception):
            outcome = classify_http_error(error)
            if outcome is not None:
                raise outcome from error

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.__exit__(kind, error, trace)

    def __call__(self, function: Callable[_P, _R]) -> Callable[_P, _R]:
        if inspect.iscoroutinefunction(function):

            @functools.wraps(function)
            async def run_async(*args: Any, **kwargs: Any) -> Any:
                with self:
                    return await function(*args, **kwargs)

            return cast("Callable[_P, _R]", run_async)

        @functools.wraps(function)
        def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            with self:
                return function(*args, **kwargs)

        return run


def _finding(error: BaseException) -> _Finding | None:
    for name in ("httpx", "httpx2"):
        httpx = _loaded(name)
        if httpx is not None and isinstance(error, httpx.HTTPError):
            return _httpx(error, httpx)
    requests = _loaded("requests.exceptions")
    if requests is not None and isinstance(error, requests.RequestException):
        return _requests(error, requests)
    urllib3 = _loaded("urllib3.exceptions")
    if urllib3 is not None and isinstance(error, urllib3.HTTPError):
        return _urllib3(error, urllib3)
    aiohttp = _loaded("aiohttp")
    if aiohttp is not None and isinstance(error, aiohttp.ClientError):
        return _aiohttp(error, aiohttp)
    if isinstance(error, ssl.SSLError):
        # A TLS connection's own error, let through by a client: httpx's async transport
        # does so when the connection breaks after its handshake.
        return _tls(error)
    return None


def _loaded(name: str) -> ModuleType | None:
    return sys.modules.get(name)


def _httpx(error: BaseException, httpx: ModuleType) -> _Finding | None:
    # httpcore maps every failure to open a connection (refused, DNS, connect timeout, the
    # TLS handshake) to ConnectError or ConnectTimeout, before a byte of the request is sent.
    if isinstance(error, httpx.ConnectTimeout):
        return _Finding(sent=False, what=_CONNECT_TIMEOUT)
    if isinstance(error, httpx.PoolTimeout):
        return _Finding(sent=False, what=_POOL)
    if isinstance(error, httpx.ConnectError):
        return _Finding(sent=False, what=_why_not_connected(error))
    if isinstance(error, httpx.ProxyError):
        return _Finding(sent=False, what=_PROXY)
    if isinstance(error, httpx.UnsupportedProtocol | httpx.LocalProtocolError):
        return None  # the application's request is malformed: a bug, not an outage
    if isinstance(error, httpx.ReadTimeout):
        return _Finding(sent=True, what=_READ_TIMEOUT)
    if isinstance(error, httpx.WriteTimeout):
        return _Finding(sent=True, what=_WRITE_TIMEOUT)
    if isinstance(error, httpx.DecodingError):
        return _Finding(sent=True, what=_BROKEN_ANSWER)
    if isinstance(error, httpx.TransportError):
        # RemoteProtocolError ("Server disconnected without sending a response"), ReadError,
        # WriteError, CloseError: the request may have been read by the server.
        return _Finding(sent=True, what=_DISCONNECTED)
    return None  # HTTPStatusError, TooManyRedirects: answers, the application's to read


def _requests(error: BaseException, requests: ModuleType) -> _Finding | None:
    # ConnectTimeout and SSLError are ConnectionErrors too: the narrower first.
    if isinstance(error, requests.ConnectTimeout):
        return _Finding(sent=False, what=_CONNECT_TIMEOUT)
    if isinstance(error, requests.ProxyError):
        return _Finding(sent=False, what=_PROXY)
    if isinstance(error, requests.SSLError):
        return _tls(error)
    if isinstance(error, requests.ConnectionError):
        # requests wraps urllib3's error (its first argument): a MaxRetryError whose reason is
        # NewConnectionError was refused or unresolved; a ProtocolError broke mid-request.
        wrapped = error.args[0] if error.args else None
        found = _finding(wrapped) if isinstance(wrapped, BaseException) else None
        return found or _Finding(sent=True, what=_TRANSPORT)
    if isinstance(error, requests.ReadTimeout):
        return _Finding(sent=True, what=_READ_TIMEOUT)
    if isinstance(error, requests.ChunkedEncodingError | requests.ContentDecodingError):
        return _Finding(sent=True, what=_BROKEN_ANSWER)
    if isinstance(error, requests.Timeout):
        return _Finding(sent=True, what=_READ_TIMEOUT)
    return None  # HTTPError (raise_for_status), RetryError, bad URLs


def _urllib3(error: BaseException, urllib3: ModuleType) -> _Finding | None:
    if isinstance(error, urllib3.MaxRetryError):
        # Its reason is the last attempt's error (retries of a POST are connect retries only,
        # unless the application allowed more: see the module's note).
        reason = error.reason
        return _finding(reason) if isinstance(reason, BaseException) else None
    if isinstance(error, urllib3.ProxyError):
        return _Finding(sent=False, what=_PROXY)
    # NewConnectionError (NameResolutionError among them) is a ConnectTimeoutError too.
    if isinstance(error, urllib3.NewConnectionError):
        return _Finding(sent=False, what=_why_not_connected(error))
    if isinstance(error, urllib3.ConnectTimeoutError):
        return _Finding(sent=False, what=_CONNECT_TIMEOUT)
    if isinstance(error, urllib3.SSLError):
        return _tls(error)
    if isinstance(error, urllib3.EmptyPoolError | urllib3.ClosedPoolError):
        return _Finding(sent=False, what=_POOL)
    if isinstance(error, urllib3.ReadTimeoutError):
        return _Finding(sent=True, what=_READ_TIMEOUT)
    if isinstance(error, urllib3.DecodeError | urllib3.ResponseNotChunked):
        return _Finding(sent=True, what=_BROKEN_ANSWER)
    if isinstance(error, urllib3.ProtocolError | urllib3.TimeoutError):
        # ProtocolError: "Connection aborted." (RemoteDisconnected, a reset), IncompleteRead,
        # InvalidChunkLength: the request may have been read by the server.
        return _Finding(sent=True, what=_DISCONNECTED)
    return None  # ResponseError (status retries used up), LocationValueError, ...


def _aiohttp(error: BaseException, aiohttp: ModuleType) -> _Finding | None:
    connect_timeout = getattr(aiohttp, "ConnectionTimeoutError", None)  # aiohttp >= 3.10
    if connect_timeout is not None and isinstance(error, connect_timeout):
        return _Finding(sent=False, what=_CONNECT_TIMEOUT)
    if isinstance(error, aiohttp.ClientSSLError | aiohttp.ServerFingerprintMismatch):
        return _Finding(sent=False, what=_TLS)
    if isinstance(error, aiohttp.ClientConnectorError):
        # DNS (ClientConnectorDNSError), refused, a proxy's connection: before sending.
        return _Finding(sent=False, what=_why_not_connected(error))
    if isinstance(error, aiohttp.ServerTimeoutError):
        # The socket read timeout (before 3.10 the connect timeout too: then doubt, to be safe).
        return _Finding(sent=True, what=_READ_TIMEOUT)
    if isinstance(error, aiohttp.ClientPayloadError):
        return _Finding(sent=True, what=_BROKEN_ANSWER)
    if isinstance(error, aiohttp.ClientConnectionError):
        # ServerDisconnectedError, ClientOSError, a reset: the request may have been read.
        return _Finding(sent=True, what=_DISCONNECTED)
    return None  # ClientResponseError (a status), InvalidURL, ...


def _tls(error: BaseException) -> _Finding:
    """A TLS error: before sending if the handshake failed, else perhaps after."""
    cause = next((e for e in _chain(error) if isinstance(e, ssl.SSLError | ssl.CertificateError)), None)
    if cause is not None and (isinstance(cause, ssl.SSLCertVerificationError) or _raised_in_handshake(cause)):
        return _Finding(sent=False, what=_TLS)
    return _Finding(sent=True, what=_TLS_LATER)


def _raised_in_handshake(error: BaseException) -> bool:
    """The innermost frame of the error's traceback is the ``ssl`` module's handshake: no
    application data (the request) can have been sent on that connection."""
    frame = error.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    return frame is not None and frame.tb_frame.f_code.co_name == "do_handshake"


def _why_not_connected(error: BaseException) -> str:
    """Why a connection could not be opened, from what the client's error was raised from."""
    for cause in _chain(error):
        if isinstance(cause, ssl.SSLError | ssl.CertificateError):
            return _TLS
        if isinstance(cause, socket.gaierror) or type(cause).__name__ in (
            "NameResolutionError",
            "ClientConnectorDNSError",
        ):
            return _DNS
        if isinstance(cause, ConnectionRefusedError):
            return _REFUSED
        if isinstance(cause, TimeoutError):
            return _CONNECT_TIMEOUT
    return _NOT_CONNECTED


def _chain(error: BaseException) -> Iterator[BaseException]:
    """``error`` and what it was raised from or wraps (causes, contexts, a MaxRetryError's
    reason, aiohttp's ``os_error``, a wrapper's first argument), nearest first, each once."""
    seen: set[int] = set()
    todo = [error]
    while todo and len(seen) < _CHAIN_LIMIT:
        current = todo.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        args = current.args if isinstance(current.args, tuple) else ()
        for linked in (
            current.__cause__,
            current.__context__,
            _attribute(current, "reason"),
            _attribute(current, "os_error"),
            *args[:1],
        ):
            if isinstance(linked, BaseException):
                todo.append(linked)


def _attribute(error: BaseException, name: str) -> Any:
    try:
        return getattr(error, name, None)
    except Exception:  # a property that fails
        return None


__all__ = ["ClassifiedHttpErrors", "classified_http_errors", "classify_http_error"]
