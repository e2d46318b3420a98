"""`patch --apply` / `revert` under SIGKILL at every step, with a manifest that cannot be read, and in
each file's own encoding.

Each kill is real: a child interpreter sets `durable.fault_hook` to SIGKILL itself at one named
step (manifest.py lists them) and runs the transaction; the test then recovers with `revert` and
compares the whole engine tree (every file, hidden ones included, its bytes and permission bits,
every directory and link) with the pristine copy: a `diff -r`, plus modes.

Encodings: an edit is written in the encoding its file declares, keeping every byte outside it
(coding cookies, BOM, CRLF). Reference: the patch of the plain UTF-8/LF fixture file (what
test_patch.py checks). Each variant is a byte transform `t` of the file, chosen so that it commutes
with the edit; the patched variant must be exactly `t(patched plain file)`, and revert must give
back `t(original)` byte for byte.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tpfuse.audit import durable, manifest
from tpfuse.audit.arch import parse_arch
from tpfuse.audit.driver import audit
from tpfuse.audit.patch import propose_patch
from tpfuse.cli.main import main

from .conftest import FIXTURES

SRC = str(Path(manifest.__file__).resolve().parents[2])
DRIVER = r"""
import json, os, signal, sys
from tpfuse.audit import durable, manifest
from tpfuse.cli.main import main
kill_at, job = sys.argv[1], json.loads(sys.argv[2])
seen = []
def hook(step):
    seen.append(step)
    if step == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
durable.fault_hook = hook
if job["op"] == "apply":
    manifest.apply(job["root"], job["changes"], job["expected"], {}, state_dir=job["state_dir"])
elif job["op"] == "revert":
    manifest.revert(job["root"], state_dir=job["state_dir"])
else:
    rc = main(job["argv"])
    assert rc == 0, rc
print(json.dumps(seen))
"""


def tree(root: Path) -> dict:
    """Every entry under `root`: files as (mode, bytes), links as their target, directories as their mode."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            st = path.lstat()
            if path.is_symlink():
                out[rel] = ("link", os.readlink(path))
            elif path.is_dir():
                out[rel] = ("dir", st.st_mode)
            else:
                out[rel] = (st.st_mode, path.read_bytes())
    return out


