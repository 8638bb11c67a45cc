"""A persistent, warp-specialized Hopper GEMM written in Gluon (Triton's explicit-layout language): one
warp issues TMA loads into a ring of shared-memory slots, the kernel's warpgroups run asynchronous
warpgroup MMAs (wgmma, one in flight) and the epilogue, mbarriers hand the slots back and forth, and each
output tile leaves by a TMA store that overlaps the next tile's MMAs.

C = alpha * (A @ B) + beta * Bias        (A: M x K, B: K x N, C: M x N row-major; one matrix, no batch)

Why a second TMA kernel: Triton's compiler (tma.py) schedules one instruction stream for loads and
MMAs, and ran the models' large GEMMs at 1.00-1.08x cuBLAS's device time. cuBLAS's Hopper kernels split
producer and consumer warps; written out here the same way, the models' 39 GEMMs of >= 2**33
multiply-adds ran at a geometric mean of 1.045x cuBLAS's device time (0.92-1.04x on the large ones),
against 1.097x for the same kernel software-pipelined in one partition (H200, bf16, CUDA-graph timing
after an L2 flush). Per K step the TMA unit moves (BM + BN) x BK x 2 bytes into a slot.

Same contract as gemm_tma: Hopper, 16-bit operands with one unit stride and 16-byte aligned base and
leading strides (`gemm_tma.layout`), a row-major 16-bit result, and at most a bias row. Host descriptors,
built per call on the Python path; a repeat call replays its call plan (runtime/plan.py: the C++ recipe
encodes the descriptors once and puts in each call's addresses), 8-12 us of host per call.
"""
import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ...runtime import kernel
from ...runtime.utils import cdiv, sm_count
from . import tma as gemm_tma

# registers per thread of the load warp (it holds a few scalars); the MMA warpgroups get the rest of the
# launch's cap (`maxnreg` in the configs: (num_warps + 4) x 32 threads x maxnreg <= 65536, the load warp
# counting as a warpgroup)
LOAD_REGS = gl.constexpr(40)


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
def _issue_load(a_desc, b_desc, b2_desc, a_bufs, b_bufs, b2_bufs, bars, count, off_m, off_n, off_k, pred,
                A_T: gl.constexpr, B_T: gl.constexpr, NUM_BUF: gl.constexpr, SPLIT: gl.constexpr):
    """TMA loads of one K step into ring slot count % NUM_BUF (its barrier counts the bytes). SPLIT: the
    tile's columns come in two parts, B's second part (b2_desc's block) from column off_n + BN1."""
    s = count % NUM_BUF
    bar = bars.index(s)
    nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes + (
        b2_desc.block_type.nbytes if SPLIT else 0)
    mbarrier.expect(bar, nbytes, pred=pred)
    if A_T:
        tma.async_copy_global_to_shared(a_desc, [off_k, off_m], bar, a_bufs.index(s), pred)
    else:
        tma.async_copy_global_to_shared(a_desc, [off_m, off_k], bar, a_bufs.index(s), pred)
    BN1: gl.constexpr = b_desc.block_type.shape[0 if B_T else 1]
    if B_T:
        tma.async_copy_global_to_shared(b_desc, [off_n, off_k], bar, b_bufs.index(s), pred)
        if SPLIT:
            tma.async_copy_global_to_shared(b2_desc, [off_n + BN1, off_k], bar, b2_bufs.index(s), pred)
    else:
        tma.async_copy_global_to_shared(b_desc, [off_k, off_n], bar, b_bufs.index(s), pred)
        if SPLIT:
            tma.async_copy_global_to_shared(b2_desc, [off_k, off_n + BN1], bar, b2_bufs.index(s), pred)


