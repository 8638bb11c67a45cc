"""The fallback policy: how a call reaches ATen's own kernel, and what Gems does when its implementation
fails where ATen does not.

An implementation that raises where ATen succeeds stops serving that call signature (dtypes, shapes,
strides, argument kinds); other signatures keep being served, so one bad layout never switches the
overload off for the process. Each failing signature is counted and warned about once. The table of
failing signatures is bounded per overload (MAX_BROKEN_SIGNATURES, the oldest dropped first): a
dropped signature is tried again, and fails, warns and goes to ATen again.
`GEMS_STRICT=1` re-raises instead (the test suite sets it).

ATen hands a Python kernel wrapped-number tensors (`x * 2.0`) as Python numbers; every path back to
ATen's original kernel turns them into equivalent 0-dim tensors first (see gems.codegen.numbers).
"""
from __future__ import annotations

import warnings

import torch

from .. import registry
from ..codegen.numbers import call_with_numbers, tensor_positions
from ..runtime import settings

_Tensor = torch.Tensor
_strided = torch.strided

MAX_BROKEN_SIGNATURES = 256

_NUMBER_DTYPES = {float: torch.float64, int: torch.int64, bool: torch.bool, complex: torch.complex128}
# functional overloads that compute every tensor argument at the common dtype and check no input's own
# dtype (gems.codegen.numbers; sub and rsub raise on a bool tensor)
_PROMOTES_ALL = frozenset({"add.Tensor", "mul.Tensor", "div.Tensor"})


def boxed_with_numbers(name, call_boxed):
    """ATen's kernel `call_boxed(keyset, *args, **kwargs)` of overload `name`, taking the Python numbers
    a Python kernel receives for wrapped-number tensors."""
    schema = registry.aten_overload(name)._schema
    positions = tensor_positions(schema)
    if not positions:
        return call_boxed
    if len(positions) == 1:
        # ATen itself calls e.g. _to_copy on a wrapped number: as the only tensor it keeps the
        # wrapped number's own dtype (double / int64 / bool)
        (p,) = positions

        def call_one(keyset, *args, **kwargs):
            if len(args) > p and args[p].__class__ in _NUMBER_DTYPES:
                args = list(args)
                args[p] = torch.tensor(args[p], dtype=_NUMBER_DTYPES[args[p].__class__])
            return call_boxed(keyset, *args, **kwargs)
        return call_one

    out_name = next((a.name for a in schema.arguments if a.kwarg_only and a.alias_info is not None
                     and a.alias_info.is_write), None)

    promotes_all = name in _PROMOTES_ALL

    def call(keyset, *args, **kwargs):
        return call_with_numbers(lambda *a, **kw: call_boxed(keyset, *a, **kw), args, positions, kwargs, out_name,
                                 promotes_all)
    return call


def unserved_scanner(unserved: dict):
    """A function (args, kwargs) -> reason or None: whether a call involves one of the backend's unserved
    dtypes anywhere (a tensor, a dtype argument, a list of tensors, or the default dtype)."""
    def find(v):
        if isinstance(v, _Tensor):
            return unserved.get(v.dtype)
        if isinstance(v, torch.dtype):
            return unserved.get(v)
        if isinstance(v, (list, tuple)):
            for x in v:
                r = find(x)
                if r is not None:
                    return r
        return None

    def scan(args, kwargs):
        for a in args:
            r = find(a)
            if r is not None:
                return r
        for a in kwargs.values():
            r = find(a)
            if r is not None:
                return r
        # Python floats become the default dtype (int tensor + 1.5)
        return unserved.get(torch.get_default_dtype())
    return scan


def after_error(impl, op, exc, call_orig, keyset, args, kwargs):
    """Implementation `impl` raised `exc` (not Unsupported): ATen runs the call. When ATen raises too,
    ATen's exception propagates (the error users would get without Gems); when it succeeds, Gems had a
    bug: ATen's result is returned, the error is counted in `op` (the overload's OpRuntime) and warned
    about, and the call's signature goes to ATen from then on."""
    try:
        out = call_orig(keyset, *args, **kwargs)
    except Exception as aten_exc:  # noqa: BLE001
        raise aten_exc from None
    if settings.STRICT:
        raise exc
    reason = f"gems error: {type(exc).__name__}"
    op.counts[1] += 1
    op.reasons[reason] = op.reasons.get(reason, 0) + 1
    call = describe_call(impl.name, args, kwargs)
    what = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"
    broken = op.broken
    if len(broken) >= MAX_BROKEN_SIGNATURES:
        # bounded: the oldest failing signature makes room (dicts keep insertion order)
        broken.pop(next(iter(broken), None), None)
    broken[call_signature(args, kwargs)] = f"gems error earlier for this signature ({type(exc).__name__})"
    scope = "calls with this signature go to ATen from now on"
    warnings.warn(f"gems: {call} raised {what}; ATen served the call and {scope} (counted in gems.stats()). "
                  f"Please report this.", RuntimeWarning, stacklevel=3)
    return out


def call_signature(args, kwargs):
    """What identifies a call for the error policy: per argument its kind, tensors by dtype, shape,
    strides and device, small values by value."""
    return (tuple(_arg_key(a) for a in args), tuple((k, _arg_key(v)) for k, v in sorted(kwargs.items())))


def _arg_key(a):
    if isinstance(a, _Tensor):
        return ("T", a.dtype, tuple(a.shape), a.stride() if a.layout is _strided else None, a.device, a.layout)
    if isinstance(a, (list, tuple)):
        return tuple(_arg_key(v) for v in a)
    if a is None or isinstance(a, (bool, int, float, str, torch.dtype, torch.device, torch.layout,
                                   torch.memory_format)):
        return a if not isinstance(a, float) or a == a else "nan"
    return type(a).__name__


def describe_call(name, args, kwargs) -> str:
    """'aten::add.Tensor(float32[4, 8], float32[8], alpha=2)': an overload and its input signature."""
    def one(a):
        if isinstance(a, _Tensor):
            d = str(a.dtype).replace("torch.", "")
            nc = "" if a.layout is not _strided or a.is_contiguous() else " non-contiguous"
            return f"{d}{list(a.shape)}{nc}" + ("" if a.device.type in ("cpu", "cuda") else f" on {a.device}")
        if isinstance(a, (list, tuple)):
            return "[" + ", ".join(one(v) for v in a) + "]"
        if a is None or isinstance(a, (bool, int, float, str, torch.dtype, torch.memory_format, torch.layout,
                                       torch.device)):
            return str(a)
        return type(a).__name__
    parts = [one(a) for a in args] + [f"{k}={one(v)}" for k, v in kwargs.items()]
    return f"aten::{name}({', '.join(parts)})"
