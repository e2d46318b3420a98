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
_PARAM_RE = re.compile(r"capability|sm_version|device_sm|sm_arch|_major\b|device_arch|arch\b")
_WORD_RE = re.compile(r"[A-Za-z_]\w*")
_CONSTANT_NAMES = frozenset({"get_platform", "current_platform", "is_cuda", "_is_cuda", "is_cuda_alike"})
# A line that compares (`arch == "sm_90a"`, `"sm100" in name`): a token in its string literal counts.
_COMPARES_RE = re.compile(r"==|!=|<=|>=| in | not in |[<>]")


def _may_name_param(text: str) -> bool:
    """Can `_PARAM_RE` match in `text`? Each of its words holds one of these (substring tests are
    several times faster than the regex on a text that holds none)."""
    return "arch" in text or "capability" in text or "sm_version" in text or "device_sm" in text or "_major" in text


# Where a match of _PARAM_RE can start: each of its words begins with one of these.
_PARAM_PREFIXES = ("capability", "sm_", "device_", "_major", "arch")


def prefixed_matches(pattern: re.Pattern, prefixes: tuple[str, ...], text: str) -> list:
    """`list(pattern.finditer(text))` for a pattern whose every match starts with one of
    `prefixes`, found from the prefixes' substring searches instead of trying the pattern (an
    alternation) at every position of the text."""
    starts = []
    for prefix in prefixes:
        i = text.find(prefix)
        while i >= 0:
            starts.append(i)
            i = text.find(prefix, i + 1)
    out, end = [], -1
    for i in sorted(starts):
        if i < end:
            continue
        m = pattern.match(text, i)
        if m:
            out.append(m)
            end = m.end()
    return out


def _param_matches(text: str) -> list:
    return prefixed_matches(_PARAM_RE, _PARAM_PREFIXES, text)


def _param_word(text: str, m: re.Match) -> bool:
    """A `_PARAM_RE` match that can name a capability: `arch` only as a whole word (a parameter
    `arch` that a caller passes the device's `major * 10 + minor` to), not `model_arch`."""
    return m.group() != "arch" or m.start() == 0 or not (text[m.start() - 1].isalnum() or text[m.start() - 1] == "_")


class Skipped:
    """A top-level def/class the audit did not parse: its text holds no architecture condition."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name


def split_lines(source: str, *, keepends: bool = True) -> list:
    """The lines of `source` as `ast` counts them (at "\n"; `str.splitlines` also cuts at form feeds
    and other separators, which would shift every later line)."""
    if keepends:
        # `str.splitlines` in one pass, where it cut at "\n" only: each "\n" ends a line for it too, so
        # as many lines as "\n" cuts means no other separator cut one ("\r\n" ends one line at its "\n").
        lines = source.splitlines(True)
        if len(lines) == source.count("\n") + (not source.endswith("\n") and bool(source)):
            return lines
    parts = source.split("\n")
    if not keepends:
        return parts[:-1] if parts and parts[-1] == "" else parts
    lines = [part + "\n" for part in parts[:-1]]
    if parts[-1]:
        lines.append(parts[-1])
    return lines


def _triple_quotes(source: str) -> list:
    """[(offset, quote)] of every triple quote (double or single) in `source` in order, as
    `re.finditer` finds them (str.find scans for one literal far faster than a regex alternation
    tried at every position; the two quotes share no character, so their matches never overlap)."""
    found = []
    for quote in ('"""', "'''"):
        i = source.find(quote)
        while i >= 0:
            found.append((i, quote))
            i = source.find(quote, i + 3)
    found.sort()
    return found


class TextMap:
    """Line offsets and triple-quoted string regions of a module's text (as far as the text shows).

    `regions` is None when the triple quotes do not pair up (a `'''` inside a string, say): then
    nothing is taken for a docstring and every token counts as code."""

    def __init__(self, source: str):
        self.source = source
        self.lines = split_lines(source)
        self.starts = list(itertools.accumulate(map(len, self.lines), initial=0))
        open_quote, regions = None, []
        for pos, quote in _triple_quotes(source):
            if open_quote is None:
                open_quote = (pos, quote)
            elif quote == open_quote[1]:
                regions.append((open_quote[0], pos + 3))
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


