"""Running the shipped Alembic migrations from Python and from ``toolledger migrate``.

Whether a ledger is current is asked by every command that opens it: that question is
answered from the ``alembic_version`` table and ``HEAD`` alone, without importing Alembic or
reading its scripts (a tenth of a second or two of every command's start); Alembic is loaded
only to migrate.
"""

from __future__ import annotations

from importlib.resources import files
from typing import TYPE_CHECKING

from sqlalchemy import Connection, create_engine, inspect, pool, text

from toolledger.store.engine import sync_url

if TYPE_CHECKING:
    from alembic.config import Config

HEAD = "0012"
"""The newest revision shipped: tests/store/test_migrations.py holds it equal to the scripts'
head, so a new migration cannot be added without it."""


def alembic_config(database_url: str) -> Config:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(files("toolledger.migrations")))
    config.attributes["database_url"] = database_url
    return config


def upgrade(database_url: str, revision: str = "head") -> None:
    from alembic import command

    command.upgrade(alembic_config(database_url), revision)


def downgrade(database_url: str, revision: str = "base") -> None:
    from alembic import command

    command.downgrade(alembic_config(database_url), revision)


def head_revision(database_url: str) -> str | None:
    """The scripts' head, as Alembic reads it (``HEAD`` is the same, known without reading)."""
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config(database_url)).get_current_head()


def current_revision(database_url: str) -> str | None:
    """The ledger's revision (None: an empty database), read from ``alembic_version``."""
    engine = create_engine(sync_url(database_url), poolclass=pool.NullPool)
    try:
        with engine.connect() as conn:
            return revision_of(conn)
    finally:
        engine.dispose()


def revision_of(conn: Connection) -> str | None:
    """The revision ``alembic_version`` records on ``conn`` (None: never migrated)."""
    if not inspect(conn).has_table("alembic_version"):
        return None
    versions = [row[0] for row in conn.execute(text("SELECT version_num FROM alembic_version"))]
    if len(versions) > 1:
        raise RuntimeError(f"the ledger records several schema revisions at once: {sorted(versions)}")
    return versions[0] if versions else None


def is_current(database_url: str) -> bool:
    return current_revision(database_url) == HEAD
