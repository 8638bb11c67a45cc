"""all / any over any list of dims, and _is_all_true / _is_any_true: logical reductions of x != 0.

    all(x, dims)[k] = AND_{r} (x[k, r] != 0),   any(x, dims)[k] = OR_{r} (x[k, r] != 0)

for every input dtype but float64 (NaN != 0 counts as true, -0.0 as false; bool is read as is). The result is
bool (uint8 for a uint8 input, ATen's legacy rule; an out= may be bool or uint8). An empty reduction
gives all = True, any = False.

The input is read through its strides exactly as sum/mean read it (reduction.py's planning: kept
dims merge into M and K, reduced dims into R; X[m * sM + r * sR + k * sK]), by two kernels: reduced
axis innermost (K == 1) or a kept axis innermost (coalesced over K). When the grid is too small to
fill the GPU (a full reduction), R is split: each program writes its chunk's 0/1 flag into a uint8
workspace [SPLIT, M*K], which the same kernels reduce in a second launch (an AND of ANDs, an OR of
ORs). Layouts the planner cannot read in one pass are made contiguous; reduced dims that are still
apart are reduced one run at a time through a uint8 intermediate. No atomics: deterministic.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..registry import FLOATS, INTS, Unsupported, register
from ..runtime import kernel
from ..runtime.utils import cdiv, empty, next_pow2, prepare_out, wrap_dims
from .reduction import _cfg, _plan, _runs, _target_programs

# float64 inputs go to ATen (counted): the project serves no float64 compute op, which gems-coverage
# parity relies on to refuse a float64 run (it would compare ATen with itself)
DTYPES = FLOATS + INTS + (torch.bool,)
_INT64_FROM = 2 ** 31 - 1


@kernel
@triton.jit
def logical_inner(X, Y, M, R, sM, sR, r_per_split,
                  ALL: tl.constexpr, BIG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr):
    """Y[split * M + m] = AND (ALL) / OR over r in the split's range of (X[m * sM + r * sR] != 0)."""
    split = tl.program_id(1)
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rr = tl.arange(0, BLOCK_R)[None, :]
    mmask = (m < M)[:, None]
    if BIG:
        base = m.to(tl.int64)[:, None] * sM
    else:
        base = m[:, None] * sM
    r0 = split * r_per_split
    r_end = tl.minimum(R, r0 + r_per_split)
    found = tl.zeros([BLOCK_M, BLOCK_R], tl.int32)
    for start in range(r0, r_end, BLOCK_R):
        r = start + rr
        mask = mmask & (r < R)     # tiles never cross into the next split (r_per_split % BLOCK_R == 0)
        if BIG:
            offs = base + r.to(tl.int64) * sR
        else:
            offs = base + r * sR
        nz = tl.load(X + offs, mask=mask, other=0) != 0
        if ALL:
            found |= (mask & ~nz).to(tl.int32)     # a zero: AND is false
        else:
            found |= (mask & nz).to(tl.int32)      # a nonzero: OR is true
    f = tl.max(found, 1)
    if ALL:
        res = f == 0
    else:
        res = f != 0
    tl.store(Y + split * M + m, res.to(Y.dtype.element_ty), mask=m < M)