def child(kill_at: str, job: dict) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-c", DRIVER, kill_at, json.dumps(job)], capture_output=True, text=True,
                          env=env, timeout=120)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A pristine engine copy (one mode changed, so modes are checked) and the full sm120 patch of it."""
    root = tmp_path_factory.mktemp("pristine") / "fakeengine"
    shutil.copytree(FIXTURES / "fakeengine", root, ignore=shutil.ignore_patterns("__pycache__"))
    os.chmod(root / "layers/caps.py", 0o640)
    result = audit(str(root))
    proposal = propose_patch(result, result.selected(parse_arch("sm120"), parse_arch("sm100")), parse_arch("sm120"),
                             parse_arch("sm100"))
    changes = proposal.changes
    assert len(changes) >= 3  # the kill points span several files
    return root, {rel: new for rel, (_, new) in changes.items()}, dict(result.file_hashes)


def fresh(pristine, base: Path) -> tuple[Path, dict]:
    src, changes, expected = pristine
    root = base / "fakeengine"
    shutil.copytree(src, root, symlinks=True)
    return root, {"root": str(root), "changes": changes, "expected": expected, "state_dir": str(base / "state")}


def steps_of(pristine, base: Path, op: str, setup=None) -> list:
    root, job = fresh(pristine, base)
    if setup:
        setup(job)
    proc = child("", {**job, "op": op})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_kill_at_every_apply_step_then_revert_restores_every_byte(pristine, tmp_path):
    src, changes, _ = pristine
    want = tree(src)
    steps = steps_of(pristine, tmp_path / "dry", "apply")
    files = list(changes)
    assert (steps[:len(files)] == [f"backup:{rel}" for rel in files]
            and steps[len(files):len(files) + 2] == ["sums", "intent"])
    assert steps[-1] == "commit" and sum(s.startswith("replaced:") for s in steps) == len(files)
    for k, step in enumerate(steps):
        base = tmp_path / str(k)
        root, job = fresh(pristine, base)
        proc = child(step, {**job, "op": "apply"})
        assert proc.returncode == -signal.SIGKILL, (step, proc.stderr)
        replaced = sum(s.startswith("replaced:") for s in steps[:k + 1])
        now = tree(root)
        targets = {rel for rel in set(now) | set(want) if not rel.endswith(durable.TMP_SUFFIX)
                   and not rel.startswith(".tpfuse-patch")}
        assert sum(now.get(rel) != want.get(rel) for rel in targets) == replaced, step
        # the tree carries its marker from the step that writes it until the revert (outside --state-dir's state)
        assert (".tpfuse-patch/marker.json" in now) == (k >= steps.index("marker")), step
        if step.startswith("tmp-"):
            assert any(rel.endswith(durable.TMP_SUFFIX) for rel in now), step  # the kill left a temp file in the tree
        sdir = manifest.state_dir_for(root, job["state_dir"])
        if k >= steps.index("intent"):
            # the intent record is on disk: a second apply refuses (and writes nothing) until revert
            with pytest.raises(manifest.ManifestError, match=r"interrupted|already carries") as err:
                manifest.apply(root, changes, job["expected"], {}, state_dir=job["state_dir"])
            assert f"tpfuse revert {root} --state-dir {job['state_dir']}" in str(err.value)
            assert tree(root) == now
        rows = manifest.revert(root, state_dir=job["state_dir"])
        assert sorted(r["path"] for r in rows if r["action"] == "restored") == sorted(
            s.split(":", 1)[1] for s in steps[:k + 1] if s.startswith("replaced:"))
        assert tree(root) == want, step  # byte-exact, no temp file left, modes kept
        assert not sdir.exists(), step


def test_kill_at_every_revert_step_then_revert_again(pristine, tmp_path):
    src, changes, _ = pristine
    want = tree(src)

    def patched(job):
        manifest.apply(job["root"], job["changes"], job["expected"], {}, state_dir=job["state_dir"])

    steps = steps_of(pristine, tmp_path / "dry", "revert", patched)
    assert sum(s.startswith("restored:") for s in steps) == len(changes) and steps[-1] == "manifest-removed"
    for k, step in enumerate(steps):
        root, job = fresh(pristine, tmp_path / str(k))
        patched(job)
        proc = child(step, {**job, "op": "revert"})
        assert proc.returncode == -signal.SIGKILL, (step, proc.stderr)
        manifest.revert(root, state_dir=job["state_dir"])
        assert tree(root) == want, step
        assert not manifest.state_dir_for(root, job["state_dir"]).exists()


def test_cli_apply_killed_midway(pristine, tmp_path, capsys):
    """The command a user runs: killed after its second file, then `patch` refuses and `revert` restores."""
    src, changes, _ = pristine
    root, job = fresh(pristine, tmp_path)
    argv = ["patch", str(root), "--arch", "sm120", "--like", "sm100", "--apply", "--state-dir", job["state_dir"]]
    second = list(changes)[1]
    proc = child(f"replaced:{second}", {"op": "cli", "argv": argv})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert tree(root) != tree(src)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "interrupted" in err and f"tpfuse revert {root}" in err and "Traceback" not in err
    assert main(["revert", str(root), "--state-dir", job["state_dir"], "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["restored"]
    assert [r["path"] for r in rows if r["action"] == "restored"] == list(changes)[:2]
    assert tree(root) == tree(src)
    main([*argv, "--json"])  # and a new apply works again (exit 1: some gates need a hand edit)
    assert json.loads(capsys.readouterr().out)["applied"]


def test_apply_killed_before_its_intent_record_leaves_nothing_to_undo(pristine, tmp_path, capsys):
    src, changes, _ = pristine
    root, job = fresh(pristine, tmp_path)
    proc = child("sums", {**job, "op": "apply"})
    assert proc.returncode == -signal.SIGKILL
    assert tree(root) == tree(src)
    assert main(["revert", str(root), "--state-dir", job["state_dir"]]) == 0
    assert "nothing to restore" in capsys.readouterr().out
    assert not manifest.state_dir_for(root, job["state_dir"]).exists()
    # A leftover of that kind does not block the next apply either.
    child("backup:" + next(iter(changes)), {**job, "op": "apply"})
    manifest.apply(root, changes, job["expected"], {}, state_dir=job["state_dir"])
    assert manifest.revert(root, state_dir=job["state_dir"]) and tree(root) == tree(src)


def test_failure_while_writing_targets_undoes_the_files_written(pristine, tmp_path, monkeypatch):
    src, changes, _ = pristine
    root, job = fresh(pristine, tmp_path)
    second = list(changes)[1]

    def disk_full(step):
        if step == f"tmp-half:{second}":
            raise OSError(28, "No space left on device (simulated)")

    monkeypatch.setattr(durable, "fault_hook", disk_full)
    with pytest.raises(manifest.ManifestError, match=r"writing 2/.*restored the 1 file\(s\) written, nothing changed"):
        manifest.apply(root, changes, job["expected"], {}, state_dir=job["state_dir"])
    assert tree(root) == tree(src)
    assert not manifest.state_dir_for(root, job["state_dir"]).exists()


# -- a manifest that cannot be read ------------------------------------------------------------
def _empty(path: Path) -> None:
    path.write_bytes(b"")


def _truncated(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])


def _no_files(path: Path) -> None:
    data = json.loads(path.read_text())
    del data["files"]
    path.write_text(json.dumps(data))


def _entry_without_hash(path: Path) -> None:
    data = json.loads(path.read_text())
    del data["files"][0]["sha256_after"]
    path.write_text(json.dumps(data))


def _escaping_path(path: Path) -> None:
    data = json.loads(path.read_text())
    data["files"][0]["path"] = "../../etc/passwd"
    path.write_text(json.dumps(data))


def _a_list(path: Path) -> None:
    path.write_text("[]")


def _unreadable(path: Path) -> None:  # a directory in its place: unreadable even for root
    path.unlink()
    path.mkdir()


def _not_utf8(path: Path) -> None:
    path.write_bytes(b"\xff\xfe{")


@pytest.mark.parametrize("corrupt,why", [
    (_empty, "is empty"), (_truncated, "not valid JSON"), (_no_files, "lacks its 'files' list"),
    (_entry_without_hash, "without 'sha256_after'"), (_escaping_path, "outside the target"),
    (_a_list, "JSON list"), (_unreadable, "cannot be read"), (_not_utf8, "not valid JSON"),
])
def test_unreadable_manifest_names_it_the_backups_and_the_recovery(pristine, tmp_path, capsys, corrupt, why):
    src, changes, _ = pristine
    root, job = fresh(pristine, tmp_path)
    manifest.apply(root, changes, job["expected"], {}, state_dir=job["state_dir"])
    patched = tree(root)
    mpath = manifest.state_dir_for(root, job["state_dir"]) / "manifest.json"
    corrupt(mpath)
    for argv in (["revert", str(root)], ["patch", str(root), "--arch", "sm120", "--apply"]):
        assert main([*argv, "--state-dir", job["state_dir"]]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and str(mpath) in err and why in err, err
        assert f"{len(changes)} original file(s) whose checksums match SHA256SUMS" in err
        assert all(rel in err for rel in changes)
        command = f"tpfuse revert {root} --state-dir {job['state_dir']} --force"
        assert f"`{command}`" in err
        assert tree(root) == patched  # nothing touched
    assert main(command.split()[1:]) == 0  # the command the message gives
    assert tree(root) == tree(src)
    assert not mpath.parent.exists()


def test_forced_recovery_refuses_a_backup_that_fails_its_checksum(pristine, tmp_path, capsys):
    _, changes, _ = pristine
    root, job = fresh(pristine, tmp_path)
    manifest.apply(root, changes, job["expected"], {}, state_dir=job["state_dir"])
    patched = tree(root)
    sdir = manifest.state_dir_for(root, job["state_dir"])
    _empty(sdir / "manifest.json")
    first = next(iter(changes))
    (sdir / "backups" / first).write_bytes(b"garbage")
    assert main(["revert", str(root), "--state-dir", job["state_dir"]]) == 2
    err = capsys.readouterr().err
    assert f"1 original file(s) that do NOT match SHA256SUMS (kept, not restored): {first}" in err
    assert main(["revert", str(root), "--state-dir", job["state_dir"], "--force"]) == 2
    err = capsys.readouterr().err
    assert first in err and "nothing restored" in err
    assert tree(root) == patched


def test_deleted_manifest_with_patched_files_is_recoverable(pristine, tmp_path, capsys):
    src, changes, _ = pristine
    root, job = fresh(pristine, tmp_path)
    manifest.apply(root, changes, job["expected"], {}, state_dir=job["state_dir"])
    sdir = manifest.state_dir_for(root, job["state_dir"])
    (sdir / "manifest.json").unlink()
    assert main(["patch", str(root), "--arch", "sm120", "--apply", "--state-dir", job["state_dir"]]) == 2
    err = capsys.readouterr().err
    assert "holds backups but no manifest" in err and "--force" in err
    assert main(["revert", str(root), "--state-dir", job["state_dir"]]) == 2
    assert "holds backups but no manifest" in capsys.readouterr().err
    assert main(["revert", str(root), "--state-dir", job["state_dir"], "--force"]) == 0
    capsys.readouterr()
    assert tree(root) == tree(src)


def test_a_symlinked_file_is_refused_and_nothing_written(pristine, tmp_path):
    src, changes, _ = pristine
    root, job = fresh(pristine, tmp_path)
    first = next(iter(changes))
    real = tmp_path / "elsewhere.py"
    real.write_bytes((root / first).read_bytes())
    (root / first).unlink()
    os.symlink(real, root / first)
    before = tree(root)
    with pytest.raises(manifest.ManifestError, match=rf"{first} is a symbolic link to .*nothing was written"):
        manifest.apply(root, changes, job["expected"], {}, state_dir=job["state_dir"])
    assert tree(root) == before and not manifest.state_dir_for(root, job["state_dir"]).exists()


def test_owner_of_a_replaced_file_is_kept(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("only root can give a file to another user")
    path = tmp_path / "f.py"
    path.write_bytes(b"x = 1\n")
    os.chown(path, 65534, 65534)
    durable.write(path, b"x = 2\n", 0o640)
    st = path.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o777, path.read_bytes()) == (65534, 65534, 0o640, b"x = 2\n")
    assert not durable.tmp_path(path).exists()


def test_revert_that_cannot_write_keeps_the_state_and_can_be_rerun(pristine, tmp_path, monkeypatch, capsys):
    src, changes, _ = pristine
    root, job = fresh(pristine, tmp_path)
    manifest.apply(root, changes, job["expected"], {}, state_dir=job["state_dir"])
    second = list(changes)[1]

    def read_only_fs(step):
        if step == f"tmp-half:revert:{second}":
            raise OSError(30, "Read-only file system (simulated)")

    monkeypatch.setattr(durable, "fault_hook", read_only_fs)
    assert main(["revert", str(root), "--state-dir", job["state_dir"]]) == 2
    err = capsys.readouterr().err
    assert (f"restoring {second} failed" in err
            and f"`tpfuse revert {root} --state-dir {job['state_dir']}` again" in err and "Traceback" not in err)
    monkeypatch.setattr(durable, "fault_hook", None)
    assert main(["revert", str(root), "--state-dir", job["state_dir"]]) == 0
    capsys.readouterr()
    assert tree(root) == tree(src)


def test_corrupt_audit_json_is_a_usage_error(capsys, engine, tmp_path):
    bad = tmp_path / "audit.json"
    bad.write_text('{"file_hashes": ')
    assert main(["patch", str(engine), "--arch", "sm120", "--audit-json", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "run the audit again" in err and "Traceback" not in err


def test_a_second_patch_or_revert_while_one_runs_is_refused(pristine, tmp_path):
    src, changes, _ = pristine
    root, job = fresh(pristine, tmp_path)
    sdir = manifest.state_dir_for(root, job["state_dir"])
    fd = durable.lock(sdir.with_name(sdir.name + ".lock"))  # what a running apply holds
    try:
        with pytest.raises(manifest.ManifestError, match="another tpfuse patch or revert is running"):
            manifest.apply(root, changes, job["expected"], {}, state_dir=job["state_dir"])
        assert tree(root) == tree(src) and not sdir.exists()
    finally:
        os.close(fd)
    manifest.apply(root, changes, job["expected"], {}, state_dir=job["state_dir"])
    fd = durable.lock(sdir.with_name(sdir.name + ".lock"))
    try:
        with pytest.raises(manifest.ManifestError, match="another tpfuse patch or revert is running"):
            manifest.revert(root, state_dir=job["state_dir"])
    finally:
        os.close(fd)
    manifest.revert(root, state_dir=job["state_dir"])
    assert tree(root) == tree(src)


def test_unwritable_state_location_is_a_clean_error(pristine, tmp_path):
    src, changes, _ = pristine
    root, job = fresh(pristine, tmp_path)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    with pytest.raises(manifest.ManifestError, match=r"cannot create the patch state .*--state-dir DIR"):
        manifest.apply(root, changes, job["expected"], {}, state_dir=blocker / "state")
    assert tree(root) == tree(src)


def test_a_manifest_written_before_the_journal_still_reverts(pristine, tmp_path):
    """The earlier layout: no SHA256SUMS, no "complete" or "version"; the manifest's hashes suffice."""
    src, changes, _ = pristine
    root, job = fresh(pristine, tmp_path)
    manifest.apply(root, changes, job["expected"], {}, state_dir=job["state_dir"])
    sdir = manifest.state_dir_for(root, job["state_dir"])
    (sdir / "SHA256SUMS").unlink()
    old = json.loads((sdir / "manifest.json").read_text())
    for key in ("complete", "version"):
        del old[key]
    (sdir / "manifest.json").write_text(json.dumps(old))
    assert sorted(r["path"] for r in manifest.revert(root, state_dir=job["state_dir"])) == sorted(changes)
    assert tree(root) == tree(src)


