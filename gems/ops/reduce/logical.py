"""all / any over any list of dims, and _is_all_true / _is_any_true: logical reductions of x != 0.

    all(x, dims)[k] = AND_{r} (x[k, r] != 0),   any(x, dims)[k] = OR_{r} (x[k, r] != 0)

for every input dtype but float64 (NaN != 0 counts as true, -0.0 as false; bool is read as is). The result is
bool (uint8 for a uint8 input, ATen's legacy rule; an out= may be bool or uint8). An empty reduction
gives all = True, any = False. A uint8 out= with another input dtype on the CPU goes to ATen, whose CPU
kernel converts the input to uint8 before testing it (0.5 -> 0); on CUDA ATen tests the input as is.

The input is read through its strides exactly as sum/mean read it, by the same planning and kernels
(reduction.py, op codes OP_ANY / OP_ALL): any = max and all = min of the 0/1 flags (x != 0), accumulated
in int32, R split over programs through an int32 workspace when the grid is too small (the second stage
reduces the flags with the same op). No atomics: deterministic.
"""
from __future__ import annotations

import torch

from ...registry import FLOATS, INTS, Unsupported, register
from ...runtime.utils import prepare_out, wrap_dims
from .reduction import OP_ALL, OP_ANY, reduce_into

# float64 inputs go to ATen (counted): the project serves no float64 compute op, which gems-coverage
# parity relies on to refuse a float64 run (it would compare ATen with itself)
DTYPES = FLOATS + INTS + (torch.bool,)


def _logical(x, dims, keepdim, is_all, out, name):
    """dims: None for every dim, else a list (an empty list reduces nothing: ATen's all.dims rule)."""
    nd = x.dim()
    if dims is None:
        dl = list(range(nd))
    elif len(dims) == 0:
        dl = []
    else:
        dl = wrap_dims(dims, nd)
    rset = set(dl) if nd else set()
    shape = [1 if d in rset else s for d, s in enumerate(x.shape)] if keepdim else \
        [s for d, s in enumerate(x.shape) if d not in rset]
    if out is not None:
        if out.dtype not in (torch.bool, torch.uint8):
            raise RuntimeError(f"{name} only supports bool tensor for result, got: {_aten_dtype_name(out.dtype)}")
        odt = out.dtype
        if odt == torch.uint8 and x.dtype not in (torch.uint8, torch.bool) and not x.is_cuda:
            # ATen's CPU reduction reads self converted to out's dtype first (all(0.5) into uint8 is
            # False, 256 is 0); its CUDA one reads self as it is, as Gems does. C's float -> uint8
            # conversion out of range is the CPU's own: ATen answers it
            raise Unsupported("uint8 out= with a non-uint8 self on the CPU (ATen converts self to uint8)")
    else:
        odt = torch.uint8 if x.dtype == torch.uint8 else torch.bool
    y = prepare_out(out, shape, odt, x.device)
    n = y.numel()
    if n == 0:
        return y
    if x.numel() == 0:
        # every output reduces an empty set: the identity (all: True, any: False)
        return y.fill_(is_all)
    # 0/1 flags accumulate in int32 (also the split workspace and the intermediate of reduced dims that
    # are apart), stored once into the bool/uint8 result
    reduce_into(x, sorted(rset), y, OP_ALL if is_all else OP_ANY, torch.int32, 1.0)
    return y


def _aten_dtype_name(dt):
    return {torch.float32: "Float", torch.float64: "Double", torch.float16: "Half", torch.bfloat16: "BFloat16",
            torch.int64: "Long", torch.int32: "Int", torch.int16: "Short", torch.int8: "Char"}.get(dt, str(dt))


@register("all.default", "all.all_out", category="reduction", dtypes=DTYPES)
def all_(self, *, out=None):
    """True iff every element is nonzero (NaN counts as nonzero); bool (uint8 for uint8 input)."""
    return _logical(self, None, False, True, out, "all")


@register("all.dim", "all.out", category="reduction", dtypes=DTYPES)
def all_dim(self, dim, keepdim=False, *, out=None):
    """all over one dim."""
    return _logical(self, [dim], keepdim, True, out, "all")


@register("all.dims", "all.dims_out", category="reduction", dtypes=DTYPES)
def all_dims(self, dim=None, keepdim=False, *, out=None):
    """all over a list of dims (None: every dim; []: none, an elementwise x != 0)."""
    return _logical(self, None if dim is None else list(dim), keepdim, True, out, "all")


@register("any.default", "any.all_out", category="reduction", dtypes=DTYPES)
def any_(self, *, out=None):
    """True iff some element is nonzero (NaN counts as nonzero); bool (uint8 for uint8 input)."""
    return _logical(self, None, False, False, out, "any")


@register("any.dim", "any.out", category="reduction", dtypes=DTYPES)
def any_dim(self, dim, keepdim=False, *, out=None):
    """any over one dim."""
    return _logical(self, [dim], keepdim, False, out, "any")


@register("any.dims", "any.dims_out", category="reduction", dtypes=DTYPES)
def any_dims(self, dim=None, keepdim=False, *, out=None):
    """any over a list of dims (None: every dim; []: none, an elementwise x != 0)."""
    return _logical(self, None if dim is None else list(dim), keepdim, False, out, "any")


@register("_is_all_true", category="reduction", dtypes=(torch.bool,))
def is_all_true(self):
    """all() of a bool tensor as a 0-dim bool tensor (what torch._assert_async-style checks call)."""
    if self.dtype != torch.bool:
        raise Unsupported("not a bool tensor (ATen asserts)")
    return _logical(self, None, False, True, None, "all")


@register("_is_any_true", category="reduction", dtypes=(torch.bool,))
def is_any_true(self):
    """any() of a bool tensor as a 0-dim bool tensor."""
    if self.dtype != torch.bool:
        raise Unsupported("not a bool tensor (ATen asserts)")
    return _logical(self, None, False, False, None, "any")
