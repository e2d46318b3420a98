"""`tpfuse audit` / `patch` / `revert`: find, explain and open architecture gates in an engine's source.

Exit codes: 0 ok; 1 gates found with --fail-on-gates, or a patch/revert that could not do all it
was asked; 2 usage or environment error (bad path, unknown arch, read-only file, changed file);
3 (audit) the scan is incomplete: some file could not be read, decoded or parsed, or is above the
per-file size bound; each is listed under `skipped` with its reason, and 3 wins over 1.
Imports nothing heavy at module import (no torch; the audit modules load when a command runs).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tpfuse.cli.main import EXIT_NEGATIVE, EXIT_OK, UsageError, dumps_json

EXIT_INCOMPLETE = 3  # audit: some file was not scanned (listed under `skipped`)
AUDIT_EXIT_CODES = (
    "exit codes: 0 scanned everything (gates or not, without --fail-on-gates); 1 gates found with --fail-on-gates; "
    "2 usage or environment error; 3 incomplete scan: a file could not be read, decoded or parsed, or is above the "
    "per-file size bound (TPFUSE_AUDIT_MAX_BYTES, default 1 MiB); each is listed under 'skipped' with its reason; 3 wins over 1"
)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("audit", help="list architecture gates that are false on --arch", description=__doc__.splitlines()[0], epilog=AUDIT_EXIT_CODES)
    _common(p)
    p.add_argument("--sarif", metavar="FILE", help="also write SARIF 2.1.0 to FILE")
    p.add_argument("--all", action="store_true", help="also list non-gates (test skips, log/message branches, helper and flag definitions)")
    p.add_argument("--no-native", action="store_true", help="skip C/C++/CUDA/CMake files")
    p.add_argument("--fail-on-gates", action="store_true", help="exit 1 when gates are found (CI)")
    p.set_defaults(run=run_audit)

    p = subparsers.add_parser("patch", help="print (or --apply) the minimal edit that opens gates for --arch")
    _common(p)
    p.add_argument("--only", nargs="+", metavar="ID", help="patch only these gate IDs (from `tpfuse audit`)")
    p.add_argument("--apply", action="store_true", help="write the edit (atomically, with backups and a manifest)")
    p.add_argument("--audit-json", metavar="FILE", help="refuse files whose hash differs from this earlier `audit --json` output")
    p.add_argument("--state-dir", metavar="DIR", help="where backups and the manifest go (default ~/.cache/tpfuse/patches)")
    p.add_argument("--force-hardware", action="store_true", help="also patch hardware gates (guarded code needs what --arch lacks); warns")
    p.set_defaults(run=run_patch)

    p = subparsers.add_parser("revert", help="restore the files a `tpfuse patch --apply` changed, byte for byte")
    p.add_argument("target", metavar="TARGET", help="the directory, file or package that was patched")
    p.add_argument("--force", action="store_true", help="restore even files changed after patching, or, when the manifest is unreadable, every backup SHA256SUMS verifies")
    p.add_argument("--state-dir", metavar="DIR", help="where the manifest was written")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(run=run_revert)


def _common(p) -> None:
    p.add_argument("target", metavar="TARGET", help="a directory, a .py file, or an installed package name (sglang, vllm, flashinfer, tensorrt_llm)")
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
        raise UsageError(f"--like {like.name} is the same as --arch; pick an architecture the gates already enable, e.g. sm100")
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


def run_audit(args) -> int:
    from tpfuse.audit import report

    arch, like = _archs(args)
    result = _run_audit(args, native=not args.no_native, keep_trees=False)  # a report: no patch needs the trees
    selected = result.selected(arch, like, include_non_gates=args.all)
    if args.sarif:
        Path(args.sarif).write_text(report.dumps(report.to_sarif(result, selected, arch)))
    if args.json:
        print(report.dumps(report.to_json(result, selected, arch, like)))
    else:
        report.print_table(result, selected, arch, like)
    gates = [f for f in selected if f.category == "gate"]
    if result.skipped:
        return EXIT_INCOMPLETE
    return EXIT_NEGATIVE if args.fail_on_gates and gates else EXIT_OK


def run_patch(args) -> int:
    from tpfuse.audit import manifest, report
    from tpfuse.audit.hardware import hardware_needs
    from tpfuse.audit.patch import HARM_MARK, build_changes, unified_diff, verify

    arch, like = _archs(args)
    result = _run_audit(args, native=False)
    candidates = result.selected(arch, like)
    if args.only:
        known = {f.id: f for f in result.findings}
        unknown = [i for i in args.only if i not in known]
        if unknown:
            raise UsageError(f"--only: no gate with ID {', '.join(unknown)} in {result.target.root}; run `tpfuse audit` for the IDs")
        candidates = [known[i] for i in args.only]  # an inverse gate or non-gate asked for by ID is refused with its reason
    else:
        candidates = [f for f in candidates if not f.report_only and f.category == "gate"]
    changes, plans, errors = build_changes(result, candidates, arch, like, force_hardware=args.force_hardware)
    forced = [(f.id, hardware_needs(f, arch)) for f in candidates if f.id in plans and hardware_needs(f, arch)]
    for gid, needs in forced:
        print(f"# warning: {gid} is a hardware gate (guarded code needs {needs}, which {arch.name} lacks); patched because of --force-hardware", file=sys.stderr)
    expected = dict(result.file_hashes)
    if args.audit_json:
        try:
            earlier = json.loads(Path(args.audit_json).read_text()).get("file_hashes", {})
        except (OSError, ValueError, AttributeError) as exc:
            raise UsageError(f"--audit-json: {args.audit_json} is not the output of `tpfuse audit --json` ({type(exc).__name__}: {exc}); run the audit again") from None
        stale = [rel for rel in changes if rel in earlier and earlier[rel] != expected.get(rel)]
        if stale:
            raise UsageError(f"patch: {', '.join(stale)} changed since the audit in {args.audit_json}; audit again")
    checks = verify(result, changes, candidates, plans, arch) if changes else []
    written = None
    harmful = [gid for gid, err in errors if HARM_MARK in err] + [row["id"] for row in checks if row["harm"]]
    refused = args.apply and bool(harmful)
    if refused:
        # An edit that re-audits as still excluding (or as changing other architectures) is never written, nor any other.
        print(f"# patch --apply refused, nothing written: the edit of {', '.join(harmful)} does not open it safely"
              + (f"; apply the others with --only {' '.join(sorted(plans))}" if plans else ""), file=sys.stderr)
    elif args.apply and changes:
        meta = {"arch": arch.name, "like": like.name if like else None, "gates": sorted(plans)}
        try:
            written = manifest.apply(result.target.root, {rel: new for rel, (_, new) in changes.items()}, expected, meta, state_dir=args.state_dir)
        except manifest.ManifestError as exc:
            raise UsageError(str(exc)) from None
        checks = verify(result, changes, candidates, plans, arch, from_disk=True)
    if args.json:
        print(report.dumps({
            "target": str(result.target.root), "arch": arch.name, "applied": bool(written), "refused": refused,
            "manifest": str(written) if written else None,
            "diff": {rel: unified_diff(rel, old, new) for rel, (old, new) in changes.items()},
            "gates": checks, "errors": [{"id": i, "error": e} for i, e in errors], "skipped": result.skipped,
        }))
    else:
        for rel, (old, new) in changes.items():
            sys.stdout.write(unified_diff(rel, old, new))
        for row in checks:
            state = "includes" if row["includes_arch"] else "STILL EXCLUDES"
            print(f"# {row['id']} -> {row['new_id']} {row['path']}:{row['line']}: now {state} {arch.name} (enables {' '.join(row['enables'])})", file=sys.stderr)
        for gid, err in errors:
            print(f"# {gid}: {err}", file=sys.stderr)
        for skip in result.skipped:
            print(f"# skipped {skip['path']} ({skip['reason']}): {skip['error']}", file=sys.stderr)
        if written:
            print(f"# applied; manifest {written}; undo with `tpfuse revert {result.target.root}`", file=sys.stderr)
        elif not candidates:
            print(f"# no gate false on {arch.name} to patch", file=sys.stderr)
    if refused:
        return EXIT_NEGATIVE
    if written:
        return EXIT_OK  # gates refused with a reason (hardware, inverse, unpatchable) are reported, not a failed apply
    if errors or any(not row["includes_arch"] for row in checks):
        return EXIT_NEGATIVE
    return EXIT_OK


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
