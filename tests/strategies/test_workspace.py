"""The peer workspace's facts (`tpfuse.strategies.workspace`): the sentinel is -0.0 in every dtype,
and a timed-out or aborted wait is an error naming the ranks and the fix."""

import torch

from tpfuse.kernels.protocol import ERR_ABORTED, ERR_TIMEOUT
from tpfuse.strategies.workspace import SENTINEL_BITS, PeerTimeoutError


def test_sentinels_are_negative_zero():
    assert torch.tensor([SENTINEL_BITS[2]], dtype=torch.int16).view(torch.bfloat16).item() == 0.0
    assert str(torch.tensor([SENTINEL_BITS[2]], dtype=torch.int16).view(torch.float16).item()) == "-0.0"
    assert str(torch.tensor([SENTINEL_BITS[4]], dtype=torch.int32).view(torch.float32).item()) == "-0.0"


def test_timeout_error_names_the_ranks_and_the_fix():
    exc = PeerTimeoutError("oneshot", 0, ERR_TIMEOUT, [2, 3], row=5, call=17, timeout_s=5.0)
    text = str(exc)
    assert isinstance(exc, RuntimeError) and exc.ranks == [2, 3]
    assert text.startswith("oneshot: rank 0 waited 5 s for data from rank(s) 2, 3")
    assert "Close the Communicator" in text and "TPFUSE_TIMEOUT_S" in text
    aborted = str(PeerTimeoutError("twoshot", 1, ERR_ABORTED, [0], row=0, call=3, timeout_s=5.0))
    assert aborted.startswith("twoshot: rank 1 stopped at call 3: rank(s) 0 gave up waiting first") and "NaN" in aborted
