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
    (["tune", "--preset", "glm5", "--results", UNDER_A_FILE], 2,
     "cannot be written (Not a directory); pass a path under"),
    (["tune", "--preset", "glm5", "--cache-dir", str(Path(__file__).resolve())], 2, "(it is a file, not a directory); pass --cache-dir DIR"),
    (["verify", "--strategy", "ring", "--hidden", "64", "--results", UNDER_A_FILE], 2, "cannot be written"),
    (["bench", "e2e", "--preset", "tiny", "--results", UNDER_A_FILE], 2, "cannot be written"),
    # /proc takes no new file whatever its permission bits say (and root passes every access check).
    (["tune", "--preset", "glm5", "--results", "/proc/x.jsonl"], 2,
     "--results /proc/x.jsonl cannot be written (No such file or directory); pass a path under a directory"),
    (["verify", "--strategy", "ring", "--hidden", "64", "--results", "/proc/x.jsonl"], 2,
     "--results /proc/x.jsonl cannot be written"),
    (["bench", "e2e", "--preset", "tiny", "--results", "/proc/x.jsonl"], 2, "--results /proc/x.jsonl cannot be written"),
    (["profile", "--preset", "tiny", "--results", "/proc/x.jsonl"], 2, "--results /proc/x.jsonl cannot be written"),
    (["profile", "--preset", "tiny", "--trace", "/proc/t.json"], 2, "--trace /proc/t.fusion-on.json cannot be written"),
    (["profile", "--preset", "tiny", "--fusion", "off", "--trace", "/proc/t.json"], 2,
     "--trace /proc/t.json cannot be written"),
    (["profile", "--preset", "tiny", "--plot", str(FROZEN)], 2, "is a directory; pass a file path"),
    # Inputs that mean nothing.
    (["tune", "--preset", "glm5", "--strategies", ""], 2, "--strategies '' names no strategy; give a comma-separated"),
    (["tune", "--preset", "glm5", "--strategies", " , "], 2, "--strategies ' , ' names no strategy"),
    (["tune", "--preset", "glm5", "--fresh", "--no-save"], 2,
     "--fresh replaces the saved table and --no-save saves none; give one of them"),
    (["verify", "--strategy", "ring", "--baseline", "ring", "--hidden", "64"], 2,
     "--baseline ring is the strategy under test: an A/B of a strategy against itself decides nothing"),
    # Hints that work as given.
    (["verify", "--strategy", "ring"], 2, "e.g. `tpfuse verify --strategy ring --preset glm5`"),
    (["tune"], 2, "e.g. `tpfuse tune --preset glm5`"),
    # Sizes no rank can hold: refused from the memory estimate, in one line.
    (["selftest", "--tokens", "100000000"], 2, "--tokens 100000000 needs about "),
    (["tune", "--preset", "glm5", "--max-tokens", "100000000", "--device", "cpu"], 2,
     "--max-tokens 100000000 at hidden 6144 needs about "),
    (["tune", "--hidden", "10000000000", "--device", "cpu"], 2, "--max-tokens 128 at hidden 10000000000 needs about "),
    (["verify", "--strategy", "ring", "--hidden", "64", "--max-tokens", "10000000000000", "--device", "cpu"], 2,
     "needs about "),
    (["bench", "e2e", "--preset", "glm5", "--device", "cpu"], 2,
     "glm5 with 78 layers and 256 experts at batch 64 needs about "),
    (["profile", "--preset", "glm5", "--device", "cpu"], 2, "or pass --preset tiny (the test-sized model)"),
    # The bench's cuts in its flags' words.
    (["bench", "e2e", "--preset", "nope"], 2, "invalid choice: 'nope' (choose from 'glm5', 'deepseek-v3', "),
    (["bench", "e2e", "--preset", "glm5", "--layers", "2", "--experts", "4"], 2,
     "--experts 4 is below glm5's top-8 routing; pass --experts 8 or more"),
    (["bench", "e2e", "--preset", "tiny", "--dense-layers", "-1"], 2, "--dense-layers must be >= 0, got -1"),
    (["profile", "--preset", "tiny", "--trace", UNDER_A_FILE + ".json"], 2, "--trace"),
    (["profile", "--preset", "tiny", "--plot", UNDER_A_FILE + ".png"], 2, "--plot"),
    (["audit"], 2, "the following arguments are required"),
    (["patch"], 2, "the following arguments are required"),
    (["revert"], 2, "the following arguments are required"),
]


