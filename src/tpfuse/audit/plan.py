"""Plan the minimal edit that makes a gate true for `--arch`, in the codebase's own idiom.

For a gate, the condition's atoms (comparisons, calls, names, attributes under and/or/not) are
evaluated; an atom that is true for `--like` and false for `--arch`, in a position where making it
true opens the gate, is extended, atom by atom until the gate is open for `--arch`:

- a membership test in a literal (`sm in (100, 103)`) gets the new element; `major == 10` becomes
  `major in (10, 12)`; ranges and other comparisons get `or <subject> == <value>`;
- any other atom gets a sibling in the same idiom, spelled by substituting the architecture in its
  text (`_is_sm100_supported` -> `_is_sm120_supported`, `get_platform().is_sm100` -> `.is_sm120`,
  `family(100)` -> `family(120)`), joined with `or`.

A sibling name the module lacks is added next to the original: a cached flag is defined after its
sibling's definition (spelled the same way), a helper is added to the `from ... import` that brings
in its sibling, but only when the target defines it. A sibling whose meaning cannot be confirmed in
the target is refused with a `PatchError` that names what is missing and what to add.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field

from tpfuse.audit.arch import ARCHS, Arch, ArchBool, ArchNum
from tpfuse.audit.evaluate import Evaluator, atoms, to_bool
from tpfuse.audit.hardware import hardware_needs
from tpfuse.audit.values import Const, ModuleRef, UserFunc


class PatchError(ValueError):
    """A gate cannot be patched safely; the message says what is missing and how to proceed.

    `deliberate`: the gate is refused on purpose (report-only, inverse, not a gate, a hardware
    exclusion, excluded explicitly), as opposed to an edit that cannot be spelled here, which the
    other edits of the same patch may still make unnecessary (patch.py re-audits it)."""

    def __init__(self, message: str, *, deliberate: bool = False):
        super().__init__(message)
        self.deliberate = deliberate


@dataclass
class AtomEdit:
    """Replace the source range of `node` (an ast node of the gate's module) with `new_code`."""

    node: ast.AST
    new_code: str
    wrap: bool  # parenthesize (the atom's parent is not an `or`)


@dataclass
class Plan:
    path: str
    gate_id: str
    like: Arch
    atom_edits: list = field(default_factory=list)
    imports: list = field(default_factory=list)  # (ImportFrom ast node, existing name, new name)
    statements: list = field(default_factory=list)  # (ast stmt to insert after, new statement code)


def substitute(text: str, like: Arch, arch: Arch) -> str:
    """Respell `text` for `arch` where it names `like` (sm100 -> sm120, (10, 0) -> (12, 0), 100 -> 120)."""
    out = re.sub(rf"(?i)(sm_?){like.cc_int}(?!\d)", lambda m: f"{m.group(1)}{arch.cc_int}", text)
    out = re.sub(rf"\(\s*{like.major}\s*,\s*{like.minor}\s*\)", f"({arch.major}, {arch.minor})", out)
    out = re.sub(rf"(?<![\w.]){like.cuda_arch}(?![\w.])", str(arch.cuda_arch), out)
    out = re.sub(rf"(?<![\w.]){like.cc_int}(?![\w.])", str(arch.cc_int), out)
    return out


def literal_for(example, arch: Arch):
    """The value naming `arch` in the same form as `example` (a tuple, an SM int, a major, a string)."""
    if isinstance(example, tuple) and len(example) == 2:
        return (arch.major, arch.minor)
    if isinstance(example, str) and example.isdigit():
        return str(arch.cc_int)
    if isinstance(example, int) and not isinstance(example, bool):
        if example >= 300:
            return arch.cuda_arch
        return arch.cc_int if example >= 20 else arch.major
    return None


class Planner:
    """Plans edits for sites of one `AuditResult` (driver.py)."""

    def __init__(self, result, arch: Arch, *, force_hardware: bool = False):
        self.result = result
        self.resolver = result.resolver
        self.arch = arch
        self.force_hardware = force_hardware

    def _eval(self, site, node, overrides=None):
        ev = Evaluator(self.resolver, site.module, site.local, site.attrs, overrides=overrides)
        return to_bool(ev.eval(node))

    def like_candidates(self, finding) -> list:
        """Architectures the gate enables, nearest below `arch` first, x.0 before x.y (code names families by x.0)."""
        enabled = [a for a in ARCHS if finding.values[a.name] is not False]
        return sorted(enabled, key=lambda a: (a.cc_int > self.arch.cc_int, a.minor != 0, -a.cc_int))

    def plan(self, finding, like: Arch | None) -> Plan:
        if like is not None:
            return self._plan(finding, like)
        first = None
        for cand in self.like_candidates(finding):
            try:
                return self._plan(finding, cand)
            except PatchError as exc:
                first = first or exc
        raise first or PatchError(f"patch: gate {finding.id} enables no architecture; nothing to copy")

    def _plan(self, finding, like: Arch) -> Plan:
        site = self.result.sites.get(finding.id)
        if site is None or finding.report_only:
            raise PatchError(f"patch: gate {finding.id} ({finding.path}:{finding.line}) is report-only; "
                             f"edit the build configuration by hand", deliberate=True)
        if finding.category == "inverse":
            raise PatchError(
                f"patch: gate {finding.id} ({finding.path}:{finding.line}) is an inverse gate: it turns a feature off "
                f"where it names an architecture (on elsewhere: {', '.join(finding.enables)}); it is never opened, "
                "edit it by hand if you must",
                deliberate=True,
            )
        if finding.category != "gate":
            raise PatchError(f"patch: {finding.id} ({finding.path}:{finding.line}) is a {finding.category}, not a "
                             "gate; nothing to patch", deliberate=True)
        needs = hardware_needs(finding, self.arch)
        if needs and not self.force_hardware:
            raise PatchError(
                f"patch: gate {finding.id} ({finding.path}:{finding.line}) is a hardware exclusion: its guarded code "
                f"needs {needs}, which {self.arch.name} lacks; pass --force-hardware to patch it anyway",
                deliberate=True,
            )
        if finding.values[like.name] is False:
            raise PatchError(f"patch: gate {finding.id} is false on --like {like.name} too; "
                             f"pick --like from {', '.join(finding.enables)}", deliberate=True)
        plan = Plan(finding.path, finding.id, like)
        if finding.kind == "decorator" and isinstance(site.node, ast.Call) and site.node.args:
            # FlashInfer's @supported_compute_capability([100, 103]): the list is the gate.
            listed = site.node.args[0]
            if isinstance(listed, (ast.List, ast.Tuple)) and listed.elts and isinstance(listed.elts[0], ast.Constant):
                lit = literal_for(listed.elts[0].value, self.arch)
                if lit is not None:
                    plan.atom_edits.append(AtomEdit(listed, ("append", repr(lit)), wrap=False))
                    return plan
        overrides: dict = {}
        arch_only = ArchBool.where(lambda a: a == self.arch)
        blocked = []
        for atom, polarity, parent_or in atoms(site.node, site.polarity):
            value = self._eval(site, atom)
            gate_now = self._gate_value(site, overrides)
            if gate_now.at(self.arch) is not False:
                break
            if polarity < 0:
                if value.at(self.arch) is True and value.at(like) is not True:
                    blocked.append(ast.unparse(atom))
                continue
            if value.at(self.arch) is not False or value.at(like) is False:
                continue
            if isinstance(atom, ast.Compare) and len(atom.ops) == 1 and isinstance(atom.ops[0], (ast.NotEq, ast.NotIn)):
                # `major != 12`: written to exclude it; `or major == 12` would undo that
                blocked.append(ast.unparse(atom))
                continue
            # An atom that is the whole condition needs no parentheses around `atom or sibling`.
            plan.atom_edits.append(self._extend(site, atom, like, parent_or or atom is site.node, plan))
            overrides[id(atom)] = value.or_(arch_only)
        if self._gate_value(site, overrides).at(self.arch) is False:
            why = (f"it excludes {self.arch.name} explicitly ({'; '.join(blocked)})" if blocked
                   else "no atom of it can be extended")
            raise PatchError(f"patch: gate {finding.id} ({finding.path}:{finding.line}) cannot be opened for "
                             f"{self.arch.name}: {why}; edit it by hand", deliberate=bool(blocked))
        return plan

    def _gate_value(self, site, overrides) -> ArchBool:
        value = self._eval(site, site.node, overrides)
        return value if site.polarity > 0 else value.not_()

    # -- one atom -----------------------------------------------------------------------
    def _extend(self, site, atom, like: Arch, parent_or: bool, plan: Plan) -> AtomEdit:
        if isinstance(atom, ast.Compare) and len(atom.ops) == 1:
            edit = self._extend_compare(site, atom)
            if edit is not None:
                return edit
        if isinstance(atom, ast.Compare):
            edit = self._extend_range(site, atom, parent_or)
            if edit is not None:
                return edit
        listed = self._listed_argument(site, atom, like)
        if listed is not None:
            return listed
        old = ast.unparse(atom)
        new = substitute(old, like, self.arch)
        if new == old:
            raise PatchError(
                f"patch: gate {plan.gate_id}: `{old}` names {like.name} in no way that can be respelled for "
                f"{self.arch.name}; add the {self.arch.name} condition by hand"
            )
        self._support(site, atom, new, like, plan)
        return AtomEdit(atom, new, wrap=not parent_or)

    def _listed_argument(self, site, atom, like: Arch) -> AtomEdit | None:
        """`_match_sm_version(dev, ["100", "103"])`: the list argument naming `like` gets `arch`, spelled alike."""
        if not isinstance(atom, ast.Call):
            return None
        for arg in [*atom.args, *(k.value for k in atom.keywords)]:
            if not isinstance(arg, (ast.List, ast.Tuple, ast.Set)) or not arg.elts:
                continue
            values = [e.value for e in arg.elts if isinstance(e, ast.Constant)]
            for old, new in ((like.cc_int, self.arch.cc_int), (str(like.cc_int), str(self.arch.cc_int)),
                             (like.major, self.arch.major)):
                if old in values and type(old) is type(values[0]) and new not in values:
                    lit = repr(new)
                    if isinstance(new, str):  # in the list's own quotes
                        first = ast.get_source_segment(self.resolver.module(site.module).source, arg.elts[0]) or "'"
                        lit = first[0] + lit[1:-1] + first[0]
                    return AtomEdit(arg, ("append", lit), wrap=False)
        return None

    def _subject_literal(self, site, subject: ast.expr):
        """The value `subject` (an SM int, a major, a capability tuple, an SM string) has on `--arch`:
        the literal of the edit, so that an int is compared with an int and a tuple with a tuple."""
        value = Evaluator(self.resolver, site.module, site.local, site.attrs).eval(subject)
        if not isinstance(value, ArchNum):
            return None
        lit = value.at(self.arch)
        return tuple(lit) if isinstance(lit, list) else lit

    def _extend_compare(self, site, atom: ast.Compare) -> AtomEdit | None:
        op, right = atom.ops[0], atom.comparators[0]
        lit = self._subject_literal(site, atom.left)
        if lit is None:
            return None
        if isinstance(op, ast.In) and isinstance(right, (ast.Tuple, ast.List, ast.Set)) and right.elts:
            first = Evaluator(self.resolver, site.module).eval(right.elts[0])
            if isinstance(first, Const) and type(first.value) is type(lit):
                return AtomEdit(right, ("append", repr(lit)), wrap=False)
        if isinstance(op, ast.Eq):
            value = Evaluator(self.resolver, site.module).eval(right)
            if isinstance(value, Const) and type(value.value) is type(lit):
                return AtomEdit(atom, ("in", repr(lit)), wrap=False)
        return None

    def _extend_range(self, site, atom: ast.Compare, parent_or: bool) -> AtomEdit | None:
        operands = [atom.left, *atom.comparators]
        consts = [Evaluator(self.resolver, site.module).eval(o) for o in operands]
        subjects = [o for o, c in zip(operands, consts) if not isinstance(c, Const)]
        examples = [c.value for c in consts if isinstance(c, Const)]
        if len(subjects) != 1 or not examples:
            return None
        lit = self._subject_literal(site, subjects[0])
        if lit is None:
            return None
        if any(isinstance(o, (ast.In, ast.NotIn)) for o in atom.ops):
            if not all(isinstance(e, (tuple, list, frozenset, set, dict)) and all(type(x) is type(lit) for x in e)
                       for e in examples):
                return None
        elif not all(type(e) is type(lit) for e in examples):
            return None
        return AtomEdit(atom, f"{ast.unparse(subjects[0])} == {lit!r}", wrap=not parent_or)

    # -- names the sibling needs -------------------------------------------------------------
    def _support(self, site, atom, new_code: str, like: Arch, plan: Plan) -> None:
        old_names = {n.id for n in ast.walk(atom) if isinstance(n, ast.Name)}
        new_tree = ast.parse(new_code, mode="eval")
        info = self.resolver.module(site.module)
        old_attrs = {n.attr for n in ast.walk(atom) if isinstance(n, ast.Attribute)}
        for node in ast.walk(new_tree):
            if isinstance(node, ast.Attribute) and node.attr not in old_attrs:
                base = Evaluator(self.resolver, site.module, site.local, site.attrs).eval(node.value)
                if isinstance(base, ModuleRef) and not self.resolver.defines(base.name, node.attr):
                    raise PatchError(
                        f"patch: gate {plan.gate_id}: helper `{node.attr}` does not exist in {base.name} within the "
                        f"target; add `{node.attr}` to {base.name} first"
                    )
            if not isinstance(node, ast.Name) or node.id in old_names:
                continue
            self._ensure_name(info, site, node.id, like, plan)
        self.resolver.missing.clear()
        value = self._eval_new(site, new_tree, plan)
        if self.resolver.missing:
            raise PatchError(f"patch: gate {plan.gate_id}: {self.resolver.missing[0]}; add it to the target first")
        if value is not None and value.at(self.arch) is False:
            raise PatchError(f"patch: gate {plan.gate_id}: `{new_code}` is false on {self.arch.name} in the target; "
                             f"add an {self.arch.name} predicate first")

    def _eval_new(self, site, tree, plan):
        if plan.statements or plan.imports:
            return None  # names added by this plan are checked by the re-audit of the patched text
        return self._eval(site, tree.body)

    def _ensure_name(self, info, site, name: str, like: Arch, plan: Plan) -> None:
        if site.local and name in site.local or name in info.bindings:
            return
        sibling = substitute_back(name, like, self.arch)
        binding = info.bindings.get(sibling)
        if binding is None:
            raise PatchError(f"patch: gate {plan.gate_id}: `{name}` is not defined in {info.path.name} and has no "
                             "sibling to copy; define it first")
        if binding[0] == "assign":
            stmt = _statement_of(info.tree, binding[1])
            new_stmt = substitute(ast.get_source_segment(info.source, stmt), like, self.arch)
            plan.statements.append((stmt, new_stmt))
            sub = ast.parse(new_stmt).body[0]
            old = {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name)}
            for node in ast.walk(sub.value):
                if isinstance(node, ast.Name) and node.id not in old:
                    self._ensure_name(info, site, node.id, like, plan)
            return
        if binding[0] == "from":
            _, module, level, _orig = binding
            absolute = self.resolver.absolute(site.module, module, level)
            if not self.resolver.defines(absolute, name):
                where = ("." * level) + (module or "")
                raise PatchError(
                    f"patch: gate {plan.gate_id}: helper `{name}` does not exist in {where} within the target "
                    f"(its sibling `{sibling}` does); add `{name}` to {where} first"
                )
            node = _import_of(info.tree, sibling)
            plan.imports.append((node, sibling, name))
            return
        if isinstance(self.resolver.global_value(site.module, sibling), UserFunc):
            raise PatchError(f"patch: gate {plan.gate_id}: `{name}` is not defined next to `{sibling}` in "
                             f"{info.path.name}; define it first")
        raise PatchError(f"patch: gate {plan.gate_id}: cannot add `{name}` (sibling `{sibling}` is bound by "
                         f"{binding[0]}); add it by hand")


def substitute_back(name: str, like: Arch, arch: Arch) -> str:
    return re.sub(rf"(?i)(sm_?){arch.cc_int}(?!\d)", lambda m: f"{m.group(1)}{like.cc_int}", name)


def _statement_of(tree: ast.Module, value: ast.AST) -> ast.stmt:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is value:
            return node
    raise AssertionError("binding without statement")


def _import_of(tree: ast.Module, name: str) -> ast.ImportFrom:
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
            return node
    raise AssertionError("import binding without statement")
