"""Dispatch: put registry implementations behind ATen's dispatcher, switch them on and off cheaply.

How a call flows: the dispatcher reaches the backend key (CUDA, or CPU under the interpreter) where
Gems registered one small Python kernel per overload. That kernel

1. goes straight to ATen's original kernel when Gems is off for this thread/op, or when it is entered
   from inside a Gems implementation (the interpreter copies CPU storages with ops Gems may override;
   this guard is what keeps it from recursing into itself);
2. checks the declared support (first tensor's dtype, strided layout, device; a dtype the backend
   cannot compute exactly anywhere in the call, bf16 on the interpreter; a call with no tensor at all)
   and the op's own check; anything unsupported runs ATen's original kernel and is counted in
   `stats()` with its reason;
3. calls the implementation. If the implementation raises, ATen runs the same call: when ATen raises
   too, ATen's exception propagates (same type and message users would get without Gems); when ATen
   succeeds, Gems had a bug: the ATen result is returned, the error is counted and warned about with
   the op and the call's signature, and that signature (dtypes, shapes, strides, argument kinds) goes
   to ATen from then on, while other calls of the op are still served; an overload failing for
   MAX_BROKEN_SIGNATURES distinct signatures is switched off (`GEMS_STRICT=1` re-raises instead,
   which the test suite uses).

Registration happens once (first `enable()` or `use_gems()`), so entering a scope only swaps a
thread-local pointer. `disable()` with no scope active anywhere removes the registrations, which
restores ATen exactly, with no overhead left behind.
"""
from __future__ import annotations

import threading
import warnings
from typing import Iterable, Optional

import torch

from . import registry
from .codegen.numbers import call_with_numbers, tensor_positions
from .registry import AtenError, Unsupported
from .runtime import backends as _backends
from .runtime import fast as _fastmod
from .runtime import reentry
from .runtime.plan import build as plan_build
from .runtime.plan import cache as plan_cache
from .runtime.plan.signature import make_signature, named_args
from .runtime import settings
from .runtime.backends import backend

_Tensor = torch.Tensor
_strided = torch.strided
# ATen hands a Python kernel wrapped-number tensors (`x * 2.0`) as Python numbers; every path back to
# ATen's original kernel turns them into equivalent 0-dim tensors first (see gems.codegen.numbers).


class _ThreadState(threading.local):
    scoped = False     # this thread is inside use_gems()
    cfg = None         # its active op set (frozenset) while scoped


_TLS = _ThreadState()
_LOCK = threading.RLock()
_lib = None                      # torch.library.Library holding our registrations, or None
_global_cfg = None               # op set of enable(), or None
_scopes: list = []               # active use_gems scopes in all threads, innermost last
_cfg_cache: dict = {}
# the C++ fast path (runtime/fast.py, csrc/fastpath.cpp): its module once loaded, or None. It mirrors
# the state above: config ids stand for op sets, and every state change below is told to it.
_fast = None
_cfg_ids: dict = {}              # op set -> config id


def _cfg_id(cfg) -> int:
    """The C++ side's id of an op set (its ops' membership is set there when the id is made)."""
    i = _cfg_ids.get(cfg)
    if i is None:
        i = len(_cfg_ids)
        _cfg_ids[cfg] = i
        if _fast is not None and i < _fast.MAX_CONFIGS:
            for impl in registry.all_impls():
                if impl.fast is not None:
                    impl.fast.set_member(i, impl.name in cfg)
    return i if _fast is None or i < _fast.MAX_CONFIGS else -1


def _fast_sync_scopes():
    if _fast is not None:
        _fast.set_top_scope(_cfg_id(_scopes[-1].cfg) if _scopes else -1)


def _graph_task_active() -> bool:
    return torch._C._current_graph_task_id() != -1


def _config_for_unscoped_thread():
    cfg = _global_cfg
    if cfg is None and _scopes and _graph_task_active():
        # Autograd runs CUDA backward work on its own device threads, which never entered the scope
        # of the thread that called backward(); they follow the innermost active scope.
        cfg = _scopes[-1].cfg
    return cfg


