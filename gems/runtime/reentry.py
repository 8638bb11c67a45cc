"""The re-entry guard: whether the calling thread is inside a Gems implementation right now.

Gems' implementations and plans call ATen ops that Gems may serve itself: the interpreter copies CPU
storages with them, the poison test aid fills outputs with `fill_`. Such a call must run ATen's own
kernel, never Gems' again (it would recurse). The dispatcher's kernel sends every call made while the
guard is up straight to ATen.

This module owns the per-thread depth. The dispatcher's per-call kernel reads and raises it inline
(`THREAD.depth`: a function call per op call would cost host time on every call); everything else
raises it with `guard()`.
"""
from __future__ import annotations

import threading


class _Depth(threading.local):
    depth = 0          # > 0 while a Gems implementation (or a plan of one) runs on this thread


THREAD = _Depth()


class guard:
    """Context: calls made inside go to ATen's own kernels (the interpreter launches the C++ fast path
    calls back, poison fills)."""

    __slots__ = ()

    def __enter__(self):
        THREAD.depth += 1
        return self

    def __exit__(self, *exc):
        THREAD.depth -= 1
        return False
