"""`patch` keeps each file's encoding and every byte outside its edit: coding cookies, BOM, CRLF.

Reference: the patch of the plain UTF-8/LF fixture file (what test_patch.py checks). Each variant
is a byte transform `t` of the file, chosen so that it commutes with the edit; the patched variant
must be exactly `t(patched plain file)`, and revert must give back `t(original)` byte for byte.
"""

from __future__ import annotations

import json

import pytest

from tpfuse.audit import manifest
from tpfuse.audit.driver import audit
from tpfuse.cli.main import main

RUNTIME_GATE = "allreduce_fusion_applies() result"  # adds an import, a statement and a disjunct
LATIN1_HEAD = b"# -*- coding: latin-1 -*-\n# r\xe9glage: caf\xe9, na\xefve\n"


def crlf(b: bytes) -> bytes:
    return b.replace(b"\n", b"\r\n")


VARIANTS = {
    "latin-1 cookie": lambda b: LATIN1_HEAD + b,
    "utf-8 BOM": lambda b: b"\xef\xbb\xbf" + b,
    "CRLF": crlf,
    "latin-1 cookie and CRLF": lambda b: crlf(LATIN1_HEAD + b),
    "utf-8 BOM, non-ASCII comment": lambda b: b"\xef\xbb\xbf# caf\xc3\xa9 \xe2\x82\xac\n" + b,
}


def patch_only(capsys, root, guards, state_dir, *extra):
    gid = next(f.id for f in audit(str(root)).findings if f.guards == guards)
    code = main(["patch", str(root), "--arch", "sm120", "--like", "sm100", "--only", gid, "--json", "--state-dir", str(state_dir), *extra])
    return code, json.loads(capsys.readouterr().out)


@pytest.fixture
def reference(capsys, engine, tmp_path):
    """(original, patched) bytes of layers/fusion.py, plain UTF-8 with LF."""
    path = engine / "layers/fusion.py"
    before = path.read_bytes()
    code, data = patch_only(capsys, engine, RUNTIME_GATE, tmp_path / "ref-state", "--apply")
    assert code == 0 and data["applied"]
    after = path.read_bytes()
    manifest.revert(engine, state_dir=tmp_path / "ref-state")
    assert path.read_bytes() == before and after != before
    return before, after


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_patch_keeps_encoding_and_every_byte_outside_the_edit(capsys, engine, tmp_path, reference, variant):
    t = VARIANTS[variant]
    before, after = reference
    path = engine / "layers/fusion.py"
    path.write_bytes(t(before))
    code, data = patch_only(capsys, engine, RUNTIME_GATE, tmp_path / "state")
    assert code == 0 and not data["applied"] and "_is_sm120_supported" in data["diff"]["layers/fusion.py"]
    code, data = patch_only(capsys, engine, RUNTIME_GATE, tmp_path / "state", "--apply")
    assert code == 0 and data["applied"] and data["gates"][0]["includes_arch"]
    assert path.read_bytes() == t(after)
    assert manifest.revert(engine, state_dir=tmp_path / "state")
    assert path.read_bytes() == t(before)


def test_a_latin1_file_does_not_stop_the_other_files_from_being_patched(capsys, engine, tmp_path):
    caps = engine / "layers/caps.py"
    caps.write_bytes(LATIN1_HEAD + caps.read_bytes().replace(b"    return sm_version in (100, 103)\n", b"    return sm_version in (100, 103)  # \xe9t\xe9\n"))
    original = caps.read_bytes()
    code = main(["patch", str(engine), "--arch", "sm120", "--like", "sm100", "--apply", "--json", "--state-dir", str(tmp_path / "s")])
    data = json.loads(capsys.readouterr().out)
    assert data["applied"] and code in (0, 1)  # 1: some gates need a hand edit (listed in errors)
    assert {"layers/caps.py", "layers/fusion.py", "aliases.py"} <= set(data["diff"])
    new = caps.read_bytes()
    assert b"    return sm_version in (100, 103, 120)  # \xe9t\xe9\n" in new and new.startswith(LATIN1_HEAD)
    new.decode("latin-1")
    with pytest.raises(UnicodeDecodeError):
        new.decode("utf-8")  # still latin-1, not re-encoded
    manifest.revert(engine, state_dir=tmp_path / "s")
    assert caps.read_bytes() == original


def test_an_edit_the_encoding_cannot_hold_writes_nothing(engine, tmp_path):
    path = engine / "layers/caps.py"
    path.write_bytes(LATIN1_HEAD + path.read_bytes())
    before = path.read_bytes()
    expected = {"layers/caps.py": manifest.sha256(before)}
    with pytest.raises(manifest.ManifestError, match=r"cannot be written in its encoding latin-1.*nothing was written"):
        manifest.apply(engine, {"layers/caps.py": before.decode("latin-1") + "# \u20ac\n"}, expected, {}, state_dir=tmp_path / "s")
    assert path.read_bytes() == before and not manifest.state_dir_for(engine, tmp_path / "s").exists()
