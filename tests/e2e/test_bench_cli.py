"""`tpfuse bench e2e` and `tpfuse profile` end to end on CPU (gloo, eager steps), JSON checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tpfuse.cli.main import main
from tpfuse.results import read_rows


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


@pytest.mark.slow
@pytest.mark.gloo
def test_profile_cpu_json_plot_rows(tmp_path, capsys):
    png = tmp_path / "stages.png"
    code = main(["profile", "--preset", "tiny", "--batch", "2", "--steps", "2", "--prompt-len", "4", "--context", "16",
                 "--json", "--plot", str(png), "--results", str(tmp_path)])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["allreduce_count_ok"] is True
    assert [m["fusion"] for m in out["modes"]] == [True, False]
    for mode in out["modes"]:
        assert set(mode["stages"]) == {"attention", "moe_gemm", "other_gemm", "communication", "norm", "other"}
        assert sum(s["share"] for s in mode["stages"].values()) == pytest.approx(1.0)
        assert mode["stages"]["moe_gemm"]["launches_per_step"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = read_rows(tmp_path / "profile.jsonl")
    assert len(rows) == 12 and {r["shape"]["stage"] for r in rows} == set(out["modes"][0]["stages"])


TESTS_DIR = str(Path(__file__).resolve().parents[1])


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
@pytest.mark.parametrize("fusion, names", [("both", ["t.fusion-on.json", "t.fusion-off.json"]),
                                           ("off", ["t.json"])])
def test_profile_writes_the_traces_it_prints(tmp_path, capsys, fusion, names):
    trace = tmp_path / "t.json"
    assert main(["profile", "--preset", "tiny", "--batch", "1", "--steps", "1", "--prompt-len", "4", "--context", "8",
                 "--fusion", fusion, "--trace", str(trace), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["trace"] == [str(tmp_path / n) for n in names]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)
    for name in names:
        assert json.loads((tmp_path / name).read_text())["traceEvents"]


def test_profile_plot_without_matplotlib_names_both_install_commands_quoted(capsys, monkeypatch, tmp_path):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an environment without it imports
    assert main(["profile", "--preset", "tiny", "--plot", str(tmp_path / "p.png")]) == 2
    err = capsys.readouterr().err
    assert "--plot needs matplotlib; install matplotlib with `pip install 'tpfuse[plot]'` (from a checkout: " \
           "`pip install '.[plot]'`) or drop --plot" in err
