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
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from tpfuse.audit.arch import ARCHS, Arch
from tpfuse.audit.modules import module_name_for
from tpfuse.audit.native import scan_native
from tpfuse.audit.resolve import ARCH_RE, Resolver
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

# Text that any Python file holding an architecture condition contains, searched in the raw bytes
# lower-cased (its words are ASCII): plain substring tests and a regex with a literal prefix (an
# alternation with IGNORECASE was the slowest part of reading an engine).
_TEXT_RE = re.compile(rb"sm_?\d{2,3}|sm\d+x")
# "capability" alone is too common (model and API capabilities): only the device's spellings. Each
# group is searched only where its common part is in the text (one pass each instead of one a word).
_TEXT_WORDS = (
    (b"capabilit",
     (b"device_capabilit", b"compute_capabilit", b"devicecapabilit", b"capability.major", b"capability[0]")),
    (b"device_", (b"get_device_properties", b"device_sm")),
    (b"platform", (b"get_platform()", b"current_platform")),
    (b"blackwell", ()), (b"hopper", ()), (b"ampere", ()), (b"sm_version", ()),
)


def _mentions_arch(data: bytes) -> bool:
    lower = data.lower()
    for common, words in _TEXT_WORDS:
        if common in lower and (not words or any(w in lower for w in words)):
            return True
    return bool(_TEXT_RE.search(lower))


def _native_mentions_arch(data: bytes) -> bool:
    return b"__CUDA_ARCH" in data or b"arch" in data.lower()  # what native.py's #if and CMake scans need


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
    # allocation burst (a whole-engine audit then takes several times as long: benchmarks/results/README.md),
    # and ASTs hold no cycles to free.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _Run(spec, native=native, overlay=overlay, progress=progress, only=only, keep_trees=keep_trees).run()
    finally:
        # What the audit built stays alive with its result and holds no garbage cycles: moving it to
        # the permanent generation keeps every later collection, and the one at interpreter exit
        # (which took longer than the audit itself, measured on sglang), from rescanning it.
        gc.freeze()
        if enabled:
            gc.enable()


# `from X import a, b` / `from X import (a,\n b as c)`: what a file takes from other modules.
_FROM_IMPORT_BYTES = re.compile(rb"from[ \t]+(\.*)([\w.]*)[ \t]+import[ \t]+(\([^)]*\)|[^\n;#]*)")
_NAME_BYTES = re.compile(rb"[A-Za-z_]\w*")
# The same statements without groups: `findall` then gives their whole text, without a match object each.
_FROM_IMPORT_TEXT = re.compile(rb"from[ \t]+\.*[\w.]*[ \t]+import[ \t]+(?:\([^)]*\)|[^\n;#]*)")
# Rounds of the consumer pass: a name that holds an architecture value in a module without architecture
# text (a flag built from another module's flag) is found one round after the flag it reads.
_CONSUMER_ROUNDS = 3


def _from_imports(data: bytes) -> list:
    """[(dots, module, [(name, bound as)])] of the file's `from ... import` statements (any indentation)."""
    out = []
    for m in _FROM_IMPORT_BYTES.finditer(data):
        pairs = []
        for part in m.group(3).strip(b"()").split(b","):
            words = _NAME_BYTES.findall(part)
            if words:
                pairs.append((words[0].decode(),
                              (words[2] if len(words) > 2 and words[1] == b"as" else words[0]).decode()))
        out.append((len(m.group(1)), m.group(2).decode() or None, pairs))
    return out


