"""The audit driver: `audit()` finds every architecture condition of a target and evaluates it for each architecture.

Data flow: `resolve_target` lists the files -> a cheap text filter keeps the Python files that
mention an architecture -> `ModuleScanner` (scan.py) evaluates their conditions through one shared
`Resolver` (resolve.py) -> each site becomes an `ArchCondition` (verdict.py) with a stable ID ->
`native.scan_native` adds report-only C++/CUDA/CMake conditions. `AuditResult.selected(arch, like)`
is what the CLI reports: the conditions whose verdict (verdict.py) is a gate excluding `arch`.

Gate IDs are a short hash of the module's dotted name, the enclosing scope, the site kind and the
normalized condition text (`ast.unparse`), so they survive edits elsewhere in the file and
formatting changes, and `--only ID` works across runs.
"""

from __future__ import annotations

import ast
import gc
import hashlib
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from tpfuse.audit.arch import ARCHS, Arch
from tpfuse.audit.modules import module_name_for
from tpfuse.audit.native import scan_native
from tpfuse.audit.resolve import Resolver
from tpfuse.audit.scan import ModuleScanner
from tpfuse.audit.target import (
    SourceSkip,
    Target,
    decode_source,
    max_source_bytes,
    read_bytes,
    resolve_target,
    stream_matches,
)
from tpfuse.audit.verdict import APART, ArchCondition, number_repeats, stable_id, verdict

# Text that any Python file holding an architecture condition contains.
# Plain substring tests and a regex with a literal prefix: an alternation with IGNORECASE took
# seconds over sglang's 68 MB of Python.
_TEXT_RE = re.compile(r"sm_?\d{2,3}|sm\d+x")
# "capability" alone is too common (model and API capabilities): only the spellings of section 3.
_TEXT_WORDS = (
    "device_capabilit", "compute_capabilit", "devicecapabilit", "capability.major", "capability[0]", "get_device_properties",
    "blackwell", "hopper", "ampere", "device_sm", "sm_version", "get_platform()", "current_platform",
)


def _mentions_arch(text: str) -> bool:
    lower = text.lower()
    return any(w in lower for w in _TEXT_WORDS) or bool(_TEXT_RE.search(lower))


def _native_mentions_arch(text: str) -> bool:
    return "__CUDA_ARCH" in text or "arch" in text.lower()  # what native.py's #if and CMake scans need


def _holds_no_arch(path: Path, skip: SourceSkip, *, native: bool = False) -> bool:
    """A file above the size bound whose text, streamed, never mentions an architecture holds no gate."""
    if skip.reason != "too-large":
        return False
    try:
        return not stream_matches(path, _native_mentions_arch if native else _mentions_arch)
    except SourceSkip:
        return False


@dataclass
class AuditResult:
    target: Target
    findings: list
    file_hashes: dict
    skipped: list
    files_scanned: int
    seconds: float
    sites: dict = field(default_factory=dict)  # id -> Site (Python findings; for patch)
    resolver: Resolver | None = None

    def verdicts(self, arch: Arch, like: Arch | None = None) -> list:
        """[(condition, verdict)] of every finding on `arch` (verdict.py decides)."""
        return [(f, verdict(f, arch, like)) for f in self.findings]

    def selected(self, arch: Arch, like: Arch | None = None, *, include_non_gates: bool = False) -> list:
        """Gates that exclude `arch` (false there, not false on `like` or some other architecture);
        with `include_non_gates`, the non-gates false there too (never inverse gates or quirks)."""
        return [f for f, v in self.verdicts(arch, like)
                if v.excludes and (v.category == "gate" or include_non_gates and v.category not in APART)]

    def inverse(self, arch: Arch) -> list:
        """Inverse gates off on `arch`: features turned off there on purpose (never patched)."""
        return [f for f, v in self.verdicts(arch) if v.category == "inverse" and v.excludes]

    def quirks(self, arch: Arch) -> list:
        """Per-architecture tunings and workarounds not applied on `arch` (never gates)."""
        return [f for f, v in self.verdicts(arch) if v.category == "quirk" and v.excludes]


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def audit(spec: str, *, native: bool = True, overlay: dict | None = None, progress=None, only: set | None = None,
          keep_trees: bool = True) -> AuditResult:
    """Audit TARGET `spec` (directory, file or installed package name); never imports it.

    `overlay` maps paths to replacement source text (used to re-audit a patch before writing it).
    `only` restricts the scanned Python files to these relative paths (other modules are still
    parsed when a gate depends on them). `progress(done, total)` is called after each file.
    `keep_trees=False` (a report only, no patch) lets each module's syntax tree go once it is
    scanned, keeping only what other modules may resolve through it; `sites` is then empty."""
    # The audit keeps hundreds of ASTs alive; the cyclic collector would rescan them after every
    # allocation burst (measured: 38 s instead of a few for sglang), and ASTs hold no cycles to free.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _audit(spec, native=native, overlay=overlay, progress=progress, only=only, keep_trees=keep_trees)
    finally:
        # What the audit built stays alive with its result and holds no garbage cycles: moving it to
        # the permanent generation keeps every later collection, and the one at interpreter exit
        # (which took longer than the audit itself, measured on sglang), from rescanning it.
        gc.freeze()
        if enabled:
            gc.enable()