@gluon.jit
def _tile_offsets(tile, grid_m, grid_n, GROUP_M: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Grouped tile order (as kernels.matmul_kernel): GROUP_M row-tiles per column-tile, for L2 reuse."""
    per_group = GROUP_M * grid_n
    first_m = (tile // per_group) * GROUP_M
    group_m = gl.minimum(grid_m - first_m, GROUP_M)
    return (first_m + (tile % per_group) % group_m) * BLOCK_M, ((tile % per_group) // group_m) * BLOCK_N


@gluon.jit
def _schedule(M, N, K, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr):
    """(program, programs, tile rows, tile columns, K steps): both partitions walk tiles program,
    program + programs, ... and every K step of each, in the same order."""
    return gl.program_id(0), gl.num_programs(0), gl.cdiv(M, BLOCK_M), gl.cdiv(N, BLOCK_N), gl.cdiv(K, BLOCK_K)


@gluon.jit
def _items(grid_m, grid_n, splits, K_SPLIT: gl.constexpr):
    """Work items: the output tiles, times `splits` K ranges each with K_SPLIT."""
    if K_SPLIT:
        return grid_m * grid_n * splits
    else:
        return grid_m * grid_n


@gluon.jit
def _item(item, grid_m, grid_n, k_steps, k_per, K_SPLIT: gl.constexpr):
    """(tile, K range index, first K step, end K step) of a work item: K range r of every tile comes
    before range r + 1's (the programs running together share operand rows and columns, as unsplit)."""
    if K_SPLIT:
        r = item // (grid_m * grid_n)
        return item % (grid_m * grid_n), r, r * k_per, gl.minimum(k_steps, (r + 1) * k_per)
    else:
        return item, 0, 0, k_steps


@gluon.jit
def _load_partition(a_desc, b_desc, b2_desc, a_bufs, b_bufs, b2_bufs, ready, empty, M, N, K, splits, k_per,
                    A_T: gl.constexpr, B_T: gl.constexpr, GROUP_M: gl.constexpr, NUM_BUF: gl.constexpr,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, SPLIT: gl.constexpr,
                    K_SPLIT: gl.constexpr):
    """One warp: walks the program's work items (tiles, or with K_SPLIT tiles x K ranges) and their K
    steps, and for step `count` waits until the MMA partition has released ring slot count % NUM_BUF
    (`empty`), then issues its TMA loads (`ready` counts the bytes). It runs ahead into the next item
    while the MMA warps finish this one."""
    pid, programs, grid_m, grid_n, k_steps = _schedule(M, N, K, BLOCK_M, BLOCK_N, BLOCK_K)
    count = 0
    for item in range(pid, _items(grid_m, grid_n, splits, K_SPLIT), programs):
        tile, r, k_lo, k_hi = _item(item, grid_m, grid_n, k_steps, k_per, K_SPLIT)
        off_m, off_n = _tile_offsets(tile, grid_m, grid_n, GROUP_M, BLOCK_M, BLOCK_N)
        for ks in range(k_lo, k_hi):
            # a fresh barrier counts as released in phase 1: the first NUM_BUF loads do not wait
            mbarrier.wait(empty.index(count % NUM_BUF), ((count // NUM_BUF) & 1) ^ 1)
            _issue_load(a_desc, b_desc, b2_desc, a_bufs, b_bufs, b2_bufs, ready, count, off_m, off_n, ks * BLOCK_K,
                        True, A_T, B_T, NUM_BUF, SPLIT)
            count += 1


@gluon.jit
def _epilogue(acc, c_desc, c_smem, Bias, off_m, off_n, N, alpha, beta, s_xn, HAS_BIAS: gl.constexpr):
    """alpha, the bias row and the cast of one accumulator, stored by TMA from `c_smem` (free: the
    caller waited for the previous tile's stores)."""
    layout: gl.constexpr = acc.type.layout
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    acc = acc * alpha
    if HAS_BIAS:
        # a bias row (linear's; stride 0 along M): one vector per tile, broadcast over the rows. A
        # [BM, BN] tile of bias pointers would take 128 registers per thread and spill
        rn = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        x = gl.load(Bias + rn * s_xn, mask=rn < N, other=0.0)
        acc = acc + beta * x.to(gl.float32)[None, :]
    c_smem.store(acc.to(c_desc.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(c_desc, [off_m, off_n], c_smem)


@gluon.jit
def _mma_partition(c_desc, c2_desc, a_bufs, b_bufs, b2_bufs, c_smem, c2_smem, ready, empty, Bias, M, N, K, alpha,
                   beta, s_xn, splits, k_per, ws_rows, A_T: gl.constexpr, B_T: gl.constexpr, HAS_BIAS: gl.constexpr,
                   GROUP_M: gl.constexpr, NUM_BUF: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   BLOCK_K: gl.constexpr, SPLIT: gl.constexpr, K_SPLIT: gl.constexpr):
    """The kernel's warpgroups: per K step wait for the slot's bytes, issue the wgmma asynchronously,
    wait for the previous one (one in flight) and release its slot; per tile the epilogue (alpha, the
    bias row, the cast) into shared memory and a TMA store that overlaps the next tile's MMAs. SPLIT:
    the tile's columns are two accumulators (c_desc's and c2_desc's widths), two wgmmas per K step.
    K_SPLIT: per work item one K range of a tile, its fp32 partial stored to rows r * ws_rows + off_m
    of the workspace that c_desc describes (blas adds the ranges, alpha and the bias afterwards)."""
    BN1: gl.constexpr = c_desc.block_type.shape[1]
    BN2: gl.constexpr = c2_desc.block_type.shape[1]
    layout: gl.constexpr = _mma_layout(BLOCK_M, BN1, gl.num_warps())
    layout2: gl.constexpr = _mma_layout(BLOCK_M, BN2, gl.num_warps())
    pid, programs, grid_m, grid_n, k_steps = _schedule(M, N, K, BLOCK_M, BLOCK_N, BLOCK_K)
    count = 0
    for item in range(pid, _items(grid_m, grid_n, splits, K_SPLIT), programs):
        tile, r, k_lo, k_hi = _item(item, grid_m, grid_n, k_steps, k_per, K_SPLIT)
        off_m, off_n = _tile_offsets(tile, grid_m, grid_n, GROUP_M, BLOCK_M, BLOCK_N)
        acc = gl.zeros((BLOCK_M, BN1), dtype=gl.float32, layout=layout)
        if SPLIT:
            acc2 = gl.zeros((BLOCK_M, BN2), dtype=gl.float32, layout=layout2)
        for ks in range(k_lo, k_hi):
            s = count % NUM_BUF
            mbarrier.wait(ready.index(s), (count // NUM_BUF) & 1)
            if A_T:
                a = a_bufs.index(s).permute((1, 0))
            else:
                a = a_bufs.index(s)
            if B_T:
                b = b_bufs.index(s).permute((1, 0))
            else:
                b = b_bufs.index(s)
            acc = warpgroup_mma(a, b, acc, is_async=True)
            if SPLIT:
                if B_T:
                    b2 = b2_bufs.index(s).permute((1, 0))
                else:
                    b2 = b2_bufs.index(s)
                acc2 = warpgroup_mma(a, b2, acc2, is_async=True)
                # wgmma groups retire in order: with two outstanding, the previous step's two are done
                acc, acc2, _, _, _ = warpgroup_mma_wait(num_outstanding=2, deps=(acc, acc2, a, b, b2))
            else:
                acc, _, _ = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a, b))
            # the MMAs of step count - 1 are complete: the loader may refill their slot
            mbarrier.arrive(empty.index((count + NUM_BUF - 1) % NUM_BUF), pred=ks > k_lo)
            count += 1
        if SPLIT:
            acc, acc2 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc2))
        else:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index((count + NUM_BUF - 1) % NUM_BUF), pred=k_hi > k_lo)
        # the previous tile's stores must have read the output tiles before they are overwritten
        tma.store_wait(pendings=0)
        row = r * ws_rows + off_m      # off_m unless K_SPLIT (r is 0)
        _epilogue(acc, c_desc, c_smem, Bias, row, off_n, N, alpha, beta, s_xn, HAS_BIAS)
        if SPLIT:
            _epilogue(acc2, c2_desc, c2_smem, Bias, row, off_n + BN1, N, alpha, beta, s_xn, HAS_BIAS)
    tma.store_wait(pendings=0)


@gluon.jit
def _matmul(a_desc, b_desc, b2_desc, c_desc, c2_desc, Bias, M, N, K, alpha, beta, s_xn, splits, k_per, ws_rows,
            A_T: gl.constexpr, B_T: gl.constexpr, HAS_BIAS: gl.constexpr, GROUP_M: gl.constexpr,
            NUM_BUF: gl.constexpr, SPLIT: gl.constexpr, K_SPLIT: gl.constexpr):
    """The body of the kernels: shared memory, barriers and the two partitions."""
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1] + (c2_desc.block_type.shape[1] if SPLIT else 0)
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[0 if A_T else 1]
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_BUF] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [NUM_BUF] + b_desc.block_type.shape, b_desc.layout)
    c_smem = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    if SPLIT:
        b2_bufs = gl.allocate_shared_memory(b2_desc.dtype, [NUM_BUF] + b2_desc.block_type.shape, b2_desc.layout)
        c2_smem = gl.allocate_shared_memory(c2_desc.dtype, c2_desc.block_type.shape, c2_desc.layout)
    else:
        b2_bufs = b_bufs
        c2_smem = c_smem
    ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([
        (_mma_partition, (c_desc, c2_desc, a_bufs, b_bufs, b2_bufs, c_smem, c2_smem, ready, empty, Bias, M, N, K,
                          alpha, beta, s_xn, splits, k_per, ws_rows, A_T, B_T, HAS_BIAS, GROUP_M, NUM_BUF, BLOCK_M,
                          BLOCK_N, BLOCK_K, SPLIT, K_SPLIT)),
        (_load_partition, (a_desc, b_desc, b2_desc, a_bufs, b_bufs, b2_bufs, ready, empty, M, N, K, splits, k_per, A_T,
                           B_T, GROUP_M, NUM_BUF, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT, K_SPLIT)),
    ], [1], [LOAD_REGS])


