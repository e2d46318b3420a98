"""The pre-bound launch against Triton's own launch, on CPU with the launch stubbed.

`StubbedLaunches` keeps Triton's whole call path (binder, cache key, launch metadata) and records
what reaches the compiled kernel's C launcher, so each test compares the arguments a pre-bound
call hands the launcher with those of `kernel[grid](...)` for the same call, and checks which calls
must leave the pre-bound path (unaligned pointers, another device, a launch hook) and what
`check` refuses. The GPU tests of the epilogue (tests/kernels/test_epilogue.py) run the real thing.
"""

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                reason="TRITON_INTERPRET=1 makes interpreted kernels: nothing is pre-bound")

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from triton.runtime.jit import JITFunction  # noqa: E402

from tpfuse.kernels.launcher import StubbedLaunches, bind  # noqa: E402


@triton.jit(do_not_specialize=["M"])
def _kernel(x_ptr, peers, out_ptr, M, H, eps, BLOCK: tl.constexpr, FLAG: tl.constexpr, EXTRA: tl.constexpr = 3):
    pass


def _args(m=4, h=64, offset=0):
    x = torch.randn(m * h + 8)[offset:offset + m * h].view(m, h)
    peers = (torch.randn(m, h), torch.randn(m, h))
    return x, peers, torch.empty(m, h), m, h, 1e-6


META = dict(BLOCK=64, FLAG=True, num_warps=4)


def _plain(call):
    """A launcher call with empty hook chains written as None (Triton >= 3.5 passes its empty
    HookChain objects, the pre-bound launch None: the C launcher skips both alike)."""
    call = list(call)
    for i in (7, 8):
        if call[i] is not None and not getattr(call[i], "calls", True):
            call[i] = None
    return call


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if isinstance(x, tuple):
            _same(x, y)
        else:
            assert x is y if isinstance(x, torch.Tensor) else x == y, (x, y)


def _count_ordinary(monkeypatch):
    runs = []
    original = JITFunction.run

    def counting(self, *args, **kwargs):
        runs.append(kwargs.get("warmup"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(JITFunction, "run", counting)
    return runs


def test_a_prebound_call_hands_the_launcher_what_triton_s_own_launch_does(monkeypatch):
    args = _args()
    with StubbedLaunches(keep=8) as stub:
        _kernel[(3, 2)](*args, **META)
        launch = bind(_kernel, (3, 2), args, META, launch=True)
        runs = _count_ordinary(monkeypatch)
        later = _args(m=4)  # new tensors, another eps: the same variant
        later = later[:5] + (2e-5,)
        _kernel[(3, 2)](*later, **META)
        assert runs == [False]
        launch(*later)
        assert runs == [False], "the pre-bound call went through Triton's launch"
    assert launch.prebound and stub.launches == 4
    own, bound_first, own_later, prebound = map(_plain, stub.calls)
    _same(own, bound_first)
    _same(own_later, prebound)
    # grid, stream, function, metadata, then every parameter: the tuple, the constexprs, the default
    assert prebound[:6] == [3, 2, 1, StubbedLaunches.STREAM, StubbedLaunches.FUNCTION, StubbedLaunches.METADATA]
    assert prebound[-3:] == [64, True, 3] and prebound[-4] == 2e-5


def test_calls_that_triton_would_launch_otherwise_take_triton_s_launch(monkeypatch):
    args = _args()
    with StubbedLaunches(keep=0) as stub:
        launch = bind(_kernel, (3,), args, META, launch=True)
        runs = _count_ordinary(monkeypatch)
        unaligned = _args(offset=1)  # 4-byte offset: not a multiple of 16 bytes
        assert unaligned[0].data_ptr() % 16
        launch(*unaligned)
        assert runs == [False]
        peers_unaligned = args[:1] + ((args[1][0], unaligned[0]),) + args[2:]
        launch(*peers_unaligned)  # a pointer inside a tuple argument
        assert runs == [False, False]
        hook = triton.knobs.runtime.launch_enter_hook
        if not hasattr(hook, "add"):
            pytest.skip(f"Triton {triton.__version__} keeps no HookChain")

        def profiler(metadata):
            pass

        hook.add(profiler)
        try:
            launch(*args)  # a profiler's hook must see the launch: Triton's path hands it over
        finally:
            hook.remove(profiler)
        assert runs == [False, False, False]
        launch(*args)
        assert runs == [False, False, False]
        stub.device = 1
        launch(*args)  # another current device
        assert runs == [False, False, False, False]
    assert stub.launches == 6


def test_check_refuses_a_call_that_specialises_otherwise():
    args = _args()
    with StubbedLaunches():
        launch = bind(_kernel, (3,), args, META, launch=False)
        assert launch.prebound
        launch.check(*_args(m=7))  # M is not specialised; H still 64
        with pytest.raises(ValueError, match="specialise"):
            launch.check(*_args(h=1))  # H == 1 is a constant to Triton
        with pytest.raises(ValueError, match="specialise"):
            launch.check(*_args(h=40))  # 40 is not a multiple of 16
        with pytest.raises(ValueError, match="specialise"):
            x, peers, out, m, h, eps = _args()
            launch.check(x.half(), peers, out, m, h, eps)


def test_bound_on_unaligned_pointers_stays_on_triton_s_launch(monkeypatch):
    with StubbedLaunches() as stub:
        launch = bind(_kernel, (1,), _args(offset=1), META, launch=True)
        assert not launch.prebound
        runs = _count_ordinary(monkeypatch)
        launch(*_args())
        assert runs == [False] and stub.launches == 2


def test_stubbed_launches_leave_the_kernel_as_they_found_it():
    with StubbedLaunches():
        bind(_kernel, (1,), _args(), META, launch=True)
        assert _kernel.device_caches
    assert 0 not in _kernel.device_caches and JITFunction._do_compile.__name__ == "_do_compile"
