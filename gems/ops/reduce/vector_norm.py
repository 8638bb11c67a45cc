"""linalg_vector_norm: what torch.linalg.vector_norm, torch.norm and clip_grad_norm_ call, on the
planning and kernels of reduction.py (one pass over the input, any strides, split when the grid is
small), with the norm's op codes there:

    ord 2: sqrt(sum |x|^2)   inf: max |x|   -inf: min |x|   1: sum |x|   0: sum (x != 0)
    other p: (sum |x|^p)^(1/p)

Accumulation in fp32 (fp64 for a float64 result), the result rounded once, in the input's dtype or
`dtype=` (the input read as that dtype, as ATen's reduction iterator does). NaN propagates (inf and
-inf norms too). Norms over an empty set are 0 where the op has an identity (ord >= 0 but inf);
inf, -inf and negative orders over an empty set raise in ATen: those calls go to it.
"""
from __future__ import annotations

import math

import torch

from ...registry import FLOATS, Unsupported, register
from ...runtime.utils import promote_types, wrap_dims
from . import reduction as R


def norm_op(p: float):
    """(op code, p) for the order p (a Python number)."""
    if p == 2:
        return R.NORM_SQ + R.POST_SQRT, 1.0
    if p == math.inf:
        return R.NORM_ABSMAX, 1.0
    if p == -math.inf:
        return R.NORM_ABSMIN, 1.0
    if p == 1:
        return R.NORM_ABS, 1.0
    if p == 0:
        return R.NORM_NZ, 1.0
    return R.NORM_POW + R.POST_ROOT, float(p)


def _order(ord):
    if isinstance(ord, bool) or not isinstance(ord, (int, float)):
        raise Unsupported(f"ord {ord!r}")   # complex, or a kind ATen may reject
    p = float(ord)
    if math.isnan(p):
        raise Unsupported("ord nan")
    return p


def vector_norm(x, ord=2, dim=None, keepdim=False, *, dtype=None, out=None):
    if x.dtype not in FLOATS:
        raise Unsupported(f"input dtype {x.dtype}")   # ATen raises for integers, complex is not served
    out_dtype = x.dtype if dtype is None else dtype
    if out_dtype not in FLOATS + (torch.float64,) or not torch.can_cast(x.dtype, out_dtype) or \
            promote_types(x.dtype, out_dtype) != out_dtype:
        raise Unsupported(f"dtype {dtype}")    # ATen raises on narrowing; complex is not served
    p = _order(ord)
    op, pp = norm_op(p)
    if (p < 0 or p == math.inf) and x.numel() == 0:
        # no identity: ATen raises where a reduced set is empty (its message, its checks)
        raise Unsupported(f"{p}-norm of an empty tensor")
    if op % 16 == R.NORM_POW and out_dtype == torch.float64:
        raise Unsupported("p-norm in float64")   # the kernel's 2^(p log2 |x|) is an fp32 formula on GPUs
    nd = x.dim()
    dims = None if dim is None or len(dim) == 0 else wrap_dims(dim, nd)
    extent = math.prod(x.shape[d] for d in dims) if dims is not None and nd else x.numel()
    if extent == 1 and p != 0 and x.device.type == "cpu":
        # one element per result: ATen's CPU kernel answers |x| (the p-norm of one element) without
        # forming x^p, which overflows from 1.8e19 in fp32; the max-norm gives the same
        op, pp = norm_op(math.inf)
    return R.reduce_dims(x, dims if nd else None, keepdim, out_dtype, op, out, p=pp)


@register("linalg_vector_norm.default", "linalg_vector_norm.out", category="reduction", dtypes=FLOATS)
def linalg_vector_norm(x, ord=2, dim=None, keepdim=False, *, dtype=None, out=None):
    """Vector p-norm over a list of dims (2, inf, -inf, 1, 0, any float p): one reduction pass, fp32 accumulation."""
    return vector_norm(x, ord, dim, keepdim, dtype=dtype, out=out)