# -- the tree carries its own undo ----------------------------------------------------------------
def test_a_moved_tree_reverts_from_the_state_it_carries(pristine, tmp_path):
    src, changes, _ = pristine
    root, job = fresh(pristine, tmp_path / "a")
    manifest.apply(root, changes, job["expected"], {})  # the default: the state lives in the tree
    assert (root / ".tpfuse-patch" / "marker.json").is_file()
    moved = tmp_path / "b" / "renamed"
    moved.parent.mkdir()
    shutil.move(str(root), moved)
    rows = manifest.revert(moved)
    assert sorted(r["path"] for r in rows if r["action"] == "restored") == sorted(changes)
    assert tree(moved) == tree(src)  # byte for byte, and the marker and state are gone


def test_a_wiped_cache_loses_nothing(pristine, tmp_path, monkeypatch):
    src, changes, _ = pristine
    root, job = fresh(pristine, tmp_path)
    cache = tmp_path / "cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    manifest.apply(root, changes, job["expected"], {})
    shutil.rmtree(cache, ignore_errors=True)
    manifest.revert(root)
    assert tree(root) == tree(src)


def test_a_relative_state_dir_is_found_from_another_directory(pristine, tmp_path, monkeypatch, capsys):
    src, changes, _ = pristine
    root, job = fresh(pristine, tmp_path / "t")
    (tmp_path / "here").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    argv = ["patch", str(root), "--arch", "sm120", "--like", "sm100", "--apply", "--state-dir", "rel-state", "--json"]
    main(argv)
    data = json.loads(capsys.readouterr().out)
    absolute = (tmp_path / "here" / "rel-state").resolve()
    assert data["applied"] and data["undo"] == f"tpfuse revert {root} --state-dir {absolute}"
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert main(["revert", str(root)]) == 0  # the marker names the state; no --state-dir needed
    capsys.readouterr()
    assert tree(root) == tree(src) and all(p.suffix == ".lock" for p in absolute.iterdir())  # the state is gone


