"""argmax / argmin: the index of the largest (smallest) element over one dim, or over all elements.

    argmax(x, d)[k] = min { r : x[k, r] >= x[k, j] for every j }   (the first maximal index)

with ATen's NaN rule: a NaN is larger and smaller than anything, so the first NaN wins for argmax
and argmin alike. Comparisons are exact (fp16/bf16 read as fp32, integers as they are); -0.0 and 0.0
are equal (the first one wins).

The input is read through its strides as X[m * sM + r * sR + k * sK] (reduction.py's planning: the
reduced dim is R, the kept dims merge into M and K; a layout that does not merge is made contiguous
once). With no dim, R runs over the logical order of all elements: the input's dims must merge into
one stride group (contiguous, a step slice), or it is made contiguous. Two kernels, as for sum:
`arg_inner` (K == 1) reduces the tile's fast axis, `arg_outer` (K > 1) keeps K as the fast axis so a
reduction over a non-innermost dim reads contiguous rows.

Each lane of a tile keeps its own (value, index) pair while the loop walks R; the tile is reduced
once at the end with a combine that breaks ties by the smaller index, so the result does not depend
on the tile shape. When the grid is too small to fill the GPU (the decode step's argmax over a
[1, vocab] row) R is split: each program writes its chunk's winner (value in the input dtype, index
as int64) to a workspace [SPLIT, M*K] and `arg_inner` reduces that over SPLIT in a second launch,
reading the indices from the workspace. No atomics: deterministic.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...registry import FLOATS, INTS, Unsupported, register
from ...runtime import backend, kernel
from ...runtime.utils import cdiv, empty, next_pow2, prepare_out, wrap_dim
from .reduction import config, geometry, merge_dims, mrk_plan, target_programs_on

# float64 goes to ATen: the project serves no float64 compute op (gems-coverage parity relies on it)
DTYPES = FLOATS + INTS
_INT64_FROM = 2 ** 31 - 1
# the index of a lane that holds no element (masked): it never wins (see _better)
_NONE32 = tl.constexpr(2 ** 31 - 1)
_NONE64 = tl.constexpr(2 ** 63 - 1)


@triton.jit
def _better(v1, i1, v2, i2, NONE, MIN: tl.constexpr):
    """True where (v1, i1) beats (v2, i2): a real element beats an empty lane (index NONE); NaN beats
    numbers; otherwise the larger (MIN: smaller) value, and on a tie (or two NaNs) the smaller index."""
    n1 = v1 != v1
    n2 = v2 != v2
    if MIN:
        strict = v1 < v2
    else:
        strict = v1 > v2
    tie = (v1 == v2) | (n1 & n2)
    return (i2 == NONE) | ((i1 != NONE) & (strict | (n1 & ~n2) | (tie & (i1 < i2))))


@triton.jit
def _max32(v1, i1, v2, i2):
    w = _better(v1, i1, v2, i2, 2147483647, False)
    return tl.where(w, v1, v2), tl.where(w, i1, i2)


@triton.jit
def _min32(v1, i1, v2, i2):
    w = _better(v1, i1, v2, i2, 2147483647, True)
    return tl.where(w, v1, v2), tl.where(w, i1, i2)


@triton.jit
def _max64(v1, i1, v2, i2):
    w = _better(v1, i1, v2, i2, 9223372036854775807, False)
    return tl.where(w, v1, v2), tl.where(w, i1, i2)


@triton.jit
def _min64(v1, i1, v2, i2):
    w = _better(v1, i1, v2, i2, 9223372036854775807, True)
    return tl.where(w, v1, v2), tl.where(w, i1, i2)


@triton.jit
def _finish(v, i, AXIS: tl.constexpr, MIN: tl.constexpr, BIG: tl.constexpr):
    """The tile's winner along AXIS (ties to the smaller index, so the tile shape does not matter)."""
    if BIG:
        if MIN:
            return tl.reduce((v, i), AXIS, _min64)
        else:
            return tl.reduce((v, i), AXIS, _max64)
    else:
        if MIN:
            return tl.reduce((v, i), AXIS, _min32)
        else:
            return tl.reduce((v, i), AXIS, _max32)


