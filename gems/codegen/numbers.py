"""Python numbers at Tensor positions of an ATen schema, for calls into ATen's own kernels.

When ATen passes a *wrapped number* (`x * 2.0` reaches `mul.Tensor` with `other` a 0-dim tensor
flagged as a wrapped number) to a Python kernel, the kernel receives a Python float/int/bool. Calling
the original kernel back with `call_boxed` then fails ("Expected a value of type 'Tensor'"), and
Python cannot create a wrapped number. `numbers_to_tensors` replaces each such number by a 0-dim CPU
tensor that ATen treats as it treats the wrapped number:

* where a tensor of more than 0 dims decides the result dtype without the number (it is of the
  number's category or a higher one: a float tensor for a float, an integer or float one for an
  int), the number exactly, as float64 / int64: TensorIterator converts a CPU scalar operand to the
  common dtype (or reads it at opmath precision) whether it is wrapped or not, and ints out of the
  dtype's range wrap (`int8 + 300` is 45), as they do for the wrapped number;
* else a dtype that makes type promotion give the wrapped number's result: for a float, the widest
  floating dtype among the (0-dim) tensors, else the default dtype (the number's category wins);
  for an int, the widest integer dtype among the tensors, else int64. An int out of that dtype's
  range is what ATen converts to the common dtype: wrapped (`int8(1) + 300` is 45, and
  `int8(44) == 300` is True) where the op computes in that integer dtype, kept exact where it
  computes in float (`int8(100) / 300` is 1/3, as are xlogy, copysign, atan2). A tensor cannot say
  both, so `numbers_to_tensors` wraps it and reports that it did; the caller runs the op again with
  the number exact (a tensor of the default float dtype) when the first answer is floating-point
  (`call_with_numbers`);
* bool: bool;
* complex (no Gems kernel takes one; every such call reaches ATen here): every number of the call
  as a 0-dim tensor: complex128, the wrapped number's own dtype, where a dimensioned floating or
  complex tensor decides the result's precision anyway (`float16 + 1j` stays complex32); else of the
  complex dtype ATen's promotion gives the call (`int8 + 1j` the default complex dtype), which a 0-dim
  tensor of that dtype leaves unchanged. For the arithmetic ops that compute every tensor at the common
  dtype, the tensors are cast to that dtype first and the number stays complex128 (division reads the
  number unrounded: `int64 / (0.1 - 0.001j)` on CUDA multiplies by 1 / v computed from the complex128).

This is for the dispatcher's fallback path (`call_orig`); Gems' own pointwise kernels take numbers
as kernel scalars and never need it.
"""
from __future__ import annotations

import torch

_FLOAT_RANK = {torch.float16: 1, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}


def tensor_positions(schema) -> tuple:
    """Indices of the positional arguments typed `Tensor` in an ATen schema."""
    return tuple(i for i, a in enumerate(schema.arguments)
                 if not a.kwarg_only and str(a.type) == "Tensor")


def call_with_numbers(call, args, positions, kwargs, out_name=None, promotes_all=False):
    """call(*args, **kwargs) with the numbers at `positions` as tensors (see the module doc).
    `out_name`: the overload's `out=` argument, if it has one. `promotes_all`: the overload is functional
    and computes every tensor argument at the common dtype with no check on the inputs' own dtypes
    (add, mul, div: sub raises on a bool tensor, which a cast would hide), so a complex
    number can keep its own complex128 (see `_complex_at_common_dtype`)."""
    if promotes_all:
        res = _complex_at_common_dtype(call, args, positions, kwargs)
        if res is not NotImplemented:
            return res
    conv, wrapped = numbers_to_tensors(args, positions, report=True)
    if not wrapped:
        return call(*conv, **kwargs)
    out = kwargs.get(out_name) if out_name else None
    if isinstance(out, torch.Tensor) and out.is_floating_point():
        # an int number out of the inputs' integer range, written to a float out=: whether the op
        # computes in that integer dtype (add: wrap, then cast) or in float (div: exact) shows in
        # whether it accepts an integer out= (a 0-dim scratch tensor; its answer is thrown away)
        dt = next(t.dtype for t in conv if isinstance(t, torch.Tensor) and not t.is_floating_point()
                  and not t.is_complex() and t.dtype != torch.bool)
        try:
            call(*conv, **{**kwargs, out_name: torch.empty((), dtype=dt, device=out.device)})
            in_float = False
        except RuntimeError:
            in_float = True
        return call(*(numbers_to_tensors(args, positions, exact_ints=True) if in_float else conv), **kwargs)
    res = call(*conv, **kwargs)
    if isinstance(res, torch.Tensor) and res.is_floating_point() and out is None:
        # the op computed in float: ATen read the out-of-range int exactly, not wrapped (a functional
        # op: nothing was written by the first call)
        res = call(*numbers_to_tensors(args, positions, exact_ints=True), **kwargs)
    return res


