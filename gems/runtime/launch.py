"""Low-overhead kernel launch: a cache of compiled kernels keyed only by what changes the binary.

Triton's `JITFunction.run` binds arguments, specializes every one of them, hashes options, checks
globals and builds launch metadata on every call: 10-20 us of host time. For an eager op library that
is the whole budget. `LaunchCache` keeps, per kernel, a dict from a *binary key* to the compiled
kernel, and on a hit calls the compiled launcher directly.

The binary key holds exactly what Triton specializes on: tensor dtype and 16-byte alignment, for ints
whether they equal 1, are divisible by 16 and need 64 bits; float/bool/None types; constexpr values;
and the launch options (num_warps, num_stages). Sizes do not appear, so one binary serves all shapes
of a class. A miss goes through Triton's own `run` (which compiles, or finds the binary on disk) and
records the kernel it returns; its time counts towards runtime/progress.py's one-line note (in
gems.warmup's collect mode, runtime/collect.py records the compile instead; with GEMS_COMPILE=background
runtime/background.py compiles it on a thread pool while ATen answers the call). The cache is bounded
(LRU-ish: oldest entry dropped).

Under the interpreter (TRITON_INTERPRET=1) there is no binary: calls go straight to the interpreter.
"""
from __future__ import annotations

import torch
import triton

from . import background, collect, launcher_build, progress, tritonkey
from .plan import recording
from .plan.launchers import hooks_active
from .source import compile_source

_Tensor = torch.Tensor
try:
    from triton.tools.tensor_descriptor import TensorDescriptor as _TensorDescriptor
except ImportError:  # pragma: no cover - a Triton without host tensor descriptors
    _TensorDescriptor = None
try:   # Gluon's host descriptor also carries its shared-memory layout, which the binary depends on
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as _GluonDescriptor
except ImportError:  # pragma: no cover - a Triton without Gluon
    _GluonDescriptor = None
_MAX_ENTRIES = 256  # binaries per kernel; a kernel with more variants than this is a design bug


def _int_key(v: int):
    # mirrors Triton's integer specialization: ==1 becomes a constant, %16 enables vectorization,
    # the range picks i32/i64/u64
    if v == 1:
        return 1
    return (v & 15 == 0, -0x80000000 <= v <= 0x7FFFFFFF, v < 0x8000000000000000)


def binary_key(args, constexpr_pos=()) -> tuple:
    """The part of a launch that selects a binary. Constexpr positions key by value."""
    key = []
    app = key.append
    for i, a in enumerate(args):
        if i in constexpr_pos:
            app(a)
        elif isinstance(a, _Tensor):
            app(a.dtype)
            app(a.data_ptr() & 15 == 0)
        elif a.__class__ is int:
            app(_int_key(a))
        elif a.__class__ is bool or a is None or a.__class__ is float:
            app(a.__class__)
        elif a.__class__ is _TensorDescriptor:
            # Triton specializes a host descriptor on its dtype and block shape (tensordesc<bf16[128, 64]>)
            app((a.base.dtype, tuple(a.block_shape), a.padding))
        elif a.__class__ is _GluonDescriptor:
            app((a.base.dtype, tuple(a.block_shape), a.padding, a.layout))
        else:  # dtypes, strings, ... can only be constexprs; key by value
            app(a)
    return tuple(key)


def _make_key_fn(nargs: int, constexpr_pos):
    """A key function unrolled for one kernel's parameter list: ~0.1 us per argument.

    Each position tests the common type inline (Tensor for pointers, int for sizes) and defers to
    the generic `binary_key` logic otherwise, so the key is the same as `binary_key(args, pos)`.
    """
    parts = []
    for i in range(nargs):
        a = f"a{i}"
        if i in constexpr_pos:
            parts.append(a)
        else:
            parts.append(f"(({a}.dtype, {a}.data_ptr() & 15 == 0) if {a}.__class__ is T else "
                         f"(({a} == 1) or ({a} & 15 == 0, -0x80000000 <= {a} <= 0x7FFFFFFF, {a} < 0x8000000000000000)) "
                         f"if {a}.__class__ is int else one({a}))")
    names = ", ".join(f"a{i}" for i in range(nargs))
    src = f"def key({names}{',' if nargs == 1 else ''}):\n    return ({', '.join(parts)}{',' if nargs == 1 else ''})\n"
    ns = {"T": _Tensor, "one": lambda a: binary_key((a,))}
    return compile_source(src, f"<gems launch key, {nargs} args>", ns)["key"]


