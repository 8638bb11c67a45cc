"""Triton's own cache key, hashed on a thread before the first compile needs it.

Why: every Triton compile, and every load of a binary from Triton's disk cache, starts from the key of
the Triton installation: a SHA-256 of its compiler and language sources and of libtriton (about 400 MB),
computed once per process by `triton.runtime.cache.triton_key`. On an H200 host that took 0.7-1.2 s,
and it fell on the calling thread at a model's first kernel: in a process whose binaries were all on
disk it was half of patched BERT's first training step (a wall-clock sample of that step). Reading and
hashing release the GIL, so on a thread started when Gems is switched on for a GPU (gems.enable,
use_gems, gems.patch of a model on a GPU) it runs beside the ops' import, the user's model building and
the step's first Python work.

How: `start()` calls Triton's own function on a daemon thread; Triton caches the result, so every later
compile reads it. `wait()` joins that thread while it runs: every launch-cache miss calls it, and so do
the background compile workers and gems.warmup before it forks its compile processes, so they wait for
the hash in progress instead of computing a second one beside it. A miss that background compilation
would defer waits too: in a process after the first, the key then lets the miss load its binary from
disk at once (runtime/background.py), instead of ATen answering while a worker waits for the same hash;
in a first process no compile can start before the key anyway. `ready()` says whether the key is
computed. Where Triton's function is not what this expects, nothing starts and Triton computes the key
where it always did.
"""
from __future__ import annotations

import threading

_thread: threading.Thread | None = None
_lock = threading.Lock()


def _triton_key():
    """Triton's function, when it is the cached function this expects; else None."""
    try:
        from triton.runtime import cache
    except Exception:  # noqa: BLE001 - another Triton: leave the key to it
        return None
    fn = getattr(cache, "triton_key", None)
    return fn if callable(fn) and hasattr(fn, "cache_info") else None


def ready() -> bool:
    """Whether Triton's key is computed in this process (a compile or a disk lookup then costs no hashing)."""
    fn = _triton_key()
    return fn is not None and fn.cache_info().currsize > 0


def start():
    """Compute Triton's key on a thread, once per process (a no-op when it is computed or computing)."""
    global _thread
    fn = _triton_key()
    if fn is None or fn.cache_info().currsize > 0:
        return
    with _lock:
        if _thread is None or (not _thread.is_alive() and not ready()):
            _thread = threading.Thread(target=_compute, args=(fn,), name="gems-triton-key", daemon=True)
            _thread.start()


def _compute(fn):
    try:
        fn()
    except Exception:  # noqa: BLE001 - the first compile computes it again and raises there if it must
        pass


def wait():
    """Block while the thread `start()` made is hashing (a launch-cache miss, a compile worker, a fork)."""
    t = _thread
    if t is not None and t.is_alive():
        t.join()
