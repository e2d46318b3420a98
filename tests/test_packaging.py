"""What `pip install .` brings: every package the ranks need at run time is a declared dependency."""

import re
from pathlib import Path

import tomllib

from tpfuse.cli.preflight import RUNTIME_PACKAGES

ROOT = Path(__file__).resolve().parents[1]


def _requirement_names(requirements: list[str]) -> set[str]:
    return {re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower() for r in requirements}


def test_runtime_packages_are_declared_dependencies_not_only_extras():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = _requirement_names(project["dependencies"])
    assert {"torch", "numpy"} <= declared
    assert set(RUNTIME_PACKAGES) <= declared


def test_ci_runs_the_readme_commands_in_fresh_venvs():
    ci = (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    setup = readme.split("## Set up on a fresh machine", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```bash\n(.*?)\n```$", setup, re.M | re.S)
    assert blocks[0] == "pip install torch==2.13.0 && pip install . && tpfuse selftest --world-size 2"
    assert len(blocks) == 2 and "python -m pytest" in blocks[1]
    # .ci/run reads the blocks from that section and runs each inside its own `python -m venv`.
    assert 'in_setup = ($0 == "## Set up on a fresh machine")' in ci
    assert 'python -m venv "$venv_dir/$1"' in ci and 'source "$venv_dir/$1/bin/activate"' in ci
    assert 'in_fresh_venv main "$main_command"' in ci and 'in_fresh_venv test "$test_command"' in ci


def test_ci_runs_the_linter_the_test_extra_installs():
    ci = (ROOT / ".ci" / "run").read_text()
    tests_extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    assert "ruff" in _requirement_names(tests_extra)
    assert ci.rstrip().endswith('"$venv_dir/test/bin/ruff" check .')
