"""Every hand-written kernel compiles for an H100 (sm_90), checked without a GPU.

The CPU suite runs kernels under the Triton interpreter, which accepts code that Triton's compiler
rejects (a constexpr re-bound in a loop made sort fail on the GPU only). Here Triton's real compiler
(front end, LLVM, ptxas: all in the triton wheel) compiles one recorded signature per kernel from
tests/data/kernel_signatures.jsonl, in a process without the interpreter. A new `@kernel` needs a
record, and a kernel whose parameters change needs a new one; scripts/compile_check.py says how.
"""
import importlib
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import gems.fused
import gems.ops
from gems.runtime.launch import LaunchCache
from harness import ON_GPU

ROOT = Path(__file__).resolve().parents[2]
RECORDS = ROOT / "tests" / "data" / "kernel_signatures.jsonl"
HOW = ("record them: GEMS_COMPILE_RECORD=/tmp/k.jsonl python -m pytest -n 2 tests/core tests/ops tests/fused; "
       "python scripts/compile_check.py /tmp/k.jsonl --per-kernel 1 --write tests/data/kernel_signatures.jsonl")


def _launch_caches():
    found = {}
    for pkg in (gems.ops, gems.fused):
        for info in pkgutil.iter_modules(pkg.__path__, pkg.__name__ + "."):
            mod = importlib.import_module(info.name)
            for name, obj in vars(mod).items():
                # the module that defines the kernel (not one importing it): the Python function's, under
                # the LaunchCache and the JIT/interpreted function (whose own __module__ is Triton's)
                if isinstance(obj, LaunchCache) and _defining_module(obj) == mod.__name__:
                    found[(mod.__name__, name)] = obj
    assert found, "no kernels found: the search is broken"
    return found


def _defining_module(obj):
    import inspect
    fn = obj
    while not inspect.isfunction(fn) and hasattr(fn, "fn"):
        fn = fn.fn
    return getattr(fn, "__module__", None)


def _records():
    return [json.loads(line) for line in RECORDS.read_text().splitlines() if line.strip()]


def test_every_kernel_has_a_record():
    have = {(r["module"], r["name"]) for r in _records()}
    missing = sorted(f"{m}.{n}" for m, n in _launch_caches() if (m, n) not in have)
    assert not missing, f"kernels without a compile record: {missing}; {HOW}"


def test_records_match_the_kernels():
    import inspect
    for r in _records():
        fn = getattr(importlib.import_module(r["module"]), r["name"])
        while not inspect.isfunction(fn):       # LaunchCache -> JIT/interpreted function -> function
            fn = fn.fn
        params = inspect.signature(fn).parameters
        required = [n for n, p in params.items() if p.default is inspect.Parameter.empty]
        what = f"{r['module']}.{r['name']}"
        assert set(r["signature"]) <= set(params), f"{what}: the record names parameters the kernel lost; {HOW}"
        assert set(required) <= set(r["signature"]), f"{what}: the kernel has new parameters; {HOW}"


@pytest.mark.skipif(ON_GPU, reason="on the GPU the suite compiles every kernel anyway")
def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "compile_check.py"), str(RECORDS), "-j", "2"],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"kernels that do not compile for sm_90:\n{proc.stdout[-6000:]}{proc.stderr[-3000:]}"
