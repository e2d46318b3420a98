"""The quantized epilogue compiles for GPUs this machine does not have: Triton's frontend and
NVIDIA backend lower it to PTX on CPU (no ptxas, no driver). Checks what the capability-based
admission claims: the software conversion needs no e4m3 / e2m1 instruction (so SM80 runs it), the
hardware path on sm_90 is cvt.rn.satfinite (round to nearest even, saturating), and the codes
leave in 128-bit stores. Plain CPU tier; skipped where Triton's compiler internals differ.
"""

import re

import pytest

triton = pytest.importorskip("triton")

SIG = {"s_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "newres_ptr": "*bf16", "M": "i32",
       "H": "i32", "eps": "fp32", "q_ptr": "*u8", "q_row_stride": "i32", "sc_ptr": "*fp32", "s_row_stride": "i32",
       "s_col_stride": "i32", "param_ptr": "*fp32", "scale_ub": "fp32", "BLOCK_H": "constexpr", "ROWS": "constexpr",
       "HAS_RES": "constexpr", "SOFT_BF16": "constexpr", "WITH_NORMED": "constexpr", "KIND": "constexpr",
       "GROUP": "constexpr", "SWIZZLED": "constexpr", "HAS_UB": "constexpr", "HW_CVT": "constexpr"}
ALIGNED = ("s_ptr", "res_ptr", "w_ptr", "out_ptr", "newres_ptr", "H", "q_ptr", "q_row_stride", "sc_ptr", "param_ptr")


def _ptx(cc: int, kind: int, group: int, swizzled: bool, hw: int) -> str:
    try:
        from triton._C.libtriton import ir
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import CUDABackend
        from triton.compiler import ASTSource
    except ImportError as exc:
        pytest.skip(f"Triton's compiler internals are not importable here: {exc}")
    from tpfuse.kernels.epilogue import residual_rmsnorm_quant_kernel

    sig = dict(SIG, sc_ptr="*u8" if kind == 4 else "*fp32")
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ALIGNED}
    constexprs = {"BLOCK_H": 8192, "ROWS": 1, "HAS_RES": True, "SOFT_BF16": False, "WITH_NORMED": False, "KIND": kind,
                  "GROUP": group, "SWIZZLED": swizzled, "HAS_UB": False, "HW_CVT": hw}
    target = GPUTarget("cuda", cc, 32)
    backend = CUDABackend(target)
    src = ASTSource(residual_rmsnorm_quant_kernel, sig, constexprs, attrs)
    options = backend.parse_options({"num_warps": 16})
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    mod = src.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context)
    stages, metadata = {}, {}
    backend.add_stages(stages, options, src.language)
    for name in ("ttir", "ttgir", "llir", "ptx"):
        mod = stages[name](mod, metadata)
    return mod


def test_software_and_hardware_paths_lower_as_admitted():
    sm80 = _ptx(80, 2, 16, False, 0)  # fp8 per token, software
    assert not re.search(r"cvt\.[a-z.]*e4m3", sm80) and "st.global.v4.b32" in sm80
    sm90 = _ptx(90, 3, 128, False, 1)  # fp8 per group, hardware cvt
    assert set(re.findall(r"cvt\.[a-z0-9.]*e4m3[a-z0-9.]*", sm90)) == {"cvt.rn.satfinite.e4m3x2.f32"}
    fp4 = _ptx(90, 4, 16, True, 1)  # nvfp4 on sm_90: e2m1 in software, block scales by the e4m3 cvt
    assert not re.search(r"e2m1", fp4) and "st.global.v4.b32" in fp4


@pytest.mark.parametrize("cc", [100, 120])  # B200-class and RTX PRO 6000-class (Triton targets sm_100a / sm_120a)
def test_hardware_e2m1_path_assembles_for_blackwell(cc):
    ptx = _ptx(cc, 4, 16, True, 3)
    assert "cvt.rn.satfinite.e2m1x2.f32" in ptx
    import shutil
    import subprocess
    from pathlib import Path

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    ptxas = next((str(p) for p in (bin_dir / "ptxas-blackwell", bin_dir / "ptxas") if p.exists()), shutil.which("ptxas"))
    if ptxas is None:
        pytest.skip("no ptxas to assemble the sm_100a PTX with")
    arch = re.search(r"\.target (sm_\w+)", ptx).group(1)
    proc = subprocess.run([ptxas, f"-arch={arch}", "-o", "/dev/null", "-"], input=ptx, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