@kernel
@triton.jit
def arg_inner(X, XI, Y, YV, M, R, sM, sR, r_per_split,
              MIN: tl.constexpr, HAS_IDX: tl.constexpr, PARTIAL: tl.constexpr, BIG: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr):
    """Y[split * M + m] = argmax (MIN: argmin) over r in the split's range of X[m * sM + r * sR]; the
    index is r, or XI[m * sM + r * sR] with HAS_IDX (the second stage). PARTIAL: the winner's value
    goes to YV[split * M + m] too."""
    if BIG:
        NONE = _NONE64
    else:
        NONE = _NONE32
    split = tl.program_id(1)
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rr = tl.arange(0, BLOCK_R)[None, :]
    mmask = (m < M)[:, None]
    if BIG:
        base = m.to(tl.int64)[:, None] * sM
        r0 = split.to(tl.int64) * r_per_split
    else:
        base = m[:, None] * sM
        r0 = split * r_per_split
    r_end = tl.minimum(R, r0 + r_per_split)
    acc_i = tl.full([BLOCK_M, BLOCK_R], NONE, r0.dtype)
    acc_v = tl.zeros([BLOCK_M, BLOCK_R], X.dtype.element_ty)   # any value: its index is NONE
    if X.dtype.element_ty.is_floating():
        acc_v = acc_v.to(tl.float32)
    for start in range(r0, r_end, BLOCK_R):
        r = start + rr
        mask = mmask & (r < r_end)
        offs = base + r * sR
        x = tl.load(X + offs, mask=mask, other=0)
        if X.dtype.element_ty.is_floating():
            x = x.to(tl.float32)          # exact for fp16 / bf16
        if HAS_IDX:
            idx = tl.load(XI + offs, mask=mask, other=0).to(r.dtype)
        else:
            idx = r
        idx = tl.where(mask, idx, NONE)
        w = _better(x, idx, acc_v, acc_i, NONE, MIN)
        acc_v = tl.where(w, x, acc_v)
        acc_i = tl.where(w, idx, acc_i)
    v, i = _finish(acc_v, acc_i, 1, MIN, BIG)
    tl.store(Y + split * M + m, i.to(tl.int64), mask=m < M)
    if PARTIAL:
        tl.store(YV + split * M + m, v.to(YV.dtype.element_ty), mask=m < M)


