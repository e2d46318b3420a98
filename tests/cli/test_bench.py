"""`tpfuse bench e2e`: its usage errors."""

from tpfuse.cli.main import main


def test_bench_refuses_shared_gpu_with_the_reason(capsys):
    assert main(["bench", "e2e", "--preset", "tiny", "--shared-gpu"]) == 2
    assert "--shared-gpu: the reference model is timed with one GPU per rank" in capsys.readouterr().err
