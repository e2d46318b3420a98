"""Benchmarks and their result rows (`fusegate.bench.results`)."""