class LaunchCache:
    """Wraps a `@triton.jit` function. `k[grid](*args, num_warps=..)` launches it.

    Pass every argument positionally in the kernel's parameter order (constexprs included): the hot
    path then needs no binding.
    """

    __slots__ = ("fn", "name", "interpreted", "_cache", "_constexpr_pos", "_key", "hits", "misses")

    def __init__(self, fn):
        self.fn = fn
        self.name = getattr(fn, "__name__", None) or fn.fn.__name__
        self.interpreted = not hasattr(fn, "device_caches")
        self._cache: dict = {}
        params = getattr(fn, "params", [])
        self._constexpr_pos = frozenset(p.num for p in params if p.is_constexpr)
        self._key = None if self.interpreted else _make_key_fn(len(params), self._constexpr_pos)
        self.hits = self.misses = 0

    def __getitem__(self, grid):
        return lambda *args, num_warps=4, num_stages=3, maxnreg=None, first=False: self.run(
            grid, args, num_warps, num_stages, maxnreg, first)

    def run(self, grid, args, num_warps=4, num_stages=3, maxnreg=None, first=False):
        """`maxnreg`: the per-thread register cap (warp-specialized Gluon kernels rebalance registers
        between partitions under it); part of the binary's key. `first`: the caller's promise that this
        launch is its call's first write (nothing the call writes has been written yet), so that a miss
        in an in-place or out= call may be answered by ATen while it compiles (runtime/background.py)."""
        rec = recording.active()
        if rec is not None:
            return self._run_recorded(rec, grid, args, num_warps, num_stages, maxnreg, first)
        if self.interpreted:
            return self.fn[grid](*args, num_warps=num_warps, num_stages=num_stages)
        dev = _get_device()
        key = (dev, num_warps, num_stages, maxnreg, self._key(*args))
        entry = self._cache.get(key)
        if entry is None:
            self.misses += 1
            # every compile and disk load starts from Triton's key, hashing on a thread since Gems was
            # switched on: wait for it (runtime/tritonkey.py says why a deferred miss waits too)
            tritonkey.wait()
            if collect.active():    # gems.warmup's collecting run: record the compile, ATen answers
                kernel = collect.launch(self.fn, grid, args, num_warps, num_stages, maxnreg)
            elif background.deferring(first):    # GEMS_COMPILE=background: compile on the pool, ATen answers
                kernel = background.launch(self.fn, grid, args, num_warps, num_stages, maxnreg)
            else:
                t0 = progress.clock()
                # (Triton's options treat maxnreg=None as unset: the binary of a launch without a cap); a
                # compile builds the kernel's C launcher beside it, not after it (launcher_build.py)
                with launcher_build.building_ahead():
                    kernel = self.fn[grid](*args, num_warps=num_warps, num_stages=num_stages, maxnreg=maxnreg)
                progress.compiled(self.name, progress.clock() - t0)    # one line if first runs stall
            if len(self._cache) >= _MAX_ENTRIES:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = _entry(kernel)
            return kernel
        self.hits += 1
        n = len(grid)
        g0, g1, g2 = grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1
        kernel, launch, function, coop, pdl, meta = entry
        stream = _get_stream(dev)
        if launch is not None and not hooks_active():
            # the C launcher itself: CudaLauncher.__call__ only adds scratch allocation, and this
            # kernel needs none
            # (grid, stream, function, cooperative, pdl, global/profile scratch, packed metadata,
            # launch metadata, enter hook, exit hook, kernel args): the C signature Triton 3.6 generates
            launch(g0, g1, g2, stream, function, coop, pdl, None, None, meta, None, None, None, *args)
        else:  # no direct launcher, or a profiler listens: give the hooks what Triton would
            rt = _knobs_runtime
            enter, leave = rt.launch_enter_hook, rt.launch_exit_hook
            if not getattr(enter, "calls", enter):
                kernel.run(g0, g1, g2, stream, kernel.function, kernel.packed_metadata, None, None, leave, *args)
            else:
                kernel.run(g0, g1, g2, stream, kernel.function, kernel.packed_metadata,
                           kernel.launch_metadata(grid, stream, *args), enter, leave, *args)
        return kernel

    def ahead(self, args, num_warps=4, num_stages=3, maxnreg=None):
        """In a call background compilation may defer, queue this launch's compile now if it is not
        compiled; launch nothing. Elsewhere (but in collect mode) a no-op.

        For an op whose kernels run one after another, each reading what the last one wrote
        (embedding's backward: sort, run bounds, chunk sums, rows): a deferred call stops at its first
        uncompiled kernel, so each later kernel would be met, and queued, only a step after the one
        before it compiled, and a short first run would leave the last of them to be compiled by the
        next process. Called for each of them before the first launch, it queues them all at once (in
        gems.warmup's collecting run: records them, one round instead of one per kernel)."""
        if self.interpreted:
            return
        collecting = collect.active()
        if not collecting and not background.deferring():
            return
        if self.entry(args, num_warps, num_stages, maxnreg) is not None:
            return
        tritonkey.wait()
        if collecting:
            collect.ahead(self.fn, args, num_warps, num_stages, maxnreg)
        else:
            background.ahead(self.fn, args, num_warps, num_stages, maxnreg)

    def _run_recorded(self, rec, grid, args, num_warps, num_stages, maxnreg=None, first=False):
        """A launch while a call plan is recorded: run it (the interpreter's own storage copies are
        not the op's and must not taint the recording), then note it with its binary (a register
        cap is compiled into the binary: a replay launches that function and needs nothing more)."""
        with recording.quiet():
            if self.interpreted:
                out = self.fn[grid](*args, num_warps=num_warps, num_stages=num_stages)
                entry = None
            else:
                with recording.suspended():     # the plain path, without recording itself again
                    out = self.run(grid, args, num_warps, num_stages, maxnreg, first)
                entry = self.entry(args, num_warps, num_stages, maxnreg)
        rec.launch(self, entry, grid, args, num_warps, num_stages, maxnreg)
        return out

    def entry(self, args, num_warps=4, num_stages=3, maxnreg=None):
        """The cached (kernel, launcher, function, cooperative, pdl, metadata) of a launch that has
        run with these arguments on the current device, or None (the interpreter, not run yet)."""
        if self.interpreted:
            return None
        return self._cache.get((_get_device(), num_warps, num_stages, maxnreg, self._key(*args)))

    def cache_info(self) -> dict:
        return {"entries": len(self._cache), "hits": self.hits, "misses": self.misses}