@kernel
@gluon.jit
def matmul_gluon_kernel(a_desc, b_desc, c_desc, Bias, M, N, K, alpha, beta, s_xn,
                        A_T: gl.constexpr, B_T: gl.constexpr, HAS_BIAS: gl.constexpr, GROUP_M: gl.constexpr,
                        NUM_BUF: gl.constexpr):
    """Program p computes output tiles p, p + programs, ... with fp32 accumulation;
    C[tile] = alpha * sum_k A[m, k] B[k, n] + beta * Bias[n]   (a bias row: `launch` takes no other).

    Warp-specialized: `_load_partition` (one extra warp, few registers) and `_mma_partition` (the
    launch's num_warps) share a ring of NUM_BUF operand slots through two barriers per slot, `ready`
    (loads landed) and `empty` (MMA done reading). Both walk the same tiles and K steps, so a running
    count gives each the slot (count % NUM_BUF) and the barrier phase ((count // NUM_BUF) & 1).
    A_T / B_T: the operand is read through a descriptor of its transpose (its rows are the contiguous
    axis) and handed to wgmma as a permuted shared-memory view."""
    _matmul(a_desc, b_desc, b_desc, c_desc, c_desc, Bias, M, N, K, alpha, beta, s_xn, 1, 0, 0, A_T, B_T, HAS_BIAS,
            GROUP_M, NUM_BUF, False, False)


