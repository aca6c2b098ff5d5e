"""The store: the only code that talks SQL.

Owns the schema (tables, indexes), engines and the database clock, the ledger's transitions
(one transaction each, with their audit events), sessions and replicas with their leases,
liveness (who is provably gone), audit queries and pruning, what the operator's probes read
(``operator_views``), and migrations. Imports the domain and the shared foundations
(settings, errors, metrics), never the gateway, the runtime or anything above them.
"""
