"""The GEMMs the models call (benchmarks/gemm_cases.json): ATen (cuBLAS) vs Gems' Triton GEMM.

    python -m benchmarks.gemm --device cuda [-o FILE] [--model llama2] [--workload decode] [--max-cases N] [--quick]
                              [--rounds N]      # ATen and Gems timed in turns N times (medians): for A/Bs
    python -m benchmarks.gemm --device cpu --quick     # smoke run: Triton interpreter, dims capped at 64

Per case, in one process on the same random inputs (operand layouts as the models pass them): the
median time of ATen (Gems unregistered) and of Gems (`triton.testing.do_bench`, which clears L2
between runs, so a weight is read from HBM as it is after a layer's worth of other traffic), the
ratio Gems/ATen, TFLOP/s of both and, for skinny GEMMs (M <= 16, decode), GB/s of the operand
streams against the device's copy bandwidth (measured here: the memory roof they can reach).
Both results are checked against a reference (fp32 math for 16-bit cases, fp64 for fp32 cases):
Gems' relative error must stay within 2x ATen's own plus a small floor, so a fast wrong kernel is
flagged, never counted; so is a call Gems did not serve (`gems.stats()`). Gems autotunes per shape
bucket on its first call: that call runs before the timed region and its time (compile + tuning)
is reported per case and in total. Per source (model/workload), the cases' time x calls per step
gives the step's GEMM time with each library. Each row names the kernel Gems' tuner chose (pointer
or TMA kernel, tile, warps, stages, K split: `blas.describe_config`) and, on the GPU, the kernel cuBLAS
ran (`aten_kernel`, from one profiled call after every timing; the table shows its tile: cuBLAS sizes
mid-size tiles so that about one round of programs fills the SMs). `GEMS_GEMM=triton` is set (docs/design.md,
decision 12) so that Gems' own kernel is measured even where its tuning cache would pick ATen.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path

from benchmarks.interpreter import use_interpreter_for

CASES_FILE = Path(__file__).resolve().parent / "gemm_cases.json"
SKINNY_M = 16
_DT = {"bf16": "bfloat16", "f16": "float16", "f32": "float32", "f64": "float64"}
# relative-error floor per dtype on top of 2x ATen's own error (bf16 output rounding alone is ~1e-3)
_FLOOR = {"bfloat16": 2e-3, "float16": 3e-4, "float32": 1e-5, "float64": 1e-12}
# datasheet HBM bandwidth, GB/s, for the record next to the measured copy roof
_DATASHEET = {"H100": 3350, "H200": 4800}


def load_cases(path=CASES_FILE, model=None, workload=None, max_cases=None):
    """The table's cases whose sources match the filters (a case kept keeps only the matching sources)."""
    with open(path) as f:
        doc = json.load(f)
    out = []
    for c in doc["cases"]:
        src = [s for s in c["sources"] if (model is None or s["model"] == model)
               and (workload is None or s["workload"] == workload)]
        if src:
            out.append(dict(c, sources=src))
    return doc, out[:max_cases] if max_cases else out


def scaled(case, cap):
    """The case with M, N, K capped (and batch at 2): the interpreter's smoke run."""
    if not cap:
        return case
    c = dict(case, M=min(case["M"], cap), N=min(case["N"], cap), K=min(case["K"], cap),
             batch=min(case["batch"], 2))
    c.pop("strides", None)   # the recorded views belong to the full shape
    c["flops"] = 2 * c["M"] * c["N"] * c["K"] * c["batch"]
    return c


def _rand(shape, dt, dev, view=None):
    """Random normal values (never all zero); `view` ([shape, strides] from the table) makes the
    recorded strided view over a fresh buffer instead."""
    import torch
    if view is None:
        return torch.randn(shape, device=dev, dtype=torch.float32).to(dt)
    shape, stride = view
    span = 1 + sum((s - 1) * st for s, st in zip(shape, stride) if s > 0)
    return torch.randn(span, device=dev, dtype=torch.float32).to(dt).as_strided(shape, stride)


