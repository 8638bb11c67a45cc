"""The dispatcher's state, in one object (`STATE`) owned by this module and passed to the functions
that read or change it.

`registry.OpImpl` is the declaration of an overload (what it serves and how); `OpRuntime` is what the
dispatcher learns about it while it runs (its call plans, its C++ fast-path op, counts, fallback
reasons, the signatures its implementation failed on). `DispatchState` holds every `OpRuntime` and the
selection state: what `enable()` chose, the `use_gems()` scopes of all threads, the calling thread's
own scope, the registrations at the backend key and the C++ fast path's module, which mirrors the
selection (its config ids stand for op sets).

Backward work autograd runs on threads of its own (CUDA's device threads) follows the selection of
the thread that started the backward: `use_gems()` also stashes its op set in torch's thread-local
Python objects, which autograd captures when a backward starts (at::ThreadLocalState) and restores on
every thread that runs that backward's nodes.
"""
from __future__ import annotations

import ctypes
import sys
import threading
from typing import Optional

import torch

from .. import registry
from ..runtime import abi


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


# the calling thread's use_gems() op set (None outside a scope) among torch's thread-local Python objects
SCOPE_KEY = "gems.use_gems"
_is_stashed = torch._C._is_key_in_tls
_stashed = torch._C._get_obj_in_tls
_graph_task_id = torch._C._current_graph_task_id


def _stash_takes_a_reference() -> bool:
    """Whether torch's `_stash_obj_in_tls` takes its own reference to the object. Some torch releases
    wrap the borrowed pointer in a SafePyObject that releases a reference it never took: the stashed
    object is then freed while still stashed (a later read returns whatever reuses its memory), so
    Gems hands such a release the reference it will drop. Probed once, on an object of our own."""
    probe = object()
    before = sys.getrefcount(probe)
    torch._C._stash_obj_in_tls(_PROBE_KEY, probe)
    takes = sys.getrefcount(probe) > before
    if not takes:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(probe))   # the reference the stash will release
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(None))
    torch._C._stash_obj_in_tls(_PROBE_KEY, None)
    return takes


_PROBE_KEY = "gems.stash_probe"
_STASH_TAKES_A_REFERENCE = _stash_takes_a_reference()


def stash_scope(cfg):
    """Record the calling thread's scope (an op set, or None outside any) where autograd finds it."""
    if not _STASH_TAKES_A_REFERENCE:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(cfg))
    torch._C._stash_obj_in_tls(SCOPE_KEY, cfg)


def config_for_unscoped_thread(state: DispatchState):
    """The op set of a thread outside any use_gems() scope of its own: enable()'s, or, for backward work
    autograd runs on a thread of its own, the scope of the thread that started the backward (never
    another thread's: a backward started outside any scope follows enable())."""
    cfg = state.global_cfg
    if state.scopes:
        task = _graph_task_id()
        if task != -1:
            scoped = _stashed(SCOPE_KEY) if _is_stashed(SCOPE_KEY) else None
            if scoped is not None:
                cfg = scoped
            if state.fast is not None:
                # the C++ side keys this thread's graph task to its config: the task's later calls
                # on this thread replay from C++
                state.fast.set_task(task, state.fast.UNSCOPED if scoped is None else cfg_id(state, scoped))
    return cfg


# config ids live at once (the C++ side's room); an id whose op set no scope and no enable() uses any
# more is reused
MAX_CONFIG_IDS = abi.MAX_CONFIGS


def cfg_id(state: DispatchState, cfg) -> int:
    """The C++ side's id of an op set (its ops' membership is set there when the id is made); -1 when
    the C++ side has no room for another."""
    i = state.cfg_ids.get(cfg)
    if i is None:
        with state.lock:
            i = _new_cfg_id(state, cfg)
    fast = state.fast
    return i if fast is None or i < fast.MAX_CONFIGS else -1


def _new_cfg_id(state: DispatchState, cfg) -> int:
    ids = state.cfg_ids
    i = ids.get(cfg)
    if i is not None:
        return i
    if len(ids) < MAX_CONFIG_IDS:
        i = len(ids)
    else:
        # the oldest op set nothing selects now gives up its id: its ops' membership is rewritten below
        # (a running backward's selection is its starting thread's active scope, so it is in use too)
        in_use = {state.global_cfg, *(s.cfg for s in state.scopes)}
        old = next((c for c in ids if c not in in_use), None)
        if old is None:
            return -1   # every id is in use: this op set takes the Python path
        i = ids.pop(old)
    ids[cfg] = i
    fast = state.fast
    if fast is not None and i < fast.MAX_CONFIGS:
        for name, rt in state.ops.items():
            if rt.fast is not None:
                rt.fast.set_member(i, name in cfg)
    return i


def is_registered() -> bool:
    """Whether Gems' kernels are registered at the backend key right now (`disable()` with no scope
    active anywhere removes them)."""
    return STATE.lib is not None
