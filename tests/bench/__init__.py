"""The benchmarks' smoke tests: each ``bench.*`` driver runs as users run it (``--quick``)."""
