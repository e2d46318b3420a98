"""Strategies that exist only for the tune/verify tests (registered through TPFUSE_STRATEGIES).

- `SequentialBroadcast`: the same sums as the reference (fp32, rank order 0..W-1, bit-identical on
  every rank), computed through W sequential broadcasts and then held for `PAUSE_S`: a correct
  implementation slower by far more than the machine's noise, for verify's REVERT and tune's guard.
- `SlowFused`: the same, but declared fused, so the do-no-harm guard must refuse it.
- `ReferenceCopy`: the reference strategy under another name: equal speed, for verify's KEEP.
- `WrongOnRankOne`: correct on rank 0, adds one to every sum on rank 1: one rank's failure must
  reject it on every rank.
- `SlowSetup`: the reference strategy whose per-bucket preparation takes `SETUP_S` seconds (as a
  cold kernel compile does) and records the token counts it was asked to prepare; registered
  only where a test adds `SLOW_SETUP_PLUGIN` (it is as fast as the reference, so a default
  baseline could pick it).
"""

import time

import torch
import torch.distributed as dist

from tpfuse.reference import accumulation_dtype, residual_rmsnorm_ref
from tpfuse.spec import Needs
from tpfuse.strategies.base import Strategy
from tpfuse.strategies.reference import ReferenceStrategy

# The slowdown must be far outside the timing noise of a loaded 2-core machine, where a gloo call of
# 64 values has been measured at 1.2 / 3.6 / 4.8 ms (p20 / median / p80): repeating the broadcasts
# (8 x W of them) then measured only 1.96x the reference and verify rightly said "too noisy to
# tell". A fixed pause per call makes the ratio about 10x whatever the machine does.
PAUSE_S = 0.03


class SequentialBroadcast(Strategy):
    name = "slow_broadcast"
    description = "test only: W sequential broadcasts, then a pause"
    fused = False
    needs = Needs()

    def _sum(self, x):
        acc_dtype = accumulation_dtype(x.dtype)
        total = None
        for r in range(self.ctx.world_size):
            buf = (x.to(acc_dtype, copy=True) if r == self.ctx.rank
                   else torch.empty(x.shape, dtype=acc_dtype, device=x.device))
            dist.broadcast(buf, src=dist.get_global_rank(self.ctx.group, r), group=self.ctx.group)
            total = buf if total is None else total + buf
        time.sleep(PAUSE_S)
        return total.to(x.dtype)

    def all_reduce(self, x):
        return self._sum(x)

    def all_reduce_residual_rmsnorm(self, x, residual, weight, eps):
        return residual_rmsnorm_ref(self._sum(x), residual, weight, eps)


class SlowFused(SequentialBroadcast):
    name = "slow_fused"
    fused = True


class ReferenceCopy(ReferenceStrategy):
    name = "reference_copy"


class WrongOnRankOne(ReferenceStrategy):
    name = "wrong_on_rank_one"

    def _reduced(self, x):
        acc = super()._reduced(x)
        return acc + 1 if self.ctx.rank == 1 else acc


SETUP_S = 1.5


class SlowSetup(ReferenceStrategy):
    name = "slow_setup"
    prepared: list = []  # per process: the `buckets` of every prepare_buckets call

    def prepare_buckets(self, *, hidden, dtype, max_tokens, buckets, op=None):
        time.sleep(SETUP_S)
        SlowSetup.prepared.append(tuple(buckets))


PLUGINS = ",".join(
    f"{name}=support.tune_test_strategies:{cls}"
    for name, cls in (("slow_broadcast", "SequentialBroadcast"), ("slow_fused", "SlowFused"),
                      ("reference_copy", "ReferenceCopy"), ("wrong_on_rank_one", "WrongOnRankOne"))
)
SLOW_SETUP_PLUGIN = "slow_setup=support.tune_test_strategies:SlowSetup"
