"""evaluate.py: how a value read on one path and given from outside on another (a caller's argument,
an environment variable) joins the device's.

Expected sets are written from the idiom's meaning: `_get_device_arch()` is `major * 10 + minor` of
the device unless FLASH_ATTENTION_ARCH names another architecture, so `arch // 10 == 10` is true on
major 10; a value given in place of the device's is not what a GPU runs by default.
"""

from __future__ import annotations

import textwrap

from tpfuse.audit.arch import ArchBool, ArchNum
from tpfuse.audit.driver import audit
from tpfuse.audit.evaluate import ite
from tpfuse.audit.values import UNKNOWN

from .conftest import names

# FA4 CuTe's interface (vLLM 0.33.0 vllm_flash_attn/cute/interface.py, sglang 0.5.23
# kernels/ops/attention/flash_attn/cute/interface.py), cut to the two ways it reads the architecture.
FA4_INTERFACE = """
    import os
    from functools import lru_cache

    import torch


    @lru_cache(maxsize=None)
    def _get_device_arch():
        arch_override = os.environ.get("FLASH_ATTENTION_ARCH", None)
        if arch_override is not None:
            return _parse_arch_str(arch_override)
        major, minor = torch.cuda.get_device_capability()
        return major * 10 + int(minor)


    def _flash_attn_fwd(q, k, v, _arch=None, fp8=False):
        arch = _get_device_arch() if _arch is None else _arch
        if fp8:
            assert arch // 10 == 10, "FP8 is only supported on SM100"


    def _flash_attn_bwd(q, k, v, learnable_sink=None):
        arch = _get_device_arch()
        if learnable_sink is not None:
            assert arch // 10 in [9, 10, 11], "Learnable sink backward is supported on SM90 and SM100/SM110"
"""


def _enabled(tmp_path, source: str) -> dict:
    (tmp_path / "m.py").write_text(textwrap.dedent(source))
    return {(f.scope, f.condition): f.enables for f in audit(str(tmp_path / "m.py")).findings}


def test_an_override_of_the_device_architecture_leaves_the_device_value_audited(tmp_path):
    found = _enabled(tmp_path, FA4_INTERFACE)
    assert found == {
        ("_flash_attn_fwd", "arch // 10 == 10"): names(lambda a: a.major == 10),
        ("_flash_attn_bwd", "arch // 10 in [9, 10, 11]"): names(lambda a: a.major in (9, 10, 11)),
    }


def test_only_a_test_of_whether_a_value_was_given_reads_as_an_override(tmp_path):
    # `if not available: return reason` is a failure path, not a value given in place of the device's:
    # what the function returns stays unknown there, so no condition on it is evaluated.
    found = _enabled(tmp_path, """
        import torch


        def _device_sm(available):
            if not available:
                return _reason()
            major, minor = torch.cuda.get_device_capability()
            return major * 10 + minor


        def pick(available):
            if _device_sm(available) >= 100:
                return 1
            return 0
    """)
    assert found == {}


def test_ite_takes_the_device_value_over_a_given_one_only_for_an_override():
    device = ArchNum.of(lambda a: a.cc_int)
    undecided = ArchBool.const(None)
    assert ite(undecided, device, UNKNOWN, override=True) == device
    assert ite(undecided, UNKNOWN, device, override=True) == device
    assert ite(undecided, device, UNKNOWN) is UNKNOWN
