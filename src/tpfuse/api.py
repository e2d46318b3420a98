"""The public entry point: `Communicator`, bound to a torch.distributed process group.

    comm = tpfuse.Communicator()                       # world group, strategy="auto"
    y = comm.all_reduce(x)                               # sum over ranks, out of place
    normed, residual = comm.all_reduce_residual_rmsnorm(x, residual, weight, eps=1e-6)
    q, scale, residual, _ = comm.all_reduce_residual_rmsnorm(x, residual, weight, quant=tpfuse.nvfp4(gs))

Every method is a collective: all ranks of the group call it in the same order with the same
shapes and dtypes. Construction is a collective too (ranks agree on the group's facts once).
Calls run on the caller's current CUDA stream. The ops' exact meaning and rounding points are in
`tpfuse.reference`; every strategy matches it and returns identical bits on every rank.

Strategy choice: `strategy="auto"` consults the dispatch table written by `tpfuse tune` (see
`tpfuse.dispatch.choice`); an explicit name (or TPFUSE_STRATEGY) is honoured, and a call it cannot
serve raises ValueError with the admission reason. `debug=True` (or TPFUSE_DEBUG=1) checks before
each collective that all ranks agree on shape and dtype, turning a would-be hang into an error.
Construction first checks that every rank asked for the same strategy, debug mode and device
(`tpfuse.group.agree_settings`): a mismatch raises on every rank, naming the ranks; so do an
unknown keyword option (`OPTIONS` lists them) and a device that is not 'cpu' or 'cuda'.

Per-call cost: everything that depends only on the call's op, shape, dtype, residual and
quantized-output format (the `Problem`, the strategy's choice and instance) is computed once per
shape and kept (`_Route`); a steady-state call checks its arguments (`tpfuse.validation`: a few
attribute reads when they are valid), looks its route up and calls the strategy.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

from tpfuse import env
from tpfuse.dispatch.agree import agreed_table
from tpfuse.dispatch.choice import CONSERVATIVE_DEFAULT, Choice, choose, is_fused, warn_once
from tpfuse.dispatch.table import token_buckets
from tpfuse.group import agree_group_facts, agree_settings, device_type_of
from tpfuse.probe import probe
from tpfuse.spec import Op, Problem, dtype_name
from tpfuse.strategies import admission, get_strategy, strategy_names
from tpfuse.strategies.base import Strategy, StrategyContext
from tpfuse.strategies.host_wait import HostGroup, PeerGuard, strategy_timeout_s
from tpfuse.validation import SUPPORTED_DTYPES, as_rows, check_all_reduce, check_quant, check_residual_rmsnorm

# The keyword options a Communicator hands its strategies (`StrategyContext.options`); any other
# name is refused at construction, so that a misspelt option is an error and not a silent default.
OPTIONS = {
    "timeout_s": "seconds a wait for a peer may take (reference, ring, oneshot, twoshot; default TPFUSE_TIMEOUT_S)",
    "max_tokens": "tokens the peer workspace is sized for when prepare() was not called (oneshot, twoshot)",
    "max_programs": "grid cap of the peer kernels (oneshot, twoshot; default the GPU's SMs per rank on it)",
}

_SETTING_FIXES = {
    "strategy": "pass the same strategy= (and TPFUSE_STRATEGY) on every rank",
    "debug": "set TPFUSE_DEBUG (or debug=) the same on every rank",
    "device": "pass the same device= on every rank",
    "plugins": "set TPFUSE_STRATEGIES the same on every rank",
}


class Communicator:
    def __init__(
        self, group=None, *, strategy: str = "auto", device=None, debug: bool | None = None, cpu_group=None,
        **options,
    ) -> None:
        """`device`: where the tensors live; default CUDA (current device) for NCCL groups, else CPU.
        Pass device="cuda" with a gloo group to run CUDA tensors over gloo, e.g. several ranks
        sharing one GPU (NCCL refuses that). `cpu_group`: a gloo group of the same ranks in the same
        order; construction's handshakes (group facts, table agreement) and debug checks then run
        on it while the data moves over `group` (engines pass theirs, to keep object collectives
        off NCCL). `options` reach every strategy (see each strategy)."""
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "Communicator: torch.distributed is not initialized; call "
                "torch.distributed.init_process_group('gloo' on CPU or 'nccl' on GPUs) first"
            )

        self.group = group if group is not None else dist.group.WORLD
        self.cpu_group = cpu_group if cpu_group is not None else self.group
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        requested, problem, plugins = strategy, "", {}
        try:  # errors are raised on every rank by agree_settings, not here on this one alone
            requested, plugins = env.strategy_override() or strategy, env.extra_strategies()
            if requested != "auto" and requested not in strategy_names():
                problem = f"unknown strategy {requested!r}; use 'auto' or one of: {', '.join(strategy_names())}"
            elif requested != "auto":
                get_strategy(requested)  # a plugin's target must import and be a Strategy
            debug_on = env.debug_enabled() if debug is None else bool(debug)
            strategy_timeout_s(options)  # read by the strategies at their first call
        except (ValueError, ImportError) as exc:
            debug_on, problem = False, problem or str(exc)
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            problem = problem or _unknown_options(unknown)
        device_type, device_problem = _device_type(device, self.group)
        problem = problem or device_problem
        if device_type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("Communicator: device='cuda' but torch sees no CUDA GPU; "
                               "use a gloo group with device='cpu'")
        # Collective, before any other: ranks that differ here would run different collectives.
        agree_settings(self.cpu_group, "Communicator", {"strategy": requested, "debug": debug_on, "device": device_type,
                                                        "plugins": plugins}, problem, fixes=_SETTING_FIXES)
        self.requested = requested
        self.debug = debug_on
        self.options = options
        if self.debug:
            # Debug checks run on a private gloo group with the strategies' timeout (collective to
            # create): a stuck or dead peer then raises PeerLostError naming it within that bound,
            # whatever the data group's backend, and an abandoned check cannot hold up exit.
            timeout_s = strategy_timeout_s(options, "Communicator")
            host = HostGroup(self.cpu_group, timeout_s, "Communicator") if self.world_size > 1 else None
            self._debug_guard = PeerGuard("Communicator", self.rank, timeout_s, bounded=True, host_group=host)
        self.caps = probe()
        self.facts = agree_group_facts(self.group, self.caps, device_type=device_type, handshake_group=self.cpu_group)
        self.device = (torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda"
                       else torch.device("cpu"))
        self._instances: dict[str, Strategy] = {}
        self._choices: dict[tuple, Choice] = {}
        # Routes per op, keyed by (tokens, hidden, dtype, has residual, quantized-output kind)
        self._routes: dict[Op, dict[tuple, _Route]] = {op: {} for op in Op}
        self._closed = False
        # Collective: every rank loads its dispatch table and all agree on its digest, or all
        # use none (tpfuse.dispatch.agree). Loaded once; `tpfuse tune` output applies to new
        # Communicators.
        self.table, self.table_note = agreed_table(self.cpu_group, self.facts, self.caps)

    # ---- public ops -------------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the group's ranks: out of place, same shape and dtype (fp32 accumulation)."""
        check_all_reduce(x, device=self.device)
        rows = as_rows(x)
        m, h = rows.shape
        if self.debug:
            self._check_ranks_agree(Op.ALL_REDUCE, rows)
        route = self._routes[Op.ALL_REDUCE].get((m, h, x.dtype, False, None)) or self._route(
            Op.ALL_REDUCE, rows, has_residual=False)
        if m == 0:
            return torch.empty_like(x, memory_format=torch.contiguous_format)
        if x.requires_grad and torch.is_grad_enabled():
            with torch.no_grad():  # inference-only: outputs never carry autograd history (README)
                out = route.call(rows)
        else:
            out = route.call(rows)
        return out if rows is x else out.view(x.shape)

    def all_reduce_residual_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float = 1e-6, *, quant=None
    ):
        """(normed, new_residual): new_residual = residual + allreduce(x); normed = rmsnorm(new_residual) * weight.

        `residual=None` means no residual (the first layer): new_residual is allreduce(x). Shapes
        (..., hidden); weight (hidden,); all in one floating dtype. Rounding points: see
        tpfuse.reference. Zero tokens returns empty outputs without communicating.

        `quant` (a `tpfuse.QuantSpec`: tpfuse.fp8_static, fp8_per_token, fp8_per_group, nvfp4)
        quantizes the normed output and returns a `tpfuse.QuantOutput` (out, scale, residual,
        normed) instead: shapes and layouts in `tpfuse.quant`; normed is None unless the spec
        has with_normed=True. Every strategy that admits the format gives the reference's bits.
        """
        check_residual_rmsnorm(x, residual, weight, eps, device=self.device)
        kind = None
        if quant is not None:
            check_quant("all_reduce_residual_rmsnorm", quant, x.shape[-1], device=self.device)
            kind = quant.kind
        rows = as_rows(x)
        res_rows = as_rows(residual) if residual is not None else None
        m, h = rows.shape
        op = Op.ALL_REDUCE_RESIDUAL_RMSNORM
        if self.debug:
            self._check_ranks_agree(op, rows)
        route = self._routes[op].get((m, h, x.dtype, residual is not None, kind)) or self._route(
            op, rows, has_residual=residual is not None, quant=kind)
        weight, eps = weight.contiguous(), float(eps)
        if m == 0:
            if quant is not None:  # nothing to communicate; the reference gives the empty outputs
                from tpfuse.reference import residual_rmsnorm_quant_ref

                return _shaped(residual_rmsnorm_quant_ref(rows, res_rows, weight, eps, quant), x.shape, kind)
            empty = torch.empty_like(x, memory_format=torch.contiguous_format)
            return empty, empty.clone()
        # Autograd records nothing unless an input requires grad, so only then is no_grad needed
        # (entering it costs more than the rest of the host path's checks).
        if (x.requires_grad or weight.requires_grad or (residual is not None and residual.requires_grad)
                or quant is not None) and torch.is_grad_enabled():
            with torch.no_grad():  # inference-only: outputs never carry autograd history (README)
                return self._fused(route, x, rows, res_rows, weight, eps, quant)
        if quant is None:  # the steady call, inline
            normed, new_residual = route.call(rows, res_rows, weight, eps)
            return (normed, new_residual) if rows is x else (normed.view(x.shape), new_residual.view(x.shape))
        return self._fused(route, x, rows, res_rows, weight, eps, quant)

    def prepare(self, *, hidden: int, dtype: torch.dtype, max_tokens: int) -> None:
        """Set up every strategy that calls up to `max_tokens x hidden` may use; call before graph capture."""

        if self._closed:
            raise RuntimeError("Communicator.prepare: called after close(); create a new Communicator and prepare it")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"Communicator.prepare: max_tokens must be an integer >= 1, got {max_tokens!r}; pass the "
                             "largest number of tokens a call will have")
        for tokens in token_buckets(max_tokens):
            for op in Op:
                problem = Problem(op, tokens, hidden, dtype_name(dtype), self.facts)
                self._strategy(problem)
        for instance in self._instances.values():
            instance.prepare(hidden=hidden, dtype=dtype, max_tokens=max_tokens)

    def strategy_for(self, op: Op, num_tokens: int, hidden: int, dtype: torch.dtype, *,
                     has_residual: bool = True) -> Choice:
        """Which strategy a call of this shape would use, and why."""
        return self._choose(Problem(Op(op), num_tokens, hidden, dtype_name(dtype), self.facts, has_residual))

    def check(self) -> None:
        """Synchronise and raise the first device-side failure of any earlier call (e.g.
        PeerTimeoutError naming the ranks that never arrived). Eager calls raise it themselves on
        the next call; after CUDA-graph replays, call this to find out."""
        for instance in self._instances.values():
            instance.check()

    # ---- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        """Release every strategy's resources (collective for strategies with peer buffers)."""
        if self._closed:
            return
        self._closed = True
        for routes in self._routes.values():
            routes.clear()  # a later call misses its route, and _route raises
        for instance in self._instances.values():
            instance.close()
        self._instances.clear()
        if self.debug:
            self._debug_guard.close()

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- internals --------------------------------------------------------------------------

    @staticmethod
    def _fused(route, x, rows, res_rows, weight, eps, quant):
        if quant is not None:
            return _shaped(route.call(rows, res_rows, weight, eps, quant=quant), x.shape, quant.kind)
        normed, new_residual = route.call(rows, res_rows, weight, eps)
        if rows is x:
            return normed, new_residual
        return normed.view(x.shape), new_residual.view(x.shape)

    def _route(self, op: Op, rows: torch.Tensor, *, has_residual: bool, quant: str | None = None) -> _Route:
        """The route of calls of this op and shape (made once, kept unless it has zero tokens)."""
        if self._closed:
            raise RuntimeError("Communicator: used after close(); create a new Communicator")
        m, h = rows.shape
        problem = Problem(op, m, h, dtype_name(rows.dtype), self.facts, has_residual, quant)
        if m == 0:  # nothing is communicated: no strategy is chosen
            return _Route(problem, None, None)
        instance = self._strategy(problem)
        if op is Op.ALL_REDUCE:
            call = instance.all_reduce
        elif quant is None:
            call = instance.fused_route(m, h, rows.dtype, has_residual=has_residual)
        else:
            call = instance.all_reduce_residual_rmsnorm
        route = self._routes[op][(m, h, rows.dtype, has_residual, quant)] = _Route(problem, self._choose(problem), call)
        return route

    def _choose(self, problem: Problem) -> Choice:
        key = (problem.op, problem.num_tokens, problem.hidden, problem.dtype, problem.has_residual, problem.quant)
        choice = self._choices.get(key)
        if choice is not None:
            return choice
        if self.requested == "auto" and self.table is None:
            warn_once(
                f"no-table:{self.table_note}",
                f"Communicator: {self.table_note}; using the conservative default "
                f"({' then '.join(CONSERVATIVE_DEFAULT)}, first admitted). Measure this machine with "
                f"`tpfuse tune --world-size {self.world_size} --preset <model>` (or --hidden H).",
            )
        names = [self.requested] if self.requested != "auto" else None
        choice = choose(
            problem,
            admission(problem, self.caps, names),
            requested=self.requested,
            table=self.table,
            is_fused=is_fused,
            requested_by="TPFUSE_STRATEGY" if env.strategy_override() else "strategy=",
        )
        if choice.warning:
            warn_once(f"override:{choice.name}:{problem.op.value}", f"Communicator: {choice.warning}")
        self._choices[key] = choice
        return choice

    def _strategy(self, problem: Problem) -> Strategy:
        name = self._choose(problem).name
        instance = self._instances.get(name)
        if instance is None:
            ctx = StrategyContext(
                group=self.group,
                rank=self.rank,
                world_size=self.world_size,
                facts=self.facts,
                caps=self.caps,
                device=self.device,
                options=dict(self.options),
            )
            instance = self._instances[name] = get_strategy(name)(ctx)
        return instance

    def _check_ranks_agree(self, op: Op, rows: torch.Tensor) -> None:
        if self._closed:  # before any collective: the group may be gone
            raise RuntimeError("Communicator: used after close(); create a new Communicator")
        host = self._debug_guard.host_group
        if host is None:  # one rank: nobody to disagree with
            return
        # A fixed-size integer gather on the private gloo group, waited on within its bound.
        ops = list(Op)
        mine = torch.tensor([ops.index(op), rows.shape[0], rows.shape[1], SUPPORTED_DTYPES.index(rows.dtype)],
                            dtype=torch.int64)
        everyone = [torch.empty_like(mine) for _ in range(self.world_size)]
        request = host.pg.allgather([everyone], [mine])
        self._debug_guard.wait([request], f"the other ranks (debug check before {op.value})")
        calls = [tuple(t.tolist()) for t in everyone]
        if any(c != calls[0] for c in calls):
            table = "; ".join(f"rank {r}: {ops[c[0]].value} ({c[1]}, {c[2]}) {SUPPORTED_DTYPES[c[3]]}"
                              for r, c in enumerate(calls))
            raise ValueError(f"{op.value}: ranks disagree on the call ({table}); "
                             "every rank must pass the same shape and dtype")


