"""GPU benchmarks: ATen vs Gems side by side in one process (FlagGems / Liger columns when importable).

    python -m benchmarks.run                  # every case, table on stdout, JSON to --json
    python -m benchmarks.run --only softmax   # cases whose name contains 'softmax'

Per case: median time of ATen and of Gems (`triton.testing.do_bench`, median of many runs after
warm-up), Gems/ATen ratio, achieved GB/s (bytes that must move: each input read once, each output
written once) or TFLOP/s, Gems' relative error against ATen, and whether Gems served the call
(from `gems.stats()`, so a silent fallback never shows up as a Gems time).
Loop ratio: the same from back-to-back calls synchronized once (`loop_ms`): do_bench's L2 flush skews
host-bound calls, the loop shows what a model sees. Device ratio: the kernels' own time per call
(`device_ms`, torch.profiler's kernel sums), which no host cost enters. Host overhead rows: 1024-element fp32 calls,
20,000 in a row, synchronized only at the end.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch
import triton
from triton.testing import do_bench

import gems

BF = torch.bfloat16
CASES = []


def case(name, bytes_=None, flops=None, target=None):
    def deco(setup):
        CASES.append(dict(name=name, setup=setup, bytes=bytes_, flops=flops, target=target))
        return setup
    return deco


def _t(shape, dtype=BF, grad=False):
    return torch.randn(shape, device="cuda", dtype=dtype, requires_grad=grad)


N64M = 64 * 1024 * 1024
# ---- core targets (ratio = Gems time / ATen time) ----
S = (32768, 4096)
NS = S[0] * S[1]


@case("softmax bf16 32768x4096", bytes_=2 * 2 * NS, target=0.40)
def _():
    x = _t(S)
    return lambda: torch.softmax(x, -1)


@case("softmax backward bf16 32768x4096", bytes_=3 * 2 * NS, target=1.0)
def _():
    y, g = torch.softmax(_t(S), -1), _t(S)
    return lambda: torch.ops.aten._softmax_backward_data(g, y, -1, BF)


@case("log_softmax bf16 32768x4096", bytes_=2 * 2 * NS, target=1.0)
def _():
    x = _t(S)
    return lambda: torch.log_softmax(x, -1)


@case("layer_norm bf16 32768x4096", bytes_=2 * 2 * NS, target=0.68)
def _():
    x, w, b = _t(S), _t(S[1]), _t(S[1])
    return lambda: torch.nn.functional.layer_norm(x, (S[1],), w, b)


@case("layer_norm backward bf16 32768x4096", bytes_=3 * 2 * NS, target=1.0)
def _():
    x, w, b, g = _t(S), _t(S[1]), _t(S[1]), _t(S)
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, (S[1],), w, b, 1e-5)
    return lambda: torch.ops.aten.native_layer_norm_backward(g, x, (S[1],), mean, rstd, w, b, [True, True, True])


@case("sum dim=-1 bf16 32768x4096", bytes_=2 * NS, target=1.0)
def _():
    x = _t(S)
    return lambda: torch.sum(x, -1)


@case("mean dim=0 bf16 32768x4096", bytes_=2 * NS, target=1.0)
def _():
    x = _t(S)
    return lambda: torch.mean(x, 0)


@case("sum all bf16 64M", bytes_=2 * N64M, target=1.0)
def _():
    x = _t(N64M)
    return lambda: torch.sum(x)


@case("amax dim=-1 bf16 32768x4096", bytes_=2 * NS, target=1.0)
def _():
    x = _t(S)
    return lambda: torch.amax(x, -1)


@case("mm bf16 8192^3", flops=2 * 8192 ** 3, target=1.05)
def _():
    a, b = _t((8192, 8192)), _t((8192, 8192))
    return lambda: torch.mm(a, b)


@case("mm bf16 4096x4096x11008", flops=2 * 4096 * 4096 * 11008, target=1.05)
def _():
    a, b = _t((4096, 4096)), _t((4096, 11008))
    return lambda: torch.mm(a, b)


@case("addmm (linear) bf16 4096x4096x11008, B transposed", flops=2 * 4096 * 4096 * 11008, target=1.05)
def _():
    x, w, bias = _t((4096, 4096)), _t((11008, 4096)), _t(11008)
    return lambda: torch.nn.functional.linear(x, w, bias)


@case("bmm bf16 32x(2048x128 @ 128x2048)", flops=2 * 32 * 2048 * 2048 * 128, target=1.05)
def _():
    a, b = _t((32, 2048, 128)), _t((32, 128, 2048))
    return lambda: torch.bmm(a, b)


@case("embedding bf16 16384 of 32000x4096", bytes_=2 * 2 * 16384 * 4096, target=1.0)
def _():
    idx, w = torch.randint(0, 32000, (16384,), device="cuda"), _t((32000, 4096))
    return lambda: torch.nn.functional.embedding(idx, w)


@case("embedding backward bf16 16384 of 32000x4096", bytes_=2 * 2 * 16384 * 4096 + 2 * 32000 * 4096, target=1.0)
def _():
    idx, g = torch.randint(0, 32000, (16384,), device="cuda"), _t((16384, 4096))
    return lambda: torch.ops.aten.embedding_dense_backward(g, idx, 32000, -1, False)


# ---- pointwise (bandwidth-bound: the targets are ratios to ATen) ----
@case("add bf16 64M", bytes_=3 * 2 * N64M, target=1.03)
def _():
    x, y = _t(N64M), _t(N64M)
    return lambda: torch.add(x, y)


@case("mul bf16 64M", bytes_=3 * 2 * N64M, target=1.03)
def _():
    x, y = _t(N64M), _t(N64M)
    return lambda: torch.mul(x, y)


@case("gelu bf16 64M", bytes_=2 * 2 * N64M, target=1.03)
def _():
    x = _t(N64M)
    return lambda: torch.nn.functional.gelu(x)


@case("gelu tanh bf16 64M", bytes_=2 * 2 * N64M, target=1.03)
def _():
    x = _t(N64M)
    return lambda: torch.nn.functional.gelu(x, approximate="tanh")


@case("silu bf16 64M", bytes_=2 * 2 * N64M, target=1.03)
def _():
    x = _t(N64M)
    return lambda: torch.nn.functional.silu(x)


@case("silu backward bf16 64M", bytes_=3 * 2 * N64M, target=1.0)
def _():
    x, g = _t(N64M), _t(N64M)
    return lambda: torch.ops.aten.silu_backward(g, x)


@case("exp bf16 64M", bytes_=2 * 2 * N64M, target=1.03)
def _():
    x = _t(N64M)
    return lambda: torch.exp(x)


@case("where bf16 64M", bytes_=(2 * 3 + 1) * N64M, target=1.03)
def _():
    c, x, y = _t(N64M) > 0, _t(N64M), _t(N64M)
    return lambda: torch.where(c, x, y)


@case("add bf16 8192^2 a+a.T", bytes_=3 * 2 * 8192 * 8192, target=0.40)
def _():
    a = _t((8192, 8192))
    return lambda: torch.add(a, a.t())


@case("add bf16 row+matrix 8192x8192 + 8192", bytes_=2 * 2 * 8192 * 8192, target=1.0)
def _():
    a, r = _t((8192, 8192)), _t(8192)
    return lambda: a + r


@case("mul bf16 64M * 2.0 (scalar)", bytes_=2 * 2 * N64M, target=1.0)
def _():
    x = _t(N64M)
    return lambda: x * 2.0


HOST = {
    "add": lambda s, s2: (lambda: torch.add(s, s2)),
    "mul_scalar": lambda s, s2: (lambda: s * 2.0),
    "softmax": lambda s, s2: (lambda: torch.softmax(s.view(8, 128), -1)),
    "sum": lambda s, s2: (lambda: torch.sum(s)),
}


def host_us(fn, n=20000, warmup=200, sync=torch.cuda.synchronize):
    """Wall time per call (us) of n back-to-back calls synchronized once, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return (time.perf_counter() - t0) / n * 1e6


