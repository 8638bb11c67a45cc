"""logsumexp over one dim or a run of adjacent dims: one launch.

ATen's CUDA logsumexp is a composite of nine ops (amax, abs, eq, masked_fill_, sub, exp_, sum, log_,
add_): nine launches and, for 16-bit inputs, a rounding to the input dtype after each. Here a tensor
is viewed as (M, N, K) with N the reduced elements (softmax's geometry); one program owns one m and a
block of k, and walks N once with an online maximum:

    m' = max(m, max(x_blk)),  c = (|m'| = inf ? 0 : m'),  s = s * exp(c_old - c) + sum(exp(x_blk - c))
    y  = log(s) + c

in fp32, rounded once to the input's dtype. The shift c is ATen's rule (an infinite maximum shifts by
0), so the special values match it: a row of -inf gives -inf, a +inf gives +inf, a NaN gives NaN.
Bytes: N x M x K elements read once, M x K written (the composite reads the input twice and
writes/reads three temporaries of its size).

Served: float inputs, one dim or adjacent dims (after wrapping; any order), 0-dim inputs. Integer
inputs (ATen converts them to the default float dtype), non-adjacent dims, dim=[] on a tensor with
dims (ATen raises there) and N x K >= 2**31 (32-bit offsets within a row block, softmax's geometry
check) run ATen's composite, counted. Backward is autograd's formula
(grad * exp(x - y)) over Gems' pointwise ops.
"""
from __future__ import annotations

import functools
import math

import triton
import triton.language as tl

from ...registry import FLOATS, Unsupported, register
from ...runtime import kernel
from ...runtime.utils import cdiv, num_warps_for, prepare_out, wrap_dims
from ..norm.softmax import geometry as softmax_geometry


@kernel
@triton.jit
def logsumexp_kernel(X, Y, N, K, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Y[m, k] = log(sum_n exp(X[m, n, k] - c)) + c, c the row maximum (0 when it is infinite)."""
    m = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)[:, None]
    n = tl.arange(0, BLOCK_N)[None, :]
    base = m * N * K + k
    kmask = k < K
    mx = tl.full([BLOCK_K, 1], -float("inf"), tl.float32)
    c = tl.zeros([BLOCK_K, 1], tl.float32)
    s = tl.zeros([BLOCK_K, 1], tl.float32)
    for start in range(0, N, BLOCK_N):
        mask = kmask & (n + start < N)
        x = tl.load(X + base + (n + start) * K, mask=mask, other=-float("inf")).to(tl.float32)
        mx = tl.maximum(mx, tl.max(x, 1)[:, None])
        c_new = tl.where(tl.abs(mx) == float("inf"), 0.0, mx)
        # exp(c - c_new) rescales the sum so far; with s = 0 (nothing yet, or all -inf) it stays 0, and is
        # not computed: c starts at 0, so a first maximum below -88 would make it 0 * inf = NaN
        scale = tl.where(s > 0, tl.exp(c - c_new), 0.0)
        s = s * scale + tl.sum(tl.exp(x - c_new), 1)[:, None]
        c = c_new
    y = tl.log(s) + c
    tl.store(Y + m * K + k, y.to(Y.dtype.element_ty), mask=kmask)


@functools.lru_cache(maxsize=4096)
def _geometry(shape, dims):
    """(M, N, K, BLOCK_K, BLOCK_N, num_warps) for reducing the adjacent `dims` of a contiguous
    tensor of `shape` (memoized per signature): softmax's tiles for the merged (M, N, K) view, or None
    when the dims are not adjacent."""
    lo, hi = min(dims, default=0), max(dims, default=-1)
    if hi - lo + 1 != len(dims):
        return None
    M, N, K = (math.prod(shape[:lo]), math.prod(shape[lo:hi + 1]), math.prod(shape[hi + 1:]))
    _, _, _, bk, bn = softmax_geometry((M, N, K), 1)
    return M, N, K, bk, bn, num_warps_for(bk * bn)


def _served(x, dim, keepdim=False, **_):
    if x.dim() and len(dim) == 0:
        return "dim=[] on a tensor with dims (ATen raises)"
    return None


@register("logsumexp.default", "logsumexp.out", category="reduction", dtypes=FLOATS, check=_served)
def logsumexp(x, dim, keepdim=False, *, out=None):
    """log(sum(exp(x))) over `dim` in one pass (see the module docstring)."""
    dims = tuple(sorted(wrap_dims(dim, x.dim())))   # IndexError / RuntimeError as ATen's
    if x.dim() == 0:
        dims = ()
    shape = [1 if i in dims else s for i, s in enumerate(x.shape)] if keepdim else \
        [s for i, s in enumerate(x.shape) if i not in dims]
    g = _geometry(tuple(x.shape), dims)
    if g is None:
        raise Unsupported("dims not adjacent")
    y = prepare_out(out, shape, x.dtype, x.device)
    M, N, K, bk, bn, nw = g
    if y.numel() == 0:
        return y
    # N = 0 (an empty reduced dim) launches too: the kernel writes log(0) = -inf, as ATen does
    logsumexp_kernel[(M, cdiv(K, bk))](x.contiguous(), y, N, K, bk, bn, num_warps=nw)
    return y
