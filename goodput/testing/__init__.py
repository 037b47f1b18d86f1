"""Test helpers shipped with the package so benchmarks and later parts can reuse them."""
