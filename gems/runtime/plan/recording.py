"""Recording: the thread's recording call, what it saw, and the hooks the runtime calls while it runs.

A signature's recording call runs the implementation under a `Recording`. This module owns the
thread-local slot that says which recording (if any) is active; every other module reaches it only
through the functions here: `active()`, `taint()`, `dynamic()` / `add_dynamic()` (per-call numbers of
the next launch), `quiet()` (ATen ops that are not the implementation's), `suspended()` (nothing
recorded inside). A `Recording` notes allocations (runtime/alloc.py) and launches (runtime/launch.py);
a `TorchDispatchMode` sees every other ATen op the implementation calls, and any op that is not a view
or an allocation *taints* the recording: its signature keeps the full path.
"""
from __future__ import annotations

import threading
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_T = torch.Tensor


class _State(threading.local):
    rec: Optional["Recording"] = None


_STATE = _State()


def active() -> Optional["Recording"]:
    return _STATE.rec


def taint(why: str, transient: bool = False):
    """Called by code that does something a plan cannot repeat (a host read, ...). `transient`: only
    this call is special (it ran an autotuning benchmark): the next call of the signature records."""
    rec = _STATE.rec
    if rec is not None and rec.tainted is None:
        rec.tainted = why
        rec.transient = transient


def dynamic(slots: dict):
    """The next launch takes these kernel arguments from the call: {arg position: (schema argument
    name, conversion)}, e.g. {1: ("other", "float")} for `x * 2.0` (see runtime/abi.py, CONVERSIONS)."""
    rec = _STATE.rec
    if rec is not None:
        rec.pending_dynamic = dict(slots)


def add_dynamic(slots: dict):
    """Like `dynamic`, adding to the slots already declared for the next launch (per-call random state
    beside per-call numbers, see plan/rng.py)."""
    rec = _STATE.rec
    if rec is not None:
        rec.pending_dynamic = {**(rec.pending_dynamic or {}), **slots}


# ATen ops an implementation may call without making its plan wrong: views (no data touched) and
# allocations (a plan only ever uses recorded ones; an unrecorded tensor cannot be mapped anyway).
_HARMLESS = frozenset("""view as_strided expand t transpose permute squeeze unsqueeze select slice alias
detach _reshape_alias unfold unflatten diagonal split split_with_sizes unbind narrow empty empty_strided empty_like
new_empty new_empty_strided _debug_has_internal_overlap sym_size sym_stride sym_numel
sym_storage_offset is_contiguous sym_is_contiguous _unsafe_view view_as can_cast result_type promote_types
""".split())


# composites that return a view when they can and a copy otherwise: harmless when they returned a view
_VIEW_OR_COPY = frozenset(["reshape", "flatten", "contiguous", "reshape_as", "expand_as"])


class _Watch(TorchDispatchMode):
    """Sees the ATen ops an implementation calls while it is recorded."""

    def __init__(self, rec):
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        base = func.overloadpacket.__name__
        out = func(*args, **(kwargs or {}))
        if base in _HARMLESS or self.rec.tainted is not None:
            return out
        if base in _VIEW_OR_COPY and isinstance(out, _T) and isinstance(args[0], _T) and \
                out.untyped_storage().data_ptr() == args[0].untyped_storage().data_ptr():
            return out   # reshape / contiguous / flatten that returned a view: nothing to repeat
        self.rec.tainted = f"calls aten::{base}"
        return out


class Recording:
    """What one call of an implementation allocated and launched."""

    def __init__(self, values=None):
        self.values = values or {}   # the recorded call's arguments by schema name
        self.allocs = []        # (tensor, zero_fill, poison)
        self.launches = []      # (LaunchCache, entry or None, grid, args, (num_warps, num_stages, maxnreg), dynamic)
        self.tainted = None
        self.transient = False
        self.pending_dynamic = None
        self._watch = None

    def __enter__(self):
        self._prev = _STATE.rec
        _STATE.rec = self
        try:
            self._watch = _Watch(self)
            self._watch.__enter__()
        except Exception:  # noqa: BLE001 - a mode that cannot be entered here: record nothing
            self._watch = None
            self.tainted = "dispatch mode unavailable"
        return self

    def __exit__(self, *exc):
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.__exit__(*exc)
            # the mode and the recording point at each other: left as a cycle, every recording (with the
            # tensors it holds: the call's inputs, outputs and workspaces) waited for the garbage
            # collector, whose collections were half of a recording's host time (measured on a CPU host) and
            # kept GPU memory of past calls (decode's KV caches) alive until then
            watch.rec = None
        _STATE.rec = self._prev
        self._prev = None
        return False

    # hooks ------------------------------------------------------------------------------------
    def alloc(self, t, zero, poison):
        self.allocs.append((t, zero, poison))

    def launch(self, lc, entry, grid, args, num_warps, num_stages, maxnreg=None):
        dyn, self.pending_dynamic = self.pending_dynamic, None
        self.launches.append((lc, entry, tuple(grid), tuple(args), (num_warps, num_stages, maxnreg), dyn or {}))


def quiet():
    """Context: ATen ops run here (allocations the recording notes itself, the interpreter's storage
    copies, poison fills, a sanctioned `.item()`) are not the implementation's and must not taint the
    recording. It turns Python dispatch off (the recording's mode is the only one on the stack inside
    an implementation): an allocation under the mode cost 17 us, under this guard 3 (popping the
    modes instead: 11; measured on a CPU host)."""
    return torch._C._DisableTorchDispatch() if _STATE.rec is not None else _NULL


class suspended:
    """Context: nothing is recorded inside. For an autotuner's timing runs (the call's plan is tainted
    already, and a recording would keep every workspace those runs allocate alive until the call
    ends: hundreds of them), and for a recorded launch's own plain run (runtime/launch.py), which must
    not record itself again."""

    def __enter__(self):
        self.rec, _STATE.rec = _STATE.rec, None
        return self

    def __exit__(self, *a):
        _STATE.rec = self.rec
        return False


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


_NULL = _Null()
