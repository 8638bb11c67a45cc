"""Timing shared by the kernel benchmarks: the median of a call's time in ms."""
from __future__ import annotations

import statistics
import time


def median_ms(fn, device: str, *, warmup: int, rep: int, cpu_runs: int) -> float:
    """On CUDA, triton.testing.do_bench's median (warm-up and repetitions in ms, L2 cleared between
    calls); elsewhere (the interpreter: timings only show that the path runs) one untimed call and the
    median of `cpu_runs` timed ones."""
    if device == "cuda":
        from triton.testing import do_bench   # after the caller chose the interpreter or not
        return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
    fn()
    ts = []
    for _ in range(cpu_runs):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)
