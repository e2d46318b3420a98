"""Render audit findings: a rich table for people, JSON for programs, SARIF 2.1.0 for code scanning.

SARIF layout (OASIS SARIF 2.1.0): one run, `tool.driver.rules` with one rule per finding category
and language (`arch-gate`, `arch-gate-native`), `results[]` with `ruleId`, `level`, `message.text`
and `locations[].physicalLocation` (`artifactLocation.uri` relative to `%SRCROOT%`, `region`),
and the gate ID as a partial fingerprint so code-scanning services track a gate across commits.
"""

from __future__ import annotations

import json
import sys

from tpfuse._version import __version__
from tpfuse.audit.arch import ARCH_NAMES, Arch
from tpfuse.audit.target import REASONS
from tpfuse.audit.verdict import verdict

SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
_RULES = {
    "arch-gate": "Architecture gate that excludes the target architecture",
    "arch-gate-native": "C++/CUDA/CMake architecture condition that excludes the target architecture (report-only)",
}


def summary_line(finding, arch: Arch) -> str:
    return (
        f"{finding.path}:{finding.line} [{finding.id}] {finding.scope}: `{finding.condition}` is false on "
        f"{arch.name}; enables {', '.join(finding.enables)}; guards {finding.guards}"
    )


def to_json(result, selected: list, arch: Arch, like: Arch | None) -> dict:
    return {
        "target": str(result.target.root),
        "arch": arch.name,
        "like": like.name if like else None,
        "archs": list(ARCH_NAMES),
        "files_scanned": result.files_scanned,
        "seconds": round(result.seconds, 3),
        "skipped": result.skipped,
        "aliases": list(result.target.aliases),
        "note": result.target.note,
        "file_hashes": {f.path: result.file_hashes.get(f.path) for f in selected},
        "gates": [_with_verdict(f, arch, like) for f in selected],
        "inverse": [_with_verdict(f, arch, None) for f in result.inverse(arch)],
        "quirks": [_with_verdict(f, arch, None) for f in result.quirks(arch)],
        "counts": _counts(result),
    }


def _with_verdict(cond, arch: Arch, like: Arch | None) -> dict:
    """The condition with its verdict on `arch`; gates carry their class: `hardware` (refused by patch) or `policy`."""
    v = verdict(cond, arch, like)
    return {**cond.to_dict(), "class": v.klass, "class_reason": v.klass_reason, "verdict": v.to_dict()}


def _counts(result) -> dict:
    counts: dict = {}
    for f in result.findings:
        counts[f.category] = counts.get(f.category, 0) + 1
    return counts


def to_sarif(result, selected: list, arch: Arch) -> dict:
    results = []
    for f in selected:
        v = verdict(f, arch)
        rule = "arch-gate-native" if f.report_only else "arch-gate"
        results.append({
            "ruleId": rule,
            "level": "note" if f.report_only or not v.reported else "warning",
            "message": {"text": summary_line(f, arch) + (f" ({f.note})" if f.note else "")},
            "locations": [{
                "physicalLocation": {
                    "artifactLocation": {"uri": f.path, "uriBaseId": "%SRCROOT%"},
                    "region": {"startLine": f.line, "endLine": max(f.end_line, f.line), "startColumn": f.column},
                },
                **({"logicalLocations": [{"fullyQualifiedName": f.scope}]}
                   if f.scope not in ("<file>", "<module>") else {}),
            }],
            "partialFingerprints": {"tpfuseGateId": f.id},
            "properties": {
                "category": v.category, "kind": f.kind, "confidence": v.confidence, "enables": f.enables,
                "guards": f.guards, "reportOnly": f.report_only, "class": v.klass,
            },
        })
    return {
        "$schema": SARIF_SCHEMA,
        "version": "2.1.0",
        "runs": [{
            "tool": {"driver": {
                "name": "tpfuse-audit", "version": __version__,
                "rules": [{"id": k, "name": k, "shortDescription": {"text": v}} for k, v in _RULES.items()],
                "notifications": [{"id": r, "shortDescription": {"text": f"file not scanned: {r}"}} for r in REASONS],
            }},
            "originalUriBaseIds": {"%SRCROOT%": {"uri": result.target.root.as_uri() + "/"}},
            "invocations": [_invocation(result)],
            "results": results,
        }],
    }


def _invocation(result) -> dict:
    """SARIF `invocation`: each skipped file as an error notification; the run is unsuccessful if any."""
    notes = [{
        "level": "error",
        "message": {"text": f"not scanned: {skip['error']}"},
        "descriptor": {"id": skip.get("reason", "unreadable")},
        "locations": [{"physicalLocation": {"artifactLocation": {"uri": skip["path"], "uriBaseId": "%SRCROOT%"}}}],
    } for skip in result.skipped]
    return {"executionSuccessful": not notes, "toolExecutionNotifications": notes}


def print_table(result, selected: list, arch: Arch, like: Arch | None, *, console=None) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    # Off a terminal (a pipe, a CI log) rich would wrap at 80 columns; paths and conditions need more.
    console = console or Console(width=None if sys.stdout.isatty() else 200)
    title = f"{len(selected)} gate(s) false on {arch.name}" + (f" but not on {like.name}" if like else "")
    table = Table(title=title, show_lines=False, expand=False)
    for col in ("id", "where", "scope", "condition", "enables", "guards", "conf"):
        table.add_column(col, overflow="fold")
    for f in selected:
        v = verdict(f, arch, like)
        cond = f.condition if len(f.condition) <= 90 else f.condition[:87] + "..."
        where = f"{f.path}:{f.line}" + (" [native]" if f.report_only else "")
        conf = v.confidence + (f" ({v.category})" if v.category != "gate" else "")
        if not f.report_only and v.klass == "hardware":
            conf += " (hardware)"
        table.add_row(f.id, where, f.scope, cond, " ".join(f.enables), f.guards, conf)
    console.print(table)
    inverse = result.inverse(arch)
    if inverse:
        console.print(f"{len(inverse)} inverse gate(s) turn a feature off on {arch.name} on purpose (never patched):")
        for f in inverse:
            console.print(f"  {f.id} {f.path}:{f.line} `{f.condition[:80]}`: on for {' '.join(f.enables)}; {f.guards}")
    quirks = result.quirks(arch)
    if quirks:
        console.print(f"{len(quirks)} quirk(s) tune or work around other architectures, not applied on {arch.name} "
                      "(not gates):")
        for f in quirks:
            console.print(f"  {f.id} {f.path}:{f.line} `{f.condition[:80]}`: on for {' '.join(f.enables)}; {f.guards}")
    counts = ", ".join(f"{v} {k}" for k, v in sorted(_counts(result).items()))
    console.print(f"scanned {result.files_scanned} files in {result.seconds:.2f} s; all architecture conditions: "
                  f"{counts or 'none'}")
    for skip in result.skipped:
        # escape: an error text such as "[Errno 13] ..." is not rich markup
        console.print(f"[yellow]skipped[/] {escape(skip['path'])} ({skip.get('reason', 'unreadable')}): "
                      f"{escape(skip['error'])}", highlight=False)
    for alias in result.target.aliases:
        console.print(f"[dim]alias[/] {escape(alias['path'])} -> {escape(alias['target'])} (a link into the tree, "
                      f"audited as {escape(alias['target'])})", highlight=False)
    if result.target.note:
        console.print(f"[yellow]note[/] {escape(result.target.note)}", highlight=False)


def dumps(obj) -> str:
    return json.dumps(obj, indent=2, sort_keys=False)
