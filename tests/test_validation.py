"""The input checks (`tpfuse.validation`): a quantization spec that does not fit the call is refused
naming the problem."""

import pytest
import torch

from tpfuse import quant as Q
from tpfuse.validation import check_quant


@pytest.mark.parametrize("quant, hidden, exc, message", [
    (Q.fp8_per_group(128), 6000, ValueError, "not a multiple of 128"),
    (Q.nvfp4(1.0), 6152, ValueError, "not a multiple of 16"),
    (Q.fp8_static(torch.ones(2)), 64, TypeError, "one element"),
    (Q.fp8_static(0.0), 64, ValueError, "finite number > 0"),
    ("fp8", 64, TypeError, "must be a tpfuse.QuantSpec"),
    (Q.QuantSpec("fp4", 16), 64, ValueError, "is not a format"),
    (Q.QuantSpec("nvfp4", 16, "row", scale=1.0), 64, ValueError, "layout 'row' is not a format"),
    (Q.QuantSpec("fp8_per_group", 24), 48, ValueError, "power of two"),
])
def test_check_quant_names_the_problem(quant, hidden, exc, message):
    with pytest.raises(exc, match=message):
        check_quant("op", quant, hidden, device=torch.device("cpu"))
