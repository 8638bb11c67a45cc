"""Collect mode: launch-cache misses record what Triton would compile instead of compiling it.

gems/warmup.py runs a model once in this mode. A launch whose binary Triton holds in memory runs as
usual; a miss (runtime/launch.py) asks Triton for the kernel with `triton.knobs.runtime.jit_cache_hook`
set to `_record`, which notes the compile job (the JIT function, its specialization, its options and
target) and tells Triton to skip the compile; the launch then raises NotCompiled (`not_compiled()`, an
`Unsupported`), so the dispatcher answers the call with ATen and the step goes on with right values. The
hook only acts on launches that come through a launch-cache miss in collect mode (a thread-local flag):
any other Triton launch compiles as usual, so no code gets an unlaunched kernel it does not expect.

The same hook serves background compilation (runtime/background.py): there a launch-cache miss of a
functional op hands its job to a sink (`launch(..., sink=...)`) that compiles it on a thread pool.

`compile_jobs` then compiles the jobs (and builds their C launchers) in forked worker processes, which
fill Triton's disk cache, and
`load_jobs` loads each binary from that cache into the JIT function's in-memory cache, so the next
launch of the same specialization finds it without compiling.
"""
from __future__ import annotations

import hashlib
import json
import os
import threading
import time

import triton

from . import tritonkey

_tls = threading.local()
_jobs: dict = {}      # (id(jit function), Triton's cache key) -> job tuple, while collecting
_active = False       # a process-wide switch: read only on launch-cache misses and tuning misses


_not_compiled = None


def not_compiled() -> type:
    """The exception class NotCompiled, an `Unsupported`: the launch needs a binary that collect mode
    only recorded, and ATen answers the call."""
    global _not_compiled
    if _not_compiled is None:
        # deferred: gems.registry imports the runtime package, which imports this module
        from ..registry import Unsupported

        class NotCompiled(Unsupported):
            pass
        _not_compiled = NotCompiled
    return _not_compiled


def active() -> bool:
    return _active


_saved_hook = None    # the jit_cache_hook collect mode replaced, put back when it stops


_installs = 0         # collect mode and background compilation each hold the hook while they need it


def install_hook():
    """Put `_record` in Triton's jit_cache_hook (the hook it replaces is kept and put back by the
    last `uninstall_hook`; it still sees every launch `_record` does not record)."""
    global _installs, _saved_hook
    if _installs == 0 and triton.knobs.runtime.jit_cache_hook is not _record:
        _saved_hook = triton.knobs.runtime.jit_cache_hook
        triton.knobs.runtime.jit_cache_hook = _record
    _installs += 1


def uninstall_hook():
    global _installs, _saved_hook
    _installs = max(0, _installs - 1)
    if _installs == 0:
        if triton.knobs.runtime.jit_cache_hook is _record:
            triton.knobs.runtime.jit_cache_hook = _saved_hook
        _saved_hook = None


def start():
    """Turn collect mode on (one collector at a time, process-wide: the hook is Triton's global knob)."""
    global _active
    _jobs.clear()
    install_hook()
    _active = True


def stop() -> list:
    """Turn collect mode off (the hook it replaced is back unless background compilation holds it);
    the compile jobs it recorded."""
    global _active
    if _active:
        _active = False
        uninstall_hook()
    jobs = list(_jobs.values())
    _jobs.clear()
    return jobs


def launch(fn, grid, args, num_warps, num_stages, maxnreg, sink=None, warmup=False):
    """A launch-cache miss in collect mode (or, with `sink`, of a call background compilation may
    defer): the kernel Triton holds in memory (launched, unless `warmup`), or NotCompiled once the
    compile job is recorded (`sink(job)` takes it; a sink returning False has Triton compile it here
    instead)."""
    _tls.recording = True
    _tls.sink = sink
    try:
        if warmup:
            kernel = fn.warmup(*args, grid=grid, num_warps=num_warps, num_stages=num_stages, maxnreg=maxnreg)
        else:
            kernel = fn[grid](*args, num_warps=num_warps, num_stages=num_stages, maxnreg=maxnreg)
    finally:
        _tls.recording = False
        _tls.sink = None
    if kernel is None:
        raise not_compiled()("kernel not compiled yet")
    return kernel


def ahead(fn, args, num_warps, num_stages, maxnreg, sink=None):
    """Record the compile of a launch an op makes later in the call (see LaunchCache.ahead), or hand
    it to `sink` as `launch` does; launch nothing."""
    try:
        launch(fn, (1,), args, num_warps, num_stages, maxnreg, sink=sink, warmup=True)
    except not_compiled():
        pass


def tune(configs, bench):
    """A tuning miss in collect mode: every config's launch is recorded (its bench raises NotCompiled
    at its first uncompiled kernel), nothing is timed or stored; the first config answers."""
    for c in configs:
        try:
            bench(c)
        except Exception:  # noqa: BLE001 - NotCompiled, or a config that fails as it would when tuned
            continue
    return configs[0]


def _record(*, key, fn, compile, **kw):
    """Triton's jit_cache_hook: True (skip the compile) for a launch-cache miss in collect mode or one
    background compilation takes; any other launch goes to the hook this one replaced."""
    if not getattr(_tls, "recording", False):
        return _saved_hook(key=key, fn=fn, compile=compile, **kw) if _saved_hook is not None else False
    jf = fn.jit_function
    device = compile["device"]
    _, _, target, backend, _ = jf.device_caches[device]
    # the options object itself is not handed to the hook: rebuilt as JITFunction.preload does
    opts = json.loads(compile["specialization_data"])["options"]
    options = backend.parse_options({k: tuple(v) if isinstance(v, list) else v for k, v in opts.items()})
    job = (jf, device, key, compile["signature"], compile["constants"], compile["configs"][0], options, target)
    sink = getattr(_tls, "sink", None)
    if sink is not None:
        return sink(job) is not False
    _jobs.setdefault((id(jf), str(key)), job)
    return True


