"""A deliberately wrong strategy (drops the last rank's input) that checks must catch."""

import torch.distributed as dist

from tpfuse.strategies.reference import ReferenceStrategy


class DropsLastRankStrategy(ReferenceStrategy):
    name = "drops_last_rank"
    description = "test only: all_reduce that ignores the last rank's input"

    def _reduced(self, x):
        acc = x.float().clone()
        if self.ctx.rank == self.ctx.world_size - 1:
            acc.zero_()
        dist.all_reduce(acc, group=self.ctx.group)
        return acc
