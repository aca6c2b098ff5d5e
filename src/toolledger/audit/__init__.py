"""Audit views of the ledger (CLI, HTTP API, web view)."""
