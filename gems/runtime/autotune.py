"""Autotuning with results cached per bucketed shape, in memory and on disk.

Unlike `triton.autotune`, nothing here runs on the hot path after the first call for a bucket: the
wrapper computes a small bucket key (e.g. the next power of two of the row length), and `pick`
returns the stored config from a dict. A miss benchmarks every config once with
`triton.testing.do_bench` and stores the winner in `<cache dir>/autotune/<arch>/<name>.json`.

The cache dir is `$GEMS_CACHE_DIR`, else `$XDG_CACHE_HOME/gems`, else `~/.cache/gems`. Writes take an
advisory file lock, merge with what other processes wrote meanwhile, and replace the file atomically,
so concurrent processes never see a torn file and never lose each other's entries.
On a backend that cannot time kernels (the interpreter) the first config is used.
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Callable, Sequence

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
# slower than the one it displaced (2048 x 100008 x 4096, H200, session 30). 0: off, the default until a
# GPU A/B has measured it (benchmarks.gemm --confirm-rounds, with a fresh GEMS_CACHE_DIR per side).
CONFIRM_ROUNDS = 0
CONFIRM_TOP = 3


class Autotuner:
    def __init__(self, name: str, configs: Sequence[dict]):
        self.name = name
        self.configs = [dict(c) for c in configs]
        self._best: dict[str, dict] | None = None
        self._lock = threading.Lock()

    def _path(self) -> Path:
        from .backends import backend
        return cache_dir() / "autotune" / backend().arch / f"{self.name}.json"

    def _load(self) -> dict:
        try:
            return json.loads(self._path().read_text())
        except (OSError, ValueError):
            return {}

    def pick(self, bucket, bench: Callable[[dict], float]) -> dict:
        """Best config for `bucket` (any repr-able value); `bench(config)` runs one config."""
        best = self._best
        if best is None:
            with self._lock:
                if self._best is None:
                    self._best = self._load()
            best = self._best
        k = repr(bucket)
        cfg = best.get(k)
        if cfg is not None:
            return cfg
        from .backends import backend
        from .plan import suspended, taint
        if not backend().can_benchmark or len(self.configs) == 1:
            cfg = self.configs[0]
            best[k] = cfg
            return cfg
        taint("autotuning", transient=True)   # benchmark launches are not the call's: plan the next call
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


def bench_ms(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench
    return do_bench(fn, warmup=5, rep=20, return_mode="median")