def _make_kernel(impl: registry.OpImpl, orig, keyset, be):
    name = impl.name
    counts, reasons = impl.counts, impl.reasons
    # dtypes the backend cannot compute exactly (bf16 on the interpreter) go to ATen whatever the op says
    unserved = _backends.unserved_dtypes(be)
    dtypes = frozenset(impl.dtypes) - frozenset(unserved)
    scan_unserved = _unserved_scanner(unserved) if unserved else None
    check = impl.check
    call_orig = _boxed_with_numbers(impl.name, orig.call_boxed)
    on_cuda = be.device_type == "cuda"
    tls = _TLS
    guard = reentry.THREAD
    get_device = torch._C._cuda_getDevice if on_cuda else None
    schema = registry._aten_overload(name)._schema
    # ATen calls some ops on a wrapped number alone (`_to_copy(2)`): with no tensor there is nothing to
    # launch on, so such a call goes to ATen
    tensor_slots = bool(tensor_positions(schema))
    host_pos = tuple(i for i, a in enumerate(schema.arguments) if a.name in impl.host_args)
    broken = impl.broken
    sig = make_signature(schema, impl.dynamic, on_cuda) if impl.plan and settings.PLANS else None
    # plans outlive a registration: disable() followed by enable() finds them again
    if sig is not None and impl.plans is None:
        impl.plans = plan_cache.PlanCache()
    cache = impl.plans if sig is not None else None
    plans = cache.plans if cache is not None else None
    extra_key = impl.plan_key
    MISS, NO_PLAN, AtenPlan, SEEN = plan_cache.MISS, plan_cache.NO_PLAN, plan_cache.AtenPlan, plan_cache.SEEN
    record_later = settings.PLAN_AFTER > 1
    fast_op = impl.fast if _fast is not None and sig is not None else None
    # under the interpreter a launch copies storages with ops Gems may serve: keep the re-entry
    # guard up while a plan runs there; on CUDA a plan calls nothing Gems serves
    guard_plan = not on_cuda

    def fallback(reason, args, kwargs):
        counts[1] += 1
        reasons[reason] = reasons.get(reason, 0) + 1
        return call_orig(keyset, *args, **kwargs)

    def signature_fallback(reason, key, args, kwargs):
        # a decision the call's signature alone makes (dtypes, devices, layouts and argument kinds are
        # all in the key): recorded like Unsupported(signature=True), so repeat calls go straight to
        # ATen, replayed from C++ on the fast path (a CPU tensor beside CUDA ones, e.g. a mask or
        # position ids made on the host, costs no Python round trip per call)
        if key is not None:
            cache.put(key, AtenPlan(reason))
            if fast_op is not None:
                fast_op.publish_aten(reason)
        return fallback(reason, args, kwargs)

    def kernel(*args, **kwargs):
        if guard.depth:
            return call_orig(keyset, *args, **kwargs)
        cfg = tls.cfg if tls.scoped else _config_for_unscoped_thread()
        if cfg is None or name not in cfg:
            return call_orig(keyset, *args, **kwargs)
        key = None
        unseen = False      # the signature's first call: with GEMS_PLAN_AFTER=2 it records nothing
        if plans is not None:
            # hot path: the call's signature names a plan (a hit means every check below passed
            # for this signature before)
            try:
                key = sig(*args, **kwargs)
                if extra_key is not None:
                    key = (key, extra_key())
            except Exception:  # noqa: BLE001 - e.g. stride() of a sparse tensor: the full path decides
                key = None
            p = plans.get(key)
            if p.__class__ is AtenPlan:
                # a recorded signature-level decision for ATen (Unsupported(signature=True))
                if fast_op is not None:
                    fast_op.publish_aten(p.reason)
                return fallback(p.reason, args, kwargs)
            if p is not None and p is not NO_PLAN and p is not SEEN:
                # (a LazyPlan compiles on its first run here and puts the function in its place)
                if guard_plan:
                    guard.depth += 1
                    try:
                        out = p(*args, **kwargs)
                    finally:
                        guard.depth -= 1
                else:
                    out = p(*args, **kwargs)
                if out is not MISS:
                    counts[0] += 1
                    if fast_op is not None:
                        # the C++ side missed this call (else Python would not run): give it the plan
                        recipe = p.__gems_recipe__
                        if recipe is not None:
                            fast_op.publish(recipe, False)
                    return out
                key = None  # declined (overlapping out=/in-place): the full path, not recorded
            elif p is None:
                unseen = record_later
            elif p is NO_PLAN:
                key = None
            # (SEEN: the signature's second call records)
        # declared support: the first tensor's dtype; every tensor strided, real, on this device
        first = True
        for a in args:
            if isinstance(a, _Tensor):
                if a.layout is not _strided:
                    return fallback(f"layout {a.layout}", args, kwargs)
                if first:
                    first = False
                    if a.dtype not in dtypes:
                        return signature_fallback(unserved.get(a.dtype) or f"dtype {a.dtype}", key, args, kwargs)
                    if on_cuda and a.is_cuda and a.get_device() != get_device():
                        return signature_fallback("tensor on a non-current device", key, args, kwargs)
                elif a.is_complex():
                    return signature_fallback("complex", key, args, kwargs)
                if on_cuda and not a.is_cuda and a.dim() != 0 and not any(
                        i < len(args) and args[i] is a for i in host_pos):
                    return signature_fallback("cpu tensor argument", key, args, kwargs)
        if first and tensor_slots:
            return signature_fallback("Python number as the only tensor argument", key, args, kwargs)
        if scan_unserved is not None:
            reason = scan_unserved(args, kwargs)
            if reason is not None:
                return signature_fallback(reason, key, args, kwargs)
        if broken:
            bad = broken.get(_call_signature(args, kwargs))
            if bad is not None:
                return fallback(bad, args, kwargs)
        if check is not None:
            reason = check(*args, **kwargs)
            if reason is not None:
                return fallback(reason, args, kwargs)
        guard.depth += 1
        try:
            if key is not None and not unseen:
                out = _record(impl, cache, key, schema, on_cuda, args, kwargs)
            else:
                out = impl.fn(*args, **kwargs)
                if unseen and key is not None:
                    cache.put_seen(key)
        except AtenError as e:
            guard.depth -= 1
            raise e.error from None
        except Unsupported as e:
            guard.depth -= 1
            reason = str(e) or "unsupported arguments"
            if key is not None:
                if e.signature:
                    cache.put(key, AtenPlan(reason))
                    if fast_op is not None:
                        fast_op.publish_aten(reason)
                else:
                    cache.put(key, None, f"unsupported: {e}")
            return fallback(reason, args, kwargs)
        except Exception as e:  # noqa: BLE001 - see module docstring, step 3
            guard.depth -= 1
            return _after_error(impl, e, call_orig, keyset, args, kwargs)
        except BaseException:
            # KeyboardInterrupt, a test's timeout: the thread's depth must not stay raised (every
            # later call would go to ATen)
            guard.depth -= 1
            raise
        guard.depth -= 1
        counts[0] += 1
        return out

    kernel.__name__ = f"gems_{name.replace('.', '_')}"
    kernel.__gems_planned__ = sig is not None
    return kernel


