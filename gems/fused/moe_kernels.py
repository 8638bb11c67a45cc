"""The Triton kernels of `gems.fused.moe_experts` (moe.py launches them): routed SwiGLU experts as grouped
GEMMs over token rows sorted by expert.

Rows. The S = T * k (token, slot) pairs are sorted by expert id on the device; row r of the sorted order is
slot `Slot[r]` (= t * k + j), token `Slot[r] // k`. Expert e owns rows [Bounds[e], Bounds[e + 1]).

Tiles. A row tile is BM consecutive rows of one expert. `tile_table_kernel` writes, for every row tile t
of a fixed upper bound grid_m = cdiv(S, BM) + E (an expert's rows need at most cdiv(n_e, BM) tiles), the
triple Table[0, t] = expert, Table[1, t] = first row, Table[2, t] = end row (0, 0, 0 past the last tile:
that program exits at once). So the row-tiled GEMMs launch once over all experts with a grid known on the
host, and read which expert and rows they own from the table: no host sync, no per-expert launch.
Program ids are swizzled in groups of GROUP_M row tiles (consecutive tiles belong to one expert), so the
programs that run together share one expert's weight panel in L2.

Rounding follows the unfused Hugging Face expert loop at the input dtype: gate, up, act(gate), the gated
product and the down projection are each rounded once to the dtype, the routing weight multiplies the
rounded down projection in fp32 and the product is rounded again. Products accumulate in fp32; fp32 inputs
multiply at `PRECISION` ("ieee", or "tf32" when torch allows it).
"""
import triton
import triton.language as tl

from ..codegen.tlmath import sigmoid
from ..runtime import kernel


@kernel
@triton.jit
def tile_table_kernel(Bounds, Table, E, grid_m, BM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr):
    """Table[:, t] = (expert, first row, end row) of row tile t; expert e has cdiv(n_e, BM) tiles, in
    expert order. t is mapped to its expert by counting the experts whose tiles all come before it."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ei = tl.arange(0, BLOCK_E)
    me = ei < E
    lo = tl.load(Bounds + ei, mask=me, other=0)
    hi = tl.load(Bounds + ei + 1, mask=me, other=0)
    tiles = (hi - lo + BM - 1) // BM
    end = tl.cumsum(tiles, 0)
    first = end - tiles
    past = (end[None, :] <= t[:, None]) & me[None, :]
    e = tl.sum(past.to(tl.int32), axis=1)
    sel = ei[None, :] == e[:, None]
    lo_t = tl.sum(tl.where(sel, lo[None, :], 0), axis=1)
    hi_t = tl.sum(tl.where(sel, hi[None, :], 0), axis=1)
    first_t = tl.sum(tl.where(sel, first[None, :], 0), axis=1)
    valid = e < E
    mt = t < grid_m
    tl.store(Table + t, tl.where(valid, e, 0), mask=mt)
    tl.store(Table + grid_m + t, tl.where(valid, lo_t + (t - first_t) * BM, 0), mask=mt)
    tl.store(Table + 2 * grid_m + t, tl.where(valid, hi_t, 0), mask=mt)


@triton.jit
def _swizzle(pid, grid_m, grid_n, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program pid: groups of GROUP_M row tiles, row tile fastest in a group."""
    per_group = GROUP_M * grid_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    return pid_m, pid_n


