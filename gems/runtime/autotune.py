"""Autotuning with results cached per bucketed shape, in memory and on disk.

Unlike `triton.autotune`, nothing here runs on the hot path after the first call for a bucket: the
wrapper computes a small bucket key (e.g. the next power of two of the row length), and `pick`
returns the stored config from a dict. A miss benchmarks every config once (`bench_ms`: L2 cleared,
then one run between two events, behind a sleep kernel that covers the host's launch; TIMING "do_bench":
`triton.testing.do_bench`) and stores the winner in `<cache dir>/autotune/<arch>/<name>-hold.json`.

Picks shipped with Gems (`gems/runtime/tuned/<arch>/<name>.json`, written by
`scripts/ship_tuned.py` from a machine's cache after `gems-coverage tune`) answer a bucket before any
tuning, so a first call on a measured GPU does not tune; the machine's own cache overrides them.

The cache dir is `$GEMS_CACHE_DIR`, else `$XDG_CACHE_HOME/gems`, else `~/.cache/gems`. Writes take an
advisory file lock, merge with what other processes wrote meanwhile, and replace the file atomically,
so concurrent processes never see a torn file and never lose each other's entries.
On a backend that cannot time kernels (the interpreter) the first config is used. A bucket's first tuning
counts towards runtime/progress.py's one-line note.
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Callable, Sequence

from . import background, backends, collect, progress
from .plan.recording import suspended, taint

try:
    import fcntl
except ImportError:  # pragma: no cover - non-POSIX
    fcntl = None


def cache_dir() -> Path:
    root = os.environ.get("GEMS_CACHE_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "gems"


# Confirmation rounds: after one timing of every config, the CONFIRM_TOP fastest are timed CONFIRM_ROUNDS
# more times, taking turns (clocks and neighbours drift while a bucket is tuned), and the lowest median of
# each one's timings wins. Why: one timing each picked a GEMM config that the benchmark then timed 17%
# slower than the one it displaced (2048 x 100008 x 4096 on an H200). 0: off, the default until a
# GPU A/B has measured it (benchmarks.gemm --confirm-rounds, with a fresh GEMS_CACHE_DIR per side).
CONFIRM_ROUNDS = 0
CONFIRM_TOP = 3


# tuned picks shipped as package data, per GPU architecture (the cache's layout)
SHIPPED_DIR = Path(__file__).resolve().parent / "tuned"


class Autotuner:
    def __init__(self, name: str, configs: Sequence[dict]):
        self.name = name
        self.configs = [dict(c) for c in configs]
        self._best: dict[str, dict] | None = None
        self._lock = threading.Lock()

    def _file(self) -> str:
        # (picks made under another TIMING are another file: "do_bench" keeps the name it always had)
        suffix = "" if TIMING == "do_bench" else f"-{TIMING}"
        return f"{self.name}{suffix}.json"

    def _path(self) -> Path:
        return cache_dir() / "autotune" / backends.backend().arch / self._file()

    def _load(self) -> dict:
        try:
            return json.loads(self._path().read_text())
        except (OSError, ValueError):
            return {}

    def _shipped(self) -> dict:
        """The picks shipped with Gems for this GPU architecture (SHIPPED_DIR/<arch>/<file>), restricted
        to configs this tuner still has (a config dropped from the list since is tuned again)."""
        try:
            data = json.loads((SHIPPED_DIR / backends.backend().arch / self._file()).read_text())
        except (OSError, ValueError):
            return {}
        return {k: c for k, c in data.items() if c in self.configs}

    def pick(self, bucket, bench: Callable[[dict], float]) -> dict:
        """Best config for `bucket` (any repr-able value); `bench(config)` runs one config."""
        best = self._best
        if best is None:
            with self._lock:
                if self._best is None:
                    self._best = {**self._shipped(), **self._load()}   # this machine's own picks win
            best = self._best
        k = repr(bucket)
        cfg = best.get(k)
        if cfg is not None:
            return cfg
        if not backends.backend().can_benchmark or len(self.configs) == 1:
            cfg = self.configs[0]
            best[k] = cfg
            return cfg
        taint("autotuning", transient=True)   # benchmark launches are not the call's: plan the next call
        if collect.active():    # gems.warmup's collecting run: every config's kernels recorded, nothing timed
            return collect.tune(self.configs, bench)
        if background.deferring():
            with suspended():
                ready = background.tune_ready(self.configs, bench)
            if not ready:   # GEMS_COMPILE=background: some config is compiling; ATen answers, nothing stored
                raise collect.not_compiled()(f"{self.name}: tuning's kernels not compiled yet")
        t0 = progress.clock()
        timings = []
        with suspended():
            for c in self.configs:
                try:
                    timings.append((bench(c), c))
                except Exception:  # a config that fails to compile (e.g. out of shared memory) is skipped
                    continue
        if not timings:
            raise RuntimeError(f"autotune {self.name}: every config failed for {k}")
        if CONFIRM_ROUNDS > 0 and len(timings) > 1:
            with suspended():
                cfg = _confirm(sorted(timings, key=lambda t: t[0])[:CONFIRM_TOP], bench)
        else:
            cfg = min(timings, key=lambda t: t[0])[1]
        best[k] = cfg
        self._store(k, cfg)
        progress.tuned(self.name, k, progress.clock() - t0, self._path())
        return cfg

    def _store(self, k: str, cfg: dict):
        path = self._path()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path.with_suffix(".lock"), "w") as lock:
                if fcntl is not None:
                    fcntl.flock(lock, fcntl.LOCK_EX)
                data = self._load()
                data[k] = cfg
                tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
                tmp.write_text(json.dumps(data, indent=0, sort_keys=True))
                os.replace(tmp, path)
        except OSError:
            pass  # a read-only cache dir only costs re-tuning in the next process


def _confirm(top, bench: Callable[[dict], float]) -> dict:
    """The config of `top` ((first time, config), fastest first) with the lowest median over its first
    time and CONFIRM_ROUNDS more, the configs taking turns (a config failing now counts as infinitely slow)."""
    import statistics
    times = [[t] for t, _ in top]
    for _ in range(CONFIRM_ROUNDS):
        for ts, (_, c) in zip(times, top):
            try:
                ts.append(bench(c))
            except Exception:  # noqa: BLE001 - it ran once already; a failure now rules it out
                ts.append(float("inf"))
    best = min(range(len(top)), key=lambda i: (statistics.median(times[i]), i))
    return top[best][1]


# How the tuner times a config: "hold" (the default) or "do_bench". Both clear L2 and bracket one run of the
# config between two events; "hold" first enqueues a sleep kernel sized at twice the host's time for one
# launch, so the GPU waits while the host enqueues the run and the events see the run's kernels alone.
# "do_bench" (triton.testing.do_bench) has only its L2 clear (~75 us of GPU work) in front of the run: a
# config whose Python launch takes longer (a Gluon GEMM builds its TMA descriptors per launch: 40-130 us)
# is charged part of its host time, by an amount that varies from run to run. Measured on an H200: on the
# 20 model GEMMs above 1.10x cuBLAS, do_bench timed some Gluon configs at up to 2.9x what the held timing
# measured, and its picks differed on 8 of the 20 (geomean device time of the picks 1.177 vs 1.146x
# cuBLAS; worst addmm 512 x 768 x 3072: 1.60 vs 1.15x); tuning all 85 model GEMMs with "hold" cut Gems'
# GEMM time by 1.3% (geomean; two tuning runs, whose run-to-run spread is about as large) against a
# do_bench tuning, mm 768 x 3072 x 4096 by 17%. An earlier A/B on 63 shapes had found no difference in
# the geomean (1.018 vs 1.017). In a model the planned C++ path
# launches these configs, so the tuner's Python launch cost is not what the call pays. $GEMS_TUNE_TIMING
# sets it; each timing keeps its own cache file (`Autotuner._path`), so picks made one way are not served
# for the other.
TIMING = os.environ.get("GEMS_TUNE_TIMING", "hold")
TIMINGS = ("do_bench", "hold")


def bench_ms(fn: Callable[[], object]) -> float:
    """Median device time (ms) of one run of `fn`, L2 cleared before each run (TIMING says how).

    In gems.warmup's collect mode `fn` runs once, untimed, and 0.0 is returned: that run records the
    config's uncompiled kernels (or launches the compiled ones), and collect mode stores no pick, so a
    timing would be thrown away; every collecting round would time every compiled config again."""
    if collect.active() or background.probing():
        fn()
        return 0.0
    if TIMING == "hold":
        return held_ms(fn)
    if TIMING != "do_bench":
        raise ValueError(f"autotune.TIMING {TIMING!r}: one of {', '.join(TIMINGS)}")
    from triton.testing import do_bench
    return do_bench(fn, warmup=5, rep=20, return_mode="median")


class _Cuda:
    """The few device calls held_ms makes (a seam: tests replace it with a recorder)."""

    def __init__(self):
        import torch
        from triton import runtime
        self.torch, self.driver = torch, runtime.driver.active

    def event(self):
        return self.torch.cuda.Event(enable_timing=True)

    def sleep(self, cycles: int):
        self.torch.cuda._sleep(cycles)

    def sync(self):
        self.torch.cuda.synchronize()

    def l2_buffer(self):
        return self.driver.get_empty_cache_for_benchmark()

    def clear(self, buf):
        self.driver.clear_cache(buf)

    def device(self):
        return self.torch.cuda.current_device()


_CYCLES_PER_MS: dict = {}


def _cycles_per_ms(dev: "_Cuda") -> float:
    """The sleep kernel's spin cycles per millisecond on this device (measured once per process)."""
    key = dev.device()
    if key not in _CYCLES_PER_MS:
        dev.sleep(1000)
        s, e = dev.event(), dev.event()
        s.record()
        dev.sleep(2_000_000)
        e.record()
        dev.sync()
        _CYCLES_PER_MS[key] = 2_000_000 / max(s.elapsed_time(e), 1e-3)
    return _CYCLES_PER_MS[key]


