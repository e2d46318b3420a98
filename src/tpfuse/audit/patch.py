"""Turn `Plan`s (plan.py) into new file text by editing the source at `ast` positions.

Every edit replaces or inserts bytes at the positions `ast` records (line, UTF-8 byte column;
an expression's range excludes enclosing parentheses), so all other text, formatting and
comments stay byte for byte; the result is parsed again before it is returned. Edits: replace
an atom with `atom or sibling` (parenthesized unless the atom already sits in an `or`), append an
element to a literal tuple/list/set, rewrite `x == a` as `x in (a, b)`, add a name to a
`from ... import` next to its sibling, insert a statement after its sibling. Edits are applied
from the end of the file backwards, so earlier positions stay valid. `propose_patch` returns the
new text per file and never writes; `apply_patch` re-audits it and, only if every edit opens its gate
as intended, has manifest.py write it.
"""

from __future__ import annotations

import ast
import difflib
from dataclasses import dataclass, field

from tpfuse.audit import manifest
from tpfuse.audit.arch import ARCHS, Arch
from tpfuse.audit.driver import audit
from tpfuse.audit.plan import PatchError, Plan, Planner
from tpfuse.audit.target import read_source


class _Text:
    """The source as bytes with line offsets: ast positions -> byte offsets."""

    def __init__(self, source: str):
        self.data = source.encode("utf-8")
        self.eol = "\r\n" if b"\r\n" in self.data else "\n"  # inserted lines end as the file's do
        self.starts = [0]
        for line in self.data.splitlines(keepends=True):
            self.starts.append(self.starts[-1] + len(line))

    def at(self, line: int, col: int) -> int:
        return self.starts[line - 1] + col

    def span(self, node) -> tuple[int, int]:
        return self.at(node.lineno, node.col_offset), self.at(node.end_lineno, node.end_col_offset)

    def code(self, node) -> str:
        a, b = self.span(node)
        return self.data[a:b].decode("utf-8")

    def indent_of(self, line: int) -> str:
        raw = self.data[self.starts[line - 1]: self.starts[line]].decode("utf-8")
        return raw[: len(raw) - len(raw.lstrip())]


def _expr_edit(text: _Text, edit) -> tuple[int, int, str]:
    a, b = text.span(edit.node)
    code = text.code(edit.node)
    if isinstance(edit.new_code, tuple):
        mode, lit = edit.new_code
        if mode == "append":
            body, close = code.rstrip()[:-1].rstrip(), code.rstrip()[-1]
            assert close in ")]}", f"patch: {code!r} is not a bracketed literal"
            sep = "" if body.endswith(",") else ","
            return a, b, f"{body}{sep} {lit}{close}"
        node = edit.node
        return a, b, f"{text.code(node.left)} in ({text.code(node.comparators[0])}, {lit})"
    new = f"{code} or {edit.new_code}"
    return a, b, f"({new})" if edit.wrap else new


def _import_edit(text: _Text, node: ast.ImportFrom, sibling: str, new: str) -> tuple[int, int, str] | None:
    if any((alias.asname or alias.name) == new for alias in node.names):
        return None
    alias = next(a for a in node.names if (a.asname or a.name) == sibling)
    _, end = text.span(alias)
    rest = text.data[end: text.at(node.end_lineno, node.end_col_offset)]
    if rest.startswith(b",") and rest[1:].lstrip(b" \t").startswith((b"\n", b"\r")):
        # one name per line in parentheses: the new one on its own line, indented alike
        eol = end + 1
        return eol, eol, f"{text.eol}{text.indent_of(alias.lineno)}{new},"
    return end, end, f", {new}"


def _statement_edit(text: _Text, stmt: ast.stmt, code: str) -> tuple[int, int, str]:
    end = text.starts[stmt.end_lineno] if stmt.end_lineno < len(text.starts) else len(text.data)
    indent = " " * stmt.col_offset
    body = "".join(f"{indent}{line}{text.eol}" if line else text.eol for line in code.splitlines())
    prefix = "" if text.data[:end].endswith(b"\n") else text.eol
    return end, end, prefix + body