# A line that begins with code at column 0: the character after a "\n" (the first line is tested
# apart). A pattern that begins with a literal is searched for that literal by sre's fast scan; a
# MULTILINE `^` is tried at every position, several times slower on an engine's modules.
_COLUMN0_CHARS = " \t\r\n#)]}'\""
_COLUMN0_RE = re.compile(r"\n[^ \t\r\n#)\]}'\"]")


def _column0_lines(source: str) -> list:
    """The offsets of the lines that begin with code at column 0: not with a blank, a comment, a
    closing bracket or a quote (`_COLUMN0_CHARS`)."""
    found = [0] if source and source[0] not in _COLUMN0_CHARS else []
    found += [m.start() + 1 for m in _COLUMN0_RE.finditer(source)]
    return found


def _chunks(textmap: TextMap) -> list:
    """[(first line index, last line index + 1, is_def)] of the module's top-level pieces."""
    starts, kinds = [], []
    prev_deco = False
    lines, line_starts = textmap.lines, textmap.starts
    # Only the lines that begin with code at column 0 can start a chunk: one regex pass finds them
    # (a test per line was a tenth of the parse).
    for pos in _column0_lines(textmap.source):
        i = bisect.bisect_right(line_starts, pos) - 1
        line = lines[i]
        if not line.strip() or textmap.in_triple_string(line_starts[i]):
            continue
        is_deco = line[0] == "@"
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


def _read_chunks(source: str, textmap: TextMap, tokens: list, name_re: re.Pattern) -> tuple:
    """(chunks, texts, offsets, arch chunks, their `_Words`, the hot names found at the tokens, def names,
    wanted (not to be changed), classes, pending assignments, {def chunk: its `_statements`}): what
    `parse_selected` reads from the text and tokens alone, before any hot name of the caller."""
    lines = textmap.lines
    chunks = _chunks(textmap)
    texts = ["".join(lines[a:b]) for a, b, _ in chunks]
    offsets = [textmap.starts[a] for a, _, _ in chunks] + [len(source)]
    arch_chunks = {bisect.bisect_right(offsets, pos) - 1 for pos in tokens}
    param_chunks: set = set()
    # Only a def chunk not already kept needs the (slower) code test.
    for m in _param_matches(source):
        k = bisect.bisect_right(offsets, m.start()) - 1
        if k in param_chunks or k in arch_chunks or not chunks[k][2]:
            continue
        if _param_word(source, m) and textmap.is_code(m.start()):
            param_chunks.add(k)
    if "minor" in source:
        param_chunks |= {k for k, t in enumerate(texts) if "minor" in t and "major" in t}
    words = _Words(texts)
    hot: set = set()
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
    # ("class" at a line start first, as substrings: the regex's `^` is tried at every line of a long def)
    classes = {k for k, (_, _, is_def) in enumerate(chunks) if is_def and (texts[k].startswith("class") or
                                                                         "\nclass" in texts[k])
               and _CLASS_RE.search(texts[k])}
    # What makes a name hot, to a fixpoint: a top-level assignment from architecture text or a hot name
    # (`_GPU_MAJOR = get_device_capability()[0]`, `_USE_FMA = _GPU_MAJOR >= 10`, `_FLAG = _helper()`);
    # a function that holds architecture text and returns a value (its callers read the architecture);
    # what a kept class exports (its methods returning architecture values, attributes set from it).
    pending = [(k, {n.strip() for targets in _ASSIGN_RE.findall(texts[k]) for n in targets.split(",")})
               for k, (_, _, is_def) in enumerate(chunks) if not is_def]
    pending = [(k, bound) for k, bound in pending if bound]
    statements: dict = {}  # def chunk -> its `_statements` (filled as they are needed)
    return chunks, texts, offsets, arch_chunks, words, hot, names, wanted, classes, pending, statements


