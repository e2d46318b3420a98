"""Helpers shared by tests in several folders: the fake NVML and the test-only strategies that spawned
ranks load through TPFUSE_STRATEGIES as `support.<module>:<Class>` (tests/ is on their path)."""
