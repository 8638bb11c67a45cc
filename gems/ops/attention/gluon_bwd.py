"""A FlashAttention-3-style backward for Hopper written in Gluon: one program per block of 128 keys walks the
query blocks that see it, a loading warp brings Q, dO, lse2 and delta by TMA, two consumer warpgroups each
own 64 of the keys, and dQ leaves every step through a TMA reduce-add into an fp32 accumulator.

    S^T = K Q^T,   P^T = exp2(S^T * qk_scale - lse2),   dV += P^T dO,   dP^T = V dO^T,
    dS^T = P^T * (dP^T - delta) * scale,   dK += dS^T Q,   dQ += dS K

(lse2 = lse * log2(e) of the forward's logsumexp, delta = rowsum(dO * O): `attn_bwd_gluon_pre`, which
also zeroes the dQ accumulator; the scale is folded into dS, so dK and dQ need no epilogue scaling;
`attn_bwd_cast` writes dQ in its dtype at the end).

Why: the Triton backward (kernels.py: attn_bwd_dkdv, then attn_bwd_dq) recomputes S and dP in
its dQ kernel, 7 GEMMs per block pair where this kernel does 5, and its loads wait in the MMA warps;
it took 1.26-1.53x cuDNN's backward time at Llama-2's shapes, this kernel 1.02-1.09x (H200, docs/perf.md).
dQ is accumulated across the key-block programs in global memory by the TMA unit
(`cp.reduce.async.bulk.tensor ... add.f32`, one [64, 64] fp32 box per consumer and step), so no
program recomputes anything; the price is 32 KB of fp32 reduce traffic into L2 per step, the
accumulator's zeroing and the final cast.

Per step (64 queries x 128 keys): the loader moves Q and dO (2 x 64 x 128 x 2 bytes) and lse2 and
delta (2 x 64 x 4 bytes) into ring slot it % STAGES; each consumer computes its 64 keys' S^T and dP^T
([64 keys, 64 queries], wgmma from shared memory), P^T and dS^T in registers, stores both to shared
memory, runs dV and dK ([64 keys, 128]) from there, and then, after both consumers have written
their halves of dS^T (`ds_ready`, two arrivals), its half of dQ's columns: dQ[:, half] = dS (all 128
keys) K[:, half]. What the measurements said (H200): with lse and delta loaded by the
consumers from global memory right before the first product, the load latency stalled every step
(1.20-1.28x cuDNN, against 1.02-1.09x through the loader); with each consumer computing dQ over its
own 64 keys (no `ds_ready`, twice the reduce traffic) 1.13-1.27x.

Contract (`supports`): Hopper, fp16/bf16, head dim 128, Q/K/V/dO addressable by TMA in place
(gluon_fwd.tma_operands), O and the gradients with unit last stride, a positive scale, no mask, no
dropout (the caller's part). Causal is top-left aligned. GQA: a program walks the query blocks of the
query heads of its KV head (all of them, or GROUP / NG when `group_split` spreads the group over NG
programs, which then add dK and dV into fp32 sums). Rows past Sq / Sk are zero-filled on loads (P^T =
0 there: lse2 = +inf for missing rows, and keys past Sk are masked) and clipped on the dQ reduce;
dK/dV rows past Sk are not stored.
"""
import torch
import triton
import triton.language as tl
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from ...runtime import kernel
from ...runtime.alloc import empty, zeros
from ...runtime.utils import cdiv, sm_count
from . import gluon_fwd as fwd
from .gluon_fwd import CONSUMER_REGS, FIRST, ROWS, SECOND, acc_layout

LOG2E = gl.constexpr(1.4426950408889634)
# keys per program (two consumer warpgroups of ROWS each)
BLOCK_N = 128


