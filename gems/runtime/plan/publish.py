"""The recording call of a signature, for ATen overloads (the dispatcher's kernel) and for planned
fused functions (runtime/planned.py) alike: run the implementation under a recording, keep its plan
in the cache, hand its recipe to the C++ fast path, and, as a test aid, answer the call from the new
plan.

The test aid (GEMS_PLAN_CHECK, runtime/settings.py; the test suite sets it): the call's answer comes
from the new plan instead of the recorded run. Written arguments (in-place `self`, `out=`) are
restored to their values before the call, the CUDA generators' offsets too (the plan must draw the
random numbers the recorded run drew, plan/rng.py), and the plan runs the call again, so the op tests
also test the plans.
"""
from __future__ import annotations

import torch

from .build import record
from .cache import MISS
from .signature import named_args


def record_and_publish(owner, schema, cache, key, args, kwargs, direct: bool, check: bool, fast_op=None):
    """The recording call of signature `key`: `owner.fn(*args, **kwargs)` (owner: the overload's
    registry.OpImpl, or a runtime.planned.Planned) under a recording; its plan goes into `cache` (a
    PlanCache) and, when it has a recipe, to `fast_op` (the C++ fast path's op, or None). `check`:
    answer the call from the new plan (the test aid above). Returns the call's result."""
    fn = owner.fn
    values = named_args(schema, args, kwargs)
    saved = _snapshot(schema, values) if check else None
    gens = [(g, g.get_offset()) for g in torch.cuda.default_generators] if saved is not None and direct else ()
    # lazy: the C++ fast path replays the recipe; the Python function is compiled if it ever runs
    out, p, rec = record(fn, schema, args, kwargs, direct, values, lazy=fast_op is not None)
    if owner.fn is not fn:   # replaced meanwhile (a test double, a disabled overload): keep nothing
        return out
    if p is not None or not rec.transient:
        cache.put(key, p, rec.tainted)
    recipe = getattr(p, "__gems_recipe__", None)
    if recipe is not None and fast_op is not None and fast_op.publish(recipe, saved is not None):
        # the C++ side keeps the plan for this call's key; with the check it answers this very call
        # from it, after the written arguments are restored here
        if saved is not None:
            _restore(saved, gens)
        return out
    if p is not None and saved is not None:
        _restore(saved, gens)
        again = p(*args, **kwargs)
        if again is not MISS:
            return again
        if not saved:
            return out      # the plan declined and nothing was restored: the recorded run's answer stands
        for t, copy in saved:   # the plan declined: run the call again on the restored arguments
            t.copy_(copy)
        return fn(*args, **kwargs)
    return out


def _snapshot(schema, values):
    """(tensor, copy) of the arguments a call writes (in-place self, out=)."""
    out = []
    for a in schema.arguments:
        v = values.get(a.name)
        if a.alias_info is not None and a.alias_info.is_write and isinstance(v, torch.Tensor):
            out.append((v, v.clone()))
    return out


def _restore(saved, gens):
    for t, copy in saved:
        t.copy_(copy)
    for g, off in gens:
        g.set_offset(off)
