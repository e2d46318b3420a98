"""The probe's link source (`tpfuse.probe.links`) on a fake torch: peer access, native atomics and
NVML's link kind combined per ordered pair, unknowns said with notes; libcudart found in the
process map."""

from __future__ import annotations

from support.fake_torch import fake_torch
from tpfuse.probe.capabilities import GpuInfo
from tpfuse.probe.links import _loaded_libraries, read_links
from tpfuse.probe.nvml import NvmlPair


def _gpus(n):
    return [GpuInfo(i, "G", None, (9, 0), 1, None, None, 1, None, None, None, None) for i in range(n)]


def test_links_combine_peer_access_atomics_and_nvml_kind():
    pairs = {(0, 1): NvmlPair("nvlink", 18, "switch", "node"), (1, 0): NvmlPair("pcie", None, None, "system")}
    torch = fake_torch(peers={(0, 1)})
    links, notes = read_links(torch, _gpus(2), pairs, atomics=lambda a, b: int(a < b))
    by = {(l.a, l.b): l for l in links}
    assert by[(0, 0)].kind == "same_device" and by[(0, 0)].peer_access and by[(0, 0)].native_atomics
    l01, l10 = by[(0, 1)], by[(1, 0)]
    assert (l01.peer_access, l01.kind, l01.nvlink_count, l01.nvlink_via, l01.pcie_level, l01.native_atomics) == (
        True, "nvlink", 18, "switch", "node", True)
    assert (l10.peer_access, l10.kind, l10.pcie_level, l10.native_atomics) == (False, "pcie", "system", False)
    assert notes == []


def test_links_without_nvml_or_atomics_say_unknown_with_notes():
    def broken(a, b):
        raise RuntimeError("cudaDeviceGetP2PAttribute(0, 1) returned cudaError 101")

    links, notes = read_links(fake_torch(peers=None), _gpus(2), {}, atomics=broken)
    l01 = next(l for l in links if (l.a, l.b) == (0, 1))
    assert (l01.kind, l01.peer_access, l01.native_atomics) == ("unknown", False, None)
    assert "GPU pairs 0->1, 1->0: cudaDeviceGetP2PAttribute(0, 1) returned cudaError 101" in notes
    assert any(n.startswith("GPU pairs 0->1, 1->0: can_device_access_peer: peer query failed") for n in notes)
    _, notes = read_links(fake_torch(peers=set()), _gpus(2), {}, atomics=None,
                          atomics_unavailable="no loadable libcudart")
    assert notes == ["native peer atomics unknown: no loadable libcudart"]


def test_loaded_libraries_are_read_from_the_process_map(tmp_path):
    maps = tmp_path / "maps"
    cudart = "/venv/lib/python3.11/site-packages/nvidia/cu13/lib/libcudart.so.13"
    maps.write_text(
        f"7f0000000000-7f0000001000 r-xp 00000000 08:01 1 {cudart}\n"
        f"7f0000001000-7f0000002000 r--p 00001000 08:01 1 {cudart}\n"
        "7f0000003000-7f0000004000 r-xp 00000000 08:01 2 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
    )
    assert _loaded_libraries("libcudart.so", maps=str(maps)) == [cudart]
    assert _loaded_libraries("libcudart.so", maps=str(tmp_path / "missing")) == []