def _operand(rows, cols, lay, lead, dt, dev, view=None):
    """An operand of logical shape (*lead, rows, cols), row-major ('N') or a transposed row-major ('T')."""
    if view is None and lay == "T":
        return _rand((*lead, cols, rows), dt, dev).transpose(-1, -2)
    return _rand((*lead, rows, cols), dt, dev, view)


def make_call(case, dev, dt):
    """(fn, args, kwargs) of the case's ATen overload on fresh inputs."""
    import torch
    aten = torch.ops.aten
    op = case["op"]
    views = case.get("strides", {})
    M, N, K = case["M"], case["N"], case["K"]
    lead = (case["batch"],) if op in ("bmm", "baddbmm") else ()
    a = _operand(M, K, case["layout"][0], lead, dt, dev, views.get("a"))
    b = _operand(K, N, case["layout"][1], lead, dt, dev, views.get("b"))
    fn = {"mm": aten.mm.default, "bmm": aten.bmm.default, "addmm": aten.addmm.default,
          "baddbmm": aten.baddbmm.default, "_addmm_activation": aten._addmm_activation.default}[op]
    if not case.get("bias"):
        return fn, (a, b), {}
    shape = {"row": (N,), "col": (*lead, M, 1), "full": (*lead, M, N), "scalar": (1,)}[case["bias"]]
    bias = _rand(shape, dt, dev, views.get("bias"))
    kw = {k: case[k] for k in ("alpha", "beta") if k in case}
    if op == "_addmm_activation":
        kw["use_gelu"] = case.get("gelu", False)
    return fn, (bias, a, b), kw


def relerr(x, ref):
    import torch
    x = x.to(ref.dtype)
    if not torch.isfinite(x).all():
        return float("inf")
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def stream_bytes(case, itemsize):
    """Bytes a skinny GEMM must move: each operand read once, the result written once."""
    M, N, K, B = case["M"], case["N"], case["K"], case["batch"]
    n = B * (M * K + K * N + M * N)
    if case.get("bias"):
        n += {"row": N, "col": M, "full": M * N, "scalar": 1}[case["bias"]] * (B if case["op"] == "baddbmm" else 1)
    return n * itemsize


class Timer:
    """Medians by do_bench on CUDA (benchmarks.run's settings; fewer runs with --quick); one wall-clock run
    on CPU, where the interpreter's times mean nothing."""

    def __init__(self, device, quick):
        self.cuda = device == "cuda"
        self.quick = quick

    def sync(self):
        if self.cuda:
            import torch
            torch.cuda.synchronize()

    def __call__(self, fn):
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        if self.quick:
            from triton.testing import do_bench
            fn()
            self.sync()
            return do_bench(fn, warmup=5, rep=20, return_mode="median")
        from benchmarks.run import bench
        return bench(fn)

    def first_call_ms(self, fn):
        self.sync()
        t0 = time.perf_counter()
        out = fn()
        self.sync()
        return out, (time.perf_counter() - t0) * 1e3


def copy_roof_gbps(timer):
    """Device-to-device copy bandwidth (bytes read + written): the roof a weight stream can reach."""
    from gems.decode.timing import copy_roof_gbps as roof
    return roof("cuda", timer)


