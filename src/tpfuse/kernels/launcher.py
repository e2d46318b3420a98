"""Pre-bound Triton launches: one compiled variant of a `@triton.jit` kernel, launched again and
again without Triton's per-call argument specialisation.

`kernel[grid](*args, **meta)` does, on every call, what a caller that launches one shape over and
over already knows: it specialises every argument (a tensor's dtype and 16-byte alignment, an
integer's value class), builds a cache key from them and the options, looks the compiled variant
up, checks the kernel's globals, builds launch metadata, and only then calls the compiled
variant's C launcher. `bind` makes that ordinary call once (it compiles the variant, or finds it in
Triton's cache, exactly as Triton would) and returns a `PreboundLaunch` that holds the compiled
kernel's launcher, function handle and packed metadata, and calls the launcher directly.

    launch = bind(kernel, grid, args, meta, launch=True)   # the ordinary launch, once per shape
    launch(*args)                                          # later calls: the same variant, directly

Contract. A `PreboundLaunch` serves calls whose arguments Triton would specialise as it did those
of the binding call. It checks, per call and cheaply, what varies between calls of one shape:
every tensor argument (also inside tuple arguments) is 16-byte aligned as at binding, the current
CUDA device is the binding one, and no launch hook (a profiler's
`triton.knobs.runtime.launch_enter_hook`) is set; a call that fails a check takes the ordinary
`kernel[grid]` launch, which picks the right variant. The caller keys its cache by everything else
that selects a variant: the grid, the constexpr and option values (`meta`, bound here), the dtype
of each tensor argument, whether a pointer argument is None, and the value class of each integer
argument that Triton specialises (1, a multiple of 16, 32- or 64-bit; `do_not_specialize`
arguments only by 32- or 64-bit). `check(*args)` raises if a call would specialise otherwise
(tests use it). The positional arguments of a call are the leading parameters of the kernel;
the remaining ones (constexprs, defaults) are bound from `meta` at binding.

The launch itself is Triton's: the same compiled kernel, the same C launcher, the caller's current
stream (so CUDA-graph capture records it like any launch). In the Triton interpreter
(TRITON_INTERPRET=1) there is no compiled kernel and every call is the ordinary launch.

`StubbedLaunches` replaces compilation and the C launcher (and the active driver) by a recording
no-op, so the host path of any call, Triton's own specialisation included, runs and can be timed
on a machine without a GPU (benchmarks/bench_host_path.py --stub, and the tests of this module).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import triton
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

# Triton specialises a pointer on its divisibility by 16 bytes (the "D" attribute of its signature):
# a variant compiled for aligned pointers issues 128-bit accesses.
ALIGNMENT = 16


def _hook_set(hook) -> bool:
    """True for a launch hook that would run: a callable, or a non-empty HookChain (Triton >= 3.5
    keeps an empty HookChain where earlier versions keep None)."""
    return hook is not None and bool(getattr(hook, "calls", True))


class PreboundLaunch:
    """One compiled variant of `kernel` for one grid and `meta`; call it with the kernel's leading
    positional arguments. See the module docstring for what a call must share with the binding one."""

    __slots__ = ("kernel", "grid", "meta", "_run", "_function", "_packed", "_tail", "_tensors", "_tuples",
                 "_device", "_current_device", "_stream", "_runtime", "_binding_spec")

    def __init__(self, kernel, grid: Sequence[int], meta: dict, args: tuple, compiled) -> None:
        self.kernel, self.grid, self.meta = kernel, tuple(grid), dict(meta)
        self._run = None  # None: every call takes the ordinary launch
        self._binding_spec = None
        if compiled is None or not isinstance(kernel, JITFunction) or getattr(kernel, "pre_run_hooks", None):
            return
        if hasattr(compiled, "result"):  # a future of Triton's asynchronous compile mode
            compiled = compiled.result()
        try:
            run, function, packed = compiled.run, compiled.function, compiled.packed_metadata
        except AttributeError:  # a Triton whose compiled kernels keep these elsewhere: stay ordinary
            return
        full = _bound_arguments(kernel, args, meta)
        self._tail = full[len(args):]
        self._tensors = tuple(i for i, a in enumerate(args) if hasattr(a, "data_ptr"))
        self._tuples = tuple(i for i, a in enumerate(args) if isinstance(a, tuple)
                             and any(hasattr(t, "data_ptr") for t in a))
        if _pointer_bits(args, self._tensors, self._tuples) % ALIGNMENT:
            return  # bound for unaligned pointers: rare; such calls keep Triton's own path
        self._current_device = driver.active.get_current_device
        self._stream = driver.active.get_current_stream
        self._device = self._current_device()
        self._runtime = triton.knobs.runtime
        self._function, self._packed = function, packed
        self._run = run

    @property
    def prebound(self) -> bool:
        """True when calls go to the compiled kernel's launcher directly (False in the interpreter,
        or when the binding call's pointers were unaligned)."""
        return self._run is not None

    def __call__(self, *args) -> None:
        run = self._run
        if run is None:
            self.kernel[self.grid](*args, **self.meta)
            return
        rt = self._runtime
        device = self._device
        if (_pointer_bits(args, self._tensors, self._tuples) % ALIGNMENT or self._current_device() != device
                or _hook_set(rt.launch_enter_hook) or _hook_set(rt.launch_exit_hook)):
            self.kernel[self.grid](*args, **self.meta)
            return
        grid = self.grid
        run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, self._stream(device),
            self._function, self._packed, None, None, None, *args, *self._tail)

    def check(self, *args) -> None:
        """Raise ValueError if Triton would specialise `args` (with the bound meta) otherwise than
        the binding call, i.e. if this launch must not serve them; passes in the interpreter."""
        if self._run is None:
            return
        spec = _specialisation(self.kernel, args, self.meta)
        if spec != self._binding_spec:
            raise ValueError(f"PreboundLaunch.check: {self.kernel.__name__} arguments specialise as {spec}, the "
                             f"bound variant as {self._binding_spec}; key the launch cache by what differs")


