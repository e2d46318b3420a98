"""GPU tier: tune and verify time CUDA-graph replays, so host launch cost stays out of the figures."""

import time

import pytest
import torch

from tpfuse.spawn import run_ranks

pytestmark = pytest.mark.gpu


def _rank(rank, world_size):
    import torch.distributed as dist

    from tpfuse.timing import time_interleaved

    torch.cuda.set_device(0)
    x = torch.randn(1024, device="cuda")

    def host_heavy():  # 2 ms of host work before a tiny kernel: what a slow launch path looks like
        time.sleep(0.002)
        x.mul_(1.0)

    def device_heavy():  # about 0.25 ms of device time (a spin kernel), no host cost
        torch.cuda._sleep(500_000)

    info = {}
    got = time_interleaved({"host": host_heavy, "device": device_heavy}, group=dist.group.WORLD,
                           device=torch.device("cuda"), rounds=3, warmup=1, info=info)
    return info["method"], got


def test_graph_replays_keep_host_cost_out():
    ((method, got),) = run_ranks(_rank, 1, timeout_s=120)
    assert method == "cuda_graph"
    assert max(got["host"]) < 200, got["host"]  # eager event timing would include the 2 ms sleep
    assert min(got["device"]) > 50, got["device"]  # the spin kernel's device time is all there
