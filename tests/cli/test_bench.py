"""`tpfuse bench e2e` end to end on CPU (gloo, eager steps; JSON and rows checked) and on one CUDA
GPU (CUDA graphs, NVML energy); usage errors in its flags' words; the default preset of CPU and
CUDA ranks; no rows unless --results names a place, and a tune hint that `tpfuse tune` accepts; a
rank failure with --json as one JSON object (`profile` runs through the same code, so it is checked
here too)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tpfuse.cli.main import main
from tpfuse.results import read_rows

TESTS_DIR = str(Path(__file__).resolve().parents[1])
TINY = ["--preset", "tiny", "--prompt-len", "4", "--context", "16"]


@pytest.mark.slow
@pytest.mark.gloo
def test_bench_e2e_cpu_json(tmp_path, capsys):
    code = main(["bench", "e2e", "--preset", "tiny", "--layers", "2", "--experts", "8", "--batch", "1,3",
                 "--steps", "2", "--min-seconds", "0", "--prompt-len", "4", "--context", "16",
                 "--json", "--results", str(tmp_path)])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert out["device"] == "cpu" and out["allreduce_count_ok"] is True
    assert any("CUDA graphs need CUDA" in note for note in out["notes"])
    points = out["points"]
    assert [(p["fusion"], p["batch"]) for p in points] == [(True, 1), (True, 3), (False, 1), (False, 3)]
    for p in points:
        total = sum(p["allreduces_per_step"].values())
        assert total == p["expected_allreduces_per_step"] == 2 * 2
        fused = p["allreduces_per_step"]["all_reduce_residual_rmsnorm"]
        assert fused == (total if p["fusion"] else 0)
        assert p["tok_per_s"] == pytest.approx(p["batch"] / (p["median_us"] * 1e-6))
        assert p["j_per_token"] is None and "CPU" in p["energy_note"]
        assert p["cuda_graphs"] is False and p["steps"] >= 2
        assert p["moe_runner"] in ("loop", "dense", "grouped_mm")
    rows = read_rows(tmp_path / "e2e.jsonl")
    assert len(rows) == 4 and {r["op"] for r in rows} == {"e2e_decode_step"}
    assert [r["shape"]["batch"] for r in rows] == [1, 3, 1, 3]
    assert all(r["extra"]["allreduces_per_step"] == points[i]["allreduces_per_step"] for i, r in enumerate(rows))
    assert [r["median"] for r in rows] == [p["median_us"] for p in points]


@pytest.mark.gpu
def test_bench_e2e_cuda_graphs_and_energy(tmp_path, capsys):
    code = main(["bench", "e2e", "--preset", "tiny", "--batch", "1,16", "--steps", "5", "--min-seconds", "0.5",
                 "--prompt-len", "4", "--context", "16", "--json", "--results", str(tmp_path)])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["device"] == "cuda" and out["notes"] == []
    for p in out["points"]:
        assert p["cuda_graphs"] is True
        assert sum(p["allreduces_per_step"].values()) == p["expected_allreduces_per_step"] == 4
        assert p["moe_runner"] != "loop"  # not capturable, so never admitted with graphs
        if p["energy_j"] is None:
            assert "NVML" in p["energy_note"]
        else:
            assert p["energy_j"] > 0 and p["j_per_token"] == pytest.approx(p["energy_j"] / (p["batch"] * p["steps"]))


@pytest.mark.parametrize("argv, message", [
    (["--preset", "glm5", "--layers", "2", "--experts", "4"],
     "--experts 4 is below glm5's top-8 routing; pass --experts 8"),
    (["--preset", "tiny", "--world-size", "4"], "--world-size 4: num_kv_heads=2 does not split over 4 ranks; use a "
                                                "--world-size that divides it"),
    (["--preset", "nope"], "invalid choice: 'nope' (choose from 'glm5', 'deepseek-v3', 'qwen3-235b', 'llama3-70b', "
                           "'tiny')"),
    (["--preset", "tiny", "--layers", "2", "--dense-layers", "3"], "--dense-layers 3 is more than the cut's 2 layers"),
    (["--preset", "tiny", "--prompt-len", "16", "--context", "16"], "raise --context"),
    (["--preset", "tiny", "--moe-runner", "fast"], "is not a runner"),
])
def test_bench_e2e_usage_errors(argv, message, capsys, tmp_path):
    assert main(["bench", "e2e", *argv, "--results", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert not any(name in err for name in ("ModelConfig:", "model_config:", "E2ESpec:", "get_preset:")), err
    assert not (tmp_path / "e2e.jsonl").exists()


def test_bench_e2e_bad_batch_list(capsys):
    assert main(["bench", "e2e", "--batch", "1,x"]) == 2
    assert "comma-separated" in capsys.readouterr().err


def test_bench_refuses_shared_gpu_with_the_reason(capsys):
    assert main(["bench", "e2e", "--preset", "tiny", "--shared-gpu"]) == 2
    assert "--shared-gpu: the reference model is timed with one GPU per rank" in capsys.readouterr().err


def test_without_a_preset_cpu_ranks_run_the_tiny_model_and_cuda_ranks_glm5(monkeypatch):
    from tpfuse.cli import bench
    from tpfuse.cli.main import build_parser
    from tpfuse.cli.ranks import Ranks

    args = build_parser().parse_args(["bench", "e2e"])
    spec, ranks = bench.make_spec(args, batches=args.batch)
    if ranks.device == "cpu":
        assert spec.preset == "tiny"
    assert bench.DEFAULT_PRESET == {"cuda": "glm5", "cpu": "tiny"}
    monkeypatch.setattr("tpfuse.cli.ranks.resolve_ranks", lambda *a, **k: Ranks(1, "nccl", "cuda"))
    monkeypatch.setattr(bench, "_check_memory", lambda *a, **k: None)
    assert bench.make_spec(args, batches=args.batch)[0].preset == "glm5"


@pytest.mark.slow
@pytest.mark.gloo
def test_bench_e2e_writes_nothing_unasked_and_its_tune_hint_is_accepted(empty_cwd, capfd):
    assert main(["bench", "e2e", *TINY, "--batch", "1", "--fusion", "on", "--steps", "2", "--min-seconds", "0"]) == 0
    out, _ = capfd.readouterr()
    assert list(empty_cwd.iterdir()) == []
    assert "result rows not kept (pass --results PATH to keep them)" in out
    hint = re.search(r"measure it with `tpfuse (tune --world-size 1 --preset tiny)`", out)
    assert hint
    assert re.search(r"^bench e2e: 1 point\(s\) in [\d.]+ s, best [\d.]+ tok/s \(batch 1, fusion on\); "
                     r"allreduce count ok$", out, re.M)
    # The hint's command passes tune's argument checks (here stopped right after them by --rounds 0).
    assert main([*hint.group(1).split(), "--rounds", "0"]) == 2
    assert "--rounds must be >= 1" in capfd.readouterr().err


@pytest.mark.gloo
@pytest.mark.parametrize("argv", [["bench", "e2e", "--batch", "1", "--steps", "1", "--min-seconds", "0"],
                                  ["profile", "--batch", "1", "--steps", "1"]], ids=["bench-e2e", "profile"])
def test_a_rank_failure_with_json_is_one_json_object_and_exit_1(argv, capsys, monkeypatch):
    import os

    monkeypatch.setenv("TPFUSE_STRATEGIES", "raises=support.raising_strategy:RaisesStrategy")
    monkeypatch.setenv("PYTHONPATH", TESTS_DIR + os.pathsep + os.environ.get("PYTHONPATH", ""))
    assert main([*argv, "--preset", "tiny", "--prompt-len", "4", "--context", "8", "--strategy", "raises",
                 "--json"]) == 1
    captured = capsys.readouterr()
    doc = json.loads(captured.out)  # exactly one object: anything more would not parse
    command = " ".join(argv[:2]) if argv[0] == "bench" else "profile"
    assert doc["exit_code"] == 1 and doc["error"].startswith(f"tpfuse {command}: 1 rank(s) failed: rank(s) 0: ")
    assert "raises: this strategy fails every call" in doc["error"]
    assert captured.err.strip().splitlines()[-1] == doc["error"]
