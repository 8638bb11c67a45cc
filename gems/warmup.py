"""`gems.warmup(model, example_inputs)`: compile the kernels a model's step needs in parallel, before it runs.

Why: Gems compiles each Triton kernel on its first launch, one after the other, on the calling thread; a
fresh process spends most of a model's first step compiling (a 7B forward: ~29 s against ATen's 1.2 s).
Triton's compiles are independent of each other, and it keeps every binary on disk.

How (collect, then compile):
1. The model runs once in collect mode (runtime/collect.py). A launch whose binary is not in memory
   does not compile: Triton's `jit_cache_hook` records the compile job (function, specialization,
   options) and skips it, and the launch raises `NotCompiled`, an `Unsupported`, so the dispatcher
   answers that call with ATen. The step therefore goes on with right values: every later call sees the
   shapes, dtypes and data it would see in a real step (garbage in a skipped kernel's output could send
   an index out of bounds or change what the model does next). A bucket's first tuning records every
   config's kernels and times nothing.
2. The jobs compile in forked worker processes, which fill Triton's disk cache; the parent then loads
   each binary from there into the function's in-memory cache (milliseconds each).
3. An operation whose first kernel was missing never reached its second one, and code outside the
   dispatcher that cannot fall back (the fused linear cross-entropy's kernels; gems.patch's other fused
   modules answer with their PyTorch reference, gems/fused/deferral.py) lets `NotCompiled` end that run
   early: the run repeats (up to `rounds` times) until it records nothing new. A repeat costs about one ATen
   step plus loading what the last one compiled.
The first real step then finds its kernels compiled; what the runs did not reach compiles there, as
before. Call plans that ATen's answers in collect mode would have fixed (a signature kept on the full
path) are dropped, and the Python path's counts in `gems.stats()` are put back as they were (plans the
C++ fast path replayed meanwhile stay counted).

Why processes, not threads: Triton's front end (Python AST to IR) holds the GIL, and so does much of
the rest; ptxas runs as a subprocess. 64 compiles of one small kernel on a 16-core H200 host took 13.8 s
serially, 3.97 s on 8 threads and 2.10 s in 8 forked processes (on a 2-core host threads were slower
than serial: 2.39 s against 1.87 for 16). Forked, so that a worker inherits every JIT function,
including kernels Gems generates from source (no importable module to name them by); a worker compiles
(and builds the kernel's C launcher) only and never touches CUDA. Why not the simpler design (a launch-cache miss submits
its compile to a pool and the step goes on): the step cannot go on without the kernel's output, unless
ATen computes it, which is what the collect run is.

Side effects: the runs call the model like a step: modules' buffers (batch-norm statistics) are put back
afterwards, and with `train=True` so are the parameters' gradients; inputs the model writes in place
are written. Under the Triton interpreter nothing is compiled: warmup says so once and returns.
"""
from __future__ import annotations

import os
import time

import torch

from .dispatch.state import STATE
from .runtime import backends, collect, progress
from .runtime.plan.cache import NO_PLAN

_said_interpreter = False


