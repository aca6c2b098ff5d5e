"""Pure rules of the ledger: keys, states, effect classes, results, redaction. No I/O here."""
