"""`tpfuse audit` / `patch` / `revert` (src/tpfuse/cli/audit.py): table, JSON, SARIF, exit codes and bad
input; output paths checked first, one JSON object."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tpfuse.cli.main import main

FIXTURES = Path(__file__).resolve().parents[1] / "audit" / "fixtures"
FIXTURE = FIXTURES / "fakeengine"
ENGINE = str(FIXTURE)


@pytest.fixture
def engine(tmp_path) -> Path:
    """A writable copy of the fakeengine fixture package (as tests/audit/conftest.py makes it)."""
    dest = tmp_path / "src" / "fakeengine"
    shutil.copytree(FIXTURE, dest, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


@pytest.mark.parametrize("where", ["proc", "directory", "under-a-file"])
def test_an_unwritable_sarif_path_is_a_usage_error_before_the_scan(capsys, tmp_path, where):
    sarif = {"proc": "/proc/x.sarif", "directory": str(tmp_path),
             "under-a-file": str(Path(__file__).resolve() / "x.sarif")}[where]
    code = main(["audit", str(FIXTURE / "layers"), "--arch", "sm120", "--sarif", sarif, "--json"])
    captured = capsys.readouterr()
    assert code == 2 and "Traceback" not in captured.err
    assert f"--sarif {sarif}" in captured.err and "pass --sarif a file path in a writable directory" in captured.err
    doc = json.loads(captured.out)  # one JSON object, nothing else
    assert doc["exit_code"] == 2 and "--sarif" in doc["error"]


def test_a_writable_sarif_path_gets_the_report(capsys, tmp_path):
    sarif = tmp_path / "out.sarif"
    assert main(["audit", str(FIXTURE / "layers"), "--arch", "sm120", "--sarif", str(sarif)]) == 0
    capsys.readouterr()
    assert json.loads(sarif.read_text())["version"] == "2.1.0"


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_json_lists_the_story_gates(capsys):
    code, out, _ = run(capsys, "audit", ENGINE, "--arch", "sm120", "--like", "sm100", "--json")
    assert code == 3  # broken.py does not parse: the scan is incomplete
    data = json.loads(out)
    assert data["arch"] == "sm120" and data["like"] == "sm100"
    by_guard = {g["guards"]: g for g in data["gates"]}
    assert "server_args.enable_flashinfer_allreduce_fusion = True" in by_guard
    runtime = by_guard["allreduce_fusion_applies() result"]
    assert runtime["values"]["sm120"] is False and runtime["values"]["sm100"] is None
    assert runtime["path"] == "layers/fusion.py" and runtime["scope"] == "allreduce_fusion_applies"
    fusion = (FIXTURES / "fakeengine/layers/fusion.py").read_bytes()
    assert data["file_hashes"]["layers/fusion.py"] == __import__("hashlib").sha256(fusion).hexdigest()
    assert data["skipped"] == [{"path": "broken.py", "reason": "unparsable", "error": data["skipped"][0]["error"]}]


def test_table_names_gates(capsys):
    code, out, _ = run(capsys, "audit", ENGINE, "--arch", "sm120")
    assert code == 3  # broken.py
    assert "layers/fusion.py:18" in out and "allreduce_fusion_applies" in out
    assert "skipped broken.py" in out


def test_fail_on_gates_exit_code(capsys, engine):
    # With broken.py (it does not parse) the scan is incomplete: 3, with or without --fail-on-gates.
    assert run(capsys, "audit", str(engine), "--arch", "sm120", "--fail-on-gates", "--json")[0] == 3
    assert run(capsys, "audit", str(engine), "--arch", "sm120", "--json")[0] == 3
    (engine / "broken.py").unlink()
    assert run(capsys, "audit", str(engine), "--arch", "sm120", "--fail-on-gates", "--json")[0] == 1
    # without the flag, findings are not a failure
    assert run(capsys, "audit", str(engine), "--arch", "sm120", "--json")[0] == 0
    # A file with no gates: exit 0 even with --fail-on-gates.
    assert run(capsys, "audit", str(FIXTURES / "fakeengine/utils/__init__.py"), "--arch", "sm120",
               "--fail-on-gates")[0] == 0


def test_sarif_structure(capsys, tmp_path):
    sarif_path = tmp_path / "out.sarif"
    code, _, _ = run(capsys, "audit", ENGINE, "--arch", "sm120", "--json", "--sarif", str(sarif_path))
    assert code == 3  # broken.py
    sarif = json.loads(sarif_path.read_text())
    assert sarif["version"] == "2.1.0" and "sarif-2.1.0" in sarif["$schema"]
    run0 = sarif["runs"][0]
    rule_ids = {r["id"] for r in run0["tool"]["driver"]["rules"]}
    assert run0["results"]
    for res in run0["results"]:
        assert res["ruleId"] in rule_ids
        assert res["level"] in ("none", "note", "warning", "error")
        assert res["message"]["text"]
        loc = res["locations"][0]["physicalLocation"]
        assert (FIXTURES / "fakeengine" / loc["artifactLocation"]["uri"]).is_file()
        assert isinstance(loc["region"]["startLine"], int) and loc["region"]["startLine"] >= 1
    native = [r for r in run0["results"] if r["ruleId"] == "arch-gate-native"]
    assert native and all(r["properties"]["reportOnly"] for r in native)


def test_path_that_does_not_exist(capsys, tmp_path):
    code, _, err = run(capsys, "audit", str(tmp_path / "nope"), "--arch", "sm120")
    assert code == 2 and "does not exist" in err


def test_package_not_installed(capsys):
    code, _, err = run(capsys, "audit", "surely_not_an_installed_engine_xyz", "--arch", "sm120")
    assert code == 2 and "nor an installed package" in err and "pip install" in err


def test_installed_package_resolved_without_import(capsys, monkeypatch):
    import sys

    monkeypatch.syspath_prepend(str(FIXTURES))
    code, out, _ = run(capsys, "audit", "fakeengine", "--arch", "sm120", "--json")
    assert code == 3 and json.loads(out)["gates"]  # 3: broken.py
    assert "fakeengine" not in sys.modules  # found by importlib.util.find_spec, never imported


def test_unknown_arch(capsys):
    code, _, err = run(capsys, "audit", ENGINE, "--arch", "sm999")
    assert code == 2 and "unknown architecture" in err and "sm120" in err and "sm80" in err


def test_audit_does_not_import_torch():
    import subprocess
    import sys

    code = (
        "import sys; from tpfuse.cli.main import main; "
        f"rc = main(['audit', {ENGINE!r}, '--arch', 'sm120', '--json']); "
        "assert 'torch' not in sys.modules, 'torch imported'; assert 'libcst' not in sys.modules"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("arch", ["sm80", "sm90", "sm121"])
def test_every_reported_gate_is_false_on_arch(capsys, arch):
    code, out, _ = run(capsys, "audit", ENGINE, "--arch", arch, "--json")
    gates = json.loads(out)["gates"]
    assert gates and all(g["values"][arch] is False for g in gates)
