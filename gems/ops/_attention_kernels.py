"""Triton kernels of Gems' fused attention (no `register` here: gems/ops/attention.py wraps them).

Notation: q [B, Hq, Sq, D], k/v [B, Hkv, Sk, D] (Hq = GROUP * Hkv; query head h reads KV head
h // GROUP, so grouped-query attention never materializes repeated K/V), an optional bias broadcast
to [B, Hq, Sq, Sk] read through its strides (0 on broadcast dims; float = additive, bool = keep where
True), `is_causal` top-left aligned like SDPA's math (key j visible to query i iff j <= i).

    S = scale * q k^T + bias,   P = softmax(S) (a row with no visible key gives P = 0, out = 0),
    out = P v,                  lse = logsumexp(S) in natural log (0 for a row with no visible key)

Forward (`attn_fwd`): one program per (BLOCK_M queries, batch*head[, KV split]); online softmax in base 2
(scores pre-multiplied by scale*log2(e), so exp2 is one MUFU op), fp32 accumulators; the key blocks that
need no mask (below the causal diagonal and inside Sk) run in a loop without masks, the diagonal and
the ragged last block in a second, masked loop; blocks above the diagonal are never visited.
Split-KV (decode, few programs): each program also takes one slice of the keys and writes its partial
(out / l, m, l) in fp32; `attn_combine` merges the slices (flash-decoding).
Dropout (DROPOUT): P V takes P * keep, keep = `_dropout_keep`(Philox seed, offset; query row, key) < 1 - p,
the row sum all of P, the output 1 / (1 - p); the backward needs keep per tile again:
dV = (P * Z)^T dO, dP = (dO V^T) * Z (Z = keep / (1 - p)), and delta = rowsum(dO * O) stays right.
DROPOUT == 1: the backward kernels regenerate keep from Philox; DROPOUT == 2: the forward also writes it
as bits after [seed, offset] in the state tensor (`_keep_fwd`), and the backward reads them (`_keep`).
Backward: `attn_bwd_pre` delta = rowsum(dO * O); `attn_bwd_dkdv` one program per (BLOCK_N keys, batch *
KV head) walks every query block of every query head of its group (deterministic: no atomics, GQA
gradients summed in registers; when that leaves SMs idle the group is spread over programs writing fp32
partials that `attn_bwd_group_sum` adds, still deterministic); `attn_bwd_dq` one program per (BLOCK_M
queries, batch*head) walks the keys. dQ and dK/dV recompute P from the saved logsumexp.
"""
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
NEG_INF = tl.constexpr(float("-inf"))
POS_INF = tl.constexpr(float("inf"))
# a stored dropout mask's bytes per 128 keys of a query row (a byte per quad of keys); attention.py
# sizes the state tensor with it
MASK_BYTES_PER_128 = tl.constexpr(32)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    # fp32 inputs: full fp32 products (ATen's fp32 attention is not tf32); fp16/bf16: tensor cores
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _dot_acc(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b, accumulated by the MMA itself."""
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _bias_tile(b_ptrs, mask, BIAS_BOOL: tl.constexpr):
    """A bias tile in the log2 domain (fp32)."""
    if BIAS_BOOL:
        keep = tl.load(b_ptrs, mask=mask, other=1)
        return tl.where(keep != 0, 0.0, NEG_INF)
    else:
        return tl.load(b_ptrs, mask=mask, other=0.0).to(tl.float32) * LOG2E


@triton.jit
def _bias_keys(b_row, n, stride_bn, Sk, BIAS_BOOL: tl.constexpr):
    """A bias that does not vary along the queries (a padding mask [B, 1, 1, Sk], or one query): one
    vector over the block's keys, in the log2 domain, broadcast over the rows by the caller (BLOCK_M
    times fewer loads than a tile)."""
    return _bias_tile(b_row + n * stride_bn, n < Sk, BIAS_BOOL)


@triton.jit
def _philox_quads(seed, offset, rows, col0, BM: tl.constexpr, BN: tl.constexpr):
    """Philox(seed; counter (key // 4, row, offset low, offset high)) for the [BM, BN] block of query rows
    `rows` (global ids (b * Hq + h) * Sq + i) and keys col0 ... col0 + BN - 1 (col0 % 4 == 0): four
    [BM, BN / 4] uint32, r_t[:, c] for key col0 + 4c + t. A function of the positions only, so the
    backward's tiles (any block shape) regenerate the same numbers."""
    offset = offset.to(tl.int64)
    c0 = tl.broadcast_to((col0 // 4 + tl.arange(0, BN // 4))[None, :], [BM, BN // 4]).to(tl.uint32)
    c1 = tl.broadcast_to(rows[:, None], [BM, BN // 4]).to(tl.uint32)
    zero = tl.zeros([BM, BN // 4], tl.uint32)
    c2 = zero + (offset & 0xFFFFFFFF).to(tl.uint32)
    c3 = zero + ((offset >> 32) & 0xFFFFFFFF).to(tl.uint32)
    return tl.philox(seed, c0, c1, c2, c3)


@triton.jit
def _quads(r0, r1, r2, r3, BM: tl.constexpr, BN: tl.constexpr):
    """[BM, BN / 4] x 4 -> [BM, BN]: key 4c + t takes r_t[:, c] ([BM, BN/4, 2, 2] -> [BM, BN])."""
    return tl.reshape(tl.join(tl.join(r0, r1), tl.join(r2, r3)), [BM, BN])


@triton.jit
def _dropout_keep(seed, offset, rows, col0, thr, BM: tl.constexpr, BN: tl.constexpr):
    """Which scores of the [BM, BN] block dropout keeps: a key's Philox uint32 < thr = keep prob * 2**32."""
    r0, r1, r2, r3 = _philox_quads(seed, offset, rows, col0, BM, BN)
    return _quads(r0, r1, r2, r3, BM, BN) < thr.to(tl.uint32)


@triton.jit
def _bits_row(Sk):
    """Bytes per query row of a stored dropout mask (4 bits per byte: one byte per quad of keys): rows
    padded to 128 keys, so every key block (<= 128 keys, a divisor of 128) lies inside its row."""
    return ((Sk + 127) // 128) * MASK_BYTES_PER_128


@triton.jit
def _bits_ptrs(Bits, rows, col0, Sk, BN: tl.constexpr):
    """[BM, BN / 4] byte pointers of the key quads col0 / 4 ... (col0 + BN) / 4 - 1."""
    return Bits + rows[:, None] * _bits_row(Sk) + (col0 // 4 + tl.arange(0, BN // 4))[None, :]


@triton.jit
def _keep_fwd(seed, offset, rows, rmask, col0, thr, Bits, Sk, BM: tl.constexpr, BN: tl.constexpr,
              DROPOUT: tl.constexpr):
    """The forward's keep tile; DROPOUT == 2 also stores it (bit t of byte c: key 4c + t), packed in the
    layout Philox computes it in (a quad per byte: packing 8 keys per byte needed a reshape of the tile
    that doubled the forward's time at BERT's 512 tokens), so the backward reads BM * BN / 4 bytes
    instead of running Philox again (10 rounds per 4 scores, about half of each backward kernel)."""
    r0, r1, r2, r3 = _philox_quads(seed, offset, rows, col0, BM, BN)
    t = thr.to(tl.uint32)
    if DROPOUT == 2:
        nib = ((r0 < t).to(tl.uint8) | ((r1 < t).to(tl.uint8) << 1) | ((r2 < t).to(tl.uint8) << 2)
               | ((r3 < t).to(tl.uint8) << 3))
        tl.store(_bits_ptrs(Bits, rows, col0, Sk, BN), nib, mask=rmask[:, None])
    return _quads(r0, r1, r2, r3, BM, BN) < t


@triton.jit
def _keep(seed, offset, rows, rmask, col0, thr, Bits, Sk, BM: tl.constexpr, BN: tl.constexpr,
          DROPOUT: tl.constexpr):
    """The backward's keep tile [BM, BN]: DROPOUT == 2 reads the forward's bits, 1 regenerates Philox."""
    if DROPOUT == 2:
        nib = tl.load(_bits_ptrs(Bits, rows, col0, Sk, BN), mask=rmask[:, None], other=0)
        return _quads(nib & 1, nib & 2, nib & 4, nib & 8, BM, BN) != 0
    else:
        return _dropout_keep(seed, offset, rows, col0, thr, BM, BN)


@triton.jit
def _bits_base(State, DROPOUT: tl.constexpr):
    """The stored mask's bytes: after the [seed, offset] pair of the state tensor (DROPOUT == 2)."""
    if DROPOUT == 2:
        return (State + 2).to(tl.pointer_type(tl.uint8), bitcast=True)
    else:
        return State


@triton.jit
def _fwd_block(acc, l_i, m_i, q, k_base, v_base, b_rows, start_n, rm, rvalid, offs_n, offs_d,
               stride_kn, stride_kd, stride_vn, stride_vd, stride_bn, Sk, D, qk_scale,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_BOOL: tl.constexpr,
               BIAS_ROW: tl.constexpr, EVEN_D: tl.constexpr, IEEE: tl.constexpr,
               seed, offset, grow, thr, Bits, DROPOUT: tl.constexpr, KD, VD, kv_b, kv_h, TMA: tl.constexpr):
    n = start_n + offs_n
    kt_ptrs = k_base + n[None, :] * stride_kn + offs_d[:, None] * stride_kd     # [BLOCK_D, BLOCK_N]
    v_ptrs = v_base + n[:, None] * stride_vn + offs_d[None, :] * stride_vd      # [BLOCK_N, BLOCK_D]
    if TMA:
        # K, V tiles by TMA ([1, 1, BLOCK_N, D] boxes; keys past Sk arrive as zeros): no per-thread
        # address math, the copy engine streams 2 x BLOCK_N x D x 2 bytes per step
        kt = tl.trans(tl.reshape(KD.load([kv_b, kv_h, start_n, 0]), [offs_n.shape[0], offs_d.shape[0]]))
        v = tl.reshape(VD.load([kv_b, kv_h, start_n, 0]), [offs_n.shape[0], offs_d.shape[0]])
    elif MASKED:
        if EVEN_D:
            kt = tl.load(kt_ptrs, mask=n[None, :] < Sk, other=0.0)
            v = tl.load(v_ptrs, mask=n[:, None] < Sk, other=0.0)
        else:
            kt = tl.load(kt_ptrs, mask=(n[None, :] < Sk) & (offs_d[:, None] < D), other=0.0)
            v = tl.load(v_ptrs, mask=(n[:, None] < Sk) & (offs_d[None, :] < D), other=0.0)
    else:
        if EVEN_D:
            kt = tl.load(kt_ptrs)
            v = tl.load(v_ptrs)
        else:
            kt = tl.load(kt_ptrs, mask=offs_d[:, None] < D, other=0.0)
            v = tl.load(v_ptrs, mask=offs_d[None, :] < D, other=0.0)
    qk = _dot(q, kt, IEEE)
    if MASKED:
        valid = n[None, :] < Sk
        if CAUSAL:
            valid = valid & (n[None, :] <= rm[:, None])
    if HAS_BIAS:
        if BIAS_ROW:     # b_rows: one pointer, the bias row every query of the block shares
            s = qk * qk_scale + _bias_keys(b_rows, n, stride_bn, Sk, BIAS_BOOL)[None, :]
        else:
            b_ptrs = b_rows[:, None] + n[None, :] * stride_bn
            if MASKED:
                bmask = rvalid[:, None] & (n[None, :] < Sk)
            else:
                bmask = rvalid[:, None]
            s = qk * qk_scale + _bias_tile(b_ptrs, bmask, BIAS_BOOL)
        if MASKED:
            s = tl.where(valid, s, NEG_INF)
        m_new = tl.maximum(m_i, tl.max(s, 1))
    else:
        # no bias: the scale (> 0, the wrapper checks) commutes with the max, so the exponent below
        # is one fused multiply-add per score
        if MASKED:
            qk = tl.where(valid, qk, NEG_INF)
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    # a row with nothing visible yet keeps m = -inf: shift by 0 so exp2 gives 0, not NaN
    m_use = tl.where(m_new == NEG_INF, 0.0, m_new)
    if HAS_BIAS:
        p = tl.math.exp2(s - m_use[:, None])
    else:
        p = tl.math.exp2(qk * qk_scale - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    # dropout zeroes P's entries after the softmax: the row sum (the softmax's denominator, and the lse)
    # takes every entry, P V only the kept ones (the 1 / keep scale is applied once, at the end)
    if DROPOUT:
        keep = _keep_fwd(seed, offset, grow, rvalid, start_n, thr, Bits, Sk, p.shape[0], p.shape[1], DROPOUT)
        pv = tl.where(keep, p, 0.0)
    else:
        pv = p
    # P V accumulates into the rescaled accumulator inside the MMA (Hopper's wgmma adds to its
    # registers): a separate product plus an add would hold a second [BLOCK_M, BLOCK_D] fp32 tile
    acc = _dot_acc(pv.to(v.dtype), v, acc * alpha[:, None], IEEE)
    # the row sum last: its registers are live for the shortest time
    l_i = l_i * alpha + tl.sum(p, 1)
    return acc, l_i, m_new


@triton.jit(do_not_specialize=["seed", "offset"])   # per-call values: one binary for every call
def attn_fwd(Q, K, V, KD, VD, Bias, O, LSE, ML,
             stride_qb, stride_qh, stride_qm, stride_qd,
             stride_kb, stride_kh, stride_kn, stride_kd,
             stride_vb, stride_vh, stride_vn, stride_vd,
             stride_bb, stride_bh, stride_bm, stride_bn,
             stride_ob, stride_oh, stride_om, stride_od, stride_os,
             stride_lb, stride_lh, stride_lm, stride_ls,
             Hq, GROUP, Sq, Sk, D, qk_scale, SPLIT_LEN, seed, offset, thr, inv_keep, SeedOut,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
             CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_BOOL: tl.constexpr, EVEN_D: tl.constexpr,
             IEEE: tl.constexpr, SPLIT: tl.constexpr, STORE_LSE: tl.constexpr, REVERSE: tl.constexpr,
             PACK: tl.constexpr, BIAS_ROW: tl.constexpr, DROPOUT: tl.constexpr, TMA: tl.constexpr):
    """out/lse of one query block (SPLIT: the partial out/l, m of one key slice, fp32).

    PACK (GQA decode): the block's rows are (query head of the group, query) pairs of one KV head,
    so the group's heads share each K/V tile instead of reading it GROUP times; axis 1 is B * Hkv.
    BIAS_ROW: the bias is the same for every row of the block (stride 0 along the queries, and along
    the heads when PACK; or one query): it is read as one vector per key block.
    DROPOUT: P's entries are kept with probability thr / 2**32 (`_dropout_keep`; Philox seed, offset per
    call) and the output scaled by inv_keep; program (0, 0, 0) writes (seed, offset) to SeedOut, where the
    backward kernels read them; DROPOUT == 2: every program also writes its keep bits after them.
    TMA (decode on Hopper): K and V come through the descriptors KD, VD ([B, Hkv, Sk, D] boxes of
    [1, 1, BLOCK_N, D]); otherwise KD, VD are unused."""
    if REVERSE:   # causal: the longest rows first, so the last wave is short
        pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    if PACK:
        Hkv = Hq // GROUP
        b = (pid_bh // Hkv).to(tl.int64)
        hk = (pid_bh % Hkv).to(tl.int64)
        rh = hk * GROUP + offs_m // Sq          # per row: query head, query index
        rm = offs_m % Sq
        rvalid = offs_m < GROUP * Sq
        q_rows = b * stride_qb + rh * stride_qh + rm * stride_qm
        b_rows = Bias + b * stride_bb + rh * stride_bh + rm * stride_bm
        o_rows = b * stride_ob + rh * stride_oh + rm * stride_om
        l_rows = b * stride_lb + rh * stride_lh + rm * stride_lm
    else:
        b = (pid_bh // Hq).to(tl.int64)
        h = pid_bh % Hq
        hk = (h // GROUP).to(tl.int64)
        h = h.to(tl.int64)
        rm = offs_m
        rvalid = offs_m < Sq
        q_rows = b * stride_qb + h * stride_qh + offs_m * stride_qm
        b_rows = Bias + b * stride_bb + h * stride_bh + offs_m * stride_bm
        o_rows = b * stride_ob + h * stride_oh + offs_m * stride_om
        l_rows = b * stride_lb + h * stride_lh + offs_m * stride_lm
    if BIAS_ROW:
        if PACK:
            b_rows = Bias + b * stride_bb + hk * GROUP * stride_bh
        else:
            b_rows = Bias + b * stride_bb + h * stride_bh
    grow = offs_m
    if DROPOUT:
        if PACK:
            grow = (b * Hq + rh) * Sq + rm
        else:
            grow = (b * Hq + h) * Sq + offs_m
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0) & (tl.program_id(2) == 0):
            tl.store(SeedOut, seed)
            tl.store(SeedOut + 1, offset)
    Bits = _bits_base(SeedOut, DROPOUT)
    q_ptrs = Q + q_rows[:, None] + offs_d[None, :] * stride_qd
    if EVEN_D:
        q = tl.load(q_ptrs, mask=rvalid[:, None], other=0.0)
    else:
        q = tl.load(q_ptrs, mask=rvalid[:, None] & (offs_d[None, :] < D), other=0.0)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    kv_b = b.to(tl.int32)
    kv_h = hk.to(tl.int32)
    # keys [0, hi) are visible to some row of this block; [0, hi_full) to every row, without a mask
    if CAUSAL:
        if PACK:
            hi = tl.minimum(Sk, Sq)
            hi_full = 0
        else:
            hi = tl.minimum(Sk, start_m + BLOCK_M)
            hi_full = tl.minimum((start_m // BLOCK_N) * BLOCK_N, (Sk // BLOCK_N) * BLOCK_N)
    else:
        hi = Sk
        hi_full = (Sk // BLOCK_N) * BLOCK_N
    if SPLIT:
        lo = tl.program_id(2) * SPLIT_LEN
        end = lo + SPLIT_LEN
        hi_full_s = tl.minimum(hi_full, end)
        lo2 = tl.maximum(lo, hi_full)
        hi_s = tl.minimum(hi, end)
    else:
        lo = 0
        hi_full_s = hi_full
        lo2 = hi_full
        hi_s = hi
    m_i = tl.full([BLOCK_M], NEG_INF, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(lo, hi_full_s, BLOCK_N):
        acc, l_i, m_i = _fwd_block(acc, l_i, m_i, q, k_base, v_base, b_rows, start_n, rm, rvalid, offs_n, offs_d,
                                   stride_kn, stride_kd, stride_vn, stride_vd, stride_bn, Sk, D,
                                   qk_scale, False, CAUSAL, HAS_BIAS, BIAS_BOOL, BIAS_ROW, EVEN_D, IEEE,
                                   seed, offset, grow, thr, Bits, DROPOUT, KD, VD, kv_b, kv_h, TMA)
    for start_n in range(lo2, hi_s, BLOCK_N):
        acc, l_i, m_i = _fwd_block(acc, l_i, m_i, q, k_base, v_base, b_rows, start_n, rm, rvalid, offs_n, offs_d,
                                   stride_kn, stride_kd, stride_vn, stride_vd, stride_bn, Sk, D,
                                   qk_scale, True, CAUSAL, HAS_BIAS, BIAS_BOOL, BIAS_ROW, EVEN_D, IEEE,
                                   seed, offset, grow, thr, Bits, DROPOUT, KD, VD, kv_b, kv_h, TMA)
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    if DROPOUT:
        out = out * inv_keep
    split_off = 0
    if SPLIT:
        split_off = tl.program_id(2).to(tl.int64)
    o_ptrs = O + split_off * stride_os + o_rows[:, None] + offs_d[None, :] * stride_od
    if EVEN_D:
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=rvalid[:, None])
    else:
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=rvalid[:, None] & (offs_d[None, :] < D))
    l_ptrs = LSE + split_off * stride_ls + l_rows
    if SPLIT:
        # partial statistics: m (log2 domain) in LSE, l in ML
        tl.store(l_ptrs, m_i, mask=rvalid)
        tl.store(ML + split_off * stride_ls + l_rows, l_i, mask=rvalid)
    elif STORE_LSE:
        lse = tl.where(empty, 0.0, (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * LN2)
        tl.store(l_ptrs, lse, mask=rvalid)


@triton.jit
def attn_combine(OP, MP, LP, O, LSE, NSPLIT, Hq,
                 stride_ps, stride_pb, stride_ph, stride_pm,
                 stride_ms, stride_mb, stride_mh, stride_mm,
                 stride_ob, stride_oh, stride_om, stride_od,
                 stride_lb, stride_lh, stride_lm,
                 BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr, D, STORE_LSE: tl.constexpr):
    """Merge the split partials of one query row: out = sum_s w_s out_s / sum_s w_s, w_s = l_s 2^(m_s - max m).

    Every split at once: one [BLOCK_S, BLOCK_D] fp32 load (at most 64 x 256 x 4 = 64 KiB per row), so the
    memory latency is paid once per row instead of once per split (a loop over 32 splits took 8.6 us
    on an H200, this 2-3)."""
    i = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hq).to(tl.int64)
    h = (pid_bh % Hq).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    smask = offs_s < NSPLIT
    st = b * stride_mb + h * stride_mh + i * stride_mm + offs_s * stride_ms
    m_s = tl.load(MP + st, mask=smask, other=NEG_INF)
    l_s = tl.load(LP + st, mask=smask, other=0.0)
    m_tot = tl.max(m_s, 0)
    m_use = tl.where(m_tot == NEG_INF, 0.0, m_tot)
    w = tl.where(l_s == 0.0, 0.0, l_s * tl.math.exp2(m_s - m_use))
    w_tot = tl.sum(w, 0)
    if EVEN_D:
        mask = smask[:, None]
    else:
        mask = smask[:, None] & (offs_d[None, :] < D)
    o_s = tl.load(OP + b * stride_pb + h * stride_ph + i * stride_pm + offs_s[:, None] * stride_ps + offs_d[None, :],
                  mask=mask, other=0.0)
    empty = w_tot == 0.0
    out = tl.sum(w[:, None] * o_s, 0) / tl.where(empty, 1.0, w_tot)
    o_ptrs = O + b * stride_ob + h * stride_oh + i * stride_om + offs_d * stride_od
    if EVEN_D:
        tl.store(o_ptrs, out.to(O.dtype.element_ty))
    else:
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=offs_d < D)
    if STORE_LSE:
        lse = tl.where(empty, 0.0, (m_use + tl.math.log2(tl.where(empty, 1.0, w_tot))) * LN2)
        tl.store(LSE + b * stride_lb + h * stride_lh + i * stride_lm, lse)


@triton.jit
def attn_bwd_pre(O, DO, Delta, Hq, Sq, D,
                 stride_ob, stride_oh, stride_om, stride_od,
                 stride_gb, stride_gh, stride_gm, stride_gd,
                 BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """delta[b, h, m] = sum_d dO * O (fp32), Delta contiguous [B, Hq, Sq]."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hq).to(tl.int64)
    h = (pid_bh % Hq).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m[:, None] < Sq) & (offs_d[None, :] < D)
    o = tl.load(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od,
                mask=mask, other=0.0).to(tl.float32)
    g = tl.load(DO + b * stride_gb + h * stride_gh + offs_m[:, None] * stride_gm + offs_d[None, :] * stride_gd,
                mask=mask, other=0.0).to(tl.float32)
    tl.store(Delta + pid_bh.to(tl.int64) * Sq + offs_m, tl.sum(o * g, 1), mask=offs_m < Sq)


@triton.jit
def _lse2(LSE_row_ptrs, mask):
    """lse (natural log) -> log2 domain; a missing row (or an lse of -inf from a row with no visible
    key) becomes +inf, which makes P = 0 for it without a separate mask."""
    lse = tl.load(LSE_row_ptrs, mask=mask, other=POS_INF).to(tl.float32) * LOG2E
    return tl.where(lse == NEG_INF, POS_INF, lse)


@triton.jit
def _dkdv_block(dk, dv, k, v, q_base, do_base, b_base, lse_base, delta_base, start_m, offs_n, offs_m0, offs_d,
                stride_qm, stride_qd, stride_gm, stride_gd, stride_bm, stride_bn, stride_lm,
                Sq, Sk, D, qk_scale, DIAG: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                BIAS_BOOL: tl.constexpr, BIAS_ROW: tl.constexpr, EVEN_D: tl.constexpr, IEEE: tl.constexpr,
                seed, offset, grow0, start_n, thr, inv_keep, Bits, DROPOUT: tl.constexpr):
    offs_m = start_m + offs_m0
    rmask = offs_m < Sq
    if EVEN_D:
        lmask = rmask[:, None]
    else:
        lmask = rmask[:, None] & (offs_d[None, :] < D)
    q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd, mask=lmask, other=0.0)
    do = tl.load(do_base + offs_m[:, None] * stride_gm + offs_d[None, :] * stride_gd, mask=lmask, other=0.0)
    lse2 = _lse2(lse_base + offs_m * stride_lm, rmask)
    delta = tl.load(delta_base + offs_m, mask=rmask, other=0.0)
    st = _dot(k, tl.trans(q), IEEE) * qk_scale                     # [BLOCK_N, BLOCK_M], log2 domain
    if HAS_BIAS:
        if BIAS_ROW:
            st += _bias_keys(b_base, offs_n, stride_bn, Sk, BIAS_BOOL)[:, None]
        else:
            b_ptrs = b_base + offs_n[:, None] * stride_bn + offs_m[None, :] * stride_bm
            st += _bias_tile(b_ptrs, (offs_n[:, None] < Sk) & rmask[None, :], BIAS_BOOL)
    pt = tl.math.exp2(st - lse2[None, :])      # masked keys (-inf) and missing rows (lse2 = +inf) give 0
    if DIAG:
        pt = tl.where(offs_m[None, :] >= offs_n[:, None], pt, 0.0)
    dpt = _dot(v, tl.trans(do), IEEE)
    if DROPOUT:
        # the forward's mask, transposed: dV takes the kept (scaled) P, dP's kept entries are scaled
        keep = tl.trans(_keep(seed, offset, grow0 + offs_m, rmask, start_n, thr, Bits, Sk, offs_m0.shape[0],
                              offs_n.shape[0], DROPOUT))
        dv += _dot((tl.where(keep, pt, 0.0) * inv_keep).to(do.dtype), do, IEEE)
        dpt = tl.where(keep, dpt * inv_keep, 0.0)
    else:
        dv += _dot(pt.to(do.dtype), do, IEEE)
    dst = pt * (dpt - delta[None, :])
    dk += _dot(dst.to(q.dtype), q, IEEE)
    return dk, dv


@triton.jit
def attn_bwd_dkdv(Q, K, V, Bias, DO, LSE, Delta, DK, DV,
                  stride_qb, stride_qh, stride_qm, stride_qd,
                  stride_kb, stride_kh, stride_kn, stride_kd,
                  stride_vb, stride_vh, stride_vn, stride_vd,
                  stride_bb, stride_bh, stride_bm, stride_bn,
                  stride_gb, stride_gh, stride_gm, stride_gd,
                  stride_lb, stride_lh, stride_lm,
                  stride_dkb, stride_dkh, stride_dkn, stride_dkd, stride_dkg,
                  stride_dvb, stride_dvh, stride_dvn, stride_dvd, stride_dvg,
                  Hq, Hkv, GROUP, NG, Sq, Sk, D, qk_scale, scale,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_BOOL: tl.constexpr, EVEN_D: tl.constexpr,
                  IEEE: tl.constexpr, BIAS_ROW: tl.constexpr, SeedOff, thr, inv_keep, DROPOUT: tl.constexpr):
    """dV = sum over the group's heads of P^T dO; dK = scale * sum dS^T Q, dS = P (dP - delta).

    NG > 1 (GQA with too few programs otherwise): the group's heads are split over NG programs, each
    writing an fp32 partial at DK/DV + gi * stride_g, summed by `attn_bwd_group_sum`.
    DROPOUT (Z = the forward's mask / keep prob, regenerated from SeedOff = [seed, offset], or read from
    the bits after them when DROPOUT == 2):
    dV = sum (P * Z)^T dO, dP = (dO V^T) * Z, dS = P (dP - delta)."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    gi = pid_bh % NG
    pid_bh = pid_bh // NG
    b = (pid_bh // Hkv).to(tl.int64)
    hk = (pid_bh % Hkv).to(tl.int64)
    gpp = GROUP // NG
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    if EVEN_D:
        kmask = offs_n[:, None] < Sk
    else:
        kmask = (offs_n[:, None] < Sk) & (offs_d[None, :] < D)
    k = tl.load(K + b * stride_kb + hk * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                mask=kmask, other=0.0)
    v = tl.load(V + b * stride_vb + hk * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                mask=kmask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    if CAUSAL:
        # query rows < start_n see none of these keys; rows >= start_n + BLOCK_N - 1 see all of them
        lo = (start_n // BLOCK_M) * BLOCK_M
        mid = tl.minimum(((start_n + BLOCK_N + BLOCK_M - 1) // BLOCK_M) * BLOCK_M, Sq)
    else:
        lo = 0
        mid = 0
    seed = 0
    offset = 0
    if DROPOUT:
        seed = tl.load(SeedOff)
        offset = tl.load(SeedOff + 1)
    Bits = _bits_base(SeedOff, DROPOUT)
    for g in range(gi * gpp, gi * gpp + gpp):
        h = hk * GROUP + g
        grow0 = (b * Hq + h) * Sq
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + b * stride_gb + h * stride_gh
        b_base = Bias + b * stride_bb + h * stride_bh
        lse_base = LSE + b * stride_lb + h * stride_lh
        delta_base = Delta + (b * Hq + h) * Sq
        for start_m in range(lo, mid, BLOCK_M):
            dk, dv = _dkdv_block(dk, dv, k, v, q_base, do_base, b_base, lse_base, delta_base, start_m, offs_n,
                                 offs_m0, offs_d, stride_qm, stride_qd, stride_gm, stride_gd, stride_bm, stride_bn,
                                 stride_lm, Sq, Sk, D, qk_scale, True, CAUSAL, HAS_BIAS, BIAS_BOOL, BIAS_ROW,
                                 EVEN_D, IEEE, seed, offset, grow0, start_n, thr, inv_keep, Bits, DROPOUT)
        for start_m in range(tl.maximum(mid, lo), Sq, BLOCK_M):
            dk, dv = _dkdv_block(dk, dv, k, v, q_base, do_base, b_base, lse_base, delta_base, start_m, offs_n,
                                 offs_m0, offs_d, stride_qm, stride_qd, stride_gm, stride_gd, stride_bm, stride_bn,
                                 stride_lm, Sq, Sk, D, qk_scale, False, CAUSAL, HAS_BIAS, BIAS_BOOL, BIAS_ROW,
                                 EVEN_D, IEEE, seed, offset, grow0, start_n, thr, inv_keep, Bits, DROPOUT)
    dk = dk * scale
    gi64 = gi.to(tl.int64)
    tl.store(DK + b * stride_dkb + hk * stride_dkh + gi64 * stride_dkg + offs_n[:, None] * stride_dkn
             + offs_d[None, :] * stride_dkd, dk.to(DK.dtype.element_ty), mask=kmask)
    tl.store(DV + b * stride_dvb + hk * stride_dvh + gi64 * stride_dvg + offs_n[:, None] * stride_dvn
             + offs_d[None, :] * stride_dvd, dv.to(DV.dtype.element_ty), mask=kmask)


@triton.jit
def attn_bwd_group_sum(P, OUT, NG, Hkv, Sk, D,
                       stride_pb, stride_ph, stride_pg, stride_pn,
                       stride_ob, stride_oh, stride_on, stride_od,
                       BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """OUT[b, hk, n, :] = sum_g P[b, hk, g, n, :] (fp32 partials of a GQA group, D contiguous)."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hkv).to(tl.int64)
    hk = (pid_bh % Hkv).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_n[:, None] < Sk) & (offs_d[None, :] < D)
    base = P + b * stride_pb + hk * stride_ph + offs_n[:, None] * stride_pn + offs_d[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for g in range(0, NG):
        acc += tl.load(base + g * stride_pg, mask=mask, other=0.0)
    tl.store(OUT + b * stride_ob + hk * stride_oh + offs_n[:, None] * stride_on + offs_d[None, :] * stride_od,
             acc.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _dq_block(dq, q, do, lse2, delta, k_base, v_base, b_base, start_n, offs_m, offs_n0, offs_d,
              stride_kn, stride_kd, stride_vn, stride_vd, stride_bm, stride_bn, Sq, Sk, D, qk_scale,
              MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_BOOL: tl.constexpr,
              BIAS_ROW: tl.constexpr, EVEN_D: tl.constexpr, IEEE: tl.constexpr,
              seed, offset, grow, thr, inv_keep, Bits, DROPOUT: tl.constexpr):
    n = start_n + offs_n0
    kt_ptrs = k_base + n[None, :] * stride_kn + offs_d[:, None] * stride_kd     # [BLOCK_D, BLOCK_N]
    vt_ptrs = v_base + n[None, :] * stride_vn + offs_d[:, None] * stride_vd
    if MASKED:
        if EVEN_D:
            mk = n[None, :] < Sk
        else:
            mk = (n[None, :] < Sk) & (offs_d[:, None] < D)
        kt = tl.load(kt_ptrs, mask=mk, other=0.0)
        vt = tl.load(vt_ptrs, mask=mk, other=0.0)
    else:
        if EVEN_D:
            kt = tl.load(kt_ptrs)
            vt = tl.load(vt_ptrs)
        else:
            kt = tl.load(kt_ptrs, mask=offs_d[:, None] < D, other=0.0)
            vt = tl.load(vt_ptrs, mask=offs_d[:, None] < D, other=0.0)
    s = _dot(q, kt, IEEE) * qk_scale
    if HAS_BIAS:
        if BIAS_ROW:
            s += _bias_keys(b_base, n, stride_bn, Sk, BIAS_BOOL)[None, :]
        else:
            b_ptrs = b_base + offs_m[:, None] * stride_bm + n[None, :] * stride_bn
            if MASKED:
                bmask = (offs_m[:, None] < Sq) & (n[None, :] < Sk)
            else:
                bmask = offs_m[:, None] < Sq
            s += _bias_tile(b_ptrs, bmask, BIAS_BOOL)
    p = tl.math.exp2(s - lse2[:, None])
    if MASKED:
        valid = n[None, :] < Sk
        if CAUSAL:
            valid = valid & (n[None, :] <= offs_m[:, None])
        p = tl.where(valid, p, 0.0)
    dp = _dot(do, vt, IEEE)
    if DROPOUT:
        keep = _keep(seed, offset, grow, offs_m < Sq, start_n, thr, Bits, Sk, offs_m.shape[0], offs_n0.shape[0],
                     DROPOUT)
        dp = tl.where(keep, dp * inv_keep, 0.0)
    ds = p * (dp - delta[:, None])
    dq += _dot(ds.to(kt.dtype), tl.trans(kt), IEEE)
    return dq


@triton.jit
def attn_bwd_dq(Q, K, V, Bias, DO, LSE, Delta, DQ,
                stride_qb, stride_qh, stride_qm, stride_qd,
                stride_kb, stride_kh, stride_kn, stride_kd,
                stride_vb, stride_vh, stride_vn, stride_vd,
                stride_bb, stride_bh, stride_bm, stride_bn,
                stride_gb, stride_gh, stride_gm, stride_gd,
                stride_lb, stride_lh, stride_lm,
                stride_dqb, stride_dqh, stride_dqm, stride_dqd,
                Hq, GROUP, Sq, Sk, D, qk_scale, scale,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, BIAS_BOOL: tl.constexpr, EVEN_D: tl.constexpr,
                IEEE: tl.constexpr, BIAS_ROW: tl.constexpr, SeedOff, thr, inv_keep, DROPOUT: tl.constexpr):
    """dQ = scale * dS K, dS = P (dP - delta), dP = dO V^T (DROPOUT: times the forward's Z)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // Hq).to(tl.int64)
    h = pid_bh % Hq
    hk = (h // GROUP).to(tl.int64)
    h = h.to(tl.int64)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    rmask = offs_m < Sq
    if EVEN_D:
        lmask = rmask[:, None]
    else:
        lmask = rmask[:, None] & (offs_d[None, :] < D)
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=lmask, other=0.0)
    do = tl.load(DO + b * stride_gb + h * stride_gh + offs_m[:, None] * stride_gm + offs_d[None, :] * stride_gd,
                 mask=lmask, other=0.0)
    lse2 = _lse2(LSE + b * stride_lb + h * stride_lh + offs_m * stride_lm, rmask)
    delta = tl.load(Delta + (b * Hq + h) * Sq + offs_m, mask=rmask, other=0.0)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    b_base = Bias + b * stride_bb + h * stride_bh
    if CAUSAL:
        hi = tl.minimum(Sk, start_m + BLOCK_M)
        hi_full = tl.minimum((start_m // BLOCK_N) * BLOCK_N, (Sk // BLOCK_N) * BLOCK_N)
    else:
        hi = Sk
        hi_full = (Sk // BLOCK_N) * BLOCK_N
    seed = 0
    offset = 0
    if DROPOUT:
        seed = tl.load(SeedOff)
        offset = tl.load(SeedOff + 1)
    Bits = _bits_base(SeedOff, DROPOUT)
    grow = (b * Hq + h) * Sq + offs_m
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(0, hi_full, BLOCK_N):
        dq = _dq_block(dq, q, do, lse2, delta, k_base, v_base, b_base, start_n, offs_m, offs_n0, offs_d,
                       stride_kn, stride_kd, stride_vn, stride_vd, stride_bm, stride_bn, Sq, Sk, D, qk_scale,
                       False, CAUSAL, HAS_BIAS, BIAS_BOOL, BIAS_ROW, EVEN_D, IEEE, seed, offset, grow, thr,
                       inv_keep, Bits, DROPOUT)
    for start_n in range(hi_full, hi, BLOCK_N):
        dq = _dq_block(dq, q, do, lse2, delta, k_base, v_base, b_base, start_n, offs_m, offs_n0, offs_d,
                       stride_kn, stride_kd, stride_vn, stride_vd, stride_bm, stride_bn, Sq, Sk, D, qk_scale,
                       True, CAUSAL, HAS_BIAS, BIAS_BOOL, BIAS_ROW, EVEN_D, IEEE, seed, offset, grow, thr,
                       inv_keep, Bits, DROPOUT)
    dq = dq * scale
    tl.store(DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqm + offs_d[None, :] * stride_dqd,
             dq.to(DQ.dtype.element_ty), mask=lmask)
