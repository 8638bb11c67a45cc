"""Counts: what Gems served and what fell back to ATen (and why), per overload; call-plan counts."""
from __future__ import annotations

from .. import registry
from ..runtime import background
from ..runtime.planned import plan_stats as fused_plan_stats
from .state import STATE


def stats() -> dict:
    """Per overload with any traffic: {'served': n, 'fallback': n, 'reasons': {reason: n}, 'python': n}.
    'python': the served calls that ran the Python kernel (a signature's first call, an op without call
    plans, or every call without the C++ fast path) rather than a plan replayed from C++.
    `fused::<name>`: the calls of a gems.fused function its PyTorch reference answered while a kernel
    compiled in the background (fused/deferral.py); its served calls are not counted."""
    out = {f"fused::{n}": {"served": 0, "fallback": c, "reasons": {"kernel not compiled yet": c}, "python": 0}
           for n, c in background.answers().items()}
    for impl in registry.all_impls():
        op = STATE.ops.get(impl.name)
        if op is None:
            continue
        s, f = op.served, op.fell_back
        if s or f:
            out[impl.name] = {"served": s, "fallback": f, "reasons": op.all_reasons(), "python": op.counts[0]}
    return out


def plan_stats() -> dict:
    """Per overload with call plans: {'plans': n, 'no_plan': n, 'built': n, 'reasons': {why: n}}, where
    `reasons` says why signatures kept the full path (see docs/architecture.md, call plans); gems.fused's
    planned launch functions appear as `fused::<name>` (runtime/planned.py)."""
    out = fused_plan_stats()
    for impl in registry.all_impls():
        op = STATE.ops.get(impl.name)
        cache = op.plans if op is not None else None
        if cache is not None and cache.plans:
            out[impl.name] = cache.info()
            if op.fast is not None:
                out[impl.name]["fast_plans"] = op.fast.size()
    return out


def reset_stats():
    """Zero the counts of `stats()` (call plans are kept)."""
    for op in STATE.ops.values():
        op.reset_counts()
    background.answers(reset=True)