class _Route(NamedTuple):
    """What a call of one (op, shape, dtype, residual, quantized-output format) needs, made once:
    its problem, the strategy's choice and what of the strategy instance to call (a bound op, or
    the instance's route for that shape: `Strategy.fused_route`)."""

    problem: Problem
    choice: Choice | None
    call: Callable | None


def _unknown_options(unknown: list[str]) -> str:
    guesses = [f"{name!r} (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(name, OPTIONS, 1))
               else repr(name) for name in unknown]
    return (f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(guesses)}; the options are "
            f"{', '.join(OPTIONS)} (tpfuse.api.OPTIONS says what each sets)")


def _device_type(device, group) -> tuple[str, str]:
    """(device type, problem or "") of the `device` argument; the group's default when None."""
    if device is None:
        return device_type_of(group), ""
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError, ValueError):
        return str(device), (f"device {device!r} is not a torch device; pass device='cuda' (the current GPU) or "
                             "device='cpu'")
    if kind not in ("cpu", "cuda"):
        return kind, f"device {device!r} is not supported; pass device='cuda' (the current GPU) or device='cpu'"
    return kind, ""


def _shaped(result, shape, kind: str):
    """A QuantOutput of (M, H) rows given the leading dimensions of `shape` (per-token scales
    too; the other scales keep their 2-D layouts)."""
    lead = tuple(shape[:-1])
    out = result.out.view(*lead, result.out.shape[-1])
    scale = result.scale.view(*lead, 1) if kind == "fp8_per_token" else result.scale
    normed = None if result.normed is None else result.normed.view(shape)
    return type(result)(out, scale, result.residual.view(shape), normed)
