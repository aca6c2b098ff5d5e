"""Who may use the audit API: bearer tokens by name, each with read or full rights.

Tokens come from settings (``TOOLLEDGER_API_TOKENS``: read, resolve, watch;
``TOOLLEDGER_API_READ_TOKENS``: read only). The name of the token used is the operator
recorded on a resolution. A token is never logged, echoed or kept beyond its digest.
``TOOLLEDGER_METRICS_TOKEN``, when set, closes ``/metrics`` to anyone without it or an API
token.

With no token configured at all the API serves loopback only, to anyone on the machine
(``local``), and refuses requests a browser could be tricked into sending from elsewhere.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated
from urllib.parse import urlsplit

from fastapi import Depends, HTTPException, Request, Security, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import SecretStr

from toolledger.errors import ToolLedgerError
from toolledger.settings import Settings

MIN_TOKEN_CHARS = 16
METRICS_VARIABLE = "TOOLLEDGER_METRICS_TOKEN"
MAX_TOKEN_NAME_CHARS = 64
LOCAL_OPERATOR = "local"
"""The operator recorded when no token is configured (loopback only)."""
_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="toolledger"'}


class ApiConfigurationError(ToolLedgerError):
    """The API cannot start safely as configured (no token on a public address, a weak token)."""

    code = "api_configuration"


@dataclass(frozen=True)
class Principal:
    """Who made a request, and whether they may change anything."""

    name: str
    may_write: bool
    local: bool = False
    """No token is configured: anyone on this machine, who may say who they are."""


@dataclass(frozen=True)
class _Token:
    digest: bytes
    principal: Principal


class TokenRing:
    """The configured tokens, kept as sha256 digests.

    Comparing digests of equal length with ``hmac.compare_digest`` leaks neither a token's
    content nor its length through timing, and every token is compared on every request,
    so which name matched does not show either.
    """

    def __init__(
        self,
        full: dict[str, SecretStr],
        read_only: dict[str, SecretStr],
        metrics: SecretStr | None = None,
    ) -> None:
        names = [*full, *read_only]
        if len(set(names)) != len(names):
            raise ApiConfigurationError("a token name is both in api_tokens and api_read_tokens: use one")
        tokens = [
            *_tokens(full.items(), may_write=True),
            *_tokens(read_only.items(), may_write=False),
        ]
        # The metrics token opens /metrics and nothing else: it is kept apart from the named
        # tokens, so it can never stand for an operator.
        scrapers = _tokens([(METRICS_VARIABLE, metrics)], may_write=False) if metrics is not None else []
        if len({t.digest for t in [*tokens, *scrapers]}) != len(tokens) + len(scrapers):
            raise ApiConfigurationError("two API tokens have the same value: give every name its own token")
        self._tokens = tokens
        self._scrapers = scrapers

    @classmethod
    def from_settings(cls, settings: Settings) -> TokenRing:
        return cls(settings.api_tokens, settings.api_read_tokens, settings.metrics_token)

    @property
    def empty(self) -> bool:
        return not self._tokens

    @property
    def metrics_closed(self) -> bool:
        """A metrics token is set: /metrics needs it, or any API token."""
        return bool(self._scrapers)

    def may_scrape(self, presented: str) -> bool:
        digest = hashlib.sha256(presented.encode("utf-8", "surrogateescape")).digest()
        matched = False
        for token in [*self._tokens, *self._scrapers]:
            matched = hmac.compare_digest(digest, token.digest) or matched
        return matched

    def identify(self, presented: str) -> Principal | None:
        digest = hashlib.sha256(presented.encode("utf-8", "surrogateescape")).digest()
        found: Principal | None = None
        for token in self._tokens:
            # No early exit: the loop's duration must not depend on which token matched.
            if hmac.compare_digest(digest, token.digest) and found is None:
                found = token.principal
        return found


def _tokens(entries: Iterable[tuple[str, SecretStr]], *, may_write: bool) -> list[_Token]:
    tokens = []
    for name, secret in entries:
        if not name.strip() or len(name) > MAX_TOKEN_NAME_CHARS or not name.isprintable():
            raise ApiConfigurationError(
                f"API token names must be 1 to {MAX_TOKEN_NAME_CHARS} printable characters"
            )
        value = secret.get_secret_value()
        if len(value) < MIN_TOKEN_CHARS:
            raise ApiConfigurationError(f"API token {name!r} is shorter than {MIN_TOKEN_CHARS} characters")
        tokens.append(_Token(hashlib.sha256(value.encode()).digest(), Principal(name, may_write)))
    return tokens


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and ``localhost``; a name that must be resolved is not trusted."""
    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def ensure_safe_exposure(tokens: TokenRing, host: str) -> None:
    """Refuse to listen beyond this machine with no token: the ledger would be open to all."""
    if tokens.empty and not is_loopback(host):
        raise ApiConfigurationError(
            f"refusing to serve the audit API on {host} without a token: set TOOLLEDGER_API_TOKENS "
            '(e.g. {"alice": "<a long random token>"}) or listen on 127.0.0.1'
        )