def _run_fresh(argv: list[str], **extra_env: str) -> tuple[int, bool, str, str]:
    """(exit code, torch imported?, stdout, stderr) of main(argv) in a new interpreter."""
    code = ("import sys, json\nfrom tpfuse.cli.main import main\nrc = main(json.loads(sys.argv[1]))\n"
            "sys.stderr.write('\\n@@' + json.dumps([rc, 'torch' in sys.modules]))\n")
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra_env}
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


def test_usage_errors_with_json_are_one_json_object_on_stdout():
    """Every usage error above, argparse's own included, with --json: exactly one JSON object."""
    wrong = []
    for argv, expected, message in EXIT_CODES:
        if expected != 2 or not argv:
            continue
        rc, _, out, err = _run_fresh([*argv, "--json"])
        try:
            doc = json.loads(out)
        except ValueError:
            doc = None
        if rc != 2 or not isinstance(doc, dict) or doc.get("exit_code") != 2 or message not in doc.get("error", ""):
            wrong.append((argv, rc, out[-300:]))
    assert not wrong


@pytest.mark.parametrize("variable, value", [("TPFUSE_TIMEOUT_S", "nan"), ("TPFUSE_TIMEOUT_S", "inf"),
                                             ("TPFUSE_TIMEOUT_S", "1e300"), ("TPFUSE_STRATEGIES", "x=os"),
                                             ("TPFUSE_STRATEGY", "a b"), ("TPFUSE_DEBUG", "maybe")])
def test_a_bad_variable_the_ranks_would_read_is_a_usage_error_before_torch(variable, value):
    for argv in (["selftest"], ["tune", "--hidden", "64"], ["verify", "--strategy", "ring", "--hidden", "64"],
                 ["bench", "e2e"], ["profile"]):
        rc, torch_imported, _, err = _run_fresh(argv, **{variable: value})
        assert (rc, torch_imported) == (2, False) and f"{variable}" in err and "Traceback" not in err, (argv, err)


def _no_gpu_visible() -> bool:
    from tpfuse.cli.ranks import no_gpu_visible

    return no_gpu_visible()


# Where no GPU can be visible, what needs a GPU is refused from the flags alone: no torch, no probe.
REFUSED_WITHOUT_TORCH = [
    (["selftest", "--strategy", "oneshot"], "--strategy oneshot is not admitted on 2 gloo rank(s) on cpu (oneshot: "
                                            "needs CUDA tensors; this group runs on cpu)"),
    (["selftest", "--device", "cuda"], "--device cuda but torch sees no CUDA GPU; use --device cpu"),
    (["selftest", "--device", "cpu", "--shared-gpu"], "--shared-gpu needs --device cuda"),
    (["selftest", "--shared-gpu"], "--shared-gpu needs a CUDA GPU and torch sees none"),
    (["verify", "--strategy", "oneshot", "--preset", "glm5"], "--strategy oneshot is not admitted"),
    (["verify", "--strategy", "ring", "--baseline", "nccl_epilogue", "--hidden", "64"],
     "--baseline nccl_epilogue is not admitted"),
    (["tune", "--preset", "glm5", "--strategies", "oneshot,twoshot"], "--strategies oneshot,twoshot: none is admitted"),
    (["bench", "e2e", "--strategy", "oneshot"], "--strategy oneshot is not admitted on 1 gloo rank(s) on cpu"),
    (["profile", "--strategy", "nccl_eager"], "--strategy nccl_eager is not admitted"),
]


@pytest.mark.parametrize("argv, message", REFUSED_WITHOUT_TORCH, ids=[" ".join(a) for a, _ in REFUSED_WITHOUT_TORCH])
def test_what_needs_a_gpu_is_refused_without_torch_where_none_can_be_visible(argv, message):
    if not _no_gpu_visible():
        pytest.skip("a GPU driver is present here: only torch can tell whether a GPU is visible")
    rc, torch_imported, _, err = _run_fresh(argv)
    assert (rc, torch_imported) == (2, False) and message in err and err.count("\n") == 1, err


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


def _subparser(argv):
    from tpfuse.cli.main import build_parser

    parser = build_parser()
    for name in argv:
        sub = next(a for a in parser._actions if isinstance(a, type(parser._subparsers._group_actions[0])))
        parser = sub.choices[name]
    return parser


@pytest.mark.parametrize("argv", [["doctor"], ["selftest"], ["diagnose"], ["tune"], ["verify"], ["bench", "e2e"],
                                  ["profile"]], ids=lambda argv: " ".join(argv))
def test_every_option_says_what_it_does(argv):
    parser = _subparser(argv)
    assert parser.description
    silent = [a.option_strings or a.dest for a in parser._actions if a.help is None and a.dest != "help"]
    assert not silent, f"`tpfuse {' '.join(argv)} --help` lists options without a help text: {silent}"
