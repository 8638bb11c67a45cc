"""A persistent Hopper GEMM written in Gluon (Triton's explicit-layout language): TMA loads into a ring
of shared-memory buffers guarded by mbarriers, asynchronous warpgroup MMAs (wgmma) with one in flight,
and the output tile stored by TMA while the next tile's first loads are already on their way.

C = alpha * (A @ B) + beta * Bias        (A: M x K, B: K x N, C: M x N row-major; one matrix, no batch)

Why a second TMA kernel: Triton's compiler (gemm_tma.py) decides the pipeline itself and ran the models'
large GEMMs at 1.04-1.14x cuBLAS's time; here the schedule is written out, as cuBLAS's Hopper kernels
do it. Per K step the TMA unit moves (BM + BN) x BK x 2 bytes; the MMA of step k overlaps the loads
of steps k + 1 .. k + NUM_BUF - 1 and the wait for MMA k - 1 (`warpgroup_mma_wait(1)`), after which
its buffers are refilled.

Same contract as gemm_tma: Hopper, 16-bit operands with one unit stride and 16-byte aligned base and
leading strides (`gemm_tma.layout`), a row-major 16-bit result. Host descriptors: the Python path only
(no call plan), so the tuner offers it only to problems whose device time covers that.
"""
import functools

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..runtime import kernel
from ..runtime.utils import cdiv, sm_count


@gluon.constexpr_function
def _mma_layout(BLOCK_M, BLOCK_N, num_warps):
    """The wgmma accumulator layout: warps stacked along M (16 rows per warp, 4 warps per warpgroup)
    while the tile has rows for them, then along N; the widest instruction N that divides the tile."""
    warps = [4, 1]
    while warps[0] * warps[1] < num_warps:
        if BLOCK_M > 16 * warps[0]:
            warps[0] *= 2
        else:
            warps[1] *= 2
    n = min(256, BLOCK_N // warps[1])
    while BLOCK_N % n:
        n -= 8
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=warps, instr_shape=[16, n, 16])


@gluon.jit
def _issue_load(a_desc, b_desc, a_bufs, b_bufs, bars, count, off_m, off_n, off_k, pred,
                A_T: gl.constexpr, B_T: gl.constexpr, NUM_BUF: gl.constexpr):
    """TMA loads of one K step into ring slot count % NUM_BUF (its barrier counts the bytes)."""
    s = count % NUM_BUF
    bar = bars.index(s)
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=pred)
    if A_T:
        tma.async_copy_global_to_shared(a_desc, [off_k, off_m], bar, a_bufs.index(s), pred)
    else:
        tma.async_copy_global_to_shared(a_desc, [off_m, off_k], bar, a_bufs.index(s), pred)
    if B_T:
        tma.async_copy_global_to_shared(b_desc, [off_n, off_k], bar, b_bufs.index(s), pred)
    else:
        tma.async_copy_global_to_shared(b_desc, [off_k, off_n], bar, b_bufs.index(s), pred)


