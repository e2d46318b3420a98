"""A strategy for the lifecycle tests only (registered through TPFUSE_STRATEGIES): its first call
records this rank's pid in $TPFUSE_TEST_PID_DIR, then runs the reference allreduce for ever, so a
test can kill the parent, or one rank, while every rank is busy in collectives."""

import os

from tpfuse.strategies.reference import ReferenceStrategy


class PidThenBlock(ReferenceStrategy):
    name = "pid_then_block"
    description = "test only: records the rank's pid, then allreduces until killed"

    def all_reduce(self, x):
        path = os.path.join(os.environ["TPFUSE_TEST_PID_DIR"], str(os.getpid()))
        with open(path + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(path + ".tmp", path)
        while True:
            super().all_reduce(x)

    all_reduce_residual_rmsnorm = None  # only all_reduce is tuned in these tests