def parse_selected(source: str, filename: str, tokens: list, name_re: re.Pattern, *, textmap: TextMap | None = None,
                   extra_hot: frozenset = frozenset()) -> tuple[ast.Module, dict, set, list]:
    """(module tree of the parsed chunks, {name: Skipped} of the defs/classes left out, the hot
    names: top-level names bound to, defining or importing something architecture-related, and the
    [first, last) 0-based line ranges that were left out, defs and methods).

    `tokens` are the sorted character offsets of the architecture tokens in code (`code_tokens`)."""
    textmap = textmap or TextMap(source)
    lines = textmap.lines
    # What the module's text and tokens alone decide is kept on its line map: a module parsed again
    # (more hot names from its imports) reads its chunks, their words and statements once.
    cached = getattr(textmap, "selection", None)
    if cached is None or cached[0] is not source or cached[1] is not tokens or cached[2] is not name_re:
        cached = textmap.selection = (source, tokens, name_re, _read_chunks(source, textmap, tokens, name_re))
    chunks, texts, offsets, arch_chunks, words, base_hot, names, wanted, classes, pending, read = cached[3]
    wanted = list(wanted)
    hot: set = set(extra_hot) | base_hot
    trims: dict = {}  # class chunk -> [len(hot) it was last grown with, its _ClassTrim]
    flows: dict = {}  # def chunk -> its `_statements`, as this parse reads them (from `read`, kept for the run)
    grew = True
    while grew:
        grew = False
        for k, bound in pending:
            if not bound <= hot and (k in arch_chunks or words.touches(k, hot)):
                hot |= bound
                grew = True
        for k, (_, _, is_def) in enumerate(chunks):
            if not is_def:
                continue
            if not wanted[k] and words.touches(k, hot):
                wanted[k] = grew = True
            if not wanted[k]:
                continue
            if k in classes:
                if k not in trims:
                    arch_lines = {textmap.line_of(pos) - chunks[k][0] for pos in
                                  tokens[bisect.bisect_left(tokens, offsets[k]):
                                         bisect.bisect_left(tokens, offsets[k + 1])]}
                    trims[k] = [None, _ClassTrim(texts[k], arch_lines, lines[chunks[k][0]:chunks[k][1]])]
                if trims[k][0] != len(hot):
                    exports = trims[k][1].grow(hot)
                    if not exports <= hot:
                        hot |= exports
                        grew = True
                    trims[k][0] = len(hot)
            elif names[k] and names[k] not in hot:
                if k not in flows and k not in arch_chunks and not words.touches(k, hot):
                    continue  # no architecture token and no hot word in its text: no return can depend on them
                if k not in flows:
                    arch_lines = {textmap.line_of(pos) for pos in
                                  tokens[bisect.bisect_left(tokens, offsets[k]):
                                         bisect.bisect_left(tokens, offsets[k + 1])]}
                    if k not in read:
                        read[k] = _statements(lines, chunks[k][0], chunks[k][1], arch_lines)
                    flows[k] = read[k]
                if _flow(flows[k], hot)[0]:
                    hot.add(names[k])
                    grew = True
    # A class that exports something is hot itself: other modules read it (`Cls.supported(arch)`), and
    # its tree is kept for them after the module is scanned (resolve.Resolver.release).
    hot.update(names[k] for k in trims if trims[k][1].exports and names[k])
    # One parse of the text with the skipped chunks blanked (their lines kept as empty lines, so
    # every position is the real one): a cut inside a string or brackets shows as a SyntaxError.
    kept, skipped, hidden = [], {}, []
    for k, ((a, b, is_def), text, need, name) in enumerate(zip(chunks, texts, wanted, names)):
        if need and k in classes:
            trimmed, ranges = trims[k][1].render()
            kept.append(trimmed)
            hidden += [(a + i, a + j) for i, j in ranges]
            continue
        if need and is_def and b - a >= _THIN_MIN_LINES and name not in hot:  # a hot def is inlined whole
            arch_lines = {textmap.line_of(pos) for pos in
                          tokens[bisect.bisect_left(tokens, offsets[k]):bisect.bisect_left(tokens, offsets[k + 1])]}
            statements = flows.get(k) or read.get(k) or _statements(lines, a, b, arch_lines)
            drops = _thin(statements, _relevant(statements, hot))
            part = lines[a:b]
            _apply_drops(part, drops, a)
            kept.append("".join(part))
            hidden += [r for r, _ in drops]
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


