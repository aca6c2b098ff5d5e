"""The domain: the ledger's pure rules, which every other layer builds on.

Owns call and idempotency keys, call states and their allowed transitions, effect classes,
the result payloads the model is given, audit queries as values (filters, cursors,
references), records of calls and sessions, and redaction. No I/O: no SQLAlchemy, no openai,
no clock or environment reads, and no import of anything in toolledger outside this folder
(``lint-imports`` holds it to that).
"""
