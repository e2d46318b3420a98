"""Architecture names and the three-valued logic the audit evaluates gates with."""

from __future__ import annotations

import itertools

import pytest

from tpfuse.audit.arch import ARCH_NAMES, ARCHS, ArchBool, ArchNum, compare, parse_arch
from tpfuse.audit.predicates import CAP_ANY


@pytest.mark.parametrize("text,name",
                         [("sm120", "sm120"), ("SM_120", "sm120"), ("120", "sm120"), ("12.0", "sm120"),
                          ("sm100a", "sm100"), ("12.1f", "sm121"), ("sm89", "sm89")])
def test_parse_arch_spellings(text, name):
    arch = parse_arch(text)
    assert arch.name == name
    assert arch.cc_int == int(name[2:])


@pytest.mark.parametrize("bad", ["sm130", "hopper", "", "12.9", "sm_70"])
def test_unknown_arch_lists_the_valid_ones(bad):
    with pytest.raises(ValueError) as exc:
        parse_arch(bad, option="--arch")
    msg = str(exc.value)
    assert msg.startswith("--arch: unknown architecture")
    for name in ARCH_NAMES:
        assert name in msg


# Kleene's strong three-valued logic, written out as tables (None = unknown).
_AND = {(True, True): True, (True, False): False, (True, None): None, (False, True): False, (False, False): False,
        (False, None): False, (None, True): None, (None, False): False, (None, None): None}
_OR = {(True, True): True, (True, False): True, (True, None): True, (False, True): True, (False, False): False,
       (False, None): None, (None, True): True, (None, False): None, (None, None): None}
_NOT = {True: False, False: True, None: None}


def test_kleene_tables_elementwise():
    vals = (True, False, None)
    pairs = list(itertools.product(vals, vals))
    # Lay every pair out across the architectures (9 archs, 9 pairs).
    a = ArchBool(tuple(p[0] for p in pairs))
    b = ArchBool(tuple(p[1] for p in pairs))
    assert a.and_(b).values == tuple(_AND[p] for p in pairs)
    assert a.or_(b).values == tuple(_OR[p] for p in pairs)
    assert a.not_().values == tuple(_NOT[p[0]] for p in pairs)


def test_enables_and_names():
    value = ArchBool(tuple(True if a.major == 9 else None if a.major == 10 else False for a in ARCHS))
    assert value.enabled_names() == ["sm90", "sm100?", "sm103?"]
    assert value.enables(parse_arch("sm103")) and not value.enables(parse_arch("sm120"))


def test_compare_lifts_over_archs():
    cap = ArchNum.of(lambda a: (a.major, a.minor))
    got = compare("GtE", cap, (10, 0))
    assert [a.name for a, v in zip(ARCHS, got.values) if v] == ["sm100", "sm103", "sm110", "sm120", "sm121"]
    sm = ArchNum.of(lambda a: a.cc_int)
    got = compare("In", sm, [100, 103])
    assert [a.name for a, v in zip(ARCHS, got.values) if v] == ["sm100", "sm103"]
    assert compare("Lt", cap, "x") is None  # tuple < str: undecidable, never a crash


def test_a_capability_is_in_a_set_of_any_of_its_integer_forms():
    # A parameter named `compute_capability` compares equal to 90, (9, 0) and 9; a frozenset finds it
    # by equality, not by hash (vLLM: `compute_capability in frozenset({90})`).
    from tpfuse.audit.predicates import CAP_ANY

    assert compare("In", CAP_ANY, frozenset({90})).values == tuple(a.name == "sm90" for a in ARCHS)
    assert compare("NotIn", CAP_ANY, {100: "x", 103: "y"}).values == tuple(a.name not in ("sm100", "sm103")
                                                                           for a in ARCHS)


def test_capability_parameter_compares_in_every_integer_form():
    assert compare("Eq", CAP_ANY, 9).values == tuple(a.major == 9 for a in ARCHS)  # a major
    assert compare("GtE", CAP_ANY, 100).values == tuple(a.cc_int >= 100 for a in ARCHS)  # major*10+minor
    assert compare("Lt", CAP_ANY, 1000).values == tuple(a.cuda_arch < 1000 for a in ARCHS)  # __CUDA_ARCH__
    assert compare("In", CAP_ANY, ((10, 0), (10, 3))).values == tuple(a.cc_int in (100, 103) for a in ARCHS)
