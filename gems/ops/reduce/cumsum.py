"""cumsum: inclusive prefix sums along one dim.

    y[m, r, k] = sum_{j <= r} cast(x[m, j, k])      cast: to the result dtype, as ATen converts first

Result dtype (ATen's rule): `dtype=` if given, else that of `out=`, else int64 for integer and bool
inputs and the input's dtype for floating ones. Accumulation is fp32 for fp16/bf16/fp32 results (each
output rounded once) and int64 for integer results (narrower integer results wrap, like ATen's).

Layout: the input and the output are read and written through their strides as
X[m * sXm + r * sXr + k * sXk], with M the dims before the scanned one and K those after it, each
merged into one stride group (a layout that does not merge is made contiguous once; an out= that does
not merge goes to ATen). The output is contiguous unless out= (or the in-place self) says otherwise.

Two kernels, as for the reductions: `cumsum_inner` (K == 1) scans the tile's fast axis, coalesced for
the last dim of a row-major tensor; `cumsum_outer` (K > 1) keeps K as the fast axis and scans down
the rows. A row longer than one block is scanned block by block with a running carry: each block is
scanned in registers (`tl.cumsum`), the carry added, and the block's last prefix becomes the next
carry. One program owns a run of rows from start to end, so no second pass and no atomics; a very
long single row is a serial loop over its blocks (top-p's cumsum over a [batch, vocab] row of
sorted probabilities is 32 to 256 blocks).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...registry import FLOATS, INTS, Unsupported, register
from ...runtime import backend, kernel
from ...runtime.utils import cdiv, empty, next_pow2, resize_like_aten, wrap_dim
from ..memory import has_internal_overlap, overlaps
from .reduction import merge_dims

# float64 goes to ATen (the project serves no float64 compute op); bool inputs sum as int64
DTYPES = FLOATS + INTS + (torch.bool,)
_INT_RESULTS = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
_INT64_FROM = 2 ** 31 - 1

# tile: elements per program; max_r / max_k: widest scanned / kept extent of a tile. The interpreter's
# are small so that test shapes run the carry loop and several programs.
# long: (rows, max_r, warps) for at most `rows` rows along the last dim, one program per row with a wider
# tile (fewer dependent carry steps: a decode-time cumsum of one [1, 32000] row of probabilities is one
# program), or None
# [1, 32000] fp32 on an H200 (out-of-tree sweep of profiler sums): 6.4 us of device time with
# 8192-wide tiles at 8 warps, 19.9 us with the default 1024 (ATen's multi-block scan: 3.0 us); [16, 32000]:
# 6.8 us (ATen 41.8).
_CONFIGS = {"cuda": dict(tile=4096, max_r=1024, max_k=256, long=(16, 8192, 8)),
            "interpreter": dict(tile=512, max_r=64, max_k=16, long=None)}


@triton.jit
def _load_cast(X, offs, mask, OUT, ACC):
    """x converted to the result dtype OUT first (ATen's self.to(result dtype)), then to ACC; integer
    inputs reach floating results through fp32, as c10's conversions do."""
    x = tl.load(X + offs, mask=mask, other=0)
    if OUT.is_floating():
        x = x.to(tl.float32).to(OUT)
    else:
        x = x.to(OUT)
    return x.to(ACC)


@kernel
@triton.jit
def cumsum_inner(X, Y, M, R, sXm, sXr, sYm, sYr,
                 ACC: tl.constexpr, BIG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr):
    """Y[m * sYm + r * sYr] = sum_{j <= r} X[m * sXm + j * sXr]   (rows m of a [BLOCK_M, BLOCK_R] tile)."""
    OUT = Y.dtype.element_ty
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rr = tl.arange(0, BLOCK_R)[None, :]
    mmask = (m < M)[:, None]
    if BIG:
        m = m.to(tl.int64)
    xb = m[:, None] * sXm
    yb = m[:, None] * sYm
    carry = tl.zeros([BLOCK_M], ACC)
    for start in range(0, R, BLOCK_R):
        if BIG:
            r = start.to(tl.int64) + rr
        else:
            r = start + rr
        mask = mmask & (r < R)
        x = _load_cast(X, xb + r * sXr, mask, OUT, ACC)
        s = tl.cumsum(x, axis=1) + carry[:, None]
        tl.store(Y + yb + r * sYr, s.to(OUT), mask=mask)
        # masked lanes added 0: the block's last column is the running total
        carry = tl.sum(tl.where(rr == BLOCK_R - 1, s, 0), axis=1)


@kernel
@triton.jit
def cumsum_outer(X, Y, M, R, K, sXm, sXr, sXk, sYm, sYr, sYk,
                 ACC: tl.constexpr, BIG: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Y[m * sYm + r * sYr + k * sYk] = sum_{j <= r} X[m * sXm + j * sXr + k * sXk]   (K the fast axis)."""
    OUT = Y.dtype.element_ty
    nkb = tl.cdiv(K, BLOCK_K)
    pid = tl.program_id(0)
    m = pid // nkb
    k = (pid % nkb) * BLOCK_K + tl.arange(0, BLOCK_K)
    kmask = (k < K)[None, :]
    rr = tl.arange(0, BLOCK_R)[:, None]
    if BIG:
        m = m.to(tl.int64)
        k = k.to(tl.int64)
    xb = m * sXm + k[None, :] * sXk
    yb = m * sYm + k[None, :] * sYk
    carry = tl.zeros([BLOCK_K], ACC)
    for start in range(0, R, BLOCK_R):
        if BIG:
            r = start.to(tl.int64) + rr
        else:
            r = start + rr
        mask = kmask & (r < R)
        x = _load_cast(X, xb + r * sXr, mask, OUT, ACC)
        s = tl.cumsum(x, axis=0) + carry[None, :]
        tl.store(Y + yb + r * sYr, s.to(OUT), mask=mask)
        carry = tl.sum(tl.where(rr == BLOCK_R - 1, s, 0), axis=0)


def _group(dims):
    """(size, stride) of the merged dims, or None if they do not merge into one group."""
    g = merge_dims([(n, s) for n, s in dims if n != 1])
    if len(g) > 1:
        return None
    return g[0] if g else (1, 0)


def _layout(t, d):
    """(M, sM, R, sR, K, sK) reading t as T[m * sM + r * sR + k * sK] around dim d, or None."""
    if t.dim() == 0:
        return 1, 0, 1, 0, 1, 0
    dims = list(zip(t.shape, t.stride()))
    outer, inner = _group(dims[:d]), _group(dims[d + 1:])
    if outer is None or inner is None:
        return None
    return outer[0], outer[1], t.shape[d], t.stride(d), inner[0], inner[1]


def _result_dtype(x, dtype, out):
    if dtype is not None:
        od = dtype
    elif out is not None:
        od = out.dtype
    else:
        od = torch.int64 if (x.dtype == torch.bool or not x.dtype.is_floating_point) else x.dtype
    if od not in FLOATS and od not in _INT_RESULTS:
        raise Unsupported(f"result dtype {od}")
    if x.dtype.is_floating_point and not od.is_floating_point:
        raise Unsupported("floating input summed as integers (ATen's conversion)")
    return od


def _cumsum(x, dim, dtype, out, inplace=False):
    d = wrap_dim(dim, x.dim())
    od = _result_dtype(x, dtype, out)
    if out is not None:
        if dtype is not None and out.dtype != dtype:
            if inplace:
                raise RuntimeError(f"Bad in-place call: input tensor dtype {x.dtype} and output tensor dtype "
                                   f"{dtype} should match")
            raise RuntimeError(f"Expected out tensor to have dtype {dtype}, but got {out.dtype} instead")
        if out.device != x.device:
            raise Unsupported("out on another device")
        if not inplace:
            if overlaps(out, x):
                raise Unsupported("out overlaps the input")
            if tuple(out.shape) != tuple(x.shape):
                resize_like_aten(out, x.shape)
        y = out
    else:
        y = empty(x.shape, od, x.device)
    if y.numel() == 0:
        return y
    ylay = _layout(y, d)
    if ylay is None:
        raise Unsupported("out's dims do not merge around the scanned dim")
    xlay = _layout(x, d)
    if xlay is None:
        if inplace:
            raise Unsupported("self's dims do not merge around the scanned dim")
        x = x.contiguous()   # one copy (no call plan for this signature)
        xlay = _layout(x, d)
    M, sXm, R, sXr, K, sXk = xlay
    _, sYm, _, sYr, _, sYk = ylay
    acc = tl.float32 if od.is_floating_point else tl.int64
    spans = [1 + (M - 1) * abs(a) + (R - 1) * abs(b) + (K - 1) * abs(c) for a, b, c in
             ((sXm, sXr, sXk), (sYm, sYr, sYk))]
    big = int(max(spans + [M * R * K]) >= _INT64_FROM)
    cfg = _CONFIGS[backend().name]
    if K == 1:
        long = cfg["long"]
        if long is not None and M <= long[0] and R > cfg["max_r"]:
            bm, br, warps = 1, min(next_pow2(R), long[1]), long[2]
        else:
            br = min(next_pow2(R), cfg["max_r"])
            bm = min(next_pow2(M), max(cfg["tile"] // br, 1))
            warps = max(1, min(8, bm * br // 512))
        cumsum_inner[(cdiv(M, bm),)](x, y, M, R, sXm, sXr, sYm, sYr, acc, big, bm, br, num_warps=warps)
    else:
        bk = min(next_pow2(K), cfg["max_k"])
        br = min(next_pow2(R), max(cfg["tile"] // bk, 1))
        cumsum_outer[(M * cdiv(K, bk),)](x, y, M, R, K, sXm, sXr, sXk, sYm, sYr, sYk, acc, big, br, bk,
                                         num_warps=max(1, min(8, br * bk // 512)))
    return y


@register("cumsum", "cumsum.out", category="reduction", dtypes=DTYPES)
def cumsum(self, dim, *, dtype=None, out=None):
    """Inclusive prefix sum along a dim (fp32 / int64 accumulation; integer inputs give int64)."""
    return _cumsum(self, dim, dtype, out)


@register("cumsum_", category="reduction", dtypes=DTYPES)
def cumsum_(self, dim, *, dtype=None):
    """In-place prefix sum (the result keeps self's dtype; dtype= must equal it)."""
    if self.dtype == torch.bool:
        raise Unsupported("bool self (ATen's in-place rule)")
    if has_internal_overlap(self):
        raise Unsupported("self has overlapping elements (ATen raises)")
    if dtype is not None and dtype != self.dtype:
        raise RuntimeError(f"Bad in-place call: input tensor dtype {self.dtype} and output tensor dtype {dtype} "
                           f"should match")
    _cumsum(self, dim, dtype, self, inplace=True)
    return self
