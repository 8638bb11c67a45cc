"""The per-call kernel: one small Python function per overload, registered at the backend key.

What it does with a call, in order (`make_kernel` builds it; everything that depends only on the
overload and the backend is computed there, once, so the call does only what depends on the call):

1. Re-entry and selection: a call made from inside a Gems implementation (the interpreter copies CPU
   storages with ops Gems may serve; the re-entry guard, runtime/reentry.py, is up there), or for an
   overload the calling thread's selection leaves out, runs ATen's original kernel.
2. The plan lookup: the call's signature keys the overload's plan cache; a plan runs the recorded
   allocations and launches (and is handed to the C++ fast path, which missed this call); a recorded
   signature-level decision for ATen runs ATen's kernel.
3. Declared support: the first tensor's dtype, every tensor strided, real and on this device, dtypes
   the backend cannot compute exactly (bf16 on the interpreter), a call with no tensor at all, a
   signature the implementation failed on before, the op's own check. Anything unsupported runs ATen's
   kernel and is counted with its reason (fallback.py).
4. The implementation runs (the signature's recording call records its plan, runtime/plan/publish.py).
   `Unsupported` sends the call to ATen, any other exception goes through the error policy
   (fallback.after_error). With GEMS_COMPILE=background a functional overload's implementation runs
   marked deferrable (runtime/background.py): a kernel it needs that is not compiled yet raises
   NotCompiled, and ATen answers that call without the signature's plan state changing.
"""
from __future__ import annotations

import torch

from .. import registry
from ..codegen.numbers import tensor_positions
from ..registry import AtenError, Unsupported
from ..runtime import background, backends, collect, reentry, settings
from ..runtime.plan import cache as plan_cache
from ..runtime.plan.publish import record_and_publish
from ..runtime.plan.signature import make_signature
from .fallback import after_error, boxed_with_numbers, call_signature, unserved_scanner
from .state import DispatchState, OpRuntime, config_for_unscoped_thread

_Tensor = torch.Tensor
_strided = torch.strided


def _declared_support(impl: registry.OpImpl, schema, be):
    """What the support checks of step 3 compare with: (the dtypes served for the first tensor, the
    backend's unserved dtypes -> reason, a scanner for them or None, whether the schema has tensor
    slots, the positions of tensor arguments ATen reads on the host)."""
    # dtypes the backend cannot compute exactly (bf16 on the interpreter) go to ATen whatever the op says
    unserved = backends.unserved_dtypes(be)
    dtypes = frozenset(impl.dtypes) - frozenset(unserved)
    scan_unserved = unserved_scanner(unserved) if unserved else None
    # ATen calls some ops on a wrapped number alone (`_to_copy(2)`): with no tensor there is nothing to
    # launch on, so such a call goes to ATen
    tensor_slots = bool(tensor_positions(schema))
    host_pos = tuple(i for i, a in enumerate(schema.arguments) if a.name in impl.host_args)
    return dtypes, unserved, scan_unserved, tensor_slots, host_pos


def _plan_cache(state: DispatchState, impl: registry.OpImpl, op: OpRuntime, schema, on_cuda):
    """Step 2's inputs: (the signature function or None when the overload has no call plans, its plan
    cache, the C++ fast-path op or None)."""
    sig = make_signature(schema, impl.dynamic, on_cuda) if impl.plan and settings.PLANS else None
    if sig is None:
        return None, None, None
    # plans outlive a registration: disable() followed by enable() finds them again
    if op.plans is None:
        op.plans = plan_cache.PlanCache()
    return sig, op.plans, op.fast if state.fast is not None else None


