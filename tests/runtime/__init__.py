"""`src/toolledger/runtime`: the decider, the executor, the service, recovery and crashes."""