def _record(impl, cache, key, schema, on_cuda, args, kwargs):
    """First call of a signature: run the implementation under a recording and keep its plan.

    With GEMS_PLAN_CHECK=N (the test suite sets it) the call's answer comes from the new plan instead,
    for an overload's first N plans: written arguments are restored to their values before the call,
    and the plan runs it again, so the op tests also test the plans."""
    fn = impl.fn
    values = named_args(schema, args, kwargs)
    saved = _snapshot(schema, values) if cache.built < settings.PLAN_CHECK else None
    # the plan's answer must draw the random numbers the recorded run drew (plan.philox): the CUDA
    # generators' offsets go back to where they were before the plan runs the call again
    gens = [(g, g.get_offset()) for g in torch.cuda.default_generators] if saved is not None and on_cuda else ()
    # lazy: the C++ fast path replays the recipe; the Python function is compiled if it ever runs
    out, p, rec = plan_build.record(fn, schema, args, kwargs, on_cuda, values, lazy=impl.fast is not None)
    if impl.fn is not fn:   # replaced meanwhile (a test double, a disabled overload): keep nothing
        return out
    if p is not None or not rec.transient:
        cache.put(key, p, rec.tainted)
    recipe = getattr(p, "__gems_recipe__", None)
    if recipe is not None and impl.fast is not None and impl.fast.publish(recipe, saved is not None):
        # the C++ side keeps the plan for this call's key; with GEMS_PLAN_CHECK it answers this very
        # call from it, after the written arguments are restored here
        if saved is not None:
            for t, copy in saved:
                t.copy_(copy)
            for g, off in gens:
                g.set_offset(off)
        return out
    if p is not None and saved is not None:
        for t, copy in saved:
            t.copy_(copy)
        for g, off in gens:
            g.set_offset(off)
        again = p(*args, **kwargs)
        if again is not plan_cache.MISS:
            return again
        for t, copy in saved:   # the plan declined: the recorded run's answer stands
            t.copy_(copy)
        return fn(*args, **kwargs)
    return out


