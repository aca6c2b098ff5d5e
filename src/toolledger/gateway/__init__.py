"""The gateway: the only code that talks to the Agents API (the openai SDK).

Owns ``AgentsGateway`` (retrieve, list, stream events, submit tool results with a
deterministic Idempotency-Key), the classification of the SDK's exceptions, and the one retry
policy. Imports the domain and the shared foundations, never the store, the runtime or
anything above them; ``runtime.composition`` builds it, and imports it (and openai) only then.
"""
