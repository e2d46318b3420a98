"""What `bench e2e` and `profile` leave behind and print on CPU: no rows unless --results names a
place, tpfuse warnings as one plain line, no Kineto status lines, GB/s that never reads 0, and a
tune hint that `tpfuse tune` accepts."""

from __future__ import annotations

import re

import pytest

from tpfuse.cli.main import main
from tpfuse.cli.profile import format_gbps

TINY = ["--preset", "tiny", "--prompt-len", "4", "--context", "16"]


@pytest.fixture
def empty_cwd(tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("TPFUSE_CACHE_DIR", str(tmp_path / "cache"))  # no dispatch table: the default is used
    return work


@pytest.mark.slow
@pytest.mark.gloo
def test_profile_writes_nothing_unasked_and_prints_clean_lines(empty_cwd, capfd):
    assert main(["profile", *TINY, "--batch", "2", "--steps", "2", "--fusion", "on"]) == 0
    out, err = capfd.readouterr()
    assert list(empty_cwd.iterdir()) == []
    assert "result rows not kept (pass --results PATH to keep them)" in out
    assert "USDT:" not in err and "STAGE:" not in err and "profiler_start" not in err
    warning = [line for line in err.splitlines() if "no dispatch table" in line]
    assert len(warning) == 1 and warning[0].startswith("tpfuse: warning: Communicator: no dispatch table at ")
    assert "api.py" not in err and "self._choose" not in err
    gbps = re.search(r"^│ attention .*│\s+(\S+) │$", out, re.M).group(1)
    assert float(gbps) > 0
    assert re.search(r"^profile: fusion on [\d.]+ us/step; allreduce count ok$", out, re.M)


@pytest.mark.slow
@pytest.mark.gloo
def test_bench_e2e_writes_nothing_unasked_and_its_tune_hint_is_accepted(empty_cwd, capfd):
    assert main(["bench", "e2e", *TINY, "--batch", "1", "--fusion", "on", "--steps", "2", "--min-seconds", "0"]) == 0
    out, _ = capfd.readouterr()
    assert list(empty_cwd.iterdir()) == []
    assert "result rows not kept (pass --results PATH to keep them)" in out
    hint = re.search(r"measure it with `tpfuse (tune --world-size 1 --preset tiny)`", out)
    assert hint
    assert re.search(r"^bench e2e: 1 point\(s\) in [\d.]+ s, best [\d.]+ tok/s \(batch 1, fusion on\); allreduce count ok$",
                     out, re.M)
    # The hint's command passes tune's argument checks (here stopped right after them by --rounds 0).
    assert main([*hint.group(1).split(), "--rounds", "0"]) == 2
    assert "--rounds must be >= 1" in capfd.readouterr().err


def test_tune_takes_the_tiny_preset_of_the_benchmarks():
    import argparse

    from tpfuse.cli.args import hiddens

    assert hiddens(argparse.Namespace(preset=["tiny"], hidden=[], max_tokens=4), "tune") == (64,)


@pytest.mark.parametrize("gbps, text", [(0.0637, "0.0637"), (1.5, "1.5"), (12.345, "12.3"), (3400.4, "3400"),
                                        (0.00042, "4.2e-04")])
def test_gbps_keeps_three_significant_digits(gbps, text):
    assert format_gbps(gbps) == text
