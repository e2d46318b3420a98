"""Triton kernels and their launchers; `tpfuse.strategies` decides which launcher runs.

- `epilogue`: residual-add + RMSNorm in one pass (and the row helper the fused kernels share).
- `sync`: the PCIe-safe waiting primitives (sentinel polling with a bounded spin, -0.0 canonicalisation).
- `oneshot`, `twoshot`: allreduce fused with the epilogue over peer buffers (Lamport protocol,
  described in `tpfuse.strategies.workspace`).
- `custom_ops`: `torch.library` registrations so torch.compile graphs can call the kernels.

Importing this package imports nothing; each module imports Triton when it is imported. Set
TRITON_INTERPRET=1 before importing a kernel module to run it on CPU tensors (tests do).
"""
