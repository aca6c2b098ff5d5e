"""Audit: what operators see and do, over the runtime's ledger.

Owns ``AuditService`` (list, show, count, export, resolve, prune calls; list and watch
sessions), its masked views, the HTTP API with its bearer-token auth, probes and metrics,
and the web view's files. Everything it opens comes from a ``runtime.composition.Runtime``.
Imports the runtime and below; never the CLI.
"""