@kernel
@triton.jit
def arg_outer(X, Y, YV, M, R, K, sM, sR, sK, r_per_split,
              MIN: tl.constexpr, PARTIAL: tl.constexpr, BIG: tl.constexpr,
              BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Y[(split * M + m) * K + k] = argmax (MIN: argmin) over r in the split's range of
    X[m * sM + r * sR + k * sK]; PARTIAL: the winner's value goes to YV at the same place."""
    if BIG:
        NONE = _NONE64
    else:
        NONE = _NONE32
    nkb = tl.cdiv(K, BLOCK_K)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    m = pid // nkb
    k = (pid % nkb) * BLOCK_K + tl.arange(0, BLOCK_K)
    kmask = (k < K)[None, :]
    rr = tl.arange(0, BLOCK_R)[:, None]
    if BIG:
        base = m.to(tl.int64) * sM + k.to(tl.int64)[None, :] * sK
        r0 = split.to(tl.int64) * r_per_split
    else:
        base = m * sM + k[None, :] * sK
        r0 = split * r_per_split
    r_end = tl.minimum(R, r0 + r_per_split)
    acc_i = tl.full([BLOCK_R, BLOCK_K], NONE, r0.dtype)
    acc_v = tl.zeros([BLOCK_R, BLOCK_K], X.dtype.element_ty)
    if X.dtype.element_ty.is_floating():
        acc_v = acc_v.to(tl.float32)
    for start in range(r0, r_end, BLOCK_R):
        r = start + rr
        mask = kmask & (r < r_end)
        x = tl.load(X + base + r * sR, mask=mask, other=0)
        if X.dtype.element_ty.is_floating():
            x = x.to(tl.float32)
        idx = tl.where(mask, r, NONE)
        w = _better(x, idx, acc_v, acc_i, NONE, MIN)
        acc_v = tl.where(w, x, acc_v)
        acc_i = tl.where(w, idx, acc_i)
    v, i = _finish(acc_v, acc_i, 0, MIN, BIG)
    if BIG:
        out = (split * M + m).to(tl.int64) * K + k
    else:
        out = (split * M + m) * K + k
    tl.store(Y + out, i.to(tl.int64), mask=k < K)
    if PARTIAL:
        tl.store(YV + out, v.to(YV.dtype.element_ty), mask=k < K)


# few rows of a long last dim (a decode step's argmax over [1, 32000] logits): one program per row and no
# second stage: (at most rows, at most R, tile width, warps), or None for reduction.geometry's split.
# [1, 32000] fp32 on an H200 (out-of-tree sweep of profiler sums): 5.8 us of device time
# with 4096-wide tiles at 8 warps, ATen 8.5, the split path 4.6 but two launches and two workspaces
# (host loop: 11.4 us per call against ATen's 9.4). The interpreter takes it too, so CPU CI runs it.
_ROWS = {"cuda": (16, 65536, 4096, 8), "interpreter": (16, 65536, 64, 4)}


def _launch(x, y, plan, is_min):
    """Write the arg-reduction of x (read through `plan`) into the contiguous int64 y (M*K)."""
    M, sM, R, sR, K, sK = plan
    rows = _ROWS[backend().name]
    if K == 1 and rows is not None and M <= rows[0] and R <= rows[1]:
        # one launch and no workspace: the host cost of a second stage outweighs its device time here
        big = int(1 + (M - 1) * sM + (R - 1) * sR >= _INT64_FROM)
        arg_inner[(M, 1)](x, None, y, None, M, R, sM, sR, R, is_min, False, False, big, 1,
                          min(next_pow2(R), rows[2]), num_warps=rows[3])
        return
    # the same tiles and R split as sum/amax (reduction.geometry)
    block_a, block_b, grid0, split, r_per = geometry(M, R, K, target_programs_on(x.device))
    if K == 1:
        bm, br = block_a, block_b
    else:
        br, bk = block_a, block_b
    n = M * K
    span = 1 + (M - 1) * sM + (R - 1) * sR + (K - 1) * sK
    big = int(max(span, split * n, R) >= _INT64_FROM)
    partial = split > 1
    if partial:
        wi = empty((split, n), torch.int64, x.device)
        wv = empty((split, n), x.dtype, x.device)
    else:
        wi, wv = y, None
    if K == 1:
        nw = max(1, min(8, bm * br // 512))
        arg_inner[(grid0, split)](x, None, wi, wv, M, R, sM, sR, r_per, is_min, False, partial, big, bm, br,
                                  num_warps=nw)
    else:
        nw = max(1, min(8, br * bk // 512))
        arg_outer[(grid0, split)](x, wi, wv, M, R, K, sM, sR, sK, r_per, is_min, partial, big, br, bk,
                                  num_warps=nw)
    if partial:
        # second stage: the [split, n] winners reduced over split, indices read from the workspace
        br2 = next_pow2(split)
        bm2 = min(next_pow2(n), max(config()["tile"] // br2, 1))
        arg_inner[(cdiv(n, bm2), 1)](wv, wi, y, None, n, split, 1, n, split, is_min, True, False, big, bm2, br2,
                                     num_warps=max(1, min(8, bm2 * br2 // 512)))


def _argreduce(x, dim, keepdim, is_min, out, name):
    nd = x.dim()
    if dim is None:
        if x.numel() == 0:
            raise IndexError(f"{name}(): Expected reduction dim to be specified for input.numel() == 0.")
        shape = [1] * nd if keepdim else []
        groups = merge_dims([(n, s) for n, s in zip(x.shape, x.stride()) if n != 1])
        if len(groups) > 1:
            x = x.contiguous()   # the flat index follows the logical order: one copy (no call plan)
            groups = [(x.numel(), 1)]
        R, sR = groups[0] if groups else (1, 0)
        plan = (1, 0, R, sR, 1, 0)
    else:
        d = wrap_dim(dim, nd)
        if nd and x.shape[d] == 0:
            raise IndexError(f"{name}(): Expected reduction dim {d} to have non-zero size.")
        if nd:
            shape = [1 if i == d else n for i, n in enumerate(x.shape)] if keepdim else \
                [n for i, n in enumerate(x.shape) if i != d]
        else:
            shape = []
        plan = mrk_plan(x.shape, x.stride(), {d}) if nd else (1, 0, 1, 0, 1, 0)
        if plan is None:
            x = x.contiguous()   # kept dims that do not merge into two groups: one copy (no call plan)
            plan = mrk_plan(x.shape, x.stride(), {d})
    y = prepare_out(out, shape, torch.int64, x.device)
    if y.numel():
        _launch(x, y, plan, is_min)
    return y


@register("argmax.default", "argmax.out", category="reduction", dtypes=DTYPES)
def argmax(self, dim=None, keepdim=False, *, out=None):
    """Index of the largest element over a dim or all elements (first one on ties, NaN counts as largest)."""
    return _argreduce(self, dim, keepdim, False, out, "argmax")


@register("argmin.default", "argmin.out", category="reduction", dtypes=DTYPES)
def argmin(self, dim=None, keepdim=False, *, out=None):
    """Index of the smallest element over a dim or all elements (first one on ties, NaN counts as smallest)."""
    return _argreduce(self, dim, keepdim, True, out, "argmin")
