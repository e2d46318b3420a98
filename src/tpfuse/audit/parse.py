"""Parse only the parts of a module an audit can need: top-level statements and arch-related defs.

`ast.parse` of every module a whole-engine audit touches was most of its run time and memory
(sglang 0.5.23: 840 modules, 9 s of `compile`, 0.8 GB of trees). A module is cut at its top-level
`def` / `class` / decorator lines (column 0, outside brackets and strings as far as the text
shows). Every chunk of ordinary top-level statements is parsed (imports, flags, tables); a
`def` or `class` chunk only when its text can hold an architecture condition: it mentions an
architecture token (`arch_text`), is named like an arch helper (`name_re`: `get_platform`,
`is_cuda`), mentions a name the module binds at top level to such an
expression, or a parameter named as a capability. Each skipped `def`/`class` is still bound, to
an opaque value (`Skipped`), so name resolution does not fall back to a seed for it. Inside a
kept class, methods are chosen the same way (`_trim_class`; `self.` attributes tie them). A chunk
that is left out becomes blank lines (positions stay the real ones); if the text then does not parse (a
cut fell inside a string or brackets), the module is parsed whole, so errors are reported as before.
"""

from __future__ import annotations

import ast
import bisect
import itertools
import re

# A top-level def/class/decorator line starts a chunk; other column-0 code lines start one too.
_DEF_RE = re.compile(r"(?:async\s+def|def|class)\b")
_ASSIGN_RE = re.compile(r"^([A-Za-z_]\w*(?:[ \t]*,[ \t]*[A-Za-z_]\w*)*)[ \t]*(?::[^=\n]*)?=(?!=)", re.MULTILINE)
# Capability parameter names (scan.py's _capability_params), without a leading \b so that sre's
# literal scan applies; `major`/`minor` pairs are found with substring tests.
_PARAM_RE = re.compile(r"capability|sm_version|device_sm|sm_arch|arch_major")
_TOKEN_WORDS: dict = {}


def _token_words(name_re: re.Pattern) -> re.Pattern:
    """Whole identifiers that contain a `name_re` token (`is_cuda_sm_at_least`), found in one pass."""
    if name_re.pattern not in _TOKEN_WORDS:
        tokens = name_re.pattern.replace("^_?", "")
        _TOKEN_WORDS[name_re.pattern] = re.compile(rf"\b\w*?(?:{tokens})\w*", name_re.flags)
    return _TOKEN_WORDS[name_re.pattern]
_WORD_RE = re.compile(r"[A-Za-z_]\w*")
_CONSTANT_NAMES = frozenset({"get_platform", "current_platform", "is_cuda", "_is_cuda", "is_cuda_alike"})


class Skipped:
    """A top-level def/class the audit did not parse: its text holds no architecture condition."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name


def _chunks(lines: list) -> list:
    """[(first line index, last line index + 1, is_def)] of the module's top-level pieces."""
    starts, kinds = [], []
    prev_deco = False
    for i, line in enumerate(lines):
        c = line[:1]
        if not c or c in " \t\r\n#)]}'\"" or not line.strip():
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
    ends = starts[1:] + [len(lines)]
    return list(zip(starts, ends, kinds))