class _Words:
    """Do texts hold one of a growing set of names as a word (`_WORD_RE`)? A substring test first;
    a text's word set only once a name is in it (most texts hold none of the few hot names, and
    splitting every def into words was a tenth of the parse)."""

    def __init__(self, texts: list):
        self.texts = texts
        self.sets: dict = {}  # text index -> its words
        self.absent: dict = {}  # text index -> names found in it as no substring at all

    def touches(self, k: int, names: set) -> bool:
        """`not names.isdisjoint(set(_WORD_RE.findall(texts[k])))`."""
        if not names:
            return False
        found = self.sets.get(k)
        if found is None:
            absent, text = self.absent.get(k), self.texts[k]
            for w in names - absent if absent else names:  # (a loop: `any` of a generator was slower here)
                if w in text:
                    break
            else:
                self.absent[k] = absent | names if absent else set(names)
                return False
            found = self.sets[k] = set(_WORD_RE.findall(text))
        return not names.isdisjoint(found)


def _trim_class(text: str, arch_lines: set, hot: set) -> tuple[str, list, set]:
    """`_ClassTrim(text, arch_lines).trim(hot)`."""
    return _ClassTrim(text, arch_lines).trim(hot)


class _ClassTrim:
    """A class chunk with the methods that cannot hold an architecture condition replaced by `pass`
    and blank lines (same line count).

    A method is kept when it holds an architecture token, a capability parameter, or reads a name
    tied to one: a hot name, a kept method's name that returns a value (`self._use_fp8()`), or an
    attribute or class attribute assigned from architecture text (`self.sm = get_device_sm()`, also
    through a local name of the same method: `major = ...; self.fast = major >= 10`), transitively.
    `trim` may be called again with more hot names (the module's grow as classes export theirs): it
    goes on from where it stopped."""

    def __init__(self, text: str, arch_lines: set, lines: list | None = None):
        """`lines`: `split_lines(text)` where the caller has them (a module's lines of the chunk)."""
        self.text, self.arch_lines = text, arch_lines
        self.lines = lines = split_lines(text) if lines is None else lines
        header = next((i for i, line in enumerate(lines) if line.startswith("class")), None)
        body = lines[header + 1:] if header is not None else []
        first = next((line for line in body if line.strip() and not line.lstrip().startswith("#")), "")
        self.indent = indent = first[: len(first) - len(first.lstrip())]
        self.parts: list = []
        if not indent:
            return
        # Methods start at the body's indentation with def/async def/@ (decorators join their def); other
        # code there (not a closing bracket, a quote or a comment) starts a part of class-level statements.
        # One regex pass over the text finds those lines (a test per line was a tenth of the parse).
        line_starts = list(itertools.accumulate(map(len, lines), initial=0))
        # (After the "\n" that ends a line: a literal-first pattern, searched by sre's fast scan; the
        # header's own "\n" is where the search starts.)
        at_indent = re.compile(rf"\n{re.escape(indent)}(?=[^ \t\r\n\f\v)\]}}'\"#])")
        starts, prev_deco = [], False
        for m in at_indent.finditer(text, line_starts[header + 1] - 1):
            i = bisect.bisect_right(line_starts, m.start() + 1) - 1
            rest = lines[i][len(indent):]
            is_deco = rest.startswith("@")
            if not prev_deco:
                starts.append((i, is_deco or bool(_DEF_RE.match(rest))))
            prev_deco = is_deco
        self.parts = [(a, b, is_method) for (a, is_method), (b, _) in zip(starts, starts[1:] + [(len(lines), False)])]
        self.texts = ["".join(lines[a:b]) for a, b, _ in self.parts]
        self.arch_sorted = arch = sorted(arch_lines)
        self.keep = [not is_method or bisect.bisect_left(arch, a) < bisect.bisect_left(arch, b)
                     or _may_name_param(chunk) and any(_param_word(chunk, m) for m in _PARAM_RE.finditer(chunk))
                     or ("major" in chunk and "minor" in chunk)
                     for (a, b, is_method), chunk in zip(self.parts, self.texts)]
        self.hot_words: set = set()
        self.exports: set = set()
        self.words = _Words(self.texts)
        self.flows: dict = {}
        self.done: dict = {}

    def _may_flow(self, j: int, hot_words: set) -> bool:
        """Can `_flow` of part `j` find anything: an architecture token in it, or a hot word in its text
        (strings and comments included: more words than its code has)?"""
        a, b, _ = self.parts[j]
        if bisect.bisect_left(self.arch_sorted, a) < bisect.bisect_left(self.arch_sorted, b):
            return True
        return self.words.touches(j, hot_words)

    def _returns_arch(self, j: int) -> bool:
        """Does method `j` return an architecture value (its name is exported): others inline it whole."""
        name = _METHOD_NAME_RE.match(self.texts[j])
        return bool(name) and name.group(1) in self.exports

    def trim(self, hot: set) -> tuple[str, list, set]:
        """(the trimmed text, the [first, last) line ranges replaced, the names the class adds to `hot`:
        what other code reads the architecture through)."""
        exports = self.grow(hot)
        return (*self.render(), exports)

    def grow(self, hot: set) -> set:
        """What `trim(hot)` returns last (the names the class adds to `hot`), without the text: a
        module's classes are grown each time its hot names grow, and rendered once at the end."""
        if not self.parts:
            return set()
        hot_words, parts, lines = self.hot_words, self.parts, self.lines
        hot_words |= hot
        grew = True
        while grew:
            grew = False
            for j, chunk in enumerate(self.texts):
                if self.keep[j]:
                    if self.done.get(j) == len(hot_words):
                        continue
                    if j not in self.flows and not self._may_flow(j, hot_words):
                        self.done[j] = len(hot_words)  # what `_flow` gives it: nothing (read again if hot grows)
                        continue
                    if j not in self.flows:
                        self.flows[j] = _statements(lines, parts[j][0], parts[j][1], self.arch_lines)
                    returns, names, attrs = _flow(self.flows[j], hot_words)
                    attrs = attrs if parts[j][2] else names  # a class-level name is a class attribute
                    name = _METHOD_NAME_RE.match(chunk) if parts[j][2] and returns else None
                    if name:  # it returns a value that depends on the architecture: its callers read it
                        attrs = attrs | {name.group(1)}
                    if not attrs <= hot_words:
                        hot_words |= attrs
                        self.exports |= attrs
                        grew = True
                    self.done[j] = len(hot_words)
                elif self.words.touches(j, hot_words):
                    self.keep[j] = grew = True
        return self.exports - hot

    def render(self) -> tuple[str, list]:
        """(the trimmed text, the [first, last) line ranges replaced) for the names grown so far."""
        if not self.parts:
            return self.text, []
        hot_words, parts, lines = self.hot_words, self.parts, self.lines
        out, ranges = lines[: parts[0][0]], [(a, b) for (a, b, _), k in zip(parts, self.keep) if not k]
        for j, ((a, b, is_method), k) in enumerate(zip(parts, self.keep)):
            if not k:
                out += [f"{self.indent}pass\n"] + ["\n"] * (b - a - 1)
            elif is_method and b - a >= _THIN_MIN_LINES and not self._returns_arch(j):
                statements = self.flows.get(j) or _statements(lines, a, b, self.arch_lines)
                drops = _thin(statements, _relevant(statements, hot_words))
                part = lines[a:b]
                _apply_drops(part, drops, a)
                out += part
                ranges += [r for r, _ in drops]
            else:
                out += lines[a:b]
        return "".join(out), ranges


