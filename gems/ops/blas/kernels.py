"""The pointer GEMM's kernels (matmul.py launches them): one tiled matmul with a batch axis, a K split and the
fused bias epilogue, and the fixed-order reduce of a K split's fp32 partials.

    C[b] = alpha * (A[b] @ B[b]) + beta * bias        (bias broadcast to (M, N) by its strides)

Every operand is addressed through its own strides (a stride equal to 1 is specialized by Triton, so the
inner dimension of either layout is loaded with 16-byte vectors); products accumulate in fp32.
"""
import triton
import triton.language as tl

from ...runtime import kernel
from .epilogue import scale_add_bias


@kernel
@triton.jit
def matmul_kernel(A, B, C, Bias, M, N, K, k_per, alpha, beta,
                  s_ab, s_am, s_ak, s_bb, s_bk, s_bn, s_cs, s_cb, s_cm, s_cn, s_xb, s_xm, s_xn,
                  HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, EVEN_K: tl.constexpr, I64: tl.constexpr,
                  SPLIT_K: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """C[b, m, n] = alpha * sum_k A[b, m, k] * B[b, k, n] + beta * Bias[b, m, n]   (fp32 accumulation).

    Program id 0 -> (batch, tile); tiles of one batch are ordered in groups of GROUP_M tile-rows so
    that consecutive programs share B column-panels and A row-panels in L2. Program id 1 -> the K
    split: with SPLIT_K > 1 split s sums k in [s * k_per, (s + 1) * k_per) and stores its raw fp32
    partial at C + s * s_cs (a workspace; `splitk_reduce_kernel` adds the splits and the epilogue).
    """
    pid = tl.program_id(0)
    split = tl.program_id(1)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    tiles = grid_m * grid_n
    batch = pid // tiles
    t = pid % tiles
    per_group = GROUP_M * grid_n
    first_m = (t // per_group) * GROUP_M
    group_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (t % per_group) % group_m
    pid_n = (t % per_group) // group_m

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    if I64:  # some operand spans >= 2**31 elements: element offsets need 64 bits
        rm = rm.to(tl.int64)
        rn = rn.to(tl.int64)
        rk = rk.to(tl.int64)
    b64 = batch.to(tl.int64)
    mask_m = rm < M
    mask_n = rn < N
    k0 = split * k_per          # k_per == K without a split; a multiple of BLOCK_K with one
    k_len = tl.minimum(K - k0, k_per)
    a_ptrs = A + b64 * s_ab + (rm[:, None] * s_am + (k0 + rk[None, :]) * s_ak)
    b_ptrs = B + b64 * s_bb + ((k0 + rk[:, None]) * s_bk + rn[None, :] * s_bn)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # whole K tiles without a K mask: a mask along K (the contiguous axis of a row-major A) would cost
    # the 16-byte vector loads in every iteration (K = 100008, Aquila's vocab, ran 2.5x cuBLAS's time)
    for k in range(0, k_len // BLOCK_K):
        a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
        b = tl.load(b_ptrs, mask=mask_n[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * s_ak
        b_ptrs += BLOCK_K * s_bk
    if not EVEN_K:
        # the K tail, peeled: the only masked iteration (only the last split has one)
        k_left = k_len % BLOCK_K
        if k_left > 0:
            a = tl.load(a_ptrs, mask=mask_m[:, None] & (rk[None, :] < k_left), other=0.0)
            b = tl.load(b_ptrs, mask=(rk[:, None] < k_left) & mask_n[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)

    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K > 1:
        w_ptrs = C + split * s_cs + b64 * s_cb + (rm[:, None] * s_cm + rn[None, :] * s_cn)
        tl.store(w_ptrs, acc, mask=mask)
    else:
        acc = scale_add_bias(acc, alpha, beta, Bias + b64 * s_xb + (rm[:, None] * s_xm + rn[None, :] * s_xn),
                             mask, HAS_BIAS)
        c_ptrs = C + b64 * s_cb + (rm[:, None] * s_cm + rn[None, :] * s_cn)
        tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=mask)


@kernel
@triton.jit
def splitk_reduce_kernel(W, C, Bias, M, N, alpha, beta, s_ws, s_wm, s_cb, s_cm, s_cn, s_xb, s_xm, s_xn,
                         HAS_BIAS: tl.constexpr, I64: tl.constexpr, SPLIT_K: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """C[b, m, n] = alpha * sum_s W[s, b, m, n] + beta * Bias[b, m, n]: the split-K epilogue.

    W is the fp32 workspace [SPLIT_K, batch, M, N] with split stride s_ws and row stride s_wm (N for
    matmul_kernel's; the Gluon kernel's rows are padded to 16 bytes and its splits to whole tiles).
    Bytes: 4 * SPLIT_K read + one result written per element, against the GEMM's K / SPLIT_K operand
    reads per element.
    """
    pid = tl.program_id(0)
    batch = tl.program_id(1)
    grid_n = tl.cdiv(N, BLOCK_N)
    rm = (pid // grid_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (pid % grid_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    if I64:
        rm = rm.to(tl.int64)
        rn = rn.to(tl.int64)
    b64 = batch.to(tl.int64)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    w_ptrs = W + b64 * M * s_wm + (rm[:, None] * s_wm + rn[None, :])
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):   # fixed order: the sum is deterministic
        acc += tl.load(w_ptrs + s * s_ws, mask=mask, other=0.0)
    acc = scale_add_bias(acc, alpha, beta, Bias + b64 * s_xb + (rm[:, None] * s_xm + rn[None, :] * s_xn),
                         mask, HAS_BIAS)
    tl.store(C + b64 * s_cb + (rm[:, None] * s_cm + rn[None, :] * s_cn), acc.to(C.dtype.element_ty), mask=mask)