@gluon.jit
def _tile_offsets(tile, grid_m, grid_n, GROUP_M: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Grouped tile order (as blas.matmul_kernel): GROUP_M row-tiles per column-tile, for L2 reuse."""
    per_group = GROUP_M * grid_n
    first_m = (tile // per_group) * GROUP_M
    group_m = gl.minimum(grid_m - first_m, GROUP_M)
    return (first_m + (tile % per_group) % group_m) * BLOCK_M, ((tile % per_group) // group_m) * BLOCK_N


@kernel
@gluon.jit
def matmul_gluon_kernel(a_desc, b_desc, c_desc, Bias, M, N, K, alpha, beta, s_xn,
                        A_T: gl.constexpr, B_T: gl.constexpr, HAS_BIAS: gl.constexpr, GROUP_M: gl.constexpr,
                        NUM_BUF: gl.constexpr):
    """Program p computes output tiles p, p + programs, ... with fp32 accumulation;
    C[tile] = alpha * sum_k A[m, k] B[k, n] + beta * Bias[n]   (a bias row: `launch` takes no other).

    Counters `loads` / `used` run over the program's whole life (ring slot = count % NUM_BUF, barrier
    phase = (count // NUM_BUF) & 1); a load predicated off (past K) is not counted, so both agree at
    every tile's end. A_T / B_T: the operand is read through a descriptor of its transpose (its rows
    are the contiguous axis) and handed to wgmma as a permuted shared-memory view."""
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[0 if A_T else 1]
    layout: gl.constexpr = _mma_layout(BLOCK_M, BLOCK_N, gl.num_warps())

    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_BUF] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NUM_BUF] + b_desc.block_type.shape, b_desc.layout)
    c_smem = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(bars.index(i), count=1)

    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    grid_m = gl.cdiv(M, BLOCK_M)
    grid_n = gl.cdiv(N, BLOCK_N)
    tiles = grid_m * grid_n
    k_steps = gl.cdiv(K, BLOCK_K)
    loads = 0
    used = 0

    # the first tile's first NUM_BUF - 1 K steps
    off_m, off_n = _tile_offsets(pid, grid_m, grid_n, GROUP_M, BLOCK_M, BLOCK_N)
    for i in gl.static_range(NUM_BUF - 1):
        p = (i < k_steps) & (pid < tiles)
        _issue_load(a_desc, b_desc, a_bufs, b_bufs, bars, loads, off_m, off_n, i * BLOCK_K, p, A_T, B_T, NUM_BUF)
        loads += p.to(gl.int32)

    for tile in range(pid, tiles, programs):
        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=layout)
        for ks in range(k_steps):
            s = used % NUM_BUF
            mbarrier.wait(bars.index(s), (used // NUM_BUF) & 1)
            if A_T:
                a = a_bufs.index(s).permute((1, 0))
            else:
                a = a_bufs.index(s)
            if B_T:
                b = b_bufs.index(s).permute((1, 0))
            else:
                b = b_bufs.index(s)
            acc = warpgroup_mma(a, b, acc, is_async=True)
            # MMA ks - 1 is complete after this: its slot takes the load of step ks + NUM_BUF - 1
            acc, _, _ = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a, b))
            used += 1
            nk = ks + NUM_BUF - 1
            p = nk < k_steps
            _issue_load(a_desc, b_desc, a_bufs, b_bufs, bars, loads, off_m, off_n, nk * BLOCK_K, p, A_T, B_T,
                        NUM_BUF)
            loads += p.to(gl.int32)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))

        # the next tile's first loads go out before this tile's epilogue
        next_m, next_n = _tile_offsets(tile + programs, grid_m, grid_n, GROUP_M, BLOCK_M, BLOCK_N)
        for i in gl.static_range(NUM_BUF - 1):
            p = (i < k_steps) & (tile + programs < tiles)
            _issue_load(a_desc, b_desc, a_bufs, b_bufs, bars, loads, next_m, next_n, i * BLOCK_K, p, A_T, B_T,
                        NUM_BUF)
            loads += p.to(gl.int32)

        acc = acc * alpha
        if HAS_BIAS:
            # a bias row (linear's; stride 0 along M): one vector per tile, broadcast over the rows. A
            # [BM, BN] tile of bias pointers would take 128 of the 255 registers per thread and spill
            rn = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
            x = gl.load(Bias + rn * s_xn, mask=rn < N, other=0.0)
            acc = acc + beta * x.to(gl.float32)[None, :]
        # the previous tile's store must have read c_smem before it is overwritten
        tma.store_wait(pendings=0)
        c_smem.store(acc.to(c_desc.dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [off_m, off_n], c_smem)
        off_m = next_m
        off_n = next_n
    tma.store_wait(pendings=0)
    for i in gl.static_range(NUM_BUF):
        mbarrier.invalidate(bars.index(i))


@functools.lru_cache(maxsize=None)
def _smem_layout(block, bits):
    dtype = gl.bfloat16 if bits == "bf16" else gl.float16
    return gl.NVMMASharedLayout.get_default_for(list(block), dtype)


def _desc(t, shape, lead, block):
    dt = "bf16" if str(t.dtype) == "torch.bfloat16" else "fp16"
    return TensorDescriptor(t, shape, [lead, 1], list(block), _smem_layout(tuple(block), dt))


def supports(bias, has_bias):
    """Whether `launch` takes this bias: none, or one row broadcast over M (stride 0 along M)."""
    return not has_bias or bias.stride(0) == 0 or bias.shape[0] == 1


def launch(a, b, c, bias, alpha, beta, has_bias, layouts, cfg):
    """c = alpha * a @ b (+ beta * bias row) with `cfg` (BLOCK_M/N/K, GROUP_M, NUM_BUF, warps); `layouts`
    from gemm_tma.layout (the same operand conditions), the bias as `supports` says."""
    (a_t, s_a), (b_t, s_b) = layouts
    M, K = a.shape
    N = b.shape[1]
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    ad = _desc(a, [K, M], s_a, [bk, bm]) if a_t else _desc(a, [M, K], s_a, [bm, bk])
    bd = _desc(b, [N, K], s_b, [bn, bk]) if b_t else _desc(b, [K, N], s_b, [bk, bn])
    cd = _desc(c, [M, N], max(c.stride(0), N), [bm, bn])
    progs = min(cdiv(M, bm) * cdiv(N, bn), sm_count(a.device))
    xn = bias.stride(1) if has_bias else 0
    matmul_gluon_kernel[(progs,)](ad, bd, cd, bias, M, N, K, float(alpha), float(beta), xn,
                                  a_t, b_t, has_bias, cfg["GROUP_M"], cfg["NUM_BUF"], num_warps=cfg["num_warps"],
                                  num_stages=1)
