"""native_layer_norm forward and backward (the kernels also serve gems.fused.layer_norm and
add_layer_norm: a residual-add flag in the forward, an added residual gradient in the backward).

The input is read as M rows of N = prod(normalized_shape) elements (row stride taken from the
tensor when each row is unit-stride, so sliced batches need no copy; `runtime.utils.as_rows` copies
other layouts, e.g. a sliced or expanded tensor normalized over more than its last dim).

Forward: each program holds BLOCK_M whole rows in registers (N <= max_n; one row of 4096 bf16 on
the GPU), so x is read once and y written once: 2 passes over memory, the minimum. Mean and
variance are computed in fp32 from the registers (two-pass variance, no E[x^2] - E[x]^2
cancellation), dividing by N with IEEE division (Triton's `/` is approximate on the GPU). The first
estimate of the mean sums the row shifted by its first element (a constant row then has mean exactly
that element and normalizes to exactly 0, as under ATen's Welford; an fp32 sum of N copies of 0.1 is
not N * 0.1); one correction step adds the mean of x - mean, and y is (x - mean) * rstd, each
difference taken from x itself: where x - mean is small beside the shifted values (a row whose first
element is far from its mean) the shifted form loses digits, which a large weight then shows (values
near 0.09 in a row starting near 3, times a weight of 3e38: y 1.5e-4 off in fp32, 8x ATen's error). Wider rows loop over the row three times
(mean; the correction and the variance; write). A row whose shifted sum or squares overflow fp32 (a value past
2^64; its variance is then not finite) is normalized again from x * 2^-80, exact for normal numbers,
and gets the float64 answer, its sum carried with each addition's rounding error so that huge values
that cancel keep the small ones (ATen's Welford answers NaN or 0 there: docs/known-differences.md). The
errors themselves are summed in fp32, so where huge values' own rounding errors meet the small values
first the small ones may still be lost: the mean is then within fp32 summation's bound. The
branch is taken only by a program that has such a row (or one holding inf / NaN), so other rows pay a
per-row test.

Backward: with xhat = (x - mean) * rstd and wg = dy * w,
    dx = rstd * (wg - mean(wg * xhat) * xhat - mean(wg))          per row, one pass
    dw = sum_rows dy * xhat,  db = sum_rows dy                      over rows
Each program owns a contiguous range of rows, keeps its dw/db partial sums in fp32 registers, and
writes them once to a workspace [2, programs, N]; one column-sum launch (reading it coalesced along
N) gives dw and db. No atomics: deterministic. The workspace is programs * N * 4 bytes per gradient
(a few % of the traffic of dy + x + dx for LLM shapes). Two launches in all: at decode and BERT
sizes each launch is host time (a separate column sum per gradient made it 1.17x ATen's per-call
time on an H100).

Mean and rstd follow ATen's dtypes: the input dtype on CPU, fp32 for fp16/bf16 inputs on CUDA;
shape input.shape[:axis] + (1,) * len(normalized_shape).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ...codegen.tlmath import fma_f
from ...registry import FLOATS, Unsupported, register
from ...runtime import backend, kernel
from ...runtime.utils import as_rows, cdiv, empty, next_pow2, prepare_out, sm_count, zeros

# max_n: widest row kept in registers; tile: elements per program for short rows;
# elems_per_warp: sets num_warps; bwd_programs_per_sm: programs of the backward when dw/db are needed
_CONFIGS = {
    # bwd: N=4096 bf16 at 16 warps is 64 registers/thread (8 warps: 114), two programs fit an SM
    # either way, so two per SM and no second wave; more warps keep more row loads in flight
    "cuda": dict(max_n=16384, tile=4096, elems_per_warp=512, bwd_elems_per_warp=256, max_warps=16,
                 bwd_programs_per_sm=2, colsum_n=64, colsum_p=32),
    # the interpreter: few programs; a small max_n so that tests (also gems.fused's) reach the looping path
    "interpreter": dict(max_n=128, tile=1024, elems_per_warp=512, bwd_elems_per_warp=512, max_warps=1,
                        programs=4, colsum_n=32, colsum_p=4),
}


# offsets switch to int64 from this many elements on (a module variable so tests can lower it)
_INT64_FROM = 2 ** 31 - 1


def _cfg():
    return _CONFIGS[backend().name]


def _warps(elems, key="elems_per_warp"):
    cfg = _cfg()
    return max(1, min(cfg["max_warps"], next_pow2(max(elems // cfg[key], 1))))


# a row whose statistics overflow fp32 is normalized again from x * SCALE_DOWN (exact for normal
# numbers): its deviations stay below 2^49 and their squares below 2^98, summed over any row length
SCALE_DOWN: tl.constexpr = tl.constexpr(2.0 ** -80)
SCALE_UP: tl.constexpr = tl.constexpr(2.0 ** 80)


@triton.jit
def _two_sum(a, b):
    """(s, e) with s = fl(a + b) and s + e = a + b exactly (Knuth's TwoSum; no reassociation on Triton)."""
    s = a + b
    bp = s - a
    return s, (a - (s - bp)) + (b - bp)


@triton.jit
def _two_sum_combine(s1, e1, s2, e2):
    s, e = _two_sum(s1, s2)
    return s, e1 + e2 + e


@triton.jit
def _exact_sum(x, err):
    """Per row, sum(x + err) with every partial sum's rounding error carried (cascaded TwoSum, the errors
    summed in fp32): a row whose huge values cancel keeps its small ones unless the huge values' own
    errors absorb them first. Only the rows that overflow fp32 take it."""
    s, e = tl.reduce((x, err), 1, _two_sum_combine)
    return tl.where(s - s == 0.0, s + e, s)    # an infinite (or NaN) sum as it is: its errors are NaN


@triton.jit
def _affine(y, W, B, c, N, HAS_W: tl.constexpr, HAS_B: tl.constexpr):
    """y * w + b rounded once (a fused multiply-add, as ATen's kernels compute it): a product past fp32's
    range plus an infinite bias is that infinity, where a rounded product would meet it as inf - inf."""
    if HAS_W:
        w = tl.broadcast_to(tl.load(W + c, mask=c < N, other=0.0).to(tl.float32), y.shape)
        if HAS_B:
            y = fma_f(y, w, tl.broadcast_to(tl.load(B + c, mask=c < N, other=0.0).to(tl.float32), y.shape))
        else:
            y = y * w
    elif HAS_B:
        y = y + tl.load(B + c, mask=c < N, other=0.0).to(tl.float32)
    return y


@triton.jit
def _write_rows(src, W, B, Y, yrow, rmask, cols, N, mean, rstd, scale, SCALED: tl.constexpr,
                HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK_N: tl.constexpr):
    """The forward's write pass over rows longer than a block: y = (x [* scale] - mean) * rstd (* W + B).
    SCALED: the rows normalized from x * 2^-80."""
    for start in range(0, N, BLOCK_N):
        c = cols + start
        mask = rmask & (c < N)
        x = tl.load(src + c, mask=mask, other=0.0).to(tl.float32)
        if SCALED:
            y = (x * scale - mean[:, None]) * rstd[:, None]
        else:
            y = (x - mean[:, None]) * rstd[:, None]
        y = _affine(y, W, B, c, N, HAS_W, HAS_B)
        tl.store(yrow + c, y.to(Y.dtype.element_ty), mask=mask)


@kernel
@triton.jit
def layer_norm_fwd(X, R, W, B, Y, S, MEAN, RSTD, M, N, sX, sR, eps,
                   HAS_RES: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, SINGLE: tl.constexpr,
                   BIG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """s = x + r rounded to x's dtype (HAS_RES: gems.fused.add_layer_norm, S written), else s = x;
    Y = (s - mean) * rstd * W + B per row; mean = sum(s)/N, rstd = 1/sqrt(sum((s-mean)^2)/N + eps).
    Bytes per element: read x (+ r), write y (+ s); W and B once per program; mean/rstd per row."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = (rows < M)[:, None]
    cols = tl.arange(0, BLOCK_N)[None, :]
    if BIG:
        rows_1 = rows.to(tl.int64)
    else:
        rows_1 = rows
    rows_l = rows_1[:, None]
    xrow = X + rows_l * sX
    yrow = Y + rows_l * N
    # the statistics are taken of s - s[0] (shift = the row's first element, rounded as s is): a
    # constant row then has mean exactly s[0] and normalizes to exactly 0, as ATen's Welford does
    shift = tl.load(X + rows_1 * sX, mask=rows < M, other=0.0)
    if HAS_RES:
        shift = (shift.to(tl.float32)
                 + tl.load(R + rows_1 * sR, mask=rows < M, other=0.0).to(tl.float32)).to(S.dtype.element_ty)
    shift = shift.to(tl.float32)[:, None]
    if SINGLE:
        mask = rmask & (cols < N)
        x = tl.load(xrow + cols, mask=mask, other=0.0)
        if HAS_RES:
            x = (x.to(tl.float32) + tl.load(R + rows_l * sR + cols, mask=mask, other=0.0).to(tl.float32))
            x = x.to(S.dtype.element_ty)
            tl.store(S + rows_l * N + cols, x, mask=mask)     # the new residual: contiguous rows
        x32 = x.to(tl.float32)
        xs = tl.where(mask, x32 - shift, 0.0)
        mean = tl.sum(shift, 1) + tl.div_rn(tl.sum(xs, 1), N * 1.0)
        # one correction step (module doc): the mean of x - mean, each difference taken from x itself
        mean += tl.div_rn(tl.sum(tl.where(mask, x32 - mean[:, None], 0.0), 1), N * 1.0)
        xc = tl.where(mask, x32 - mean[:, None], 0.0)
        var = tl.div_rn(tl.sum(xc * xc, 1), N * 1.0)
        rstd = 1.0 / tl.sqrt(var + eps)
        y = xc * rstd[:, None]
        if tl.max(tl.where(var < float("inf"), 0, 1), 0) > 0:
            # a row whose shifted sum or squares overflowed fp32 (or that holds inf / NaN): its statistics
            # again from x * 2^-80 (module doc), taken only when some row of this program needs it
            over = var < float("inf")
            xq = tl.where(mask, x.to(tl.float32) * SCALE_DOWN, 0.0)
            mean_q = tl.div_rn(_exact_sum(xq, tl.zeros_like(xq)), N * 1.0)
            xcq = tl.where(mask, xq - mean_q[:, None], 0.0)
            rstd_q = 1.0 / tl.sqrt(tl.div_rn(tl.sum(xcq * xcq, 1), N * 1.0))
            y = tl.where(over[:, None], y, xcq * rstd_q[:, None])
            rstd = tl.where(over, rstd, rstd_q * SCALE_DOWN)
            mean = tl.where(over, mean, mean_q * SCALE_UP)
        y = _affine(y, W, B, cols, N, HAS_W, HAS_B)
        tl.store(yrow + cols, y.to(Y.dtype.element_ty), mask=mask)
    else:
        # three passes over the row (mean, variance, write); with a residual the first pass writes the
        # rounded sum and the later ones read it back instead of x and r
        if HAS_RES:
            src = S + rows_l * N
        else:
            src = xrow
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for start in range(0, N, BLOCK_N):
            mask = rmask & (cols + start < N)
            x = tl.load(xrow + start + cols, mask=mask, other=0.0)
            if HAS_RES:
                x = (x.to(tl.float32)
                     + tl.load(R + rows_l * sR + start + cols, mask=mask, other=0.0).to(tl.float32))
                x = x.to(S.dtype.element_ty)
                tl.store(src + start + cols, x, mask=mask)
            acc += tl.where(mask, x.to(tl.float32) - shift, 0.0)
        mean = tl.sum(shift, 1) + tl.div_rn(tl.sum(acc, 1), N * 1.0)
        if HAS_RES:
            tl.debug_barrier()   # the sums stored above are read back below (by the same threads anyway)
        # the second pass sums x - mean and its squares: the mean's correction and the corrected two-pass
        # variance (S2 - S1^2 / N) / N, in the pass the variance needs anyway
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc1 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for start in range(0, N, BLOCK_N):
            mask = rmask & (cols + start < N)
            x = tl.load(src + start + cols, mask=mask, other=0.0).to(tl.float32)
            xc = tl.where(mask, x - mean[:, None], 0.0)
            acc1 += xc
            acc += xc * xc
        corr = tl.div_rn(tl.sum(acc1, 1), N * 1.0)
        var = tl.div_rn(tl.sum(acc, 1), N * 1.0) - corr * corr
        var = tl.where(var < 0.0, 0.0, var)    # rounding below 0; a NaN stays (it takes the branch below)
        rstd = 1.0 / tl.sqrt(var + eps)
        mean += corr
        if tl.max(tl.where(var < float("inf"), 0, 1), 0) > 0:
            # (one row per program here) the statistics of x * 2^-80, as in the single-block case: the
            # written y is then (x * 2^-80 - mean_q) * rstd_q, i.e. shift = 0, a scale on x
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            err = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for start in range(0, N, BLOCK_N):
                mask = rmask & (cols + start < N)
                xq = tl.where(mask, tl.load(src + start + cols, mask=mask, other=0.0).to(tl.float32) * SCALE_DOWN,
                              0.0)
                acc, e = _two_sum(acc, xq)
                err += e
            mean_s = tl.div_rn(_exact_sum(acc, err), N * 1.0)
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for start in range(0, N, BLOCK_N):
                mask = rmask & (cols + start < N)
                x = tl.load(src + start + cols, mask=mask, other=0.0).to(tl.float32) * SCALE_DOWN
                xc = tl.where(mask, x - mean_s[:, None], 0.0)
                acc += xc * xc
            rstd = 1.0 / tl.sqrt(tl.div_rn(tl.sum(acc, 1), N * 1.0))
            _write_rows(src, W, B, Y, yrow, rmask, cols, N, mean_s, rstd, SCALE_DOWN, True, HAS_W, HAS_B, BLOCK_N)
            mean = mean_s * SCALE_UP
            rstd = rstd * SCALE_DOWN
        else:
            _write_rows(src, W, B, Y, yrow, rmask, cols, N, mean, rstd, 1.0, False, HAS_W, HAS_B, BLOCK_N)
    tl.store(MEAN + rows, mean.to(MEAN.dtype.element_ty), mask=rows < M)
    tl.store(RSTD + rows, rstd.to(RSTD.dtype.element_ty), mask=rows < M)


@kernel
@triton.jit
def layer_norm_bwd(G, DS, X, W, MEAN, RSTD, DX, WS_W, WS_B, M, N, sG, sDS, sX, rows_per_prog,
                   HAS_W: tl.constexpr, HAS_DS: tl.constexpr, DO_DX: tl.constexpr, DO_DW: tl.constexpr,
                   DO_DB: tl.constexpr, SINGLE: tl.constexpr, BIG: tl.constexpr, BLOCK_N: tl.constexpr):
    """dx = rstd * (wg - mean(wg * xhat) * xhat - mean(wg)) (+ ds: HAS_DS, the gradient reaching the new
    residual of gems.fused.add_layer_norm); WS_W[p] = sum_{rows of p} dy * xhat, WS_B[p] = sum_{rows of p}
    dy (workspace rows: fp32 partial sums, zeroed by the caller when not SINGLE).
    Bytes per element: read dy, x (+ ds), write dx."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    row0 = pid * rows_per_prog
    row_end = tl.minimum(M, row0 + rows_per_prog)
    if BIG:
        ws_off = pid.to(tl.int64) * N
        row0_l = row0.to(tl.int64)  # loop indices: int64 through this base (a loop var may be a plain int)
    else:
        ws_off = pid * N
    if SINGLE:
        cmask = cols < N
        if HAS_W:
            w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK_N], tl.float32)
        db = tl.zeros([BLOCK_N], tl.float32)
        for row in range(row0, row_end):
            if BIG:
                r = row0_l + (row - row0)
            else:
                r = row
            g = tl.load(G + r * sG + cols, mask=cmask, other=0.0).to(tl.float32)
            x = tl.load(X + r * sX + cols, mask=cmask, other=0.0).to(tl.float32)
            mean = tl.load(MEAN + row).to(tl.float32)
            rstd = tl.load(RSTD + row).to(tl.float32)
            xhat = tl.where(cmask, (x - mean) * rstd, 0.0)
            if DO_DX:
                if HAS_W:
                    wg = g * w
                else:
                    wg = g
                c1 = tl.sum(wg * xhat, 0) / N
                c2 = tl.sum(wg, 0) / N
                dx = rstd * (wg - c1 * xhat - c2)
                if HAS_DS:
                    dx += tl.load(DS + r * sDS + cols, mask=cmask, other=0.0).to(tl.float32)
                tl.store(DX + r * N + cols, dx.to(DX.dtype.element_ty), mask=cmask)
            if DO_DW:
                dw += g * xhat
            if DO_DB:
                db += g
        if DO_DW:
            tl.store(WS_W + ws_off + cols, dw, mask=cmask)
        if DO_DB:
            tl.store(WS_B + ws_off + cols, db, mask=cmask)
    else:
        for row in range(row0, row_end):
            if BIG:
                r = row0_l + (row - row0)
            else:
                r = row
            mean = tl.load(MEAN + row).to(tl.float32)
            rstd = tl.load(RSTD + row).to(tl.float32)
            if DO_DX:
                a1 = tl.zeros([BLOCK_N], tl.float32)
                a2 = tl.zeros([BLOCK_N], tl.float32)
                for start in range(0, N, BLOCK_N):
                    c = start + cols
                    cmask = c < N
                    g = tl.load(G + r * sG + c, mask=cmask, other=0.0).to(tl.float32)
                    x = tl.load(X + r * sX + c, mask=cmask, other=0.0).to(tl.float32)
                    xhat = tl.where(cmask, (x - mean) * rstd, 0.0)
                    if HAS_W:
                        g = g * tl.load(W + c, mask=cmask, other=0.0).to(tl.float32)
                    a1 += g * xhat
                    a2 += g
                c1 = tl.sum(a1, 0) / N
                c2 = tl.sum(a2, 0) / N
            for start in range(0, N, BLOCK_N):
                c = start + cols
                cmask = c < N
                g = tl.load(G + r * sG + c, mask=cmask, other=0.0).to(tl.float32)
                x = tl.load(X + r * sX + c, mask=cmask, other=0.0).to(tl.float32)
                xhat = tl.where(cmask, (x - mean) * rstd, 0.0)
                if DO_DX:
                    if HAS_W:
                        wg = g * tl.load(W + c, mask=cmask, other=0.0).to(tl.float32)
                    else:
                        wg = g
                    dx = rstd * (wg - c1 * xhat - c2)
                    if HAS_DS:
                        dx += tl.load(DS + r * sDS + c, mask=cmask, other=0.0).to(tl.float32)
                    tl.store(DX + r * N + c, dx.to(DX.dtype.element_ty), mask=cmask)
                # this program's private workspace row: read-modify-write, no races
                if DO_DW:
                    p = WS_W + ws_off + c
                    tl.store(p, tl.load(p, mask=cmask, other=0.0) + g * xhat, mask=cmask)
                if DO_DB:
                    p = WS_B + ws_off + c
                    tl.store(p, tl.load(p, mask=cmask, other=0.0) + g, mask=cmask)


