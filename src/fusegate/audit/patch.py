"""Turn `Plan`s (plan.py) into new file text with libcst, so formatting and comments survive.

Nodes are found by position: `ast` gives (line, UTF-8 byte column) ranges, libcst's
`PositionProvider` gives (line, character column) ranges that, like ast's, exclude parentheses.
Edits: replace an atom with `atom or sibling` (parenthesized unless the atom already sits in an
`or`), append an element to a literal tuple/list/set, rewrite `x == a` as `x in (a, b)`, add a name
to a `from ... import`, insert a statement after its sibling. `patched_sources` returns the new
text per file and never writes; manifest.py writes.
"""

from __future__ import annotations

import ast
import difflib

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

from fusegate.audit.arch import ARCHS
from fusegate.audit.plan import Plan


def _char_col(lines: list, line: int, byte_col: int) -> int:
    return len(lines[line - 1].encode()[:byte_col].decode(errors="replace"))


def _key(lines: list, node: ast.AST) -> tuple:
    key = [node.lineno, _char_col(lines, node.lineno, node.col_offset), node.end_lineno, _char_col(lines, node.end_lineno, node.end_col_offset)]
    # ast counts a tuple's parentheses as part of it; libcst keeps them in lpar/rpar, outside the range.
    if isinstance(node, ast.Tuple) and lines[key[0] - 1][key[1]: key[1] + 1] == "(":
        key[1] += 1
        key[3] -= 1
    return tuple(key)


class _Editor(cst.CSTTransformer):
    METADATA_DEPENDENCIES = (PositionProvider,)

    def __init__(self, source: str, plans: list):
        super().__init__()
        lines = source.splitlines()
        self.expr_edits = {}
        self.import_edits = {}
        self.insert_after = {}
        for plan in plans:
            for edit in plan.atom_edits:
                self.expr_edits[_key(lines, edit.node)] = edit
            for node, sibling, new in plan.imports:
                self.import_edits.setdefault(node.lineno, []).append((sibling, new))
            for stmt, code in plan.statements:
                self.insert_after.setdefault(stmt.lineno, []).append(code)
        self.applied = 0
        self._line_of: dict = {}

    def _pos(self, node) -> tuple:
        r = self.get_metadata(PositionProvider, node)
        return (r.start.line, r.start.column, r.end.line, r.end.column)

    def on_leave(self, original, updated):
        if isinstance(original, cst.BaseExpression) and self.expr_edits:
            try:
                key = self._pos(original)
            except KeyError:
                return super().on_leave(original, updated)
            edit = self.expr_edits.pop(key, None)
            if edit is not None:
                self.applied += 1
                return self._apply(updated, edit)
        return super().on_leave(original, updated)

    def _apply(self, node, edit):
        code = cst.Module([]).code_for_node(node)
        if isinstance(edit.new_code, tuple):
            mode, lit = edit.new_code
            if mode == "append":
                inner = code.rstrip()
                close = inner[-1]
                body = inner[:-1].rstrip()
                sep = "" if body.endswith(",") else ","
                return cst.parse_expression(f"{body}{sep} {lit}{close}")
            left = cst.Module([]).code_for_node(node.left)
            right = cst.Module([]).code_for_node(node.comparisons[0].comparator)
            return cst.parse_expression(f"{left} in ({right}, {lit})").with_changes(lpar=node.lpar, rpar=node.rpar)
        new = cst.parse_expression(edit.new_code)
        op = cst.BooleanOperation(
            left=node, operator=cst.Or(), right=new,
            lpar=[cst.LeftParen()] if edit.wrap else [], rpar=[cst.RightParen()] if edit.wrap else [],
        )
        return op

    def leave_ImportFrom(self, original, updated):
        edits = self.import_edits.get(self._pos(original)[0])
        if not edits or isinstance(updated.names, cst.ImportStar):
            return updated
        names = list(updated.names)
        for sibling, new in edits:
            if any(cst.Module([]).code_for_node(a.name) == new for a in names):
                continue
            i = next(i for i, a in enumerate(names) if (a.evaluated_alias or a.evaluated_name) == sibling)
            comma = names[i].comma
            if i + 1 == len(names):
                # The last alias's comma leads to `)` (or nothing): the sibling takes the separator
                # its predecessor uses (newline + indent in a parenthesized list), the new alias the old one.
                lead = names[i - 1].comma if i > 0 and isinstance(names[i - 1].comma, cst.Comma) else cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
                names[i] = names[i].with_changes(comma=lead)
            names.insert(i + 1, cst.ImportAlias(name=cst.Name(new), comma=comma))
            self.applied += 1
        return updated.with_changes(names=names)

    def leave_SimpleStatementLine(self, original, updated):
        self._line_of[id(updated)] = self._pos(original)[0]
        return updated

    def leave_Module(self, original, updated):
        return updated.with_changes(body=self._insert_all(updated.body))

    def leave_IndentedBlock(self, original, updated):
        return updated.with_changes(body=self._insert_all(updated.body))

    def _insert_all(self, body):
        out = []
        for stmt in body:
            out.append(stmt)
            line = self._line_of.get(id(stmt))
            for code in dict.fromkeys(self.insert_after.get(line, ())):
                out.append(cst.parse_statement(code + "\n"))
                self.applied += 1
        return out


