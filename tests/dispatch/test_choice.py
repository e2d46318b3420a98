"""The dispatch decision as pure functions: the do-no-harm guard at lookup, explicit-override
warnings, and the default choice's reasons."""

import pytest

from tpfuse.dispatch.choice import choose, default_choice, guarded
from tpfuse.dispatch.table import DispatchTable, Entry
from tpfuse.spec import GroupFacts, Op, Problem, Verdict

FUSED = {"oneshot", "twoshot"}


def is_fused(name):
    return name in FUSED


def _t(median):
    return {"median": median, "p20": median, "p80": median, "n": 9}


def _table(choice, times, rejected=None, margin=0.03, tokens=8):
    entry = Entry("all_reduce_residual_rmsnorm", "bfloat16", 64, tokens, choice, "measured", "reference",
                  {n: _t(t) for n, t in times.items()}, {}, rejected or {})
    return DispatchTable({}, {}, (entry,), {"margin": margin})


def _problem(tokens=5):
    facts = GroupFacts(world_size=2, backend="gloo", device_type="cpu")
    return Problem(Op.ALL_REDUCE_RESIDUAL_RMSNORM, tokens, 64, "bfloat16", facts)


ALL_OK = {n: Verdict.yes() for n in ("nccl_epilogue", "reference", "ring", "oneshot", "twoshot")}


def test_lookup_guard_refuses_a_fused_choice_its_own_times_do_not_support():
    table = _table("oneshot", {"reference": 100.0, "oneshot": 99.0})  # e.g. a hand-edited table
    name, reason = guarded(table.entries[0], table.margin, is_fused)
    assert name == "reference" and "guard" in reason
    choice = choose(_problem(), ALL_OK, table=table, is_fused=is_fused)
    assert (choice.name, choice.source) == ("reference", "table")
    good = _table("oneshot", {"reference": 100.0, "oneshot": 90.0})
    assert choose(_problem(), ALL_OK, table=good, is_fused=is_fused).name == "oneshot"


def test_lookup_falls_back_to_the_default_when_the_choice_is_not_admitted_or_not_tuned():
    table = _table("oneshot", {"reference": 100.0, "oneshot": 50.0})
    verdicts = {**ALL_OK, "oneshot": Verdict.no("needs peer access"), "nccl_epilogue": Verdict.no("needs NCCL")}
    choice = choose(_problem(), verdicts, table=table, is_fused=is_fused)
    assert (choice.name, choice.source) == ("reference", "default") and "needs peer access" in choice.reason
    choice = choose(_problem(tokens=9), ALL_OK, table=table, is_fused=is_fused)  # beyond the tuned buckets
    assert choice.source == "default" and "no bucket" in choice.reason
    assert choose(_problem(), verdicts, table=None).source == "default"


def test_explicit_override_is_honoured_with_a_warning_when_measurements_contradict_it():
    table = _table("reference", {"reference": 100.0, "ring": 150.0, "oneshot": 101.0},
                   rejected={"twoshot": "failed correctness: rank 1: differs"})
    slow = choose(_problem(), ALL_OK, requested="ring", table=table, is_fused=is_fused)
    assert (slow.name, slow.source) == ("ring", "explicit") and "1.50x" in slow.warning
    broken = choose(_problem(), ALL_OK, requested="twoshot", table=table, is_fused=is_fused,
                    requested_by="TPFUSE_STRATEGY")
    assert (broken.name == "twoshot" and "failed the correctness check" in broken.warning
            and "TPFUSE_STRATEGY" in broken.reason)
    close = choose(_problem(), ALL_OK, requested="oneshot", table=table, is_fused=is_fused)  # within the margin
    assert close.warning == ""
    with pytest.raises(ValueError, match="cannot run .* needs NCCL"):
        choose(_problem(), {**ALL_OK, "nccl_epilogue": Verdict.no("needs NCCL")}, requested="nccl_epilogue")


def test_default_choice_explains_every_rejection():
    with pytest.raises(ValueError, match="a: needs CUDA; b: too big"):
        default_choice({"a": Verdict.no("needs CUDA"), "b": Verdict.no("too big")})