def describe(job) -> str:
    """A job as "name[constexpr=value, ..., warps, stages]": which kernel, in which configuration."""
    jf = job[0]
    constants, options = (job[4], job[6]) if len(job) > 6 else ({}, None)
    name = getattr(getattr(jf, "fn", None), "__name__", None) or getattr(jf, "__name__", None) or str(jf)
    try:
        names = jf.arg_names
        consts = ", ".join(f"{names[k[0]]}={v}" for k, v in constants.items()
                           if isinstance(k, tuple) and len(k) == 1 and isinstance(v, (int, float, bool, str)))
    except Exception:  # noqa: BLE001 - a description only: the name alone will do
        consts = ""
    launch = ", ".join(f"{k}={getattr(options, k)}" for k in ("num_warps", "num_stages") if hasattr(options, k))
    return f"{name}[{', '.join(p for p in (consts, launch) if p)}]"


def compile_one(job):
    """Compile `job` (fills Triton's disk cache); the compiled kernel."""
    jf, _, _, signature, constants, attrs, options, target = job
    src = jf.ASTSource(jf, signature, constants, attrs)
    return jf.compile(src, target=target, options=options.__dict__)


def disk_cache_used() -> bool:
    """Whether Triton's disk cache folder holds anything (a process after the first on this machine), or
    cannot be looked at (a cache manager of the user's own)."""
    if triton.knobs.cache.manager_class is not None:
        return True
    folder = triton.knobs.cache.dir
    try:
        with os.scandir(folder) as entries:
            return any(True for _ in entries)
    except OSError:
        return False


def on_disk(job) -> bool:
    """Whether Triton's disk cache holds `job`'s binary, looked up as Triton's compile() looks before it
    compiles (its cache key, then the kernel's metadata group in that key's folder): compiling the job
    would then only read files. False when that cannot be told cheaply: Triton's own key (a hash of its
    installed files, runtime/tritonkey.py) is not computed yet, a forced recompile
    (TRITON_ALWAYS_COMPILE), or Triton's internals not as this expects."""
    try:
        from triton.compiler import compiler as tc
        if triton.knobs.compilation.always_compile or not tritonkey.ready():
            return False
        jf, _, _, signature, constants, attrs, options, target = job
        src = jf.ASTSource(jf, signature, constants, attrs)
        backend = tc.make_backend(target)
        opts = backend.parse_options(dict(options.__dict__, **src.parse_options()))
        key = tc.get_cache_key(src, backend, opts, env_vars=tc.get_cache_invalidating_env_vars())
        name = f"{src.name[:150]}.json"
        group = tc.get_cache_manager(hashlib.sha256(key.encode("utf-8")).hexdigest()).get_group(name)
        return bool(group) and name in group
    except Exception:  # noqa: BLE001 - not known: the job goes to the pool, as any other
        return False


_pending: list = []   # the jobs a forked worker compiles, by index (inherited, never pickled)


def _worker(i: int):
    t0 = time.perf_counter()
    try:
        kernel = compile_one(_pending[i])
    except Exception as e:  # noqa: BLE001 - the real launch compiles it again and raises there
        return i, time.perf_counter() - t0, f"{type(e).__name__}: {e}"
    # built here, the parent only loads it. The driver object was made in the parent before the fork;
    # making a launcher touches no device
    build_launcher(kernel)
    return i, time.perf_counter() - t0, None


def build_launcher(kernel):
    """Build the C launcher of a compiled kernel, which Triton otherwise builds at its first launch
    with the host C compiler (~0.3 s) and keeps in its disk cache; nothing when that fails (the first
    launch builds it then)."""
    try:
        triton.runtime.driver.active.launcher_cls(kernel.src, kernel.metadata)
    except Exception:  # noqa: BLE001
        pass


def compile_jobs(jobs: list, workers: int) -> list:
    """Compile `jobs` in `workers` forked processes (serially in this one where fork is unavailable or
    workers <= 1); per job (seconds, error or None)."""
    import multiprocessing as mp    # deferred: only a warmup compiles in processes (import gems stays light)
    global _pending
    if workers <= 1 or len(jobs) <= 1 or "fork" not in mp.get_all_start_methods():
        return [_worker_local(j) for j in jobs]
    _pending = list(jobs)
    tritonkey.wait()    # the workers inherit Triton's key instead of each hashing its files again
    try:
        # fork: the workers inherit every JIT function (generated kernels have no importable module);
        # they compile only (no CUDA call), so the parent's CUDA context is never used in a child
        with mp.get_context("fork").Pool(min(workers, len(jobs))) as pool:
            done = pool.map(_worker, range(len(jobs)), chunksize=1)
    finally:
        _pending = []
    return [(t, err) for _, t, err in sorted(done)]


def _worker_local(job):
    t0 = time.perf_counter()
    try:
        compile_one(job)
    except Exception as e:  # noqa: BLE001
        return time.perf_counter() - t0, f"{type(e).__name__}: {e}"
    return time.perf_counter() - t0, None


def load_jobs(jobs: list) -> int:
    """Put each job's binary (from Triton's disk cache, or compiled now) into its JIT function's
    in-memory cache, as Triton's own compile path does; the number loaded."""
    n = 0
    for job in jobs:
        jf, device, key = job[0], job[1], job[2]
        try:
            kernel = compile_one(job)
        except Exception:  # noqa: BLE001 - the real launch compiles it again and raises there
            continue
        jf.device_caches[device][0][key] = kernel
        n += 1
    return n
