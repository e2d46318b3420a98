"""`tpfuse audit` / `patch` / `revert`: find, explain and open architecture gates in an engine's source.

Exit codes: 0 ok; 1 a negative verdict (gates found with --fail-on-gates; a gate `patch` was asked
to open stays closed, dry run or --apply alike; an --apply refused because an edit fails its
re-audit); 2 usage or environment error (bad path, unknown arch, an output path that cannot be
written, a tree that already carries a patch, a file changed during the apply: nothing is written);
3 (audit) the scan is incomplete: some file could not be read, decoded or parsed, or is above the
per-file size bound; each is listed under `skipped` with its reason, and 3 wins over 1.
The audit modules are imported when a command runs, not with this module: every `tpfuse`
command builds this parser, and importing them costs about as much as Python's own start-up.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tpfuse.cli.exits import EXIT_NEGATIVE, EXIT_OK, UsageError, dumps_json

EXIT_INCOMPLETE = 3  # audit: some file was not scanned (listed under `skipped`)
AUDIT_EXIT_CODES = (
    "exit codes: 0 scanned everything (gates or not, without --fail-on-gates); 1 gates found with --fail-on-gates; 2 "
    "usage or environment error (--sarif not writable included: checked before the scan); 3 incomplete scan: a file "
    "could not be read, decoded or parsed, or is above the per-file size bound (TPFUSE_AUDIT_MAX_BYTES, default 1 "
    "MiB); each is listed under 'skipped' with its reason; 3 wins over 1"
)
PATCH_DESCRIPTION = (
    "Print the minimal edit that opens each gate false on --arch (all of them, or --only IDs) in the codebase's own "
    "idiom, as a unified diff; every edit is re-audited in memory first (true on --arch as on --like, no other "
    "architecture changed). --apply writes it as one journaled transaction: the tree carries its own undo (a marker "
    "file and the byte-exact originals, found by `tpfuse revert` wherever the tree moves), and an edit made to a file "
    "during the apply stops it with the user's bytes kept."
)
PATCH_EXIT_CODES = (
    "exit codes (the same for a dry run and --apply of the same plan): 0 every gate asked for opens (by its own edit "
    "or through an edited helper or flag it reads); 1 some gate stays closed (inverse, hardware without "
    "--force-hardware, no edit in its idiom; each listed with its reason; with --apply the others are written), or "
    "--apply refused because an edit fails its re-audit (nothing written); 2 usage or environment error (nothing "
    "written), e.g. a tree that already carries a patch: run `tpfuse revert` first"
)
REVERT_DESCRIPTION = (
    "Restore every file a `tpfuse patch --apply` changed, byte for byte and with its permission bits, from the undo "
    "the patched tree carries (or --state-dir); files changed after patching are kept unless --force; a revert that "
    "was interrupted is finished by running it again."
)
REVERT_EXIT_CODES = ("exit codes: 0 restored (or nothing was left to restore); 2 nothing to revert, or a file changed "
                     "after patching (without --force)")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("audit", help="list architecture gates that are false on --arch",
                              description=__doc__.splitlines()[0], epilog=AUDIT_EXIT_CODES)
    _common(p)
    p.add_argument("--sarif", metavar="FILE", help="also write SARIF 2.1.0 to FILE")
    p.add_argument("--all", action="store_true",
                   help="also list non-gates (test skips, log/message branches, helper and flag definitions)")
    p.add_argument("--no-native", action="store_true", help="skip C/C++/CUDA/CMake files")
    p.add_argument("--fail-on-gates", action="store_true", help="exit 1 when gates are found (CI)")
    p.set_defaults(run=run_audit)

    p = subparsers.add_parser("patch", help="print (or --apply) the minimal edit that opens gates for --arch",
                              description=PATCH_DESCRIPTION, epilog=PATCH_EXIT_CODES)
    _common(p)
    p.add_argument("--only", nargs="+", metavar="ID", help="patch only these gate IDs (from `tpfuse audit`)")
    p.add_argument("--apply", action="store_true", help="write the edit (atomically, with backups and a manifest)")
    p.add_argument("--audit-json", metavar="FILE",
                   help="refuse files whose hash differs from this earlier `audit --json` output")
    p.add_argument("--state-dir", metavar="DIR",
                   help="keep the backups and the manifest in DIR instead of inside the tree (the tree's marker names "
                        "DIR)")
    p.add_argument("--force-hardware", action="store_true",
                   help="also patch hardware gates (guarded code needs what --arch lacks); warns")
    p.set_defaults(run=run_patch)

    p = subparsers.add_parser("revert", help="restore the files a `tpfuse patch --apply` changed, byte for byte",
                              description=REVERT_DESCRIPTION, epilog=REVERT_EXIT_CODES)
    p.add_argument("target", metavar="TARGET", help="the directory, file or package that was patched")
    p.add_argument("--force", action="store_true", help="restore even files changed after patching, or, when the "
                   "manifest is unreadable, every backup SHA256SUMS verifies")
    p.add_argument("--state-dir", metavar="DIR",
                   help="where the patch's state was written, if the tree's marker is gone")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=run_revert)


def _common(p) -> None:
    p.add_argument("target", metavar="TARGET",
                   help="a directory, a .py file, or an installed package name (sglang, vllm, flashinfer, "
                        "tensorrt_llm)")
    p.add_argument("--arch", required=True, help="the GPU architecture to audit for, e.g. sm120")
    p.add_argument("--like", help="report/patch only gates true on this architecture, e.g. sm100")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _archs(args):
    from tpfuse.audit.arch import parse_arch

    try:
        arch = parse_arch(args.arch, option="--arch")
        like = parse_arch(args.like, option="--like") if args.like else None
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if like == arch:
        raise UsageError(f"--like {like.name} is the same as --arch; pick an architecture the gates already enable, "
                         "e.g. sm100")
    return arch, like


def _run_audit(args, *, native: bool, keep_trees: bool = True):
    from tpfuse.audit.driver import audit

    show = not args.json and sys.stderr.isatty()
    try:
        if not show:
            return audit(args.target, native=native, keep_trees=keep_trees)
        from rich.progress import Progress

        with Progress(transient=True) as progress:
            task = progress.add_task("auditing", total=None)
            return audit(args.target, native=native, keep_trees=keep_trees,
                         progress=lambda done, total: progress.update(task, completed=done, total=total))
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def check_output_file(option: str, path: str) -> Path:
    """`path` can be written as a file, checked before any work; UsageError naming `option` and the fix otherwise.

    A file that does not exist yet is created and removed again: only that proves a directory such
    as /proc or a read-only mount takes a new file."""
    out = Path(path).expanduser()
    fix = f"pass {option} a file path in a writable directory"
    if out.is_dir():
        raise UsageError(f"{option} {path} is a directory, not a file; {fix}, e.g. {out / 'audit.sarif'}")
    if out.exists():
        if not out.is_file() or not os.access(out, os.W_OK):
            raise UsageError(f"{option} {path} exists and cannot be written as a file; {fix}")
        return out
    try:
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError as exc:
        raise UsageError(f"{option} {path} cannot be created ({exc.strerror or exc}); {fix}") from None
    os.close(fd)
    out.unlink()
    return out


def run_audit(args) -> int:
    from tpfuse.audit import report

    arch, like = _archs(args)
    sarif = check_output_file("--sarif", args.sarif) if args.sarif else None
    result = _run_audit(args, native=not args.no_native, keep_trees=False)  # a report: no patch needs the trees
    selected = result.selected(arch, like, include_non_gates=args.all)
    if sarif is not None:
        try:
            sarif.write_text(report.dumps(report.to_sarif(result, selected, arch)))
        except OSError as exc:  # the disk filled, or the path changed since it was checked
            raise UsageError(f"--sarif {args.sarif} could not be written ({exc.strerror or exc}); "
                             f"pass --sarif a file path in a writable directory") from None
    if args.json:
        print(report.dumps(report.to_json(result, selected, arch, like)))
    else:
        report.print_table(result, selected, arch, like)
    gates = [f for f in selected if f.category == "gate"]
    if result.skipped:
        return EXIT_INCOMPLETE
    return EXIT_NEGATIVE if args.fail_on_gates and gates else EXIT_OK


def run_patch(args) -> int:
    from tpfuse.audit import report
    from tpfuse.audit.hardware import hardware_needs
    from tpfuse.audit.manifest import ManifestError, existing_patch
    from tpfuse.audit.patch import PatchRefused, apply_patch, propose_patch, unified_diff
    from tpfuse.audit.patchstate import revert_cmd
    from tpfuse.audit.target import resolve_target

    arch, like = _archs(args)
    if args.apply:  # before the audit: a tree that carries a patch takes no second one
        try:
            why = existing_patch(resolve_target(args.target, native=False).root, args.state_dir)
        except (ValueError, ManifestError) as exc:
            raise UsageError(str(exc)) from None
        if why:
            raise UsageError(why)
    result = _run_audit(args, native=False)
    candidates = result.selected(arch, like)
    if args.only:
        known = {f.id: f for f in result.findings}
        unknown = [i for i in args.only if i not in known]
        if unknown:
            raise UsageError(f"--only: no gate with ID {', '.join(unknown)} in {result.target.root}; run `tpfuse "
                             "audit` for the IDs")
        # an inverse gate or non-gate asked for by ID is refused with its reason
        candidates = [known[i] for i in args.only]
    else:
        candidates = [f for f in candidates if not f.report_only]
    proposal = propose_patch(result, candidates, arch, like, force_hardware=args.force_hardware)
    for gid in sorted(proposal.plans):
        needs = hardware_needs(next(f for f in candidates if f.id == gid), arch)
        if needs:
            print(f"# warning: {gid} is a hardware gate (guarded code needs {needs}, which {arch.name} lacks); "
                  f"patched because of --force-hardware", file=sys.stderr)
    if args.audit_json:
        try:
            earlier = json.loads(Path(args.audit_json).read_text()).get("file_hashes", {})
        except (OSError, ValueError, AttributeError) as exc:
            raise UsageError(f"--audit-json: {args.audit_json} is not the output of `tpfuse audit --json` "
                             f"({type(exc).__name__}: {exc}); run the audit again") from None
        stale = [rel for rel in proposal.changes if rel in earlier and earlier[rel] != result.file_hashes.get(rel)]
        if stale:
            raise UsageError(f"patch: {', '.join(stale)} changed since the audit in {args.audit_json}; audit again")
    written, refused, checks = None, None, proposal.checks
    if args.apply and proposal.changes:
        try:
            written, checks = apply_patch(proposal, state_dir=args.state_dir)
        except PatchRefused as exc:
            refused = str(exc)
        except ManifestError as exc:
            raise UsageError(str(exc)) from None
    undo = revert_cmd(result.target.root, args.state_dir) if written else None
    if args.json:
        print(report.dumps({
            "target": str(result.target.root), "arch": arch.name, "applied": bool(written), "refused": bool(refused),
            "manifest": str(written) if written else None, "undo": undo,
            "diff": {rel: unified_diff(rel, old, new) for rel, (old, new) in proposal.changes.items()},
            "gates": checks, "opened_by_other_edits": list(proposal.opened.values()),
            "errors": [{"id": i, "error": e} for i, e in proposal.errors], "skipped": result.skipped,
        }))
    else:
        for rel, (old, new) in proposal.changes.items():
            sys.stdout.write(unified_diff(rel, old, new))
        for row in checks:
            state = "includes" if row["includes_arch"] else "STILL EXCLUDES"
            print(f"# {row['id']} -> {row['new_id']} {row['path']}:{row['line']}: now {state} {arch.name} "
                  f"(enables {' '.join(row['enables'])})", file=sys.stderr)
        for row in proposal.opened.values():
            print(f"# {row['id']} {row['path']}:{row['line']}: opened by the other edits (a helper or flag it reads), "
                  f"now enables {' '.join(row['enables'])}", file=sys.stderr)
        for gid, err in proposal.errors:
            print(f"# {gid}: {err}", file=sys.stderr)
        for skip in result.skipped:
            print(f"# skipped {skip['path']} ({skip['reason']}): {skip['error']}", file=sys.stderr)
        if refused:
            print(f"# {refused}", file=sys.stderr)
        if written:
            print(f"# applied; manifest {written}; undo with `{undo}`", file=sys.stderr)
        elif not candidates:
            print(f"# no gate false on {arch.name} to patch", file=sys.stderr)
    # The same plan gives the same code, dry run or --apply: 1 when a gate asked for stays closed.
    return EXIT_OK if proposal.complete and not refused else EXIT_NEGATIVE


def run_revert(args) -> int:
    from tpfuse.audit import manifest
    from tpfuse.audit.target import resolve_target

    try:
        root = resolve_target(args.target, native=False).root
        restored = manifest.revert(root, force=args.force, state_dir=args.state_dir)
    except (ValueError, manifest.ManifestError) as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        print(dumps_json({"target": str(root), "restored": restored}))
    else:
        for row in restored:
            print(f"{row.get('action', 'restored')} {row['path']} (sha256 {row['sha256'][:12]})")
        if not restored:
            print(f"nothing to restore: an interrupted patch had changed no file of {root}; removed its leftover state")
    return EXIT_OK
