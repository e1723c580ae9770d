"""Benchmarks: `python -m bench.<name> [--quick]`; a table, then a JSON line of figures."""
