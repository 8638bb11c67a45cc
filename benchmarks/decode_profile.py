"""Where a graphed decode token's time goes: the step's kernels, the graph replay, and generate's host work.

    python -m benchmarks.decode_profile --device cuda [--model llama2] [--batch 32] [--new-tokens 64]
    python -m benchmarks.decode_profile --device cpu         # smoke run: tiny model, Triton interpreter

On the patched model (packed projections) with Gems enabled, bf16 on CUDA:
1. kernels: an eager decode step on a static cache under torch.profiler, device ms per step by kernel
   (a generate of 9 tokens minus one of 1, over 8 steps), the largest first (CUDA only);
2. graphed: ms per token of `generate` through `gems.decode.graphed` (gems.decode.timing), one step's
   replay alone (`gems.decode.replay_ms`), and the same ms per token with generate's own ops (logits
   copy, token choice, stop flag, the next step's mask) on ATen while the step itself runs Gems: what
   Gems' dispatch costs outside the graph;
3. host: perf_counter time per token in generate's phases: `prepare_inputs_for_generation`, the
   graphed forward (its checks, the input copies, the replay's launch, the logits copy) and
   `_update_model_kwargs_for_generation`; the rest of a token is generate's loop (logits processors,
   token choice, stop check, and the wait for the GPU when the check is per step).
Per token minus one replay is the time the GPU is not replaying the step: generate's small kernels, and
host work the GPU waits for. With the stop check deferred (gems.decode.graphed's default) the host runs a
step ahead and only the small kernels remain.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import time


def step_kernels(gen, on_cuda: bool) -> list:
    """[(device ms per step, launches per step, kernel name)] of the eager decode steps, largest first."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    def totals(n):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
            gen(n)
            torch.cuda.synchronize()
        ms, count = collections.Counter(), collections.Counter()
        for e in p.key_averages():
            t = getattr(e, "self_device_time_total", 0) or 0
            if t > 0 and e.device_type == torch.autograd.DeviceType.CUDA:
                ms[e.key] += t / 1e3
                count[e.key] += e.count
        return ms, count
    if not on_cuda:
        return []
    gen(2)
    ms9, n9 = totals(9)
    ms1, n1 = totals(1)
    rows = [((ms9[k] - ms1.get(k, 0.0)) / 8, (n9[k] - n1.get(k, 0)) / 8, k) for k in ms9]
    return sorted((r for r in rows if r[0] > 0), reverse=True)


def host_phases(model, gen) -> dict:
    """{phase: (perf_counter ms per call, calls)} of generate's phases over one generate (module
    docstring, 3); the forward's calls are the decode steps' (the prompt's left out)."""
    spent = collections.defaultdict(list)
    names = ("prepare_inputs_for_generation", "forward", "_update_model_kwargs_for_generation")
    saved = {n: model.__dict__.get(n) for n in names}

    def timed(name, f):
        @functools.wraps(f)
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                spent[name].append(time.perf_counter() - t)
        return wrapper
    for n in names:
        object.__setattr__(model, n, timed(n, getattr(model, n)))
    try:
        gen()
    finally:
        for n, old in saved.items():
            if old is None:
                model.__dict__.pop(n, None)
            else:
                object.__setattr__(model, n, old)
    # the first forward is the prompt's (eager): the decode steps' are the others
    spent["forward"] = spent["forward"][1:]
    return {n: (sum(ts) * 1e3 / max(len(ts), 1), len(ts)) for n, ts in spent.items()}


@contextlib.contextmanager
def gems_inside_forward(model):
    """Gems off for generate's own ops, on inside the model's (graphed) forward."""
    import gems
    inner = model.__dict__["forward"]

    def forward(*a, **k):
        with gems.use_gems():
            return inner(*a, **k)
    gems.disable()
    object.__setattr__(model, "forward", forward)
    try:
        yield
    finally:
        object.__setattr__(model, "forward", inner)
        gems.enable()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="llama2")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args(argv)
    on_cuda = args.device.startswith("cuda")
    if not on_cuda:
        from benchmarks.interpreter import use_interpreter_for
        use_interpreter_for(args.device)
    import torch

    import gems
    import gems_models as M
    from gems.decode import graphed, replay_ms, ungraphed
    from gems.decode.attention import install as install_decode_attention
    from gems.decode.timing import ms_per_token
    seq_len = args.seq_len or (128 if on_cuda else 8)
    new = args.new_tokens or (64 if on_cuda else 4)
    bundle = M.build(M.resolve(args.model), size="full" if on_cuda else "tiny", device=args.device,
                     dtype="bfloat16" if on_cuda else "float32", batch=args.batch, seq_len=seq_len, seed=0)
    model = bundle.model.eval()
    inputs = {k: v for k, v in bundle.inputs.items() if k in ("input_ids", "attention_mask")}

    def gen(n, **kw):
        with torch.no_grad():
            return model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                  pad_token_id=0, **kw)
    static = dict(cache_implementation="static", disable_compile=True)
    gems.enable()
    gems.patch(model, pack_projections=True)
    print(f"{args.model}, batch {args.batch}, {seq_len}-token prompt, {new} new tokens, on {args.device}")
    restore = install_decode_attention(model)
    try:
        rows = step_kernels(lambda n: gen(n, **static), on_cuda)
    finally:
        if restore is not None:
            restore()
    if rows:
        print(f"eager decode step, device ms per step by kernel (total {sum(r[0] for r in rows):.3f}):")
        for ms, n, name in rows[:16]:
            print(f"  {ms:7.3f} ms  x{n:5.1f}  {name[:100]}")
    graphed(model, max_batch=args.batch, max_cache_len=max(256, seq_len + new))
    try:
        gen(new)
        med = lambda xs: sorted(xs)[len(xs) // 2]    # noqa: E731
        per_token = med(ms_per_token(model, inputs, new, args.runs, 1, pad_token_id=0))
        replay = replay_ms(model) if on_cuda else None
        with gems_inside_forward(model):
            aten_outside = med(ms_per_token(model, inputs, new, args.runs, 1, pad_token_id=0))
        phases = host_phases(model, lambda: gen(new))
    finally:
        ungraphed(model)
    print(f"graphed generate: {per_token:.3f} ms per token"
          + (f"; one replay alone {replay:.3f} ms, the rest {per_token - replay:.3f} ms" if replay else "")
          + f"; generate's own ops on ATen: {aten_outside:.3f} ms per token")
    print("host, ms per call (calls) in one generate, decode steps only for the forward:")
    for name, (ms, n) in phases.items():
        print(f"  {ms:7.3f} ms  x{n:3d}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
