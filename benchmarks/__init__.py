"""Benchmarks run by hand (``python -m benchmarks.<name>``); each prints its figures and can write JSON."""