def test_a_moved_tree_with_an_outside_state_reverts_through_its_marker(pristine, tmp_path):
    src, changes, _ = pristine
    root, job = fresh(pristine, tmp_path / "a")
    manifest.apply(root, changes, job["expected"], {}, state_dir=job["state_dir"])
    moved = tmp_path / "moved"
    shutil.move(str(root), moved)
    manifest.revert(moved)
    assert tree(moved) == tree(src)


def test_a_lost_outside_state_is_named_and_nothing_changes(pristine, tmp_path, capsys):
    _, changes, _ = pristine
    root, job = fresh(pristine, tmp_path)
    manifest.apply(root, changes, job["expected"], {}, state_dir=job["state_dir"])
    shutil.rmtree(job["state_dir"])
    patched = tree(root)
    assert main(["revert", str(root)]) == 2
    err = capsys.readouterr().err
    assert "whose state" in err and "is gone" in err and all(rel in err for rel in changes) and "reinstall" in err
    assert tree(root) == patched


def test_an_edit_during_apply_is_kept_and_stops_it(pristine, tmp_path, monkeypatch):
    src, changes, _ = pristine
    root, job = fresh(pristine, tmp_path)
    first, second = list(changes)[:2]
    edited = b"# the user's edit, made while the patch was being applied\n"

    def user_edits_second(step):
        if step == f"replaced:{first}":
            (root / second).write_bytes(edited)

    monkeypatch.setattr(durable, "fault_hook", user_edits_second)
    with pytest.raises(manifest.ManifestError,
                       match=rf"{second} changed while the patch was being applied.*kept its new bytes"):
        manifest.apply(root, changes, job["expected"], {}, state_dir=job["state_dir"])
    now, want = tree(root), tree(src)
    assert now[second][1] == edited  # the user's bytes, not the patched old text
    assert {rel for rel in set(now) | set(want) if now.get(rel) != want.get(rel)} == {second}  # the rest as before
    assert not manifest.state_dir_for(root, job["state_dir"]).exists()