def _snapshot(schema, values):
    """(tensor, copy) of the arguments a call writes (in-place self, out=)."""
    out = []
    for a in schema.arguments:
        v = values.get(a.name)
        if a.alias_info is not None and a.alias_info.is_write and isinstance(v, _Tensor):
            out.append((v, v.clone()))
    return out


def _boxed_with_numbers(name, call_boxed):
    positions = tensor_positions(registry._aten_overload(name)._schema)
    if not positions:
        return call_boxed
    if len(positions) == 1:
        # ATen itself calls e.g. _to_copy on a wrapped number: as the only tensor it keeps the
        # wrapped number's own dtype (double / int64 / bool)
        (p,) = positions

        def call_one(keyset, *args, **kwargs):
            if len(args) > p and args[p].__class__ in _NUMBER_DTYPES:
                args = list(args)
                args[p] = torch.tensor(args[p], dtype=_NUMBER_DTYPES[args[p].__class__])
            return call_boxed(keyset, *args, **kwargs)
        return call_one

    schema = registry._aten_overload(name)._schema
    out_name = next((a.name for a in schema.arguments if a.kwarg_only and a.alias_info is not None
                     and a.alias_info.is_write), None)

    def call(keyset, *args, **kwargs):
        return call_with_numbers(lambda *a, **kw: call_boxed(keyset, *a, **kw), args, positions, kwargs, out_name)
    return call


_NUMBER_DTYPES = {float: torch.float64, int: torch.int64, bool: torch.bool, complex: torch.complex128}


# An implementation that raises where ATen succeeds stops serving that call signature (dtypes, shapes,
# strides, argument kinds) for the rest of the process; other signatures keep being served. After this
# many distinct failing signatures the overload is switched off altogether (a kernel that does not
# compile on this GPU at all would otherwise fail once for every new shape).
MAX_BROKEN_SIGNATURES = 16


def _after_error(impl, exc, call_orig, keyset, args, kwargs):
    try:
        out = call_orig(keyset, *args, **kwargs)
    except Exception as aten_exc:  # noqa: BLE001
        raise aten_exc from None
    if settings.STRICT:
        raise exc
    reason = f"gems error: {type(exc).__name__}"
    impl.counts[1] += 1
    impl.reasons[reason] = impl.reasons.get(reason, 0) + 1
    call = describe_call(impl.name, args, kwargs)
    what = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"
    if len(impl.broken) < MAX_BROKEN_SIGNATURES:
        impl.broken[_call_signature(args, kwargs)] = f"gems error earlier for this signature ({type(exc).__name__})"
        scope = "calls with this signature go to ATen from now on"
    else:
        disabled = f"disabled after {MAX_BROKEN_SIGNATURES} failing signatures"

        def _disabled(*_a, **_k):
            raise Unsupported(disabled)
        impl.set_fn(_disabled)
        scope = f"after {MAX_BROKEN_SIGNATURES} failing signatures ATen serves aten::{impl.name} from now on"
    warnings.warn(f"gems: {call} raised {what}; ATen served the call and {scope} (counted in gems.stats()). "
                  f"Please report this.", RuntimeWarning, stacklevel=3)
    return out


