"""toolledger: durable, idempotent execution of function tools for OpenAI Agents API sessions."""

__version__ = "0.1.0"
