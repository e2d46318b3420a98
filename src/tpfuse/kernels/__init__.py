"""Triton kernels and their launchers; `tpfuse.strategies` decides which launcher runs.

The modules and what each is for: docs/ARCHITECTURE.md. Importing this package imports nothing; each
module imports Triton when it is imported. Set TRITON_INTERPRET=1 before importing a kernel module to
run it on CPU tensors (tests do).
"""
