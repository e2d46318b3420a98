"""The one-shot kernel (`tpfuse.kernels.oneshot`) against the reference.

Interpreter tier: the real kernel on CPU through TRITON_INTERPRET=1, one spawned process per rank
over shared-memory peer buffers (x86 ordering is stronger than a GPU's: these check the protocol's
logic, not memory ordering; shapes are tiny because the interpreter runs every program in Python).
Plain tier: the GPU build of the decode kernel lowers to PTX on CPU and ptxas assembles it.
GPU tier: W ranks emulated as W CUDA streams in one process (`support.peer.EmulatedRanks`), under
every launch option (programmatic dependent launch off / end trigger / entry trigger, the per-thread
spin on and off), and captured in a CUDA graph. The processes-on-one-GPU tests of the strategy are
in tests/strategies/test_peer.py.
"""

import pytest
import torch

from support.peer import EmulatedRanks, check_calls, check_outputs, check_split, check_split_quant

# Back-to-back calls with changing M (including M < W and the slot rotation several times over),
# changing inputs, with and without residual, and the plain allreduce.
CALLS = [(3, "int", "res"), (5, "rand", "res"), (1, "int", "none"), (4, "int", "ar"), (2, "rand", "res"),
         (7, "int", "res"), (1, "rand", "ar")]


@pytest.mark.interpreter
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_two_ranks_back_to_back_calls(dtype):
    check_calls("oneshot", 2, dtype, 64, CALLS)


@pytest.mark.interpreter
@pytest.mark.slow
def test_four_ranks():
    check_calls("oneshot", 4, torch.float16, 32, [(5, "int", "res"), (2, "rand", "res"), (9, "int", "ar"),
                                                   (3, "int", "res")])


@pytest.mark.interpreter
@pytest.mark.slow
def test_rows_split_over_chunks_match_the_reference():
    check_split("oneshot", 40, 16)  # three chunks a row, the last one partial


@pytest.mark.interpreter
@pytest.mark.slow
def test_split_rows_quantized_in_the_kernel_equal_the_reference():
    """Rows of three 64-element chunks: per-token FP8 exchanges each row's absmax between its
    chunks, per-group and NVFP4 scale blocks fall inside chunks, swizzled padding is zeroed."""
    check_split_quant("oneshot")


# ---- plain: the GPU build lowers on CPU ---------------------------------------------------------

@pytest.mark.parametrize("world, spin", [(8, 2), (8, 3), (2, 3), (8, 4), (2, 4)])
def test_decode_kernel_lowers_and_assembles_for_sm90(world, spin):
    """The one-pass decode kernel (one item a program, rows of 6 chunks, entry trigger) as a GPU
    build for sm_90: with spin 3 each poll first reloads the W - 1 other tags together (one
    predicated load per source in the tag wait), with spin 4 it reloads every source's 16-byte
    vector and tag together; ptxas takes the whole kernel."""
    import re

    from support.ptx import PEER_ALIGNED, assemble, assert_poll_vectorised, lower_to_ptx, peer_kernel_signature
    from tpfuse.kernels.oneshot import oneshot_kernel
    from tpfuse.kernels.peer_stages import PeerConfig, QuantOpts

    C = PeerConfig.of(world=world, world_p2=world, chunk=1024, num_chunks=6, num_chunks_p2=8, sentinel=-(1 << 15),
                      elem_bits=16, has_res=True, has_norm=True, split=True, use_asm=True, soft_bf16=False, pdl=2,
                      spin=spin, single=True, rows_owned=False, per_poll=1, per_push=1)
    sig, constexprs = peer_kernel_signature(world), {"C": C, "Q": QuantOpts.of()}
    ptx = lower_to_ptx(oneshot_kernel, sig, constexprs, PEER_ALIGNED, cc=90)
    tag_loads = set(re.findall(r"@[mn](\d+) ld\.volatile\.global\.b32", ptx))
    assert tag_loads == (set(map(str, range(world))) if spin >= 3 else set()), tag_loads
    vector_polls = re.findall(r"@n(\d+) ld\.volatile\.global\.v4\.b32", ptx)
    assert sorted(map(int, vector_polls)) == (list(range(world)) if spin >= 4 else []), vector_polls
    if spin >= 4:
        assert_poll_vectorised(lower_to_ptx(oneshot_kernel, sig, constexprs, PEER_ALIGNED, cc=90, stage="ttgir"))
    assert "griddepcontrol.wait" in ptx and "st.relaxed.sys.global.v4.b32" in ptx
    assemble(ptx)


@pytest.mark.parametrize("spin", [2, 4])
def test_per_token_split_rows_reduce_and_wait_for_both_partial_sets_at_once(spin):
    """Per-token FP8 with rows of 6 chunks, a GPU build for sm_90: each chunk's sum of squares and
    max |h * w| come from one block reduction (one barrier more than static FP8, not two), and
    the two sets of partials are waited for in one per-thread loop (12 tagged words reloaded a
    retry), not in two waits one after the other; ptxas takes the kernel."""
    import re

    from support.ptx import PEER_ALIGNED, assemble, lower_to_ptx, peer_kernel_signature
    from tpfuse.kernels.oneshot import oneshot_kernel
    from tpfuse.kernels.peer_stages import PeerConfig, QuantOpts
    from tpfuse.kernels.quant import KIND_FP8_STATIC, KIND_FP8_TOKEN

    C = PeerConfig.of(world=8, world_p2=8, chunk=1024, num_chunks=6, num_chunks_p2=8, sentinel=-(1 << 15),
                      elem_bits=16, has_res=True, has_norm=True, split=True, use_asm=True, soft_bf16=False, pdl=2,
                      spin=spin, single=True, rows_owned=False, per_poll=1, per_push=1)
    sig, constexprs = peer_kernel_signature(8), {"C": C, "Q": QuantOpts.of(kind=KIND_FP8_TOKEN)}
    ptx = lower_to_ptx(oneshot_kernel, sig, constexprs, PEER_ALIGNED, cc=90)
    blocks = re.findall(r"// begin inline asm(.*?)// end inline asm", ptx, flags=re.S)
    partial_loads = [len(re.findall(r"ld\.volatile\.global\.b64", b)) for b in blocks]
    assert [n for n in partial_loads if n] == [12], partial_loads
    static = lower_to_ptx(oneshot_kernel, sig, {"C": C, "Q": QuantOpts.of(kind=KIND_FP8_STATIC)}, PEER_ALIGNED, cc=90)
    barriers = [len(re.findall(r"bar\.sync", p)) for p in (static, ptx)]
    assert barriers[1] == barriers[0] + 1, barriers
    assemble(ptx)


