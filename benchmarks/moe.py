"""gems.fused.moe_experts (grouped-GEMM MoE experts) vs the per-expert PyTorch loop and transformers' own
experts module, forward and forward+backward, at Mixtral-like shapes reduced in width.

    python -m benchmarks.moe                    # GPU, bf16, h = 1024 / 2048 / 4096, I = 3.5 h, E = 8, k = 2, T = 4096
    python -m benchmarks.moe --quick            # h = 1024 and 2048 only, shorter runs
    python -m benchmarks.moe -o out.json        # also write JSON
    python -m benchmarks.moe --device cpu       # tiny shapes through the Triton interpreter (smoke)
    python -m benchmarks.moe --tune             # per-kernel tile sweep (fwd+bwd, h=4096), best config printed

Columns (median ms, `triton.testing.do_bench` on the GPU; a median of a few runs on the CPU):
  gems     `gems.fused.moe_experts` (Gems' ATen ops not enabled: the sort and sums are ATen's)
  gems_tgmm  the same with gemm="torch": torch's grouped GEMM with Gems' kernels around it (bf16 on
           Hopper; elsewhere it is the gems column again)
  loop     `gems.fused.moe.reference_moe_experts`, the per-expert loop (one host sync per expert)
  hf       transformers' `MixtralExperts` forward with `_experts_implementation="eager"` (its loop)
  hf_gmm   the same module with "grouped_mm" (torch._grouped_mm where the GPU has it); "-" where it fails
  block    `MixtralSparseMoeBlock` (router included) as built, and `blk_gems` the block from
           `gems.patching.moe.patch_moe_block`
TFLOP/s is Gems' over the experts' multiply-adds (forward 6 S h I, forward+backward 18 S h I, S = T k);
err is max |gems - loop| / max |loop| of the output (forward) or the worst gradient (forward+backward).
Routing is drawn uniformly at random, so experts get about S / E rows each.

Measured on one H200 (bf16, T = 4096, torch 2.11, triton 3.6, transformers 5.17), ms gems / loop / hf_gmm:
  h=1024  fwd 0.53 / 2.68 / 0.94   fwd+bwd  2.06 /  7.95 /  2.39   (340 / 263 TFLOP/s)
  h=2048  fwd 1.56 / 2.90 / 2.14   fwd+bwd  6.68 / 13.48 /  5.84   (464 / 324)
  h=4096  fwd 6.46 / 5.98 / 6.39   fwd+bwd 25.97 / 42.92 / 18.44   (447 / 333)
The backward's tiles are untuned (fixed configs in gems/fused/moe.py): grouped_mm's is faster from h=2048.
"""
from __future__ import annotations

import argparse
import sys

import torch   # triton is imported later, after --device cpu has set TRITON_INTERPRET

from benchmarks.interpreter import use_interpreter_for
from benchmarks.results import write_json
from benchmarks.timing import median_ms


def _parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--quick", action="store_true", help="fewer, shorter cases")
    p.add_argument("--tokens", type=int, default=None, help="T (default 4096; 24 on the CPU)")
    p.add_argument("--tune", action="store_true", help="sweep each kernel's tiles at the largest case")
    p.add_argument("-o", "--output", default=None, help="write results as JSON here")
    return p.parse_args(argv)


# candidate tiles per kernel: (BN, BK, warps, stages); wgrad (BM, BN, BK, warps, stages)
_SWEEP = {
    "wgrad": [(128, 128, 64, 8, 3), (128, 128, 32, 8, 4), (128, 256, 64, 8, 3), (64, 128, 64, 4, 4),
              (128, 128, 64, 4, 4), (256, 128, 64, 8, 3)],
    "down_bwd": [(64, 64, 8, 3), (128, 64, 8, 3), (64, 64, 4, 4), (128, 64, 8, 4), (128, 128, 8, 3)],
    "rows_mm": [(128, 64, 8, 3), (128, 64, 4, 4), (256, 64, 8, 3), (64, 64, 4, 4), (128, 128, 8, 3)],
    "gate_up": [(64, 64, 8, 3), (128, 64, 8, 3), (64, 64, 4, 4), (128, 64, 8, 4), (64, 128, 8, 3)],
}