def _direct(launch) -> bool:
    """Whether `launch` takes the C signature Triton 3.6 generates: the C launcher itself, or, for a
    kernel with tensor-descriptor parameters, the closure Triton wraps it in
    (driver.wrap_handle_tensordesc), which takes the same leading arguments and encodes each host
    descriptor before calling it."""
    if type(launch).__name__ == "builtin_function_or_method":
        return True
    return getattr(launch, "__qualname__", "") == "wrap_handle_tensordesc.<locals>.inner"


def _entry(kernel):
    """(kernel, C launcher or None, function, cooperative, pdl, packed metadata).

    The C launcher is called directly only when the kernel needs no scratch memory (what
    CudaLauncher.__call__ would allocate) and has the launcher signature `_direct` knows."""
    run = getattr(kernel, "run", None)
    launch = getattr(run, "launch", None)
    direct = (launch is not None and _direct(launch)
              and not getattr(run, "global_scratch_size", 1) and not getattr(run, "profile_scratch_size", 1))
    if not direct:
        return kernel, None, None, False, False, None
    return kernel, launch, kernel.function, run.launch_cooperative_grid, run.launch_pdl, kernel.packed_metadata


_knobs_runtime = triton.knobs.runtime
_get_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_get_device = getattr(torch._C, "_cuda_getDevice", None)


def kernel(fn) -> LaunchCache:
    """Decorator: `@kernel` over `@triton.jit` gives a kernel with the cached launch path."""
    return LaunchCache(fn)
