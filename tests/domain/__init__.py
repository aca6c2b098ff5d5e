"""The pure rules of `src/toolledger/domain`: keys, delivered calls, the transition catalogue."""
