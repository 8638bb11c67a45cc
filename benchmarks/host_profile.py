"""Where the host time of one small Gems call goes (GPU machine): component timings + cProfile.

    python -m benchmarks.host_profile
    python -m benchmarks.host_profile --python-path   # the Python plan path (GEMS_FAST=0), piece by piece

`--python-path` takes one call apart (`x + x`, bf16 [1,1,4096]): the whole call with ATen and with
Gems, the Gems kernel called without the dispatcher, its signature and lookup, the plan alone, and
the floor any Python kernel pays (the dispatcher's hop into Python, an allocation, Triton's launcher).
docs/architecture.md section 6 has the H100 numbers and what they mean for that path.
"""
import argparse
import cProfile
import os
import pstats
import warnings

import torch
import triton
import triton.language as tl

import gems
from benchmarks.run import host_us
from gems.runtime.launch import LaunchCache


us = host_us  # same timer as the benchmark's host rows


@triton.jit
def _scale(X, Y, n, s, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + i, tl.load(X + i, mask=i < n) * s, mask=i < n)


def main():
    x, y = torch.randn(1024, device="cuda"), torch.randn(1024, device="cuda")
    out = torch.empty_like(x)
    r = {}
    r["aten add"] = us(lambda: torch.add(x, y))
    r["aten x*2.0"] = us(lambda: x * 2.0)
    r["torch.empty(1024)"] = us(lambda: torch.empty(1024, device="cuda"))
    r["torch.empty_like"] = us(lambda: torch.empty_like(x))
    r["x.contiguous() (no-op)"] = us(lambda: x.contiguous())
    r["_cuda_getDevice+stream"] = us(lambda: torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice()))
    k = LaunchCache(_scale)
    r["LaunchCache hit"] = us(lambda: k[(1,)](x, out, 1024, 2.0, 1024))
    r["LaunchCache.run hit"] = us(lambda: k.run((1,), (x, out, 1024, 2.0, 1024)))
    r["triton jit launch"] = us(lambda: _scale[(1,)](x, out, 1024, 2.0, 1024))
    ck = next(iter(k._cache.values()))[0]
    s = torch._C._cuda_getCurrentRawStream(0)
    r["compiled.run direct"] = us(lambda: ck.run(1, 1, 1, s, ck.function, ck.packed_metadata, None, None, None,
                                                 x, out, 1024, 2.0, 1024))
    lib = torch.library.Library("aten", "IMPL")
    orig = torch.library.get_kernel("aten::sub.Tensor", "CUDA")
    ks = torch._C.DispatchKeySet("CUDA")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lib.impl("sub.Tensor", lambda *a, **kw: orig.call_boxed(ks, *a, **kw), "CUDA")
    r["aten sub via python passthrough"] = us(lambda: torch.sub(x, y))
    lib._destroy()
    r["aten sub"] = us(lambda: torch.sub(x, y))
    gems.enable()
    calls = {"gems add": lambda: torch.add(x, y), "gems x*2.0": lambda: x * 2.0,
             "gems softmax": lambda: torch.softmax(x.view(8, 128), -1), "gems sum": lambda: torch.sum(x)}
    for name, f in calls.items():
        r[name] = us(f)
    for name, v in r.items():
        print(f"{name:36s} {v:7.2f} us")
    for name, f in calls.items():
        print(f"\n==== cProfile {name} (20k calls)")
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(20000):
            f()
        pr.disable()
        torch.cuda.synchronize()
        pstats.Stats(pr).sort_stats("tottime").print_stats(14)
    gems.disable()


def python_path():
    os.environ["GEMS_FAST"] = "0"            # read when gems.enable() first registers
    from gems import dispatch, registry
    from gems.dispatch import registration
    from gems.runtime import plan as plan_mod
    kernels = {}
    make = registration.make_kernel

    def keep(state, impl, *a):               # the Python kernel of each overload, to call it directly
        k = make(state, impl, *a)
        kernels[impl.name] = k
        return k

    registration.make_kernel = keep
    x = torch.randn(1, 1, 4096, device="cuda", dtype=torch.bfloat16)
    held = torch.empty_like(x)
    r = {"aten x + x": us(lambda: x + x),
         "torch.empty_strided": us(lambda: torch.empty_strided((1, 1, 4096), (4096, 4096, 1), dtype=x.dtype,
                                                               device="cuda")),
         "torch.empty_like": us(lambda: torch.empty_like(x))}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lib = torch.library.Library("aten", "IMPL")
        lib.impl("add.Tensor", lambda a, b, alpha=1: held, "CUDA")
        lib.impl("sub.Tensor", lambda a, b, alpha=1: torch.empty_like(a), "CUDA")
    r["python kernel returning a held tensor"] = us(lambda: x + x)
    r["python kernel returning empty_like"] = us(lambda: x - x)
    lib._destroy()
    gems.enable()
    r["gems x + x (Python path)"] = us(lambda: x + x)
    impl = registry.get("add.Tensor")
    k = kernels["add.Tensor"]
    r["gems kernel, no dispatcher hop"] = us(lambda: k(x, x))
    sig = plan_mod.make_signature(registry.aten_overload("add.Tensor")._schema, impl.dynamic, True)
    plans = dispatch.op_runtime(impl.name).plans.plans
    p = plans[sig(x, x)]
    r["signature"] = us(lambda: sig(x, x))
    r["signature + lookup"] = us(lambda: plans.get(sig(x, x)))
    r["plan alone (allocate, launch)"] = us(lambda: p(x, x))
    r["launch-hook check"] = us(plan_mod.hooks_active)
    gems.disable()
    registration.make_kernel = make
    for name, v in r.items():
        print(f"{name:40s} {v:7.2f} us")
    print(f"\nfloor of any Python kernel (hop + empty_like + launcher) ~ "
          f"{r['python kernel returning empty_like'] + r['plan alone (allocate, launch)'] - r['torch.empty_strided']:.2f} us")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python-path", action="store_true", help="take the Python plan path's call apart")
    python_path() if ap.parse_args().python_path else main()