class _Run:
    """One audit: the files, the shared resolver, the conditions found per file."""

    def __init__(self, spec: str, *, native: bool, overlay: dict | None, progress, only: set | None, keep_trees: bool):
        self.start = time.perf_counter()
        max_source_bytes()  # a bad TPFUSE_AUDIT_MAX_BYTES is a ValueError naming it, before any file is read
        self.target = resolve_target(spec, native=native)
        self.overlay = {Path(k).resolve(): v for k, v in (overlay or {}).items()}
        self.modules, roots = _module_names(self.target)
        self.resolver = Resolver(roots, self.overlay, within=_context_root(self.target, self.modules, roots))
        self.progress, self.only, self.keep_trees = progress, only, keep_trees
        self.by_path: dict = {}  # rel -> conditions of that file (a rescan replaces them)
        self.sites, self.hashes, self.skipped = {}, {}, list(self.target.unlisted)
        self.scanned: set = set()
        # rel -> (path, module name, its from-import statements' bytes) of every readable Python file
        self.imports: dict = {}
        self._import_pairs: dict = {}  # rel -> _from_imports of it, read when needed
        self._import_words: dict = {}  # rel -> the identifiers of its from-import statements
        self.exports: set = set()  # names without architecture text that hold an architecture value somewhere
        # A file audited alone (or a few, as a patch's re-audit does) has no tree to learn the exports
        # from: each of its imported names is resolved instead, which gives a tree's verdicts.
        self.precise = len(self.modules) == 1 or only is not None
        self._rels = [_relative(path, self.target.root) for path, _ in self.modules]
        self._index = {rel: i for i, rel in enumerate(self._rels)}
        self._root = self.target.root.resolve()

    def run(self) -> AuditResult:
        total = len(self.modules) + len(self.target.native_files)
        pending, done = [], 0
        for (path, name), rel in zip(self.modules, self._rels):
            item = self._read_pass(path, name, rel) if self.only is None or rel in self.only else None
            if item is not None:
                pending.append(item)
            elif self.progress:
                done += 1
                self.progress(done, total)
        # Modules before the modules that import them, so a name one exports is known when the
        # other is scanned (each is scanned once instead of again by `_consumers`).
        for item in _providers_first(pending, self.imports):
            self._scan_pass(*item)
            if self.progress:
                done += 1
                self.progress(done, total)
        if not self.precise:
            self._consumers()
        findings = [f for rel in sorted(self.by_path, key=self._index.__getitem__) for f in self.by_path[rel]]
        if self.target.native_files and self.only is None:
            findings += self._native(total)
        return AuditResult(self.target, findings, self.hashes, self.skipped, len(self.scanned),
                           time.perf_counter() - self.start,
                           self.sites, self.resolver)

    def _read(self, path: Path, rel: str):
        """(text or None, raw bytes or None, mentions the architecture); None when the file cannot be read."""
        if path in self.overlay:
            text = self.overlay[path]
            data = text.encode("utf-8")
            return text, data, _mentions_arch(data)
        try:  # a file that cannot be read, decoded or is above the size bound is reported, never fatal
            data = read_bytes(path)
            # The filter's words are ASCII: it reads the raw bytes, and only a file that may hold a
            # gate is decoded (strictly), as only such a file is parsed.
            mentions = _mentions_arch(data)
            return (decode_source(data)[0] if mentions else None), data, mentions
        except SourceSkip as exc:
            if not _holds_no_arch(path, exc):
                self.skipped.append({"path": rel, "reason": exc.reason, "error": str(exc)})
            return None

    def _read_pass(self, path: Path, name: str, rel: str) -> tuple | None:
        """(path, name, rel, text, sha256) of a file that may hold a condition, else None."""
        read = self._read(path, rel)
        if read is None:
            return None
        text, data, mentions = read
        # Only the import statements' text is kept, read into names when a name it may import matters.
        blob = b"\n".join(_FROM_IMPORT_TEXT.findall(data)) if b"import" in data else b""
        self.imports[rel] = (path, name, blob)
        if mentions and text is not None or self.precise:
            return path, name, rel, text if mentions else None, sha256_bytes(data)
        return None

    def _scan_pass(self, path: Path, name: str, rel: str, text: str | None, digest: str) -> None:
        if self.precise:
            extra = self._arch_imports(rel, None)
        else:
            imported = {orig for _, _, pairs in self._imports_of(rel) for orig, _ in pairs} if self.exports else set()
            extra = self._arch_imports(rel, imported & self.exports) if imported & self.exports else frozenset()
        mentions = text is not None and self.resolver.holds_tokens(name, path, text)
        # Without a token in code its architecture words are in comments, docstrings or messages only.
        if mentions or extra:
            self.hashes[rel] = digest
            self._scan(path, name, rel, extra)

    def _arch_imports(self, rel: str, candidates: set | None) -> frozenset:
        """Names the file imports that hold an architecture value where they come from (only `candidates`, if given)."""
        path, name, blob = self.imports[rel]
        imports = self._imports_of(rel)
        found = set()
        for level, module, pairs in imports:
            for orig, bound in pairs:
                if candidates is not None and orig not in candidates or bound in found or ARCH_RE.search(bound):
                    continue
                if self.resolver.arch_valued(self.resolver.import_value(name, module, level, orig)):
                    found.add(bound)
        return frozenset(found)

    def _scan(self, path: Path, name: str, rel: str, extra: frozenset) -> None:
        resolver = self.resolver
        if extra:
            resolver.extra_hot[name] = extra
            resolver.forget(name)  # parsed before the names it imports were known to matter
        info = resolver.module(name, path)
        self.scanned.add(rel)
        if rel not in self.hashes:  # a consumer found by the second pass: read for its hash only now
            read = self._read(path, rel)
            if read is None:
                return
            self.hashes[rel] = sha256_bytes(read[1])
        if info is None:
            error = resolver.errors.get(path.resolve(), "SyntaxError: unparsable")
            self.skipped.append({"path": rel, "reason": "unparsable", "error": error})
            return
        # never silently: a dropped file hides its gates
        if info.path != path and info.path.resolve() != path.resolve():
            self.skipped.append({"path": rel, "reason": "name-clash",
                                 "error": f"module name {name} already names {info.path}"})
            return
        try:
            scanner = ModuleScanner(resolver, name, rel)
            module_sites = scanner.scan()
        except RecursionError:  # a pathologically nested expression: report, never crash
            self.skipped.append({"path": rel, "reason": "unparsable",
                                 "error": "RecursionError: expression nested too deeply"})
            return
        for cond_id in [c.id for c in self.by_path.get(rel, [])]:
            self.sites.pop(cond_id, None)
        self.by_path[rel] = _collect(module_sites, rel, scanner.lines, self.sites, self._root)
        if not self.precise:
            self.exports |= resolver.exports_of(name)
        if not self.keep_trees:
            self.sites.clear()
            resolver.release(name)

    def _imports_of(self, rel: str) -> list:
        """`_from_imports` of file `rel`, read once."""
        if rel not in self._import_pairs:
            self._import_pairs[rel] = _from_imports(self.imports[rel][2])
        return self._import_pairs[rel]

    def _consumers(self) -> None:
        """Files that read an architecture value through an imported name without architecture text
        (`from .flags import FAST_PATH`, `if not FAST_PATH:`): scanned, or scanned again with those names."""
        done: dict = {}
        for _ in range(_CONSUMER_ROUNDS):
            grew = False
            keys = {e.encode() for e in self.exports}
            for rel, (path, name, blob) in self.imports.items():
                if not blob:
                    continue
                if rel not in self._import_words:
                    self._import_words[rel] = frozenset(_NAME_BYTES.findall(blob))
                if self._import_words[rel].isdisjoint(keys):
                    continue
                imports = self._imports_of(rel)
                wanted = {orig for _, _, pairs in imports for orig, _ in pairs} & self.exports
                if not wanted or done.get(rel) == wanted:
                    continue
                done[rel] = wanted
                info = self.resolver.module(name) if rel in self.scanned else None
                bound = {b for _, _, pairs in imports for orig, b in pairs if orig in wanted}
                if info is not None and bound <= info.hot and not info.hides(wanted):
                    continue  # scanned with those names known to matter, every def reading them parsed
                extra = self._arch_imports(rel, wanted)
                if extra:
                    before = len(self.exports)
                    self._scan(path, name, rel, extra)
                    grew = grew or len(self.exports) > before
            if not grew:
                return

    def _native(self, total: int) -> list:
        found = []
        for j, path in enumerate(self.target.native_files):
            rel = path.relative_to(self.target.root).as_posix()
            try:
                data = read_bytes(path)
            except SourceSkip as exc:
                if not _holds_no_arch(path, exc, native=True):
                    self.skipped.append({"path": rel, "reason": exc.reason, "error": str(exc)})
                continue
            conditions = scan_native(rel, data.decode("utf-8", errors="replace"))
            if conditions:
                self.hashes[rel] = sha256_bytes(data)
                found.extend(conditions)
            self.scanned.add(rel)
            if self.progress:
                self.progress(len(self.modules) + j + 1, total)
        return found