_bearer = HTTPBearer(
    auto_error=False,
    description="A token of TOOLLEDGER_API_TOKENS (read, resolve, watch) or TOOLLEDGER_API_READ_TOKENS.",
)


async def authenticated(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)]
) -> Principal:
    """Every data route depends on this (a test walks the route table to make sure)."""
    tokens: TokenRing = request.app.state.tokens
    if tokens.empty:
        _only_from_this_machine(request)
        return Principal(LOCAL_OPERATOR, may_write=True, local=True)
    if credentials is None:
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "a bearer token is required", headers=_CHALLENGE)
    principal = tokens.identify(credentials.credentials)
    if principal is None:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "the bearer token is not valid",
            headers={"WWW-Authenticate": 'Bearer realm="toolledger", error="invalid_token"'},
        )
    return principal


async def metrics_reader(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)]
) -> None:
    """/metrics names every tool and counts its calls: with a metrics token configured, only a
    scraper holding it (or an API token) may read them."""
    tokens: TokenRing = request.app.state.tokens
    if not tokens.metrics_closed:
        return
    if credentials is None:
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "a bearer token is required", headers=_CHALLENGE)
    if not tokens.may_scrape(credentials.credentials):
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED,
            "the bearer token is not valid",
            headers={"WWW-Authenticate": 'Bearer realm="toolledger", error="invalid_token"'},
        )


async def may_write(principal: Annotated[Principal, Depends(authenticated)]) -> Principal:
    """Resolving calls and watching sessions change the ledger: a read token may not."""
    if not principal.may_write:
        raise HTTPException(status.HTTP_403_FORBIDDEN, f"token {principal.name!r} may only read")
    return principal


Reader = Annotated[Principal, Depends(authenticated)]
Writer = Annotated[Principal, Depends(may_write)]


def _only_from_this_machine(request: Request) -> None:
    """Without tokens, a web page elsewhere must not reach the API through the user's browser:
    a rebound DNS name arrives with a foreign Host, a cross-site request with a foreign Origin."""
    host = request.headers.get("host", "")
    origin = request.headers.get("origin")
    if not is_loopback(_hostname(host)) or (origin is not None and urlsplit(origin).netloc != host):
        raise HTTPException(
            status.HTTP_403_FORBIDDEN,
            "no API token is configured: only requests to this machine's loopback address are served",
        )


def _hostname(host_header: str) -> str:
    if host_header.startswith("["):
        return host_header[1:].split("]", 1)[0]
    return host_header.rsplit(":", 1)[0] if host_header.count(":") == 1 else host_header


__all__ = [
    "ApiConfigurationError",
    "Principal",
    "Reader",
    "TokenRing",
    "Writer",
    "authenticated",
    "ensure_safe_exposure",
    "is_loopback",
    "may_write",
    "metrics_reader",
]
