"""Compile, for a GPU target, every hand-written kernel the CPU suite launched: GPU-only compile errors
without a GPU.

The CPU suite runs kernels under the Triton interpreter, which accepts code the compiler rejects (a
constexpr re-bound in a loop, say) and knows no shared-memory limit. Run the suite with
GEMS_COMPILE_RECORD=FILE (tests/conftest.py then writes each launched kernel's signature, constexpr
values and num_warps to FILE, once per distinct one), then this script compiles each record with
Triton's real compiler (front end, LLVM and ptxas, all of which run without a GPU):

    GEMS_COMPILE_RECORD=/tmp/kernels.jsonl python -m pytest tests/ops/test_sort.py
    python scripts/compile_check.py /tmp/kernels.jsonl [--arch 90] [-j 2]

tests/data/kernel_signatures.jsonl holds one record per kernel (`--per-kernel 1 --write FILE` after a
recorded run of the whole suite); tests/core/test_gpu_compile.py compiles them in CI and fails when a
`@kernel` has none or its record no longer matches its parameters.

A record fails when compiling raises or the kernel needs more shared memory than one block of the
target gets (227 KiB on sm_90). Generated pointwise kernels (gems.codegen) are left out: their source is
written at run time; the GPU suite covers them.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import importlib
import json
import os
import sys

_SHARED_MAX = {90: 232448, 80: 166912, 89: 101376}

_PTR = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64", "int64": "i64",
        "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i1"}


# ---- recording (imported by tests/conftest.py under the interpreter) -------------------------------
def install_recorder(path: str) -> None:
    """Patch the interpreter's launch so that each distinct kernel launch is appended to `path`."""
    import inspect

    import torch
    from triton.runtime.interpreter import InterpretedFunction

    seen: set = set()
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        fn = self.fn
        if not fn.__module__.startswith("gems.") or fn.__module__.startswith("gems.codegen"):
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)
        params = list(inspect.signature(fn).parameters.values())
        sig, consts = {}, {}
        for p, a in zip(params, args):
            if "constexpr" in str(p.annotation):
                consts[p.name] = (a if isinstance(a, (int, float, bool, str, type(None)))
                                  else f"tl.dtype:{a}" if type(a).__name__ == "dtype" else f"?{a}")
                sig[p.name] = "constexpr"
            elif isinstance(a, torch.Tensor):
                sig[p.name] = "*" + _PTR.get(str(a.dtype).split(".")[-1], "?")
            elif a is None:
                sig[p.name] = "constexpr"
                consts[p.name] = None
            elif isinstance(a, bool):
                sig[p.name] = "i1"
            elif isinstance(a, int):
                sig[p.name] = "i32" if -2**31 <= a < 2**31 else ("i64" if a < 2**63 else "u64")
            elif isinstance(a, float):
                sig[p.name] = "fp32"
            elif type(a).__name__ == "TensorDescriptor":   # host TMA descriptor: Triton's type string
                sig[p.name] = f"tensordesc<{_PTR.get(str(a.base.dtype).split('.')[-1], '?')}{list(a.block_shape)}>"
            else:
                sig[p.name] = "?" + type(a).__name__
        rec = {"module": fn.__module__, "name": fn.__qualname__, "signature": sig, "constexprs": consts,
               "num_warps": kwargs.get("num_warps", 4)}
        key = json.dumps(rec, sort_keys=True, default=str)
        if key not in seen:
            seen.add(key)
            with open(path, "a") as f:
                f.write(key + "\n")
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run


# ---- compiling ---------------------------------------------------------------------------------------
def _jit(module: str, name: str):
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    while not hasattr(obj, "arg_names") and hasattr(obj, "fn"):   # LaunchCache, Autotuner, ...
        obj = obj.fn
    return obj


