"""Attention benchmark: ATen's SDPA (whatever backend it picks, named per row) vs Gems' fused kernels.

    python -m benchmarks.attention                      # all cases, bf16, on the GPU
    python -m benchmarks.attention --quick -o att.json  # a few cases per family
    python -m benchmarks.attention --only decode        # case names containing 'decode'
    python -m benchmarks.attention --sweep fwd          # try launch configs of a kernel kind
                                                        # (fwd fwd_bias fwd_dropout fwd_causal decode dkdv dq: Triton;
                                                        # gluon: the Hopper forward, vs cuDNN;
                                                        # --sweep-head-dim 64: BERT's shapes)
    python -m benchmarks.attention --device cpu         # tiny shapes through the Triton interpreter (smoke run)

Cases (the attention the supported models call): Llama-2-7B (32 heads x 128, causal; batch 1-8, sequence 512-4096), BERT (batch 32,
12 x 64, sequence 128-512, boolean padding mask [B, 1, 1, S] with a quarter of the keys masked in
half the batch), GQA 32/4 (sequence 2048, causal, enable_gqa), decode (one query, KV 128-8192,
32 x 128, batch 1; and GQA 32/4). Forward, and forward+backward and the backward alone where training uses
it; BERT also with its
training default, attention dropout 0.1 (forward+backward only: Gems' and ATen's masks differ by design). Per row: ATen's backend
(the fused overload it dispatched to), median ms of each (`triton.testing.do_bench`, L2 flushed; ATen
and Gems alternate `--rounds` times and each takes the median of its rounds), TFLOP/s
(forward 4*B*H*Sq*Sk*D, half of it under a square causal mask; backward 2.5x the forward), Gems/ATen
ratio, Gems' max abs difference to ATen, and whether Gems served the call (gems.stats()). ATen runs
with Gems unregistered (`gems.disable()`), i.e. exactly what users without Gems run; Gems runs with
`gems.enable()` (attention is in its default selection). On the GPU a second table
follows, after every timing: each side's kernel time per call from the profiler (no host time or launch
gaps, L2 warm), which decides the rows of a few microseconds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1:][:1] == ["cpu"]:
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import gems  # noqa: E402
from gems.ops.attention import gluon_fwd as AG  # noqa: E402

FUSED = ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention",
         "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu")
BACKWARD_OF = {n: n + "_backward" for n in FUSED}


def cases(quick: bool, cpu: bool):
    """(name, B, Hq, Hkv, Sq, Sk, D, causal, mask, training[, dropout_p])."""
    out = []
    if cpu:
        return [("llama-tiny causal", 1, 2, 2, 64, 64, 32, True, False, True),
                ("bert-tiny pad", 2, 2, 2, 48, 48, 32, False, True, True),
                ("gqa-tiny", 1, 4, 1, 64, 64, 32, True, False, True),
                ("decode-tiny", 1, 2, 2, 1, 256, 32, False, False, False)]
    llama = [(1, 512), (1, 2048), (4, 2048), (1, 4096)] if quick else \
        [(b, s) for b in (1, 2, 4, 8) for s in (512, 1024, 2048, 4096)]
    for b, s in llama:
        out.append((f"llama2-7b B{b} S{s}", b, 32, 32, s, s, 128, True, False, True))
    for s in ((128, 512) if quick else (128, 256, 384, 512)):
        out.append((f"bert-base B32 S{s} pad", 32, 12, 12, s, s, 64, False, True, True))
        # BERT's training default: attention dropout 0.1 (forward+backward only: the masks differ by design)
        out.append((f"bert-base B32 S{s} pad dropout", 32, 12, 12, s, s, 64, False, True, True, 0.1))
    out.append(("gqa 32/4 B1 S2048", 1, 32, 4, 2048, 2048, 128, True, False, True))
    for kv in ((128, 2048, 8192) if quick else (128, 256, 512, 1024, 2048, 4096, 8192)):
        out.append((f"decode llama2-7b KV{kv}", 1, 32, 32, 1, kv, 128, False, False, False))
    for kv in ((8192,) if quick else (1024, 8192)):
        out.append((f"decode gqa 32/4 KV{kv}", 1, 32, 4, 1, kv, 128, False, False, False))
    return out


def flops(B, Hq, Sq, Sk, D, causal):
    f = 4.0 * B * Hq * Sq * Sk * D
    return f / 2 if causal and Sq == Sk else f


def aten_choice(fn):
    seen = []

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Mode():
        fn()
    return next((n for n in seen if n in FUSED), "math")


def device_ms(fn, device):
    """Kernel time per call (ms) from the profiler (benchmarks.run.device_ms: the call's kernels,
    memsets and copies summed; no host time or launch gaps, L2 warm). None on the CPU."""
    if device != "cuda":
        return None
    from benchmarks.run import device_ms as profiled
    return profiled(fn)


def bench(fn, device):
    if device == "cuda":
        from triton.testing import do_bench
        return do_bench(fn, warmup=25, rep=100, return_mode="median")
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return sorted(ts)[1]


def make_inputs(B, Hq, Hkv, Sq, Sk, D, mask, dtype, device, grad):
    # HF's layout: [B, S, H, D] projections viewed as [B, H, S, D]
    q = torch.randn(B, Sq, Hq, D, device=device, dtype=dtype).transpose(1, 2)
    k = torch.randn(B, Sk, Hkv, D, device=device, dtype=dtype).transpose(1, 2)
    v = torch.randn(B, Sk, Hkv, D, device=device, dtype=dtype).transpose(1, 2)
    if grad:
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    m = None
    if mask:
        m = torch.ones(B, 1, 1, Sk, dtype=torch.bool, device=device)
        m[B // 2:, ..., Sk - Sk // 4:] = False
    return q, k, v, m


def served(names):
    st = gems.stats()
    return {n: st.get(n + ".default", {}).get("served", 0) for n in names}


def run_case(c, dtype, device, rounds=1, kernel_time=False):
    """The case's rows: do_bench times (ATen and Gems alternating `rounds` times), or with kernel_time
    the profiler's kernel time per call of each side (device_ms) instead."""
    name, B, Hq, Hkv, Sq, Sk, D, causal, mask, training = c[:10]
    dropout = c[10] if len(c) > 10 else 0.0
    q, k, v, m = make_inputs(B, Hq, Hkv, Sq, Sk, D, mask, dtype, device, training)
    kw = dict(attn_mask=m, is_causal=causal, enable_gqa=Hq != Hkv, dropout_p=dropout)
    fwd = lambda: F.scaled_dot_product_attention(q, k, v, **kw)  # noqa: E731
    g = torch.randn(B, Hq, Sq, D, device=device, dtype=dtype)

    def fwd_bwd():
        out = fwd()
        torch.autograd.grad(out, (q, k, v), g)

    f = flops(B, Hq, Sq, Sk, D, causal)
    rows = []
    gems.disable()
    with torch.no_grad():
        backend = aten_choice(fwd)
        ref = fwd()
    def bwd():
        # the backward alone, of a forward run on the same side (Gems' backward reads its forward's state)
        out = fwd()
        return lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True)

    # (pass, a function returning the timed callable, flops, grad mode)
    passes = [("fwd", lambda: fwd, f, torch.no_grad)] if not dropout else []
    if training:
        passes.append(("fwd+bwd", lambda: fwd_bwd, 3.5 * f, torch.enable_grad))
        passes.append(("bwd", bwd, 2.5 * f, torch.enable_grad))
    for kind, make, fl, ctx in passes:
        if kernel_time:
            # the profiler's pass, after every timing (a profiled run leaves later launches slower: the
            # timed rows after one read 2-4x their times)
            d_aten, d_gems = _sides(lambda f: device_ms(f, device), make, ctx)
            rows.append(dict(case=name, pass_=kind, aten_device_ms=d_aten, gems_device_ms=d_gems,
                             device_ratio=d_gems / d_aten if d_aten else None))
            continue
        # ATen and Gems alternate `rounds` times (clocks and neighbours drift during a run); each side's
        # time is the median of its rounds' medians
        gems.reset_stats()
        t_aten, t_gems = zip(*[_sides(lambda f: bench(f, device), make, ctx) for _ in range(rounds)])
        t_aten, t_gems = statistics.median(t_aten), statistics.median(t_gems)
        gems.enable()
        try:
            with ctx():
                out = fwd() if kind == "fwd" else None
            names = [backend] + ([BACKWARD_OF.get(backend, "")] if kind != "fwd" else [])
            s = served([n for n in names if n])
            ok = all(v > 0 for v in s.values()) and backend != "math"
            err = (out.float() - ref.float()).abs().max().item() if out is not None else None
            reasons = {n: d["reasons"] for n, d in gems.stats().items() if d["fallback"] and "dot_product" in n}
        finally:
            gems.disable()
        rows.append(dict(case=name, pass_=kind, aten_backend=backend, aten_ms=t_aten, gems_ms=t_gems,
                         ratio=t_gems / t_aten, rounds=rounds, aten_tflops=fl / t_aten / 1e9,
                         gems_tflops=fl / t_gems / 1e9, max_abs_diff=err, served=ok, fallback_reasons=reasons))
    return rows