_METHOD_NAME_RE = re.compile(r"(?:[ \t]*@[^\n]*\n)*[ \t]*(?:async[ \t]+)?def[ \t]+(\w+)")
# An assignment statement's targets, names or `self.`/`cls.` attributes.
_TARGETS_RE = re.compile(r"[ \t]*((?:(?:self|cls)\.)?[A-Za-z_]\w*(?:[ \t]*,[ \t]*(?:(?:self|cls)\.)?[A-Za-z_]\w*)*)"
                         r"[ \t]*(?::[^=\n]*)?=(?!=)")
_FIRST_WORD_RE = re.compile(r"[ \t]*(@|[A-Za-z_]\w*)")
_HEADERS = frozenset({"if", "while", "for", "with", "try", "match", "case", "async"})
_CHAINED = frozenset({"elif", "else", "except", "finally"})  # continue the header above them at their indentation


def _statements(lines: list, first: int, last: int, arch_lines: set) -> list:
    """The statements of lines[first:last] (a def, a class part): [(indentation, kind, words, holds an
    architecture token, attributes assigned, names assigned, first line, end line)], kind one of
    "def", "header", "match", "chained", "return", "exit", "assign", "import", "decorator", "other".

    Read from the text with strings and comments blanked (one regex pass): a statement ends where
    its brackets close and no backslash or multi-line string goes on, and runs over the lines after
    it that hold no code (comments). Its words are its code's identifiers, never a string's or a
    comment's."""
    code_lines = _CODE_RE.sub(_newlines_only, "".join(lines[first:last])).split("\n")
    n = last - first
    arch = sorted(arch_lines)
    starts, depth, continued = [], 0, False
    for i, c in enumerate(code_lines[:n]):
        # (`c and not c.isspace()` is `c.strip()` without a copy of every line)
        if depth <= 0 and not continued and c and not c.isspace():
            starts.append(i)
            depth = 0
        if "(" in c or ")" in c or "[" in c or "]" in c or "{" in c or "}" in c:
            depth += _depth(c)
        continued = "\\" in c and c.rstrip().endswith("\\")
    out = []
    ends = starts[1:] + [n]
    for start, end in zip(starts, ends):
        line = code_lines[start]
        stripped = line.lstrip()
        span = line if end - start == 1 else "\n".join(code_lines[start:end])
        word = _FIRST_WORD_RE.match(line)
        head = word.group(1) if word else ""
        attrs = names = _NO_NAMES  # most statements bind nothing: one shared empty set, never mutated
        if head in ("def", "class") or head == "async" and stripped.startswith("async def"):
            kind = "def"
            bound = _DEF_NAME_RE.match(stripped)
            names = {bound.group(1)} if bound else names
        elif head in _HEADERS:
            kind = "match" if head == "match" else "header"
            bound = (_FOR_RE.match(stripped) if head in ("for", "async")
                     else _WITH_AS_RE.search(span) if head == "with" else None)
            names = set(_WORD_RE.findall(bound.group(1))) if bound else names
        elif head in ("from", "import"):
            kind = "import"
            imported = span.split(" import ", 1)[-1] if head == "from" else span[6:]
            names = {m.group(2) or m.group(1).split(".")[0] for m in _IMPORTED_RE.finditer(imported)}
        else:
            kind = _PLAIN_KINDS.get(head, "other")
            target = _TARGETS_RE.match(line) if kind == "other" else None
            if target:
                kind = "assign"
                attrs, names = set(), set()
                for name in target.group(1).split(","):
                    name = name.strip()
                    if name.startswith(("self.", "cls.")):
                        attrs.add(name.split(".", 1)[1])
                    else:
                        names.add(name)
        if arch:
            j = bisect.bisect_left(arch, first + start)
            has_arch = j < len(arch) and arch[j] < first + end
        else:
            has_arch = False
        out.append((len(line) - len(stripped), kind, set(_WORD_RE.findall(span)), has_arch,
                    attrs, names, first + start, first + end))
    return out


