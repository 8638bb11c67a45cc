"""A FlashAttention-3-style forward for Hopper written in Gluon: one warp loads Q, K and V by TMA into
shared memory, two consumer warpgroups each own 64 query rows of a 128-row block and run the block's
two GEMMs as asynchronous warpgroup MMAs, and mbarriers hand the K/V ring's slots back and forth.

    S = Q K^T,   P = exp2(S * qk_scale - m),   O = (sum_j P_j V_j) / l,   lse = (m + log2 l) * ln 2

(online softmax in base 2: m the running row maximum of S * qk_scale, l the running row sum of P;
qk_scale = scale * log2(e)).

Why a second forward: the Triton kernel (_attention_kernels.attn_fwd) runs the tutorial's loop, in which
every warp waits for its own loads and does its own softmax between its GEMMs; on an H100 its best config
took 1.35x cuDNN's time at Llama-2's shapes, and neither TMA loads nor Triton 3.6's automatic warp
specialization moved it (docs/perf.md, session 19). Here loads run in their own warp, ahead of the MMAs,
and (OVERLAP) each consumer issues the next block's Q K^T before the softmax of the current one and the
P V product after it, so the tensor cores work while the softmax runs (FlashAttention-3's intra-warpgroup
overlap); the two consumers share each K/V tile, and the hardware interleaves one's softmax with the
other's MMAs.

Bytes per key block: the TMA unit moves BLOCK_N x D x 2 bytes of K and as much of V into a ring slot,
read by both consumers (128 query rows); Q (128 x D x 2 bytes) once per program.

Contract (`supports`): Hopper, fp16/bf16, head dim 64 or 128, Q/K/V with unit stride along the head dim
and 16-byte aligned base and strides (TMA), no mask, no dropout, more than 16 queries (decode has its own
split-KV kernel). Causal is top-left aligned (key j visible to query i iff j <= i), as in attention.py.
Descriptors are 4-d over [B, H, S, D] with the tensors' own strides, so Hugging Face's [B, S, H, D]
layout and GQA (K/V head h // group) need no copy; rows past the sequence are zero-filled by TMA on
loads and clipped on the output's store.
"""
import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..runtime import kernel
from ..runtime.utils import cdiv

# query rows per consumer warpgroup (one wgmma M of 16 per warp, 4 warps); a program owns two
ROWS = gl.constexpr(64)
LOAD_REGS = gl.constexpr(24)
# registers per thread of consumer 1 (the worker warpgroup; consumer 0 gets the launch's cap)
CONSUMER_REGS = gl.constexpr(240)
LN2 = gl.constexpr(0.6931471805599453)
# the consumers' halves of a program's rows (constexpr: warp_specialize passes values by their types)
FIRST = gl.constexpr(0)
SECOND = gl.constexpr(1)