@kernel
@triton.jit
def logical_outer(X, Y, M, R, K, sM, sR, sK, r_per_split,
                  ALL: tl.constexpr, BIG: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Y[(split * M + m) * K + k] = AND (ALL) / OR over r in the split's range of (X[m*sM + r*sR + k*sK] != 0)."""
    nkb = tl.cdiv(K, BLOCK_K)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    m = pid // nkb
    k = (pid % nkb) * BLOCK_K + tl.arange(0, BLOCK_K)
    kmask = (k < K)[None, :]
    rr = tl.arange(0, BLOCK_R)[:, None]
    if BIG:
        base = m.to(tl.int64) * sM + k.to(tl.int64)[None, :] * sK
    else:
        base = m * sM + k[None, :] * sK
    r0 = split * r_per_split
    r_end = tl.minimum(R, r0 + r_per_split)
    found = tl.zeros([BLOCK_R, BLOCK_K], tl.int32)
    for start in range(r0, r_end, BLOCK_R):
        r = start + rr
        mask = kmask & (r < R)
        if BIG:
            offs = base + r.to(tl.int64) * sR
        else:
            offs = base + r * sR
        nz = tl.load(X + offs, mask=mask, other=0) != 0
        if ALL:
            found |= (mask & ~nz).to(tl.int32)
        else:
            found |= (mask & nz).to(tl.int32)
    f = tl.max(found, 0)
    if ALL:
        res = f == 0
    else:
        res = f != 0
    if BIG:
        out = (split * M + m).to(tl.int64) * K + k
    else:
        out = (split * M + m) * K + k
    tl.store(Y + out, res.to(Y.dtype.element_ty), mask=k < K)


def _launch(x, y, plan, is_all):
    """Reduce x (read through `plan`) into the contiguous y (M*K flags), splitting R if the grid is small."""
    M, sM, R, sR, K, sK = plan
    cfg = _cfg()
    tile = cfg["tile"]
    if K == 1:
        br = min(next_pow2(R), cfg["max_r"])
        bm = min(next_pow2(M), max(tile // br, 1))
        grid0 = cdiv(M, bm)
    else:
        tile_o = cfg.get("tile_outer", tile)
        bk = min(next_pow2(K), max(cfg["max_k"], tile_o // next_pow2(R)))
        br = min(next_pow2(R), max(tile_o // bk, 1))
        grid0 = M * cdiv(K, bk)
    split, r_per = 1, R
    target = _target_programs(x.device)
    if grid0 < target and R > br * cfg["min_iters"]:
        split = min(cdiv(target, grid0), cdiv(R, br * cfg["min_iters"]), cfg["max_split"])
        if split > 1:
            r_per = cdiv(cdiv(R, split), br) * br
            split = cdiv(R, r_per)
    n = M * K
    span = 1 + (M - 1) * sM + (R - 1) * sR + (K - 1) * sK
    big = int(max(span, split * n) >= _INT64_FROM)
    dst = y if split == 1 else empty((split, n), torch.uint8, x.device)
    if K == 1:
        nw = max(1, min(8, bm * br // 512))
        logical_inner[(grid0, split)](x, dst, M, R, sM, sR, r_per, is_all, big, bm, br, num_warps=nw)
    else:
        nw = max(1, min(8, br * bk // 512))
        logical_outer[(grid0, split)](x, dst, M, R, K, sM, sR, sK, r_per, is_all, big, br, bk, num_warps=nw)
    if split > 1:
        _launch(dst, y, (1, 0, split, n, 1, 0) if n == 1 else (1, 0, split, n, n, 1), is_all)


def _reduce_into(x, dims, y, is_all):
    """Reduce x over `dims` into the contiguous y (kept dims in logical order)."""
    rset = set(dims)
    plan = _plan(x.shape, x.stride(), rset)
    if plan is None and not x.is_contiguous():
        x = x.contiguous()   # a layout the plan cannot read in one pass: one copy (no call plan)
        plan = _plan(x.shape, x.stride(), rset)
    if plan is not None:
        _launch(x, y, plan, is_all)
        return
    last = _runs(dims)[-1]
    mid = empty([1 if d in last else s for d, s in enumerate(x.shape)], torch.uint8, x.device)
    _reduce_into(x, last, mid, is_all)
    _reduce_into(mid, [d for d in dims if d not in last], y, is_all)


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
    else:
        odt = torch.uint8 if x.dtype == torch.uint8 else torch.bool
    y = prepare_out(out, shape, odt, x.device)
    n = y.numel()
    if n == 0:
        return y
    if x.numel() == 0:
        # every output reduces an empty set: the identity (all: True, any: False), R = 0
        logical_inner[(cdiv(n, 1024), 1)](x, y, n, 0, 0, 0, 0, is_all, 0, 1024, 1, num_warps=4)
        return y
    _reduce_into(x, sorted(rset), y, is_all)
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