def _call_signature(args, kwargs):
    """What identifies a call for the error policy: per argument its kind, tensors by dtype, shape,
    strides and device, small values by value."""
    return (tuple(_arg_key(a) for a in args), tuple((k, _arg_key(v)) for k, v in sorted(kwargs.items())))


def _arg_key(a):
    if isinstance(a, _Tensor):
        return ("T", a.dtype, tuple(a.shape), a.stride() if a.layout is _strided else None, a.device, a.layout)
    if isinstance(a, (list, tuple)):
        return tuple(_arg_key(v) for v in a)
    if a is None or isinstance(a, (bool, int, float, str, torch.dtype, torch.device, torch.layout,
                                   torch.memory_format)):
        return a if not isinstance(a, float) or a == a else "nan"
    return type(a).__name__


def describe_call(name, args, kwargs) -> str:
    """'aten::add.Tensor(float32[4, 8], float32[8], alpha=2)': an overload and its input signature."""
    def one(a):
        if isinstance(a, _Tensor):
            d = str(a.dtype).replace("torch.", "")
            nc = "" if a.layout is not _strided or a.is_contiguous() else " non-contiguous"
            return f"{d}{list(a.shape)}{nc}" + ("" if a.device.type in ("cpu", "cuda") else f" on {a.device}")
        if isinstance(a, (list, tuple)):
            return "[" + ", ".join(one(v) for v in a) + "]"
        if a is None or isinstance(a, (bool, int, float, str, torch.dtype, torch.memory_format, torch.layout,
                                       torch.device)):
            return str(a)
        return type(a).__name__
    parts = [one(a) for a in args] + [f"{k}={one(v)}" for k, v in kwargs.items()]
    return f"aten::{name}({', '.join(parts)})"


def _unserved_scanner(unserved: dict):
    """A function (args, kwargs) -> reason or None: whether a call involves one of the backend's unserved
    dtypes anywhere (a tensor, a dtype argument, a list of tensors, or the default dtype)."""
    def find(v):
        if isinstance(v, _Tensor):
            return unserved.get(v.dtype)
        if isinstance(v, torch.dtype):
            return unserved.get(v)
        if isinstance(v, (list, tuple)):
            for x in v:
                r = find(x)
                if r is not None:
                    return r
        return None

    def scan(args, kwargs):
        for a in args:
            r = find(a)
            if r is not None:
                return r
        for a in kwargs.values():
            r = find(a)
            if r is not None:
                return r
        # Python floats become the default dtype (int tensor + 1.5)
        return unserved.get(torch.get_default_dtype())
    return scan


