"""Lower a Triton kernel to PTX for a GPU this machine need not have, and assemble PTX with ptxas
(the plain tier: checks of what a kernel compiles to, on CPU). Each helper skips the calling test
with the reason when Triton's compiler internals or ptxas are not available."""

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
