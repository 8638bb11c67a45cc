"""Milliseconds per decode token of `model.generate`, as a user sees it (generate's own per-step work,
logits processors and stopping checks included), for the benchmark and for users comparing set-ups.

A run of n new tokens is one prefill and n - 1 one-token steps; a run of 1 new token is the prefill
alone. ms per token = (time(n) - time(1)) / (n - 1), each the median of its timed runs, so the
prefill's time (eager in every set-up) cancels out.

A decode step reads every weight once, so `weight_bytes(model) / (ms per token)` against
`copy_roof_gbps()` says how close a set-up is to what the GPU's memory allows.
"""
from __future__ import annotations

import statistics
import time

import torch


def generate_greedy(model, inputs: dict, new_tokens: int, **kw):
    """(tokens [B, new_tokens], per-step logits [B, V] list) of a greedy generate of exactly
    new_tokens tokens."""
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, **kw)
    n = inputs["input_ids"].shape[1]
    return out.sequences[:, n:], list(out.logits)


def ms_per_token(model, inputs: dict, new_tokens: int, runs: int, warmup: int, **kw) -> list:
    """`runs` estimates of the decode steps' ms per token (see the module docstring), after `warmup`
    untimed runs of each length."""
    if new_tokens < 2:
        raise ValueError("ms_per_token: new_tokens must be at least 2 (the first token comes from the prefill)")
    dev = inputs["input_ids"].device
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)

    def once(n):
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw)
        sync()
        return (time.perf_counter() - t0) * 1e3

    for _ in range(warmup):
        once(new_tokens)
        once(1)
    prefill = statistics.median(once(1) for _ in range(max(runs, 1)))
    return [(once(new_tokens) - prefill) / (new_tokens - 1) for _ in range(runs)]


def weight_bytes(model) -> int:
    """Bytes of the weights one decode step reads: every parameter and buffer, the input embedding
    table excepted (a step reads only its tokens' rows) unless the output projection shares it."""
    seen, total = set(), 0
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    skip = emb.weight.data_ptr() if emb is not None and (out is None or out.weight.data_ptr() != emb.weight.data_ptr()) \
        else None
    for t in list(model.parameters()) + list(model.buffers()):
        ptr = t.data_ptr()
        if ptr in seen or ptr == skip:
            continue
        seen.add(ptr)
        total += t.numel() * t.element_size()
    return total


def copy_roof_gbps(device=None, timer=None) -> float:
    """The GPU's device-to-device copy bandwidth, GB/s of bytes read + written: a 512 MiB copy (far beyond
    L2), the median of 10 timed with CUDA events unless `timer(fn) -> ms` is given. The most a stream of
    weights can reach."""
    x = torch.empty(2**29, device=device or "cuda", dtype=torch.uint8)
    y = torch.empty_like(x)
    if timer is None:
        def timer(fn):
            fn()
            times = []
            for _ in range(10):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
            return statistics.median(times)
    ms = timer(lambda: y.copy_(x))
    return 2 * x.numel() / ms / 1e6
