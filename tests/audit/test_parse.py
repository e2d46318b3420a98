"""parse.py: which parts of a module the selective parse keeps, and the names it calls hot."""

from __future__ import annotations

import textwrap

from tpfuse.audit.driver import audit
from tpfuse.audit.parse import TextMap, _ClassTrim, _flow, _statements, _trim_class, parse_selected, split_lines
from tpfuse.audit.resolve import ARCH_RE, arch_tokens

from .conftest import names


def select(source: str):
    source = textwrap.dedent(source)
    textmap = TextMap(source)
    return parse_selected(source, "m.py", arch_tokens(textmap)[1], ARCH_RE, textmap=textmap)


def found(tmp_path, source: str) -> dict:
    (tmp_path / "m.py").write_text(textwrap.dedent(source))
    return {f.condition: (f.scope, [a for a, v in f.values.items() if v])
            for f in audit(str(tmp_path / "m.py")).findings}


def test_a_flag_built_from_a_helper_keeps_the_defs_that_read_it(tmp_path):
    source = """
        import torch


        def _helper():
            return torch.cuda.get_device_capability()[0] >= 10


        _FLAG = _helper()


        def use():
            if _FLAG:
                return 1
            return 0
    """
    _, skipped, hot, _ = select(source)
    assert {"_helper", "_FLAG"} <= hot and "use" not in skipped
    assert found(tmp_path, source)["_FLAG"] == ("use", names(lambda a: a.major >= 10))


def test_a_method_returning_an_architecture_value_keeps_its_callers(tmp_path):
    source = """
        import torch


        class Backend:
            def _use_trtllm(self):
                if torch.cuda.get_device_capability()[0] == 10:
                    return True
                return False

            def forward(self, x):
                if self._use_trtllm():
                    return x * 2
                return x
    """
    assert "_use_trtllm" in select(source)[2]
    assert found(tmp_path, source)["self._use_trtllm()"] == ("Backend.forward", names(lambda a: a.major == 10))


def test_a_method_that_returns_nothing_exports_nothing():
    # Its callers cannot read the architecture through it: they stay out of the parse.
    source = textwrap.dedent("""
        class Runner:
            def setup(self):
                log_capability()
                self.n = 4

            def step(self):
                self.setup()
                return self.n
    """)
    trimmed, ranges, exports = _ClassTrim(source, {3}).trim(set())
    assert exports == set() and [source.split("\n")[a] for a, _ in ranges] == ["    def step(self):"]


def test_a_class_is_hot_only_when_it_exports_something():
    _, _, hot, _ = select("""
        import torch


        class Quiet:
            def run(self):
                torch.cuda.get_device_capability()


        class Config:
            @classmethod
            def supported(cls):
                return torch.cuda.get_device_capability()[0] >= 10
    """)
    assert "Config" in hot and "supported" in hot and "Quiet" not in hot


def test_the_flow_follows_headers_around_a_return():
    lines = split_lines(textwrap.dedent("""
        def backend(self, x):
            if self.is_blackwell:
                return "trtllm"
            elif x:
                y = 1
            else:
                z = compute(
                    a, "(",
                )
            s = \"\"\"
            if not x:
                return
            \"\"\"
            def inner():
                return 3
            return z
    """))
    statements = _statements(lines, 0, len(lines), set())
    returns, local, attrs = _flow(statements, {"is_blackwell"})
    assert returns and local == {"y", "z"} and not attrs  # `else` continues the `if`; the string is one statement
    returns, _, _ = _flow(statements, set())
    assert not returns  # `inner`'s return is its own


def test_a_helper_taking_the_architecture_in_another_module_is_read(tmp_path):
    pkg = tmp_path / "eng"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "api.py").write_text(textwrap.dedent("""
        _ROUTED = frozenset({100, 103})


        class MxInt4Config:
            @classmethod
            def supported(cls, arch: int) -> bool:
                return arch in _ROUTED
    """))
    (pkg / "runner.py").write_text(textwrap.dedent("""
        import torch

        from .api import MxInt4Config


        def check():
            major, minor = torch.cuda.get_device_capability()
            arch = major * 10 + minor
            if not MxInt4Config.supported(arch):
                raise NotImplementedError("MxInt4 needs SM100/SM103")
    """))
    got = {f.condition: f for f in audit(str(tmp_path / "eng")).findings if f.path == "runner.py"}
    gate = got["not MxInt4Config.supported(arch)"]
    assert gate.kind == "guard" and [a for a, v in gate.values.items() if v] == ["sm100", "sm103"]


