"""The `toolledger` command as users run it (`src/toolledger/cli`)."""