def make_kernel(state: DispatchState, impl: registry.OpImpl, op: OpRuntime, orig, keyset, be):
    """The Python kernel of overload `impl` on backend `be` (`orig`: ATen's kernel it sits on)."""
    name = impl.name
    schema = registry.aten_overload(name)._schema
    on_cuda = be.device_type == "cuda"
    call_orig = boxed_with_numbers(name, orig.call_boxed)
    dtypes, unserved, scan_unserved, tensor_slots, host_pos = _declared_support(impl, schema, be)
    check = impl.check
    sig, cache, fast_op = _plan_cache(state, impl, op, schema, on_cuda)
    plans = cache.plans if cache is not None else None
    extra_key = impl.plan_key
    record_later = settings.PLAN_AFTER > 1
    # under the interpreter a launch copies storages with ops Gems may serve: keep the re-entry
    # guard up while a plan runs there; on CUDA a plan calls nothing Gems serves
    guard_plan = not on_cuda
    # what the call reads, bound here so that each is one local lookup
    counts, reasons, broken = op.counts, op.reasons, op.broken
    tls, guard, scopes = state.thread, reentry.THREAD, state.scopes
    get_device = torch._C._cuda_getDevice if on_cuda else None
    MISS, NO_PLAN, AtenPlan, SEEN = plan_cache.MISS, plan_cache.NO_PLAN, plan_cache.AtenPlan, plan_cache.SEEN
    # background compilation: whether this overload's calls may be answered by ATen while a kernel
    # compiles: a functional call at any miss (its outputs are fresh, so nothing half-written survives),
    # an in-place or out= call only at a launch its op declares as the call's first write
    defer_mark = (background.WRITES if writes_an_argument(schema) else True) if settings.BACKGROUND_COMPILE else None
    deferrable = defer_mark is not None
    set_deferring = background.set_deferring
    NotCompiled = collect.not_compiled()

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

    def unsupported(e, key, args, kwargs):
        # the implementation raised Unsupported: ATen runs the call; with signature=True the decision
        # holds for every call of the signature (a kernel still compiling in the background decides
        # nothing about the signature)
        reason = str(e) or "unsupported arguments"
        if key is not None and e.__class__ is not NotCompiled:
            if e.signature:
                cache.put(key, AtenPlan(reason))
                if fast_op is not None:
                    fast_op.publish_aten(reason)
            else:
                cache.put(key, None, f"unsupported: {e}")
        return fallback(reason, args, kwargs)

    def kernel(*args, **kwargs):
        # 1. re-entry and selection
        if guard.depth:
            return call_orig(keyset, *args, **kwargs)
        if tls.scoped:
            cfg = tls.cfg
        elif scopes:
            # a scope is active on some thread: this may be backward work one of them started
            cfg = config_for_unscoped_thread(state)
        else:
            cfg = state.global_cfg
        if cfg is None or name not in cfg:
            return call_orig(keyset, *args, **kwargs)
        # 2. the plan lookup
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
        # 3. declared support: the first tensor's dtype; every tensor strided, real, on this device
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
            bad = broken.get(call_signature(args, kwargs))
            if bad is not None:
                return fallback(bad, args, kwargs)
        if check is not None:
            reason = check(*args, **kwargs)
            if reason is not None:
                return fallback(reason, args, kwargs)
        # 4. the implementation (recording the signature's plan on its recording call)
        if deferrable:
            prev = set_deferring(defer_mark)
        try:
            guard.depth += 1
            try:
                if key is not None and not unseen:
                    out = record_and_publish(impl, schema, cache, key, args, kwargs, on_cuda,
                                             cache.built < settings.PLAN_CHECK, fast_op)
                else:
                    out = impl.fn(*args, **kwargs)
                    if unseen and key is not None:
                        cache.put_seen(key)
            except AtenError as e:
                guard.depth -= 1
                raise e.error from None
            except Unsupported as e:
                guard.depth -= 1
                return unsupported(e, key, args, kwargs)
            except Exception as e:  # noqa: BLE001 - the error policy, fallback.after_error
                guard.depth -= 1
                return after_error(impl, op, e, call_orig, keyset, args, kwargs)
            except BaseException:
                # KeyboardInterrupt, a test's timeout: the thread's depth must not stay raised (every
                # later call would go to ATen)
                guard.depth -= 1
                raise
            guard.depth -= 1
            counts[0] += 1
            return out
        finally:
            if deferrable:
                set_deferring(prev)

    kernel.__name__ = f"gems_{name.replace('.', '_')}"
    kernel.__gems_planned__ = sig is not None
    return kernel


def writes_an_argument(schema) -> bool:
    """Whether an overload writes one of its arguments (in place, out=)."""
    return any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