def _relative(path: Path, root: Path) -> str:
    """`path.relative_to(root).as_posix()` for a path under `root`, as string operations (pathlib's
    were a visible part of listing an engine's thousands of files)."""
    text, prefix = str(path), str(root).rstrip(os.sep) + os.sep
    if text.startswith(prefix):
        return text[len(prefix):].replace(os.sep, "/")
    return path.relative_to(root).as_posix()


def _providers_first(pending: list, imports: dict) -> list:
    """`pending` ((path, module name, rel, ...) items) ordered so that a module comes after the
    modules of `pending` it imports from (`imports[rel]`'s from-import statements), cycles cut
    where they close; otherwise in the given order."""
    index = {item[1]: k for k, item in enumerate(pending)}

    def providers(k: int) -> list:
        path, name, rel = pending[k][:3]
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        out = []
        for m in _FROM_IMPORT_BYTES.finditer(imports[rel][2]):
            dots, module = len(m.group(1)), m.group(2).decode()
            if dots:
                parts = package.split(".") if package else []
                parts = parts[: len(parts) - (dots - 1)] if dots > 1 else parts
                module = ".".join(parts + ([module] if module else []))
            for candidate in [module] + [f"{module}.{w.decode()}" for w in _NAME_BYTES.findall(m.group(3))]:
                j = index.get(candidate)
                if j is not None and j != k:
                    out.append(j)
        return out

    order, state = [], [0] * len(pending)  # 0 new, 1 on the path, 2 placed
    for root in range(len(pending)):
        if state[root]:
            continue
        stack = [(root, iter(providers(root)))]
        state[root] = 1
        while stack:
            k, rest = stack[-1]
            j = next(rest, None)
            if j is None:
                stack.pop()
                state[k] = 2
                order.append(pending[k])
            elif not state[j]:
                state[j] = 1
                stack.append((j, iter(providers(j))))
    return order