def bench(fn):
    fn()
    torch.cuda.synchronize()
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def loop_ms(fn, median_ms):
    """Wall time per call of back-to-back calls synchronized once, about 20 ms of them (10-300 calls).
    do_bench flushes L2 (a 256 MiB fill, Gems' own kernel when Gems is on) before each timed call; for
    a host-bound call that fill lets the host run ahead and its event time understates the call's
    host time by a varying amount. The loop has no such offset: where the two columns differ, the
    call is host-bound and the loop is what a model sees."""
    return host_us(fn, max(10, min(300, int(20.0 / max(median_ms, 1e-3)))), warmup=0) / 1e3


def device_kernels(fn, n=20):
    """{kernel (or memset/copy) name: device ms per call} from the profiler over n calls of fn."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    return {e.key: e.self_device_time_total / n / 1e3 for e in prof.key_averages() if e.self_device_time_total}


def device_ms(fn, n=20):
    """Device time per call (ms): the sum of the kernels (and memsets/copies) the profiler records
    over n calls, divided by n. The host's pace does not enter it, so for a launch-bound call it is
    the column that compares the kernels; with the loop column it splits a ratio into device and host."""
    return sum(device_kernels(fn, n).values())


def _first(x):
    return x[0] if isinstance(x, (tuple, list)) else x


def measure(fn, deterministic=True):
    """ATen's and Gems' median times of fn, Gems' relative error against ATen (NaN when fn is random),
    and whether Gems served it (from gems.stats(): a silent fallback never shows as a Gems time)."""
    r = {}
    gems.disable()
    ref = _first(fn())
    r["aten_ms"] = bench(fn)
    r["aten_loop_ms"] = loop_ms(fn, r["aten_ms"])
    r["aten_device_ms"] = device_ms(fn)
    gems.reset_stats()
    gems.enable()
    try:
        out = _first(fn())
        st = gems.stats()
        r["served"] = sum(v["served"] for v in st.values())
        r["fallback"] = {k: v["reasons"] for k, v in st.items() if v["fallback"]}
        r["relerr"] = (((out.double() - ref.double()).norm() / (ref.double().norm() + 1e-12)).item()
                       if deterministic else float("nan"))
        r["gems_ms"] = bench(fn)
        r["gems_loop_ms"] = loop_ms(fn, r["gems_ms"])
        r["gems_device_ms"] = device_ms(fn)
    finally:
        gems.disable()
    r["ratio"] = r["gems_ms"] / r["aten_ms"]
    r["loop_ratio"] = r["gems_loop_ms"] / r["aten_loop_ms"]
    r["device_ratio"] = r["gems_device_ms"] / r["aten_device_ms"] if r["aten_device_ms"] > 0 else float("nan")
    return r


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "."), "bench.json"))
    ap.add_argument("--no-host", action="store_true")
    args = ap.parse_args(argv)
    env = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(0),
           "torch": torch.__version__, "triton": triton.__version__, "gems": gems.__version__}
    print(env, flush=True)
    rows = []
    for c in CASES:
        if args.only and args.only not in c["name"]:
            continue
        r = {"case": c["name"], "target": c["target"]}
        try:
            r.update(measure(c["setup"]()))
            if c["bytes"]:
                r["aten_GBps"] = c["bytes"] / r["aten_ms"] / 1e6
                r["gems_GBps"] = c["bytes"] / r["gems_ms"] / 1e6
            if c["flops"]:
                r["aten_TFLOPs"] = c["flops"] / r["aten_ms"] / 1e9
                r["gems_TFLOPs"] = c["flops"] / r["gems_ms"] / 1e9
        except Exception as e:  # one broken case must not hide the others
            gems.disable()
            r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        torch.cuda.empty_cache()
        rows.append(r)
        print(json.dumps(r), flush=True)

    if not args.no_host:
        s, s2 = torch.randn(1024, device="cuda"), torch.randn(1024, device="cuda")
        h = {"case": "host overhead per call (us), 1024 fp32, 20k calls"}
        for k, mk in HOST.items():
            h[f"aten_{k}_us"] = host_us(mk(s, s2))
        gems.enable()
        for k, mk in HOST.items():
            h[f"gems_{k}_us"] = host_us(mk(s, s2))
        gems.disable()
        with gems.use_gems():
            pass
        t0 = time.perf_counter()
        for _ in range(10000):
            with gems.use_gems():
                pass
        h["use_gems_enter_exit_us"] = (time.perf_counter() - t0) / 10000 * 1e6
        rows.append(h)
        print(json.dumps(h), flush=True)

    with open(args.json, "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=1)
    print_table(env, rows)


def print_table(env, rows):
    from tabulate import tabulate
    table = []
    for r in rows:
        if "aten_ms" not in r:
            if "error" in r:
                table.append([r["case"], "", "", "", "", "", "", "", r["error"][:60]])
            continue
        rate = (f"{r['aten_GBps']:.0f} / {r['gems_GBps']:.0f} GB/s" if "aten_GBps" in r else
                f"{r['aten_TFLOPs']:.0f} / {r['gems_TFLOPs']:.0f} TFLOP/s" if "aten_TFLOPs" in r else "")
        ok = "" if r.get("target") is None else ("met" if r["ratio"] <= r["target"] else f"MISS (<= {r['target']})")
        note = "FELL BACK " + json.dumps(r["fallback"])[:50] if r.get("fallback") else (
            "not served" if not r.get("served") else "")
        loop = f"{r['loop_ratio']:.2f}" if "loop_ratio" in r else ""
        dev = f"{r['device_ratio']:.2f}" if "device_ratio" in r else ""
        table.append([r["case"], f"{r['aten_ms']:.4f}", f"{r['gems_ms']:.4f}", f"{r['ratio']:.2f}", loop, dev, rate,
                      f"{r['relerr']:.1e}", (ok + " " + note).strip()])
    print(f"\n{env}")
    print(tabulate(table, headers=["case", "ATen ms", "Gems ms", "ratio", "loop ratio", "device ratio", "ATen / Gems rate", "relerr",
                                   "target"]))
    for r in rows:
        if "host" in r["case"]:
            print("\n" + r["case"])
            for k in HOST:
                a, g = r[f"aten_{k}_us"], r[f"gems_{k}_us"]
                print(f"  {k:12s} ATen {a:6.2f} us  Gems {g:6.2f} us  ratio {g / a:.2f}")
            print(f"  use_gems() enter+exit {r['use_gems_enter_exit_us']:.2f} us")


if __name__ == "__main__":
    sys.exit(main())