def numbers_to_tensors(args, positions, exact_ints=False, report=False):
    """`args` with Python numbers at `positions` replaced by equivalent 0-dim tensors (see module doc).
    An int out of the range of the integer dtype it takes is wrapped into it, or with `exact_ints`
    kept as a default-float tensor; `report`: return (args, whether such an int was met)."""
    nums = [i for i in positions if i < len(args) and isinstance(args[i], (bool, int, float, complex))]
    if not nums:
        return (args, False) if report else args
    cplx = next((args[i] for i in nums if isinstance(args[i], complex)), None)
    if cplx is not None:
        args = _complex_numbers(args, nums, cplx)
        return (args, False) if report else args
    tens = [a for a in args if isinstance(a, torch.Tensor)]
    float_dim = any(t.dim() and (t.is_floating_point() or t.is_complex()) for t in tens)
    num_dim = float_dim or any(t.dim() and t.dtype != torch.bool for t in tens)
    floats = [t.dtype for t in tens if t.is_floating_point()]
    ints = [t.dtype for t in tens if not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool]
    args = list(args)
    wrapped = False
    for i in nums:
        v = args[i]
        if isinstance(v, bool):
            args[i] = torch.tensor(v, dtype=torch.bool)
        elif isinstance(v, int):
            if num_dim or not ints:
                args[i] = torch.tensor(v, dtype=torch.int64)
            else:
                dt = max(ints, key=lambda d: torch.iinfo(d).bits)
                info = torch.iinfo(dt)
                if info.min <= v <= info.max:
                    args[i] = torch.tensor(v, dtype=dt)
                elif floats:
                    # a float 0-dim tensor decides the dtype: ATen computes in float, the int exact
                    args[i] = torch.tensor(v, dtype=torch.int64)
                else:
                    wrapped = True
                    # int64 first (an int beyond it raises as ATen does), then C's wrapping cast
                    args[i] = torch.tensor(v, dtype=torch.get_default_dtype()) if exact_ints else \
                        torch.tensor(v, dtype=torch.int64).to(dt)
        elif float_dim:
            args[i] = torch.tensor(v, dtype=torch.float64)
        else:
            dt = max(floats, key=lambda d: _FLOAT_RANK.get(d, 0)) if floats else torch.get_default_dtype()
            args[i] = torch.tensor(v, dtype=dt)
    return (tuple(args), wrapped) if report else tuple(args)


def _complex_numbers(args, nums, number):
    """`args` with the numbers at `nums` as 0-dim tensors of the dtype ATen gives a call with the
    complex wrapped number `number`: its category rule (c10's combine_categories) put together from
    torch.result_type on stand-ins, the 0-dim tensors' result with the wrapped number first, then
    the dimensioned tensors' result with that (a bool stand-in for a missing group changes nothing)."""
    dim = zero = torch.bool
    for a in args:
        if isinstance(a, torch.Tensor):
            if a.dim():
                dim = torch.promote_types(dim, a.dtype)
            else:
                zero = torch.promote_types(zero, a.dtype)
    inner = torch.result_type(torch.empty((), dtype=zero), number)
    dt = torch.result_type(torch.empty((1,), dtype=dim), torch.empty((), dtype=inner))
    if dim.is_floating_point or dim.is_complex:
        # a dimensioned floating or complex tensor sets the precision, so the number can keep the wrapped
        # number's own complex128 without changing the result dtype: ATen's CUDA kernels read such a CPU
        # scalar at their compute precision (x / v as x * (1 / v), 1 / v from the complex128 value), and a
        # complex64 / complex32 copy of v rounds it first (a last-bit difference in 0.25 / (0.1 - 0.001j))
        dt = torch.complex128
    args = list(args)
    for i in nums:
        v = args[i]
        args[i] = torch.tensor(v, dtype=torch.bool if isinstance(v, bool) else dt)
    return tuple(args)


def _complex_at_common_dtype(call, args, positions, kwargs):
    """An arithmetic call with a complex number beside integer, bool or only 0-dim tensors, as ATen runs
    it with the wrapped number: every tensor cast to the call's result dtype (made 1-element, and the
    result 0-dim again, when no tensor has dims, so that dims decide the dtype), the number complex128,
    unrounded, as ATen's kernels read the wrapped number. NotImplemented: not such a call."""
    nums = [i for i in positions if i < len(args) and isinstance(args[i], complex)]
    tens = [a for a in args if isinstance(a, torch.Tensor)]
    if not nums or not tens or any(t.dim() and (t.is_floating_point() or t.is_complex()) for t in tens):
        return NotImplemented
    dt = _complex_numbers(args, nums, args[nums[0]])[nums[0]].dtype
    scalar = all(t.dim() == 0 for t in tens)
    conv = [torch.tensor(a, dtype=torch.complex128) if i in nums else
            (a.to(dt).reshape(1) if scalar else a.to(dt)) if isinstance(a, torch.Tensor) else a
            for i, a in enumerate(args)]
    res = call(*conv, **kwargs)
    return res.reshape(()) if scalar and isinstance(res, torch.Tensor) else res