def run_case(case, dev, dt, timer, roof, rounds=1):
    """One row: times, rates, errors, whether Gems served it. After the untimed first Gems call, ATen and
    Gems are timed in turns `rounds` times; each side's time is its median over the rounds, so a drift of
    the GPU's clocks during the case lands on both sides instead of on whichever ran later."""
    import torch
    import gems
    from gems.ops.blas import matmul as blas
    r = {"id": case["id"], "M": case["M"], "N": case["N"], "K": case["K"], "batch": case["batch"],
         "sources": [f"{s['model']}/{s['workload']}" + (f"/b{s['batch']}" if s["workload"] == "decode" else "")
                     + f" x{s['count']}" for s in case["sources"]]}
    torch.manual_seed(0)
    fn, args, kw = make_call(case, dev, dt)
    call = lambda: fn(*args, **kw)   # noqa: E731
    ref_dt = torch.float64 if dt in (torch.float32, torch.float64) else torch.float32
    with torch.no_grad():
        gems.disable()
        ref = fn(*[x.to(ref_dt) for x in args], **kw)
        aten_out = call()
        gems.reset_stats()
        with gems.use_gems():
            first, r["first_call_ms"] = timer.first_call_ms(call)   # compile + autotune: untimed
            r["config"] = blas.describe_config(blas.last_config())   # what the tuner chose for it
            again = call()
            st = gems.stats()
        aten_t, gems_t = [], []
        for _ in range(rounds):
            gems.disable()
            aten_t.append(timer(call))
            with gems.use_gems():
                gems_t.append(timer(call))
        gems.disable()
        r["aten_ms"], r["gems_ms"] = statistics.median(aten_t), statistics.median(gems_t)
        if rounds > 1:   # the per-round ratios' range: how much this row moves from round to round
            ratios = [g / a for g, a in zip(gems_t, aten_t)]
            r["round_ratios"] = [min(ratios), max(ratios)]
    r["served"] = sum(v["served"] for v in st.values())
    r["fallback"] = {k: v["reasons"] for k, v in st.items() if v["fallback"]}
    r["aten_err"] = relerr(aten_out, ref)
    r["gems_err"] = max(relerr(first, ref), relerr(again, ref))
    r["correct"] = r["gems_err"] <= 2 * r["aten_err"] + _FLOOR[str(dt).split(".")[-1]]
    r["ratio"] = r["gems_ms"] / r["aten_ms"]
    r["aten_TFLOPs"] = case["flops"] / r["aten_ms"] / 1e9
    r["gems_TFLOPs"] = case["flops"] / r["gems_ms"] / 1e9
    if case["M"] <= SKINNY_M:
        nbytes = stream_bytes(case, args[-1].element_size())
        r["aten_GBps"] = nbytes / r["aten_ms"] / 1e6
        r["gems_GBps"] = nbytes / r["gems_ms"] / 1e6
        if roof:
            r["aten_roof"] = r["aten_GBps"] / roof
            r["gems_roof"] = r["gems_GBps"] / roof
    return r


def ok(r) -> bool:
    """A row whose Gems time counts: served by Gems, no fallback, correct."""
    return "error" not in r and r["served"] > 0 and not r["fallback"] and r["correct"]


def summarize(rows, cases) -> dict:
    good = [r for r in rows if ok(r)]
    ratios = [r["ratio"] for r in good]
    geo = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None
    skinny = [r["ratio"] for r in good if r["M"] <= SKINNY_M]
    per_source: dict = {}
    for r, c in zip(rows, cases):
        if not ok(r):
            continue
        for s in c["sources"]:
            k = f"{s['model']}/{s['workload']}" + (f"/b{s['batch']}" if s["workload"] == "decode" else "")
            d = per_source.setdefault(k, {"aten_ms": 0.0, "gems_ms": 0.0, "cases": 0})
            d["aten_ms"] += s["count"] * r["aten_ms"]
            d["gems_ms"] += s["count"] * r["gems_ms"]
            d["cases"] += 1
    for d in per_source.values():
        d["ratio"] = d["gems_ms"] / d["aten_ms"] if d["aten_ms"] else None
    return {
        "cases": len(rows), "counted": len(good),
        "geomean_ratio": geo,
        "geomean_ratio_skinny": math.exp(sum(map(math.log, skinny)) / len(skinny)) if skinny else None,
        "over_1.10": sum(x > 1.10 for x in ratios),
        "worst": max(good, key=lambda r: r["ratio"])["id"] if good else None,
        "not_counted": {r["id"]: _why_not(r) for r in rows if not ok(r)},
        "tuning_s": sum(r.get("first_call_ms", 0.0) for r in rows) / 1e3,
        "per_source_step_gemm_ms": per_source,
    }


def _why_not(r) -> str:
    if "error" in r:
        return r["error"]
    if r["fallback"]:
        return "fell back: " + json.dumps(r["fallback"])
    if not r["served"]:
        return "not served by Gems"
    return f"WRONG: rel err {r['gems_err']:.2e} vs ATen {r['aten_err']:.2e}"


