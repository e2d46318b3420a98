"""The CLI's surface, frozen: every command's --help text and the exit code of every usage error.

A change to a --help text fails here until the stored text under tests/cli/frozen/ is updated on
purpose: `TPFUSE_FREEZE_CLI=1 python -m pytest -q tests/cli/test_frozen_cli.py` rewrites it.
Usage errors must exit 2 with the fix named, before any rank is spawned or torch is imported
(checked in a fresh interpreter, where an import of torch would show in sys.modules).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tpfuse.cli.main import main

FROZEN = Path(__file__).parent / "frozen"
UNDER_A_FILE = str(Path(__file__).resolve() / "out")  # a path no one can create: its parent is a file
# (argv prefix, file stem) for every command and subcommand, audit's included as they are.
COMMANDS = [([], "tpfuse"), (["doctor"], "doctor"), (["selftest"], "selftest"), (["diagnose"], "diagnose"),
            (["tune"], "tune"), (["verify"], "verify"), (["bench"], "bench"), (["bench", "e2e"], "bench-e2e"),
            (["profile"], "profile"), (["audit"], "audit"), (["patch"], "patch"), (["revert"], "revert")]


@pytest.mark.parametrize("argv, stem", COMMANDS, ids=[stem for _, stem in COMMANDS])
def test_help_text_is_frozen_and_exits_0(argv, stem, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")  # argparse wraps to the terminal width
    assert main([*argv, "--help"]) == 0
    text = capsys.readouterr().out
    path = FROZEN / f"{stem}.txt"
    if os.environ.get("TPFUSE_FREEZE_CLI") == "1":
        path.write_text(text)
    assert text == path.read_text(), f"`tpfuse {' '.join(argv)} --help` changed; see this module's docstring"


# (argv, exit code, text the message must contain). No command here reaches a spawned rank.
EXIT_CODES = [
    ([], 2, ""),
    (["--version"], 0, ""),
    (["no-such-command"], 2, "invalid choice"),
    (["doctor", "--hidden", "0"], 2, "--hidden 0 must be at least 1; pass a positive integer"),
    (["doctor", "--op", "sum"], 2, "is not an op; use one of"),
    (["selftest", "--world-size", "0"], 2, "--world-size must be >= 1, got 0; pass the number of local ranks"),
    (["selftest", "--world-size", "100000"], 2, "is more local ranks than this machine can run: at most"),
    (["selftest", "--repeats", "0"], 2, "--repeats must be >= 1, got 0; pass a positive integer"),
    (["selftest", "--strategy", "nope"], 2, "unknown strategy 'nope'; registered:"),
    (["selftest", "--timeout", "0"], 2, "--timeout must be > 0 seconds, got 0.0; pass e.g. --timeout 300"),
    (["diagnose"], 2, "nothing to watch; give -- COMMAND"),
    (["diagnose", "--duration", "0"], 2, "must be > 0 seconds; pass e.g. --duration 10"),
    (["tune"], 2, "give --preset"),
    (["tune", "--preset", "glm5", "--world-size", "0"], 2, "--world-size must be >= 1, got 0"),
    (["tune", "--preset", "glm5", "--world-size", "100000"], 2, "use --world-size"),
    (["tune", "--preset", "glm5", "--rounds", "0"], 2, "--rounds must be >= 1, got 0"),
    (["tune", "--preset", "glm5", "--confirm-rounds", "0"], 2, "--confirm-rounds must be >= 1, got 0"),
    (["tune", "--preset", "glm5", "--max-tokens", "0"], 2, "--max-tokens must be >= 1, got 0"),
    (["tune", "--hidden", "0"], 2, "--hidden must be >= 1, got 0; pass the model's hidden size"),
    (["tune", "--preset", "glm5", "--strategies", "nope"], 2, "unknown strategy nope in --strategies"),
    (["tune", "--preset", "nope"], 2, "invalid choice"),
    (["verify"], 2, "the following arguments are required: --strategy"),
    (["verify", "--strategy", "reference", "--hidden", "64", "--world-size", "-1"], 2, "--world-size must be >= 1"),
    (["verify", "--strategy", "reference", "--hidden", "64", "--rounds", "1"], 2, "--rounds must be >= 2"),
    (["verify", "--strategy", "reference", "--hidden", "64", "--rounds", "4", "--max-rounds", "2"], 2,
     "--max-rounds 2 is below --rounds 4"),
    (["bench"], 2, ""),
    (["bench", "e2e", "--world-size", "0"], 2, "--world-size must be >= 1, got 0"),
    (["bench", "e2e", "--world-size", "100000"], 2, "use --world-size"),
    (["bench", "e2e", "--shared-gpu"], 2, "--shared-gpu: the reference model is timed with one GPU per rank"),
    (["bench", "e2e", "--steps", "0"], 2, "--steps must be >= 1, got 0"),
    (["bench", "e2e", "--batch", "0"], 2, "give positive integers"),
    (["profile", "--batch", "0"], 2, "--batch must be >= 1, got 0"),
    (["profile", "--layers", "0"], 2, "--layers must be >= 1, got 0"),
    (["tune", "--preset", "glm5", "--results", UNDER_A_FILE], 2, "is not a writable directory; pass a path under"),
    (["tune", "--preset", "glm5", "--cache-dir", str(Path(__file__).resolve())], 2, "(it is a file, not a directory); pass --cache-dir DIR"),
    (["verify", "--strategy", "ring", "--hidden", "64", "--results", UNDER_A_FILE], 2, "is not a writable directory"),
    (["bench", "e2e", "--preset", "tiny", "--results", UNDER_A_FILE], 2, "is not a writable directory"),
    (["profile", "--preset", "tiny", "--trace", UNDER_A_FILE + ".json"], 2, "--trace"),
    (["profile", "--preset", "tiny", "--plot", UNDER_A_FILE + ".png"], 2, "--plot"),
    (["audit"], 2, "the following arguments are required"),
    (["patch"], 2, "the following arguments are required"),
    (["revert"], 2, "the following arguments are required"),
]


def _run_fresh(argv: list[str]) -> tuple[int, bool, str, str]:
    """(exit code, torch imported?, stdout, stderr) of main(argv) in a new interpreter."""
    code = ("import sys, json\nfrom tpfuse.cli.main import main\nrc = main(json.loads(sys.argv[1]))\n"
            "sys.stderr.write('\\n@@' + json.dumps([rc, 'torch' in sys.modules]))\n")
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(argv)], capture_output=True, text=True, env=env,
                          timeout=120)
    err, _, tail = proc.stderr.rpartition("\n@@")
    rc, torch_imported = json.loads(tail)
    return rc, torch_imported, proc.stdout, err


def test_usage_errors_exit_2_with_the_message_before_torch_is_imported():
    wrong = []
    for argv, expected, message in EXIT_CODES:
        rc, torch_imported, _, err = _run_fresh(argv)
        if rc != expected or message not in err or torch_imported or "Traceback" in err:
            wrong.append((argv, rc, torch_imported, err[-300:]))
    assert not wrong


# Environment errors found before any rank is spawned: these need the probe (so torch), not ranks.
NOT_ADMITTED_ON_CPU = [
    (["selftest", "--strategy", "oneshot"], "--strategy oneshot is not admitted on 2 gloo rank(s) on cpu"),
    (["selftest", "--strategy", "reference", "--strategy", "twoshot"], "--strategy twoshot is not admitted"),
    (["verify", "--strategy", "ring", "--baseline", "nccl_eager", "--hidden", "64", "--device", "cpu"],
     "--baseline nccl_eager is not admitted"),
    (["tune", "--preset", "glm5", "--max-tokens", "2", "--strategies", "oneshot", "--no-save", "--device", "cpu"],
     "--strategies oneshot: none is admitted for all_reduce_residual_rmsnorm 1x6144 bfloat16"),
]


@pytest.mark.parametrize("argv, message", NOT_ADMITTED_ON_CPU, ids=[a[0] for a, _ in NOT_ADMITTED_ON_CPU])
def test_a_strategy_not_admitted_here_is_one_reason_and_exit_2(argv, message, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("the CUDA strategies are admitted on this machine")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("needs CUDA tensors") == 1 and "Traceback" not in err
    assert err.rstrip().endswith("`tpfuse doctor` lists what is admitted here and why") or "drop --strategies" in err


def test_usage_error_with_json_prints_one_json_document(capsys):
    assert main(["tune", "--preset", "glm5", "--rounds", "0", "--json"]) == 2
    captured = capsys.readouterr()
    assert json.loads(captured.out) == {"error": "tpfuse tune: --rounds must be >= 1, got 0; pass a positive integer",
                                        "exit_code": 2}
    assert captured.err == "tpfuse tune: --rounds must be >= 1, got 0; pass a positive integer\n"
