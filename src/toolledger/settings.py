"""Configuration, from ``TOOLLEDGER_*`` environment variables or a ``.env`` file (and, for the
Agents API's key and address, the openai SDK's own ``OPENAI_API_KEY`` / ``OPENAI_BASE_URL``
when toolledger's are unset)."""

from __future__ import annotations

import base64
import binascii
import os
import re
from collections.abc import Mapping
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import AliasChoices, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from toolledger.domain.redaction import DEFAULT_SECRET_FIELDS, Redactor
from toolledger.domain.trail import MIN_KEY_BYTES, TrailKey

AGENT_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
DEFAULT_DATABASE_URL = "sqlite+aiosqlite:///toolledger.sqlite3"
SDK_VARIABLES: dict[str, tuple[str, ...]] = {
    "openai_api_key": ("OPENAI_API_KEY", "openai_api_key"),
    "openai_base_url": ("OPENAI_BASE_URL", "openai_base_url"),
}
"""Options that fall back on the openai SDK's own variable when their TOOLLEDGER_ one is
unset (the last name lets code pass the option by its name)."""


class Settings(BaseSettings):
    """Every option of toolledger; each one is also ``TOOLLEDGER_<NAME>``."""

    # A refused value is never quoted in an error: a database URL holds a password, a token is one.
    model_config = SettingsConfigDict(
        env_prefix="TOOLLEDGER_", env_file=".env", extra="ignore", hide_input_in_errors=True
    )

    database_url: str = Field(
        default=DEFAULT_DATABASE_URL,
        description="Ledger database: a SQLite file (default) or postgresql+psycopg://user:pass@host/db.",
    )
    # Unset, the SDK's own variables are honoured, as by every openai-based tool (the start-up
    # log says which one was used: ``agents_api_sources``).
    openai_api_key: SecretStr | None = Field(
        default=None,
        validation_alias=AliasChoices("TOOLLEDGER_OPENAI_API_KEY", *SDK_VARIABLES["openai_api_key"]),
        description="API key for the Agents API (unset: the SDK's own OPENAI_API_KEY).",
    )
    openai_base_url: str | None = Field(
        default=None,
        validation_alias=AliasChoices("TOOLLEDGER_OPENAI_BASE_URL", *SDK_VARIABLES["openai_base_url"]),
        description="Agents API base URL (unset: the SDK's own OPENAI_BASE_URL); point it at "
        "`toolledger emulator` to test.",
    )
    worker_id: str | None = Field(
        default=None, description="Name of this worker in leases and the audit trail."
    )
    lease_seconds: float = Field(
        default=30.0, gt=0, description="How long a claim lasts without a heartbeat."
    )
    heartbeat_seconds: float | None = Field(
        default=None, gt=0, description="How often a running call renews its lease (default: a third of it)."
    )
    handler_timeout_seconds: float = Field(default=300.0, gt=0, description="Default timeout of a handler.")
    max_arguments_bytes: int = Field(
        default=256 * 1024, gt=0, description="Largest arguments a handler is run with."
    )
    max_output_bytes: int = Field(default=1024 * 1024, gt=0, description="Largest tool output submitted.")
    max_attempts: int = Field(default=3, ge=1, description="Claims of one call before it is given up.")
    submit_attempts: int = Field(
        default=6, ge=1, description="Tries of one submission before the reconciler."
    )
    resubmit_after_seconds: float = Field(
        default=5.0,
        ge=0,
        description="A call still listed this long after its result was accepted is submitted "
        "again (same bytes, same Idempotency-Key); sooner, the listing is taken as stale.",
    )
    database_pool_size: int = Field(
        default=5, ge=1, description="PostgreSQL connections a process keeps open."
    )
    database_max_overflow: int = Field(
        default=5,
        ge=0,
        description="Extra PostgreSQL connections a process may open at busy moments (a replica "
        "uses at most pool size + overflow; PostgreSQL's default limit is 100 for everyone).",
    )
    database_retry_seconds: float = Field(
        default=120.0,
        ge=0,
        description="How long a handler's outcome, once it exists, is retried into a database "
        "that is restarting or unreachable before it is given up (the call then becomes "
        "`unknown` when its lease expires).",
    )
    batching: bool = Field(
        default=True,
        description="Write and send together what becomes ready at the same moment, never "
        "waiting to fill a batch: calls delivered together are recorded in one commit, outcomes "
        "ready together are stored in one, and a session's results that become ready while its "
        "previous submission is in flight go in one request. Off: one commit per write and one "
        "request per result, as the SDK's own runner does.",
    )
    max_concurrent_calls: int = Field(
        default=64,
        ge=1,
        description="Handlers one process runs at once (over all sessions). A call past it is "
        "recorded and claimed all the same, its lease renewed, and its handler starts once a "
        "slot is free.",
    )
    handler_threads: int = Field(
        default=32,
        ge=1,
        description="Sync handlers one process runs at once, each in a thread of its own (apart "
        "from the threads asyncio and the openai SDK use); a tool may declare fewer "
        "(`threads=`). A handler that timed out keeps its thread until it returns. Keep it "
        "under TOOLLEDGER_MAX_CONCURRENT_CALLS, so that hung sync handlers leave async ones room.",
    )
    session_lease_seconds: float = Field(
        default=30.0,
        gt=0,
        description="How long a replica owns a watched session without renewing; a dead replica's "
        "sessions are taken over after this.",
    )
    reconcile_interval_seconds: float = Field(
        default=60.0, gt=0, description="How often `serve` reconciles every session it owns."
    )
    decision_poll_seconds: float = Field(
        default=1.0,
        gt=0,
        description="How often `serve` looks for calls an operator approved, denied or re-opened "
        "from elsewhere (the CLI, the HTTP API, the web view), to run or answer them.",
    )
    shutdown_grace_seconds: float = Field(
        default=30.0,
        ge=0,
        description="On SIGTERM, how long running handlers may take to finish; the rest are left "
        "to lease expiry, as after a crash.",
    )
    stream_backoff_max_seconds: float = Field(
        default=10.0, gt=0, description="Longest wait before reconnecting a dropped event stream."
    )
    stream_idle_timeout_seconds: float = Field(
        default=120.0,
        gt=0,
        description="An event stream silent for this long (no event, no keep-alive) is reconnected.",
    )
    discover_metadata: dict[str, str] | None = Field(
        default=None,
        description='Also watch every session whose metadata matches (JSON, e.g. {"app": "shop"}).',
    )
    discover_interval_seconds: float = Field(
        default=10.0, gt=0, description="How often sessions are discovered by `discover_metadata`."
    )
    agent_ids: Annotated[tuple[str, ...], NoDecode] = Field(
        default=(),
        description="Serve every session of these agents (comma-separated `agt_…` ids): found by a "
        "sweep of each agent's sessions every `sweep_seconds`, and at once through signed webhooks "
        "when `listen` and `webhook_secret` are set. Sessions of other agents are never answered.",
    )
    listen: str | None = Field(
        default=None,
        description="HOST:PORT where `serve` takes the Agents API's signed webhooks (POST "
        "/webhooks/agents); needs `webhook_secret` and `agent_ids`.",
    )
    webhook_secret: SecretStr | None = Field(
        default=None,
        description="The webhook endpoint's signing secret (`whsec_…`, from the OpenAI dashboard).",
    )
    webhook_previous_secret: SecretStr | None = Field(
        default=None,
        description="The secret being rotated out: webhooks signed with either are accepted.",
    )
    webhook_max_bytes: int = Field(
        default=64 * 1024, gt=0, description="Largest webhook body taken (larger: 413, nothing stored)."
    )
    sweep_seconds: float = Field(
        default=30.0,
        gt=0,
        description="How often one replica pages each configured agent's sessions for those that "
        "require an action (what a dropped webhook, or none at all, leaves waiting).",
    )
    secret_fields: frozenset[str] = Field(
        default=DEFAULT_SECRET_FIELDS, description="Field names masked in logs and audit views."
    )
    log_format: Literal["auto", "text", "json"] = Field(
        default="auto",
        description="Log lines as text or JSON objects; `auto`: text on a terminal, JSON otherwise.",
    )
    api_tokens: dict[str, SecretStr] = Field(
        default_factory=dict,
        description="Audit API tokens with every right (read, resolve, watch), by the name recorded "
        'as the operator: JSON, e.g. {"alice": "a-long-random-token"}.',
    )
    api_read_tokens: dict[str, SecretStr] = Field(
        default_factory=dict,
        description="Audit API tokens that may only read (lists, details, sessions), by name: JSON.",
    )
    api_host: str = Field(
        default="127.0.0.1",
        description="Address the audit API listens on; any other than loopback needs a token.",
    )
    api_port: int = Field(
        default=8700, ge=0, le=65535, description="Port of the audit API; 0 picks a free one."
    )
    api_docs: bool = Field(
        default=False,
        description="Serve Swagger UI at /docs, its files from the installed `fastapi-offline` "
        "package (never a CDN); /openapi.json is served either way.",
    )
    metrics_token: SecretStr | None = Field(
        default=None,
        description="When set, GET /metrics needs `Authorization: Bearer` with this token or any "
        "audit API token (read tokens too); unset, /metrics is open to anyone who can reach it.",
    )
    alert_webhook_url: str | None = Field(
        default=None,
        description="`serve` POSTs a signed JSON alert here when a call needs a person: its outcome "
        "is unknown, it awaits approval, it is flagged unconfirmed, or recovery gave it up "
        "(docs/alerts.md). Needs TOOLLEDGER_ALERT_WEBHOOK_SECRET.",
    )
    alert_webhook_secret: SecretStr | None = Field(
        default=None,
        description="Key of the alerts' HMAC-SHA256 signature (the X-Toolledger-Signature header), "
        "shared with the receiver.",
    )
    alert_timeout_seconds: float = Field(
        default=10.0, gt=0, description="Longest wait for the alert webhook to answer one POST."
    )
    alert_retry_max_seconds: float = Field(
        default=300.0,
        gt=0,
        description="Longest pause between rounds of tries while the alert webhook fails; alerts "
        "wait meanwhile (in the ledger, in order) and none is dropped.",
    )
    public_url: str | None = Field(
        default=None,
        description="Where people reach the audit API (e.g. https://toolledger.example.com): "
        "alerts link to the call's page in its web view. Unset: alerts carry no link.",
    )

    trail_key: SecretStr | None = Field(
        default=None,
        description="Key of the audit trail's keyed mode (at least 32 bytes, e.g. `openssl rand "
        "-hex 32`): every event written carries an HMAC-SHA256 over its fields and the content it "
        "wrote, which someone who can write the database cannot recompute; `calls verify-trail "
        "--keyed` checks them (docs/audit-trail.md). Kept by every toolledger process that writes "
        "or verifies, never in the database.",
    )

    @field_validator("agent_ids", mode="before")
    @classmethod
    def _comma_separated(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(part.strip() for part in value.split(",") if part.strip())
        return value

    @field_validator("agent_ids")
    @classmethod
    def _agent_ids(cls, ids: tuple[str, ...]) -> tuple[str, ...]:
        for agent_id in ids:
            if not AGENT_ID.fullmatch(agent_id):
                raise ValueError(f"not an agent id: {agent_id[:80]!r} (letters, digits, _ and -)")
        return tuple(dict.fromkeys(ids))

    @field_validator("listen")
    @classmethod
    def _host_port(cls, listen: str | None) -> str | None:
        if listen is None or not listen.strip():
            return None
        host, _, port = listen.strip().rpartition(":")
        if not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ValueError("not HOST:PORT (e.g. 0.0.0.0:8080)")
        return listen.strip()

    @field_validator("webhook_secret", "webhook_previous_secret")
    @classmethod
    def _signing_secret(cls, secret: SecretStr | None) -> SecretStr | None:
        if secret is None or not secret.get_secret_value().strip():
            return None
        value = secret.get_secret_value().strip()
        if value.startswith("whsec_"):
            try:
                decoded = base64.b64decode(value[len("whsec_") :], validate=True)
            except binascii.Error:
                decoded = b""
            if not decoded:
                raise ValueError("a whsec_ secret must be base64 after its prefix")
        return SecretStr(value)

    @property
    def listen_address(self) -> tuple[str, int] | None:
        if self.listen is None:
            return None
        host, _, port = self.listen.rpartition(":")
        return host.strip("[]"), int(port)

    def intake_problem(self) -> str | None:
        """Why the intake settings cannot serve (None: they can, or there is no intake)."""
        if self.listen is not None and self.webhook_secret is None:
            return "`listen` takes signed webhooks: set TOOLLEDGER_WEBHOOK_SECRET (whsec_…)"
        if self.listen is not None and not self.agent_ids:
            return (
                "webhooks carry no agent id, and only the sessions of configured agents are "
                "answered: set TOOLLEDGER_AGENT_IDS (or serve --agent agt_…)"
            )
        return None

    @field_validator("trail_key")
    @classmethod
    def _long_enough(cls, key: SecretStr | None) -> SecretStr | None:
        if key is None or not key.get_secret_value():
            return None
        if len(key.get_secret_value().encode("utf-8")) < MIN_KEY_BYTES:
            raise ValueError(
                f"the trail key must be at least {MIN_KEY_BYTES} bytes (e.g. `openssl rand -hex 32`)"
            )
        return key

    @field_validator("alert_webhook_url", "public_url")
    @classmethod
    def _http_url(cls, url: str | None) -> str | None:
        """An http(s) address with a host, or nothing (blank counts as unset)."""
        if url is None or not url.strip():
            return None
        url = url.strip()
        parsed = urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError("not an http:// or https:// URL with a host")
        return url

    @field_validator("database_url")
    @classmethod
    def _async_driver(cls, url: str) -> str:
        return async_database_url(url)

    def agents_api_sources(self, environ: Mapping[str, str] | None = None) -> str:
        """Where the Agents API's address and key come from, for the start-up log (never the
        key itself): which variable, the SDK's own or toolledger's, or the defaults."""
        environ = os.environ if environ is None else environ
        names = {name.upper() for name in environ}

        def source(option: str, value: object) -> str:
            for variable in (f"TOOLLEDGER_{option.upper()}", SDK_VARIABLES[option][0]):
                if variable in names:
                    return variable
            return "given by a flag, in code or in .env" if value else "unset"

        url = self.openai_base_url or "the SDK's default (https://api.openai.com/v1)"
        key = "a key" if self.openai_api_key is not None else "no key"
        return (
            f"Agents API at {url} (base URL: {source('openai_base_url', self.openai_base_url)}), "
            f"{key} ({source('openai_api_key', self.openai_api_key)})"
        )

    @property
    def agents_api_configured(self) -> bool:
        """A key or a base URL is set (blank counts as unset): without one nothing is sent to
        the SDK's defaults (its public address, no key) that nobody chose."""
        key = self.openai_api_key.get_secret_value() if self.openai_api_key is not None else ""
        return bool(key.strip() or (self.openai_base_url or "").strip())

    def redactor(self) -> Redactor:
        """Redaction with the configured secret field names and the secrets toolledger holds
        (API key, database password, audit API and metrics tokens, alert webhook secret, trail
        key)."""
        tokens = (
            *self.api_tokens.values(),
            *self.api_read_tokens.values(),
            *((self.metrics_token,) if self.metrics_token is not None else ()),
        )
        secrets = [token.get_secret_value() for token in tokens]
        for secret in (
            self.openai_api_key,
            self.alert_webhook_secret,
            self.trail_key,
            self.webhook_secret,
            self.webhook_previous_secret,
        ):
            if secret is not None:
                secrets.append(secret.get_secret_value())
        password = make_url(self.database_url).password
        if password:
            secrets.append(str(password))
        return Redactor(self.secret_fields, secrets)

    @property
    def trail_key_value(self) -> TrailKey | None:
        """The trail's key (``trail_key``) as the stores take it; None when unset."""
        if self.trail_key is None:
            return None
        return TrailKey(self.trail_key.get_secret_value().encode("utf-8"))

    @property
    def heartbeat_interval(self) -> float:
        return self.heartbeat_seconds or self.lease_seconds / 3


SUPPORTED_DATABASES = {"sqlite": "aiosqlite", "postgresql": "psycopg"}
DATABASE_URL_FORMS = "sqlite:///path/to/ledger.sqlite3 or postgresql://user:password@host:5432/database"


def async_database_url(url: str) -> str:
    """``url`` with the async driver toolledger runs on, from the usual spellings
    (``postgresql://``, ``postgres://``, ``sqlite://``); ValueError for what no command could open."""
    for plain, driver in (
        ("postgres://", "postgresql+psycopg://"),
        ("postgresql://", "postgresql+psycopg://"),
        ("sqlite://", "sqlite+aiosqlite://"),
    ):
        if url.startswith(plain):
            url = driver + url[len(plain) :]
            break
    _check_database_url(url)
    return url


def _check_database_url(url: str) -> None:
    """Refuse what no command could open, saying why, before anything tries to: the messages
    never quote the URL (it may hold a password)."""
    try:
        parsed = make_url(url)
        parsed.port  # noqa: B018 - a port that is not a number is refused here, not later
    except (ArgumentError, ValueError):
        raise ValueError(
            f"not a database URL (or its port is not a number): use {DATABASE_URL_FORMS}"
        ) from None
    backend, driver = parsed.get_backend_name(), parsed.get_driver_name()
    if backend not in SUPPORTED_DATABASES:
        raise ValueError(
            f"{backend} is not supported: the ledger lives in SQLite or PostgreSQL ({DATABASE_URL_FORMS})"
        )
    if driver != SUPPORTED_DATABASES[backend]:
        raise ValueError(
            f"the {driver} driver is not supported: toolledger uses {backend}+{SUPPORTED_DATABASES[backend]}"
        )