@kernel
@gluon.jit
def matmul_gluon_wide_kernel(a_desc, b_desc, b2_desc, c_desc, c2_desc, Bias, M, N, K, alpha, beta, s_xn,
                             A_T: gl.constexpr, B_T: gl.constexpr, HAS_BIAS: gl.constexpr, GROUP_M: gl.constexpr,
                             NUM_BUF: gl.constexpr):
    """matmul_gluon_kernel with tiles BN1 + BN2 columns wide (c_desc's and c2_desc's widths, 128 + 64: Gluon's
    shapes are powers of two), two accumulators and two B parts per K step.

    Why: wave quantization on 132 SMs. BERT's 4096 x 768 outputs (its layers and their gradients) make
    192 tiles of 128 x 128, 1.45 rounds; 128 x 192 tiles make 128, one round, at (128 + 192) x 64 operand
    bytes per 128 x 192 x 64 step. A prototype ran 4096 x 768 x 3072 at 1.05x cuBLAS's kernel time (the
    tuned choice then: 1.29x) and 576 x 4096 x 4096 at 1.22x (1.54x) (H200, docs/perf.md)."""
    _matmul(a_desc, b_desc, b2_desc, c_desc, c2_desc, Bias, M, N, K, alpha, beta, s_xn, 1, 0, 0, A_T, B_T, HAS_BIAS,
            GROUP_M, NUM_BUF, True, False)