def parse_selected(source: str, filename: str, arch_text: re.Pattern | list, name_re: re.Pattern) -> tuple[ast.Module, dict, set]:
    """(module tree of the parsed chunks, {name: Skipped} of the defs/classes left out, the hot
    names: top-level names bound to, defining or importing something architecture-related).

    `arch_text` is the pattern of architecture tokens, or the character offsets where the
    caller already found them in `source` (one pass shared with the scanner)."""
    lines = source.splitlines(keepends=True)
    chunks = _chunks(lines)
    texts = ["".join(lines[a:b]) for a, b, _ in chunks]
    # Whole-text searches mapped to chunks (one regex pass instead of one per chunk).
    offsets = list(itertools.accumulate((len(t) for t in texts), initial=0))
    if isinstance(arch_text, list):
        arch_chunks = {bisect.bisect_right(offsets, pos) - 1 for pos in arch_text}
    else:
        arch_chunks = _chunks_matching(arch_text, source.lower(), offsets)
    param_chunks = _chunks_matching(_PARAM_RE, source, offsets)
    if "minor" in source:
        param_chunks |= {k for k, t in enumerate(texts) if "minor" in t and "major" in t}
    words: dict = {}

    def words_of(k: int) -> set:
        if k not in words:
            words[k] = set(_WORD_RE.findall(texts[k]))
        return words[k]

    # Names the top-level statements bind to architecture expressions, transitively
    # (`_GPU_MAJOR = get_device_capability()[0]` then `_USE_FMA = _GPU_MAJOR >= 10`).
    hot: set = set()
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
    # Imported helpers named like arch predicates (`is_cuda_sm_at_least`); not the platform
    # objects and `is_cuda`, constant on every audited arch unless an arch token follows them.
    for k, (_, _, is_def) in enumerate(chunks):
        if not is_def and "import" in texts[k]:
            hot.update(w for w in _token_words(name_re).findall(texts[k]) if w not in _CONSTANT_NAMES)
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
    kept, skipped = [], {}
    low = source.lower() if not isinstance(arch_text, list) else None
    for k, ((a, b, is_def), text, need, name) in enumerate(zip(chunks, texts, wanted, names)):
        if need and is_def and _CLASS_RE.search(text):
            arch_lines = _arch_lines_in(arch_text, low, source, offsets[k], offsets[k + 1], text)
            kept.append(_trim_class(text, arch_lines, hot))
            continue
        if need:
            kept.append(text)
            continue
        if name:
            skipped.setdefault(name, Skipped(name))
        kept.append("\n" * (b - a))
    try:
        return ast.parse("".join(kept), filename=filename), skipped, hot
    except SyntaxError:
        return ast.parse(source, filename=filename), {}, hot  # raises the real error, or parses whole


_CLASS_RE = re.compile(r"^class\s", re.MULTILINE)
_SELF_ATTR_RE = re.compile(r"\b(?:self|cls)\.([A-Za-z_]\w*)\s*(?::[^=\n]*)?=(?!=)")


def _arch_lines_in(arch_text, low, source: str, start: int, end: int, text: str) -> set:
    """0-based line numbers, within one chunk, that hold an architecture token."""
    if isinstance(arch_text, list):
        positions = [p - start for p in arch_text[bisect.bisect_left(arch_text, start): bisect.bisect_left(arch_text, end)]]
    else:
        positions = [m.start() for m in arch_text.finditer(low, start, end)]
        positions = [p - start for p in positions]
    line_starts = list(itertools.accumulate((len(x) for x in text.splitlines(keepends=True)), initial=0))
    return {bisect.bisect_right(line_starts, p) - 1 for p in positions}


def _trim_class(text: str, arch_lines: set, hot: set) -> str:
    """A class chunk with the methods that cannot hold an architecture condition replaced by
    `pass` and blank lines (same line count): a method is kept when it holds an architecture
    token, a capability parameter, or a name or `self.` attribute tied to one (transitively)."""
    lines = text.splitlines(keepends=True)
    header = next((i for i, line in enumerate(lines) if line.startswith("class")), None)
    body = [i for i in range(header + 1, len(lines)) if lines[i].strip() and not lines[i].lstrip().startswith("#")] if header is not None else []
    if not body:
        return text
    indent = lines[body[0]][: len(lines[body[0]]) - len(lines[body[0]].lstrip())]
    if not indent:
        return text
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
    return "".join(out)


def _chunks_matching(pattern: re.Pattern, text: str, offsets: list) -> set:
    """Indices of the chunks where `pattern` matches: one search per matching chunk (after a hit
    the search resumes at the next chunk)."""
    found, pos = set(), 0
    while True:
        m = pattern.search(text, pos)
        if m is None:
            return found
        k = bisect.bisect_right(offsets, m.start()) - 1
        found.add(k)
        pos = offsets[k + 1]


_NAME_RE = re.compile(r"^(?:async\s+def|def|class)\s+(\w+)", re.MULTILINE)


def _name_of(text: str) -> str | None:
    m = _NAME_RE.search(text)
    return m.group(1) if m else None