def main_kernel(call):
    """The name of the kernel that takes most of one call's device time (the profiler's; CUDA only)."""
    from benchmarks.run import device_kernels
    times = device_kernels(call, n=1)
    return max(times, key=times.get) if times else None


def tile_of(name):
    """The tile a GEMM kernel's name states ('nvjet_sm90_tst_192x96_64x5_...' -> '192x96'), or ''."""
    m = re.search(r"(\d+)x(\d+)", name or "")
    return f"{m.group(1)}x{m.group(2)}" if m else ""


def add_aten_kernels(rows, cases, dt_of):
    """Each timed row's `aten_kernel`: what cuBLAS ran for it (its tile tells how it fills the SMs). A
    pass after every timing: a profiled run leaves later launches slower for a while."""
    import torch
    import gems
    gems.disable()
    with torch.no_grad():
        for r, c in zip(rows, cases):
            if "aten_ms" not in r:
                continue
            try:
                fn, args, kw = make_call(c, "cuda", dt_of(c))
                r["aten_kernel"] = main_kernel(lambda: fn(*args, **kw))
            except Exception as e:  # noqa: BLE001 - a name is a note, not a result
                r["aten_kernel"] = f"? {type(e).__name__}"


def print_table(env, rows, summ):
    from tabulate import tabulate
    table = []
    for r in rows:
        if "aten_ms" not in r or "gems_ms" not in r:
            table.append([r["id"], "", "", "", "", "", "", r.get("error", "")[:60]])
            continue
        rate = f"{r['aten_TFLOPs']:.0f}/{r['gems_TFLOPs']:.0f}"
        bw = f"{r['aten_GBps']:.0f}/{r['gems_GBps']:.0f}" if "aten_GBps" in r else ""
        if "gems_roof" in r:
            bw += f" ({r['aten_roof']:.0%}/{r['gems_roof']:.0%})"
        note = "" if ok(r) else _why_not(r)[:40]
        table.append([r["id"], f"{r['aten_ms']:.4f}", f"{r['gems_ms']:.4f}", f"{r['ratio']:.2f}", rate, bw,
                      tile_of(r.get("aten_kernel")), r.get("config", ""), note])
    print(f"\n{env}")
    print(tabulate(table, headers=["case", "ATen ms", "Gems ms", "ratio", "TFLOP/s A/G", "GB/s A/G (roof)",
                                   "cuBLAS tile", "Gems kernel", ""]))
    print("\nGEMM time per step, cases above x calls (ATen -> Gems ms):")
    for k, d in summ["per_source_step_gemm_ms"].items():
        print(f"  {k:22s} {d['aten_ms']:9.3f} -> {d['gems_ms']:9.3f}  ({d['ratio']:.2f}x, {d['cases']} cases)")
    g = summ["geomean_ratio"]
    gs = summ["geomean_ratio_skinny"]
    print(f"geomean ratio {g:.3f}" if g else "geomean ratio -", end="")
    print(f" (skinny M<={SKINNY_M}: {gs:.3f})" if gs else "", end="")
    print(f"; over 1.10x: {summ['over_1.10']} of {summ['counted']}; worst {summ['worst']}; "
          f"not counted: {len(summ['not_counted'])}; first calls (compile + tuning): {summ['tuning_s']:.1f} s")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--cases", default=str(CASES_FILE), help="the case table (default: %(default)s)")
    p.add_argument("--model", default=None, help="only cases a model calls (llama2, bert, llava, aquila, llama-1.1b)")
    p.add_argument("--workload", default=None, choices=("prefill", "decode", "train"))
    p.add_argument("--max-cases", type=int, default=None)
    p.add_argument("--quick", action="store_true", help="fewer timed runs (CUDA)")
    p.add_argument("--rounds", type=int, default=1,
                   help="time ATen and Gems in turns this many times per case (medians; default 1)")
    p.add_argument("--cap", type=int, default=None,
                   help="cap M, N, K at this (default: 64 on cpu, none on cuda)")
    p.add_argument("--candidates", default=None,
                   help="the tuner's extra candidate groups for 16-bit inputs, comma-separated ('' for none; "
                        "blas.CANDIDATE_GROUPS: wide, wave, deep, ksplit); default blas.CANDIDATES")
    p.add_argument("--confirm-rounds", type=int, default=None,
                   help="the tuner re-times its fastest configs this many more times before choosing "
                        "(runtime.autotune.CONFIRM_ROUNDS; for an A/B give each side its own GEMS_CACHE_DIR)")
    p.add_argument("--tuner-timing", default=None, choices=("do_bench", "hold"),
                   help="how the tuner times configs (runtime.autotune.TIMING, default 'hold': behind a sleep "
                        "kernel, so the host's launch cost stays out; 'do_bench': triton.testing.do_bench; each "
                        "timing has its own cache file)")
    p.add_argument("-o", "--output", default=os.path.join(os.environ.get("OUT", "."), "gemm.json"))
    a = p.parse_args(argv)
    use_interpreter_for(a.device)   # before triton is imported (gems imports it)
    os.environ.setdefault("GEMS_GEMM", "triton")
    import torch
    import triton
    import gems
    from gems.ops.blas import matmul as blas
    if a.candidates is not None:
        try:
            blas.CANDIDATES = blas.check_candidates(g for g in a.candidates.split(",") if g)
        except ValueError as e:
            p.error(f"--candidates: {e}")
    from gems.runtime import autotune
    if a.confirm_rounds is not None:
        if a.confirm_rounds < 0:
            p.error("--confirm-rounds: 0 or more")
        autotune.CONFIRM_ROUNDS = a.confirm_rounds
    if a.tuner_timing is not None:
        autotune.TIMING = a.tuner_timing
    if a.rounds < 1:
        p.error("--rounds: 1 or more")
    if a.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here (use --device cpu for the smoke run)")
    cap = a.cap if a.cap is not None else (64 if a.device == "cpu" else None)
    doc, cases = load_cases(a.cases, a.model, a.workload, a.max_cases)
    if not cases:
        p.error(f"no case in {a.cases} matches --model {a.model} --workload {a.workload}")
    cases = [scaled(c, cap) for c in cases]
    timer = Timer(a.device, a.quick)
    cuda = a.device == "cuda"
    gpu = torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter: times mean nothing)"
    env = {"date": time.strftime("%Y-%m-%d"), "gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
           "gems": gems.__version__, "cases_from": doc.get("command"), "quick": a.quick, "cap": cap,
           "filters": {"model": a.model, "workload": a.workload, "max_cases": a.max_cases},
           "candidates": list(blas.CANDIDATES), "confirm_rounds": autotune.CONFIRM_ROUNDS, "rounds": a.rounds,
           "tuner_timing": autotune.TIMING}
    roof = None
    if cuda:
        roof = env["copy_roof_GBps"] = copy_roof_gbps(timer)
        env["datasheet_GBps"] = next((v for k, v in _DATASHEET.items() if k in gpu), None)
    print(env, flush=True)
    rows = []
    for c in cases:
        # the interpreter's bf16 is broken (docs: facts): the smoke run computes in fp32
        dt = getattr(torch, _DT[c["dtype"]]) if cuda else torch.float32
        try:
            r = run_case(c, a.device, dt, timer, roof, a.rounds)
        except Exception as e:  # noqa: BLE001 - one broken case must not hide the others
            gems.disable()
            r = {"id": c["id"], "M": c["M"], "error": f"{type(e).__name__}: {str(e)[:300]}"}
        rows.append(r)
        print(json.dumps(r), flush=True)
        if cuda:
            torch.cuda.empty_cache()
    if cuda:
        add_aten_kernels(rows, cases, lambda c: getattr(torch, _DT[c["dtype"]]))
    summ = summarize(rows, cases)
    Path(a.output).parent.mkdir(parents=True, exist_ok=True)
    with open(a.output, "w") as f:
        json.dump({"env": env, "rows": rows, "summary": summ}, f, indent=1)
    print_table(env, rows, summ)
    return 0


if __name__ == "__main__":
    sys.exit(main())
