"""tpfuse.timing: the statistics, the rotated rounds, the one-call loop, the collective protocol
on 2 gloo ranks (max over ranks), the copy kernel under the Triton interpreter; GPU tier: events,
graph replays and the copy bandwidth, and tune and verify's interleaved timing of CUDA-graph
replays, so host launch cost stays out of the figures."""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from tpfuse import timing
from tpfuse.spawn import run_ranks


def test_summary_is_median_p20_p80_of_the_samples():
    samples = [float(v) for v in range(1, 11)]  # inclusive deciles of 1..10: 1.9, 2.8, ...
    got = timing.summary(samples)
    assert got == {"median": 5.5, "p20": pytest.approx(2.8), "p80": pytest.approx(8.2), "n": 10}
    assert timing.summary([7.0]) == {"median": 7.0, "p20": 7.0, "p80": 7.0, "n": 1}


def test_sample_rounds_rotate_the_order_by_one_per_round():
    order = []

    def sampler(name):
        return lambda: order.append(name) or float(len(order))

    got = timing.sample_rounds({n: sampler(n) for n in "abc"}, 4)
    assert order == list("abc" "bca" "cab" "abc")
    assert got["a"] == [1.0, 6.0, 8.0, 10.0] and [len(v) for v in got.values()] == [4, 4, 4]


def test_time_calls_warms_up_untimed_then_times_each_call():
    calls = []

    def fn():
        calls.append(time.perf_counter())
        time.sleep(0.002 if len(calls) > 2 else 0.05)  # the two warm-up calls are slow: not in the samples

    samples = timing.time_calls(fn, reps=5, warmup=2)
    assert len(calls) == 7 and len(samples) == 5
    assert all(2000 <= s < 40_000 for s in samples), samples


def test_time_calls_runs_at_least_min_seconds():
    samples = timing.time_calls(lambda: time.sleep(0.01), reps=1, warmup=0, min_seconds=0.1)
    assert len(samples) >= 9 and sum(samples) >= 0.09e6
    assert timing.time_calls(lambda: None, reps=0, warmup=3) == []  # warm-up only


def _interleaved_rank(rank, world_size):
    import torch.distributed as dist

    def slow():  # rank 1 is the slow one: every rank must report rank 1's time
        time.sleep(0.02 if rank == 1 else 0.001)

    info = {}
    got = timing.time_interleaved({"slow": slow, "fast": lambda: None}, group=dist.group.WORLD,
                                  device=torch.device("cpu"), rounds=3, warmup=1, info=info)
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        timing.time_interleaved({"fast": lambda: None}, group=dist.group.WORLD, device=torch.device("cpu"), rounds=0)
    return info["method"], got


def test_time_interleaved_reports_the_maximum_over_ranks():
    (m0, t0), (m1, t1) = run_ranks(_interleaved_rank, 2, timeout_s=120)
    assert m0 == m1 == "perf_counter"
    assert t0 == t1  # reduced across ranks: identical everywhere
    assert len(t0["slow"]) == 3 and min(t0["slow"]) >= 20_000, t0
    assert max(t0["fast"]) < min(t0["slow"])


@pytest.fixture
def interpreted(monkeypatch):
    """The copy kernel built for the Triton interpreter (CPU tensors), rebuilt for real afterwards."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    timing.reset_copy_kernel()
    yield
    timing.reset_copy_kernel()


def test_copy_kernel_copies_every_byte_of_any_dtype(interpreted):
    n = 2 * timing.COPY_BLOCK + 3  # int32 words: a ragged last program
    src = torch.randint(-2**30, 2**30, (n,), dtype=torch.int32).view(torch.bfloat16)
    dst = torch.full_like(src, float("nan"))
    timing.copy(src, dst)
    assert torch.equal(dst.view(torch.int32), src.view(torch.int32))
    with pytest.raises(ValueError, match="equal size in bytes, a multiple of 4"):
        timing.copy(src, torch.empty(n + 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="a multiple of 4"):
        timing.copy(torch.zeros(3, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.bfloat16))


@pytest.mark.gpu
def test_event_timing_and_graph_replays_see_device_time():
    spin = lambda: torch.cuda._sleep(500_000)  # about 0.25 ms of device time, no host cost  # noqa: E731
    events = timing.time_calls(spin, reps=3, device=torch.device("cuda"))
    assert min(events) > 50, events
    sampler = timing.graph_timer([spin, spin], reps=2)
    per_call = [sampler() for _ in range(3)]
    assert statistics.median(per_call) == pytest.approx(statistics.median(events), rel=0.5)


@pytest.mark.gpu
def test_copy_kernel_and_bandwidth_on_one_gpu():
    src = torch.randn(1 << 20, device="cuda").to(torch.bfloat16)
    dst = torch.full_like(src, float("nan"))
    timing.copy(src, dst)
    assert torch.equal(dst, src)
    got = timing.copy_bandwidth(3, 3, nbytes=256 << 20)
    assert set(got) == {"torch_copy", "triton_copy"} and all(len(s) == 3 and min(s) > 0 for s in got.values())
    gbps = {k: 2 * (256 << 20) / (statistics.median(s) * 1e-6) / 1e9 for k, s in got.items()}
    assert 0.3 < gbps["triton_copy"] / gbps["torch_copy"] < 3, gbps


def _graph_replay_rank(rank, world_size):
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


@pytest.mark.gpu
def test_graph_replays_keep_host_cost_out():
    ((method, got),) = run_ranks(_graph_replay_rank, 1, timeout_s=120)
    assert method == "cuda_graph"
    assert max(got["host"]) < 200, got["host"]  # eager event timing would include the 2 ms sleep
    assert min(got["device"]) > 50, got["device"]  # the spin kernel's device time is all there
