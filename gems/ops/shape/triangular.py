"""tril / triu (functional, out=, in-place): keep one triangle of the last two dims, zero the rest.

    Y[b, i, j] = X[b, i, j]   where j - i <= diagonal (tril) or j - i >= diagonal (triu)
    Y[b, i, j] = 0            elsewhere

A [..., M, N] tensor is a matrix of rows R = B * M (the batch dims merged into one stride, which is
what every view the models pass allows; other inputs are made contiguous first) by N columns, cut
into [BLOCK_R, BLOCK_N] tiles. The input is read through its strides only inside the triangle, the
output (contiguous, like ATen's) written once. In place, only the zeros are written. The models' call
is SDPA's math path building its causal mask, `ones(L, S, dtype=bool).tril()`, once per layer.

The diagonal is clamped to [-M, N] on the host (beyond that the answer no longer changes), so a huge
diagonal never reaches the kernel as a 64-bit number.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ...codegen.layout import collapse, needs_int64
from ...registry import ALL, Unsupported, register
from ...runtime import backend, kernel
from ...runtime.utils import cdiv, next_pow2, prepare_out
from ..memory import has_internal_overlap, overlaps


@kernel
@triton.jit
def tri_kernel(X, Y, R, M, N, k, sXb, sXm, sXn, sYb, sYm, sYn, LOWER: tl.constexpr, INPLACE: tl.constexpr,
               BIG: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """Y[b, i, j] = X[b, i, j] if (j - i <= k if LOWER else j - i >= k) else 0, with row r = b * M + i;
    INPLACE (Y is X): only the zeros are stored."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    j = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if BIG:
        r = r.to(tl.int64)
        j = j.to(tl.int64)
    b = r // M
    i = r - b * M
    d = j[None, :] - i[:, None]
    if LOWER:
        keep = d <= k
    else:
        keep = d >= k
    inside = (r < R)[:, None] & (j < N)[None, :]
    y_offs = (b * sYb + i * sYm)[:, None] + j[None, :] * sYn
    if INPLACE:
        tl.store(Y + y_offs, tl.zeros([BLOCK_R, BLOCK_N], Y.dtype.element_ty), mask=inside & ~keep)
    else:
        # masked lanes read nothing: a tile wholly outside the triangle only writes zeros
        x = tl.load(X + (b * sXb + i * sXm)[:, None] + j[None, :] * sXn, mask=inside & keep, other=0)
        tl.store(Y + y_offs, x.to(Y.dtype.element_ty), mask=inside)


# tile: elements per program; max_n: widest tile. The interpreter's are small so the tests' small
# shapes still cross tiles in both directions.
_CONFIGS = {"cuda": dict(tile=4096, max_n=1024), "interpreter": dict(tile=256, max_n=32)}


def _batch_stride(t):
    """The one stride of t's batch dims merged, or None when they do not merge."""
    sizes, sts = collapse(tuple(t.shape[:-2]), [tuple(t.stride()[:-2])], list(range(t.dim() - 2)))
    return sts[0][0] if len(sizes) == 1 else None


def _same_view(a, b) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


def _tri(self, diagonal, lower, out=None, inplace=False):
    name = "tril" if lower else "triu"
    if self.dim() < 2:
        raise RuntimeError(f"{name}: input tensor must have at least 2 dimensions")
    M, N = self.shape[-2], self.shape[-1]
    k = max(-M, min(int(diagonal), N))
    if inplace:
        y = self
        if has_internal_overlap(self):
            raise Unsupported("self has overlapping elements (expanded)")
    else:
        if out is not None and overlaps(out, self):
            if not _same_view(out, self):
                raise Unsupported("out partially overlaps self")
            inplace = True   # tril(x, out=x) is tril_(x)
        y = prepare_out(out, self.shape, self.dtype, self.device)
    if y.numel() == 0:
        return y
    x = self
    sxb = _batch_stride(x)
    if sxb is None:
        if inplace:
            raise Unsupported("self's batch dims do not merge into one stride")
        x = x.contiguous()
        sxb = _batch_stride(x)
    syb = sxb if inplace else M * N
    R = self.numel() // N
    cfg = _CONFIGS[backend().name]
    bn = min(next_pow2(N), cfg["max_n"])
    br = min(next_pow2(R), max(1, cfg["tile"] // bn))
    big = needs_int64(y.numel(), br * bn, [(x.shape, x.stride()), (y.shape, y.stride())])
    nw = max(1, min(8, br * bn // 512))
    tri_kernel[(cdiv(R, br), cdiv(N, bn))](
        x, y, R, M, N, k, sxb, x.stride(-2), x.stride(-1), syb, y.stride(-2), y.stride(-1),
        lower, inplace, big, br, bn, num_warps=nw)
    return y


@register("tril", "tril.out", category="copy", dtypes=ALL)
def tril(self, diagonal=0, *, out=None):
    """The lower triangle (j - i <= diagonal) of the last two dims, zeros above."""
    return _tri(self, diagonal, True, out)


@register("tril_", category="copy", dtypes=ALL)
def tril_(self, diagonal=0):
    """In place: zero the elements above the diagonal."""
    return _tri(self, diagonal, True, inplace=True)


@register("triu", "triu.out", category="copy", dtypes=ALL)
def triu(self, diagonal=0, *, out=None):
    """The upper triangle (j - i >= diagonal) of the last two dims, zeros below."""
    return _tri(self, diagonal, False, out)


@register("triu_", category="copy", dtypes=ALL)
def triu_(self, diagonal=0):
    """In place: zero the elements below the diagonal."""
    return _tri(self, diagonal, False, inplace=True)
