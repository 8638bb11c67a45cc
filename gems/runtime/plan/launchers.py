"""What a plan launches through: the interpreter launch the C++ fast path calls back, the launch-hook
check, a launch's device."""
from __future__ import annotations

import torch
import triton

from .. import reentry

_T = torch.Tensor


def interpreter_launch(fn, grid, num_warps, num_stages, maxnreg=None):
    """A launch the C++ fast path calls back under the interpreter. The interpreter copies storages
    with ATen ops Gems may serve: the re-entry guard is up while it runs (as for a Python plan)."""
    cap = {} if maxnreg is None else {"maxnreg": maxnreg}

    def launch(*args):
        with reentry.guard():
            fn[grid](*args, num_warps=num_warps, num_stages=num_stages, **cap)
    return launch



def dev_index(kargs):
    for a in kargs:
        if isinstance(a, _T) and a.is_cuda:
            return a.get_device()
    return torch.cuda.current_device()


_knobs_runtime = triton.knobs.runtime


def hooks_active() -> bool:
    """Whether a Triton launch hook listens (a profiler such as proton): plans then decline, and the
    launch goes through Triton's own path, which gives the hook what it expects."""
    rt = _knobs_runtime
    enter, leave = rt.launch_enter_hook, rt.launch_exit_hook
    # triton 3.6 keeps hooks as (usually empty) HookChain objects; older versions use None
    return bool(getattr(enter, "calls", enter)) or bool(getattr(leave, "calls", leave))