def bind(kernel, grid: Sequence[int], args: tuple, meta: dict, *, launch: bool) -> PreboundLaunch:
    """A `PreboundLaunch` of `kernel` for `grid` and `meta`, from one ordinary Triton call with
    `args`: a launch when `launch`, else a compile without launching (`kernel.warmup`)."""
    grid = tuple(grid)
    if not isinstance(kernel, JITFunction):  # the interpreter's InterpretedFunction
        if launch:
            kernel[grid](*args, **meta)
        return PreboundLaunch(kernel, grid, meta, args, None)
    if launch:
        compiled = kernel.run(*args, grid=grid, warmup=False, **meta)
    else:
        compiled = kernel.warmup(*args, grid=grid, **meta)
    prebound = PreboundLaunch(kernel, grid, meta, args, compiled)
    if prebound.prebound:
        prebound._binding_spec = _specialisation(kernel, args, meta)
    return prebound


def _pointer_bits(args: tuple, tensors: tuple, tuples: tuple) -> int:
    bits = 0
    for i in tensors:
        bits |= args[i].data_ptr()
    for i in tuples:
        for t in args[i]:
            if hasattr(t, "data_ptr"):  # tuples may mix tensors and scalars
                bits |= t.data_ptr()
    return bits


def _bound_arguments(kernel, args: tuple, meta: dict) -> tuple:
    """Every parameter's value in signature order, as Triton passes them to its launcher."""
    signature = inspect.signature(kernel.fn)
    bound = signature.bind(*args, **{k: v for k, v in meta.items() if k in signature.parameters})
    bound.apply_defaults()
    return tuple(bound.arguments.values())


def _specialisation(kernel, args: tuple, meta: dict) -> list:
    """Triton's own specialisation of a call (its binder's output), for `check`."""
    binder: Callable = kernel.device_caches[driver.active.get_current_device()][-1]
    options = {"debug": kernel.debug or triton.knobs.runtime.debug, **meta}
    return [tuple(s) if isinstance(s, list) else s for s in binder(*args, **options)[1]]


class StubbedLaunches:
    """Context manager: Triton "compiles" every kernel to a stub whose launcher records its
    arguments (`calls`, at most `keep` of them; `launches` counts all) instead of launching, and a
    stub driver answers for device `device` (0; tests change it) and stream `STREAM`. Triton's own
    call path (binder, cache key and hit, launch metadata) runs unchanged. For a process without a
    GPU: on exit the stubbed kernels forget their caches for the stub's devices, real compiled
    variants there included."""

    STREAM = 0x5157  # any non-zero handle: what the stub driver reports as the current stream
    FUNCTION = 0xF0  # the stub function handle
    METADATA = (4, 1, 0)  # stands in for (num_warps, num_ctas, shared memory)

    def __init__(self, *, keep: int = 0) -> None:
        self.keep, self.launches, self.calls, self.device = keep, 0, [], 0

    def __enter__(self) -> StubbedLaunches:
        from triton.backends.compiler import GPUTarget

        stub = self

        class _Compiled:
            function, packed_metadata = stub.FUNCTION, stub.METADATA

            @staticmethod
            def run(*args) -> None:
                stub.launches += 1
                if len(stub.calls) < stub.keep:
                    stub.calls.append(args)

            @staticmethod
            def launch_metadata(grid, stream, *args):
                return None

        class _Driver:
            @staticmethod
            def get_current_device() -> int:
                return stub.device

            @staticmethod
            def get_current_stream(device) -> int:
                return stub.STREAM

            @staticmethod
            def get_current_target():
                return GPUTarget("cuda", 90, 32)  # any target whose backend Triton ships: nothing is compiled

        compiled, self._stubbed = _Compiled(), set()

        def do_compile(fn, key, signature, device, *args, **kwargs):
            fn.device_caches[device][0][key] = compiled  # Triton's kernel cache: later calls hit it
            self._stubbed.add((fn, device))
            return compiled

        self._saved_compile = JITFunction._do_compile
        self._saved_driver = driver._active
        driver.set_active(_Driver())
        JITFunction._do_compile = do_compile
        return self

    def __exit__(self, *exc) -> None:
        JITFunction._do_compile = self._saved_compile
        driver._active = self._saved_driver
        for fn, device in self._stubbed:
            fn.device_caches.pop(device, None)