def _module_names(target: Target) -> tuple[list, list]:
    """[(path, dotted name)] of the target's Python files and their import roots; names are unique."""
    modules, roots, taken = [], [], {}
    # directory -> (package prefix, import root): one walk up per directory, not per file; the keys are
    # strings (hashing and taking apart thousands of paths with pathlib was a visible part of an audit)
    by_dir: dict = {}
    packages: dict = {}  # directory -> whether it holds __init__.py, for module_name_for's walks up
    for path in target.python_files:
        directory, base = os.path.split(str(path))
        if directory not in by_dir:
            parent = path.parent
            name, root = module_name_for(parent / "__init__.py", lambda d=parent: _import_heads(d), packages=packages)
            by_dir[directory] = ("" if root == parent.resolve() else name, root)
            if root not in roots:  # a file's root is its directory's: listed in the order files first reach it
                roots.append(root)
        pkg, root = by_dir[directory]
        stem = base[:-3] if base.endswith(".py") and len(base) > 3 else path.stem
        name = ".".join(p for p in (pkg, "" if base == "__init__.py" else stem) if p) or stem
        if taken.setdefault(name, path) != path:
            # Two plain script directories with the same file name: the path from the target root tells them apart.
            name = ".".join(path.relative_to(target.root).with_suffix("").parts)
        modules.append((path, name))
    return modules, roots


def _import_heads(directory: Path) -> str:
    """The first lines of a few of the directory's modules: where their absolute imports are."""
    heads = []
    try:  # what `sorted(directory.glob("*.py"))` lists, by name
        names = sorted(n for n in os.listdir(directory) if n.endswith(".py"))[:5]
    except OSError:
        names = []
    for name in names:
        try:
            with open(os.path.join(directory, name), "rb") as fh:
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


def _collect(module_sites: list, rel: str, lines: list, sites: dict, root: Path) -> list:
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
            values={a.name: site.value.at(a) for a in ARCHS}, role=site.role, effect=site.effect,
            turns_off=site.turns_off,
            weak=site.value.weak, note=site.note, requires=list(site.requires), table=site.table,
        ))
    number_repeats(conditions)
    for cond in conditions:
        if cond.table and "file" in cond.table:  # where the table is: relative to TARGET when inside it
            table = dict(cond.table)
            file = Path(table.pop("file")).resolve()
            table["path"] = file.relative_to(root).as_posix() if file.is_relative_to(root) else str(file)
            cond.table = table
    for cond, site in zip(conditions, module_sites):
        sites[cond.id] = site
    return conditions