def _compile(line: str, arch: int):
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    rec = json.loads(line)
    try:
        fn = _jit(rec["module"], rec["name"])
        names = fn.arg_names
        if any(t.startswith("?") or t.endswith("?") for t in rec["signature"].values()):
            return rec, "skipped: an argument of a type this script does not map"
        consts = {(names.index(k),): tl.dtype(v[9:]) if isinstance(v, str) and v.startswith("tl.dtype:") else v
                  for k, v in rec["constexprs"].items()}
        if any(isinstance(v, str) and v.startswith("?") for v in rec["constexprs"].values()):
            return rec, "skipped: a constexpr of a type this script does not map"
        # optional: arguments Triton would see as multiples of 16 (aligned pointers, strides), as on a GPU call
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in rec.get("divisible_16", ())}
        if getattr(fn, "is_gluon", lambda: False)():     # Gluon kernels: the same compiler, another front end
            from triton.experimental.gluon._runtime import GluonASTSource as source
        else:
            source = ASTSource
        src = source(fn=fn, signature=rec["signature"], constexprs=consts, attrs=attrs)
        opts = {"num_warps": rec["num_warps"], "debug": bool(fn.debug)}
        if "num_stages" in rec:
            opts["num_stages"] = rec["num_stages"]
        if "maxnreg" in rec:
            opts["maxnreg"] = rec["maxnreg"]
        k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)
        shared = k.metadata.shared
        if shared > _SHARED_MAX.get(arch, 232448):
            return rec, f"FAIL: needs {shared} bytes of shared memory (sm_{arch} allows {_SHARED_MAX.get(arch)})"
        return rec, None
    except Exception as e:  # noqa: BLE001 - every compile error is the finding
        c = e
        while c.__cause__ is not None:
            c = c.__cause__
        return rec, f"FAIL: {type(e).__name__}: {str(e).strip()[-600:]} | cause: {type(c).__name__}: {str(c)[:300]}"


def _sample(lines, n):
    """At most n records per kernel: distinct constexpr values first, then distinct pointer dtypes."""
    by: dict = {}
    for ln in lines:
        rec = json.loads(ln)
        by.setdefault((rec["module"], rec["name"]), []).append((ln, rec))
    out = []
    for recs in by.values():
        seen_c, seen_s, pick = set(), set(), []
        for ln, rec in recs:
            c = json.dumps([rec["constexprs"], rec["num_warps"]], sort_keys=True, default=str)
            if c not in seen_c and len(pick) < n:
                seen_c.add(c)
                seen_s.add(json.dumps(rec["signature"], sort_keys=True))
                pick.append(ln)
        for ln, rec in recs:
            sg = json.dumps(rec["signature"], sort_keys=True)
            if sg not in seen_s and len(pick) < n and ln not in pick:
                seen_s.add(sg)
                pick.append(ln)
        out += pick
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("records")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--only", default="", help="substring of module.name")
    ap.add_argument("--write", metavar="FILE", help="write the (sampled) records to FILE instead of compiling")
    ap.add_argument("--per-kernel", type=int, default=0,
                    help="compile at most N records of each kernel (those with the most distinct constexprs first)")
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("compile_check: unset TRITON_INTERPRET (the kernels must be real JIT functions)")
    lines = sorted({ln.strip() for ln in open(a.records) if ln.strip() and a.only in ln})
    if a.per_kernel:
        lines = _sample(lines, a.per_kernel)
    if a.write:
        with open(a.write, "w") as f:
            f.writelines(ln + "\n" for ln in lines)
        print(f"{len(lines)} records written to {a.write}")
        return 0
    fails = 0
    with cf.ProcessPoolExecutor(a.jobs) as ex:
        for rec, err in ex.map(_compile, lines, [a.arch] * len(lines)):
            tag = f"{rec['module']}.{rec['name']} warps={rec['num_warps']} {rec['constexprs']}"
            if err and err.startswith("FAIL"):
                fails += 1
                print(f"{tag}\n    {err}", flush=True)
            elif err:
                print(f"{tag}: {err}", flush=True)
    print(f"{len(lines)} kernel signatures compiled for sm_{a.arch}: {fails} failed")
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