def _tune(c, dtype):
    """Each kernel's candidates in turn (the others at their best so far), timing forward+backward; prints the
    kernels' profile first and the best configuration last (to copy into gems/fused/moe.py's _CONFIGS)."""
    from triton.testing import do_bench

    import gems.fused as F
    from gems.fused import moe
    T, h, I, E, k = c["T"], c["h"], c["I"], c["E"], c["k"]
    x = torch.randn(T, h, device="cuda", dtype=dtype, requires_grad=True)
    w, ids = torch.softmax(torch.randn(T, E, device="cuda"), -1).topk(k, -1)
    w = (w / w.sum(-1, keepdim=True)).to(dtype).requires_grad_()
    wgu = (torch.randn(E, 2 * I, h, device="cuda", dtype=dtype) * h ** -0.5).requires_grad_()
    wd = (torch.randn(E, h, I, device="cuda", dtype=dtype) * I ** -0.5).requires_grad_()
    dy = torch.randn(T, h, device="cuda", dtype=dtype)

    def run():
        torch.autograd.grad(F.moe_experts(x, ids, w, wgu, wd), [x, w, wgu, wd], dy)
    run()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12), flush=True)
    cfg = moe._CONFIGS["cuda"]
    for name, cands in _SWEEP.items():
        best = None
        for v in cands:
            cfg[name] = v
            try:
                t = do_bench(run, warmup=3, rep=60, return_mode="median")
            except Exception as e:  # noqa: BLE001 - a config that does not compile (shared memory) is skipped
                print(f"{name} {v}: {type(e).__name__}: {str(e)[:100]}", flush=True)
                continue
            print(f"{name} {v}: {t:.3f} ms", flush=True)
            if best is None or t < best[0]:
                best = (t, v)
        cfg[name] = best[1]
        print(f"best {name}: {best[1]} ({best[0]:.3f} ms)", flush=True)
    print("tuned:", cfg)