# `_statements`' kinds that the first word alone decides (binding nothing).
_PLAIN_KINDS = {**dict.fromkeys(_CHAINED, "chained"), "return": "return", "yield": "return", "raise": "exit",
                "continue": "exit", "break": "exit", "@": "decorator"}
_NO_NAMES = frozenset()


# Strings (triple-quoted first) and comments, which `_statements` blanks (`_newlines_only`).
_CODE_RE = re.compile(r'"""[\s\S]*?"""|\'\'\'[\s\S]*?\'\'\'|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|#[^\n]*')


def _newlines_only(m: re.Match) -> str:
    """A string becomes `""` (a multi-line one with its newlines, each after a backslash: the
    statement goes on to where the string ends); a comment, nothing."""
    text = m.group()
    if text[0] == "#":
        return ""
    return '""' + "\\\n" * text.count("\n")


def _depth(code: str) -> int:
    """How many brackets `code` opens, less those it closes."""
    return code.count("(") + code.count("[") + code.count("{") - code.count(")") - code.count("]") - code.count("}")


_DEF_NAME_RE = re.compile(r"(?:async\s+)?(?:def|class)\s+(\w+)")
_FOR_RE = re.compile(r"(?:async\s+)?for\s+(.+?)\s+in\b")
_WITH_AS_RE = re.compile(r"\bas\s+\(?([\w, ]+)")
_IMPORTED_RE = re.compile(r"([\w.]+)(?:\s+as\s+(\w+))?")


