"""Helpers shared by tests in several files: the fake NVML and fake torch, the QuantOutput packing, the
peer harnesses, and the test-only strategies that spawned ranks load through TPFUSE_STRATEGIES as
`support.<module>:<Class>` (tests/ is on their path)."""