def _audit(spec: str, *, native: bool, overlay: dict | None, progress, only: set | None, keep_trees: bool) -> AuditResult:
    start = time.perf_counter()
    max_source_bytes()  # a bad TPFUSE_AUDIT_MAX_BYTES is a ValueError naming it, before any file is read
    target = resolve_target(spec, native=native)
    overlay = {Path(k).resolve(): v for k, v in (overlay or {}).items()}
    modules, roots = _module_names(target)
    resolver = Resolver(roots, overlay, within=_context_root(target, modules, roots))
    findings, sites, hashes, skipped = [], {}, {}, list(target.unlisted)
    total = len(modules) + len(target.native_files)
    scanned = 0
    for i, (path, name) in enumerate(modules):
        rel = path.relative_to(target.root).as_posix()
        if only is not None and rel not in only:
            continue
        if path in overlay:
            text = overlay[path]
            mentions = _mentions_arch(text)
            digest = sha256_bytes(text.encode("utf-8"))
        else:
            try:  # a file that cannot be read, decoded or is above the size bound is reported, never fatal
                data = read_bytes(path)
                # The filter's words are ASCII: it reads the raw bytes, and only a file that may hold a
                # gate is decoded (strictly), as only such a file is parsed.
                mentions = _mentions_arch(data.decode("latin-1"))
                text = decode_source(data)[0] if mentions else ""
            except SourceSkip as exc:
                if not _holds_no_arch(path, exc):
                    skipped.append({"path": rel, "reason": exc.reason, "error": str(exc)})
                if progress:
                    progress(i + 1, total)
                continue
            digest = sha256_bytes(data)
            del data
        if mentions:
            info = resolver.module(name, path)
            scanned += 1
            if info is None:
                error = resolver.errors.get(path.resolve(), "SyntaxError: unparsable")
                skipped.append({"path": rel, "reason": "unparsable", "error": error})
            elif info.path.resolve() != path.resolve():  # never silently: a dropped file hides its gates
                skipped.append({"path": rel, "reason": "name-clash", "error": f"module name {name} already names {info.path}"})
            else:
                hashes[rel] = digest
                try:
                    scanner = ModuleScanner(resolver, name, rel)
                    module_sites = scanner.scan()
                except RecursionError:  # a pathologically nested expression: report, never crash
                    skipped.append({"path": rel, "reason": "unparsable", "error": "RecursionError: expression nested too deeply"})
                    continue
                _collect(module_sites, rel, scanner.lines, findings, sites)
                if not keep_trees:
                    sites.clear()
                    resolver.release(name)
        if progress:
            progress(i + 1, total)
    if target.native_files and only is None:
        for j, path in enumerate(target.native_files):
            rel = path.relative_to(target.root).as_posix()
            try:
                data = read_bytes(path)
            except SourceSkip as exc:
                if not _holds_no_arch(path, exc, native=True):
                    skipped.append({"path": rel, "reason": exc.reason, "error": str(exc)})
                continue
            found = scan_native(rel, data.decode("utf-8", errors="replace"))
            if found:
                hashes[rel] = sha256_bytes(data)
                findings.extend(found)
            scanned += 1
            if progress:
                progress(len(modules) + j + 1, total)
    return AuditResult(target, findings, hashes, skipped, scanned, time.perf_counter() - start, sites, resolver)