@kernel
@triton.jit
def layer_norm_bwd_colsum(WS_W, WS_B, DW, DB, P, N, DO_DW: tl.constexpr, DO_DB: tl.constexpr,
                          BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """dw[n] = sum_p WS_W[p, n] (DO_DW), db[n] = sum_p WS_B[p, n] (DO_DB): the backward's workspace
    rows summed per column in fp32, stored in dw / db's dtypes, both in one launch.
    Bytes: P * N * 4 read and N * itemsize written per gradient."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    rows = tl.arange(0, BLOCK_P)
    aw = tl.zeros([BLOCK_P, BLOCK_N], tl.float32)
    ab = tl.zeros([BLOCK_P, BLOCK_N], tl.float32)
    for p0 in range(0, P, BLOCK_P):
        r = p0 + rows
        m = (r < P)[:, None] & cmask[None, :]
        off = r.to(tl.int64)[:, None] * N + cols[None, :]
        if DO_DW:
            aw += tl.load(WS_W + off, mask=m, other=0.0)
        if DO_DB:
            ab += tl.load(WS_B + off, mask=m, other=0.0)
    if DO_DW:
        tl.store(DW + cols, tl.sum(aw, 0).to(DW.dtype.element_ty), mask=cmask)
    if DO_DB:
        tl.store(DB + cols, tl.sum(ab, 0).to(DB.dtype.element_ty), mask=cmask)


def _split(x, normalized_shape):
    """(M, N) of a layer norm over the trailing `normalized_shape`; mismatches are ATen's to report."""
    ns = [int(s) for s in normalized_shape]
    k = len(ns)
    if k == 0 or x.dim() < k or list(x.shape[x.dim() - k:]) != ns:
        raise Unsupported("normalized_shape does not match the input")
    N = 1
    for s in ns:
        N *= s
    return x.numel() // N if N else 0, N, x.dim() - k


def _stat_dtype(x):
    if x.device.type == "cuda" and x.dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return x.dtype


def _check_param(p, ns, x, what):
    if p is None:
        return
    if list(p.shape) != [int(s) for s in ns]:
        raise Unsupported(f"{what} shape differs from normalized_shape")
    if p.dtype != x.dtype:
        raise Unsupported(f"{what} dtype differs from the input")  # ATen's mixed-dtype paths
    if p.device != x.device:
        raise Unsupported(f"{what} on another device")


@functools.lru_cache(maxsize=1024)
def _fwd_geometry(M, N, smax, has_res, has_w, has_b, int64_from):
    """(grid, constexprs, num_warps) of the forward: pure ints, cached off the host path."""
    cfg = _cfg()
    block_n = next_pow2(N)
    single = int(block_n <= cfg["max_n"])
    if single:
        block_m = min(next_pow2(M), max(1, cfg["tile"] // block_n))
    else:
        block_n, block_m = cfg["max_n"], 1
    big = int(M * max(smax, N) >= int64_from)
    consts = (int(has_res), int(has_w), int(has_b), single, big, block_m, block_n)
    return (cdiv(M, block_m),), consts, _warps(block_m * block_n)


def forward_rows(xv, sx, w, b, y, mean, rstd, M, N, eps, rv=None, sr=0, s=None):
    """One forward launch over M rows of N: xv (and the residual rv) row-strided with unit column stride
    (`runtime.utils.as_rows`), w/b contiguous or None, y (and s, the new residual) contiguous,
    mean/rstd of M elements.
    Shared by native_layer_norm and gems.fused.layer_norm / add_layer_norm (rv, s given)."""
    grid, consts, nw = _fwd_geometry(M, N, max(sx, sr), rv is not None, w is not None, b is not None,
                                     _INT64_FROM)
    layer_norm_fwd[grid](xv, rv, w, b, y, s, mean, rstd, M, N, sx, sr, float(eps), *consts, num_warps=nw)


def backward_rows(gv, sg, xv, sx, w, mean, rstd, dx, dw, db, M, N, device, dsv=None, sds=0):
    """One backward launch (+ the column sums of dw/db) over M rows of N, layouts as in forward_rows;
    dx/dw/db None where not wanted; dsv: a gradient added to dx (gems.fused.add_layer_norm's residual)."""
    do_dx, do_dw, do_db = dx is not None, dw is not None, db is not None
    cfg = _cfg()
    block_n = next_pow2(N)
    single = int(block_n <= cfg["max_n"])
    if not single:
        block_n = cfg["max_n"]
    P, rows = _bwd_programs(M, do_dw or do_db, device)
    ws_alloc = empty if single else zeros
    ws = ws_alloc((int(do_dw) + int(do_db), P, N), torch.float32, device) if do_dw or do_db else None
    ws_w = ws[0] if do_dw else None
    ws_b = ws[int(do_dw)] if do_db else None
    big = int(max(M * max(sg, sx, sds, N), P * N) >= _INT64_FROM)
    consts = (int(w is not None), int(dsv is not None), int(do_dx), int(do_dw), int(do_db), single, big, block_n)
    layer_norm_bwd[(P,)](
        gv, dsv, xv, w, mean, rstd, dx, ws_w, ws_b, M, N, sg, sds, sx, rows, *consts,
        num_warps=_warps(block_n, "bwd_elems_per_warp"))
    if ws is not None:
        # column sums of the [P, N] workspaces, straight into dw / db in their dtypes
        bn = min(next_pow2(N), cfg["colsum_n"])
        layer_norm_bwd_colsum[(cdiv(N, bn),)](ws_w, ws_b, dw, db, P, N, do_dw, do_db, cfg["colsum_p"], bn,
                                              num_warps=4)


def _forward(x, normalized_shape, weight, bias, eps, outs=(None, None, None)):
    M, N, axis = _split(x, normalized_shape)
    if N == 0:
        raise Unsupported("empty normalized_shape")
    _check_param(weight, normalized_shape, x, "weight")
    _check_param(bias, normalized_shape, x, "bias")
    stat_shape = list(x.shape[:axis]) + [1] * (x.dim() - axis)
    sd = _stat_dtype(x)
    y = prepare_out(outs[0], x.shape, x.dtype, x.device)
    mean = prepare_out(outs[1], stat_shape, sd, x.device)
    rstd = prepare_out(outs[2], stat_shape, sd, x.device)
    if M == 0:
        return y, mean, rstd
    xv, sx = as_rows(x, M, N)
    forward_rows(xv, sx, weight.contiguous() if weight is not None else None,
                 bias.contiguous() if bias is not None else None, y, mean, rstd, M, N, eps)
    return y, mean, rstd


@register("native_layer_norm", "native_layer_norm.out", category="norm", dtypes=FLOATS)
def native_layer_norm(x, normalized_shape, weight, bias, eps, *, out0=None, out1=None, out2=None):
    """Layer norm with the row in registers: fp32 statistics, one read of x and one write of y."""
    return _forward(x, normalized_shape, weight, bias, eps, (out0, out1, out2))


def _bwd_programs(M, need_ws, device):
    cfg = _cfg()
    if "programs" in cfg:
        target = cfg["programs"]
    elif need_ws:
        target = cfg["bwd_programs_per_sm"] * sm_count(device)
    else:
        target = M  # dx only: one row per program
    rows = cdiv(M, max(1, min(target, M)))
    return cdiv(M, rows), rows


@register("native_layer_norm_backward", "native_layer_norm_backward.out", category="norm", dtypes=FLOATS,
          backward=True)
def native_layer_norm_backward(grad_out, x, normalized_shape, mean, rstd, weight, bias, output_mask, *,
                               out0=None, out1=None, out2=None):
    """dx per row in one pass; dw/db from per-program fp32 partial sums and a column-sum (no atomics)."""
    do_dx, do_dw, do_db = (bool(v) for v in output_mask)
    if any(o is not None and not m for o, m in zip((out0, out1, out2), (do_dx, do_dw, do_db))):
        raise Unsupported("out tensor for a masked-out gradient")  # ATen rejects it
    M, N, axis = _split(x, normalized_shape)
    if N == 0:
        raise Unsupported("empty normalized_shape")
    if tuple(grad_out.shape) != tuple(x.shape):
        raise Unsupported("grad_out shape differs from the input")
    if grad_out.dtype != x.dtype:
        raise Unsupported("grad_out dtype differs from the input")
    _check_param(weight, normalized_shape, x, "weight")
    _check_param(bias, normalized_shape, x, "bias")
    if (do_dw and weight is None) or (do_db and bias is None):
        raise Unsupported("gradient of an absent weight/bias")  # ATen decides (it raises)
    if mean.numel() != M or rstd.numel() != M:
        raise Unsupported("mean/rstd numel differs from the number of rows")
    dx = prepare_out(out0, x.shape, x.dtype, x.device) if do_dx else out0
    dw = prepare_out(out1, weight.shape, weight.dtype, x.device) if do_dw else out1
    db = prepare_out(out2, bias.shape, bias.dtype, x.device) if do_db else out2
    if M == 0:
        if do_dw:
            dw.zero_()
        if do_db:
            db.zero_()
        return dx, dw, db
    if not (do_dx or do_dw or do_db):
        return dx, dw, db
    gv, sg = as_rows(grad_out, M, N)
    xv, sx = as_rows(x, M, N)
    backward_rows(gv, sg, xv, sx, weight.contiguous() if weight is not None else None, mean.reshape(-1),
                  rstd.reshape(-1), dx if do_dx else None, dw if do_dw else None, db if do_db else None,
                  M, N, x.device)
    return dx, dw, db
