"""sum / mean / amax over any list of dims, for any strides, without permuting or copying (the same
planning and kernels serve all / any in logical.py).

A reduction is planned on the input's *strides*: size-1 dims are dropped, the kept dims are merged
(in logical order, where strides allow) into at most two groups M (outer) and K (inner), and the
reduced dims (in any order: a reduction does not care) into one group R. The input is then read as
X[m * sM + r * sR + k * sK] and the output, contiguous, as Y[m * K + k]. Two kernels cover that:

* `reduce_inner` (K == 1): tiles [BLOCK_M, BLOCK_R], reduced along the tile's fast axis. Reducing
  the last dim of a row-major tensor (sR == 1) reads whole rows, coalesced.
* `reduce_outer` (K > 1): tiles [BLOCK_R, BLOCK_K] with K, the kept inner dim, as the fast axis, so a
  reduction over a non-innermost dim (mean over dim 0 of a matrix) still reads contiguous rows; no
  transpose, no copy.

When the grid would be too small to fill the GPU (few outputs, long R: a full reduction, mean over
dim 0 of a tall matrix) R is split across programs: each writes a partial result to an fp32 (or
int64) workspace [SPLIT, M*K] and the same kernels reduce that over SPLIT in a second, small launch.
Fixed splits and no atomics keep the result deterministic.

Inputs whose dims do not fit that plan (reduced dims that cannot merge in a strided input, more than
two kept groups) are made contiguous once; reduced dims that are still apart (sum over dims 0 and 2
of a 3-d tensor) are reduced one run at a time through an fp32 intermediate.

Accumulation is fp32 for fp16/bf16/fp32 (fp64 when the output is fp64, int64 for integer sums), and
the result is cast once at the end, as ATen does. amax propagates NaN.
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from ...registry import FLOATS, INTS, Unsupported, register
from ...runtime import backend, kernel
from ...runtime.utils import cdiv, empty, next_pow2, prepare_out, target_programs, wrap_dims

# op codes: ANY / ALL reduce (x != 0) as 0/1 flags with max / min (reduce/logical.py); the
# flags a split writes to its workspace read back unchanged (flag != 0 is the flag), so the second
# stage is the same op
OP_SUM, OP_MAX, OP_ANY, OP_ALL = 0, 1, 2, 3
# vector norms (linalg_vector_norm, _foreach_norm): the op transforms each element on load (|x|^2,
# |x|, x != 0, |x|^p) and reduces with sum, max or min (NaN propagates); `POST_*` (added as
# 16 * post) finishes the last stage: sqrt, or the 1/p-th power. A split's first stage writes the
# transformed partials without the finish; the second reads them as they are (`_split_ops`). For
# NORM_POW and POST_ROOT the `scale` argument carries p (no mean scaling there).
NORM_SQ, NORM_ABSMAX, NORM_ABSMIN, NORM_ABS, NORM_NZ, NORM_POW, OP_MIN = 4, 5, 6, 7, 8, 9, 10
POST_SQRT, POST_ROOT = 16, 32

# Launch parameters per backend. tile: elements per program and loop step; max_r / max_k: widest
# reduced (inner kernel) / kept (outer kernel) extent of a tile; programs_per_sm: grid size below
# which R is split; min_iters: loop steps each split program gets at least; min_split_elems: inputs
# smaller than this are never split (the second launch costs more host time than the parallelism
# saves: sum over [1, 32000] fp32 went from two launches to one, host loop 21.4 -> ~14 us, ATen 14.1,
# on an H200; BERT's bias-gradient sums, 3 M elements, still split).
_CONFIGS = {
    "cuda": dict(tile=4096, tile_outer=8192, max_r=4096, max_k=256, programs_per_sm=8, min_iters=4,
                 max_split=1024, min_split_elems=1 << 16),
    # the interpreter runs each program in Python: few programs, but small tiles so that small test
    # shapes still go through the loops and the split path
    "interpreter": dict(tile=1024, max_r=128, max_k=32, programs=4, min_iters=1, max_split=64),
}


def config():
    return _CONFIGS[backend().name]


def target_programs_on(device) -> int:
    return target_programs(config(), device)


# offsets switch to int64 from this many elements on (a module variable so tests can lower it)
_INT64_FROM = 2 ** 31 - 1


@triton.jit
def _combine_max(acc, x):
    # NaN wins: once acc is NaN it stays NaN (x > NaN is false), and a NaN x replaces acc
    return tl.where((x > acc) | (x != x), x, acc)


@triton.jit
def _combine_min(acc, x):
    return tl.where((x < acc) | (x != x), x, acc)


@triton.jit
def _acc_init(B0: tl.constexpr, B1: tl.constexpr, OP: tl.constexpr, ACC: tl.constexpr, IS_FLOAT: tl.constexpr):
    """The identity of the reduction: 0 for sums and any, 1 for all (of 0/1 flags), the lowest value
    for max, +inf for min (float only: the -inf norm)."""
    if OP % 16 == 0 or OP % 16 == 2 or OP % 16 == 4 or OP % 16 == 7 or OP % 16 == 8 or OP % 16 == 9:
        acc = tl.zeros([B0, B1], ACC)
    elif OP % 16 == 3:
        acc = tl.full([B0, B1], 1, ACC)
    elif OP % 16 == 6 or OP % 16 == 10:
        acc = tl.full([B0, B1], float("inf"), ACC)
    else:
        if IS_FLOAT:
            acc = tl.full([B0, B1], -float("inf"), ACC)
        else:
            acc = tl.full([B0, B1], -9223372036854775807 - 1, ACC)
    return acc


@triton.jit
def _load_acc(ptrs, mask, OP: tl.constexpr, ACC: tl.constexpr, p):
    """The input in the accumulation dtype; any/all and the 0-norm read (x != 0): NaN counts as true,
    -0.0 as false; the norms |x|^2, |x|, |x|^p = 2^(p log2 |x|) (|0|^p: 0 for p > 0, inf for p < 0)."""
    x = tl.load(ptrs, mask=mask, other=0)
    if OP % 16 == 2 or OP % 16 == 3 or OP % 16 == 8:
        x = (x != 0).to(ACC)
    else:
        x = x.to(ACC)
    if OP % 16 == 4:
        x = x * x
    elif OP % 16 == 5 or OP % 16 == 6 or OP % 16 == 7:
        x = tl.abs(x)
    elif OP % 16 == 9:
        x = tl.exp2(tl.log2(tl.abs(x)) * p)
    return x


@triton.jit
def _acc_step(acc, x, mask, OP: tl.constexpr):
    """Elementwise accumulation inside the loop; the cross-lane reduction happens once, at the end."""
    if OP % 16 == 9:
        acc += tl.where(mask, x, 0)   # masked lanes read 0, and |0|^p is inf for p < 0
    elif OP % 16 == 0 or OP % 16 == 4 or OP % 16 == 7 or OP % 16 == 8:
        acc += x
    elif OP % 16 == 6 or OP % 16 == 10:
        acc = _combine_min(acc, tl.where(mask, x, acc))
    elif OP % 16 == 2:
        acc = tl.maximum(acc, tl.where(mask, x, acc))
    elif OP % 16 == 3:
        acc = tl.minimum(acc, tl.where(mask, x, acc))
    else:
        acc = _combine_max(acc, tl.where(mask, x, acc))
    return acc


@triton.jit
def _acc_finish(acc, AXIS: tl.constexpr, OP: tl.constexpr, IS_FLOAT: tl.constexpr, HAS_SCALE: tl.constexpr, scale):
    """Reduce the tile along AXIS (sum, any/all flags, or max / min with NaN propagation like ATen),
    scale (mean) or finish a norm (sqrt, or res^(1/p) with p = scale)."""
    if OP % 16 == 0 or OP % 16 == 4 or OP % 16 == 7 or OP % 16 == 8 or OP % 16 == 9:
        res = tl.sum(acc, AXIS)
    elif OP % 16 == 2:
        res = tl.max(acc, AXIS)
    elif OP % 16 == 3:
        res = tl.min(acc, AXIS)
    elif OP % 16 == 6 or OP % 16 == 10:
        res = tl.min(acc, AXIS)
        has_nan = tl.max((acc != acc).to(tl.int32), AXIS) > 0
        res = tl.where(has_nan, float("nan"), res)
    else:
        res = tl.max(acc, AXIS)
        if IS_FLOAT:
            has_nan = tl.max((acc != acc).to(tl.int32), AXIS) > 0
            res = tl.where(has_nan, float("nan"), res)
    if OP // 16 == 1:
        res = tl.sqrt(res)
    elif OP // 16 == 2:
        # 0 -> 0 (p > 0) and inf -> 0 (p < 0) through log2 = -inf / +inf
        res = tl.exp2(tl.log2(res) / scale)
    if HAS_SCALE:
        res = res * scale
    return res


@kernel
@triton.jit
def reduce_inner(X, Y, M, R, sM, sR, r_per_split, scale,
                 OP: tl.constexpr, ACC: tl.constexpr, IS_FLOAT: tl.constexpr, HAS_SCALE: tl.constexpr,
                 BIG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr):
    """Y[split * M + m] = scale * OP_{r in split's range} X[m * sM + r * sR]   (OP: sum or max)."""
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
    acc = _acc_init(BLOCK_M, BLOCK_R, OP, ACC, IS_FLOAT)
    for start in range(r0, r_end, BLOCK_R):
        r = start + rr
        # bound by R (a specialized kernel argument), not r_end: a mask whose bound has known
        # divisibility keeps 16-byte vector loads; tiles never cross into the next split anyway
        mask = mmask & (r < R)
        if BIG:
            offs = base + r.to(tl.int64) * sR
        else:
            offs = base + r * sR
        x = _load_acc(X + offs, mask, OP, ACC, scale)
        acc = _acc_step(acc, x, mask, OP)
    res = _acc_finish(acc, 1, OP, IS_FLOAT, HAS_SCALE, scale)
    tl.store(Y + split * M + m, res.to(Y.dtype.element_ty), mask=m < M)


@kernel
@triton.jit
def reduce_outer(X, Y, M, R, K, sM, sR, sK, r_per_split, scale,
                 OP: tl.constexpr, ACC: tl.constexpr, IS_FLOAT: tl.constexpr, HAS_SCALE: tl.constexpr,
                 BIG: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """Y[(split * M + m) * K + k] = scale * OP_{r in split's range} X[m * sM + r * sR + k * sK]."""
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
    acc = _acc_init(BLOCK_R, BLOCK_K, OP, ACC, IS_FLOAT)
    for start in range(r0, r_end, BLOCK_R):
        r = start + rr
        mask = kmask & (r < R)
        if BIG:
            offs = base + r.to(tl.int64) * sR
        else:
            offs = base + r * sR
        x = _load_acc(X + offs, mask, OP, ACC, scale)
        acc = _acc_step(acc, x, mask, OP)
    res = _acc_finish(acc, 0, OP, IS_FLOAT, HAS_SCALE, scale)
    if BIG:
        out = (split * M + m).to(tl.int64) * K + k
    else:
        out = (split * M + m) * K + k
    tl.store(Y + out, res.to(Y.dtype.element_ty), mask=k < K)


# ---------------------------------------------------------------------------------------------
# planning


def merge_dims(dims):
    """Merge (size, stride) pairs, outermost first, where dim i spans exactly dim i+1 repeated."""
    out = []
    for size, stride in dims:
        if out and out[-1][1] == stride * size:
            out[-1] = (out[-1][0] * size, stride)
        else:
            out.append((size, stride))
    return out


def mrk_plan(shape, strides, rset):
    """(M, sM, R, sR, K, sK) reading the tensor as X[m*sM + r*sR + k*sK], or None if it does not fit."""
    kept = [(s, st) for d, (s, st) in enumerate(zip(shape, strides)) if d not in rset and s != 1]
    red = [(s, st) for d, (s, st) in enumerate(zip(shape, strides)) if d in rset and s != 1]
    kg = merge_dims(kept)
    rg = merge_dims(sorted(red, key=lambda p: -p[1]))
    if len(rg) > 1 or len(kg) > 2:
        return None
    R, sR = rg[0] if rg else (1, 0)
    if not kg:
        return 1, 0, R, sR, 1, 0
    if len(kg) == 1:
        (n, st), = kg
        # a kept dim below the reduced one is the tile's fast axis (coalesced); above it is M
        return (1, 0, R, sR, n, st) if st < sR else (n, st, R, sR, 1, 0)
    (m, sm), (k, sk) = kg
    return m, sm, R, sR, k, sk


# a norm's second stage reads the first's transformed partials as they are (sum, max or min)
_STAGE2 = {NORM_SQ: OP_SUM, NORM_ABS: OP_SUM, NORM_NZ: OP_SUM, NORM_POW: OP_SUM, NORM_ABSMAX: OP_MAX,
           NORM_ABSMIN: OP_MIN}


def _split_ops(op):
    """(first stage op, later stage op) of a reduction done in two passes: the finish (16 * post) only
    on the last, the element transform only on the first."""
    base, post = op % 16, op - op % 16
    return base, _STAGE2.get(base, base) + post


def _uses_p(op):
    return op % 16 == NORM_POW or op >= POST_ROOT


_TL = {torch.float32: tl.float32, torch.float64: tl.float64, torch.int64: tl.int64, torch.int32: tl.int32}


def geometry(M, R, K, target):
    """Tiles and R split of a reduction read as [M, R, K] (also arg reductions, argmax.py):
    (BLOCK_M, BLOCK_R, grid0, split, r_per) when K == 1, else (BLOCK_R, BLOCK_K, grid0, split, r_per)."""
    cfg = config()
    tile = cfg["tile"]
    if K == 1:
        block_r = min(next_pow2(R), cfg["max_r"])
        block_m = min(next_pow2(M), max(tile // block_r, 1))
        blocks, grid0, step = (block_m, block_r), cdiv(M, block_m), block_r
    else:
        tile_o = cfg.get("tile_outer", tile)
        # a short R leaves room for a wider K slice: programs keep ~tile_o elements either way
        block_k = min(next_pow2(K), max(cfg["max_k"], tile_o // next_pow2(R)))
        block_r = min(next_pow2(R), max(tile_o // block_k, 1))
        blocks, grid0, step = (block_r, block_k), M * cdiv(K, block_k), block_r
    split, r_per = 1, R
    if grid0 < target and R > step * cfg["min_iters"] and M * R * K >= cfg.get("min_split_elems", 0):
        split = min(cdiv(target, grid0), cdiv(R, step * cfg["min_iters"]), cfg["max_split"])
        if split > 1:
            r_per = cdiv(cdiv(R, split), step) * step
            split = cdiv(R, r_per)
    return blocks + (grid0, split, r_per)


@functools.lru_cache(maxsize=1024)
def _schedule(plan, op, acc_dtype, scale, target):
    """The launches that reduce a tensor read through `plan` (pure ints: cached, no per-call math).

    Returns (steps, workspace shape or None); a step is (kernel, grid, src, dst, args, num_warps)
    with src/dst 0 = input, 1 = output, 2 = workspace.
    """
    M, sM, R, sR, K, sK = plan
    acc = _TL[acc_dtype]
    is_float = int(acc_dtype.is_floating_point)
    span = 1 + (M - 1) * sM + (R - 1) * sR + (K - 1) * sK
    block_a, block_b, grid0, split, r_per = geometry(M, R, K, target)
    if K == 1:
        block_m, block_r = block_a, block_b
    else:
        block_r, block_k = block_a, block_b
    # int64 offsets only when some offset can pass 2**31 (input span, or the workspace)
    big = int(max(span, split * M * K) >= _INT64_FROM)
    last = split == 1
    op1, op2 = (op, op) if last else _split_ops(op)
    if _uses_p(op):
        s, hs = scale, 0        # scale is p: every stage may need it, none multiplies by it
    else:
        s = scale if last else 1.0
        hs = int(scale != 1.0) if last else 0
    if K == 1:
        nw = max(1, min(8, block_m * block_r // 512))
        args = (M, R, sM, sR, r_per, s, op1, acc, is_float, hs, big, block_m, block_r)
        steps = [(reduce_inner, (grid0, split), 0, 1 if last else 2, args, nw)]
    else:
        nw = max(1, min(8, block_r * block_k // 512))
        args = (M, R, K, sM, sR, sK, r_per, s, op1, acc, is_float, hs, big, block_r, block_k)
        steps = [(reduce_outer, (grid0, split), 0, 1 if last else 2, args, nw)]
    if last:
        return steps, None
    # second stage: the [split, M*K] workspace reduced over split (K = M*K, contiguous)
    n = M * K
    plan2 = (1, 0, split, n, 1, 0) if n == 1 else (1, 0, split, n, n, 1)
    steps2, ws2 = _schedule(plan2, op2, acc_dtype, scale, target)
    if ws2 is not None:  # cannot happen with max_split <= the second stage's tile; keep it honest
        raise Unsupported("three-stage reduction")
    return steps + [(k, g, 2, d, a, w) for k, g, _, d, a, w in steps2], (split, n)


def _run(steps, ws_shape, x, y, acc_dtype):
    bufs = (x, y, None if ws_shape is None else empty(ws_shape, acc_dtype, x.device))
    for k, grid, src, dst, args, nw in steps:
        k[grid](bufs[src], bufs[dst], *args, num_warps=nw)


def reduce_launch(x, y, plan, op, acc_dtype, scale):
    """Reduce x (read through `plan`) into the contiguous y (M*K elements), splitting R if needed."""
    steps, ws = _schedule(plan, op, acc_dtype, scale, target_programs_on(x.device))
    _run(steps, ws, x, y, acc_dtype)


def _runs(dims):
    """Maximal runs of consecutive dims: [0, 2, 3] -> [[0], [2, 3]]."""
    runs = []
    for d in sorted(dims):
        if runs and runs[-1][-1] == d - 1:
            runs[-1].append(d)
        else:
            runs.append([d])
    return runs


def reduce_into(x, dims, y, op, acc_dtype, scale):
    """Reduce x over `dims` into the contiguous y (kept dims in logical order)."""
    rset = set(dims)
    plan = mrk_plan(x.shape, x.stride(), rset)
    if plan is None and not x.is_contiguous():
        x = x.contiguous()  # a layout the plan cannot read in one pass: one copy, then as contiguous
        plan = mrk_plan(x.shape, x.stride(), rset)
    if plan is not None:
        reduce_launch(x, y, plan, op, acc_dtype, scale)
        return
    # contiguous, but the reduced dims are apart: reduce the innermost run first (into acc dtype)
    last = _runs(dims)[-1]
    mid = empty([1 if d in last else s for d, s in enumerate(x.shape)], acc_dtype, x.device)
    op1, op2 = _split_ops(op)
    reduce_into(x, last, mid, op1, acc_dtype, scale if _uses_p(op1) else 1.0)
    reduce_into(mid, [d for d in dims if d not in last], y, op2, acc_dtype, scale)


def _out_shape(shape, rset, keepdim):
    if keepdim:
        return [1 if d in rset else s for d, s in enumerate(shape)]
    return [s for d, s in enumerate(shape) if d not in rset]


def _acc_dtype(out_dtype):
    if out_dtype == torch.float64:
        return torch.float64
    return torch.float32 if out_dtype.is_floating_point else torch.int64


# per-call recipes for the common case (the plan reads the input as it is): one dict lookup replaces
# dim wrapping, planning and scheduling on the host path
_RECIPES: dict = {}
_MAX_RECIPES = 4096


def _recipe(x, dims, keepdim, out_dtype, op, mean, p):
    nd = x.dim()
    if isinstance(dims, int):
        dims = [dims]
    dl = wrap_dims(dims, nd)
    rset = set(dl) if nd else set()
    shape = _out_shape(x.shape, rset, keepdim) if nd else []
    count = 1
    for d in rset:
        count *= x.shape[d]
    acc = _acc_dtype(out_dtype)
    scale = 1.0 / count if mean and count else p
    sched = None
    if x.numel() and math.prod(shape):
        plan = mrk_plan(x.shape, x.stride(), rset)
        if plan is not None:
            sched = _schedule(plan, op, acc, scale, target_programs_on(x.device))
    return shape, sorted(rset), acc, scale, sched


def reduce_dims(x, dims, keepdim, out_dtype, op, out=None, mean=False, p=1.0):
    """p: the norm's order for NORM_POW / POST_ROOT (module doc of the op codes)."""
    key = (x.shape, x.stride(), dims if dims.__class__ is not list else tuple(dims), keepdim, out_dtype, op, mean,
           x.device, p)
    rec = _RECIPES.get(key)
    if rec is None:
        rec = _recipe(x, dims, keepdim, out_dtype, op, mean, p)
        if len(_RECIPES) >= _MAX_RECIPES:
            _RECIPES.clear()
        _RECIPES[key] = rec
    shape, rdims, acc, scale, sched = rec
    y = prepare_out(out, shape, out_dtype, x.device)
    if sched is not None:
        _run(sched[0], sched[1], x, y, acc)
        return y
    if y.numel() == 0:
        return y
    if x.numel() == 0:
        # every output reduces an empty set: 0 for sum and the norms that have an identity, 0/0 for
        # mean (amax and the others raised before this)
        y.fill_(float("nan") if mean else 0)
        return y
    reduce_into(x, rdims, y, op, acc, scale)
    return y


def _sum_dtype(x, dtype):
    if dtype is None:
        return torch.int64 if (x.dtype == torch.bool or not x.dtype.is_floating_point) else x.dtype
    if dtype.is_complex or dtype == torch.bool:
        raise Unsupported(f"sum to {dtype}")
    if x.dtype.is_floating_point and not dtype.is_floating_point:
        raise Unsupported("float input summed as integers")
    return dtype


SUM_DTYPES = FLOATS + INTS + (torch.bool,)
_HALVES = (torch.float16, torch.bfloat16)


def read_as(x, out_dtype):
    """x as ATen's reduction reads it: cast to the result dtype first. Only an fp16/bf16 result of
    another input dtype needs the copy: each element rounds to it before the fp32 accumulation
    (sum([2049, 1, 1], dtype=fp16) is 2048 + 1 + 1 = 2050; 7e4 becomes inf, so [7e4, -7e4] sums to
    NaN). The kernels' own conversion on load is ATen's cast for every other pair (a widening, fp64 to
    the fp32 accumulator per element, integers modulo 2^n)."""
    if out_dtype in _HALVES and x.dtype != out_dtype:
        return x.to(out_dtype)
    return x


@register("sum.default", "sum.out", category="reduction", dtypes=SUM_DTYPES)
def sum_all(x, *, dtype=None, out=None):
    """Sum of all elements (fp32/int64 accumulation, two-stage split for large inputs)."""
    od = _sum_dtype(x, dtype)
    return reduce_dims(x if dtype is None else read_as(x, od), None, False, od, OP_SUM, out)


@register("sum.dim_IntList", "sum.IntList_out", category="reduction", dtypes=SUM_DTYPES)
def sum_dim(x, dim, keepdim=False, *, dtype=None, out=None):
    """Sum over a list of dims, any strides, no copies for mergeable layouts."""
    od = _sum_dtype(x, dtype)
    return reduce_dims(x if dtype is None else read_as(x, od), dim, keepdim, od, OP_SUM, out)


def _mean_dtype(x, dtype):
    d = x.dtype if dtype is None else dtype
    if not d.is_floating_point:
        which = "Input" if dtype is None else "Optional"
        raise RuntimeError(f"mean(): could not infer output dtype. {which} dtype must be either a floating "
                           f"point or complex dtype. Got: {d}")
    return d


def _mean_input(x, od):
    # ATen's CUDA mean reads the input cast to the result dtype, as sum does; its CPU mean is an fp32
    # sum of the input as it is (for an fp16/bf16 result), divided, then cast
    return read_as(x, od) if x.device.type == "cuda" else x


@register("mean.default", "mean.dtype_out", category="reduction", dtypes=FLOATS)
def mean_all(x, *, dtype=None, out=None):
    """Mean of all elements (sum * 1/N in the accumulation dtype)."""
    od = _mean_dtype(x, dtype)
    return reduce_dims(x if dtype is None else _mean_input(x, od), None, False, od, OP_SUM, out, mean=True)


@register("mean.dim", "mean.out", category="reduction", dtypes=FLOATS)
def mean_dim(x, dim, keepdim=False, *, dtype=None, out=None):
    """Mean over a list of dims (coalesced tiles over non-innermost dims, split when the grid is small)."""
    od = _mean_dtype(x, dtype)
    return reduce_dims(x if dtype is None else _mean_input(x, od), dim, keepdim, od, OP_SUM, out, mean=True)


@register("amax.default", "amax.out", category="reduction", dtypes=FLOATS + INTS)
def amax(x, dim=(), keepdim=False, *, out=None):
    """Maximum over a list of dims; NaN propagates."""
    nd = x.dim()
    if isinstance(dim, int):
        dim = [dim]
    dl = wrap_dims(dim, nd)
    if x.numel() == 0:
        if dim is None or len(dim) == 0:
            raise RuntimeError("amax(): Expected reduction dim to be specified for input.numel() == 0. "
                               "Specify the reduction dim with the 'dim' argument.")
        for d in dl:
            if x.shape[d] == 0:
                raise IndexError(f"amax(): Expected reduction dim {d} to have non-zero size.")
    return reduce_dims(x, dl if nd else None, keepdim, x.dtype, OP_MAX, out)
