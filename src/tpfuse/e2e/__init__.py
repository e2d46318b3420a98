"""End-to-end measurement of the reference model: decode steps (`bench e2e`) and the per-stage profile."""
