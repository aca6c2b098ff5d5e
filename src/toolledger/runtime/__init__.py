"""The runtime: running a registry's tools through the ledger.

Owns the composition root (``composition.Runtime``: the one place that builds the engine,
the Agents API gateway, the redactor and the stores from the settings), the tool registry
and its loading, tool contexts, the executor of one call's life, the reconciler, the
long-running ``Service`` and ``ToolLedger``. Imports the store, the gateway, the domain and
the shared foundations; never the audit views, the CLI or the emulator.
"""
