"""Call plans for launch functions that are not ATen overloads (gems.fused's forward and backward).

An ATen op served by Gems gets its call plans from the dispatcher's kernel (gems/dispatch/kernel.py);
the fused ops of `gems.fused` are plain Python functions called from their autograd Functions, and
without plans they redo per call everything the call's signature decides: argument checks, row
layouts, tile and grid choice, the launch key. On a 1.1B Llama training step that was ~100-250 us of host time per
fused call (measured on the H200 host), more than the fused kernels saved on the device.

`@planned("name(Tensor x, Tensor? r, float eps, bool flag) -> (Tensor, Tensor?)")` declares such a
function with a schema (parsed only, never registered with the dispatcher). Its calls then work like
an ATen op's on Gems' Python path: the first call of a signature (dtypes, shapes, strides, 16-byte
alignment, device, the values of the non-tensor arguments) runs the function under a recording
(runtime/plan/publish.py, as for ATen ops); if it only allocated (`runtime.alloc.empty/zeros`),
launched (`runtime.kernel`) and took views, the recording becomes a plan, and later calls of that
signature run the plan: the allocations and the direct launches, nothing else. A function that does
anything else for a signature (an ATen op such as a copy, a host read) keeps running in full for it.

Rules for a planned function: positional arguments in schema order; tensor results only (or None in
a result tuple); it writes only tensors it allocated (no in-place argument: the schema must not
declare one); everything it decides must follow from the signature. Errors it raises are raised on a
signature's first call and, because the signature then has no plan, on every later call too.

GEMS_PLANS=0 turns plans off here as for ATen ops. With GEMS_PLAN_CHECK (the test suite sets it)
the first call of a signature is answered by its new plan, so the tests run the plans.
"""
from __future__ import annotations

import torch

from .backends import backend
from .plan.cache import MISS, NO_PLAN, PlanCache
from .plan.publish import record_and_publish
from .plan.signature import make_signature
from .settings import PLAN_CHECK, PLANS

_ALL: dict = {}     # name -> Planned, for plan_stats()


class Planned:
    """A launch function served from call plans; call it like the function."""

    __slots__ = ("fn", "name", "schema", "cache", "_sig", "__wrapped__")

    def __init__(self, fn, schema: str):
        self.fn = self.__wrapped__ = fn
        self.schema = torch._C.parse_schema(schema)
        self.name = self.schema.name
        for a in self.schema.arguments:
            if a.alias_info is not None and a.alias_info.is_write:
                raise ValueError(f"planned {self.name}: argument {a.name} is written; planned functions may "
                                 "only write tensors they allocate")
        self.cache = PlanCache()
        self._sig = None     # built on first use: the backend (CUDA or the interpreter) decides its form

    def __call__(self, *args):
        if not PLANS:
            return self.fn(*args)
        sig = self._sig
        if sig is None:
            sig = self._sig = make_signature(self.schema, frozenset(), backend().device_type == "cuda")
        try:
            key = sig(*args)
            p = self.cache.plans.get(key)
        except Exception:  # noqa: BLE001 - an argument the signature cannot key: the function decides
            return self.fn(*args)
        if p is not None:
            if p is not NO_PLAN:
                out = p(*args)
                if out is not MISS:      # MISS: a profiler listens to launches (the full path tells it)
                    return out
            return self.fn(*args)
        # no argument is written: with the check, running the new plan again is harmless
        return record_and_publish(self, self.schema, self.cache, key, args, {}, backend().device_type == "cuda",
                                  bool(PLAN_CHECK))


def planned(schema: str):
    """Decorator: serve the function from call plans (see the module docstring)."""
    def wrap(fn):
        p = Planned(fn, schema)
        _ALL[p.name] = p
        return p
    return wrap


def plan_stats() -> dict:
    """Per planned function that has run: PlanCache.info() (plans, no_plan, built, reasons)."""
    return {f"fused::{n}": p.cache.info() for n, p in _ALL.items() if p.cache.plans}
