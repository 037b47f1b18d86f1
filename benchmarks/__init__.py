"""Benchmarks, each ours against its named baseline: run them all with ``make bench``."""
