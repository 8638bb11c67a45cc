"""Registration: Gems' kernels at the backend key, with torch.library, and the C++ fast path on top.

Registration happens once (the first `enable()` or `use_gems()`), so entering a scope only swaps a
thread-local pointer. `disable()` with no scope active anywhere removes the registrations, which
restores ATen exactly, with no overhead left behind.
"""
from __future__ import annotations

import warnings

import torch

from .. import registry
from ..runtime import backends, settings
from ..runtime import fast as fastpath
from .kernel import make_kernel
from .state import DispatchState


def ensure_registered(state: DispatchState):
    """Register Gems' kernels at the backend key (once)."""
    if state.lib is not None:
        return   # the common case on every use_gems() entry
    with state.lock:
        if state.lib is not None:
            return
        be = backends.backend()
        fast = _load_fast_path(state, be)
        keyset = torch._C.DispatchKeySet(be.dispatch_key)
        lib = torch.library.Library("aten", "IMPL")
        fast_ops = []
        with warnings.catch_warnings():
            # torch warns on every override of an existing kernel: that is the point here
            warnings.simplefilter("ignore")
            for impl in registry.all_impls(be.name):
                op = state.op(impl.name)
                # the dispatcher spells the default overload without a suffix
                schema_name = impl.name[:-8] if impl.name.endswith(".default") else impl.name
                orig = torch.library.get_kernel(f"aten::{schema_name}", be.dispatch_key)
                if fast is not None and (impl.plan or impl.foreach) and op.fast is None:
                    op.fast = _new_fast_op(state, impl)
                    if impl.foreach:
                        _set_foreach(impl, op, be)
                if op.fast is not None:
                    # ATen's kernel as it is now, before Gems' goes on top: replays of recorded
                    # ATen decisions call it from C++
                    op.fast.capture_aten(be.dispatch_key)
                k = make_kernel(state, impl, op, orig, keyset, be)
                lib.impl(schema_name, k, be.dispatch_key)
                if fast is not None and (k.__gems_planned__ or impl.foreach):
                    op.fast.set_kernel(k)
                    fast_ops.append((schema_name, op.fast))
            if fast_ops:
                # on top of the Python kernels, which it calls on a miss; unregistering it restores them
                fast.register(be.dispatch_key, fast_ops)
        _forget_python_dispatch(be)
        state.lib = lib


def _load_fast_path(state: DispatchState, be):
    """The C++ fast path's module (loaded on the first registration when call plans are on), or None."""
    fast = state.fast
    if fast is None and settings.PLANS:
        fast = state.fast = fastpath.load()
        if fast is not None:
            fast.set_check(settings.PLAN_CHECK > 0)
            if be.device_type == "cuda":
                dev = torch.cuda.current_device()
                fastpath.note_stream_mode(fast.init_stream(dev, torch._C._cuda_getCurrentRawStream(dev)))
    if fast is not None:
        # nothing of Gems is registered here now: ATen's copy_, for the C++ foreach tables' uploads
        fast.capture_copy(be.dispatch_key)
    return fast


def _new_fast_op(state: DispatchState, impl):
    fast = state.fast
    schema = registry.aten_overload(impl.name)._schema
    dyn = [a.name in impl.dynamic for a in schema.arguments]
    op = fast.Op(impl.name, None, dyn, impl.plan_key is not None)
    for cfg, i in state.cfg_ids.items():
        if i < fast.MAX_CONFIGS:
            op.set_member(i, impl.name in cfg)
    return op


def _set_foreach(impl, op, be):
    """Tell the C++ op of a _foreach_* overload how to serve it whole: its spec (`register(foreach=...)`),
    the dtypes the backend serves, each with the numbers that fit it."""
    spec = impl.foreach
    unserved = backends.unserved_dtypes(be)
    limits = spec["limits"]
    dtypes = [(d, *limits[d]) for d in impl.dtypes if d not in unserved and d in limits]
    op.fast.set_foreach(list(spec["lists"]), spec.get("scalar", -1), spec.get("skind", 0), spec.get("alpha", -1),
                        impl.name.split(".")[0].endswith("_"), settings.POISON, dtypes)


def unregister_if_idle(state: DispatchState):
    """Remove the registrations when nothing selects Gems anywhere (ATen exactly as before)."""
    with state.lock:
        if state.lib is not None and state.global_cfg is None and not state.scopes:
            if state.fast is not None:
                state.fast.unregister()
            state.lib._destroy()
            state.lib = None
            _forget_python_dispatch(backends.backend())


def _forget_python_dispatch(be):
    """Drop what torch's Python dispatcher cached about the overloads Gems registers. It caches, per
    overload and key, the key whose kernel serves it (resolved once: "CPU" while Gems has a kernel there,
    for ops ATen serves from a composite key), and replays it with no check: after Gems' kernels are
    removed, a stale entry calls the empty kernel slot (a segfault in torch.compile / FakeTensor tracing,
    which run under the Python dispatcher). torch.library's own unregistration does not clear it."""
    for impl in registry.all_impls(be.name):
        cache = getattr(registry.aten_overload(impl.name), "_dispatch_cache", None)
        if cache:
            cache.clear()


def registered_ops() -> list[str]:
    """Sorted ATen overload names Gems implements on the active backend."""
    return [i.name for i in registry.all_impls(backends.backend().name)]