def warmup(model, example_inputs, *, train: bool = False, workers: int | None = None, rounds: int = 8) -> dict:
    """Compile, in parallel, the kernels one step of `model` on `example_inputs` needs.

    `example_inputs`: a tensor, a tuple of positional arguments, or a dict of keyword arguments.
    `train`: the step is forward and backward (of the output's `.loss` when it has one, else the sum
    of its first tensor). `workers`: compile processes (default: the CPU count, at most 32).
    Gems must be enabled (gems.enable() or inside use_gems()). Returns {"kernels", "rounds",
    "compile_s", "failed", "seconds", "per_round"}; "per_round" lists each round's collecting run,
    compile (all jobs, and the slowest one alone) and load times in seconds, its new kernels, and its
    three slowest compiles ("slowest": "name[constexprs] seconds" strings, for finding the kernel
    that bounds a round)."""
    global _said_interpreter
    t_start = time.perf_counter()
    info = {"kernels": 0, "rounds": 0, "compile_s": 0.0, "failed": 0, "seconds": 0.0, "per_round": []}
    if backends.interpreting():
        if not _said_interpreter:
            _said_interpreter = True
            progress.say("gems: warmup has nothing to compile under the Triton interpreter (kernels are "
                         "interpreted); it returns at once")
        return info
    if workers is None:
        workers = min(os.cpu_count() or 1, 32)
    snap = _snapshot_dispatch()
    grads = [(p, p.grad) for p in model.parameters()] if train else []
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    seen = set()
    try:
        for _ in range(max(1, rounds)):
            t0 = time.perf_counter()
            jobs = _collect_round(model, example_inputs, train)
            info["rounds"] += 1
            row = {"run_s": time.perf_counter() - t0, "kernels": 0, "compile_s": 0.0, "slowest_s": 0.0,
                   "load_s": 0.0, "slowest": []}
            info["per_round"].append(row)
            jobs = [j for j in jobs if (id(j[0]), str(j[2])) not in seen]
            if not jobs:
                break
            seen.update((id(j[0]), str(j[2])) for j in jobs)
            progress.warming(len(jobs), min(workers, len(jobs)))
            t0 = time.perf_counter()
            results = collect.compile_jobs(jobs, workers)
            row["compile_s"] = time.perf_counter() - t0
            row["slowest_s"] = max(t for t, _ in results)
            row["slowest"] = _slowest(jobs, results)
            row["kernels"] = len(jobs)
            info["compile_s"] += row["compile_s"]
            info["kernels"] += len(jobs)
            info["failed"] += sum(err is not None for _, err in results)
            t0 = time.perf_counter()
            collect.load_jobs(jobs)
            row["load_s"] = time.perf_counter() - t0
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        for p, g in grads:
            p.grad = g
        _restore_dispatch(snap)
    info["seconds"] = time.perf_counter() - t_start
    return info


def _slowest(jobs: list, results: list, n: int = 3) -> list:
    """The `n` longest compiles of a round, slowest first, each "name[constexprs] seconds"."""
    ranked = sorted(zip(results, jobs), key=lambda r: -r[0][0])[:n]
    return [f"{collect.describe(job)} {t:.2f}" for (t, _), job in ranked]


def _collect_round(model, example_inputs, train: bool) -> list:
    """One collecting run of the step; the compile jobs it recorded."""
    collect.start()
    try:
        try:
            _step(model, example_inputs, train)
        except collect.not_compiled():
            pass    # raised outside the dispatcher: the next round gets further
    finally:
        jobs = collect.stop()
    return jobs


def _step(model, example_inputs, train: bool):
    if isinstance(example_inputs, dict):
        args, kwargs = (), dict(example_inputs)
    elif isinstance(example_inputs, (tuple, list)):
        args, kwargs = tuple(example_inputs), {}
    else:
        args, kwargs = (example_inputs,), {}
    if not train:
        with torch.no_grad():
            model(*args, **kwargs)
        return
    for p in model.parameters():
        p.grad = None
    out = model(*args, **kwargs)
    loss = _loss(out)
    if loss is not None and loss.requires_grad:
        loss.backward()


def _loss(out):
    """The scalar a training step differentiates: `.loss`, else the sum of the first tensor found."""
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(out, torch.Tensor):
        return out.float().sum()
    values = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else ()
    for v in values:
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v.float().sum()
    return None


def _snapshot_dispatch():
    """Per overload: its counts, reasons and plan-cache state before the collecting runs."""
    snap = {}
    for name, rt in STATE.ops.items():
        plans = rt.plans
        snap[name] = (list(rt.counts), dict(rt.reasons),
                      None if plans is None else (set(plans.plans), plans.declined, dict(plans.reasons)))
    return snap


def _restore_dispatch(snap):
    """Take back what the collecting runs' ATen answers left: fallback counts and reasons, and the
    signatures they kept off call plans (those record their plans on their next calls)."""
    for name, rt in STATE.ops.items():
        before = snap.get(name)
        counts, reasons, plan_state = before if before is not None else ([0, 0], {}, None)
        rt.counts[:] = counts
        rt.reasons.clear()
        rt.reasons.update(reasons)
        plans = rt.plans
        if plans is None:
            continue
        keys, declined, plan_reasons = plan_state if plan_state is not None else (set(), 0, {})
        for k in [k for k, v in plans.plans.items() if v is NO_PLAN and k not in keys]:
            del plans.plans[k]
        plans.declined = declined
        plans.reasons.clear()
        plans.reasons.update(plan_reasons)