def apply_plans(source: str, plans: list[Plan]) -> str:
    """New text of one file with every plan for it applied; AssertionError if an edit found no node."""
    wrapper = MetadataWrapper(cst.parse_module(source))
    editor = _Editor(source, plans)
    new = wrapper.visit(editor)
    assert not editor.expr_edits, f"patch: edit positions not found: {list(editor.expr_edits)}"
    return new.code


def unified_diff(path: str, old: str, new: str) -> str:
    return "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a/{path}", f"b/{path}"))


HARM_MARK = "re-audits as"  # errors of edits that were proposed and then failed their re-evaluation


def build_changes(result, findings: list, arch, like, *, force_hardware: bool = False) -> tuple[dict, dict, list]:
    """Plan, apply in memory and re-audit: ({rel: (old, new)}, {gate id: Plan}, [(gate id, error)]).

    Every proposed edit is re-evaluated in the patched text; a plan whose gate does not come out
    true on `arch` with the value it has on its `--like`, or that changes the gate on another
    architecture (other than `arch`'s own major family, which shares the literal), is dropped with
    an error, and the rest is applied again, so the returned changes hold only edits that open
    their gate as intended."""
    from fusegate.audit.plan import PatchError, Planner

    planner = Planner(result, arch, force_hardware=force_hardware)
    plans: dict = {}
    errors = []
    for finding in findings:
        try:
            plans[finding.id] = planner.plan(finding, like)
        except PatchError as exc:
            errors.append((finding.id, str(exc)))
    while True:
        changes = _apply(result, plans)
        if not changes:
            return changes, plans, errors
        bad = [row for row in verify(result, changes, findings, plans, arch) if row["harm"]]
        if not bad:
            return changes, plans, errors
        for row in bad:
            errors.append((row["id"], f"patch: gate {row['id']} ({row['path']}): the edit {HARM_MARK} {row['harm']}; refused, edit it by hand"))
            del plans[row["id"]]


def _apply(result, plans: dict) -> dict:
    by_file: dict = {}
    for plan in plans.values():
        by_file.setdefault(plan.path, []).append(plan)
    changes = {}
    for rel, file_plans in by_file.items():
        info = result.resolver.module(result.sites[file_plans[0].gate_id].module)
        old = (result.target.root / rel).read_bytes().decode("utf-8")
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


def verify(result, changes: dict, findings: list, plans: dict, arch, *, from_disk: bool = False) -> list:
    """Re-audit the patched files (in memory, or from disk after writing); one row per patched gate."""
    from fusegate.audit.engine import audit

    overlay = {} if from_disk else {result.target.root / rel: new for rel, (_, new) in changes.items()}
    after = audit(result.target.spec, native=False, overlay=overlay, only=set(changes))
    rows = []
    for finding in findings:
        if finding.id not in plans:
            continue
        plan = plans[finding.id]
        inserted = {(s.lineno, code) for p in plans.values() if p.path == finding.path for s, code in p.statements}
        shift = sum(code.count("\n") + 1 for lineno, code in inserted if lineno < finding.line)
        cands = [f for f in after.findings if f.path == finding.path and f.scope == finding.scope and f.kind == finding.kind]
        best = min(cands, key=lambda f: abs(f.line - (finding.line + shift)), default=None)
        rows.append({
            "id": finding.id, "path": finding.path, "new_id": best.id if best else None, "line": best.line if best else None,
            "condition": best.condition if best else None, "enables": best.enables if best else [],
            "includes_arch": bool(best and best.values[arch.name] is not False), "like": plan.like.name,
            "harm": harm(finding, best, arch, plan.like),
        })
    return rows
