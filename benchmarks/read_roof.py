"""The decode GEMM's ceiling: how fast this GPU reads one weight at all.

    python -m benchmarks.read_roof --device cuda [--json FILE]
    python -m benchmarks.read_roof --device cpu       # smoke run: Triton interpreter, small weights

A batch-1 decode step reads every weight once and computes little, so no M = 1 GEMM on a weight can be
faster than a kernel that only reads the weight's bytes. Per weight of Llama-2-7B (bf16 [N, K], as
nn.Linear holds it), device time with L2 cleared before each run and the host's launch hidden behind a
sleep kernel (`gems.runtime.autotune.held_ms`, the tuner's own timing):

  read    the fastest of a sweep of `_read`: programs x BLOCK x warps, each program striding over the
          weight as int32 words and xor-ing them (one partial per program, so no load can be dropped);
          the least time any kernel needs to bring these bytes in;
  sum     torch.sum of the weight (ATen's streaming reduction);
  gems    x @ W.T for x [1, K] with Gems enabled (what a decode projection calls);
  cublas  the same with Gems unregistered.

Each is also GB/s (weight bytes over time) and % of the copy roof: the device-to-device copy bandwidth
of a 512 MiB buffer (bytes read + written), the most any stream reaches on this GPU. Where `read` stays
far below the roof on the small weights, the loss is the kernel's start and ramp-up, which no GEMM
tuning removes; the GEMM's target is then `read`, not the roof.
"""
from __future__ import annotations

import argparse
import json
import sys

from benchmarks.interpreter import use_interpreter_for

# Llama-2-7B's weights [N, K]: q/k/v/o, gate/up, down, lm_head; and a small one (a GQA k/v at 8 heads)
SHAPES = [(512, 4096), (4096, 4096), (11008, 4096), (4096, 11008), (32000, 4096)]
CPU_SHAPES = [(48, 64), (64, 200)]
# the sweep: programs per SM (None: one program per block, no stride loop), BLOCK (int32 words), warps
PER_SM = (None, 1, 2, 4, 8)
BLOCKS = (1024, 2048, 4096, 8192)
WARPS = (4, 8)
CPU_SWEEP = ((None, 2), (64, 128), (4,))   # the CPU counts as one SM


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _read(X, PART, n, BLOCK: tl.constexpr):
        pid, nprog = tl.program_id(0), tl.num_programs(0)
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(pid * BLOCK, n, nprog * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            acc ^= tl.load(X + offs, mask=offs < n, other=0)
        tl.store(PART + pid, tl.xor_sum(acc, axis=0))
    return _read


def read_weight(kernel, words, programs: int, block: int, warps: int):
    """One `_read` over `words` (int32, contiguous) with `programs` programs; the per-program xors."""
    import torch
    part = torch.empty(programs, dtype=torch.int32, device=words.device)
    kernel[(programs,)](words, part, words.numel(), block, num_warps=warps)
    return part


def _programs(per_sm, n, block, sms):
    blocks = -(-n // block)
    return blocks if per_sm is None else min(blocks, per_sm * sms)


def run(device: str, shapes, sweep, time_ms, roof_gbps):
    import torch
    import gems
    kernel = _kernel()
    per_sms, blocks, warps = sweep
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device == "cuda" else 1
    rows = []
    for n_out, k in shapes:
        w = torch.randn(n_out, k, device=device, dtype=torch.bfloat16)
        x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
        words = w.view(-1).view(torch.int32)
        nbytes = w.numel() * w.element_size()
        best = None
        for per_sm in per_sms:
            for block in blocks:
                for nw in warps:
                    p = _programs(per_sm, words.numel(), block, sms)
                    ms = time_ms(lambda: read_weight(kernel, words, p, block, nw))
                    if best is None or ms < best[0]:
                        best = (ms, f"{p} programs, BLOCK {block}, {nw} warps")
        gems.disable()
        sum_ms = time_ms(lambda: w.sum())
        cublas_ms = time_ms(lambda: torch.nn.functional.linear(x, w))
        fell = _fallbacks(gems)
        with gems.use_gems():
            gems_ms = time_ms(lambda: torch.nn.functional.linear(x, w))
        # a call Gems left to ATen (its tuner's "aten faster", or a dtype it does not serve here)
        row = {"N": n_out, "K": k, "MB": nbytes / 1e6, "read_config": best[1],
               "gems_served": _fallbacks(gems) == fell}
        for name, ms in (("read", best[0]), ("sum", sum_ms), ("gems", gems_ms), ("cublas", cublas_ms)):
            gbps = nbytes / ms / 1e6
            row[f"{name}_us"], row[f"{name}_GBps"] = ms * 1e3, gbps
            if roof_gbps:
                row[f"{name}_roof"] = gbps / roof_gbps
        rows.append(row)
    return rows


def _fallbacks(gems) -> int:
    return sum(v["fallback"] for k, v in gems.stats().items() if k.startswith(("mm", "addmm")))


def _cuda_timer():
    from gems.runtime.autotune import held_ms
    return held_ms


def _cpu_timer(fn):
    import time
    fn()
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the rows (and the copy roof) as JSON")
    a = ap.parse_args(argv)
    use_interpreter_for(a.device)
    import torch
    from tabulate import tabulate
    if a.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device here (--device cpu is the smoke run)")
        from benchmarks.gemm import copy_roof_gbps
        timer = _cuda_timer()
        roof = copy_roof_gbps(timer)
        rows = run("cuda", SHAPES, (PER_SM, BLOCKS, WARPS), timer, roof)
        env = {"device": torch.cuda.get_device_name(), "copy_roof_GBps": roof}
    else:
        rows = run("cpu", CPU_SHAPES, CPU_SWEEP, _cpu_timer, None)
        env = {"device": "cpu (interpreter: timings mean nothing)", "copy_roof_GBps": None}
    cols = ("read", "sum", "gems", "cublas")
    table = [[f"{r['N']} x {r['K']}", f"{r['MB']:.1f}"]
             + [f"{r[c + '_us']:.1f}" + (f" ({r[c + '_roof']:.0%})" if c + "_roof" in r else "")
                + ("" if c != "gems" or r["gems_served"] else " ATen") for c in cols]
             + [r["read_config"]] for r in rows]
    print(f"{env['device']}; copy roof {env['copy_roof_GBps'] or 0:.0f} GB/s; us (% of the copy roof); "
          f"'ATen': Gems left the call to ATen")
    print(tabulate(table, headers=["weight [N, K] bf16", "MB", "read", "torch.sum", "Gems M = 1", "cuBLAS M = 1",
                                   "fastest read"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
