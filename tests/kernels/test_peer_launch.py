"""The per-shape launch of the peer kernels (`tpfuse.kernels.peer_launch.PeerLaunch`), on CPU with
Triton's launch stubbed (`tpfuse.kernels.launcher.StubbedLaunches`): a steady call makes exactly one
launcher call (no second launch for the error words), and what a shape fixes is computed once.
"""

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                reason="TRITON_INTERPRET=1 makes interpreted kernels: nothing is pre-bound")
pytest.importorskip("triton")


def _launch(name="oneshot", world=2, m=3, h=64, **kw):
    from tpfuse.kernels.oneshot import oneshot_kernel
    from tpfuse.kernels.peer_launch import LaunchOptions, PeerLaunch
    from tpfuse.kernels.protocol import make_plan, region_elems_for, tag_words_for
    from tpfuse.kernels.twoshot import twoshot_kernel
    from tpfuse.strategies.workspace import emulated_workspaces

    twoshot = name == "twoshot"
    plan = make_plan(m, h, 2, 4)
    (ws, *_) = emulated_workspaces(world, device="cpu", dtype=torch.bfloat16,
                                   region_elems=region_elems_for(m, h, world, plan, twoshot=twoshot),
                                   num_regions=world + int(twoshot), tag_words=tag_words_for(plan, m), timeout_s=1.0)
    kernel = twoshot_kernel if twoshot else oneshot_kernel
    return ws, PeerLaunch(kernel, name, ws, m, h, torch.bfloat16, has_res=True, has_norm=True, quant=None, plan=plan,
                          max_programs=4, timeout_s=1.0, twoshot=twoshot, options=LaunchOptions(pdl=2, spin=2),
                          **kw)


@pytest.mark.parametrize("name", ["oneshot", "twoshot"])
def test_a_steady_call_is_one_launch(name):
    from tpfuse.kernels.launcher import StubbedLaunches

    ws, launch = _launch(name)
    x, res, w = torch.randn(3, 64).bfloat16(), torch.randn(3, 64).bfloat16(), torch.randn(64).bfloat16()
    with StubbedLaunches(keep=8) as stub:
        launch(x, res, w, 1e-6)  # binds (Triton's own launch, once)
        first = stub.launches
        for _ in range(5):
            ws.before_call()
            normed, new_res = launch(x, res, w, 1e-6)
        assert stub.launches - first == 5  # one launch a call, nothing else (no error-word copy)
        assert launch._launch.prebound
        args = stub.calls[-1]
        assert args[9] is x and args[10] is res  # after (grid, stream, function, metadata, hooks...)
    assert normed.shape == new_res.shape == x.shape and normed.untyped_storage().data_ptr() != \
        new_res.untyped_storage().data_ptr()


def test_shape_facts_are_fixed_at_construction():
    m = 2 * 4  # two ranks, each with as many rows as its plan's 4 programs
    ws, launch = _launch("twoshot", world=2, m=m)
    assert bool(launch.C.rows_owned) and not bool(launch.C.split)  # enough rows a rank: whole rows
    _, forced = _launch("twoshot", world=2, m=m, owns_rows=False)
    assert not bool(forced.C.rows_owned)
    _, small = _launch("twoshot", world=2, m=3)
    assert not bool(small.C.rows_owned)
    assert int(launch.C.pdl) == 2 and launch.grid == (min(launch.plan.items, 4),)
    # whole-row owners holding several items scatter TWOSHOT_PER_PUSH a step; chunk owners one
    from tpfuse.kernels.peer_launch import TWOSHOT_PER_PUSH

    assert -(-launch.plan.items // launch.grid[0]) > 1 and int(launch.C.per_push) == TWOSHOT_PER_PUSH > 1
    assert int(small.C.per_push) == 1 and int(_launch("twoshot", world=2, m=m, per_push=2)[1].C.per_push) == 2


@pytest.mark.parametrize("per_push", [0, 3, -4])
def test_scatter_steps_that_are_not_a_power_of_two_are_refused(per_push):
    with pytest.raises(ValueError, match="power of two"):
        _launch("twoshot", world=2, m=8, per_push=per_push)


def test_twoshot_whole_rows_refuse_quantizing_in_the_kernel():
    from tpfuse import quant as Q
    from tpfuse.kernels.oneshot import oneshot_kernel  # noqa: F401  (the module imports)
    from tpfuse.kernels.peer_launch import PeerLaunch

    ws, launch = _launch("twoshot", world=2, m=3, owns_rows=True)
    with pytest.raises(ValueError, match="whole-row owners"):
        PeerLaunch(launch.kernel, "twoshot", ws, 3, 64, torch.bfloat16, has_res=True, has_norm=True,
                   quant=Q.fp8_per_token(), plan=launch.plan, max_programs=4, timeout_s=1.0, twoshot=True,
                   owns_rows=True)


class _FakeLaunch:
    """A launch whose compile records whether it ran inside Triton's concurrent compile mode."""

    def __init__(self, log):
        self.log = log

    def _warmup(self):
        from triton.runtime import _async_compile

        self.log.append(("warmup", _async_compile.active_mode.get() is not None))

    def compile(self):
        self.log.append(("compile", None))


@pytest.mark.parametrize("outer", [False, True], ids=["alone", "inside a caller's AsyncCompileMode"])
def test_compile_all_compiles_concurrently_then_checks_each_one(monkeypatch, outer):
    """Every variant's compile is submitted inside triton.AsyncCompileMode (so they run on worker
    threads), then each launch's compile() loads it and checks residency; where a caller's mode is
    already active in this context, each launch compiles one by one instead of failing."""
    import concurrent.futures
    import contextlib

    import triton

    from tpfuse.kernels import peer_launch

    if not hasattr(triton, "AsyncCompileMode"):
        pytest.skip(f"Triton {triton.__version__} has no AsyncCompileMode")
    monkeypatch.setattr(peer_launch, "interpreting", lambda: False)
    log = []
    with contextlib.ExitStack() as stack:
        if outer:
            pool = stack.enter_context(concurrent.futures.ThreadPoolExecutor(1))
            stack.enter_context(triton.AsyncCompileMode(pool))
        peer_launch.compile_all([_FakeLaunch(log) for _ in range(3)])
    want = [("compile", None)] * 3 if outer else [("warmup", True)] * 3 + [("compile", None)] * 3
    assert log == want


@pytest.mark.parametrize("field, value", [("pdl", 3), ("pdl", -1), ("spin", 5), ("spin", -1)])
def test_launch_options_refuse_values_outside_their_levels(field, value):
    from tpfuse.kernels.peer_launch import LaunchOptions

    with pytest.raises(ValueError, match=f"LaunchOptions: {field}={value!r} is not"):
        LaunchOptions(**{field: value})
    assert LaunchOptions(pdl=2, spin=3).spin == 3
