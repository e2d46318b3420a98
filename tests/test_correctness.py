"""tpfuse.correctness: the inputs, the checks (a wrong answer, an unwritten output, a wrong
shape or an aliased input is caught; nothing right is refused), the digest, and the collective
verdict on 2 gloo ranks; GPU tier: a strategy that writes nothing reads NaN and fails."""

from __future__ import annotations

import pytest
import torch

from tpfuse import correctness as V
from tpfuse.reference import TOLERANCE, all_reduce_residual_rmsnorm_ref
from tpfuse.spawn import run_ranks
from tpfuse.spec import Op

FUSED = Op.ALL_REDUCE_RESIDUAL_RMSNORM.value


def _reference_outputs(case, world_size=2):
    return V.reference_outputs(case, V.case_inputs(case, world_size))


def test_exact_inputs_are_rank_tagged_small_integers_and_deterministic():
    case = V.Case("exact", FUSED, 5, 64, "bfloat16")
    a, b = V.case_inputs(case, 3), V.case_inputs(case, 3)
    assert all(torch.equal(x, y) for x, y in zip(a.xs, b.xs)) and torch.equal(a.residual, b.residual)
    assert not torch.equal(a.xs[0], a.xs[1])  # rank-tagged: a misrouted buffer changes the sum
    for t in (*a.xs, a.residual, a.weight):
        assert t.dtype == torch.bfloat16 and torch.equal(t, t.round()) and t.abs().max() <= 11
    assert V.case_inputs(V.Case("exact", FUSED, 5, 64, "bfloat16", has_residual=False), 3).residual is None
    x, residual, weight = a.for_rank(2, "cpu")
    assert torch.equal(x, a.xs[2]) and torch.equal(weight, a.weight)


def test_reference_outputs_pass_and_say_what_was_shown():
    for kind in ("exact", "random"):
        for op in (FUSED, Op.ALL_REDUCE.value):
            case = V.Case(kind, op, 3, 128, "bfloat16")
            inputs = V.case_inputs(case, 2)
            check = V.check_outputs(case, inputs, V.reference_outputs(case, inputs))
            assert check.passed, check
            assert check.reason.startswith("bit-exact" if kind == "exact" else "relative error")
            assert check.tolerance == (0.0 if kind == "exact" else TOLERANCE[torch.bfloat16])


def test_one_wrong_element_fails_the_exact_case_with_the_count():
    case = V.Case("exact", FUSED, 3, 128, "float32")
    normed, new_residual = _reference_outputs(case)
    normed = normed.clone()
    normed[1, 7] += 1
    check = V.check_outputs(case, V.case_inputs(case, 2), (normed, new_residual))
    assert not check.passed and check.error == 1.0
    assert check.reason == ("not bit-exact on small integers (with residual): "
                            "normed differs from the reference in 1 of 384 elements")


def test_an_unwritten_element_reads_nan_and_fails():
    case = V.Case("random", FUSED, 3, 128, "bfloat16")
    normed, new_residual = _reference_outputs(case)
    new_residual = new_residual.clone()
    new_residual[0, 0] = float("nan")
    check = V.check_outputs(case, V.case_inputs(case, 2), (normed, new_residual))
    assert not check.passed and check.error == float("inf") and "new_residual relative error inf" in check.reason
    exact = V.Case("exact", FUSED, 3, 128, "bfloat16")
    poisoned = tuple(torch.full_like(t, float("nan")) for t in _reference_outputs(exact))
    check = V.check_outputs(exact, V.case_inputs(exact, 2), poisoned)
    assert (not check.passed and check.error == float("inf")
            and "differs from the reference in 384 of 384" in check.reason)


def test_random_case_tolerance_is_the_reference_table_and_not_looser():
    case = V.Case("random", FUSED, 4, 256, "float16")
    inputs = V.case_inputs(case, 2)
    refs64 = V.reference_outputs(case, inputs, float64=True)
    tol = TOLERANCE[torch.float16]

    def scaled(factor):  # every output off by `factor` relative error, in float64 before the rounding
        return tuple((r * (1 + factor)).to(torch.float16) for r in refs64)

    assert V.check_outputs(case, inputs, scaled(0.25 * tol)).passed
    failed = V.check_outputs(case, inputs, scaled(2 * tol))
    assert not failed.passed and failed.tolerance == tol and failed.error > tol


def test_tolerance_fallback_only_where_asked():
    case = V.Case("exact", FUSED, 3, 256, "bfloat16")
    inputs = V.case_inputs(case, 2)
    normed, new_residual = V.reference_outputs(case, inputs)
    nudged = normed.clone()
    nudged.view(torch.int16)[0, 0] += 1  # one ulp off: not bit-exact, far within the tolerance
    assert not V.check_outputs(case, inputs, (nudged, new_residual)).passed
    check = V.check_outputs(case, inputs, (nudged, new_residual), tolerance_fallback=True)
    assert check.passed and check.reason.startswith("within tolerance") and "not bit-exact" in check.reason
    far = normed * 2
    assert not V.check_outputs(case, inputs, (far, new_residual), tolerance_fallback=True).passed


def test_wrong_shape_dtype_count_and_aliasing_fail():
    case = V.Case("exact", FUSED, 3, 128, "bfloat16")
    inputs = V.case_inputs(case, 2)
    normed, new_residual = V.reference_outputs(case, inputs)
    assert "expected (3, 128) torch.bfloat16" in V.check_outputs(case, inputs, (normed.float(), new_residual)).reason
    assert "expected (3, 128)" in V.check_outputs(case, inputs, (normed[:2], new_residual)).reason
    assert "returned 1 outputs, expected 2" in V.check_outputs(case, inputs, (normed,)).reason
    assert "aliases the input" in V.check_outputs(case, inputs, (normed, new_residual), x=normed).reason


