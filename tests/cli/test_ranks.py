"""How the CLI tells about its ranks: tpfuse warnings as one line, a RankFailure as one line per error."""

from tpfuse.cli.ranks import _format_warning, describe_failure
from tpfuse.dispatch.choice import DispatchWarning
from tpfuse.spawn import RankFailure

TRACEBACK = 'Traceback (most recent call last):\n  File "x.py", line 1, in f\n    g()\nRuntimeError: {}\n'


def test_a_rank_failure_is_one_clause_per_distinct_error():
    exc = RankFailure({0: TRACEBACK.format("tune: no strategy passed"), 1: TRACEBACK.format("tune: no strategy passed"),
                       2: "no result within 300 s (hung or waiting on a peer)"})
    assert describe_failure(exc) == ("rank(s) 0, 1: RuntimeError: tune: no strategy passed; rank(s) 2: no result "
                                     "within 300 s (hung or waiting on a peer) (`tpfuse -v ...` prints the ranks' "
                                     "tracebacks)")


def test_tpfuse_warnings_print_as_one_plain_line_others_as_python_does():
    line = _format_warning(DispatchWarning("Communicator: no dispatch table"), DispatchWarning, "/x/api.py", 182,
                           "name = self._choose(problem).name")
    assert line == "tpfuse: warning: Communicator: no dispatch table\n"
    other = _format_warning(UserWarning("u"), UserWarning, "/x/y.py", 3, "src line")
    assert other == "/x/y.py:3: UserWarning: u\n  src line\n"
