"""Background compilation (the default; `GEMS_COMPILE=inline` turns it off): ATen answers a call while its
kernel compiles.

Why: Gems compiles each Triton kernel at its first launch. On the calling thread, one after the other,
a fresh process's first training step of a 1.1B Llama spent ~25 s compiling ~75 kernels, where ATen's
takes 2 s; with this mode that first step took 9.5 s, and BERT's, GPT-2-medium's and Llama-2-7B's
prefill 4-7.5 s (docs/perf.md, Cold start). `gems.warmup` compiles ahead of time in processes, but
needs the model and its inputs before the first step; this mode needs nothing.

How: the dispatcher marks the calls of functional overloads (no argument written, no out=) as
deferrable while their implementation runs (`deferring()`, one thread-local flag). A launch-cache miss
there goes through collect mode's hook (runtime/collect.py): a kernel Triton holds in memory launches
as usual; one it would compile is handed to `submit`, which compiles it on a thread pool, and the launch
raises NotCompiled, an `Unsupported`, so ATen answers the call (counted in `gems.stats()` under
"kernel not compiled yet"). The op's outputs were fresh, so whatever its earlier kernels wrote is
dropped with them. Once the worker has put the binary into the JIT function's in-memory cache, the
next call's launch finds it. A shape bucket's first tuning in a deferrable call runs every config once
untimed (`probing()`): when one of them is not compiled yet, ATen answers and nothing is stored; when
all are, the tuning times them as usual. An op whose kernels each read what the one before wrote would
meet one more of them per call; it hands them all over before its first launch (`ahead`, through
LaunchCache.ahead), so they compile together. Each such op opts in, naming launches whose arguments it
knows before the first one runs: finding the later launches for any op by running its code on past a
kernel that did not run would feed that code garbage (a host read, a table cached for later calls).

The compile threads hold the GIL in Triton's front end. Every torch call of the calling thread lets
the GIL go and must take it back, and at Python's switch interval (5 ms) it waited up to that long each
time: on an H200 host, 152 small CPU calls of patched BERT's step took 0.5-1.1 s while kernels compiled,
under 0.01 s otherwise (cProfile). While compiles are queued the interval is SWITCH_S instead, and it is put
back when the queue drains (unless something else changed it meanwhile). The steps after that run at
Gems' usual speed (`GEMS_COMPILE_WORKERS` sets the pool's size).

What must not defer: a CUDA graph's capture would record ATen's kernels for good, and a parity check
would compare ATen with itself. No miss defers while the current stream captures a graph; `inline()`
turns deferral off for a block (gems.decode's warm-up, whose kernels the capture then finds, uses it),
GEMS_COMPILE=inline for the process.

Triton asks the hook before it looks in its disk cache. In a process after the first (Triton's cache
folder held entries when the pool started), a miss whose binary is on disk (`collect.on_disk`, the
lookup Triton's compile makes first) is loaded on the calling thread, as Triton would without the hook:
reading it takes milliseconds, and neither ATen's answer nor the hand-off to a worker (whose Python
holds the GIL while the calling thread waits) is needed. The lookup needs Triton's own key (a hash of
its installed files); the launch-cache miss has waited for it (runtime/tritonkey.py), and where it is
not computed (no thread hashed it) the miss goes to the pool. With both, a second process's first step
answers almost no call with ATen and is within a second of ATen's (docs/perf.md, Cold start).
GEMS_LOAD_INLINE=0 sends every miss through the pool.

In-place and out= overloads defer only a launch their op declares as the call's first write
(`LaunchCache.run(..., first=True)`): nothing has been written when it misses, so ATen can answer the
whole call. Declared: the _foreach_* ops and _fused_adamw_ (one launch each, which an optimizer's first
step otherwise waited 1.5-1.8 s for), every generated pointwise overload (one launch: zero_, which
autograd's gradient buffers and torch.zeros go through, fill_, copy_, add_, ...; codegen/generator.py)
and the GEMM overloads (mm, bmm, addmm out= and addmm_: their result is written by the last kernel of
matmul.launch only; gems.patch's fused linear cross-entropy calls mm with out= on every chunk).
Any other miss in such a call compiles on the calling thread: a kernel before it may have written an
argument, and ATen would then read what it wrote.

gems.patch's fused modules launch outside the dispatcher and have no ATen op to fall back to: their
public functions mark their calls deferrable themselves and answer a miss with their PyTorch
reference (gems/fused/deferral.py).

What still compiles on the calling thread: the other launches of in-place and out= calls, kernels
launched outside the dispatcher by code that does not opt in (the fused linear cross-entropy's own
kernels, MoE experts), and a kernel whose background compile failed (its own launch then raises the compile error, and the
dispatcher's error policy takes it from there).

Why threads: a worker shares the JIT functions (generated kernels have no module to import them by),
and forking a process whose other threads are running CUDA work is not safe. Triton's front end holds the
GIL, so threads gain less than warmup's processes: 64 compiles of one small kernel took 13.8 s serially,
3.97 s on 8 threads and 2.10 s in 8 processes of a 16-core host (gems/warmup.py).

At exit, Python lets the queued compiles finish: their binaries land in the disk cache for the next run.

Results: ATen's answers in place of Gems' differ only within the op's tolerance; random ops draw
from ATen's generator state instead of Gems' Philox counters for those calls.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from . import collect, progress, settings, tritonkey

_tls = threading.local()
_lock = threading.Lock()
_pool = None            # the compile workers, made (and the hook installed) at the first deferred miss
_queued: set = set()    # (id(JIT function), Triton's key) of every job handed to the pool
_failed: set = set()    # jobs whose compile raised: their launches compile (and raise) on the calling thread
_pending = 0
_done = threading.Condition(_lock)
_stats = {"submitted": 0, "compiled": 0, "failed": 0, "loaded": 0, "compile_s": 0.0}
_answers: dict = {}     # gems.fused op -> calls its reference answered while a kernel compiled (fused/deferral.py)
_said = False
_look_on_disk = False   # Triton's cache folder held entries when the pool started: misses may be on disk
NOTE_AFTER_S = progress.THRESHOLD_S     # background work done sooner than this goes unsaid
SWITCH_S = 0.0002       # the GIL's switch interval while compiles are queued (see the module's docstring)
_switch = None          # (the interval before, the one set) while compiles are queued
_note_timer = None      # the timer that says so once NOTE_AFTER_S have passed with work still queued


def workers() -> int:
    """Compile threads: GEMS_COMPILE_WORKERS (settings.py), else the CPU count less one, 1 to 16."""
    if settings.COMPILE_WORKERS > 0:
        return settings.COMPILE_WORKERS
    return max(1, min(16, (os.cpu_count() or 2) - 1))


WRITES = "writes"   # set_deferring's mark for an in-place or out= call: only its first write may defer


def deferring(first: bool = False) -> bool:
    """Whether a launch-cache miss on this thread may be answered by ATen: inside a functional call,
    or, with `first` (the launch is the call's first write: nothing it writes has been written yet),
    inside an in-place or out= call; outside `inline()`, no CUDA graph capturing on the current
    stream. Asked on misses only."""
    d = getattr(_tls, "defer", False)
    if d is not True and not (first and d is WRITES):
        return False
    return not getattr(_tls, "inline", False) and not capturing()


def capturing() -> bool:
    """A CUDA graph is being captured on the current stream (the user's torch.cuda.graph, torch.compile's
    CUDA graphs): what launches now is replayed for good, so Gems' kernel compiles here and launches,
    as it would without background compilation, rather than ATen's answer being recorded."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


@contextlib.contextmanager
def inline():
    """Kernels this thread launches in the block compile on it, as with GEMS_COMPILE=inline: for work
    that must run Gems' kernels from its first call (capturing a CUDA graph, a parity check)."""
    prev = getattr(_tls, "inline", False)
    _tls.inline = True
    try:
        yield
    finally:
        _tls.inline = prev


def set_deferring(on) -> bool:
    """Mark this thread's calls deferrable (True), deferrable at their first write (WRITES) or not
    (False); the previous mark (the dispatcher puts it back)."""
    prev = getattr(_tls, "defer", False)
    _tls.defer = on
    return prev


def probing() -> bool:
    """Whether a tuning bench on this thread runs its config once, untimed (see `tune_ready`)."""
    return getattr(_tls, "probe", False)


def _start():
    """Make the pool (and install the hook that hands it compiles) at the first deferred miss."""
    global _pool, _look_on_disk
    if _pool is None:
        with _lock:
            if _pool is None:   # the hook first: it is what hands a compile to `submit`
                _look_on_disk = settings.LOAD_INLINE and collect.disk_cache_used()
                collect.install_hook()
                _pool = ThreadPoolExecutor(workers(), thread_name_prefix="gems-compile")


def launch(fn, grid, args, num_warps, num_stages, maxnreg):
    """A launch-cache miss in a deferrable call: the kernel (compiled here only when its background
    compile failed), or NotCompiled while it compiles on the pool."""
    _start()
    return collect.launch(fn, grid, args, num_warps, num_stages, maxnreg, sink=submit)


def ahead(fn, args, num_warps, num_stages, maxnreg):
    """A launch an op will make later in a deferrable call, not in the launch cache: its compile goes
    to the pool now (a binary on disk, or one whose background compile failed, is loaded or compiled
    here), and nothing is launched (see LaunchCache.ahead)."""
    _start()
    collect.ahead(fn, args, num_warps, num_stages, maxnreg, sink=submit)


def tune_ready(configs, bench) -> bool:
    """A tuning miss in a deferrable call: every config runs once, untimed; True when all of them
    had their kernels (the tuner then times them), False when some went to the pool."""
    ready = True
    _tls.probe = True
    try:
        for c in configs:
            try:
                bench(c)
            except collect.not_compiled():
                ready = False
            except Exception:  # noqa: BLE001 - a config that fails as it would when tuned
                continue
    finally:
        _tls.probe = False
    return ready


def submit(job) -> bool:
    """The jit_cache_hook's sink: queue `job`'s compile (once); False (Triton compiles it on the calling
    thread) for a job whose background compile failed, or whose binary Triton loads from disk."""
    global _pending, _said, _note_timer
    k = (id(job[0]), str(job[2]))
    with _lock:
        if k in _failed:
            return False
        if k in _queued:
            return True
    if _look_on_disk and collect.on_disk(job):
        with _lock:
            _stats["loaded"] += 1
        return False
    with _lock:
        if k in _queued:    # queued by another thread meanwhile
            return True
        _queued.add(k)
        if _pending == 0:
            _quick_switches(True)
        _pending += 1
        _stats["submitted"] += 1
        first = not _said
        _said = True
    if first:
        # said only if the pool is still busy a few seconds on (a run whose binaries are mostly on disk
        # is done sooner, and stays silent)
        _note_timer = threading.Timer(NOTE_AFTER_S, _note_if_busy)
        _note_timer.daemon = True
        _note_timer.start()
    _pool.submit(_compile, job, k)
    return True


def _note_if_busy():
    with _lock:
        busy, n = _pending > 0, _stats["submitted"]
    if busy:
        progress.say(f"gems: compiling kernels in the background (first run only, cached on disk; {n} so far); "
                     f"ATen answers their calls meanwhile ...")


def _compile(job, k):
    global _pending
    t0 = time.perf_counter()
    err = None
    tritonkey.wait()
    try:
        kernel = collect.compile_one(job)
        collect.build_launcher(kernel)      # built here, the first launch only loads it
        jf, device, key = job[0], job[1], job[2]
        jf.device_caches[device][0][key] = kernel      # as Triton's own compile path caches it
    except Exception as e:  # noqa: BLE001 - the launch compiles it on the calling thread and raises there
        err = e
    with _lock:
        _stats["compile_s"] += time.perf_counter() - t0
        if err is None:
            _stats["compiled"] += 1
        else:
            _stats["failed"] += 1
            _failed.add(k)
            _queued.discard(k)
        _pending -= 1
        if _pending == 0:
            _quick_switches(False)
            _done.notify_all()


def _quick_switches(on: bool):
    """Shorten the GIL's switch interval (on), or put the one before back (called under _lock)."""
    global _switch
    if on:
        if _switch is None:
            before = sys.getswitchinterval()
            sys.setswitchinterval(min(before, SWITCH_S))
            _switch = (before, sys.getswitchinterval())
    elif _switch is not None:
        before, ours = _switch
        _switch = None
        if sys.getswitchinterval() == ours:
            sys.setswitchinterval(before)


def _after_fork_in_child():
    # a forked child (a DataLoader worker) has none of the pool's threads: it starts its own if it
    # ever defers a launch, with fresh locks (the parent's may have been held at the fork)
    global _pool, _pending, _lock, _done
    _pool, _pending = None, 0
    _queued.clear()
    _quick_switches(False)
    _lock = threading.Lock()
    _done = threading.Condition(_lock)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def wait(timeout: float | None = None) -> bool:
    """Block until every queued compile has finished (True), or `timeout` seconds passed (False)."""
    with _lock:
        return _done.wait_for(lambda: _pending == 0, timeout)


def count_answer(name: str):
    """A call of gems.fused's `name` was answered by its reference while a kernel compiled."""
    with _lock:
        _answers[name] = _answers.get(name, 0) + 1


def answers(reset: bool = False) -> dict:
    """{gems.fused op: calls answered by its reference while a kernel compiled} (zeroed with `reset`)."""
    with _lock:
        out = dict(_answers)
        if reset:
            _answers.clear()
    return out


def stats() -> dict:
    """{"submitted", "compiled", "failed", "pending", "compile_s" (summed over the workers), "loaded" (binaries
    on disk loaded on the calling thread instead)}."""
    with _lock:
        return {**_stats, "pending": _pending}
