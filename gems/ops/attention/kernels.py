"""Triton kernels of Gems' fused attention (no `register` here: sdpa.py wraps them).

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
Dropout (DROPOUT): P V takes P * keep, keep = a Philox uint32 < (1 - p) 2^32 per score (`_philox_pairs`:
one call per 2 x 2 scores, queries i, i ^ 8 x keys j, j ^ 8, a function of (seed, offset, positions)
only), the row sum all of P, the output 1 / (1 - p); the backward needs keep per tile again:
dV = (P * Z)^T dO, dP = (dO V^T) * Z (Z = keep / (1 - p)), and delta = rowsum(dO * O) stays right.
DROPOUT == 1: the backward kernels regenerate keep from Philox; DROPOUT == 2: the forward also writes it,
a bit per score, after [seed, offset] in the state tensor (`_store_kept`), and the backward reads the
words (`_keep`).
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
# a stored dropout mask's bytes per 128 keys of a query pair (a bit per score); sdpa.py sizes the
# state tensor with it
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
def _query_pairs(bh, start_m, Sq, BM: tl.constexpr):
    """Dropout's row counters: query i of head bh pairs with i ^ 8 (one Philox call gives four numbers:
    2 queries x 2 keys). The [BM / 2] pair ids of queries start_m ... start_m + BM - 1 (start_m % 16 == 0):
    bh * pairs per head + start_m / 2 + 0 ... BM / 2 - 1, and which of them lie inside the head's
    (16-padded) rows."""
    sqp = ((Sq + 15) // 16) * 8
    lp = start_m // 2 + tl.arange(0, BM // 2)
    return bh * sqp + lp, lp < sqp


@triton.jit
def _key_pairs(start_n, BN: tl.constexpr):
    """The key pair ids (key j pairs with j ^ 8) of keys start_n ... start_n + BN - 1 (start_n % 16 == 0)."""
    return start_n // 2 + tl.arange(0, BN // 2)


@triton.jit
def _interleave8(x00, x01, x10, x11, R: tl.constexpr, C: tl.constexpr):
    """Four [R / 2, C / 2] tiles -> [R, C]: out[r, c] = x_{bit 3 of r, bit 3 of c}[pair(r), pair(c)],
    pair(e) = (e // 16) * 8 + e % 8. Bit 3 of the row and of the column index is a register bit of
    Hopper's MMA accumulator layout (rows r and r + 8, columns c and c + 8 sit in one thread), in both
    orientations the kernels use (queries x keys and keys x queries), so Triton builds the tile in the
    registers that already hold the four numbers: no trip through shared memory, which a quad of
    adjacent keys (a lane bit) needed in every loop step."""
    a = tl.join(tl.reshape(x00, [R // 16, 8, C // 16, 8]), tl.reshape(x01, [R // 16, 8, C // 16, 8]))
    b = tl.join(tl.reshape(x10, [R // 16, 8, C // 16, 8]), tl.reshape(x11, [R // 16, 8, C // 16, 8]))
    t = tl.join(a, b)                                          # [R/16, 8, C/16, 8, col bit 3, row bit 3]
    return tl.reshape(tl.permute(t, (0, 5, 1, 2, 4, 3)), [R, C])


@triton.jit
def _philox_pairs(seed, offset, qp, kp, KEYS_FIRST: tl.constexpr):
    """Philox(seed; counter (key pair, query pair, offset low, offset high)): r_t (t = 2 * query bit 3 +
    key bit 3) for the query pairs qp and key pairs kp, as [qp, kp] tiles ([kp, qp] with KEYS_FIRST).
    A function of the positions only, so every kernel's tiles (any block shape, either orientation)
    regenerate the forward's numbers."""
    offset = offset.to(tl.int64)
    if KEYS_FIRST:
        c0 = tl.broadcast_to(kp[:, None], [kp.shape[0], qp.shape[0]]).to(tl.uint32)
        c1 = tl.broadcast_to(qp[None, :], [kp.shape[0], qp.shape[0]]).to(tl.uint32)
    else:
        c0 = tl.broadcast_to(kp[None, :], [qp.shape[0], kp.shape[0]]).to(tl.uint32)
        c1 = tl.broadcast_to(qp[:, None], [qp.shape[0], kp.shape[0]]).to(tl.uint32)
    zero = c0 * 0
    c2 = zero + (offset & 0xFFFFFFFF).to(tl.uint32)
    c3 = zero + ((offset >> 32) & 0xFFFFFFFF).to(tl.uint32)
    return tl.philox(seed, c0, c1, c2, c3)


@triton.jit
def _arrange(k0, k1, k2, k3, KEYS_FIRST: tl.constexpr):
    """The [queries, keys] (KEYS_FIRST: [keys, queries]) keep tile of the four pair tiles k_t."""
    if KEYS_FIRST:
        return _interleave8(k0, k2, k1, k3, 2 * k0.shape[0], 2 * k0.shape[1])
    else:
        return _interleave8(k0, k1, k2, k3, 2 * k0.shape[0], 2 * k0.shape[1])


@triton.jit
def _bits_row(Sk):
    """Bytes per query pair of a stored dropout mask: keys padded to 128, so every key block (<= 128
    keys, a divisor of 128) lies inside its row."""
    return ((Sk + 127) // 128) * MASK_BYTES_PER_128


# The stored mask's format follows the forward's registers (Hopper's MMA layout: lane q % 4 of a quad
# holds key pairs 8J + 2q + s, s = 0, 1, for every 16 keys J of the block): a query pair's 64-key group
# takes 4 words, word q holds the 4-bit groups (bit t: the score t of `_philox_pairs`) of key pairs
# 8Jl + 2q + s (Jl = 0..3) at bits 4 (2Jl + s). So the forward stores one 32-bit word per query pair
# and 64 keys from each thread, and the backward loads 32-bit words, which Triton's pipeliner
# prefetches (cp.async); a byte per 2 x 2 scores stored from those registers (uncoalesced byte stores)
# and read back by byte loads (not pipelined) cost more than regenerating Philox.

@triton.jit
def _word_shifts(start_n, BN: tl.constexpr):
    """[JW, 2] bit offsets, in the words of `_mask_words`, of the key pairs 8 (Jl0 + jl) + 2q + s of a
    block of BN keys (jl < JW = min(BN / 16, 4); Jl0: the block's first 16 keys inside its 64)."""
    JW: tl.constexpr = BN // 16 if BN < 64 else 4
    jl0 = (start_n % 64) // 16 if BN < 64 else 0
    jl = tl.arange(0, JW)[:, None]
    return (4 * (2 * (jl0 + jl) + tl.arange(0, 2)[None, :])).to(tl.uint32)


@triton.jit
def _mask_words(Bits, qp, start_n, Sk, BN: tl.constexpr, KEYS_FIRST: tl.constexpr):
    """uint32 pointers of the words holding keys start_n ... start_n + BN - 1 of the query pairs qp:
    [qp, BN / 64 (at least 1), 4 (q)] ([BN / 64, 4, qp] with KEYS_FIRST)."""
    NW: tl.constexpr = BN // 64 if BN >= 64 else 1
    W = Bits.to(tl.pointer_type(tl.uint32), bitcast=True)
    wrow = _bits_row(Sk) // 4
    g = start_n // 64 + tl.arange(0, NW)
    q = tl.arange(0, 4)
    if KEYS_FIRST:
        return W + qp[None, None, :] * wrow + g[:, None, None] * 4 + q[None, :, None]
    else:
        return W + qp[:, None, None] * wrow + g[None, :, None] * 4 + q[None, None, :]


@triton.jit
def _unpack(w, start_n, BN: tl.constexpr, KEYS_FIRST: tl.constexpr):
    """The [queries, keys] keep tile of a block's words w [QP, BN / 64, 4] (KEYS_FIRST: the [keys,
    queries] tile of w [BN / 64, 4, QP])."""
    sh = _word_shifts(start_n, BN)
    if KEYS_FIRST:
        nib = (w[:, None, :, None, :] >> sh[None, :, None, :, None]) & 15        # [NW, JW, 4, 2, QP]
        nib = tl.reshape(nib, [BN // 2, w.shape[2]])
    else:
        nib = (w[:, :, None, :, None] >> sh[None, None, :, None, :]) & 15        # [QP, NW, JW, 4, 2]
        nib = tl.reshape(nib, [w.shape[0], BN // 2])
    return _arrange((nib & 1) != 0, (nib & 2) != 0, (nib & 4) != 0, (nib & 8) != 0, KEYS_FIRST)


@triton.jit
def _store_kept(Bits, qp, qpv, start_n, Sk, kept, BN: tl.constexpr):
    """Store a forward block's [BM, BN] kept tile (queries x keys) in the words of `_mask_words`: row
    16R + 8h + i, key 64G + 16Jl + 8k + 2q + s -> bit 4 (2Jl + s) + 2h + k of word (pair 8R + i, G, q).
    The tile is the forward's P V operand != 0 (kept and P > 0; where P = 0 the backward's dS and dV
    terms are 0 whatever the bit), so Triton derives every layout here from the MMA's registers: built
    from the keep tile itself, the store's own layout made it run Philox a second time."""
    sh = _word_shifts(start_n, BN)                                               # [JW, 2]: jl, s
    JW: tl.constexpr = sh.shape[0]
    BM: tl.constexpr = kept.shape[0]
    b = tl.reshape(kept.to(tl.uint32), [BM // 16, 2, 8, BN // (16 * JW), JW, 2, 4, 2])
    hk = (2 * tl.arange(0, 2)[:, None] + tl.arange(0, 2)[None, :]).to(tl.uint32)  # [2, 2]: h, k
    sh8 = sh[None, None, None, None, :, None, None, :] + hk[None, :, None, None, None, :, None, None]
    w = tl.sum(tl.sum(tl.sum(tl.sum(b << sh8, 7), 5), 4), 1)          # [BM/16, 8, NW, 4]: disjoint bits
    w = tl.reshape(w, [BM // 2, BN // (16 * JW), 4])
    ptrs = _mask_words(Bits, qp, start_n, Sk, BN, False)
    m = qpv[:, None, None]
    if BN >= 64:
        tl.store(ptrs, w, mask=m)
    elif BN == 32:   # the half of the word that this block's keys own
        half = ptrs.to(tl.pointer_type(tl.uint16), bitcast=True) + (start_n % 64) // 32
        tl.store(half, (w >> (16 * ((start_n % 64) // 32))).to(tl.uint16), mask=m)
    else:
        byte = ptrs.to(tl.pointer_type(tl.uint8), bitcast=True) + (start_n % 64) // 16
        tl.store(byte, (w >> (8 * ((start_n % 64) // 16))).to(tl.uint8), mask=m)


@triton.jit
def _keep(seed, offset, qp, qpv, col0, thr, Bits, Sk, BN: tl.constexpr, DROPOUT: tl.constexpr,
          KEYS_FIRST: tl.constexpr):
    """The backward's keep tile ([queries, keys], or [keys, queries] with KEYS_FIRST): DROPOUT == 2
    reads the forward's bits, 1 regenerates Philox."""
    if DROPOUT == 2:
        if KEYS_FIRST:
            w = tl.load(_mask_words(Bits, qp, col0, Sk, BN, True), mask=qpv[None, None, :], other=0)
        else:
            w = tl.load(_mask_words(Bits, qp, col0, Sk, BN, False), mask=qpv[:, None, None], other=0)
        return _unpack(w, col0, BN, KEYS_FIRST)
    else:
        r0, r1, r2, r3 = _philox_pairs(seed, offset, qp, _key_pairs(col0, BN), KEYS_FIRST)
        t = thr.to(tl.uint32)
        return _arrange(r0 < t, r1 < t, r2 < t, r3 < t, KEYS_FIRST)


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
               seed, offset, qp, qpv, thr, Bits, DROPOUT: tl.constexpr, KD, VD, kv_b, kv_h, TMA: tl.constexpr):
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
        keep = _keep(seed, offset, qp, qpv, start_n, thr, Bits, Sk, p.shape[1], 1, False)
        pv = tl.where(keep, p, 0.0)
        if DROPOUT == 2:
            _store_kept(Bits, qp, qpv, start_n, Sk, pv != 0.0, p.shape[1])
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
    DROPOUT: P's entries are kept with probability thr / 2**32 (`_philox_pairs`; Philox seed, offset per
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
    qp, qpv = _query_pairs(pid_bh.to(tl.int64), start_m, Sq, BLOCK_M)    # dropout (never with PACK)
    if DROPOUT:
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
                                   seed, offset, qp, qpv, thr, Bits, DROPOUT, KD, VD, kv_b, kv_h, TMA)
    for start_n in range(lo2, hi_s, BLOCK_N):
        acc, l_i, m_i = _fwd_block(acc, l_i, m_i, q, k_base, v_base, b_rows, start_n, rm, rvalid, offs_n, offs_d,
                                   stride_kn, stride_kd, stride_vn, stride_vd, stride_bn, Sk, D,
                                   qk_scale, True, CAUSAL, HAS_BIAS, BIAS_BOOL, BIAS_ROW, EVEN_D, IEEE,
                                   seed, offset, qp, qpv, thr, Bits, DROPOUT, KD, VD, kv_b, kv_h, TMA)
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
                seed, offset, bh, start_n, thr, inv_keep, Bits, DROPOUT: tl.constexpr):
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
        # the forward's mask as [keys, queries]: dV takes the kept (scaled) P, dP's kept entries are scaled
        qp, qpv = _query_pairs(bh, start_m, Sq, offs_m0.shape[0])
        keep = _keep(seed, offset, qp, qpv, start_n, thr, Bits, Sk, offs_n.shape[0], DROPOUT, True)
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
        bh = b * Hq + h
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + b * stride_gb + h * stride_gh
        b_base = Bias + b * stride_bb + h * stride_bh
        lse_base = LSE + b * stride_lb + h * stride_lh
        delta_base = Delta + (b * Hq + h) * Sq
        for start_m in range(lo, mid, BLOCK_M):
            dk, dv = _dkdv_block(dk, dv, k, v, q_base, do_base, b_base, lse_base, delta_base, start_m, offs_n,
                                 offs_m0, offs_d, stride_qm, stride_qd, stride_gm, stride_gd, stride_bm, stride_bn,
                                 stride_lm, Sq, Sk, D, qk_scale, True, CAUSAL, HAS_BIAS, BIAS_BOOL, BIAS_ROW,
                                 EVEN_D, IEEE, seed, offset, bh, start_n, thr, inv_keep, Bits, DROPOUT)
        for start_m in range(tl.maximum(mid, lo), Sq, BLOCK_M):
            dk, dv = _dkdv_block(dk, dv, k, v, q_base, do_base, b_base, lse_base, delta_base, start_m, offs_n,
                                 offs_m0, offs_d, stride_qm, stride_qd, stride_gm, stride_gd, stride_bm, stride_bn,
                                 stride_lm, Sq, Sk, D, qk_scale, False, CAUSAL, HAS_BIAS, BIAS_BOOL, BIAS_ROW,
                                 EVEN_D, IEEE, seed, offset, bh, start_n, thr, inv_keep, Bits, DROPOUT)
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
              seed, offset, qp, qpv, thr, inv_keep, Bits, DROPOUT: tl.constexpr):
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
        keep = _keep(seed, offset, qp, qpv, start_n, thr, Bits, Sk, offs_n0.shape[0], DROPOUT, False)
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
    qp, qpv = _query_pairs(b * Hq + h, start_m, Sq, BLOCK_M)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(0, hi_full, BLOCK_N):
        dq = _dq_block(dq, q, do, lse2, delta, k_base, v_base, b_base, start_n, offs_m, offs_n0, offs_d,
                       stride_kn, stride_kd, stride_vn, stride_vd, stride_bm, stride_bn, Sq, Sk, D, qk_scale,
                       False, CAUSAL, HAS_BIAS, BIAS_BOOL, BIAS_ROW, EVEN_D, IEEE, seed, offset, qp, qpv,
                       thr, inv_keep, Bits, DROPOUT)
    for start_n in range(hi_full, hi, BLOCK_N):
        dq = _dq_block(dq, q, do, lse2, delta, k_base, v_base, b_base, start_n, offs_m, offs_n0, offs_d,
                       stride_kn, stride_kd, stride_vn, stride_vd, stride_bm, stride_bn, Sq, Sk, D, qk_scale,
                       True, CAUSAL, HAS_BIAS, BIAS_BOOL, BIAS_ROW, EVEN_D, IEEE, seed, offset, qp, qpv,
                       thr, inv_keep, Bits, DROPOUT)
    dq = dq * scale
    tl.store(DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqm + offs_d[None, :] * stride_dqd,
             dq.to(DQ.dtype.element_ty), mask=lmask)
