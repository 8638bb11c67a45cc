"""A FlashAttention-3-style forward for Hopper written in Gluon: a loading warpgroup brings Q, K and V by
TMA into shared memory, two consumer warpgroups each own 64 query rows of a 128-row tile and run the
tile's two GEMMs as asynchronous warpgroup MMAs, and mbarriers hand the buffers back and forth.

    S = Q K^T,   P = exp2(S * qk_scale - m),   O = (sum_j P_j V_j) / l,   lse = (m + log2 l) * ln 2

(online softmax in base 2: m the running row maximum of S * qk_scale, l the running row sum of P;
qk_scale = scale * log2(e)).

Why a second forward: the Triton kernel (kernels.attn_fwd) runs the tutorial's loop, in which
every warp waits for its own loads and does its own softmax between its GEMMs; on an H100 its best config
took 1.35x cuDNN's time at Llama-2's shapes, and neither TMA loads nor Triton 3.6's automatic warp
specialization moved it (docs/perf.md). Here loads run ahead of the MMAs in their own
warps, and (OVERLAP) each consumer issues the next block's Q K^T before the softmax of the current one
and the P V product after it, so the tensor cores work while the softmax runs (FlashAttention-3's
intra-warpgroup overlap); the two consumers share each K/V tile, and the hardware interleaves one's
softmax with the other's MMAs. PERSISTENT: one program per SM walks tiles, so the next tile's Q, K and
V load while this one's output is stored (0.91-0.99x cuDNN's time against 1.02-1.08x with one program
per tile at Llama-2's long shapes; H200, docs/perf.md).

Bytes per key block: the TMA unit moves BLOCK_N x D x 2 bytes of K and as much of V into a ring slot,
read by both consumers (128 query rows); Q (128 x D x 2 bytes) once per tile.

Contract (`supports`): Hopper, fp16/bf16, head dim 128, Q/K/V/O with unit stride along the head dim and
16-byte aligned base and strides (TMA), and from the caller: no mask, no dropout, more than 16 queries
(decode has its own split-KV kernel). Causal is top-left aligned (key j visible to query i iff j <= i),
as in sdpa.py. Descriptors are 4-d over [B, H, S, D] with the tensors' own strides, so Hugging
Face's [B, S, H, D] layout and GQA (K/V head h // group) need no copy; rows past the sequence are
zero-filled by TMA on loads and clipped on the output's store. Head dim 64 ran 1.27-1.38x cuDNN's time
here against the Triton kernel's 1.09-1.34x, so it stays there.
"""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from ...runtime import kernel
from ...runtime.utils import cdiv, sm_count
from ..blas import gluon as gemm_gluon
from ..blas import tma as gemm_tma

# query rows per consumer warpgroup (one wgmma M of 16 per warp, 4 warps); a tile has two
ROWS = gl.constexpr(64)
# registers per thread of each consumer warpgroup (setmaxnreg; the loading warpgroup gives its own back)
CONSUMER_REGS = gl.constexpr(240)
LN2 = gl.constexpr(0.6931471805599453)
# the consumers' halves of a program's rows (constexpr: warp_specialize passes values by their types)
FIRST = gl.constexpr(0)
SECOND = gl.constexpr(1)