def _ensure_registered():
    """Register Gems' kernels at the backend key (once)."""
    global _lib, _fast
    if _lib is not None:
        return   # the common case on every use_gems() entry
    with _LOCK:
        if _lib is not None:
            return
        be = backend()
        if _fast is None and settings.PLANS:
            _fast = _fastmod.load()
            if _fast is not None:
                _fast.set_check(settings.PLAN_CHECK > 0)
                if be.device_type == "cuda":
                    dev = torch.cuda.current_device()
                    _fastmod.note_stream_mode(_fast.init_stream(dev, torch._C._cuda_getCurrentRawStream(dev)))
        if _fast is not None:
            # nothing of Gems is registered here now: ATen's copy_, for the C++ foreach tables' uploads
            _fast.capture_copy(be.dispatch_key)
        keyset = torch._C.DispatchKeySet(be.dispatch_key)
        lib = torch.library.Library("aten", "IMPL")
        fast_ops = []
        with warnings.catch_warnings():
            # torch warns on every override of an existing kernel: that is the point here
            warnings.simplefilter("ignore")
            for impl in registry.all_impls(be.name):
                # the dispatcher spells the default overload without a suffix
                schema_name = impl.name[:-8] if impl.name.endswith(".default") else impl.name
                orig = torch.library.get_kernel(f"aten::{schema_name}", be.dispatch_key)
                if _fast is not None and (impl.plan or impl.foreach) and impl.fast is None:
                    impl.fast = _new_fast_op(impl)
                    if impl.foreach:
                        _set_foreach(impl, be)
                if impl.fast is not None:
                    # ATen's kernel as it is now, before Gems' goes on top: replays of recorded
                    # ATen decisions call it from C++
                    impl.fast.capture_aten(be.dispatch_key)
                k = _make_kernel(impl, orig, keyset, be)
                lib.impl(schema_name, k, be.dispatch_key)
                if _fast is not None and (k.__gems_planned__ or impl.foreach):
                    impl.fast.set_kernel(k)
                    fast_ops.append((schema_name, impl.fast))
            if fast_ops:
                # on top of the Python kernels, which it calls on a miss; unregistering it restores them
                _fast.register(be.dispatch_key, fast_ops)
        _lib = lib


def _new_fast_op(impl):
    schema = registry._aten_overload(impl.name)._schema
    dyn = [a.name in impl.dynamic for a in schema.arguments]
    op = _fast.Op(impl.name, None, dyn, impl.plan_key is not None)
    for cfg, i in _cfg_ids.items():
        if i < _fast.MAX_CONFIGS:
            op.set_member(i, impl.name in cfg)
    return op


def _set_foreach(impl, be):
    """Tell the C++ op of a _foreach_* overload how to serve it whole (fastpath.cpp foreach_serve):
    its spec from ops/foreach/launch.py, the dtypes the backend serves, each with the numbers that fit it."""
    from .codegen.generator import range_limit
    from .ops.foreach.launch import LIMITS
    from .runtime import alloc
    spec = impl.foreach
    unserved = _backends.unserved_dtypes(be)
    dtypes = [(d, range_limit(d), LIMITS[d]) for d in impl.dtypes if d not in unserved and d in LIMITS]
    impl.fast.set_foreach(list(spec["lists"]), spec.get("scalar", -1), spec.get("skind", 0), spec.get("alpha", -1),
                          impl.name.split(".")[0].endswith("_"), alloc.POISON, dtypes)


def _unregister_if_idle():
    global _lib
    with _LOCK:
        if _lib is not None and _global_cfg is None and not _scopes:
            if _fast is not None:
                _fast.unregister()
            _lib._destroy()
            _lib = None


def _config(include, exclude) -> frozenset:
    key = (_names_key(include), _names_key(exclude))
    cfg = _cfg_cache.get(key)
    if cfg is None:
        _backends.check_environment()
        be = backend().name
        if include is not None:
            ops = registry.resolve(include, be, "raise")
        else:
            ops = {i.name for i in registry.all_impls(be)}
        cfg = frozenset(ops - registry.resolve(exclude, be, "warn"))
        _cfg_cache[key] = cfg
    return cfg


def _names_key(names):
    if names is None:
        return None
    return (names,) if isinstance(names, str) else tuple(names)


def enable(include: Optional[Iterable[str]] = None, exclude: Optional[Iterable[str]] = None):
    """Serve every registered ATen overload (or the `include`d ones, minus `exclude`) with Gems.

    A group's name selects all its overloads in `include=` and `exclude=`:
    `enable(exclude=("attention",))` leaves SDPA to ATen. Process-wide; a thread inside `use_gems()`
    follows its scope instead.
    """
    global _global_cfg
    _backends.check_environment()
    cfg = _config(include, exclude)
    _ensure_registered()
    _global_cfg = cfg
    if _fast is not None:
        _fast.set_global(_cfg_id(cfg))


