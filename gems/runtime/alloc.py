"""Output and workspace allocation for kernels, in one place so call plans can repeat it.

`empty` / `zeros` are what every op uses for tensors its kernels write: a plan being recorded
(runtime/plan/recording.py) notes each one and allocates the same shape, strides and dtype on later calls.
Test aid: with GEMS_POISON=1 fresh outputs start as NaN (or -1 for integers), so an element a kernel
forgets to write can never pass as a right answer -- in plans too.
"""
from __future__ import annotations

import torch

from . import reentry
from .plan import recording
from .settings import POISON


def poison(t):
    """Fill a fresh output with NaN (-1, True): ATen's fill, not Gems' (a re-entered call goes to ATen),
    here and in plan replays: the poison is a test aid, not a launch of the op under test (tests count
    launches)."""
    with reentry.guard():
        t.fill_(float("nan") if t.is_floating_point() or t.is_complex() else (True if t.dtype == torch.bool else -1))


def _new(shape, dtype, device, like_strides):
    if like_strides is None:
        return torch.empty(shape, dtype=dtype, device=device)
    return torch.empty_strided(shape, like_strides, dtype=dtype, device=device)


def empty(shape, dtype, device, like_strides=None):
    """torch.empty / empty_strided (poisoned under GEMS_POISON=1), noted by a recording plan."""
    rec = recording.active()
    if rec is None:
        t = _new(shape, dtype, device, like_strides)
    else:
        with recording.quiet():     # noted below: not an op for the recording's watch to judge
            t = _new(shape, dtype, device, like_strides)
    if POISON:
        with recording.quiet():
            poison(t)
    if rec is not None:
        rec.alloc(t, False, POISON)
    return t


def zeros(shape, dtype, device):
    """torch.zeros (a workspace accumulated into), noted by a recording plan."""
    rec = recording.active()
    with recording.quiet():
        t = torch.zeros(shape, dtype=dtype, device=device)
    if rec is not None:
        rec.alloc(t, True, False)
    return t
