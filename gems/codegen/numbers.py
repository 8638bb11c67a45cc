"""Python numbers at Tensor positions of an ATen schema, for calls into ATen's own kernels.

When ATen passes a *wrapped number* (`x * 2.0` reaches `mul.Tensor` with `other` a 0-dim tensor
flagged as a wrapped number) to a Python kernel, the kernel receives a Python float/int/bool. Calling
the original kernel back with `call_boxed` then fails ("Expected a value of type 'Tensor'"), and
Python cannot create a wrapped number. `numbers_to_tensors` replaces each such number by a 0-dim CPU
tensor whose dtype makes ATen's type promotion give the wrapped number's result:

* float: the widest floating dtype among the call's tensors (same category: the tensors decide, and
  a float64 tensor keeps the number exact), else the default dtype (the number's category wins, and
  a wrapped float promotes to the default dtype);
* int: the widest integer dtype among the tensors, else int64;
* bool: bool.

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


def numbers_to_tensors(args, positions):
    """`args` with Python numbers at `positions` replaced by equivalent 0-dim tensors (see module doc)."""
    nums = [i for i in positions if i < len(args) and isinstance(args[i], (bool, int, float))]
    if not nums:
        return args
    tens = [a for a in args if isinstance(a, torch.Tensor)]
    floats = [t.dtype for t in tens if t.is_floating_point()]
    ints = [t.dtype for t in tens if not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool]
    args = list(args)
    for i in nums:
        v = args[i]
        if isinstance(v, bool):
            dt = torch.bool
        elif isinstance(v, int):
            dt = max(ints, key=lambda d: torch.iinfo(d).bits) if ints else torch.int64
        else:
            dt = max(floats, key=lambda d: _FLOAT_RANK.get(d, 0)) if floats else torch.get_default_dtype()
        args[i] = torch.tensor(v, dtype=dt)
    return tuple(args)
