"""diagnose: NVML sampling of power against the power limit, utilisation, clocks and memory while a
workload runs, and the analysis that names the design story's signature (GPUs busy with kernels yet
drawing little power: waiting on communication or on launches), idle GPUs and uneven ranks.

The modules and what each is for: docs/ARCHITECTURE.md. Importing this package imports neither NVML
nor matplotlib.
"""

from tpfuse.diagnose.analysis import find, summarise, thresholds
from tpfuse.diagnose.samples import Finding, GpuMeta, GpuSummary, Recording, Sample, load_recording, save_recording

__all__ = ["Finding", "GpuMeta", "GpuSummary", "Recording", "Sample", "find", "load_recording", "save_recording",
           "summarise", "thresholds"]