@gluon.constexpr_function
def _acc_layout(N):
    """wgmma accumulator of [64, N]: the warpgroup's 4 warps stacked along the rows, instruction N = N."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 16])


@gluon.jit
def _coords(Hq, GROUP, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr):
    """(batch, query head, KV head, first row) of this program; causal programs run longest rows first."""
    if CAUSAL:
        pid_m = gl.num_programs(0) - 1 - gl.program_id(0)
    else:
        pid_m = gl.program_id(0)
    pid_bh = gl.program_id(1)
    b = pid_bh // Hq
    h = pid_bh % Hq
    return b, h, h // GROUP, pid_m * BLOCK_M


@gluon.jit
def _key_blocks(m0, Sk, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """(key blocks this program reads, blocks before the first that needs a mask)."""
    if CAUSAL:
        hi = gl.minimum(Sk, m0 + BLOCK_M)
        full = gl.minimum(m0 // BLOCK_N, Sk // BLOCK_N)
    else:
        hi = Sk
        full = Sk // BLOCK_N
    return gl.cdiv(hi, BLOCK_N), full


@gluon.jit
def _load_partition(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty, Hq,
                    GROUP, Sk, CAUSAL: gl.constexpr, STAGES: gl.constexpr, BLOCK_N: gl.constexpr):
    """Q's two halves, then K_j and V_j into ring slot j % STAGES once both consumers have released the
    slot's previous K (`k_empty`, two arrivals) or V (`v_empty`). K and V have their own barriers: Q K^T
    can start before V has landed, and a K slot is refilled as soon as its scores are computed, while
    the P V product of the same block still reads V."""
    b, h, hk, m0 = _coords(Hq, GROUP, CAUSAL, 2 * ROWS)
    n_blocks, _ = _key_blocks(m0, Sk, CAUSAL, 2 * ROWS, BLOCK_N)
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [b, h, m0, 0], q_bar, q_smem.index(0))
    tma.async_copy_global_to_shared(q_desc, [b, h, m0 + ROWS, 0], q_bar, q_smem.index(1))
    for j in range(n_blocks):
        s = j % STAGES
        # a fresh barrier counts as released in phase 1: the first STAGES loads do not wait
        phase = ((j // STAGES) & 1) ^ 1
        mbarrier.wait(k_empty.index(s), phase)
        mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b, hk, j * BLOCK_N, 0], k_ready.index(s), k_smem.index(s))
        mbarrier.wait(v_empty.index(s), phase)
        mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [b, hk, j * BLOCK_N, 0], v_ready.index(s), v_smem.index(s))


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
def _consumer(q_smem, k_smem, v_smem, o_desc, q_bar, k_ready, v_ready, k_empty, v_empty, LSE, Hq, GROUP, Sq, Sk, qk_scale,
              s_lb, s_lh, s_lm, HALF: gl.constexpr, CAUSAL: gl.constexpr, STORE_LSE: gl.constexpr,
              OVERLAP: gl.constexpr, STAGES: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_D: gl.constexpr):
    """One warpgroup: query rows [m0 + HALF * 64, + 64) of the program's block, every key block."""
    s_layout: gl.constexpr = _acc_layout(BLOCK_N)
    o_layout: gl.constexpr = _acc_layout(HEAD_D)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    dtype: gl.constexpr = q_smem.dtype
    b, h, hk, m0 = _coords(Hq, GROUP, CAUSAL, 2 * ROWS)
    row0 = m0 + HALF * ROWS
    n_blocks, full = _key_blocks(m0, Sk, CAUSAL, 2 * ROWS, BLOCK_N)

    q = q_smem.index(HALF).reshape([ROWS, HEAD_D])
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([ROWS, HEAD_D], gl.float32, o_layout)
    mbarrier.wait(q_bar, 0)
    if OVERLAP:
        # block 0's scores and P before the loop; iteration j issues S_j, then P_{j-1} V_{j-1}, and runs
        # block j's softmax while the second MMA is in flight
        mbarrier.wait(k_ready.index(0), 0)
        kt = k_smem.index(0).reshape([BLOCK_N, HEAD_D]).permute((1, 0))
        s_tok = warpgroup_mma(q, kt, s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s_tok,))
        mbarrier.arrive(k_empty.index(0))
        p, m_i, alpha = _scores(s, 0, full, row0, Sk, qk_scale, m_i, CAUSAL, BLOCK_N)
        l_i = l_i * alpha + gl.sum(p, 1)
        for j in range(1, n_blocks):
            s_idx = j % STAGES
            mbarrier.wait(k_ready.index(s_idx), (j // STAGES) & 1)
            kt = k_smem.index(s_idx).reshape([BLOCK_N, HEAD_D]).permute((1, 0))
            s_tok = warpgroup_mma(q, kt, s_zero, use_acc=False, is_async=True)
            prev = (j - 1) % STAGES
            mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
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
        last = (n_blocks - 1) % STAGES
        mbarrier.wait(v_ready.index(last), ((n_blocks - 1) // STAGES) & 1)
        acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
        pv = gl.convert_layout(p.to(dtype), p_layout)
        o_tok = warpgroup_mma(pv, v_smem.index(last).reshape([BLOCK_N, HEAD_D]), acc, is_async=True)
        acc, _ = warpgroup_mma_wait(num_outstanding=0, deps=(o_tok, pv))
        mbarrier.arrive(v_empty.index(last))
    else:
        for j in range(n_blocks):
            s_idx = j % STAGES
            phase = (j // STAGES) & 1
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

    # every row sees key 0 (Sk >= 1; causal rows i >= 0), so l_i > 0
    out = acc / gl.convert_layout(l_i, o_rows)[:, None]
    if STORE_LSE:
        rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
        lse = (m_i + gl.log2(l_i)) * LN2
        gl.store(LSE + b.to(gl.int64) * s_lb + h.to(gl.int64) * s_lh + rows * s_lm, lse, mask=rows < Sq)
    # the output leaves through this warpgroup's Q slot (its MMAs are done): TMA clips rows past Sq
    q_slot = q_smem.index(HALF)
    q.store(out.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [b, h, row0, 0], q_slot)
    tma.store_wait(pendings=0)


@kernel
@gluon.jit
def attn_fwd_gluon(q_desc, k_desc, v_desc, o_desc, LSE, Hq, GROUP, Sq, Sk, qk_scale, s_lb, s_lh, s_lm,
                   CAUSAL: gl.constexpr, STORE_LSE: gl.constexpr, OVERLAP: gl.constexpr, STAGES: gl.constexpr):
    """Program (query block of 128 rows, batch x query head): out and lse of those rows.

    Warp-specialized: the kernel's 4 warps are consumer 0 (rows 0-63), a worker warpgroup consumer 1
    (rows 64-127), and one worker warp the loader. The K/V ring has STAGES slots with three barriers
    each: `k_ready` / `v_ready` (the TMA's bytes landed) and `k_empty` / `v_empty` (both consumers are done
    with it). A running key-block count j gives the slot (j % STAGES) and phase ((j // STAGES) & 1)."""
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
    HEAD_D: gl.constexpr = k_desc.block_type.shape[3]
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_empty.index(i), count=2)
    gl.warp_specialize([
        (_load_partition, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty,
                           Hq, GROUP, Sk, CAUSAL, STAGES, BLOCK_N)),
        (_consumer, (q_smem, k_smem, v_smem, o_desc, q_bar, k_ready, v_ready, k_empty, v_empty, LSE, Hq, GROUP, Sq,
                     Sk, qk_scale, s_lb, s_lh, s_lm, FIRST, CAUSAL, STORE_LSE, OVERLAP, STAGES, BLOCK_N, HEAD_D)),
        (_consumer, (q_smem, k_smem, v_smem, o_desc, q_bar, k_ready, v_ready, k_empty, v_empty, LSE, Hq, GROUP, Sq,
                     Sk, qk_scale, s_lb, s_lh, s_lm, SECOND, CAUSAL, STORE_LSE, OVERLAP, STAGES, BLOCK_N, HEAD_D)),
    ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])


@functools.lru_cache(maxsize=None)
def _smem_layout(block, dtype):
    return gl.NVMMASharedLayout.get_default_for(list(block), gl.bfloat16 if dtype is torch.bfloat16 else gl.float16)


_NEW = object.__new__


def _desc(t, block):
    """A host descriptor of 4-d `t` ([B, H, S, D], unit stride along D) with its own strides, built
    without the dataclass's per-call validation (`supports` checked alignment once per signature)."""
    d = _NEW(TensorDescriptor)
    d.base, d.shape, d.strides, d.block_shape, d.padding = t, list(t.shape), list(t.stride()), block, "zero"
    d.layout = _smem_layout(tuple(block), t.dtype)
    return d


def _tma_ok(t) -> bool:
    es = t.element_size()
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all((s * es) % 16 == 0 for s in t.stride()[:-1]))


# (BLOCK_N, STAGES, OVERLAP) by head dim; `set_config` overrides (benchmarks/attention.py --sweep)
_CONFIGS = {128: (128, 2, True)}
_OVERRIDE: dict = {}


def set_config(head_dim: int, cfg):
    """Force (BLOCK_N, STAGES, OVERLAP) for one head dim; None restores the table."""
    if cfg is None:
        _OVERRIDE.pop(head_dim, None)
    else:
        _OVERRIDE[head_dim] = tuple(cfg)


def config(head_dim: int):
    return _OVERRIDE.get(head_dim) or _CONFIGS[head_dim]


# False: every call takes attention.py's Triton kernels (benchmarks compare the two)
enabled = True


@functools.lru_cache(maxsize=16)
def _hopper(index) -> bool:
    return torch.cuda.get_device_capability(index)[0] == 9


def supports(q, k, v, o) -> bool:
    """Whether `launch` computes this call (no mask or dropout: the caller's part of the contract)."""
    return (enabled and q.is_cuda and q.dtype in _DTYPES and q.shape[3] in _CONFIGS and _hopper(q.device.index)
            and all(_tma_ok(t) for t in (q, k, v, o)))


_DTYPES = (torch.float16, torch.bfloat16)


def launch(q, k, v, o, lse, causal: bool, qk_scale: float):
    """o [B, Hq, Sq, D] (and lse [B, Hq, Sq] fp32 when not None) from q, k, v ([B, Hkv, Sk, D]); `supports`
    said yes. qk_scale = scale * log2(e)."""
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    bn, stages, overlap = config(D)
    qd = _desc(q, [1, 1, ROWS.value, D])
    od = _desc(o, [1, 1, ROWS.value, D])
    kd = _desc(k, [1, 1, bn, D])
    vd = _desc(v, [1, 1, bn, D])
    store = lse is not None
    lt = lse if store else o
    ls = lse.stride() if store else (0, 0, 0)
    attn_fwd_gluon[(cdiv(Sq, 2 * ROWS.value), B * Hq)](qd, kd, vd, od, lt, Hq, Hq // Hkv, Sq, Sk, float(qk_scale),
                                                 ls[0], ls[1], ls[2], bool(causal), store, overlap, stages,
                                                 num_warps=4, num_stages=1)
