"""`src/toolledger/store`: the ledger against real SQLite and PostgreSQL, migrations, liveness."""
