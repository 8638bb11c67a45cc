"""Plan caches: per overload (or planned function), call signature -> plan, bounded."""
from __future__ import annotations

from ..abi import MAX_PLANS
from ..source import compile_source, forget_source

MISS = object()            # a plan's answer when it declines this call (the full path runs)
NO_PLAN = object()         # cache value: this signature keeps the full path
SEEN = object()            # cache value: called once, unrecorded (the dispatcher's GEMS_PLAN_AFTER=2)


def _release(plan):
    """A plan leaves its cache: its source leaves linecache (each plan's file name is its own)."""
    if plan.__class__ is LazyPlan:
        if plan._fn is not None:
            forget_source(plan._name)
    else:
        code = getattr(plan, "__code__", None)
        if code is not None:
            forget_source(code.co_filename)


def compile_plan(src, name, ns, recipe):
    fn = compile_source(src, name, ns)["plan"]
    fn.__gems_source__ = src
    fn.__gems_recipe__ = recipe
    return fn


class LazyPlan:
    """A plan whose Python function is compiled when it first runs. Why: where the C++ fast path
    replays a signature from its recipe, the Python function is rarely called, and compiling it was a
    third of a new signature's host cost (163 of 490 us for a `cat` on a CPU host). Decode meets a
    new signature every token (the KV cache's length), for several ops. The compiled function
    replaces it in its plan cache (`PlanCache.put` tells it where) when it is first
    compiled, so later Python-side hits call the function itself."""

    __slots__ = ("__gems_source__", "__gems_recipe__", "_name", "_ns", "_fn", "slot")

    def __init__(self, src, name, ns, recipe):
        self.__gems_source__, self.__gems_recipe__ = src, recipe
        self._name, self._ns, self._fn = name, ns, None
        self.slot = None     # (plans dict, key) of the cache holding it

    def compiled(self):
        fn = self._fn
        if fn is None:
            fn = self._fn = compile_plan(self.__gems_source__, self._name, self._ns, self.__gems_recipe__)
            if self.slot is not None:
                plans, key = self.slot
                if plans.get(key) is self:
                    plans[key] = fn
                else:
                    # already evicted (run through a reference held elsewhere): nothing will
                    # drop its source later
                    forget_source(self._name)
        return fn

    def __call__(self, *args, **kwargs):
        return self.compiled()(*args, **kwargs)

    @property
    def __code__(self):
        return self.compiled().__code__

    @property
    def __globals__(self):
        """The namespace the function is (or will be) compiled in, as a function's `__globals__`: what
        the plan calls (a descriptor rebuild, say) can be inspected without compiling it."""
        return self._ns


class AtenPlan:
    """A signature whose plan is ATen's kernel: the implementation decided so for the whole signature
    (`Unsupported(reason, signature=True)`, e.g. a GEMM bucket where cuBLAS was measured faster), so
    a repeat call skips the implementation and its checks and goes straight to ATen (counted as a
    fallback with that reason)."""

    __slots__ = ("reason",)

    def __init__(self, reason: str):
        self.reason = reason


class PlanCache:
    """Plans of one overload, keyed by call signature; bounded."""

    __slots__ = ("plans", "built", "declined", "reasons")

    def __init__(self):
        self.plans: dict = {}
        self.built = self.declined = 0
        self.reasons: dict = {}

    def _room(self, key):
        """Evict the oldest signature when a new key would exceed MAX_PLANS (replacing one never does);
        a plan that leaves the cache takes its source out of linecache."""
        plans = self.plans
        if key in plans:
            _release(plans[key])
        elif len(plans) >= MAX_PLANS:
            _release(plans.pop(next(iter(plans))))

    def clear(self):
        """Drop every plan (the implementation was replaced)."""
        for plan in self.plans.values():
            _release(plan)
        self.plans.clear()

    def put_seen(self, key):
        """The signature ran once without a recording: its next call records."""
        self._room(key)
        self.plans[key] = SEEN

    def put(self, key, plan, why=None):
        self._room(key)
        if plan is None:
            self.plans[key] = NO_PLAN
            self.declined += 1
            if why:
                self.reasons[why] = self.reasons.get(why, 0) + 1
        else:
            if plan.__class__ is LazyPlan:
                plan.slot = (self.plans, key)
            self.plans[key] = plan
            self.built += 1

    def info(self) -> dict:
        aten = sum(p.__class__ is AtenPlan for p in self.plans.values())
        planned = sum(p is not NO_PLAN and p is not SEEN for p in self.plans.values())
        return {"plans": planned - aten, "aten": aten,
                "no_plan": self.declined,
                "built": self.built, "reasons": dict(self.reasons)}