def test_an_edit_during_revert_is_kept_and_the_state_too(pristine, tmp_path, monkeypatch, capsys):
    src, changes, _ = pristine
    root, job = fresh(pristine, tmp_path)
    manifest.apply(root, changes, job["expected"], {}, state_dir=job["state_dir"])
    first, second = list(changes)[:2]
    edited = b"# edited during the revert\n"

    def user_edits_second(step):
        if step == f"restored:{first}":
            (root / second).write_bytes(edited)

    monkeypatch.setattr(durable, "fault_hook", user_edits_second)
    with pytest.raises(manifest.ManifestError,
                       match=rf"{second} changed while the revert was running; kept its new bytes"):
        manifest.revert(root, state_dir=job["state_dir"])
    monkeypatch.setattr(durable, "fault_hook", None)
    assert (root / second).read_bytes() == edited and manifest.state_dir_for(root, job["state_dir"]).exists()
    with pytest.raises(manifest.ManifestError, match="changed after patching"):
        manifest.revert(root, state_dir=job["state_dir"])  # a plain re-run keeps it too
    manifest.revert(root, state_dir=job["state_dir"], force=True)
    assert tree(root) == tree(src)


def test_a_second_apply_on_a_patched_tree_says_run_revert(pristine, tmp_path, capsys):
    src, changes, _ = pristine
    root, job = fresh(pristine, tmp_path)
    argv = ["patch", str(root), "--arch", "sm120", "--like", "sm100", "--apply"]
    main([*argv, "--state-dir", job["state_dir"]])
    capsys.readouterr()
    patched = tree(root)
    for extra in (["--state-dir", job["state_dir"]], ["--state-dir", str(tmp_path / "other")], []):
        assert main([*argv, *extra, "--json"]) == 2
        captured = capsys.readouterr()
        assert "already carries a tpfuse patch" in captured.err and "run `tpfuse revert" in captured.err, extra
        assert "edit it by hand" not in captured.err and json.loads(captured.out)["exit_code"] == 2
        assert tree(root) == patched
    assert main(["revert", str(root)]) == 0
    assert tree(root) == tree(src)


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
    code = main(["patch", str(root), "--arch", "sm120", "--like", "sm100", "--only", gid, "--json", "--state-dir",
                 str(state_dir), *extra])
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
    caps.write_bytes(LATIN1_HEAD + caps.read_bytes().replace(b"    return sm_version in (100, 103)\n",
                                                             b"    return sm_version in (100, 103)  # \xe9t\xe9\n"))
    original = caps.read_bytes()
    code = main(["patch", str(engine), "--arch", "sm120", "--like", "sm100", "--apply", "--json", "--state-dir",
                 str(tmp_path / "s")])
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
        manifest.apply(engine, {"layers/caps.py": before.decode("latin-1") + "# \u20ac\n"}, expected, {},
                       state_dir=tmp_path / "s")
    assert path.read_bytes() == before and not manifest.state_dir_for(engine, tmp_path / "s").exists()
