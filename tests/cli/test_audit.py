"""`tpfuse audit` / `patch` / `revert` (src/tpfuse/cli/audit.py): output paths checked first, one JSON object."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tpfuse.cli.main import main

FIXTURE = Path(__file__).resolve().parents[1] / "audit" / "fixtures" / "fakeengine"


@pytest.mark.parametrize("where", ["proc", "directory", "under-a-file"])
def test_an_unwritable_sarif_path_is_a_usage_error_before_the_scan(capsys, tmp_path, where):
    sarif = {"proc": "/proc/x.sarif", "directory": str(tmp_path), "under-a-file": str(Path(__file__).resolve() / "x.sarif")}[where]
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
