"""One line on stderr when first-call work makes a user wait: Triton compiling a kernel on a launch-cache
miss (runtime/launch.py) and a shape bucket's first autotuning (runtime/autotune.py); and gems.warmup's
count of the kernels it compiles in parallel (`warming`).

Why: a model's first step can spend tens of seconds compiling and tuning while nothing is printed,
which reads as a hang. Why not a line per compile: a warm process compiles nothing, and a cold one
compiles hundreds of kernels; one line says what is happening without burying the user's output.

The time such work takes is added up per process (only on the miss paths: a launch-cache hit or a plan
replay never reaches this module). Once the total passes THRESHOLD_S, one line names the work in
progress; after it, at most one line per REPEAT_S with what has been done so far. `GEMS_QUIET=1`
silences both.
"""
from __future__ import annotations

import os
import sys
import threading
import time

THRESHOLD_S = 3.0     # first-call work a user does not notice; past it, say what is going on
REPEAT_S = 60.0       # at most one further line per minute while the work goes on

clock = time.perf_counter   # a seam: tests replace it with a fake clock

_lock = threading.Lock()
_spent = 0.0          # seconds of first-call work so far in this process
_counts = {"compile": 0, "tune": 0}
_seconds = {"compile": 0.0, "tune": 0.0}
_per_kernel: dict = {}  # kernel name -> [misses, seconds]: which kernels a first run waited for
_said_at = None       # the clock when the last line was printed; None: nothing printed yet


def quiet() -> bool:
    return os.environ.get("GEMS_QUIET", "") not in ("", "0")


def compiled(kernel: str, seconds: float):
    """A launch-cache miss of `kernel` took `seconds` (Triton compiled it or read it from its disk cache)."""
    _add("compile", seconds, lambda: "gems: compiling kernels for new shapes (first run only, cached on disk) ...",
         kernel)


def tuned(name: str, bucket, seconds: float, stored_in):
    """`name`'s first tuning of `bucket` took `seconds`; its pick is stored in `stored_in`."""
    _add("tune", seconds, lambda: f"gems: tuning {name} for {bucket} on {_device_name()} (once per GPU, stored in "
                                  f"{stored_in}) ...")


def warming(kernels: int, workers: int):
    """gems.warmup is about to compile `kernels` kernels in `workers` processes: said at once, since
    the user asked for this work and it takes seconds."""
    say(f"gems: compiling {kernels} kernels for this model in {workers} process{'es' if workers != 1 else ''} "
        f"(first run only, cached on disk) ...")


def say(text: str):
    """One line on stderr unless GEMS_QUIET."""
    if not quiet():
        print(text, file=sys.stderr, flush=True)


def _add(kind: str, seconds: float, line, kernel=None):
    global _spent, _said_at
    with _lock:
        _spent += seconds
        _counts[kind] += 1
        _seconds[kind] += seconds
        if kernel is not None:
            n_s = _per_kernel.setdefault(kernel, [0, 0.0])
            n_s[0] += 1
            n_s[1] += seconds
        if _spent < THRESHOLD_S or quiet():
            return
        now = clock()
        if _said_at is None:
            text = line()
        elif now - _said_at >= REPEAT_S:
            text = (f"gems: still compiling and tuning for new shapes: {_counts['compile']} kernel launches "
                    f"compiled, {_counts['tune']} buckets tuned, {_spent:.0f} s so far (first run only)")
        else:
            return
        _said_at = now
    print(text, file=sys.stderr, flush=True)


def _device_name() -> str:
    try:
        import torch
        if torch.cuda.is_available():
            return torch.cuda.get_device_name()
    except Exception:  # noqa: BLE001 - a name for a message only
        pass
    return "this device"


def totals() -> dict:
    """The first-call work this process's calling threads waited for so far: {"compile": [misses,
    seconds], "tune": [buckets, seconds], "kernels": {kernel name: [misses, seconds]}} (compiles handed
    to background compilation's pool are not here: runtime/background.py counts those)."""
    with _lock:
        return {"compile": [_counts["compile"], _seconds["compile"]], "tune": [_counts["tune"], _seconds["tune"]],
                "kernels": {k: list(v) for k, v in _per_kernel.items()}}


def reset():
    """Forget the work counted so far (tests)."""
    global _spent, _said_at
    with _lock:
        _spent, _said_at = 0.0, None
        for k in _counts:
            _counts[k] = 0
            _seconds[k] = 0.0
        _per_kernel.clear()