@kernel
@gluon.jit
def matmul_gluon_splitk_kernel(a_desc, b_desc, w_desc, M, N, K, splits, k_per, ws_rows, A_T: gl.constexpr,
                               B_T: gl.constexpr, GROUP_M: gl.constexpr, NUM_BUF: gl.constexpr):
    """matmul_gluon_kernel over tiles x `splits` K ranges of k_per steps: item (tile, r) stores
    W[r * ws_rows + m, n] = sum over its K range of A[m, k] B[k, n] in fp32 (w_desc: the workspace
    [splits * ws_rows, N], ws_rows = M rounded up to BLOCK_M so a tile's rows never reach the next
    range's); kernels.splitk_reduce_kernel adds the ranges in fixed order with alpha, the bias and the cast.

    Why: the mid-size GEMMs whose K is 4-16x M or N (577 x 1024 x 4096: 40 tiles of 128 x 128 for 132
    SMs) either leave SMs idle with large tiles or, with small ones, read each operand from L2 more
    often than cuBLAS, whose clusters share those loads by TMA multicast (Triton 3.6 has none: "NYI:
    Support multicast"). Large tiles split over K fill the SMs at large tiles' L2 traffic, for an fp32
    write and read of splits x M x N more."""
    _matmul(a_desc, b_desc, b_desc, w_desc, w_desc, M, M, N, K, 1.0, 0.0, 0, splits, k_per, ws_rows, A_T, B_T, False,
            GROUP_M, NUM_BUF, False, True)


@functools.lru_cache(maxsize=None)
def _smem_layout(block, dtype):
    return gl.NVMMASharedLayout.get_default_for(list(block), _GL_DTYPES[dtype])


_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}


def descriptor(t, shape, strides, block):
    """gemm_tma's unvalidated host descriptor, as Gluon's class with its shared-memory layout (16-bit or fp32
    `t`; attention/gluon_fwd.py's descriptors too)."""
    d = gemm_tma.descriptor(t, shape, strides, block, TensorDescriptor)
    d.layout = _smem_layout(tuple(block), t.dtype)
    return d


def _desc(t, shape, lead, block):
    """`descriptor` of a row-major view (leading stride `lead`): gemm_tma.descriptors' builder."""
    return descriptor(t, shape, [lead, 1], block)


def supports(bias, has_bias):
    """Whether `launch` takes this bias: none, or one row broadcast over M (stride 0 along M)."""
    return not has_bias or bias.stride(0) == 0 or bias.shape[0] == 1


def split_n(bn: int):
    """(BN1, BN2) of a tile `bn` columns wide: (bn, 0) for a power of two, else its highest power of two
    and the rest, which must be one too (Gluon's block shapes): 192 -> (128, 64)."""
    bn1 = 1 << (bn.bit_length() - 1)
    bn2 = bn - bn1
    if bn2 & (bn2 - 1):
        raise ValueError(f"a Gluon GEMM tile of {bn} columns is not two powers of two")
    return bn1, bn2


