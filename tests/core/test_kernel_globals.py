"""Kernels may only read module globals that are tl.constexpr: the GPU compiler rejects anything else
("Cannot access global variable ... from within @jit'ed function") while the CPU interpreter accepts
it, so without this check such a kernel passes CI and fails on every GPU call."""
import importlib
import pkgutil
import types

import triton.language as tl

import gems
import gems.codegen
import gems.ops
from gems.runtime.launch import LaunchCache


def _jit_functions():
    seen = set()
    for pkg in (gems.ops, gems.codegen):
        for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            mod = importlib.import_module(m.name)
            for name, obj in vars(mod).items():
                if isinstance(obj, LaunchCache):
                    obj = obj.fn
                fn = getattr(obj, "fn", None)
                if isinstance(fn, types.FunctionType) and hasattr(obj, "arg_names") and id(fn) not in seen:
                    seen.add(id(fn))
                    yield f"{mod.__name__}.{name}", fn


def _names(code):
    out = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            out |= _names(c)
    return out


def test_kernels_read_only_constexpr_globals():
    bad = []
    found = 0
    for qual, fn in _jit_functions():
        found += 1
        for n in _names(fn.__code__):
            v = fn.__globals__.get(n)
            if isinstance(v, (bool, int, float)) and not isinstance(v, tl.constexpr):
                bad.append(f"{qual} reads global {n}={v!r}")
    assert found > 5
    assert not bad, "wrap these in tl.constexpr(...):\n" + "\n".join(bad)
