"""Parse only the parts of a module an audit can need: top-level statements and arch-related defs.

Parsing every module a whole-engine audit touches was most of its run time and memory, so a
module is cut at its top-level `def` / `class` / decorator lines (column 0, outside brackets and
triple-quoted strings as far as the text shows). Every chunk of ordinary top-level statements is
parsed (imports, flags, tables); a `def` or `class` chunk only when its text can hold an
architecture condition: an architecture token in code (`code_tokens`: not in a comment or a
docstring, nor in a string literal unless the line compares something), a name like an arch
helper (`name_re`: `get_platform`, `is_cuda`), a name the module binds at top level to such an
expression (transitively), a name the caller says is architecture-valued (`extra_hot`: names
imported from modules where they hold an architecture value), or a parameter named as a
capability. Each skipped `def`/`class` is still bound, to an opaque value (`Skipped`), so name
resolution does not fall back to a seed for it. Inside a kept class, methods are chosen the same
way (`_trim_class`; `self.` attributes tie them). A chunk that is left out becomes blank lines
(positions stay the real ones); if the text then does not parse (a cut fell inside a string or
brackets), the module is parsed whole, so errors are reported as before.
"""

from __future__ import annotations

import ast
import bisect
import itertools
import re

# A top-level def/class/decorator line starts a chunk; other column-0 code lines start one too.
_DEF_RE = re.compile(r"(?:async\s+def|def|class)\b")
_ASSIGN_RE = re.compile(r"^([A-Za-z_]\w*(?:[ \t]*,[ \t]*[A-Za-z_]\w*)*)[ \t]*(?::[^=\n]*)?=(?!=)", re.MULTILINE)
# Capability parameter names (predicates.capability_params), without a leading \b so that sre's
# literal scan applies; `major`/`minor` pairs are found with substring tests.
_PARAM_RE = re.compile(r"capability|sm_version|device_sm|sm_arch|_major\b|device_arch")
_WORD_RE = re.compile(r"[A-Za-z_]\w*")
_CONSTANT_NAMES = frozenset({"get_platform", "current_platform", "is_cuda", "_is_cuda", "is_cuda_alike"})
_TRIPLE_RE = re.compile(r'"""|\'\'\'')
# A line that compares (`arch == "sm_90a"`, `"sm100" in name`): a token in its string literal counts.
_COMPARES_RE = re.compile(r"==|!=|<=|>=| in | not in |[<>]")


class Skipped:
    """A top-level def/class the audit did not parse: its text holds no architecture condition."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name


def split_lines(source: str, *, keepends: bool = True) -> list:
    """The lines of `source` as `ast` counts them (at "\n"; `str.splitlines` also cuts at form feeds
    and other separators, which would shift every later line)."""
    parts = source.split("\n")
    if not keepends:
        return parts[:-1] if parts and parts[-1] == "" else parts
    lines = [part + "\n" for part in parts[:-1]]
    if parts[-1]:
        lines.append(parts[-1])
    return lines


class TextMap:
    """Line offsets and triple-quoted string regions of a module's text (as far as the text shows).

    `regions` is None when the triple quotes do not pair up (a `'''` inside a string, say): then
    nothing is taken for a docstring and every token counts as code."""

    def __init__(self, source: str):
        self.source = source
        self.lines = split_lines(source)
        self.starts = list(itertools.accumulate(map(len, self.lines), initial=0))
        marks, open_quote, regions = [m for m in _TRIPLE_RE.finditer(source)], None, []
        for m in marks:
            if open_quote is None:
                open_quote = m
            elif m.group() == open_quote.group():
                regions.append((open_quote.start(), m.end()))
                open_quote = None
        self.regions = regions if open_quote is None else None
        self._region_starts = [a for a, _ in regions] if self.regions else []

    def line_of(self, pos: int) -> int:
        """0-based line index of character offset `pos`."""
        return bisect.bisect_right(self.starts, pos) - 1

    def in_triple_string(self, pos: int) -> bool:
        if not self.regions:
            return False
        i = bisect.bisect_right(self._region_starts, pos) - 1
        return i >= 0 and pos < self.regions[i][1]

    def is_code(self, pos: int) -> bool:
        """Is the token at `pos` code: not in a docstring or comment, nor in a string literal of a
        line that compares nothing?"""
        if self.in_triple_string(pos):
            return False
        i = self.line_of(pos)
        before = self.source[self.starts[i]:pos]
        if "#" in before or '"' in before or "'" in before:
            quote, escaped = None, False
            for ch in before:
                if escaped:
                    escaped = False
                elif quote is None:
                    if ch in "\"'":
                        quote = ch
                    elif ch == "#":
                        return False  # a comment
                elif ch == "\\":
                    escaped = True
                elif ch == quote:
                    quote = None
            if quote is not None:  # inside a one-line string literal
                return bool(_COMPARES_RE.search(self.lines[i]))
        return True


def code_tokens(textmap: TextMap, offsets: list) -> list:
    """The token offsets that are code (`TextMap.is_code`)."""
    return [pos for pos in offsets if textmap.is_code(pos)]


def _chunks(textmap: TextMap) -> list:
    """[(first line index, last line index + 1, is_def)] of the module's top-level pieces."""
    starts, kinds = [], []
    prev_deco = False
    for i, line in enumerate(textmap.lines):
        c = line[:1]
        if not c or c in " \t\r\n#)]}'\"" or not line.strip() or textmap.in_triple_string(textmap.starts[i]):
            continue
        is_deco = c == "@"
        is_def = is_deco or bool(_DEF_RE.match(line))
        if not prev_deco:
            starts.append(i)
            kinds.append(is_def)
        prev_deco = is_deco
    if not starts or starts[0] != 0:
        starts.insert(0, 0)
        kinds.insert(0, False)
    ends = starts[1:] + [len(textmap.lines)]
    return list(zip(starts, ends, kinds))