LONG_DEF = '''
import torch


def forward(self, x, backend=None):
    """A long engine method: most of it cannot matter to an architecture condition."""
    y = x + 1
    w = x.clone()
''' + "".join(f"    w = w * {i}\n" for i in range(40)) + '''
    cap = torch.cuda.get_device_capability()
    if backend is None:
        backend = "default"
    elif backend == "auto":
        backend = "fa4" if cap[0] == 10 else "fa3"
    else:
        pass
    match x.dtype:
        case torch.float16:
            z = 1
        case _:
            z = 2
    for i in range(3):
        if cap >= (9, 0):
            y = y + i
        else:
            raise ValueError("needs sm90")
    print(y)  # no return: its callers cannot read the architecture through it, so it is not inlined whole
'''


def test_a_long_def_keeps_what_its_conditions_read_and_parses():
    tree, _, _, hidden = select(LONG_DEF)
    lines = textwrap.dedent(LONG_DEF).split("\n")
    dropped = {i for a, b in hidden for i in range(a, b)}
    text = {lines[i].strip() for i in range(len(lines)) if i not in dropped}
    assert "w = w * 5" not in text and "z = 1" not in text  # statements no condition reads
    assert "y = x + 1" in text  # `y` is set under an architecture test below: every binding of it stays
    # The conditions, what they read, their whole chains, and the loop around a kept one stay.
    assert {"cap = torch.cuda.get_device_capability()", "if backend is None:", "elif backend == \"auto\":", "else:",
            "for i in range(3):", "if cap >= (9, 0):", 'raise ValueError("needs sm90")'} <= text
    assert "match x.dtype:" not in text  # a match no kept statement is in goes whole


def test_a_long_def_gives_the_same_conditions_as_the_whole_def(tmp_path, monkeypatch):
    from tpfuse.audit import parse

    thin = found(tmp_path, LONG_DEF)
    monkeypatch.setattr(parse, "_THIN_MIN_LINES", 10**6)
    assert found(tmp_path, LONG_DEF) == thin and "cap >= (9, 0)" in thin


SELECTIVE = '''"""Module docstring
def not_code():
    return get_platform().is_sm100
"""
import torch

_MAJOR, _ = torch.cuda.get_device_capability()
_USE_FMA = _MAJOR >= 10


def plain(x):
    return x + 1


def reads_flag():
    if _USE_FMA:
        return "fma"
    return "mul"


def calls_helper():
    if _sm90():
        return "wgmma"
    return None


def _sm90():
    return torch.cuda.get_device_capability()[0] == 9


class Unrelated:
    def method(self):
        return 2
'''


def test_selective_parse_keeps_every_condition(tmp_path):
    (tmp_path / "m.py").write_text(SELECTIVE)
    textmap = TextMap(SELECTIVE)
    tree, skipped, hot, hidden = parse_selected(SELECTIVE, "m.py", arch_tokens(textmap)[1], ARCH_RE, textmap=textmap)
    assert {"_MAJOR", "_USE_FMA", "_sm90"} <= hot
    kept = {n.name for n in tree.body if hasattr(n, "name")}
    assert {"reads_flag", "calls_helper", "_sm90"} <= kept  # a hot flag, a same-module arch helper
    assert set(skipped) == {"plain", "Unrelated"}
    left_out = {line for a, b in hidden for line in SELECTIVE.split("\n")[a:b]}
    assert any("def plain" in line for line in left_out) and any("class Unrelated" in line for line in left_out)
    found = {(f.scope, f.enables[0]) for f in audit(str(tmp_path / "m.py")).findings if f.category == "gate"}
    assert {("reads_flag", "sm100"), ("calls_helper", "sm90")} <= found  # and the flag and helper themselves
    assert not [f for f in audit(str(tmp_path / "m.py")).findings if f.line <= 4]  # the docstring holds no code


def test_class_methods_without_architecture_text_are_trimmed_not_lost(tmp_path):
    cls = (
        "class Runner:\n"
        "    def __init__(self):\n"
        "        self.sm = get_device_sm()\n"
        "\n"
        "    def plain(self, x):\n"
        "        return x + 1\n"
        "\n"
        "    def fast(self):\n"
        "        if self.sm >= 100:\n"
        "            return 1\n"
        "        return 0\n"
    )
    trimmed, ranges, exports = _trim_class(cls, {2}, set())
    assert [cls.split("\n")[a] for a, _ in ranges] == ["    def plain(self, x):"]
    assert exports == {"sm", "fast"}  # what other code reads the architecture through: `self.sm`, `x.fast()`
    assert trimmed.count("\n") == cls.count("\n")  # every position stays the real one
    assert "return x + 1" not in trimmed and "self.sm >= 100" in trimmed  # `self.sm` ties `fast` to __init__
    (tmp_path / "r.py").write_text("from eng.utils import get_device_sm\n\n\n" + cls)
    found = [f for f in audit(str(tmp_path / "r.py")).findings if f.scope == "Runner.fast"]
    assert [f.enables for f in found] == [names(lambda a: a.cc_int >= 100)]
