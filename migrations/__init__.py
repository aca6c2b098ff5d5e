"""Alembic migrations of the ledger, installed as ``toolledger.migrations``."""
