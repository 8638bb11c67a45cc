"""The RMSNorm Triton kernels of gems/fused/norms.py (which holds their launch geometry, autograd and
custom operators, and documents the layout, the casting rules and the backward's workspace).
"""
import triton
import triton.language as tl

from ..runtime import kernel


@kernel
@triton.jit
def rms_fwd(X, R, W, Y, S, RSTD, M, N, sX, sR, eps, offset,
             HAS_RES: tl.constexpr, GEMMA: tl.constexpr, SINGLE: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """s = x + r (rounded to x's dtype; HAS_RES), rstd = 1/sqrt(sum(s^2)/N + eps) (fp32, saved),
    llama: y = (w + offset) * round_x(s * rstd);  gemma: y = s * rstd * (offset + w).
    Bytes per element: read x (+ r), write y (+ s); w once per program; 4 bytes of rstd per row."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = (rows < M)[:, None]
    r64 = rows.to(tl.int64)[:, None]
    cols = tl.arange(0, BLOCK_N)[None, :]
    if SINGLE:
        mask = rmask & (cols < N)
        x = tl.load(X + r64 * sX + cols, mask=mask, other=0.0)
        if HAS_RES:
            x = (x.to(tl.float32) + tl.load(R + r64 * sR + cols, mask=mask, other=0.0).to(tl.float32))
            x = x.to(S.dtype.element_ty)
            tl.store(S + r64 * N + cols, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, 1) / N + eps)
        h = xf * rstd[:, None]
        w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32) + offset
        if GEMMA:
            y = h * w
        else:
            y = h.to(X.dtype.element_ty).to(tl.float32) * w
        tl.store(Y + r64 * N + cols, y.to(Y.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for start in range(0, N, BLOCK_N):
            c = cols + start
            mask = rmask & (c < N)
            x = tl.load(X + r64 * sX + c, mask=mask, other=0.0)
            if HAS_RES:
                x = (x.to(tl.float32) + tl.load(R + r64 * sR + c, mask=mask, other=0.0).to(tl.float32))
                x = x.to(S.dtype.element_ty)
                tl.store(S + r64 * N + c, x, mask=mask)
            xf = x.to(tl.float32)
            acc += xf * xf
        rstd = tl.rsqrt(tl.sum(acc, 1) / N + eps)
        if HAS_RES:
            tl.debug_barrier()   # the sums stored above are read back below (by the same threads anyway)
        for start in range(0, N, BLOCK_N):
            c = cols + start
            mask = rmask & (c < N)
            if HAS_RES:   # the rounded sum written above
                xf = tl.load(S + r64 * N + c, mask=mask, other=0.0).to(tl.float32)
            else:
                xf = tl.load(X + r64 * sX + c, mask=mask, other=0.0).to(tl.float32)
            h = xf * rstd[:, None]
            w = tl.load(W + c, mask=c < N, other=0.0).to(tl.float32) + offset
            if GEMMA:
                y = h * w
            else:
                y = h.to(X.dtype.element_ty).to(tl.float32) * w
            tl.store(Y + r64 * N + c, y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=rows < M)


@kernel
@triton.jit
def rms_bwd(DY, DS, X, W, RSTD, DX, WS, M, N, sDY, sDS, sX, rows_per_prog, offset,
             GEMMA: tl.constexpr, HAS_DS: tl.constexpr, DO_DX: tl.constexpr, DO_DW: tl.constexpr,
             SINGLE: tl.constexpr, BLOCK_N: tl.constexpr):
    """h = x * rstd, dh = dy * (w + offset):  dx = rstd * (dh - h * sum(dh * h) / N) (+ ds, the
    gradient of the residual output); WS[program] = sum over its rows of dy * hh, hh = round_x(h)
    (llama) or h (gemma), fp32. Bytes per element: read dy, x (+ ds), write dx; the workspace is
    programs * N * 4 bytes (zeroed by the caller on the looping path)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    row0 = pid * rows_per_prog
    row_end = tl.minimum(M, row0 + rows_per_prog)
    row0_l = row0.to(tl.int64)
    ws_off = pid.to(tl.int64) * N
    if SINGLE:
        cmask = cols < N
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32) + offset
        dw = tl.zeros([BLOCK_N], tl.float32)
        for row in range(row0, row_end):
            r = row0_l + (row - row0)   # int64 row index (a loop variable may be a plain int)
            dy = tl.load(DY + r * sDY + cols, mask=cmask, other=0.0).to(tl.float32)
            x = tl.load(X + r * sX + cols, mask=cmask, other=0.0)
            rstd = tl.load(RSTD + row)
            h = x.to(tl.float32) * rstd
            if DO_DX:
                dh = dy * w
                c = tl.sum(dh * h, 0) / N
                dx = rstd * (dh - h * c)
                if HAS_DS:
                    dx += tl.load(DS + r * sDS + cols, mask=cmask, other=0.0).to(tl.float32)
                tl.store(DX + r * N + cols, dx.to(DX.dtype.element_ty), mask=cmask)
            if DO_DW:
                if GEMMA:
                    dw += dy * h
                else:
                    dw += dy * h.to(X.dtype.element_ty).to(tl.float32)
        if DO_DW:
            tl.store(WS + ws_off + cols, dw, mask=cmask)
    else:
        for row in range(row0, row_end):
            r = row0_l + (row - row0)   # int64 row index (a loop variable may be a plain int)
            rstd = tl.load(RSTD + row)
            if DO_DX:
                acc = tl.zeros([BLOCK_N], tl.float32)
                for start in range(0, N, BLOCK_N):
                    c = cols + start
                    cmask = c < N
                    dy = tl.load(DY + r * sDY + c, mask=cmask, other=0.0).to(tl.float32)
                    h = tl.load(X + r * sX + c, mask=cmask, other=0.0).to(tl.float32) * rstd
                    w = tl.load(W + c, mask=cmask, other=0.0).to(tl.float32) + offset
                    acc += dy * w * h
                s = tl.sum(acc, 0) / N
            for start in range(0, N, BLOCK_N):
                c = cols + start
                cmask = c < N
                dy = tl.load(DY + r * sDY + c, mask=cmask, other=0.0).to(tl.float32)
                x = tl.load(X + r * sX + c, mask=cmask, other=0.0)
                h = x.to(tl.float32) * rstd
                if DO_DX:
                    w = tl.load(W + c, mask=cmask, other=0.0).to(tl.float32) + offset
                    dx = rstd * (dy * w - h * s)
                    if HAS_DS:
                        dx += tl.load(DS + r * sDS + c, mask=cmask, other=0.0).to(tl.float32)
                    tl.store(DX + r * N + c, dx.to(DX.dtype.element_ty), mask=cmask)
                if DO_DW:   # this program's own workspace row: read-modify-write, no races
                    if GEMMA:
                        g = dy * h
                    else:
                        g = dy * h.to(X.dtype.element_ty).to(tl.float32)
                    p = WS + ws_off + c
                    tl.store(p, tl.load(p, mask=cmask, other=0.0) + g, mask=cmask)