def _sides(measure, make, ctx):
    """(ATen's, Gems') measure(make()) under ctx: ATen with Gems unregistered, then Gems enabled."""
    gems.disable()
    with ctx():
        a = measure(make())
    gems.enable()
    try:
        with ctx():
            g = measure(make())
    finally:
        gems.disable()
    return a, g


def _fresh_attention():
    """Forget recorded call plans (they replay the binary of the config they were recorded with) and
    signatures an earlier config failed on (the dispatcher sends those to ATen), and zero the stats."""
    for impl in gems.registry.all_impls():
        if "dot_product" in impl.name:
            impl.set_fn(impl.fn)
    gems.reset_stats()


def sweep(dtype, device, kinds=(), head_dim=128):
    """Try launch configs per kernel kind on representative shapes; print the best of each.
    head_dim 128: Llama-2-7B shapes; 64: BERT-base's (batch 32, 12 heads, padding mask). Kind fwd takes a
    padding mask (one bias row per key block), fwd_bias a full [B, 1, S, S] mask (bias tiles), fwd_dropout
    the padding mask (head dim 64) or none, with dropout 0.1 (the forward alone: the mask is stored there)."""
    from gems.ops.attention import sdpa as A
    from gems.runtime.utils import next_pow2
    import itertools
    if head_dim <= 64:
        H, D, mask = 12, head_dim, True
        shapes = {"fwd": ("bert-base B32 S512 pad", 32, H, H, 512, 512, D, False, mask, False),
                  "fwd_bias": ("B32 S512 full mask", 32, H, H, 512, 512, D, False, "full", False),
                  "fwd_dropout": ("bert-base B32 S512 pad dropout", 32, H, H, 512, 512, D, False, mask, False, 0.1),
                  "fwd_causal": ("B32 S512 causal", 32, H, H, 512, 512, D, True, False, False),
                  "decode": ("decode KV4096", 1, H, H, 1, 4096, D, False, False, False)}
        bwd_shape = ("bert-base B32 S512 pad", 32, H, H, 512, 512, D, False, mask, True)
    else:
        D = head_dim
        shapes = {"fwd": ("llama2-7b B4 S2048 non-causal", 4, 32, 32, 2048, 2048, D, False, False, False),
                  "fwd_bias": ("llama2-7b B4 S2048 full mask", 4, 32, 32, 2048, 2048, D, False, "full", False),
                  "fwd_dropout": ("llama2-7b B4 S1024 dropout", 4, 32, 32, 1024, 1024, D, False, False, False, 0.1),
                  "fwd_causal": ("llama2-7b B1 S4096", 1, 32, 32, 4096, 4096, D, True, False, False),
                  "decode": ("decode KV4096", 1, 32, 32, 1, 4096, D, False, False, False)}
        bwd_shape = ("llama2-7b B1 S2048", 1, 32, 32, 2048, 2048, D, True, False, True)
    if device == "cpu":   # a smoke run of the sweep itself through the interpreter
        shapes = {"fwd": ("tiny", 1, 1, 1, 64, 64, D, False, False, False),
                  "fwd_bias": ("tiny mask", 2, 1, 1, 64, 64, D, False, "full", False),
                  "fwd_dropout": ("tiny dropout", 1, 1, 1, 64, 64, D, False, False, False, 0.1),
                  "fwd_causal": ("tiny causal", 1, 1, 1, 64, 64, D, True, False, False),
                  "decode": ("tiny decode", 1, 1, 1, 1, 256, D, False, False, False)}
        bwd_shape = ("tiny", 1, 1, 1, 64, 64, D, True, False, True)
    fwd_grid = [(bm, bn, w, s) for bm, bn, w, s in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4))]
    grid = {"fwd": fwd_grid, "fwd_bias": fwd_grid, "fwd_dropout": fwd_grid, "fwd_causal": fwd_grid,
            "decode": [(16, bn, w, s) for bn, w, s in itertools.product((32, 64, 128), (4, 8), (2, 3))],
            "dkdv": [(bm, bn, w, s) for bm, bn, w, s in itertools.product((16, 32, 64), (64, 128), (4, 8), (2, 3))],
            "dq": [(bm, bn, w, s) for bm, bn, w, s in itertools.product((64, 128), (32, 64), (4, 8), (2, 3))]}
    if D == 128 and (not kinds or "gluon" in kinds):
        if device == "cuda" and torch.cuda.get_device_capability()[0] == 9:
            _sweep_gluon(dtype, device, shapes)
        else:
            print("gluon: the Gluon forward runs on Hopper GPUs only", file=sys.stderr)
    block_d = max(16, next_pow2(D))
    gems.enable()
    # the Triton kinds' configs: calls the Gluon forward would take (head dim 128, no mask) go to Triton
    gluon_was, AG.enabled = AG.enabled, False
    try:
        for kind, cfgs in grid.items():
            if kinds and kind not in kinds:
                continue
            if device == "cpu":
                cfgs = cfgs[:2]
            c = shapes.get(kind, bwd_shape)
            name, B, Hq, Hkv, Sq, Sk, D, causal, mask, training = c[:10]
            p = c[10] if len(c) > 10 else 0.0
            q, k, v, m = make_inputs(B, Hq, Hkv, Sq, Sk, D, bool(mask), dtype, device, kind in ("dkdv", "dq"))
            if mask == "full":    # a [B, 1, Sq, Sk] mask: read as tiles (kind fwd_bias), not one row per key block
                m = torch.rand(B, 1, Sq, Sk, device=device) > 0.2
                m[..., 0] = True
            g = torch.randn(B, Hq, Sq, D, device=device, dtype=dtype)
            if kind in ("dkdv", "dq"):
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal)
                fn = lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True)  # noqa: E731
            else:
                fn = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal, dropout_p=p)  # noqa: E731
            results = []
            for cfg in cfgs:
                A.set_config(kind, block_d, False, cfg)
                _fresh_attention()
                try:
                    t = bench(fn, device)
                    if any(d["fallback"] for n, d in gems.stats().items() if "dot_product" in n):
                        raise RuntimeError("fell back to ATen")
                    results.append((t, cfg))
                except Exception as e:  # noqa: BLE001 - out of shared memory / registers
                    results.append((float("inf"), cfg))
                    print(f"  {kind} {cfg}: {type(e).__name__}: {str(e)[:80]}", file=sys.stderr)
            A.set_config(kind, block_d, False, None)
            _fresh_attention()
            base = bench(fn, device)
            results.sort()
            print(f"{kind:10s} on {name} (head dim {D}): table config {A.launch_config(kind, block_d, False, device == 'cpu')} "
                  f"{base:.3f} ms; best " + ", ".join(f"{cfg} {t:.3f} ms" for t, cfg in results[:4]))
    finally:
        AG.enabled = gluon_was
        gems.disable()