def _cases(device, quick, tokens):
    if device == "cpu":
        return [dict(h=32, I=48, E=8, k=2, T=tokens or 24)]
    hs = (1024, 2048) if quick else (1024, 2048, 4096)
    return [dict(h=h, I=h * 7 // 2, E=8, k=2, T=tokens or 4096) for h in hs]


def _block(c, dtype, device, impl):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    cfg = MixtralConfig(hidden_size=c["h"], intermediate_size=c["I"], num_local_experts=c["E"],
                        num_experts_per_tok=c["k"])
    cfg._experts_implementation = impl
    b = MixtralSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in b.parameters():
            p.normal_(0, p.shape[-1] ** -0.5)
    return b.to(device=device, dtype=dtype)


def _time(fn, device, quick):
    return median_ms(fn, device, warmup=5 if quick else 10, rep=30 if quick else 100,
                     cpu_runs=1 if quick else 3)


def _err(a, b):
    a, b = a.detach().float(), b.detach().float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def main(argv=None):
    args = _parse(argv)
    use_interpreter_for(args.device)   # before triton is imported (gems imports it)

    import gems.fused as F
    from gems.fused.moe import reference_moe_experts
    from gems.patching.moe import patch_moe_block

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU visible: use --device cpu for the interpreter smoke run", file=sys.stderr)
        return 2
    dev = args.device
    dtype = torch.bfloat16 if dev == "cuda" else torch.float16   # the interpreter leaves bf16 out
    if args.tune:
        if dev != "cuda":
            print("--tune needs the GPU", file=sys.stderr)
            return 2
        _tune(_cases(dev, False, args.tokens)[-1], dtype)
        return 0
    quick = args.quick or dev == "cpu"
    rows = []
    torch.manual_seed(0)
    for c in _cases(dev, args.quick, args.tokens):
        block = _block(c, dtype, dev, "eager")
        ex = block.experts
        T, h, k = c["T"], c["h"], c["k"]
        x = torch.randn(T, h, device=dev, dtype=dtype)
        logits = torch.randn(T, c["E"], device=dev, dtype=torch.float32)
        w, ids = torch.softmax(logits, -1).topk(k, -1)
        w = (w / w.sum(-1, keepdim=True)).to(dtype)
        try:
            gmm_block = _block(c, dtype, dev, "grouped_mm")
            gmm_block.load_state_dict(block.state_dict())
        except Exception:  # noqa: BLE001 - an implementation this transformers lacks only drops the column
            gmm_block = None
        patched = patch_moe_block(block)
        impls = {
            "gems": lambda x, w, a, b: F.moe_experts(x, ids, w, a, b),
            "gems_tgmm": lambda x, w, a, b: F.moe_experts(x, ids, w, a, b, gemm="torch"),
            "loop": lambda x, w, a, b: reference_moe_experts(x, ids, w, a, b),
            "hf": lambda x, w, a, b: ex(x, ids, w),
            "hf_gmm": (lambda x, w, a, b: gmm_block.experts(x, ids, w)) if gmm_block is not None else None,
            "block": lambda x, w, a, b: block(x.view(1, T, h)),
            "blk_gems": (lambda x, w, a, b: patched(x.view(1, T, h))) if patched is not None else None,
        }
        name = f"h={h} I={c['I']} E={c['E']} k={k} T={T}"
        for mode in ("fwd", "fwd+bwd"):
            grad = mode != "fwd"
            row = dict(case=name, mode=mode, **c, dtype=str(dtype).replace("torch.", ""))
            res = {}
            for impl, fn in impls.items():
                if fn is None:
                    row[f"{impl}_ms"] = None
                    continue
                xi, wi = x.clone().requires_grad_(grad), w.clone().requires_grad_(grad)
                params = [ex.gate_up_proj, ex.down_proj] if impl not in ("block", "blk_gems") else \
                    list(block.parameters())
                if impl == "hf_gmm":
                    params = [gmm_block.experts.gate_up_proj, gmm_block.experts.down_proj]
                inputs = [xi] + ([] if impl in ("block", "blk_gems") else [wi]) + params

                def step(fn=fn, xi=xi, wi=wi, inputs=inputs):
                    with torch.enable_grad() if grad else torch.no_grad():
                        y = fn(xi, wi, ex.gate_up_proj, ex.down_proj)
                        if grad:
                            return y, torch.autograd.grad(y, inputs, torch.ones_like(y) / y.shape[-1] ** 0.5)
                        return y, ()
                try:
                    res[impl] = step()
                    row[f"{impl}_ms"] = _time(step, dev, quick)
                except Exception as e:  # noqa: BLE001 - a failing column is reported, not fatal
                    if impl == "gems":
                        raise
                    row[f"{impl}_ms"] = None
                    row[f"{impl}_error"] = f"{type(e).__name__}: {e}"[:200]
            g, lp = res["gems"], res["loop"]
            row["err"] = _err(g[0], lp[0]) if not grad else max(_err(a, b) for a, b in zip(g[1], lp[1]))
            t = res.get("gems_tgmm")
            if t is not None:
                row["err_tgmm"] = _err(t[0], lp[0]) if not grad else max(_err(a, b) for a, b in zip(t[1], lp[1]))
            flops = (18 if grad else 6) * T * k * h * c["I"]
            row["gems_tflops"] = flops / (row["gems_ms"] * 1e-3) / 1e12
            rows.append(row)
            del res

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)
    cols = ("gems", "gems_tgmm", "loop", "hf", "hf_gmm", "block", "blk_gems")
    hdr = f"{'case':34} {'mode':8} " + " ".join(f"{c + ' ms':>11}" for c in cols) + f" {'TFLOP/s':>8} {'err':>8}" \
        + f" {'err tgmm':>8}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['case']:34} {r['mode']:8} " + " ".join(f(r.get(c + '_ms'), '11.3f') for c in cols)
              + f" {f(r['gems_tflops'], '8.1f')} {f(r['err'], '8.1e')} {f(r.get('err_tgmm'), '8.1e')}")
    for r in rows:
        for c in cols:
            if f"{c}_error" in r:
                print(f"{r['case']} {r['mode']}: {c} failed: {r[c + '_error']}")
    if args.output:
        write_json(args.output, rows, dev)
    return 0


if __name__ == "__main__":
    sys.exit(main())
