"""Running the shipped Alembic migrations from Python and from ``toolledger migrate``."""

from __future__ import annotations

from importlib.resources import files

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, pool

from toolledger.store.engine import sync_url


def alembic_config(database_url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(files("toolledger.migrations")))
    config.attributes["database_url"] = database_url
    return config


def upgrade(database_url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(database_url), revision)


def downgrade(database_url: str, revision: str = "base") -> None:
    command.downgrade(alembic_config(database_url), revision)


def head_revision(database_url: str) -> str | None:
    return ScriptDirectory.from_config(alembic_config(database_url)).get_current_head()


def current_revision(database_url: str) -> str | None:
    engine = create_engine(sync_url(database_url), poolclass=pool.NullPool)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()


def is_current(database_url: str) -> bool:
    return current_revision(database_url) == head_revision(database_url)