def disable():
    """Stop serving ops outside `use_gems` scopes; with no scope active, restore ATen exactly."""
    global _global_cfg
    _global_cfg = None
    if _fast is not None:
        _fast.set_global(-1)
    _unregister_if_idle()


def active_config() -> Optional[frozenset]:
    """The canonical overload names Gems serves on the calling thread right now (None: Gems off)."""
    return _TLS.cfg if _TLS.scoped else _config_for_unscoped_thread()


def is_enabled(name: Optional[str] = None) -> bool:
    """Whether Gems serves `name` (or anything at all) on the calling thread right now."""
    cfg = active_config()
    if cfg is None:
        return False
    return bool(cfg) if name is None else registry.canonical(name) in cfg


class use_gems:
    """Context manager: Gems on (for `include`, minus `exclude`) in this thread for the block.

    Nests (the inner scope's selection wins), restores the previous state on exit, and is
    thread-local like `torch.no_grad()`: other threads keep their own state. The first entry in a
    process registers the kernels; later entries only swap a thread-local pointer.
    """

    __slots__ = ("cfg", "_prev")

    def __init__(self, include: Optional[Iterable[str]] = None, exclude: Optional[Iterable[str]] = None):
        self.cfg = _config(include, exclude)
        self._prev = []

    def __enter__(self):
        _ensure_registered()
        tls = _TLS
        self._prev.append((tls.scoped, tls.cfg))
        tls.scoped, tls.cfg = True, self.cfg
        with _LOCK:
            _scopes.append(self)
            _fast_sync_scopes()
        if _fast is not None:
            _fast.set_thread(_cfg_id(self.cfg))
        return self

    def __exit__(self, *exc):
        tls = _TLS
        tls.scoped, tls.cfg = self._prev.pop()
        with _LOCK:
            # remove this scope's most recent entry (scopes of other threads may sit after it)
            for i in range(len(_scopes) - 1, -1, -1):
                if _scopes[i] is self:
                    del _scopes[i]
                    break
            _fast_sync_scopes()
        if _fast is not None:
            _fast.set_thread(_cfg_id(tls.cfg) if tls.scoped else _fast.UNSCOPED)
        return False


def stats() -> dict:
    """Per overload with any traffic: {'served': n, 'fallback': n, 'reasons': {reason: n}, 'python': n}.
    'python': the served calls that ran the Python kernel (a signature's first call, an op without call
    plans, or every call without the C++ fast path) rather than a plan replayed from C++."""
    out = {}
    for impl in registry.all_impls():
        s, f = impl.served, impl.fell_back
        if s or f:
            out[impl.name] = {"served": s, "fallback": f, "reasons": impl.all_reasons(), "python": impl.counts[0]}
    return out


def plan_stats() -> dict:
    """Per overload with call plans: {'plans': n, 'no_plan': n, 'built': n, 'reasons': {why: n}}, where
    `reasons` says why signatures kept the full path (see docs/architecture.md, call plans); gems.fused's
    planned launch functions appear as `fused::<name>` (runtime/planned.py)."""
    from .runtime.planned import plan_stats as fused_plan_stats
    out = fused_plan_stats()
    for impl in registry.all_impls():
        cache = impl.plans
        if cache is not None and cache.plans:
            out[impl.name] = cache.info()
            if impl.fast is not None:
                out[impl.name]["fast_plans"] = impl.fast.size()
    return out


def reset_stats():
    for impl in registry.all_impls():
        impl.counts[0] = impl.counts[1] = 0
        impl.reasons.clear()
        if impl.fast is not None:
            impl.fast.hits = 0
            impl.fast.reset_aten_counts()


def registered_ops() -> list[str]:
    """Sorted ATen overload names Gems implements on the active backend."""
    return [i.name for i in registry.all_impls(backend().name)]
