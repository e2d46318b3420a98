"""The measured fabric probe: its kernels on CPU (Triton interpreter), its checks on one GPU,
and the full measurement on two or more GPUs."""

import pytest
import torch

from tpfuse import timing
from tpfuse.probe import fabric


def _gpus():
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.fixture
def interpreted(monkeypatch):
    """The probe kernels built for the Triton interpreter (CPU tensors), rebuilt for real afterwards."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(fabric, "_KERNELS", None)
    timing.reset_copy_kernel()
    yield fabric._kernels()
    fabric._KERNELS = None
    timing.reset_copy_kernel()


@pytest.mark.interpreter
def test_copy_scatter_and_chase_kernels_compute_what_they_time(interpreted):
    copy_kernel, scatter_kernel, chase_kernel = interpreted
    n = 3 * timing.COPY_BLOCK - 5  # a ragged last program
    src = torch.randint(-2**30, 2**30, (n,), dtype=torch.int32)
    dst = torch.full((n,), -1, dtype=torch.int32)
    copy_kernel[(3,)](src.data_ptr(), dst.data_ptr(), n, BLOCK=timing.COPY_BLOCK)
    assert torch.equal(dst, src)

    peers = [torch.full((n,), -1, dtype=torch.int32) for _ in range(3)]
    table = torch.tensor([p.data_ptr() for p in peers], dtype=torch.int64)
    scatter_kernel[(3 * 3,)](src.data_ptr(), table, n, 3, BLOCK=timing.COPY_BLOCK)
    assert all(torch.equal(p, src) for p in peers)

    host, order = fabric._chain(97, seed=3)
    assert sorted(order) == list(range(97))
    out = torch.full((1,), -1, dtype=torch.int32)
    chase_kernel[(1,)](host.data_ptr(), out, STEPS=250)
    idx = int(host[0])
    for _ in range(250):
        idx = int(host[idx])
    assert int(out) == idx


@pytest.mark.skipif(_gpus() >= 2, reason="checks the refusal with fewer than 2 GPUs; this machine has more")
def test_fewer_than_two_gpus_is_a_clear_error():
    from tpfuse.probe import probe

    with pytest.raises(RuntimeError, match=f"needs 2 or more GPUs in this process, torch sees {_gpus()}"):
        fabric.measure_fabric(probe())


def _torch_copy_gbps(n, device):
    src = torch.arange(n, dtype=torch.int32, device=device)
    dst = torch.empty_like(src)
    us = fabric._median_us(lambda: dst.copy_(src), torch.device(device).index or 0, 10)
    return n * 4 / (us * 1e-6) / 1e9


@pytest.mark.gpu
def test_kernels_on_one_gpu_against_torch_copy():
    """Local memory (a == b): the same code path as a peer pair, checked on a single GPU. The
    Triton copy is compared with torch's own device copy, timed the same way."""
    m = fabric.measure_pair(0, 0, nbytes=64 << 20, reps=10, steps=2000)
    ref = _torch_copy_gbps((64 << 20) // 4, "cuda:0")
    for gbps in (m.read_gbps, m.write_gbps):
        assert 0.25 * ref < gbps < 2.0 * ref, (gbps, ref)
    # A dependent load from device memory costs between a few hundred ns and a few us.
    assert 0.05 < m.latency_us < 20.0, m


@pytest.mark.multi_gpu
def test_every_peer_pair_is_measured():
    from tpfuse.probe import probe

    result = fabric.measure_fabric(probe(), nbytes=16 << 20, reps=5)
    count = torch.cuda.device_count()
    expected = {(a, b) for a in range(count) for b in range(count)
                if a != b and torch.cuda.can_device_access_peer(a, b)}
    assert {(p.a, p.b) for p in result.pairs} == expected
    for p in result.pairs:
        assert p.read_gbps > 0.5 and p.write_gbps > 0.5 and 0.1 < p.latency_us < 100.0, p
    assert result.prefers in ("push", "pull") and result.all_to_all_score > 0
