"""Lower a Triton kernel to PTX for a GPU this machine need not have, and assemble PTX with ptxas
(the plain tier: checks of what a kernel compiles to, on CPU). Each helper skips the calling test
with the reason when Triton's compiler internals or ptxas are not available. Also the Triton
signature of the peer kernels (oneshot_kernel and twoshot_kernel take the same parameters)."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest


def lower_to_ptx(kernel, signature: dict, constexprs: dict, aligned=(), cc: int = 90, num_warps: int = 4,
                 stage: str = "ptx") -> str:
    """PTX of `kernel` for sm_`cc` (or the text of an earlier `stage`: "ttir", "ttgir", "llir"):
    `signature` maps every parameter to its Triton type (or "constexpr"), `constexprs` gives the
    constexpr values, `aligned` names the parameters specialised as 16-divisible (pointers 16-byte
    aligned, integers multiples of 16)."""
    pytest.importorskip("triton")
    try:
        from triton._C.libtriton import ir
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import CUDABackend
        from triton.compiler import ASTSource
    except ImportError as exc:
        pytest.skip(f"Triton's compiler internals are not importable here: {exc}")
    names = list(signature)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned if n in names}
    target = GPUTarget("cuda", cc, 32)
    backend = CUDABackend(target)
    src = ASTSource(kernel, signature, constexprs, attrs)
    options = backend.parse_options({"num_warps": num_warps})
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    mod = src.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context)
    stages, metadata = {}, {}
    backend.add_stages(stages, options, src.language)
    for name in ("ttir", "ttgir", "llir", "ptx"):
        mod = stages[name](mod, metadata)
        if name == stage:
            break
    return str(mod)


def assemble(ptx: str) -> None:
    """Assemble `ptx` for the target it names with ptxas (Triton's own, else one on PATH); fails
    the test with ptxas's message when it does not assemble."""
    triton = pytest.importorskip("triton")
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    ptxas = next((str(p) for p in (bin_dir / "ptxas-blackwell", bin_dir / "ptxas") if p.exists()),
                 shutil.which("ptxas"))
    if ptxas is None:
        pytest.skip("no ptxas to assemble the PTX with")
    arch = re.search(r"\.target (sm_\w+)", ptx).group(1)
    proc = subprocess.run([ptxas, f"-arch={arch}", "-o", "/dev/null", "-"], input=ptx, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


def peer_kernel_signature(world: int) -> dict:
    """Triton types of the peer kernels' parameters for bf16 data and no quantization."""
    p = "*bf16"
    return {"x_ptr": p, "res_ptr": p, "w_ptr": p, "out_ptr": p, "newres_ptr": p, "bufs": (p,) * world,
            "local_ptr": p, "part_ptr": "*i64", "state_ptr": "*i32", "err_ptr": "*i32", "errmap_ptr": "*i32",
            "qargs": (p, "i32", p, "i32", "i32", p, "fp32"), "rank": "i32", "M": "i32", "H": "i32",
            "region": "i64", "header": "i32", "tag_words": "i32", "eps": "fp32", "timeout_ns": "i64",
            "max_spins": "i64", "C": "constexpr", "Q": "constexpr"}


# what a launch specialises (16-byte aligned pointers, sizes divisible by 16), as a real call has it
PEER_ALIGNED = ("x_ptr", "res_ptr", "w_ptr", "out_ptr", "newres_ptr", "local_ptr", "H", "region", "header")


def assert_poll_vectorised(ttgir: str) -> None:
    """Every `sync.poll_sources` poll in `ttgir` has 8 consecutive bf16 elements a thread: its
    assembly reads a whole 16-byte vector at the first element's address."""
    polls = [line for line in ttgir.splitlines() if 'elementwise_inline_asm "{ .reg .pred pl, pt, pq' in line]
    assert polls, "no poll_sources poll in the kernel"
    for poll in polls:
        layout = re.search(r"-> tensor<1x\d+xbf16, (#\w+)>", poll).group(1)
        assert re.search(rf"^{layout} = #ttg.blocked<{{sizePerThread = \[1, 8\]", ttgir, re.M), (layout, poll[-300:])
