"""The audit API, the web view and the operator views, against ledgers filled by real runs."""
