"""`src/toolledger/gateway`: what an Agents API answer means, and its event streams."""