def apply_plans(source: str, plans: list[Plan]) -> str:
    """New text of one file with every plan for it applied."""
    text = _Text(source)
    edits = {}
    for plan in plans:
        for edit in plan.atom_edits:
            a, b, new = _expr_edit(text, edit)
            edits[(a, b)] = new  # two sites of one expression (an assignment and its table) edit it once
        for node, sibling, new in plan.imports:
            found = _import_edit(text, node, sibling, new)
            if found:
                edits[found[:2]] = found[2]
        for stmt, code in dict.fromkeys(plan.statements):
            a, b, new = _statement_edit(text, stmt, code)
            edits[(a, b, code)] = new
    data = text.data
    for key in sorted(edits, key=lambda k: (k[0], k[1]), reverse=True):
        a, b = key[0], key[1]
        data = data[:a] + edits[key].encode("utf-8") + data[b:]
    return data.decode("utf-8")


def unified_diff(path: str, old: str, new: str) -> str:
    return "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a/{path}", f"b/{path}"))


class PatchRefused(RuntimeError):
    """`apply_patch` wrote nothing: an edit failed its re-audit (the message names it)."""


@dataclass
class Proposal:
    """What `propose_patch` found: the new text per file, and the fate of every gate asked for.

    `changes` maps each file to (old text, new text); `plans` the gates whose edits are in it;
    `checks` one re-audit row per planned gate (`harm` None when it opens as on its `--like`);
    `opened` the gates no edit of their own opens that re-audit open through the other edits (a
    helper or flag they read is edited); `errors` (gate id, why) the gates left closed."""

    result: object
    arch: Arch
    like: Arch | None
    changes: dict = field(default_factory=dict)
    plans: dict = field(default_factory=dict)
    checks: list = field(default_factory=list)
    opened: dict = field(default_factory=dict)  # gate id -> the re-audit row that shows it open
    errors: list = field(default_factory=list)

    @property
    def harmful(self) -> list:
        return [row["id"] for row in self.checks if row["harm"]]

    @property
    def complete(self) -> bool:
        """Every gate asked for is opened (by its own edit or by the others) and no edit harms."""
        return not self.errors and not self.harmful


def propose_patch(result, findings: list, arch: Arch, like: Arch | None, *, force_hardware: bool = False) -> Proposal:
    """Plan, apply in memory and re-audit the edits that open `findings` on `arch`; never writes.

    Every proposed edit is re-evaluated in the patched text; a plan whose gate does not come out
    true on `arch` with the value it has on its `--like`, or that changes the gate on another
    architecture (other than `arch`'s own major family, which shares the literal), is dropped with
    an error, and the rest is applied again, so the changes hold only edits that open their gate as
    intended. A gate that could not be planned is re-audited in the patched text too: where the
    other edits open it (it reads a helper or flag that is edited), it is `opened`, not an error."""
    planner = Planner(result, arch, force_hardware=force_hardware)
    proposal = Proposal(result, arch, like)
    unplanned: dict = {}
    for finding in findings:
        try:
            proposal.plans[finding.id] = planner.plan(finding, like)
        except PatchError as exc:
            unplanned[finding.id] = (finding, str(exc), exc.deliberate)
    # The gates without an edit that other edits may open; the loop below only adds deliberate
    # refusals, so this list is final, and one re-audit per round checks the edits and these.
    reopen = [f for f, _, deliberate in unplanned.values() if not deliberate]
    after = None
    while True:
        proposal.changes = _apply(result, proposal.plans)
        if not proposal.changes:
            proposal.checks = []
            break
        after = _audit_patched(result, proposal.changes, {f.path for f in reopen})
        proposal.checks = [_row(f, _match(after, f, proposal.plans), arch, proposal.plans[f.id].like)
                           for f in findings if f.id in proposal.plans]
        bad = [row for row in proposal.checks if row["harm"]]
        if not bad:
            break
        for row in bad:
            finding = next(f for f in findings if f.id == row["id"])
            why = (f"patch: gate {row['id']} ({row['path']}): the edit re-audits as {row['harm']}; refused, "
                   "edit it by hand")
            unplanned[row["id"]] = (finding, why, True)
            del proposal.plans[row["id"]]
    if proposal.changes:
        rows = (_row(f, _match(after, f, {}), arch, None) for f in reopen)
        proposal.opened = {row["id"]: row for row in rows if row["includes_arch"]}
    proposal.errors = [(gid, why) for gid, (_, why, _) in unplanned.items() if gid not in proposal.opened]
    return proposal