def test_digest_is_the_bits():
    a = (torch.tensor([1.0, 2.0]), torch.tensor([3.0]))
    assert V.digest(a) == V.digest(tuple(t.clone() for t in a))
    assert V.digest(a) != V.digest((torch.tensor([1.0, 2.0]), torch.tensor([-3.0])))
    assert V.digest((torch.tensor([0.0]),)) != V.digest((torch.tensor([-0.0]),))  # bits, not values


def test_case_rejects_unknown_kinds_and_ops():
    with pytest.raises(ValueError, match="kind must be 'exact' or 'random'"):
        V.Case("approximate", FUSED, 1, 8, "float32")
    with pytest.raises(ValueError):
        V.Case("exact", "all_gather", 1, 8, "float32")


def test_checks_run_on_the_rank_s_share_of_the_host_threads_and_restore_them(monkeypatch):
    monkeypatch.setattr(V.os, "cpu_count", lambda: 16)
    before = torch.get_num_threads()
    torch.set_num_threads(16)
    seen = []
    try:
        with V.host_share_of_threads(2):
            seen.append(torch.get_num_threads())
            with V.host_share_of_threads(64):  # more ranks than cores: one thread each
                seen.append(torch.get_num_threads())
            seen.append(torch.get_num_threads())
        seen.append(torch.get_num_threads())
        torch.set_num_threads(4)
        with V.host_share_of_threads(2):  # never more threads than the caller had
            seen.append(torch.get_num_threads())
    finally:
        torch.set_num_threads(before)
    assert seen == [8, 1, 8, 16, 4]
    # the candidate runs on the caller's threads, the check on the share
    during = []
    torch.set_num_threads(2)
    monkeypatch.setattr(V.os, "cpu_count", lambda: 2)
    try:
        case = V.Case("exact", Op.ALL_REDUCE.value, 2, 8, "float32")
        check = V.run_case(lambda x, r, w: during.append(torch.get_num_threads()) or (x.clone(),), case, rank=0,
                           world_size=2, device="cpu")
    finally:
        torch.set_num_threads(before)
    assert during == [2] and not check.passed  # one rank's input is not the sum of two


def test_run_case_catches_a_strategy_that_writes_nothing():
    """Fresh, never written outputs: poisoned blocks (NaN) where the allocator reuses them, else
    whatever memory held; never the reference's answer."""
    case = V.Case("exact", FUSED, 4, 4096, "float32")
    check = V.run_case(lambda x, r, w: (torch.empty_like(x), torch.empty_like(x)), case, rank=0, world_size=1,
                       device=torch.device("cpu"))
    assert not check.passed and "differs from the reference" in check.reason
    good = V.run_case(lambda x, r, w: all_reduce_residual_rmsnorm_ref([x], r, w, V.EPS), case, rank=0, world_size=1,
                      device=torch.device("cpu"))
    assert good.passed, good


class _Sum:
    """A strategy-like object: fp32 all_reduce through torch.distributed, then the reference epilogue;
    `lie_on_rank` adds one everywhere on that rank, `ulp_on_rank` nudges one random-input bit there."""

    def __init__(self, rank, *, lie_on_rank=None, ulp_on_rank=None):
        self.rank, self.lie, self.ulp = rank, lie_on_rank, ulp_on_rank

    def _sum(self, x):
        import torch.distributed as dist

        acc = x.float().clone()
        dist.all_reduce(acc)
        s = acc.to(x.dtype)
        return s + 1 if self.rank == self.lie else s

    def all_reduce(self, x):
        return self._sum(x)

    def all_reduce_residual_rmsnorm(self, x, residual, weight, eps):
        from tpfuse.reference import residual_rmsnorm_ref

        normed, new_residual = residual_rmsnorm_ref(self._sum(x), residual, weight, eps)
        if self.rank == self.ulp and not torch.equal(x, x.round()):  # random inputs only: exact cases stay exact
            normed = normed.clone()
            normed.view(torch.int16)[0, 0] += 1  # one ulp (bfloat16 bits)
        return normed, new_residual


def _verdict_rank(rank, world_size, kwargs):
    import torch.distributed as dist

    verdict = V.check_candidate(_Sum(rank, **kwargs), Op.ALL_REDUCE_RESIDUAL_RMSNORM, num_tokens=3, hidden=64,
                                dtype=torch.bfloat16, group=dist.group.WORLD, rank=rank, world_size=world_size,
                                device=torch.device("cpu"))
    return verdict.ok, verdict.reason


@pytest.mark.parametrize("kwargs, ok, words", [
    ({}, True, "bit-exact on small integers, within tolerance on random inputs, identical on 2 ranks"),
    ({"lie_on_rank": 1}, False, "rank 1: not bit-exact on small integers"),
    ({"ulp_on_rank": 1}, False, "random case: ranks returned different bits"),
])
def test_check_candidate_is_one_verdict_on_every_rank(kwargs, ok, words):
    (ok0, why0), (ok1, why1) = run_ranks(_verdict_rank, 2, args=(kwargs,), timeout_s=120)
    assert (ok0, why0) == (ok1, why1)
    assert ok0 is ok and why0.startswith(words), why0
    assert "rank 0" not in why0


@pytest.mark.gpu
def test_on_cuda_an_unwritten_output_reads_nan():
    case = V.Case("exact", FUSED, 4, 4096, "bfloat16")
    check = V.run_case(lambda x, r, w: (torch.empty_like(x), torch.empty_like(x)), case, rank=0, world_size=1,
                       device=torch.device("cuda"))
    assert not check.passed and check.error == float("inf"), check