def _identifier_at(source: str, pos: int) -> str:
    a = b = pos
    while a > 0 and (source[a - 1].isalnum() or source[a - 1] == "_"):
        a -= 1
    while b < len(source) and (source[b].isalnum() or source[b] == "_"):
        b += 1
    return source[a:b]


def parse_selected(source: str, filename: str, tokens: list, name_re: re.Pattern, *, textmap: TextMap | None = None,
                   extra_hot: frozenset = frozenset()) -> tuple[ast.Module, dict, set, list]:
    """(module tree of the parsed chunks, {name: Skipped} of the defs/classes left out, the hot
    names: top-level names bound to, defining or importing something architecture-related, and the
    [first, last) 0-based line ranges that were left out, defs and methods).

    `tokens` are the sorted character offsets of the architecture tokens in code (`code_tokens`)."""
    textmap = textmap or TextMap(source)
    lines = textmap.lines
    chunks = _chunks(textmap)
    texts = ["".join(lines[a:b]) for a, b, _ in chunks]
    offsets = [textmap.starts[a] for a, _, _ in chunks] + [len(source)]
    arch_chunks = {bisect.bisect_right(offsets, pos) - 1 for pos in tokens}
    param_chunks = {bisect.bisect_right(offsets, m.start()) - 1 for m in _PARAM_RE.finditer(source) if textmap.is_code(m.start())}
    if "minor" in source:
        param_chunks |= {k for k, t in enumerate(texts) if "minor" in t and "major" in t}
    words: dict = {}

    def words_of(k: int) -> set:
        if k not in words:
            words[k] = set(_WORD_RE.findall(texts[k]))
        return words[k]

    # Names the top-level statements bind to architecture expressions, transitively
    # (`_GPU_MAJOR = get_device_capability()[0]` then `_USE_FMA = _GPU_MAJOR >= 10`).
    hot: set = set(extra_hot)
    pending = [(k, {n.strip() for targets in _ASSIGN_RE.findall(texts[k]) for n in targets.split(",")})
               for k, (_, _, is_def) in enumerate(chunks) if not is_def]
    pending = [(k, bound) for k, bound in pending if bound]
    grew = True
    while grew:
        grew = False
        for k, bound in pending:
            if not bound <= hot and (k in arch_chunks or hot and not hot.isdisjoint(words_of(k))):
                hot |= bound
                grew = True
    # Imported helpers named like arch predicates (`is_cuda_sm_at_least`), found at the tokens; not the
    # platform objects and `is_cuda`, constant on every audited arch unless an arch token follows them.
    for pos in tokens:
        k = bisect.bisect_right(offsets, pos) - 1
        if not chunks[k][2] and "import" in texts[k]:
            word = _identifier_at(source, pos)
            if word and word not in _CONSTANT_NAMES:
                hot.add(word)
    names = [_name_of(t) if is_def else None for t, (_, _, is_def) in zip(texts, chunks)]
    wanted = [not is_def or k in arch_chunks or k in param_chunks or bool(names[k] and name_re.search(names[k]))
              for k, (_, _, is_def) in enumerate(chunks)]
    # Defs of this module that hold an architecture condition are hot too: a def calling one is kept.
    hot.update(n for n, w, (_, _, is_def) in zip(names, wanted, chunks) if w and is_def and n)
    grew = True
    while grew and hot:
        grew = False
        for k in range(len(chunks)):
            if not wanted[k] and not hot.isdisjoint(words_of(k)):
                wanted[k] = grew = True
                if names[k]:
                    hot.add(names[k])
    # One parse of the text with the skipped chunks blanked (their lines kept as empty lines, so
    # every position is the real one): a cut inside a string or brackets shows as a SyntaxError.
    kept, skipped, hidden = [], {}, []
    for k, ((a, b, is_def), text, need, name) in enumerate(zip(chunks, texts, wanted, names)):
        if need and is_def and _CLASS_RE.search(text):
            arch_lines = {textmap.line_of(pos) - a for pos in tokens[bisect.bisect_left(tokens, offsets[k]):
                                                                     bisect.bisect_left(tokens, offsets[k + 1])]}
            trimmed, ranges = _trim_class(text, arch_lines, hot)
            kept.append(trimmed)
            hidden += [(a + i, a + j) for i, j in ranges]
            continue
        if need:
            kept.append(text)
            continue
        if name:
            skipped.setdefault(name, Skipped(name))
        kept.append("\n" * (b - a))
        hidden.append((a, b))
    if not hidden:
        return ast.parse(source, filename=filename), {}, hot, []
    try:
        return ast.parse("".join(kept), filename=filename), skipped, hot, hidden
    except SyntaxError:
        return ast.parse(source, filename=filename), {}, hot, []  # raises the real error, or parses whole


