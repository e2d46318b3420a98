"""Benchmarks and their result rows (`tpfuse.bench.results`)."""
