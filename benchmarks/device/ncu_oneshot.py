"""One oneshot call (W=1, 1 token x 6144, bf16) after warm-up, for an ncu stall breakdown:

    ncu --clock-control none -k regex:oneshot_kernel --launch-skip 3 --launch-count 1 \
        --section WarpStateStats --section SchedulerStats --section SpeedOfLight \
        python benchmarks/device/ncu_oneshot.py

W=1 because ncu serialises kernels: ranks emulated as streams would wait on each other forever.
"""

import sys

import torch

sys.path.insert(0, "benchmarks")
from bench_peer_kernels import Case  # noqa: E402

case = Case("oneshot", 1, (1,), 6144, torch.bfloat16)
for j in range(4):
    case.call(0, j)
torch.cuda.synchronize()
print("ok" if case.check()[0] else case.check()[1])