def held_ms(fn: Callable[[], object], warmup_ms: float = 5, rep_ms: float = 20, dev=None) -> float:
    """do_bench's measurement (L2 cleared, then `fn` between two events, median over about rep_ms of runs)
    with a sleep kernel between the clear and the first event, sized at twice the host's time for one
    call of `fn` plus 20 us: the host enqueues `fn` while the GPU sleeps, so the events bracket `fn`'s
    kernels only and the host's launch cost never enters the time."""
    import statistics
    import time
    dev = dev or _Cuda()
    fn()
    dev.sync()
    host_ms = float("inf")
    for _ in range(3):                       # the host's time to enqueue one call (best of three)
        t0 = time.perf_counter()
        fn()
        host_ms = min(host_ms, (time.perf_counter() - t0) * 1e3)
    dev.sync()
    hold_ms = 2 * host_ms + 0.02
    cycles = int(hold_ms * _cycles_per_ms(dev))
    buf = dev.l2_buffer()
    s, e = dev.event(), dev.event()
    s.record()
    for _ in range(5):
        fn()
    e.record()
    dev.sync()
    per_run = s.elapsed_time(e) / 5 + hold_ms + 0.01   # + the clear's launch, roughly
    for _ in range(max(1, int(warmup_ms / per_run))):
        fn()
    n = max(5, min(1000, int(rep_ms / per_run)))
    starts, ends = [dev.event() for _ in range(n)], [dev.event() for _ in range(n)]
    for i in range(n):
        dev.clear(buf)
        dev.sleep(cycles)
        starts[i].record()
        fn()
        ends[i].record()
    dev.sync()
    return statistics.median(st.elapsed_time(en) for st, en in zip(starts, ends))