def _flow(statements: list, hot: set) -> tuple[bool, set, set]:
    """(does a return of the def depend on the architecture, the local names and the attributes that
    may hold an architecture value) over `_statements` of one def or class part, for the `hot` names.

    A statement depends on the architecture when its text does (a token, a hot name, a local name
    that does) or a header around it does (`if is_sm100(): return "trtllm"`, then `return "fa3"`
    makes the def's result depend on it); `elif`/`else` continue their `if`. Nested defs' returns
    are their own."""
    # (indentation, depends, is a def, a header around or at it depends, a def around or at it)
    stack: list = []
    local: set = set()
    attrs: set = set()
    returns = False
    top = None
    for indent, kind, words, has_arch, assigned_attrs, assigned_names, _, _ in statements:
        if top is None and kind == "decorator":
            continue
        if top is None:  # the part's own def line (or its first statement)
            top = indent
            if kind == "def":
                continue
        chained = False
        while stack and stack[-1][0] >= indent:
            popped = stack.pop()
            chained = kind == "chained" and popped[0] == indent and popped[1]
        depends = has_arch or not words.isdisjoint(hot) or bool(local) and not words.isdisjoint(local)
        under, in_def = (stack[-1][3], stack[-1][4]) if stack else (False, False)
        if kind in ("def", "header", "chained", "match"):
            own = kind != "def" and (depends or chained)
            stack.append((indent, own, kind == "def", under or own, in_def or kind == "def"))
            if kind != "def" and (depends or under) and not in_def and "return" in words:
                returns = True  # `if is_sm100(): return 1` on one line
        elif kind == "return":
            returns = returns or (depends or under) and not in_def
        elif kind in ("assign", "import") and (depends or under):
            local |= assigned_names
            attrs |= assigned_attrs
    return returns, local, attrs


# A def shorter than this is parsed whole: helpers are what other code inlines (their every return
# counts), and the parse and scan time is in the long defs (engine forward and init methods).
_THIN_MIN_LINES = 40
# Parameter names a condition may read the capability from (scan.py seeds them, classify.capability_params).
_CAP_PARAM_RE = re.compile(r"\w*capabilit\w*|\w*sm_version|device_sm|sm_arch|\w*_major|major|minor|cap|cc"
                           r"|\w*_arch|arch")