def test_partials_asm_names_a_kind_it_does_not_know():
    from tpfuse.kernels.sync import partials_asm

    with pytest.raises(ValueError, match="'x' is not 's'"):
        partials_asm.fn(2, "sx")


# ---- GPU: W streams on one GPU -----------------------------------------------------------------

GPU_CALLS = [(1, "int", "res"), (1, "rand", "res"), (16, "int", "res"), (3, "int", "none"), (5, "int", "ar"),
             (1, "int", "res")]


# Each option is a compile of every variant the calls use, so the matrix is cut to what differs
# (benchmarks/bench_peer_kernels.py --suite variants checks every combination at 1 token as well).
@pytest.mark.gpu
@pytest.mark.parametrize("world, pdl, spin", [(8, 0, 0), (8, 2, 2), (8, 1, 1), (8, 2, 3), (8, 2, 4), (8, 1, 4),
                                              (2, 2, 2), (2, 2, 4), (2, 0, 0)])
def test_launch_options_give_the_reference_bits(world, pdl, spin):
    from tpfuse.kernels.peer_launch import LaunchOptions

    ranks = EmulatedRanks("oneshot", world, 6144, torch.bfloat16, 64, options=LaunchOptions(pdl=pdl, spin=spin))
    outs = [ranks.call(m, kind, mode, i) for i, (m, kind, mode) in enumerate(GPU_CALLS)]
    check_outputs(f"oneshot pdl={pdl} spin={spin}", [[o[r] for o in outs] for r in range(world)], world,
                  torch.bfloat16, 6144, GPU_CALLS)
    for ws in ranks.ws:
        ws.check()


@pytest.mark.gpu
@pytest.mark.parametrize("world, dtype", [(4, torch.float32), (3, torch.float16)])
def test_polling_every_source_at_once_gives_the_reference_bits_in_other_dtypes(world, dtype):
    """Spin 4 on 32-bit data (4 elements a vector) and on 16-bit data at an odd world size."""
    from tpfuse.kernels.peer_launch import LaunchOptions

    ranks = EmulatedRanks("oneshot", world, 4096, dtype, 64, options=LaunchOptions(pdl=2, spin=4))
    outs = [ranks.call(m, kind, mode, i) for i, (m, kind, mode) in enumerate(GPU_CALLS)]
    check_outputs(f"oneshot spin=4 {dtype}", [[o[r] for o in outs] for r in range(world)], world, dtype, 4096,
                  GPU_CALLS)
    for ws in ranks.ws:
        ws.check()


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["oneshot", "twoshot"])
def test_cuda_graph_replay_of_every_rank(name):
    """All ranks' calls captured in one graph (one stream each), replayed with new inputs: the
    epoch words advance on the device, so every replay gives the reference's bits."""
    from tpfuse.kernels.peer_launch import LaunchOptions
    from tpfuse.reference import all_reduce_residual_rmsnorm_ref, small_integer_inputs

    world, m, h = 4, 24, 4096
    ranks = EmulatedRanks(name, world, h, torch.bfloat16, m, options=LaunchOptions(pdl=1, spin=2))
    xs = [torch.zeros(m, h, dtype=torch.bfloat16, device="cuda") for _ in range(world)]
    res, w = torch.zeros_like(xs[0]), torch.zeros(h, dtype=torch.bfloat16, device="cuda")
    launches = [ranks.launch_for(r, m, True, True) for r in range(world)]
    outs = [[None] for _ in range(world)]

    def issue():
        for r in range(world):
            with torch.cuda.stream(ranks.streams[r]):
                outs[r][0] = launches[r](xs[r], res, w, 1e-6)

    issue()  # eager first: binds every launch
    torch.cuda.synchronize()
    main = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=main):
        for s in ranks.streams:
            s.wait_stream(main)
        issue()
        for s in ranks.streams:
            main.wait_stream(s)
    for step in range(4):
        for r in range(world):
            xs[r].copy_(small_integer_inputs(r, m, h, torch.bfloat16, seed=step))
            outs[r][0][0].fill_(float("nan"))
        res.copy_(small_integer_inputs(100, m, h, torch.bfloat16, seed=step))
        w.copy_(small_integer_inputs(101, 1, h, torch.bfloat16, seed=step)[0])
        graph.replay()
        torch.cuda.synchronize()
        ref = all_reduce_residual_rmsnorm_ref([x.cpu() for x in xs], res.cpu(), w.cpu())
        for r in range(world):
            assert torch.equal(outs[r][0][0].cpu(), ref[0]) and torch.equal(outs[r][0][1].cpu(), ref[1]), (step, r)
    for ws in ranks.ws:
        ws.check()