def _sweep_gluon(dtype, device, shapes):
    """The Gluon forward's (BLOCK_N, STAGES, OVERLAP, PERSISTENT) configs on the non-causal and causal
    Llama-2 shapes, against cuDNN (SDPA's choice with Gems off) in the same run."""
    import itertools
    cfgs = [c for c in itertools.product((64, 128), (2, 3, 4), (True, False), (True, False))
            if (4 + 2 * c[1] * c[0] // 64) * 16 <= 227]          # shared memory (KiB): 4 Q halves + the ring
    for kind in ("fwd", "fwd_causal"):
        name, B, Hq, Hkv, Sq, Sk, D, causal = shapes[kind][:8]
        q, k, v, _ = make_inputs(B, Hq, Hkv, Sq, Sk, D, False, dtype, device, False)
        fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
        t_aten = bench(fn, device)
        gems.enable()
        entered, launch = [], AG.launch
        AG.launch = lambda *a, **kw: entered.append(1) or launch(*a, **kw)
        results = []
        try:
            for cfg in cfgs:
                AG.set_config(D, cfg)
                _fresh_attention()
                entered.clear()
                try:
                    t = bench(fn, device)
                    if not entered:
                        raise RuntimeError("the Gluon kernel did not run")
                    results.append((t, cfg))
                except Exception as e:  # noqa: BLE001 - out of shared memory / registers
                    results.append((float("inf"), cfg))
                    print(f"  gluon {cfg}: {type(e).__name__}: {str(e)[:80]}", file=sys.stderr)
            AG.set_config(D, None)
            _fresh_attention()
            base = bench(fn, device)
        finally:
            AG.launch = launch
            AG.set_config(D, None)
            gems.disable()
        results.sort()
        print(f"gluon on {name} (head dim {D}): cuDNN {t_aten:.3f} ms; table config {AG.config(D, Sk)} {base:.3f} ms "
              f"({base / t_aten:.2f}x); best " + ", ".join(f"{cfg} {t:.3f} ms ({t / t_aten:.2f}x)"
                                                          for t, cfg in results[:4]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default=None)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--dtype", default=None, choices=("bf16", "fp16"))
    ap.add_argument("--sweep", nargs="*", default=None, metavar="KIND",
                    help="try launch configs (GPU), print the best per kernel kind (fwd fwd_bias fwd_causal decode dkdv "
                         "dq: the Triton kernels; gluon: the Hopper forward at head dim 128; all if none)")
    ap.add_argument("--sweep-head-dim", type=int, default=128, help="128: Llama-2 shapes; 64: BERT's")
    ap.add_argument("--rounds", type=int, default=None,
                    help="alternating ATen / Gems timings per row (default 3 on cuda, 1 on cpu)")
    ap.add_argument("--no-kernel-time", action="store_true",
                    help="skip the profiler's kernel-time table (run after all timings)")
    ap.add_argument("-o", "--json", default=None)
    a = ap.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device (use --device cpu for the interpreter smoke run)", file=sys.stderr)
        return 2
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}[a.dtype]
    if dtype is None:   # the interpreter backend leaves bf16 to ATen
        dtype = torch.float16 if a.device == "cpu" else torch.bfloat16
    if a.sweep is not None:
        sweep(dtype, a.device, tuple(a.sweep), a.sweep_head_dim)
        return 0
    env = dict(torch=torch.__version__, device=torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
               dtype=str(dtype), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        pass
    rounds = a.rounds or (3 if a.device == "cuda" else 1)
    env["rounds"] = rounds
    print(" ".join(f"{k}={v}" for k, v in env.items()))
    hdr = f"{'case':30s} {'pass':8s} {'aten backend':44s} {'aten ms':>9s} {'gems ms':>9s} {'ratio':>6s} " \
          f"{'aten TF/s':>9s} {'gems TF/s':>9s} {'maxdiff':>8s} served"
    print(hdr)
    rows = []
    for c in cases(a.quick, a.device == "cpu"):
        if a.only and a.only not in c[0]:
            continue
        for r in run_case(c, dtype, a.device, rounds):
            rows.append(r)
            d = "" if r["max_abs_diff"] is None else f"{r['max_abs_diff']:.1e}"
            print(f"{r['case']:30s} {r['pass_']:8s} {r['aten_backend']:44s} {r['aten_ms']:9.3f} {r['gems_ms']:9.3f} "
                  f"{r['ratio']:6.2f} {r['aten_tflops']:9.1f} {r['gems_tflops']:9.1f} {d:>8s} "
                  f"{'yes' if r['served'] else 'NO ' + json.dumps(r['fallback_reasons'])}", flush=True)
    if a.device == "cuda" and not a.no_kernel_time:
        print(f"\nkernel time per call (profiler: the call's kernels summed, no host time or launch gaps, L2 warm)\n"
              f"{'case':30s} {'pass':8s} {'aten us':>9s} {'gems us':>9s} {'ratio':>6s}")
        at = {(r["case"], r["pass_"]): r for r in rows}
        for c in cases(a.quick, False):
            if a.only and a.only not in c[0]:
                continue
            for k in run_case(c, dtype, a.device, kernel_time=True):
                at[(k["case"], k["pass_"])].update(k)
                print(f"{k['case']:30s} {k['pass_']:8s} {k['aten_device_ms'] * 1e3:9.1f} {k['gems_device_ms'] * 1e3:9.1f} "
                      f"{k['device_ratio']:6.2f}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(env=env, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