_CLASS_RE = re.compile(r"^class\s", re.MULTILINE)
# `self.x = ...` / `cls.x: T = ...`; `(?:self|cls)` would cost sre its literal prefix: `elf.` and `ls.` find both.
_SELF_ATTR_RE = re.compile(r"(?:s|c)(?:elf|ls)\.([A-Za-z_]\w*)\s*(?::[^=\n]*)?=(?!=)")


def _trim_class(text: str, arch_lines: set, hot: set) -> tuple[str, list]:
    """A class chunk with the methods that cannot hold an architecture condition replaced by
    `pass` and blank lines (same line count), and the [first, last) line ranges replaced: a method
    is kept when it holds an architecture token, a capability parameter, or a name or `self.`
    attribute tied to one (transitively)."""
    lines = split_lines(text)
    header = next((i for i, line in enumerate(lines) if line.startswith("class")), None)
    body = [i for i in range(header + 1, len(lines)) if lines[i].strip() and not lines[i].lstrip().startswith("#")] if header is not None else []
    if not body:
        return text, []
    indent = lines[body[0]][: len(lines[body[0]]) - len(lines[body[0]].lstrip())]
    if not indent:
        return text, []
    # Methods start at the body's indentation with def/async def/@ (decorators join their def).
    starts, prev_deco = [], False
    for i in body:
        line = lines[i]
        if not line.startswith(indent) or line[len(indent)] in " \t)]}'\"":
            continue
        rest = line[len(indent):]
        is_deco = rest.startswith("@")
        if not prev_deco:
            starts.append((i, is_deco or bool(_DEF_RE.match(rest))))
        prev_deco = is_deco
    parts = [(a, b, is_method) for (a, is_method), (b, _) in zip(starts, starts[1:] + [(len(lines), False)])]
    hot_words = set(hot)
    keep, texts = [], ["".join(lines[a:b]) for a, b, _ in parts]
    for (a, b, is_method), chunk in zip(parts, texts):
        keep.append(not is_method or any(i in arch_lines for i in range(a, b)) or bool(_PARAM_RE.search(chunk))
                    or ("major" in chunk and "minor" in chunk))
    words: dict = {}
    bound: dict = {}
    grew = True
    while grew:
        grew = False
        for j, chunk in enumerate(texts):
            if keep[j]:
                if j not in bound:
                    bound[j] = set(_SELF_ATTR_RE.findall(chunk)) | {n.strip() for t in _ASSIGN_RE.findall(chunk.replace(indent, "", 1)) for n in t.split(",")}
                if not bound[j] <= hot_words:
                    hot_words |= bound[j]
                    grew = True
            elif hot_words:
                if j not in words:
                    words[j] = set(_WORD_RE.findall(chunk))
                if not hot_words.isdisjoint(words[j]):
                    keep[j] = grew = True
    out = lines[: parts[0][0]] if parts else lines
    for (a, b, _), k in zip(parts, keep):
        out += lines[a:b] if k else [f"{indent}pass\n"] + ["\n"] * (b - a - 1)
    return "".join(out), [(a, b) for (a, b, _), k in zip(parts, keep) if not k]


_NAME_RE = re.compile(r"^(?:async\s+def|def|class)\s+(\w+)", re.MULTILINE)


def _name_of(text: str) -> str | None:
    m = _NAME_RE.search(text)
    return m.group(1) if m else None
