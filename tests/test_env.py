"""Every TPFUSE_* variable is validated where it is read, and a bad value names the variable and the fix;
a Communicator built under a bad TPFUSE_TIMEOUT_S refuses at construction instead of failing every call."""

from __future__ import annotations

import os

import pytest

from tpfuse import env


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e300", "0", "-5", "1801", "soon", " "])
def test_a_timeout_that_is_not_a_finite_bound_is_refused_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("TPFUSE_TIMEOUT_S", value)
    for reader in (env.spin_timeout_s, env.host_timeout_s):
        with pytest.raises(ValueError, match=r"^TPFUSE_TIMEOUT_S="):
            reader()


@pytest.mark.parametrize("value, seconds", [("5", 5.0), ("0.25", 0.25), ("1800", 1800.0)])
def test_a_timeout_within_the_bound_is_read(monkeypatch, value, seconds):
    monkeypatch.setenv("TPFUSE_TIMEOUT_S", value)
    assert env.spin_timeout_s() == env.host_timeout_s() == seconds


def test_without_a_timeout_the_defaults_hold(monkeypatch):
    monkeypatch.delenv("TPFUSE_TIMEOUT_S", raising=False)
    assert (env.spin_timeout_s(), env.host_timeout_s()) == (env.SPIN_DEFAULT_TIMEOUT_S, env.HOST_DEFAULT_TIMEOUT_S)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 1e300, 0, -1, True, "5"])
def test_the_timeout_option_is_held_to_the_same_bound(value):
    from tpfuse.strategies.host_wait import strategy_timeout_s

    with pytest.raises(ValueError, match=r"^ring: timeout_s"):
        strategy_timeout_s({"timeout_s": value}, "ring")


@pytest.mark.parametrize("value", ["x", "x=os", "x=os:", "=os:getcwd", "x=os getcwd:f", "x=os:get cwd", "x y=a:b"])
def test_a_malformed_plugin_entry_names_the_variable(monkeypatch, value):
    monkeypatch.setenv("TPFUSE_STRATEGIES", value)
    with pytest.raises(ValueError, match=r"^TPFUSE_STRATEGIES: entry .* must look like name=package.module:Class"):
        env.extra_strategies()


def test_plugin_entries_parse(monkeypatch):
    monkeypatch.setenv("TPFUSE_STRATEGIES", " a = pkg.mod:Cls , b=m:C.Inner ")
    assert env.extra_strategies() == {"a": "pkg.mod:Cls", "b": "m:C.Inner"}


def test_a_strategy_override_must_be_one_name(monkeypatch):
    monkeypatch.setenv("TPFUSE_STRATEGY", "ring, reference")
    with pytest.raises(ValueError, match=r"^TPFUSE_STRATEGY='ring, reference' is not a strategy name"):
        env.strategy_override()
    monkeypatch.setenv("TPFUSE_STRATEGY", " ring ")
    assert env.strategy_override() == "ring"


def test_a_relative_cache_dir_is_made_absolute(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TPFUSE_CACHE_DIR", "tables")
    assert env.cache_dir() == tmp_path / "tables"
    monkeypatch.setenv("TPFUSE_CACHE_DIR", "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert env.cache_dir() == tmp_path / "xdg" / "tpfuse"


def _construct_rank(rank, world_size):
    os.environ["TPFUSE_TIMEOUT_S"] = "nan"
    from tpfuse import Communicator

    try:
        Communicator(strategy="reference")
    except ValueError as exc:
        return str(exc)
    return "constructed"


@pytest.mark.gloo
def test_a_communicator_under_a_nan_timeout_refuses_at_construction_on_every_rank():
    from tpfuse.spawn import run_ranks

    for text in run_ranks(_construct_rank, 2, timeout_s=120):
        assert text.startswith("Communicator: TPFUSE_TIMEOUT_S='nan': must be a finite number of seconds"), text
