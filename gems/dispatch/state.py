"""The dispatcher's state, in one object (`STATE`) owned by this module and passed to the functions
that read or change it.

`registry.OpImpl` is the declaration of an overload (what it serves and how); `OpRuntime` is what the
dispatcher learns about it while it runs (its call plans, its C++ fast-path op, counts, fallback
reasons, the signatures its implementation failed on). `DispatchState` holds every `OpRuntime` and the
selection state: what `enable()` chose, the `use_gems()` scopes of all threads, the calling thread's
own scope, the registrations at the backend key and the C++ fast path's module, which mirrors the
selection (its config ids stand for op sets).
"""
from __future__ import annotations

import threading
from typing import Optional

import torch

from .. import registry


class OpRuntime:
    """One overload's run-time state, created when the dispatcher first meets the overload; it outlives
    a registration (disable() followed by enable() finds the plans again)."""

    __slots__ = ("plans", "fast", "counts", "reasons", "broken")

    def __init__(self):
        self.plans = None      # its runtime.plan.cache.PlanCache once registered with call plans
        self.fast = None       # its C++ fast-path op (runtime/fast.py) once registered there
        # [served, fell back] on the Python path; a plain list keeps the per-call increment cheap
        self.counts = [0, 0]
        self.reasons: dict = {}
        # call signatures the implementation raised on where ATen did not (fallback.after_error) -> reason
        self.broken: dict = {}

    def forget(self):
        """The implementation was replaced: plans recorded from the old one, and the signatures it
        failed on, are dropped."""
        self.broken.clear()
        if self.plans is not None:
            self.plans.clear()
        if self.fast is not None:
            self.fast.clear()

    @property
    def served(self) -> int:
        """Calls Gems served: on the Python path plus C++ fast-path plan replays."""
        return self.counts[0] + (self.fast.hits if self.fast is not None else 0)

    @property
    def fell_back(self) -> int:
        """Calls that ran ATen: on the Python path plus C++ fast-path replays of recorded fallbacks."""
        return self.counts[1] + (sum(self.fast.aten_counts().values()) if self.fast is not None else 0)

    def all_reasons(self) -> dict:
        """Fallback reason -> calls, the Python path's and the C++ fast path's together."""
        out = dict(self.reasons)
        if self.fast is not None:
            for why, n in self.fast.aten_counts().items():
                out[why] = out.get(why, 0) + n
        return out

    def reset_counts(self):
        self.counts[0] = self.counts[1] = 0
        self.reasons.clear()
        if self.fast is not None:
            self.fast.hits = 0
            self.fast.reset_aten_counts()


class ThreadSelection(threading.local):
    """The calling thread's own `use_gems()` scope."""
    scoped = False     # this thread is inside use_gems()
    cfg = None         # its active op set (frozenset) while scoped


class DispatchState:
    """Everything the dispatcher changes at run time (see the module docstring)."""

    __slots__ = ("lock", "thread", "lib", "global_cfg", "scopes", "cfg_cache", "fast", "cfg_ids", "ops")

    def __init__(self):
        self.lock = threading.RLock()
        self.thread = ThreadSelection()
        self.lib = None            # torch.library.Library holding the registrations, or None
        self.global_cfg = None     # op set of enable(), or None
        self.scopes: list = []     # active use_gems scopes in all threads, innermost last
        self.cfg_cache: dict = {}  # (include, exclude) -> op set
        # the C++ fast path (runtime/fast.py): its module once loaded, or None. It mirrors the selection:
        # config ids stand for op sets, and every change of the selection is told to it
        self.fast = None
        self.cfg_ids: dict = {}    # op set -> config id
        self.ops: dict = {}        # overload name -> OpRuntime

    def op(self, name: str) -> OpRuntime:
        """The run-time state of overload `name` (canonical), made on first use."""
        rt = self.ops.get(name)
        if rt is None:
            rt = self.ops[name] = OpRuntime()
        return rt


STATE = DispatchState()


def _implementation_replaced(name: str):
    rt = STATE.ops.get(name)
    if rt is not None:
        rt.forget()


registry.on_replace(_implementation_replaced)


def op_runtime(name: str) -> OpRuntime:
    """The run-time state (plans, C++ op, counts, reasons) of the overload `name` ('mm' or 'add.Tensor')."""
    return STATE.op(registry.get(name).name)


def active_config_of(state: DispatchState) -> Optional[frozenset]:
    """The op set Gems serves on the calling thread right now (None: Gems off)."""
    return state.thread.cfg if state.thread.scoped else config_for_unscoped_thread(state)


def config_for_unscoped_thread(state: DispatchState):
    """The op set of a thread outside any use_gems() scope of its own: enable()'s, or else, on autograd's
    device threads, the innermost active scope's."""
    cfg = state.global_cfg
    if cfg is None and state.scopes and _graph_task_active():
        # Autograd runs CUDA backward work on its own device threads, which never entered the scope
        # of the thread that called backward(); they follow the innermost active scope.
        cfg = state.scopes[-1].cfg
    return cfg


def _graph_task_active() -> bool:
    return torch._C._current_graph_task_id() != -1


def is_registered() -> bool:
    """Whether Gems' kernels are registered at the backend key right now (`disable()` with no scope
    active anywhere removes them)."""
    return STATE.lib is not None