@triton.jit
def _dot_k(acc, a_ptrs, b_ptrs, mask_m, mask_n, rk, K, step_a, step_b,
           EVEN_K: tl.constexpr, PRECISION: tl.constexpr, BK: tl.constexpr):
    """acc + A[rows, :K] @ B[:K, cols] in BK-deep steps: a_ptrs / b_ptrs address the first step's
    [BM, BK] / [BK, BN] tiles and move by step_a / step_b; rows and columns outside mask_m / mask_n
    (and, unless EVEN_K, the K tail) read zeros."""
    for k0 in range(0, K, BK):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=mask_n[None, :], other=0.0)
        else:
            mk = rk < K - k0
            a = tl.load(a_ptrs, mask=mask_m[:, None] & mk[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=mk[:, None] & mask_n[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += step_a
        b_ptrs += step_b
    return acc


@kernel
@triton.jit
def gate_up_kernel(X, Slot, Table, Wg, Wu, GU, H, grid_m, N, K, topk,
                   s_xt, s_xk, s_ge, s_gn, s_gk, s_ue, s_un, s_uk,
                   STORE_GU: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    """H[r, n] = round(silu(g)) * u, g = round(X[tok(r)] . Wg[e, n, :]), u = round(X[tok(r)] . Wu[e, n, :]):
    the gate and up projections of one row tile as two accumulators, SiLU-and-mul in the epilogue.
    X rows are gathered by token (no permuted copy). With STORE_GU, GU[r] = [g | u] (the backward's input)."""
    pid_m, pid_n = _swizzle(tl.program_id(0), grid_m, tl.cdiv(N, BN), GROUP_M)
    row0 = tl.load(Table + grid_m + pid_m)
    row_end = tl.load(Table + 2 * grid_m + pid_m)
    if row0 >= row_end:
        return
    e = tl.load(Table + pid_m).to(tl.int64)
    rows = row0 + tl.arange(0, BM)
    mask_m = rows < row_end
    tok = tl.load(Slot + rows, mask=mask_m, other=0).to(tl.int64) // topk
    rn = pid_n * BN + tl.arange(0, BN)
    mask_n = rn < N
    rk = tl.arange(0, BK)
    a_ptrs = X + tok[:, None] * s_xt + rk[None, :] * s_xk
    g_ptrs = Wg + e * s_ge + rn[None, :].to(tl.int64) * s_gn + rk[:, None] * s_gk
    u_ptrs = Wu + e * s_ue + rn[None, :].to(tl.int64) * s_un + rk[:, None] * s_uk
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
            bg = tl.load(g_ptrs, mask=mask_n[None, :], other=0.0)
            bu = tl.load(u_ptrs, mask=mask_n[None, :], other=0.0)
        else:
            mk = rk < K - k0
            a = tl.load(a_ptrs, mask=mask_m[:, None] & mk[None, :], other=0.0)
            bg = tl.load(g_ptrs, mask=mk[:, None] & mask_n[None, :], other=0.0)
            bu = tl.load(u_ptrs, mask=mk[:, None] & mask_n[None, :], other=0.0)
        acc_g = tl.dot(a, bg, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, bu, acc_u, input_precision=PRECISION)
        a_ptrs += BK * s_xk
        g_ptrs += BK * s_gk
        u_ptrs += BK * s_uk
    dt = H.dtype.element_ty
    g = acc_g.to(dt)
    u = acc_u.to(dt)
    mask = mask_m[:, None] & mask_n[None, :]
    r64 = rows.to(tl.int64)
    if STORE_GU:
        gu_ptrs = GU + r64[:, None] * (2 * N) + rn[None, :]
        tl.store(gu_ptrs, g, mask=mask)
        tl.store(gu_ptrs + N, u, mask=mask)
    gf = g.to(tl.float32)
    act = (gf * sigmoid(gf)).to(dt).to(tl.float32)
    tl.store(H + r64[:, None] * N + rn[None, :], (act * u.to(tl.float32)).to(dt), mask=mask)


@kernel
@triton.jit
def rows_mm_kernel(A, B1, B2, Wt, Slot, Table, Out, grid_m, N, K,
                   s_am, s_ak, s_be, s_bk, s_bn, s_ce, s_ck, s_cn, s_om,
                   TWO: tl.constexpr, SCALE: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    """Out[Slot[r], n] = sum_k A[r, k] B1[e, k, n]  (+ sum_k A[r, K + k] B2[e, k, n] with TWO), rounded to
    Out's dtype; with SCALE the rounded value times Wt[Slot[r]] in fp32, rounded again. Rows are written at
    their slot (token-major order), so the combine over a token's k slots is a sum of adjacent rows.
    Forward down projection: A = H, B1 = down_proj[e]^T, SCALE. Backward dX: A = [dgate | dup],
    B1 = gate weights, B2 = up weights."""
    pid_m, pid_n = _swizzle(tl.program_id(0), grid_m, tl.cdiv(N, BN), GROUP_M)
    row0 = tl.load(Table + grid_m + pid_m)
    row_end = tl.load(Table + 2 * grid_m + pid_m)
    if row0 >= row_end:
        return
    e = tl.load(Table + pid_m).to(tl.int64)
    rows = row0 + tl.arange(0, BM)
    mask_m = rows < row_end
    r64 = rows.to(tl.int64)
    rn = pid_n * BN + tl.arange(0, BN)
    mask_n = rn < N
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for part in tl.static_range(2 if TWO else 1):
        if part == 0:
            a_ptrs = A + r64[:, None] * s_am + rk[None, :] * s_ak
            b_ptrs = B1 + e * s_be + rk[:, None] * s_bk + rn[None, :].to(tl.int64) * s_bn
            sk = s_bk
        else:
            a_ptrs = A + r64[:, None] * s_am + (K + rk[None, :]) * s_ak
            b_ptrs = B2 + e * s_ce + rk[:, None] * s_ck + rn[None, :].to(tl.int64) * s_cn
            sk = s_ck
        acc = _dot_k(acc, a_ptrs, b_ptrs, mask_m, mask_n, rk, K, BK * s_ak, BK * sk, EVEN_K, PRECISION, BK)
    dt = Out.dtype.element_ty
    slot = tl.load(Slot + rows, mask=mask_m, other=0).to(tl.int64)
    y = acc.to(dt)
    if SCALE:
        w = tl.load(Wt + slot, mask=mask_m, other=0.0).to(tl.float32)
        y = (y.to(tl.float32) * w[:, None]).to(dt)
    tl.store(Out + slot[:, None] * s_om + rn[None, :], y, mask=mask_m[:, None] & mask_n[None, :])


@kernel
@triton.jit
def down_bwd_kernel(DY, Slot, Table, Wd, Wt, H, GU, DGU, DWP, grid_m, N, K, topk, S,
                    s_dt, s_dk, s_de, s_dh, s_di,
                    DO_DGU: tl.constexpr, DO_DW: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    """Backward through the down projection, the routing weight and SiLU-and-mul, for one row tile:
        p = DY[tok(r)] @ down_proj[e]          (the gradient of H before the routing weight)
        DWP[column tile, Slot[r]] = sum_n p * H[r, n]   (this tile's share of d topk_weight)
        dh = w * p;  dgate = dh * u * silu'(g),  dup = dh * round(silu(g))   -> DGU[r] = [dgate | dup]
    DY rows are gathered by token. sum_n p H = DY[tok] . (H @ down_proj[e]^T): the routing weight's gradient
    without keeping the down projection's output."""
    grid_n = tl.cdiv(N, BN)
    pid_m, pid_n = _swizzle(tl.program_id(0), grid_m, grid_n, GROUP_M)
    row0 = tl.load(Table + grid_m + pid_m)
    row_end = tl.load(Table + 2 * grid_m + pid_m)
    if row0 >= row_end:
        return
    e = tl.load(Table + pid_m).to(tl.int64)
    rows = row0 + tl.arange(0, BM)
    mask_m = rows < row_end
    r64 = rows.to(tl.int64)
    slot = tl.load(Slot + rows, mask=mask_m, other=0).to(tl.int64)
    tok = slot // topk
    rn = pid_n * BN + tl.arange(0, BN)
    mask_n = rn < N
    rk = tl.arange(0, BK)
    a_ptrs = DY + tok[:, None] * s_dt + rk[None, :] * s_dk
    b_ptrs = Wd + e * s_de + rk[:, None].to(tl.int64) * s_dh + rn[None, :] * s_di
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc = _dot_k(acc, a_ptrs, b_ptrs, mask_m, mask_n, rk, K, BK * s_dk, BK * s_dh, EVEN_K, PRECISION, BK)
    mask = mask_m[:, None] & mask_n[None, :]
    if DO_DW:
        h = tl.load(H + r64[:, None] * N + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(DWP + pid_n.to(tl.int64) * S + slot, tl.sum(acc * h, axis=1), mask=mask_m)
    if DO_DGU:
        dt = DGU.dtype.element_ty
        w = tl.load(Wt + slot, mask=mask_m, other=0.0).to(tl.float32)
        dh = acc * w[:, None]
        gu_ptrs = GU + r64[:, None] * (2 * N) + rn[None, :]
        g = tl.load(gu_ptrs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptrs + N, mask=mask, other=0.0).to(tl.float32)
        s = sigmoid(g)
        act = (g * s).to(dt).to(tl.float32)
        dg = dh * u * (s * (1.0 + g * (1.0 - s)))
        d_ptrs = DGU + r64[:, None] * (2 * N) + rn[None, :]
        tl.store(d_ptrs, dg.to(dt), mask=mask)
        tl.store(d_ptrs + N, (dh * act).to(dt), mask=mask)


@kernel
@triton.jit
def wgrad_kernel(A, B, Wt, Slot, Bounds, DW, M, N, topk,
                 s_ar, s_am, s_br, s_bn, s_we, s_wm, s_wn,
                 GATHER_A: tl.constexpr, GATHER_B: tl.constexpr, SCALE: tl.constexpr, PRECISION: tl.constexpr,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """DW[e, m, n] = sum over expert e's rows r of A[ra, m] * B[rb, n] (A's row times Wt[Slot[r]] with
    SCALE, rounded to the input dtype as the unfused backward rounds the weighted gradient), ra / rb the
    token of row r when gathered, else r. One program per (expert, m tile, n tile); the reduction runs over
    the expert's rows, so an expert without rows writes zeros.
    Gate/up weights: A = [dgate | dup] (M = 2I), B = X by token. Down weights: A = DY by token, scaled by
    the routing weight (M = h), B = H (N = I)."""
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BM)
    grid_n = tl.cdiv(N, BN)
    per_e = grid_m * grid_n
    e = pid // per_e
    t = pid % per_e
    pid_m = t // grid_n
    pid_n = t % grid_n
    start = tl.load(Bounds + e)
    end = tl.load(Bounds + e + 1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    mask_m = rm < M
    mask_n = rn < N
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for r0 in range(start, end, BK):
        rows = r0 + rk
        mr = rows < end
        slot = tl.load(Slot + rows, mask=mr, other=0).to(tl.int64)
        ra = slot // topk if GATHER_A else rows.to(tl.int64)
        rb = slot // topk if GATHER_B else rows.to(tl.int64)
        a = tl.load(A + ra[None, :] * s_ar + rm[:, None] * s_am, mask=mask_m[:, None] & mr[None, :], other=0.0)
        if SCALE:
            w = tl.load(Wt + slot, mask=mr, other=0.0).to(tl.float32)
            a = (a.to(tl.float32) * w[None, :]).to(A.dtype.element_ty)
        b = tl.load(B + rb[:, None] * s_br + rn[None, :] * s_bn, mask=mr[:, None] & mask_n[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    e64 = e.to(tl.int64)
    tl.store(DW + e64 * s_we + rm[:, None].to(tl.int64) * s_wm + rn[None, :] * s_wn, acc.to(DW.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])