def apply_patch(proposal: Proposal, *, state_dir=None, meta: dict | None = None) -> tuple:
    """Write `proposal`'s changes as one journaled transaction (manifest.py); (manifest path, re-audit rows from disk).

    The harm rule lives here, below every caller: the changes are re-audited in memory first, and
    if any edit does not open its gate as on its `--like` (or changes another architecture), nothing
    is written and `PatchRefused` names it."""
    result = proposal.result
    if not proposal.changes:
        raise PatchRefused("patch: nothing to write: no gate asked for has an edit")
    checks = verify(result, proposal.changes, result.findings, proposal.plans, proposal.arch)
    bad = [row for row in checks if row["harm"]]
    if bad:
        raise PatchRefused(
            "patch --apply refused, nothing written: the edit of "
            + ", ".join(f"{row['id']} re-audits as {row['harm']}" for row in bad)
            + (f"; apply the others with --only {' '.join(sorted(set(proposal.plans) - {r['id'] for r in bad}))}"
               if len(bad) < len(proposal.plans) else "")
        )
    meta = {"arch": proposal.arch.name, "like": proposal.like.name if proposal.like else None,
            "gates": sorted(proposal.plans), **(meta or {})}
    written = manifest.apply(result.target.root, {rel: new for rel, (_, new) in proposal.changes.items()},
                             dict(result.file_hashes), meta, state_dir=state_dir)
    return written, verify(result, proposal.changes, result.findings, proposal.plans, proposal.arch, from_disk=True)


def _apply(result, plans: dict) -> dict:
    by_file: dict = {}
    for plan in plans.values():
        by_file.setdefault(plan.path, []).append(plan)
    changes = {}
    for rel, file_plans in by_file.items():
        info = result.resolver.module(result.sites[file_plans[0].gate_id].module)
        # decoded as Python does (coding cookie, BOM); manifest.py re-encodes
        old = read_source(result.target.root / rel)[0]
        assert old == info.source, f"patch: {rel} changed while it was being patched"
        new = apply_plans(old, file_plans)
        try:
            ast.parse(new, filename=rel)
        except SyntaxError as exc:  # an edit must never produce unparsable code
            raise AssertionError(f"patch: the edit of {rel} does not parse ({exc})") from exc
        changes[rel] = (old, new)
    return changes


def harm(before, after, arch, like) -> str | None:
    """Why the patched gate `after` is not `before` opened for `arch` like `like` (None: it is)."""
    if after is None:
        return "no longer an architecture condition"
    want = before.values[like.name]
    if after.values[arch.name] is False:
        return f"still excluding {arch.name}"
    if after.values[arch.name] != want:
        return f"{after.values[arch.name]} on {arch.name} where {like.name} has {want}"
    changed = [a.name for a in ARCHS if a.name != arch.name and after.values[a.name] != before.values[a.name]
               and not (a.major == arch.major and after.values[a.name] == want)]
    if changed:
        return f"changing the gate on {', '.join(changed)} too"
    return None


def _match(after, finding, plans: dict):
    """The condition of the re-audit `after` that is `finding` (its lines shifted by inserted statements)."""
    inserted = {(s.lineno, code) for p in plans.values() if p.path == finding.path for s, code in p.statements}
    shift = sum(code.count("\n") + 1 for lineno, code in inserted if lineno < finding.line)
    cands = [f for f in after.findings if f.path == finding.path and f.scope == finding.scope
             and f.kind == finding.kind]
    return min(cands, key=lambda f: abs(f.line - (finding.line + shift)), default=None)


def _row(finding, best, arch, like) -> dict:
    return {
        "id": finding.id, "path": finding.path, "new_id": best.id if best else None,
        "line": best.line if best else None,
        "condition": best.condition if best else None, "enables": best.enables if best else [],
        "includes_arch": bool(best and best.values[arch.name] is not False), "like": like.name if like else None,
        "harm": harm(finding, best, arch, like) if like else None,
    }


def _audit_patched(result, changes: dict, also: set = frozenset(), *, from_disk: bool = False):
    """The audit of the patched files (in memory, or from disk after writing) and of the files in
    `also`, with the rest of the tree as it is."""
    overlay = {} if from_disk else {result.target.root / rel: new for rel, (_, new) in changes.items()}
    return audit(result.target.spec, native=False, overlay=overlay, only=set(changes) | set(also))


def verify(result, changes: dict, findings: list, plans: dict, arch, *, from_disk: bool = False) -> list:
    """Re-audit the patched files (in memory, or from disk after writing); one row per planned gate."""
    after = _audit_patched(result, changes, from_disk=from_disk)
    return [_row(f, _match(after, f, plans), arch, plans[f.id].like) for f in findings if f.id in plans]
