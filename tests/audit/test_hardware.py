"""hardware.py: a gate whose guarded code needs what `--arch` lacks is a hardware exclusion, which
`patch` refuses unless `--force-hardware`; a policy gate it opens."""

from __future__ import annotations

import json

from tpfuse.audit.arch import parse_arch
from tpfuse.audit.hardware import gate_class

from .conftest import find
from .test_patch import run

SM120, SM100 = parse_arch("sm120"), parse_arch("sm100")


def test_hardware_gates_refused_unless_forced(capsys, engine, result):
    tcgen05 = find(result, "v2/hardware.py", "[0] == 10")
    policy = next(f for f in result.findings if f.scope == "policy_default_backend")
    assert gate_class(tcgen05, SM120)[0] == "hardware" and gate_class(tcgen05, SM100)[0] == "policy"
    assert "sm_100a" in tcgen05.requires and gate_class(policy, SM120)[0] == "policy"
    code, out, _ = run(capsys, "patch", str(engine), "--arch", "sm120", "--like", "sm100", "--only", tcgen05.id,
                       "--json")
    assert code == 1 and "hardware exclusion" in json.loads(out)["errors"][0]["error"]
    code, out, err = run(capsys, "patch", str(engine), "--arch", "sm120", "--like", "sm100", "--only", tcgen05.id,
                         "--force-hardware", "--json")
    assert code == 0 and json.loads(out)["diff"] and "warning" in err and "hardware gate" in err


def _needed_by_regex(text: str) -> list:
    """`needed` as its patterns alone read `text` (no word prefilter): the reference."""
    from tpfuse.audit import hardware

    out = [name for name, (rx, *_) in hardware.FEATURES.items() if rx.search(text)]
    out += sorted({f"sm_{m.group(1)}a" for m in hardware._ARCH_SPECIFIC_RE.finditer(text)})
    sizes = [int(m.group(1)) * (1024 if m.group(2) else 1) for m in hardware._SMEM_RE.finditer(text)]
    if sizes and max(sizes) > min(hardware.MAX_SMEM.values()):
        out.append(f"smem>={max(sizes)}")
    return out


def test_needed_word_prefilter_matches_its_patterns():
    """The lower-cased word test before each pattern never hides a match: mixed case, every
    alternative of the tcgen05 pattern, a case-sensitive pattern, and non-ASCII text (where
    IGNORECASE folds more than ASCII: the long s matches `s`, the Kelvin sign `k`)."""
    from tpfuse.audit.hardware import needed

    texts = ["TCGEN05.mma(x)", "alloc Tmem", "x_TMEM_y", "tmem_ptr", "UMMA op", "UTCCP", "kind::F8F6F4",
             "kind::mxf8f6f4", "WGMMA", "wgmma_", "MultiCast", "cvt.rs.f16", "CVT.RS", "cvt_rs", "SM_100A",
             "Compute_90a", "sm90a", "SMEM = 200 * 1024", "Shared_Memory_bytes: 300000", "shared_mem=999999",
             "smem = 10", "\u017fm_100a", "\u017fmem = 200000", "\u212aind::f8f6f4 tcgen05", "nothing here", ""]
    for text in texts:
        assert needed(text) == _needed_by_regex(text), text
    assert needed("\u017fm_100a") == ["sm_100a"]  # IGNORECASE folds the long s: kept for non-ASCII text
    assert needed("if cap == 10: tcgen05.mma(); smem = 200 * 1024") == _needed_by_regex(
        "if cap == 10: tcgen05.mma(); smem = 200 * 1024") != []
