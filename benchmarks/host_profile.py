"""Where the host time of one small Gems call goes (GPU machine): component timings + cProfile.

    python -m benchmarks.host_profile
"""
import cProfile
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


if __name__ == "__main__":
    main()