def _module_names(target: Target) -> tuple[list, list]:
    """[(path, dotted name)] of the target's Python files and their import roots; names are unique."""
    modules, roots, taken = [], [], {}
    by_dir: dict = {}  # directory -> (package prefix, import root): one walk up per directory, not per file
    for path in target.python_files:
        if path.parent not in by_dir:
            name, root = module_name_for(path.parent / "__init__.py", lambda d=path.parent: _import_heads(d))
            by_dir[path.parent] = ("" if root == path.parent.resolve() else name, root)
        pkg, root = by_dir[path.parent]
        stem = "" if path.name == "__init__.py" else path.stem
        name = ".".join(p for p in (pkg, stem) if p) or path.stem
        if taken.setdefault(name, path) != path:
            # Two plain script directories with the same file name: the path from the target root tells them apart.
            name = ".".join(path.relative_to(target.root).with_suffix("").parts)
        modules.append((path, name))
        if root not in roots:
            roots.append(root)
    return modules, roots


def _import_heads(directory: Path) -> str:
    """The first lines of a few of the directory's modules: where their absolute imports are."""
    heads = []
    for path in sorted(directory.glob("*.py"))[:5]:
        try:
            with open(path, "rb") as fh:
                heads.append(fh.read(8192).decode("utf-8", errors="replace"))
        except OSError:
            continue
    return "\n".join(heads)


def _context_root(target: Target, modules: list, roots: list) -> Path:
    """The tree whose modules a gate may depend on: the whole top-level package holding the target.

    Auditing `srt/server_args.py` alone or inside the whole `sglang` tree must give the same
    verdicts, so both resolve `from sglang.srt.utils import ...` in the same package."""
    if len(roots) == 1 and modules:
        top = roots[0] / modules[0][1].split(".")[0]
        if top.is_dir() and target.root.resolve().is_relative_to(top.resolve()):
            return top
    return target.root


def _segment(lines: list, node: ast.AST) -> str:
    """Source text of `node` (ast.get_source_segment re-splits the whole file on every call)."""
    first, last = node.lineno - 1, (node.end_lineno or node.lineno) - 1
    if first == last:
        return lines[first].encode()[node.col_offset: node.end_col_offset].decode(errors="replace")
    parts = [lines[first].encode()[node.col_offset:].decode(errors="replace"), *lines[first + 1: last]]
    parts.append(lines[last].encode()[: node.end_col_offset].decode(errors="replace"))
    return "\n".join(parts)


def _collect(module_sites: list, rel: str, lines: list, findings: list, sites: dict) -> None:
    conditions = []
    for site in module_sites:
        node = site.node
        normalized = ast.unparse(node)
        # The module's dotted name, not the path: auditing a file alone or in its tree gives one ID.
        cond_id = stable_id(site.module, site.scope, site.kind, normalized)
        # A condition over several lines may carry comments; show it normalized instead.
        text = _segment(lines, node) if node.lineno == node.end_lineno else normalized
        conditions.append(ArchCondition(
            id=cond_id, path=rel, line=node.lineno, end_line=node.end_lineno or node.lineno, column=node.col_offset + 1,
            scope=site.scope, kind=site.kind, condition=" ".join(text.split()), guards=site.guards,
            values={a.name: site.value.at(a) for a in ARCHS}, role=site.role, effect=site.effect, turns_off=site.turns_off,
            weak=site.value.weak, note=site.note, requires=list(site.requires),
        ))
    number_repeats(conditions)
    for cond, site in zip(conditions, module_sites):
        findings.append(cond)
        sites[cond.id] = site