@gluon.constexpr_function
def acc_layout(N):
    """wgmma accumulator of [64, N]: the warpgroup's 4 warps stacked along the rows, instruction N = N."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 16])


@gluon.jit
def _tile_coords(t, n_m, Hq, GROUP, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr):
    """(batch, query head, KV head, first row) of tile t. Tiles run query blocks fastest, so the
    programs working at one time share a few heads' K/V in L2; causal blocks longest first, so the
    last ones to finish are short."""
    pid_m = t % n_m
    if CAUSAL:
        pid_m = n_m - 1 - pid_m
    pid_bh = t // n_m
    b = pid_bh // Hq
    h = pid_bh % Hq
    return b, h, h // GROUP, pid_m * BLOCK_M


@gluon.jit
def _round_tile(r, n_tiles):
    """(the program's tile in round r, whether there is one). Round r covers tiles [r * P, r * P + P) of the
    P programs, in program order on even rounds and in reverse on odd ones: a program that drew one of the
    longest causal tiles in one round draws one of the shortest in the next (with tiles in program order
    every round, 132 programs and 4 query blocks per head, a program would get the same block length in
    every round)."""
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    if r % 2 == 1:
        pid = nprog - 1 - pid
    t = r * nprog + pid
    return t, t < n_tiles


@gluon.jit
def _key_blocks(m0, row0, Sk, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """(key blocks the tile at row m0 reads, blocks before the first that needs a mask for rows from
    row0 on). Causal: a block is unmasked for those rows when its last key is left of row0, so the
    second warpgroup of a tile with 64-key blocks masks one block (the diagonal), not two."""
    if CAUSAL:
        hi = gl.minimum(Sk, m0 + BLOCK_M)
        full = gl.minimum(row0 // BLOCK_N, Sk // BLOCK_N)
    else:
        hi = Sk
        full = Sk // BLOCK_N
    return gl.cdiv(hi, BLOCK_N), full


@gluon.jit
def _load_partition(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty,
                    v_empty, Hq, GROUP, Sq, Sk, n_tiles, CAUSAL: gl.constexpr, STAGES: gl.constexpr,
                    BLOCK_N: gl.constexpr):
    """Walks the program's tiles (`_round_tile`): the tile's Q halves into Q buffer
    i % 2 once both consumers have stored the output of tile i - 2 from it (`q_empty`), then K_j and
    V_j into ring slot c % STAGES (c counts key blocks over all the program's tiles) once both
    consumers have released the slot's previous K (`k_empty`, two arrivals) or V (`v_empty`). K and V
    have their own barriers: Q K^T can start before V has landed, and a K slot is refilled as soon as
    its scores are computed, while the P V product of the same block still reads V. The loads run
    ahead into the next tile while the consumers finish this one."""
    n_m = gl.cdiv(Sq, 2 * ROWS)
    c = 0
    i = 0
    for r in range(gl.cdiv(n_tiles, gl.num_programs(0))):
        t, has = _round_tile(r, n_tiles)
        if has:
            c, i = _load_tile(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready,
                              k_empty, v_empty, t, n_m, c, i, Hq, GROUP, Sk, CAUSAL, STAGES, BLOCK_N)


@gluon.jit
def _load_tile(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty,
               t, n_m, c, i, Hq, GROUP, Sk, CAUSAL: gl.constexpr, STAGES: gl.constexpr, BLOCK_N: gl.constexpr):
    """The loads of the program's i-th tile, t; its key blocks are the program's c, c + 1, ...; returns
    the counts after it."""
    b, h, hk, m0 = _tile_coords(t, n_m, Hq, GROUP, CAUSAL, 2 * ROWS)
    n_blocks, _ = _key_blocks(m0, m0, Sk, CAUSAL, 2 * ROWS, BLOCK_N)
    qb = i % 2
    # a fresh barrier counts as released in phase 1: the first loads into each buffer do not wait
    mbarrier.wait(q_empty.index(qb), ((i // 2) & 1) ^ 1)
    mbarrier.expect(q_ready.index(qb), 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [b, h, m0, 0], q_ready.index(qb), q_smem.index(2 * qb))
    tma.async_copy_global_to_shared(q_desc, [b, h, m0 + ROWS, 0], q_ready.index(qb), q_smem.index(2 * qb + 1))
    for j in range(n_blocks):
        s = c % STAGES
        phase = ((c // STAGES) & 1) ^ 1
        mbarrier.wait(k_empty.index(s), phase)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b, hk, j * BLOCK_N, 0], k_ready.index(s), k_smem.index(s))
        mbarrier.wait(v_empty.index(s), phase)
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [b, hk, j * BLOCK_N, 0], v_ready.index(s), v_smem.index(s))
        c += 1
    return c, i + 1


@gluon.jit
def _scores(s, j, full, row0, Sk, qk_scale, m_i, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr):
    """Block j's scores in the log2 domain against running maximum m_i: (P, new maximum, rescale of the
    old sums). Blocks from `full` on mask keys past Sk (and, causal, keys right of the diagonal)."""
    s_layout: gl.constexpr = s.type.layout
    if j >= full:
        cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        keep = (cols < Sk)[None, :]
        if CAUSAL:
            rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
            keep = keep & (cols[None, :] <= rows[:, None])
        s = gl.where(keep, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    p = gl.exp2(s * qk_scale - m_new[:, None])
    return p, m_new, gl.exp2(m_i - m_new)


@gluon.jit
def _consumer_tile(q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, c, n_blocks, full, row0, Sk, qk_scale,
                   CAUSAL: gl.constexpr, OVERLAP: gl.constexpr, STAGES: gl.constexpr, BLOCK_N: gl.constexpr,
                   HEAD_D: gl.constexpr):
    """(acc, m, l) of one warpgroup's 64 rows over the tile's n_blocks key blocks, which sit in ring
    slots c % STAGES, (c + 1) % STAGES, ..."""
    s_layout: gl.constexpr = acc_layout(BLOCK_N)
    o_layout: gl.constexpr = acc_layout(HEAD_D)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    dtype: gl.constexpr = k_smem.dtype
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([ROWS, HEAD_D], gl.float32, o_layout)
    if OVERLAP:
        # block 0's scores and P before the loop; iteration j issues S_j, then P_{j-1} V_{j-1}, and runs
        # block j's softmax while the second MMA is in flight
        s_idx = c % STAGES
        mbarrier.wait(k_ready.index(s_idx), (c // STAGES) & 1)
        kt = k_smem.index(s_idx).reshape([BLOCK_N, HEAD_D]).permute((1, 0))
        s_tok = warpgroup_mma(q, kt, s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
        mbarrier.arrive(k_empty.index(s_idx))
        p, m_i, alpha = _scores(s, 0, full, row0, Sk, qk_scale, m_i, CAUSAL, BLOCK_N)
        l_i = l_i * alpha + gl.sum(p, 1)
        for j in range(1, n_blocks):
            s_idx = (c + j) % STAGES
            mbarrier.wait(k_ready.index(s_idx), ((c + j) // STAGES) & 1)
            kt = k_smem.index(s_idx).reshape([BLOCK_N, HEAD_D]).permute((1, 0))
            s_tok = warpgroup_mma(q, kt, s_zero, use_acc=False, is_async=True)
            prev = (c + j - 1) % STAGES
            mbarrier.wait(v_ready.index(prev), ((c + j - 1) // STAGES) & 1)
            acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
            pv = gl.convert_layout(p.to(dtype), p_layout)
            v = v_smem.index(prev).reshape([BLOCK_N, HEAD_D])
            o_tok = warpgroup_mma(pv, v, acc, is_async=True)
            # wgmma groups retire in order: with one outstanding, S_j is done and P V still runs
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))
            mbarrier.arrive(k_empty.index(s_idx))
            p, m_i, alpha = _scores(s, j, full, row0, Sk, qk_scale, m_i, CAUSAL, BLOCK_N)
            l_i = l_i * alpha + gl.sum(p, 1)
            acc, _ = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, pv))
            mbarrier.arrive(v_empty.index(prev))
        last = (c + n_blocks - 1) % STAGES
        mbarrier.wait(v_ready.index(last), ((c + n_blocks - 1) // STAGES) & 1)
        acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
        pv = gl.convert_layout(p.to(dtype), p_layout)
        o_tok = warpgroup_mma(pv, v_smem.index(last).reshape([BLOCK_N, HEAD_D]), acc, is_async=True)
        acc, _ = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, pv))
        mbarrier.arrive(v_empty.index(last))
    else:
        for j in range(n_blocks):
            s_idx = (c + j) % STAGES
            phase = ((c + j) // STAGES) & 1
            mbarrier.wait(k_ready.index(s_idx), phase)
            kt = k_smem.index(s_idx).reshape([BLOCK_N, HEAD_D]).permute((1, 0))
            s_tok = warpgroup_mma(q, kt, s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
            mbarrier.arrive(k_empty.index(s_idx))
            p, m_i, alpha = _scores(s, j, full, row0, Sk, qk_scale, m_i, CAUSAL, BLOCK_N)
            l_i = l_i * alpha + gl.sum(p, 1)
            acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
            pv = gl.convert_layout(p.to(dtype), p_layout)
            mbarrier.wait(v_ready.index(s_idx), phase)
            o_tok = warpgroup_mma(pv, v_smem.index(s_idx).reshape([BLOCK_N, HEAD_D]), acc, is_async=True)
            acc, _ = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, pv))
            mbarrier.arrive(v_empty.index(s_idx))
    return acc, m_i, l_i


@gluon.jit
def _consumer(q_smem, k_smem, v_smem, o_desc, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, LSE, Hq, GROUP,
              Sq, Sk, qk_scale, s_lb, s_lh, s_lm, n_tiles, HALF: gl.constexpr, CAUSAL: gl.constexpr,
              STORE_LSE: gl.constexpr, OVERLAP: gl.constexpr, STAGES: gl.constexpr, BLOCK_N: gl.constexpr,
              HEAD_D: gl.constexpr):
    """One warpgroup: query rows [m0 + HALF * 64, + 64) of each of the program's tiles, every key block;
    the output leaves through the tile's Q buffer, which is then handed back to the loader."""
    n_m = gl.cdiv(Sq, 2 * ROWS)
    c = 0
    i = 0
    for r in range(gl.cdiv(n_tiles, gl.num_programs(0))):
        t, has = _round_tile(r, n_tiles)
        if has:
            c, i = _consume_tile(q_smem, k_smem, v_smem, o_desc, q_ready, q_empty, k_ready, v_ready, k_empty,
                                 v_empty, LSE, t, n_m, c, i, Hq, GROUP, Sq, Sk, qk_scale, s_lb, s_lh, s_lm, HALF,
                                 CAUSAL, STORE_LSE, OVERLAP, STAGES, BLOCK_N, HEAD_D)


@gluon.jit
def _consume_tile(q_smem, k_smem, v_smem, o_desc, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, LSE, t, n_m,
                  c, i, Hq, GROUP, Sq, Sk, qk_scale, s_lb, s_lh, s_lm, HALF: gl.constexpr, CAUSAL: gl.constexpr,
                  STORE_LSE: gl.constexpr, OVERLAP: gl.constexpr, STAGES: gl.constexpr, BLOCK_N: gl.constexpr,
                  HEAD_D: gl.constexpr):
    """One warpgroup's rows of the program's i-th tile, t, whose key blocks are the program's c, c + 1,
    ...: softmax and output, stored through the tile's Q buffer, which then goes back to the loader;
    returns the counts after it."""
    o_rows: gl.constexpr = gl.SliceLayout(1, acc_layout(HEAD_D))
    s_rows: gl.constexpr = gl.SliceLayout(1, acc_layout(BLOCK_N))
    b, h, hk, m0 = _tile_coords(t, n_m, Hq, GROUP, CAUSAL, 2 * ROWS)
    row0 = m0 + HALF * ROWS
    n_blocks, full = _key_blocks(m0, row0, Sk, CAUSAL, 2 * ROWS, BLOCK_N)
    qb = i % 2
    q_slot = q_smem.index(2 * qb + HALF)
    q = q_slot.reshape([ROWS, HEAD_D])
    mbarrier.wait(q_ready.index(qb), (i // 2) & 1)
    # causal with key blocks of 64: the tile's last block starts at key m0 + 64 when it has keys there,
    # right of every FIRST row, so FIRST skips it (one of its 2k blocks in a tile of k blocks of 128)
    n_run = n_blocks
    if CAUSAL and HALF == FIRST and BLOCK_N == ROWS:
        if Sk > m0 + ROWS:
            n_run = n_blocks - 1
    acc, m_i, l_i = _consumer_tile(q, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty, c, n_run, full,
                                   row0, Sk, qk_scale, CAUSAL, OVERLAP, STAGES, BLOCK_N, HEAD_D)
    if n_run < n_blocks:
        # release the skipped block's slot as a reader would, after its loads landed: the slot's previous
        # use is then released by both consumers, so this arrival counts toward this use
        last = c + n_run
        mbarrier.wait(k_ready.index(last % STAGES), (last // STAGES) & 1)
        mbarrier.arrive(k_empty.index(last % STAGES))
        mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
        mbarrier.arrive(v_empty.index(last % STAGES))
    # every row sees key 0 (Sk >= 1; causal rows i >= 0), so l_i > 0
    out = acc / gl.convert_layout(l_i, o_rows)[:, None]
    if STORE_LSE:
        rows = row0 + gl.arange(0, ROWS, layout=s_rows)
        lse = (m_i + gl.log2(l_i)) * LN2
        gl.store(LSE + b.to(gl.int64) * s_lb + h.to(gl.int64) * s_lh + rows * s_lm, lse, mask=rows < Sq)
    # the output leaves through this warpgroup's Q slot (its MMAs are done): TMA clips rows past Sq
    q.store(out.to(k_smem.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [b, h, row0, 0], q_slot)
    tma.store_wait(pendings=0)
    mbarrier.arrive(q_empty.index(qb))
    return c + n_blocks, i + 1


@kernel
@gluon.jit
def attn_fwd_gluon(q_desc, k_desc, v_desc, o_desc, LSE, Hq, GROUP, Sq, Sk, qk_scale, s_lb, s_lh, s_lm, n_tiles,
                   CAUSAL: gl.constexpr, STORE_LSE: gl.constexpr, OVERLAP: gl.constexpr, STAGES: gl.constexpr):
    """Out and lse of the program's tiles (a tile: 128 query rows of one batch and query head; one per
    round r of `_round_tile`). One program per tile, or one per SM walking several (persistent).

    Warp-specialized: the kernel's 4 warps load (one would do: TMA copies are issued by one thread),
    and two worker warpgroups are the consumers, rows 0-63 and 64-127 of each tile. Q has two buffers
    (the next tile's Q loads while this one's output is stored), each with barriers `q_ready` / `q_empty`;
    the K/V ring has STAGES slots with four barriers each: `k_ready` / `v_ready` (the TMA's bytes
    landed) and `k_empty` / `v_empty` (both consumers are done with it). Running counts give each
    side the same buffer and phase: tile i of the program, Q buffer i % 2, phase (i // 2) & 1; key
    block c of the program, slot c % STAGES, phase (c // STAGES) & 1."""
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    HEAD_D: gl.constexpr = k_desc.block_type.shape[3]
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [4] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_empty.index(i), count=2)
    gl.warp_specialize([
        (_load_partition, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready,
                           k_empty, v_empty, Hq, GROUP, Sq, Sk, n_tiles, CAUSAL, STAGES, BLOCK_N)),
        (_consumer, (q_smem, k_smem, v_smem, o_desc, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, LSE, Hq,
                     GROUP, Sq, Sk, qk_scale, s_lb, s_lh, s_lm, n_tiles, FIRST, CAUSAL, STORE_LSE, OVERLAP, STAGES,
                     BLOCK_N, HEAD_D)),
        (_consumer, (q_smem, k_smem, v_smem, o_desc, q_ready, q_empty, k_ready, v_ready, k_empty, v_empty, LSE, Hq,
                     GROUP, Sq, Sk, qk_scale, s_lb, s_lh, s_lm, n_tiles, SECOND, CAUSAL, STORE_LSE, OVERLAP, STAGES,
                     BLOCK_N, HEAD_D)),
    ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])


def desc(t, block):
    """Gluon's host descriptor of 4-d `t` ([B, H, S, D]) with its own strides (`supports` checked them)."""
    return gemm_gluon.descriptor(t, list(t.shape), list(t.stride()), block)


def _tma_ok(t) -> bool:
    """Whether a TMA descriptor can address `t` through its own strides: unit stride along the last
    dim, a 16-byte aligned base, the other strides positive multiples of 16 bytes (a broadcast dim,
    stride 0, is not one: such a tensor goes to the Triton kernel, which reads it in place)."""
    es = t.element_size()
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(s > 0 and (s * es) % 16 == 0 for s in t.stride()[:-1]))


# (BLOCK_N, STAGES, OVERLAP, PERSISTENT: one program per SM, else one per tile) by head dim, from a sweep
# at Llama-2's shapes on an H200 (docs/perf.md); up to SHORT_KEYS keys a tile has at most 4
# key blocks, most of them in the overlapped loop's prologue and epilogue: without the overlap B8 x 512
# causal took 1.05x cuDNN's time, with it 1.18x (at 2048 keys: 0.87x and 0.79x). Except when every tile
# has a program of its own (one round): B1 x 512 causal (128 tiles, 132 SMs) took 12.4 us with the overlap
# and 13.1 without (cuDNN 11.8 with its memset), B2 x 512 (two rounds) 20.0 and 17.1 (H200).
# On an H200 (kernel time): since the first warpgroup skips its masked last block of
# 64 keys, key blocks of 64 without the overlap are the best of 12 configs at B1 x 512 (one round): 12.02 us
# against cuDNN's 11.85, where 128 x 2 without the overlap took 12.25 and the previous table config 12.5-12.6;
# at B2/B4/B8 x 512 it took 0.80 / 0.94 / 1.04 of cuDNN's time against _SHORT's 0.82 / 0.94 / 1.00.
# A third ring slot with one Q buffer (one round has one tile per program) was slower at every shape.
# `set_config` overrides.
_CONFIGS = {128: (128, 2, True, True)}
_SHORT = {128: (128, 2, False, True)}
_ONE_ROUND_SHORT = {128: (64, 2, False, True)}
SHORT_KEYS = 512
_OVERRIDE: dict = {}


def set_config(head_dim: int, cfg):
    """Force (BLOCK_N, STAGES, OVERLAP, PERSISTENT) for one head dim; None restores the table."""
    if cfg is None:
        _OVERRIDE.pop(head_dim, None)
    else:
        _OVERRIDE[head_dim] = tuple(cfg)


def config(head_dim: int, keys: int, one_round: bool = False):
    """The launch config for `keys` keys (per query row, before any causal mask); one_round: there are
    no more tiles than SMs."""
    o = _OVERRIDE.get(head_dim)
    if o is not None:
        return o
    if keys > SHORT_KEYS:
        return _CONFIGS[head_dim]
    return (_ONE_ROUND_SHORT if one_round else _SHORT)[head_dim]


# False: every call takes sdpa.py's Triton kernels (benchmarks compare the two)
enabled = True


def tma_operands(q, *ts) -> bool:
    """The conditions the Gluon attention kernels (forward and backward) share: `q` fp16/bf16 on a
    Hopper GPU, and `q` and `ts` addressable by TMA in place."""
    return (q.is_cuda and q.dtype in _DTYPES and gemm_tma.major_cc(q.device.index) == 9
            and _tma_ok(q) and all(_tma_ok(t) for t in ts))


def supports(q, k, v, o) -> bool:
    """Whether `launch` computes this call (no mask or dropout: the caller's part of the contract)."""
    return enabled and q.shape[3] in _CONFIGS and tma_operands(q, k, v, o)


_DTYPES = (torch.float16, torch.bfloat16)


def launch(q, k, v, o, lse, causal: bool, qk_scale: float):
    """o [B, Hq, Sq, D] (and lse [B, Hq, Sq] fp32 when not None) from q, k, v ([B, Hkv, Sk, D]); `supports`
    said yes. qk_scale = scale * log2(e)."""
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    n_tiles = cdiv(Sq, 2 * ROWS.value) * B * Hq
    sms = sm_count(q.device)
    bn, stages, overlap, persistent = config(D, Sk, n_tiles <= sms)
    qd = desc(q, [1, 1, ROWS.value, D])
    od = desc(o, [1, 1, ROWS.value, D])
    kd = desc(k, [1, 1, bn, D])
    vd = desc(v, [1, 1, bn, D])
    store = lse is not None
    lt = lse if store else o
    ls = lse.stride() if store else (0, 0, 0)
    progs = min(n_tiles, sms) if persistent else n_tiles
    attn_fwd_gluon[(progs,)](qd, kd, vd, od, lt, Hq, Hq // Hkv, Sq, Sk, float(qk_scale), ls[0], ls[1], ls[2], n_tiles,
                             bool(causal), store, overlap, stages, num_warps=4, num_stages=1)