def launch(a, b, c, bias, alpha, beta, has_bias, layouts, cfg, first=False):
    """c = alpha * a @ b (+ beta * bias row) with `cfg` (BLOCK_M/N/K, GROUP_M, NUM_BUF, warps, maxnreg); `layouts`
    from gemm_tma.layout (the same operand conditions), the bias as `supports` says. A BLOCK_N that is not
    a power of two (192) takes the wide kernel. `first` as matmul.launch's."""
    (a_t, _), (b_t, _) = layouts
    M, K = a.shape
    N = b.shape[1]
    bn1, bn2 = split_n(cfg["BLOCK_N"])
    progs = min(cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"]), sm_count(a.device))
    xn = bias.stride(1) if has_bias else 0
    opts = dict(num_warps=cfg["num_warps"], num_stages=1, maxnreg=cfg["maxnreg"], first=first)
    consts = (a_t, b_t, has_bias, cfg["GROUP_M"], cfg["NUM_BUF"])
    if not bn2:
        ad, bd, cd = gemm_tma.descriptors(a, b, c, layouts, cfg, _desc)
        matmul_gluon_kernel[(progs,)](ad, bd, cd, bias, M, N, K, float(alpha), float(beta), xn, *consts, **opts)
        return
    ad, bd, cd = gemm_tma.descriptors(a, b, c, layouts, dict(cfg, BLOCK_N=bn1), _desc)
    b2d, c2d = gemm_tma.bc_descriptors(b, c, layouts, M, cfg["BLOCK_M"], bn2, cfg["BLOCK_K"], _desc)
    matmul_gluon_wide_kernel[(progs,)](ad, bd, b2d, cd, c2d, bias, M, N, K, float(alpha), float(beta), xn, *consts,
                                       **opts)


def launch_splitk(a, b, ws, ws_rows, layouts, cfg, splits, k_per, first=False):
    """The fp32 partials of a K-split launch (`k_splits`' splits and K steps per split) into `ws`, a
    [splits, ws_rows, >= N] fp32 workspace with 16-byte aligned rows; power-of-two tiles only. `first` as
    matmul.launch's."""
    (a_t, _), (b_t, _) = layouts
    M, K = a.shape
    N = b.shape[1]
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    ad, bd = gemm_tma.a_descriptor(a, layouts, bm, bk, _desc), gemm_tma.b_descriptor(b, layouts, bn, bk, _desc)
    wd = descriptor(ws, [splits * ws_rows, N], [ws.stride(1), 1], [bm, bn])
    progs = min(cdiv(M, bm) * cdiv(N, bn) * splits, sm_count(a.device))
    matmul_gluon_splitk_kernel[(progs,)](ad, bd, wd, M, N, K, splits, k_per, ws_rows, a_t, b_t, cfg["GROUP_M"],
                                         cfg["NUM_BUF"], num_warps=cfg["num_warps"], num_stages=1,
                                         maxnreg=cfg["maxnreg"], first=first)


def k_splits(M, N, K, cfg, sms):
    """(splits, K steps per split, workspace rows) of a FILL_K config: as many K ranges as keep every
    tile's ranges within one round of programs on `sms` SMs (at most MAX_SPLITS, each of at least two
    BLOCK_K steps, none empty); (1, all steps, M) where the tiles alone fill half the SMs. The fp32
    workspace (splits x rows x ws_cols(N)) is then at most `sms` tiles: 32-bit offsets."""
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    tiles, steps = cdiv(M, bm) * cdiv(N, bn), cdiv(K, bk)
    want = min(MAX_SPLITS, sms // tiles, steps // 2)
    if want < 2:
        return 1, steps, M
    per = cdiv(steps, want)
    return cdiv(steps, per), per, cdiv(M, bm) * bm


def ws_cols(N):
    """Columns of a K-split workspace row: N rounded up to 4 fp32 (TMA's 16-byte aligned rows)."""
    return cdiv(N, 4) * 4


MAX_SPLITS = 8
