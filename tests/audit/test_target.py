"""TARGET as a file list: links are never silent, the size bound is validated where it is read."""

from __future__ import annotations

import json
import os

import pytest

from tpfuse.audit import target
from tpfuse.audit.driver import audit
from tpfuse.cli.main import main


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_a_link_to_a_directory_outside_the_tree_is_listed_as_skipped(capsys, engine, tmp_path):
    outside = tmp_path / "vendored"
    outside.mkdir()
    (outside / "fast.py").write_text("import torch\n\n\ndef f():\n    return torch.cuda.get_device_capability()[0] == 10\n")
    os.symlink(outside, engine / "layers" / "vendored")
    (engine / "broken.py").unlink()
    code, out, _ = _run(capsys, "audit", str(engine), "--arch", "sm120", "--json")
    skipped = json.loads(out)["skipped"]
    assert code == 3 and [(s["path"], s["reason"]) for s in skipped] == [("layers/vendored", "linked-directory")]
    assert str(outside) in skipped[0]["error"] and "audit" in skipped[0]["error"]


def test_a_link_to_a_directory_inside_the_tree_is_an_alias_not_a_skip(capsys, engine):
    os.symlink(engine / "layers", engine / "utils" / "layers_link")
    (engine / "broken.py").unlink()
    code, out, _ = _run(capsys, "audit", str(engine), "--arch", "sm120", "--json")
    data = json.loads(out)
    assert code == 0 and data["skipped"] == []
    assert data["aliases"] == [{"path": "utils/layers_link", "target": "layers"}]
    code, out, _ = _run(capsys, "audit", str(engine), "--arch", "sm120")
    assert "alias utils/layers_link -> layers" in out


def test_an_alias_file_is_audited_and_patched_once_as_its_real_file(capsys, engine, state_dir):
    os.symlink("caps.py", engine / "layers" / "caps_alias.py")
    result = audit(str(engine))
    assert {"path": "layers/caps_alias.py", "target": "layers/caps.py"} in result.target.aliases
    assert not [f for f in result.findings if f.path == "layers/caps_alias.py"]
    code, out, err = _run(capsys, "patch", str(engine), "--arch", "sm120", "--like", "sm100", "--apply",
                          "--state-dir", str(state_dir), "--json")
    data = json.loads(out)
    assert data["applied"] and "layers/caps.py" in data["diff"] and "layers/caps_alias.py" not in data["diff"]
    assert "points into" not in out + err  # the advice that looped: the same tree
    assert (engine / "layers" / "caps_alias.py").is_symlink()


@pytest.mark.parametrize("value", ["1e8", "abc", "-5", "0", " 12 KB"])
def test_a_bad_size_bound_is_refused_naming_the_variable(capsys, engine, monkeypatch, value):
    monkeypatch.setenv(target.MAX_BYTES_ENV, value)
    with pytest.raises(ValueError, match=r"TPFUSE_AUDIT_MAX_BYTES=.*positive whole number of bytes"):
        target.max_source_bytes()
    code, out, err = _run(capsys, "audit", str(engine), "--arch", "sm120", "--json")
    assert code == 2 and "TPFUSE_AUDIT_MAX_BYTES" in err and json.loads(out)["exit_code"] == 2
