"""Fused RoPE, cross-entropy and fused linear cross-entropy: ATen (Hugging Face's unfused code) vs
Gems (`gems.fused`) vs Liger-Kernel when importable, side by side in one process.

    python -m benchmarks.fused_rope_loss                    # GPU, Llama-2-7B shapes, bf16
    python -m benchmarks.fused_rope_loss --quick -o out.json
    python -m benchmarks.fused_rope_loss --device cpu       # smoke test: tiny shapes, Triton interpreter

Per case and mode (forward; forward+backward): median ms (`triton.testing.do_bench`; on CPU a
median of a few wall-clock runs), ratio to ATen and to Liger, and for the losses the peak memory
of one forward+backward above what the inputs hold (torch.cuda.max_memory_allocated).
Implementations:
- rope: HF's apply_rotary_pos_emb (ATen, ~8 kernels) / gems.fused.rope / liger_rotary_pos_emb (in
  place, on its own copies); q and k as HF makes them (proj output viewed [B, S, H, D] and
  transposed), cos/sin [1, S, D] from Llama's rotary embedding.
- cross_entropy: F.cross_entropy on the bf16 logits (aten), HF's ForCausalLMLoss path with the fp32
  upcast (aten-hf), gems.fused.cross_entropy (and gems-2pass: its forward forced to stream each row
  twice instead of holding it in registers, to choose the default), LigerCrossEntropyFunction (it
  overwrites its input with the gradient; given its own copy of the logits).
- fused linear CE: logits = hidden @ W.T then the above (aten, aten-hf) / gems.fused.fused_linear_cross_entropy
  (gems: its default chunks; gems-lowmem: chunk_size="low_memory", Liger's rule) /
  LigerFusedLinearCrossEntropyFunction. "fwd" runs under torch.no_grad() (an eval loss); "fwd+bwd"
  asks for d(hidden) and d(W).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from benchmarks.interpreter import use_interpreter_for


def _liger():
    try:
        import liger_kernel  # noqa: F401
        from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction
        try:
            from liger_kernel.transformers.rope import liger_rotary_pos_emb
        except Exception:     # older layouts: the autograd Function directly
            from liger_kernel.ops.rope import LigerRopeFunction
            liger_rotary_pos_emb = LigerRopeFunction.apply
        return (dict(rope=liger_rotary_pos_emb, ce=LigerCrossEntropyFunction,
                     flce=LigerFusedLinearCrossEntropyFunction), None)
    except Exception as e:  # noqa: BLE001 - report whatever stops it
        return None, f"{type(e).__name__}: {e}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--quick", action="store_true", help="fewer cases and shorter timing")
    ap.add_argument("-o", "--output", default=None, help="write the results as JSON")
    ap.add_argument("--only", default="", help="cases whose name contains this")
    args = ap.parse_args(argv)
    cpu = args.device == "cpu"
    use_interpreter_for(args.device)   # before triton is imported (gems imports it)
    import torch
    import torch.nn.functional as F

    from gems.fused import cross_entropy_loss as gloss, linear_cross_entropy as glinear
    from gems.fused import rotary as grot

    if not cpu and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu for the smoke test", file=sys.stderr)
        return 2
    dev = args.device
    dtype = torch.bfloat16 if not cpu else torch.float32   # the interpreter computes bf16 wrongly
    liger, why = _liger() if not cpu else (None, "not run on CPU (Triton interpreter)")
    if liger is None:
        print(f"Liger-Kernel unavailable: {why}")
    try:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as hf_rope
    except Exception as e:  # noqa: BLE001
        print(f"transformers unavailable ({e}); ATen rope is gems.fused.rotary.reference_rope")
        hf_rope = grot.reference_rope

    if cpu:
        from triton.runtime.interpreter import InterpreterError  # noqa: F401 - the interpreter is in use

        def bench(fn):
            fn()
            ts = []
            for _ in range(3):
                t0 = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(ts)
    else:
        from triton.testing import do_bench

        def bench(fn):
            return do_bench(fn, warmup=10 if args.quick else 25, rep=40 if args.quick else 100, return_mode="median")

    def peak_mib(fn):
        if cpu:
            return None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20

    def randn(*shape, grad=False):
        return torch.randn(*shape, device=dev, dtype=dtype).requires_grad_(grad)

    cases = []   # (name, {impl: (fwd, fwdbwd)}, measure_memory)

    # ---------------------------------------------------------------- rope
    rope_shapes = [(1, 32, 2048, 128), (4, 32, 1024, 128), (1, 32, 1, 128)]
    if args.quick:
        rope_shapes = rope_shapes[::2]
    if cpu:
        rope_shapes = [(1, 4, 8, 64), (1, 4, 1, 64)]
    for B, H, S, D in rope_shapes:
        qp, kp = randn(B, S, H * D, grad=True), randn(B, S, H * D, grad=True)
        # HF's Llama rotary embedding: emb = cat(freqs, freqs), freqs = pos * 10000^(-2i/D)
        inv = 1.0 / (10000 ** (torch.arange(0, D, 2, device=dev, dtype=torch.float32) / D))
        pos = torch.arange(4096 - S, 4096, device=dev, dtype=torch.float32)   # decode: the last position
        emb = torch.cat([pos[:, None] * inv[None], pos[:, None] * inv[None]], -1)[None]
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        gq, gk = randn(B, H, S, D), randn(B, H, S, D)

        def mk(f, qp=qp, kp=kp, cos=cos, sin=sin, gq=gq, gk=gk, B=B, S=S, H=H, D=D):
            def views():
                return qp.view(B, S, H, D).transpose(1, 2), kp.view(B, S, H, D).transpose(1, 2)

            def fwd():
                with torch.no_grad():
                    q, k = views()
                    return f(q, k, cos, sin)

            def fwdbwd():
                q, k = views()
                qe, ke = f(q, k, cos, sin)
                return torch.autograd.grad((qe, ke), (qp, kp), (gq, gk))
            return fwd, fwdbwd
        impls = {"aten": mk(hf_rope), "gems": mk(grot.rope)}
        if liger:   # Liger rotates q and k in place: its own copies
            impls["liger"] = mk(liger["rope"], qp=qp.detach().clone().requires_grad_(),
                                kp=kp.detach().clone().requires_grad_())
        cases.append((f"rope q,k [{B},{H},{S},{D}]", impls, False))

    # ---------------------------------------------------------------- cross-entropy
    ce_shapes = [(8192, 32000), (4096, 32000)]
    if args.quick:
        ce_shapes = ce_shapes[:1]
    if cpu:
        ce_shapes = [(16, 1000)]
    for N, V in ce_shapes:
        logits = randn(N, V, grad=True)
        target = torch.randint(0, V, (N,), device=dev)
        target[:: 17] = -100

        def mk_ce(f, logits=logits, target=target):
            def fwd():
                with torch.no_grad():
                    return f(logits, target)

            def fwdbwd():
                return torch.autograd.grad(f(logits, target), logits)
            return fwd, fwdbwd
        impls = {
            "aten": mk_ce(lambda x, t: F.cross_entropy(x, t)),
            "aten-hf": mk_ce(lambda x, t: F.cross_entropy(x.float(), t)),
            "gems": mk_ce(lambda x, t: gloss.cross_entropy(x, t)),
        }
        # the other forward strategy, for comparison: rows streamed in blocks and read twice
        # (the default keeps a row of <= 32768 16-bit elements in registers: one read)
        key = (V, dtype)
        default = gloss.launch_config(V, dtype)
        if default[2]:
            stream = (8192 if dtype != torch.float32 else 4096, 16, False) + default[3:]

            def two_pass(x, t, key=key, default=default, stream=stream):
                gloss._CONFIGS[key] = stream
                try:
                    return gloss.cross_entropy(x, t)
                finally:
                    gloss._CONFIGS[key] = default
            impls["gems-2pass"] = mk_ce(two_pass)
        if liger:
            own = logits.detach().clone().requires_grad_()   # Liger writes the gradient into its input
            impls["liger"] = mk_ce(lambda x, t: liger["ce"].apply(x, t, None, -100, 0.0, 0.0, "mean")[0], logits=own)
        cases.append((f"cross_entropy [{N},{V}]", impls, True))

    # ---------------------------------------------------------------- fused linear cross-entropy
    fl_shapes = [(4096, 4096, 32000)] if not cpu else [(64, 32, 500)]
    for N, Hd, V in fl_shapes:
        hidden, weight = randn(N, Hd, grad=True), randn(V, Hd, grad=True)
        with torch.no_grad():
            hidden.mul_(0.05)
            weight.mul_(0.05)
        target = torch.randint(0, V, (N,), device=dev)
        target[:: 17] = -100

        def mk_fl(f, hidden=hidden, weight=weight, target=target):
            def fwd():
                with torch.no_grad():
                    return f(hidden, weight, target)

            def fwdbwd():
                return torch.autograd.grad(f(hidden, weight, target), (hidden, weight))
            return fwd, fwdbwd
        impls = {
            "aten": mk_fl(lambda h, w, t: F.cross_entropy(h @ w.t(), t)),
            "aten-hf": mk_fl(lambda h, w, t: F.cross_entropy((h @ w.t()).float(), t)),
            "gems": mk_fl(lambda h, w, t: glinear.fused_linear_cross_entropy(h, w, t)),
            # Liger's chunk rule (its peak memory): the time-for-memory trade-off beside the default
            "gems-lowmem": mk_fl(lambda h, w, t: glinear.fused_linear_cross_entropy(h, w, t, chunk_size="low_memory")),
        }
        if liger:
            impls["liger"] = mk_fl(lambda h, w, t: liger["flce"].apply(h, w, t, None, None, -100, 0.0, 0.0, "mean")[0])
        cases.append((f"fused_linear_ce [{N},{Hd}]x[{V},{Hd}]", impls, True))

    # ---------------------------------------------------------------- run
    rows = []
    for name, impls, mem in cases:
        if args.only and args.only not in name:
            continue
        err = _max_err(impls["gems"][1](), impls["aten"][1]())   # outputs of fwd+bwd: the gradients
        print(f"{name}: max |gems - aten| over the gradients, relative to max |aten|: {err:.2e}")
        for mode, idx in (("fwd", 0), ("fwd+bwd", 1)):
            res = {}
            for impl, fns in impls.items():
                try:
                    ms = bench(fns[idx])
                    peak = peak_mib(fns[idx]) if mem else None
                    res[impl] = dict(ms=ms, peak_mib=peak)
                except Exception as e:  # noqa: BLE001 - one failing implementation must not hide the others
                    res[impl] = dict(error=f"{type(e).__name__}: {e}")
                if not cpu:
                    torch.cuda.empty_cache()
            rows.append(dict(case=name, mode=mode, results=res, grad_rel_err=err))
            _print_row(name, mode, res)
    if args.output:
        meta = dict(device=(torch.cuda.get_device_name() if not cpu else "cpu (Triton interpreter)"),
                    torch=torch.__version__, dtype=str(dtype), liger=why is None, liger_why=why,
                    date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
        with open(args.output, "w") as fh:
            json.dump(dict(meta=meta, rows=rows), fh, indent=1)
        print(f"wrote {args.output}")
    return 0


def _max_err(a, b):
    a = a if isinstance(a, (tuple, list)) else (a,)
    b = b if isinstance(b, (tuple, list)) else (b,)
    worst = 0.0
    for x, y in zip(a, b):
        x, y = x.double(), y.double()
        worst = max(worst, ((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item())
    return worst


_HEADER_DONE = []


def _print_row(name, mode, res):
    if not _HEADER_DONE:
        print(f"{'case':40s} {'mode':8s} {'impl':10s} {'ms':>9s} {'/aten':>7s} {'/liger':>7s} {'peak MiB':>9s}")
        _HEADER_DONE.append(1)
    a = res.get("aten", {}).get("ms")
    lg = res.get("liger", {}).get("ms")
    for impl, r in res.items():
        if "error" in r:
            print(f"{name:40s} {mode:8s} {impl:10s} error: {r['error'][:80]}")
            continue
        ms = r["ms"]
        ra = f"{ms / a:7.2f}" if a else "      -"
        rl = f"{ms / lg:7.2f}" if lg else "      -"
        pk = f"{r['peak_mib']:9.0f}" if r.get("peak_mib") is not None else "        -"
        print(f"{name:40s} {mode:8s} {impl:10s} {ms:9.3f} {ra} {rl} {pk}")


if __name__ == "__main__":
    sys.exit(main())
