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
  range raises here (ATen would wrap it, or keep it where the op computes in float);
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
    float_dim = any(t.dim() and (t.is_floating_point() or t.is_complex()) for t in tens)
    num_dim = float_dim or any(t.dim() and t.dtype != torch.bool for t in tens)
    floats = [t.dtype for t in tens if t.is_floating_point()]
    ints = [t.dtype for t in tens if not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool]
    args = list(args)
    for i in nums:
        v = args[i]
        if isinstance(v, bool):
            args[i] = torch.tensor(v, dtype=torch.bool)
        elif isinstance(v, int):
            if num_dim or not ints:
                args[i] = torch.tensor(v, dtype=torch.int64)
            else:
                # raises for a value out of dt's range: ATen wraps it where the common dtype is dt and
                # keeps it where the op computes in float (true division), which a tensor cannot say
                args[i] = torch.tensor(v, dtype=max(ints, key=lambda d: torch.iinfo(d).bits))
        elif float_dim:
            args[i] = torch.tensor(v, dtype=torch.float64)
        else:
            dt = max(floats, key=lambda d: _FLOAT_RANK.get(d, 0)) if floats else torch.get_default_dtype()
            args[i] = torch.tensor(v, dtype=dt)
    return tuple(args)