@builtin
def _reduce_add(desc, coord, src, _semantic=None):
    """TMA reduce-add of shared-memory tile `src` into `desc` at `coord` (an async bulk group, like a TMA
    store: `tma.store_wait` waits for its read of `src`). Gluon 3.6 builds the op but does not name it."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, desc.handle, coord, src.handle)


@gluon.jit
def _query_blocks(n0, Sq, CAUSAL: gl.constexpr):
    """(first query block, number of blocks) that see keys [n0, n0 + 128): causal, the queries from n0 on."""
    lo = 0
    if CAUSAL:
        lo = n0 // ROWS
    return lo, gl.maximum(gl.cdiv(Sq, ROWS) - lo, 0)


@gluon.jit
def _program(Hkv, GROUP, NG):
    """(batch, KV head, first query head, query heads) of program (key block, (b * Hkv + hk) * NG + g): the
    KV head's GROUP query heads in NG programs of GROUP // NG each."""
    bhg = gl.program_id(1)
    heads = GROUP // NG
    hk = (bhg // NG) % Hkv
    return bhg // (NG * Hkv), hk, hk * GROUP + (bhg % NG) * heads, heads


@gluon.jit
def _bwd_load(q_desc, k_desc, v_desc, do_desc, l_desc, d_desc, q_smem, k_smem, v_smem, do_smem, l_smem, d_smem,
              kv_ready, q_ready, q_empty, Hkv, GROUP, NG, Sq, CAUSAL: gl.constexpr, STAGES: gl.constexpr):
    """K and V of the program's key block once, then Q, dO, lse2 and delta of step it into slot
    it % STAGES once both consumers released the slot's previous step (`q_empty`, two arrivals)."""
    n0 = gl.program_id(0) * (2 * ROWS)
    b, hk, h0, heads = _program(Hkv, GROUP, NG)
    mbarrier.expect(kv_ready, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [b, hk, n0, 0], kv_ready, k_smem)
    tma.async_copy_global_to_shared(v_desc, [b, hk, n0, 0], kv_ready, v_smem)
    lo, nq = _query_blocks(n0, Sq, CAUSAL)
    for it in range(heads * nq):
        s = it % STAGES
        # a fresh barrier counts as released in phase 1: the first loads into each slot do not wait
        mbarrier.wait(q_empty.index(s), ((it // STAGES) & 1) ^ 1)
        mbarrier.expect(q_ready.index(s), q_desc.block_type.nbytes + do_desc.block_type.nbytes
                        + l_desc.block_type.nbytes + d_desc.block_type.nbytes)
        h = h0 + it // nq
        m0 = (lo + it % nq) * ROWS
        tma.async_copy_global_to_shared(q_desc, [b, h, m0, 0], q_ready.index(s), q_smem.index(s))
        tma.async_copy_global_to_shared(do_desc, [b, h, m0, 0], q_ready.index(s), do_smem.index(s))
        tma.async_copy_global_to_shared(l_desc, [b, h, m0], q_ready.index(s), l_smem.index(s))
        tma.async_copy_global_to_shared(d_desc, [b, h, m0], q_ready.index(s), d_smem.index(s))


@gluon.jit
def _bwd_consumer(q_smem, k_smem, v_smem, do_smem, l_smem, d_smem, p_smem, ds_smem, dq_smem, kv_ready, q_ready,
                  q_empty, ds_ready, dq_desc, DK, DV, Hkv, GROUP, NG, Sq, Sk, qk_scale, scale,
                  s_kb, s_kh, s_km, s_vb, s_vh, s_vm, HALF: gl.constexpr, CAUSAL: gl.constexpr, SPLIT: gl.constexpr,
                  STAGES: gl.constexpr, HEAD_D: gl.constexpr):
    """One warpgroup: keys [n0 + HALF * 64, + 64) of the program's block against every query block that
    sees them; dK and dV of those keys at the end (SPLIT: added into fp32 sums, the group's heads being
    split over NG programs), dQ[:, HALF * 64 : + 64] of every step by reduce-add. P^T and dS^T go
    through shared memory and feed dV's and dK's products from there (as register operands they and
    the accumulators did not fit 240 registers: ptxas spilled inside the loop)."""
    s_layout: gl.constexpr = acc_layout(ROWS)          # [64 keys, 64 queries]; also dQ's [64 queries, 64]
    o_layout: gl.constexpr = acc_layout(HEAD_D)        # [64 keys, HEAD_D]: dK, dV
    cols: gl.constexpr = gl.SliceLayout(0, s_layout)
    dtype: gl.constexpr = k_smem.dtype
    n0 = gl.program_id(0) * (2 * ROWS)
    b, hk, h0, heads = _program(Hkv, GROUP, NG)
    lo, nq = _query_blocks(n0, Sq, CAUSAL)
    key0 = n0 + HALF * ROWS
    keys = key0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    k_all = k_smem.reshape([2 * ROWS, HEAD_D])
    k_mine = k_all.slice(HALF * ROWS, ROWS, dim=0)                           # [64 keys, D]: S^T's A
    v_mine = v_smem.reshape([2 * ROWS, HEAD_D]).slice(HALF * ROWS, ROWS, dim=0)
    k_cols = k_all.slice(HALF * ROWS, ROWS, dim=1)                           # [128 keys, 64]: dQ's B
    p_buf = p_smem.index(HALF)
    dq_buf = dq_smem.index(HALF)
    s_zero = gl.zeros([ROWS, ROWS], gl.float32, s_layout)
    dk = gl.zeros([ROWS, HEAD_D], gl.float32, o_layout)
    dv = gl.zeros([ROWS, HEAD_D], gl.float32, o_layout)
    # blocks that need a mask: keys past Sk (last key block), causal queries left of the diagonal
    ragged = n0 + 2 * ROWS > Sk
    mbarrier.wait(kv_ready, 0)
    for it in range(heads * nq):
        s = it % STAGES
        h = h0 + it // nq
        m0 = (lo + it % nq) * ROWS
        qrows = m0 + gl.arange(0, ROWS, layout=cols)
        mbarrier.wait(q_ready.index(s), (it // STAGES) & 1)
        q = q_smem.index(s).reshape([ROWS, HEAD_D])
        do = do_smem.index(s).reshape([ROWS, HEAD_D])
        # lse2 (+inf for rows past Sq or without a visible key: P = 0 there) seeds S^T's accumulator at
        # -lse2 / qk_scale, so that it does not stay live (16 registers) across the products; dP^T's
        # starts at zero (started at -delta, ptxas waited for S^T's product before issuing it)
        lse2 = l_smem.index(s).reshape([ROWS]).load(cols) * (1.0 / qk_scale)
        st_tok = warpgroup_mma(k_mine, q.permute((1, 0)), s_zero - lse2[None, :], is_async=True)
        dpt_tok = warpgroup_mma(v_mine, do.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        # wgmma groups retire in order: with one outstanding, S^T is done and dP^T may still run
        st = warpgroup_mma_wait(num_outstanding=1, deps=(st_tok,))
        pt = gl.exp2(st * qk_scale)
        masked = ragged
        if CAUSAL:
            masked = masked | (m0 < n0 + 2 * ROWS)
        if masked:
            keep = (keys < Sk)[:, None]
            if CAUSAL:
                keep = keep & (qrows[None, :] >= keys[:, None])
            pt = gl.where(keep, pt, 0.0)
        # (the previous step's dV product has read p_buf: its wait below retired every group)
        p_buf.store(pt.to(dtype))
        fence_async_shared()
        gl.thread_barrier()
        dv_tok = warpgroup_mma(p_buf, do, dv, is_async=True)
        dpt = warpgroup_mma_wait(num_outstanding=1, deps=(dpt_tok,))
        delta = d_smem.index(s).reshape([ROWS]).load(cols)
        dst = (pt * (dpt - delta[None, :]) * scale).to(dtype)
        # dS^T of both halves in shared memory (buffer it % 2: a consumer writes it again two steps on,
        # after the other passed the next step's `ds_ready`, so after its dQ product of this one)
        db = it % 2
        ds_buf = ds_smem.index(db)
        ds_mine = ds_buf.slice(HALF * ROWS, ROWS, dim=0)
        ds_mine.store(dst)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(ds_ready.index(db))
        dk_tok = warpgroup_mma(ds_mine, q, dk, is_async=True)
        mbarrier.wait(ds_ready.index(db), (it // 2) & 1)
        dq_tok = warpgroup_mma(ds_buf.permute((1, 0)), k_cols, s_zero, use_acc=False, is_async=True)
        dv, dk, dq = warpgroup_mma_wait(num_outstanding=0, deps=(dv_tok, dk_tok, dq_tok))
        mbarrier.arrive(q_empty.index(s))
        # the previous step's reduce has read its staging buffer before it is written again
        tma.store_wait(pendings=0)
        gl.thread_barrier()
        dq_buf.reshape([ROWS, ROWS]).store(dq)
        fence_async_shared()
        gl.thread_barrier()
        _reduce_add(dq_desc, [b, h, m0, HALF * ROWS], dq_buf)
    tma.store_wait(pendings=0)
    # dK, dV of this warpgroup's keys (rows past Sk are not stored)
    d = gl.arange(0, HEAD_D, layout=gl.SliceLayout(0, o_layout))
    krows = key0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
    kmask = (krows < Sk)[:, None]
    rows64 = krows.to(gl.int64)[:, None]
    dk_ptrs = DK + b.to(gl.int64) * s_kb + hk.to(gl.int64) * s_kh + rows64 * s_km + d[None, :]
    dv_ptrs = DV + b.to(gl.int64) * s_vb + hk.to(gl.int64) * s_vh + rows64 * s_vm + d[None, :]
    if SPLIT:
        gl.atomic_add(dk_ptrs, dk, mask=kmask, sem="relaxed")
        gl.atomic_add(dv_ptrs, dv, mask=kmask, sem="relaxed")
    else:
        gl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=kmask)
        gl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=kmask)


@kernel
@gluon.jit
def attn_bwd_gluon(q_desc, k_desc, v_desc, do_desc, l_desc, d_desc, dq_desc, DK, DV, Hkv, GROUP, NG, Sq, Sk, qk_scale,
                   scale, s_kb, s_kh, s_km, s_vb, s_vh, s_vm,
                   CAUSAL: gl.constexpr, SPLIT: gl.constexpr, STAGES: gl.constexpr):
    """dK, dV of the program's 128 keys (program (key block, (batch * KV head) * NG + g)) and its share of
    dQ. SPLIT (NG > 1): DK / DV are fp32 sums the NG programs of a KV head add into.

    Warp-specialized: the kernel's 4 warps load, two worker warpgroups compute keys 0-63 and 64-127.
    Barriers: `kv_ready` (K and V landed, once), per ring slot `q_ready` / `q_empty` (Q and dO landed /
    both consumers are done with them), and per dS^T buffer `ds_ready` (both halves written). Step it
    of the program uses slot it % STAGES with phase (it // STAGES) & 1 and dS^T buffer it % 2 with
    phase (it // 2) & 1."""
    HEAD_D: gl.constexpr = k_desc.block_type.shape[3]
    dtype: gl.constexpr = k_desc.dtype
    k_smem = gl.allocate_shared_memory(dtype, k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, v_desc.block_type.shape, v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    l_smem = gl.allocate_shared_memory(gl.float32, [STAGES] + l_desc.block_type.shape, l_desc.layout)
    d_smem = gl.allocate_shared_memory(gl.float32, [STAGES] + d_desc.block_type.shape, d_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([2 * ROWS, ROWS], dtype)
    ds_smem = gl.allocate_shared_memory(dtype, [2, 2 * ROWS, ROWS], ds_layout)
    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, ROWS], dtype)
    p_smem = gl.allocate_shared_memory(dtype, [2, ROWS, ROWS], p_layout)
    dq_smem = gl.allocate_shared_memory(gl.float32, [2] + dq_desc.block_type.shape, dq_desc.layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)
    for i in gl.static_range(2):
        mbarrier.init(ds_ready.index(i), count=2)
    gl.warp_specialize([
        (_bwd_load, (q_desc, k_desc, v_desc, do_desc, l_desc, d_desc, q_smem, k_smem, v_smem, do_smem, l_smem,
                     d_smem, kv_ready, q_ready, q_empty, Hkv, GROUP, NG, Sq, CAUSAL, STAGES)),
        (_bwd_consumer, (q_smem, k_smem, v_smem, do_smem, l_smem, d_smem, p_smem, ds_smem, dq_smem, kv_ready,
                         q_ready, q_empty, ds_ready, dq_desc, DK, DV, Hkv, GROUP, NG, Sq, Sk, qk_scale, scale,
                         s_kb, s_kh, s_km, s_vb, s_vh, s_vm, FIRST, CAUSAL, SPLIT, STAGES, HEAD_D)),
        (_bwd_consumer, (q_smem, k_smem, v_smem, do_smem, l_smem, d_smem, p_smem, ds_smem, dq_smem, kv_ready,
                         q_ready, q_empty, ds_ready, dq_desc, DK, DV, Hkv, GROUP, NG, Sq, Sk, qk_scale, scale,
                         s_kb, s_kh, s_km, s_vb, s_vh, s_vm, SECOND, CAUSAL, SPLIT, STAGES, HEAD_D)),
    ], [4, 4], [CONSUMER_REGS, CONSUMER_REGS])


@kernel
@triton.jit
def attn_bwd_gluon_pre(O, DO, LSE, DELTA, LSE2, ACC, Hq, Sq, SQP, s_ob, s_oh, s_om, s_gb, s_gh, s_gm, s_lb, s_lh, s_lm,
                       BLOCK_M: tl.constexpr, HEAD_D: tl.constexpr):
    """Per row of [B, Hq, SQP]: delta = rowsum(dO * O) and lse2 = lse * log2(e) (+inf past Sq, or for an lse
    of -inf: a row without a visible key), padded to SQP rows so that their row strides suit TMA (16
    bytes); and the fp32 dQ accumulator's rows zeroed. Reads O and dO (2 x 2 x D bytes a row), writes
    4 x D + 8 bytes a row."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // Hq
    h = bh % Hq
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_D)
    valid = rows < Sq
    r64 = rows[:, None].to(tl.int64)
    o = tl.load(O + b * s_ob + h * s_oh + r64 * s_om + d[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    g = tl.load(DO + b * s_gb + h * s_gh + r64 * s_gm + d[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
    lse = tl.load(LSE + b * s_lb + h * s_lh + rows * s_lm, mask=valid, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    padded = rows < SQP
    tl.store(DELTA + bh * SQP + rows, tl.sum(o * g, 1), mask=padded)
    tl.store(LSE2 + bh * SQP + rows, lse2, mask=padded)
    tl.store(ACC + bh * Sq * HEAD_D + r64 * HEAD_D + d[None, :], tl.zeros([BLOCK_M, HEAD_D], tl.float32),
             mask=valid[:, None])


@kernel
@triton.jit
def attn_bwd_cast(ACC, OUT, H, S, s_b, s_h, s_m, BLOCK_M: tl.constexpr, HEAD_D: tl.constexpr):
    """OUT = an fp32 sum ([B, H, S, D] contiguous: dQ's, or split GQA's dK / dV) in OUT's dtype and strides
    (unit last stride)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_D)
    mask = (rows < S)[:, None]
    acc = tl.load(ACC + bh * S * HEAD_D + rows[:, None] * HEAD_D + d[None, :], mask=mask)
    out = OUT + (bh // H) * s_b + (bh % H) * s_h + rows[:, None].to(tl.int64) * s_m + d[None, :]
    tl.store(out, acc.to(OUT.dtype.element_ty), mask=mask)


def _cast(acc, out):
    B, H, S, D = out.shape
    BM = 32
    attn_bwd_cast[(cdiv(S, BM), B * H)](acc, out, H, S, out.stride(0), out.stride(1), out.stride(2), BM, D,
                                        num_warps=4)


STAGES = 2
# False: every backward takes sdpa.py's Triton kernels (benchmarks compare the two)
enabled = True


def supports(q, k, v, o, do, dq, dk, dv, scale) -> bool:
    """Whether `launch` computes this backward (no mask or dropout: the caller's part of the contract;
    a positive scale: the kernel divides the logsumexp by it)."""
    return (enabled and q.shape[3] == 128 and scale > 0 and fwd.tma_operands(q, k, v, do)
            and all(t.stride(-1) == 1 for t in (o, dq, dk, dv)))


def group_split(programs: int, group: int, sms: int) -> int:
    """Programs per KV head's query-head group: 1 (dK/dV complete in one program) unless that leaves
    fewer than two programs per SM; then the smallest divisor of the group that reaches it (GQA
    32/4 at 2048 tokens: 64 programs walking 8 heads each took 3.2x cuDNN's time, H200)."""
    for ng in range(1, group + 1):
        if group % ng == 0 and programs * ng >= 2 * sms:
            return ng
    return group


def launch(do, q, k, v, o, lse, dq, dk, dv, causal: bool, scale: float):
    """dq, dk, dv ([B, H, S, D], unit last stride) from do, q, k, v, o (`supports` said yes) and lse [B, Hq, Sq]
    (natural log, any strides): the pre-kernel, the main kernel, the casts of the fp32 sums."""
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    group = Hq // Hkv
    nkb = cdiv(Sk, BLOCK_N)
    ng = group_split(nkb * B * Hkv, group, sm_count(q.device)) if group > 1 else 1
    sqp = cdiv(Sq, 4) * 4
    acc = empty((B, Hq, Sq, D), torch.float32, q.device)       # zeroed by the pre-kernel
    lse2 = empty((B, Hq, sqp), torch.float32, q.device)
    delta = empty((B, Hq, sqp), torch.float32, q.device)
    BM = 32
    attn_bwd_gluon_pre[(cdiv(sqp, BM), B * Hq)](
        o, do, lse, delta, lse2, acc, Hq, Sq, sqp, o.stride(0), o.stride(1), o.stride(2), do.stride(0),
        do.stride(1), do.stride(2), lse.stride(0), lse.stride(1), lse.stride(2), BM, D, num_warps=4)
    if ng > 1:
        dk_out = zeros((B, Hkv, Sk, D), torch.float32, q.device)
        dv_out = zeros((B, Hkv, Sk, D), torch.float32, q.device)
    else:
        dk_out, dv_out = dk, dv
    rows = ROWS.value
    qd = fwd.desc(q, [1, 1, rows, D])
    dod = fwd.desc(do, [1, 1, rows, D])
    kd = fwd.desc(k, [1, 1, BLOCK_N, D])
    vd = fwd.desc(v, [1, 1, BLOCK_N, D])
    ld = fwd.desc(lse2, [1, 1, rows])
    dd = fwd.desc(delta, [1, 1, rows])
    dqd = fwd.desc(acc, [1, 1, rows, rows])
    ks, vs = dk_out.stride(), dv_out.stride()
    attn_bwd_gluon[(nkb, B * Hkv * ng)](
        qd, kd, vd, dod, ld, dd, dqd, dk_out, dv_out, Hkv, group, ng, Sq, Sk, float(scale * LOG2E.value),
        float(scale), ks[0], ks[1], ks[2], vs[0], vs[1], vs[2], bool(causal), ng > 1, STAGES,
        num_warps=4, num_stages=1)
    _cast(acc, dq)
    if ng > 1:
        _cast(dk_out, dk)
        _cast(dv_out, dv)
