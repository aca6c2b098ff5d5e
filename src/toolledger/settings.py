"""Configuration, from ``TOOLLEDGER_*`` environment variables or a ``.env`` file."""

from __future__ import annotations

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from toolledger.domain.redaction import DEFAULT_SECRET_FIELDS

DEFAULT_DATABASE_URL = "sqlite+aiosqlite:///toolledger.sqlite3"


class Settings(BaseSettings):
    """Every option of toolledger; each one is also ``TOOLLEDGER_<NAME>``."""

    model_config = SettingsConfigDict(env_prefix="TOOLLEDGER_", env_file=".env", extra="ignore")

    database_url: str = Field(
        default=DEFAULT_DATABASE_URL,
        description="Ledger database: a SQLite file (default) or postgresql+psycopg://user:pass@host/db.",
    )
    openai_api_key: SecretStr | None = Field(default=None, description="API key for the Agents API.")
    openai_base_url: str | None = Field(
        default=None, description="Agents API base URL; point it at `toolledger emulator` to test."
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
    max_output_bytes: int = Field(default=1024 * 1024, gt=0, description="Largest tool output submitted.")
    max_attempts: int = Field(default=3, ge=1, description="Claims of one call before it is given up.")
    submit_attempts: int = Field(
        default=6, ge=1, description="Tries of one submission before the reconciler."
    )
    secret_fields: frozenset[str] = Field(
        default=DEFAULT_SECRET_FIELDS, description="Field names masked in logs and audit views."
    )

    @field_validator("database_url")
    @classmethod
    def _async_driver(cls, url: str) -> str:
        """Accept the usual spellings and pick the async drivers toolledger runs on."""
        for plain, driver in (
            ("postgres://", "postgresql+psycopg://"),
            ("postgresql://", "postgresql+psycopg://"),
            ("sqlite://", "sqlite+aiosqlite://"),
        ):
            if url.startswith(plain):
                return driver + url[len(plain) :]
        return url

    @property
    def heartbeat_interval(self) -> float:
        return self.heartbeat_seconds or self.lease_seconds / 3