def _thin(statements: list, relevant: set) -> list:
    """[(first, last) line ranges, indentation] of a long def's statements that cannot matter to
    an architecture condition: replaced by `pass` (on their last line, so the def ends where it did).

    Kept whole: a statement whose text holds an architecture token or a `relevant` name (with its
    block, so a guard's body and what it raises stay as written, and with the rest of its `if` /
    `elif` / `else` chain: a branch dropped would change what the names are after it). Kept as a
    header only: the statements around a kept one (with their chain), and a loop or def that binds
    a name a kept statement reads; an assignment or import binding such a name is kept whole.
    `statements` start with the def itself (after its decorators)."""
    n = len(statements)
    parent, stack = [-1] * n, []
    for i, (indent, kind, *_rest) in enumerate(statements):
        while stack and statements[stack[-1]][0] >= indent:
            stack.pop()
        parent[i] = stack[-1] if stack else -1
        if kind in ("def", "header", "chained", "match"):
            stack.append(i)
    block_end = [st[7] for st in statements]
    for i in range(n - 1, 0, -1):
        if parent[i] >= 0 and block_end[i] > block_end[parent[i]]:
            block_end[parent[i]] = block_end[i]
    top = next((i for i, st in enumerate(statements) if st[1] == "def"), 0)
    whole, header, read = set(), set(range(top + 1)), set()

    def keep_whole(i: int) -> bool:
        if i in whole:
            return False
        k = i
        while k < n and (k == i or statements[k][6] < block_end[i]):  # the statement and its block
            whole.add(k)
            read.update(statements[k][2])
            k += 1
        return True

    def chain(i: int) -> list:
        members, j = [i], i
        while j > top and statements[j][1] == "chained":  # back to the chain's head
            j = _previous_sibling(parent, j)
            members.append(j)
        k = _next_sibling(statements, parent, i)
        while k is not None and statements[k][1] == "chained":
            members.append(k)
            k = _next_sibling(statements, parent, k)
        return members

    for i in range(top + 1, n):
        indent, kind, words, has_arch = statements[i][:4]
        if (has_arch or not words.isdisjoint(relevant)) and kind not in ("def", "decorator"):
            keep_whole(i)
    grew = True
    while grew:
        grew = False
        for i in range(top + 1, n):
            kind = statements[i][1]
            if i in whole and parent[i] not in whole and kind in ("header", "chained"):
                for j in chain(i):
                    grew = keep_whole(j) or grew
            elif i not in whole and i not in header and (statements[i][4] or statements[i][5]) and not (
                    read.isdisjoint(statements[i][5]) and read.isdisjoint(statements[i][4])):
                if kind in ("def", "header", "match"):
                    header.add(i)
                    read.update(statements[i][2])
                else:
                    keep_whole(i)
                grew = True
    # The headers around what is kept, with their chains; decorators with their def.
    for i in sorted(whole | header):
        p = parent[i]
        while p > top and p not in header:
            header.add(p)
            p = parent[p]
    for i in sorted(header):
        if i <= top:
            continue
        if statements[i][1] in ("header", "chained"):
            header.update(chain(i))
        elif statements[i][1] == "match":  # a match block holds case blocks only
            header.update(k for k in range(i + 1, n) if parent[k] == i)
        d = i - 1
        while statements[i][1] == "def" and d > top and statements[d][1] == "decorator" and parent[d] == parent[i]:
            header.add(d)
            d -= 1
    drops, covered = [], -1
    for i in range(top + 1, n):
        start = statements[i][6]
        if start < covered:
            continue
        if i in whole:
            covered = block_end[i]
        elif i not in header:
            drops.append(((start, block_end[i]), statements[i][0]))
            covered = block_end[i]
    return drops


def _previous_sibling(parent: list, i: int) -> int:
    j = i - 1
    while j > 0 and parent[j] != parent[i]:
        j -= 1
    return j


def _next_sibling(statements: list, parent: list, i: int) -> int | None:
    for k in range(i + 1, len(statements)):
        if parent[k] == parent[i]:
            return k
        if statements[k][0] < statements[i][0]:
            return None
    return None


def _apply_drops(lines: list, drops: list, offset: int = 0) -> None:
    """Replace each dropped range of `lines` (indices minus `offset`) by blank lines ending in `pass`."""
    for (a, b), indent in drops:
        for i in range(a - offset, b - offset - 1):
            lines[i] = "\n"
        lines[b - offset - 1] = " " * indent + "pass\n"


def _relevant(statements: list, hot: set) -> set:
    """`hot` and the def's capability-like parameters and the names it binds from the architecture."""
    top = next((i for i, st in enumerate(statements) if st[1] == "def"), 0)
    params = {w for w in statements[top][2] if _CAP_PARAM_RE.fullmatch(w)} if statements else set()
    return hot | params | _flow(statements, hot | params)[1]


_NAME_RE = re.compile(r"^(?:async\s+def|def|class)\s+(\w+)", re.MULTILINE)


def _name_of(text: str) -> str | None:
    m = _NAME_RE.search(text)
    return m.group(1) if m else None
