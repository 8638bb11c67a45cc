"""Rotary position embedding (RoPE) for q and k in one launch: Hugging Face's `apply_rotary_pos_emb`.

    q_embed, k_embed = rope(q, k, cos, sin)                 # q [B, Hq, S, D], k [B, Hkv, S, D], cos/sin [B, S, D]
    q_embed, k_embed = rope(q, k, cos, sin, unsqueeze_dim=2)  # q [B, S, Hq, D], k [B, S, Hkv, D]

Contract (transformers 5.17, models/llama/modeling_llama.py):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])
    q_embed = q * cos + rotate_half(q) * sin;  k_embed likewise

- `cos`/`sin` may have batch 1 (broadcast over the batch, as HF's rotary embedding returns for one
  row of position ids) or B; they are broadcast over heads. Their two halves need not be equal.
- q and k may be strided views (HF passes `proj(x).view(B, S, H, D).transpose(1, 2)`): read in place,
  no copy. Outputs take q's (k's) memory layout when it is dense, else contiguous.
- Outputs are in q's dtype (HF's result dtype when cos/sin have q's dtype, which HF's rotary
  embedding returns); arithmetic is fp32.
- `position_ids` is accepted and ignored, exactly like HF (cos/sin are already gathered per position).
- Grouped-query attention: k may have fewer heads than q. Partial rotary (cos narrower than D) is
  rejected with a ValueError.
- `interleaved=True` is GLM's form: the pairs (2j, 2j + 1) rotated by cos/sin[..., j], whose second
  halves are not read (GLM repeats cos[..., :D/2] pairwise); same kernel, other channel offsets.
- Backward is the rotation by the opposite angle: with c1|c2 and s1|s2 the halves of cos and sin,
  dx1 = g1*c1 + g2*s2 and dx2 = g2*c2 - g1*s1 (= g*cos + rotate_half^T(g*sin)); one launch for dq and
  dk. Gradients for cos/sin (which HF computes under no_grad) fall back to plain PyTorch if requested.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..codegen.layout import contiguous_strides
from ..ops.memory import non_overlapping_dense
from ..runtime import kernel
from ..runtime.alloc import empty
from ..runtime.planned import planned
from ..runtime.utils import next_pow2
from . import deferral, library

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _rope_tile(X, O, C, SN, x_row, o_row, c_row, s_row, h0, H,
               x_sh, x_sd, o_sh, o_sd, c_sd, s_sd,
               HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BACKWARD: tl.constexpr,
               INTERLEAVED: tl.constexpr):
    """One token's heads h0 .. h0+BLOCK_H of one tensor: both halves loaded, rotated, stored. The
    pair j is (x[j], x[j + D/2]) with angle cos[j] / cos[j + D/2], or INTERLEAVED (x[2j], x[2j + 1]) with
    cos[j] for both (GLM's form: cos[..., :D/2] repeated pairwise)."""
    hs = h0 + tl.arange(0, BLOCK_H)
    ds = tl.arange(0, BLOCK_HALF)
    dmask = ds < HALF
    mask = (hs < H)[:, None] & dmask[None, :]
    if INTERLEAVED:
        d1, d2, e2 = ds * 2, ds * 2 + 1, ds
    else:
        d1, d2, e2 = ds, ds + HALF, ds + HALF
    # cos/sin halves: 4 x D/2 values, read once per program (L2-resident across the token's programs)
    c1 = tl.load(C + c_row + ds * c_sd, mask=dmask, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(C + c_row + e2 * c_sd, mask=dmask, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(SN + s_row + ds * s_sd, mask=dmask, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(SN + s_row + e2 * s_sd, mask=dmask, other=0.0).to(tl.float32)[None, :]
    xp = X + x_row + hs[:, None].to(tl.int64) * x_sh
    x1 = tl.load(xp + d1[None, :] * x_sd, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(xp + d2[None, :] * x_sd, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        o1 = x1 * c1 + x2 * s2
        o2 = x2 * c2 - x1 * s1
    else:
        o1 = x1 * c1 - x2 * s1
        o2 = x2 * c2 + x1 * s2
    op = O + o_row + hs[:, None].to(tl.int64) * o_sh
    tl.store(op + d1[None, :] * o_sd, o1.to(O.dtype.element_ty), mask=mask)
    tl.store(op + d2[None, :] * o_sd, o2.to(O.dtype.element_ty), mask=mask)


@kernel
@triton.jit
def rope_kernel(Q, K, QO, KO, C, SN, S, HQ, HKV, NQB,
                q_sb, q_sh, q_ss, q_sd, k_sb, k_sh, k_ss, k_sd,
                qo_sb, qo_sh, qo_ss, qo_sd, ko_sb, ko_sh, ko_ss, ko_sd,
                c_sb, c_ss, c_sd, s_sb, s_ss, s_sd,
                HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BACKWARD: tl.constexpr,
                INTERLEAVED: tl.constexpr):
    """Forward  (BACKWARD=0): o = x*cos + rotate_half(x)*sin, i.e. o1 = x1*c1 - x2*s1, o2 = x2*c2 + x1*s2.
    Backward (BACKWARD=1): o = g*cos + rotate_half^T(g*sin), i.e. o1 = g1*c1 + g2*s2, o2 = g2*c2 - g1*s1.
    (x1, x2) are the two halves of the head, or with INTERLEAVED its even and odd channels (_rope_tile).

    Grid (B*S, NQB + NKB): axis 0 is the token (b, s), axis 1 a block of BLOCK_H heads of q (the first
    NQB) or of k. Bytes: each element of q and k read once and written once ((Hq+Hkv)*D*2 elements
    per token), plus 2*D cos/sin values per program (L2 hits after the first).
    """
    tok = tl.program_id(0)
    hb = tl.program_id(1)
    b = (tok // S).to(tl.int64)
    s = (tok % S).to(tl.int64)
    c_row = b * c_sb + s * c_ss
    s_row = b * s_sb + s * s_ss
    if hb < NQB:
        _rope_tile(Q, QO, C, SN, b * q_sb + s * q_ss, b * qo_sb + s * qo_ss, c_row, s_row, hb * BLOCK_H, HQ,
                   q_sh, q_sd, qo_sh, qo_sd, c_sd, s_sd, HALF, BLOCK_H, BLOCK_HALF, BACKWARD, INTERLEAVED)
    else:
        _rope_tile(K, KO, C, SN, b * k_sb + s * k_ss, b * ko_sb + s * ko_ss, c_row, s_row, (hb - NQB) * BLOCK_H,
                   HKV, k_sh, k_sd, ko_sh, ko_sd, c_sd, s_sd, HALF, BLOCK_H, BLOCK_HALF, BACKWARD, INTERLEAVED)


_CONFIGS: dict = {}


def _config(D: int, HQ: int, HKV: int):
    """(BLOCK_HALF, BLOCK_H, num_warps), cached per (D, Hq, Hkv): tiles of ~2-4K elements."""
    key = (D, HQ, HKV)
    cfg = _CONFIGS.get(key)
    if cfg is None:
        bhalf = next_pow2(D // 2)
        bh = max(1, min(next_pow2(max(HQ, HKV)), 2048 // (2 * bhalf)))
        warps = 4 if bh * bhalf * 2 >= 2048 else (2 if bh * bhalf * 2 >= 512 else 1)
        cfg = _CONFIGS[key] = (bhalf, bh, warps)
    return cfg


def _logical(st, ud):
    """(b, h, s, d) strides of a q/k stride tuple whose head dim is `ud`."""
    return (st[0], st[1], st[2], st[3]) if ud == 1 else (st[0], st[2], st[1], st[3])


def _make_plan(q, k, cos, sin, unsqueeze_dim, out_strides):
    ud = _check(q, k, cos, sin, unsqueeze_dim)
    if out_strides is None:   # q's (k's) layout when dense (HF's transposed views), contiguous otherwise
        out_strides = tuple(t.stride() if non_overlapping_dense(t) else contiguous_strides(t.shape)
                            for t in (q, k))
    qo_st, ko_st = out_strides
    if ud == 1:
        B, HQ, S, D = q.shape
        HKV = k.shape[1]
    else:
        B, S, HQ, D = q.shape
        HKV = k.shape[2]
    bhalf, bh, warps = _config(D, HQ, HKV)
    nqb, nkb = -(-HQ // bh), -(-HKV // bh)
    cst, sst = cos.stride(), sin.stride()
    # cos/sin [B or 1, S, D]: batch stride 0 when broadcast
    ints = (S, HQ, HKV, nqb, *_logical(q.stride(), ud), *_logical(k.stride(), ud), *_logical(qo_st, ud),
            *_logical(ko_st, ud), 0 if cos.shape[0] == 1 else cst[0], cst[1], cst[2],
            0 if sin.shape[0] == 1 else sst[0], sst[1], sst[2], D // 2, bh, bhalf)
    grid = (B * S, nqb + nkb) if B * S and HQ + HKV and D else None
    return ud, qo_st, ko_st, grid, ints, warps


@planned("rope_run(Tensor q, Tensor k, Tensor cos, Tensor sin, int unsqueeze_dim, bool backward, "
         "int[]? out_strides, bool interleaved) -> (Tensor, Tensor)")
def _run(q, k, cos, sin, unsqueeze_dim, backward, out_strides=None, interleaved=False):
    """(q_out, k_out) = the rotation (or its inverse) of q and k; out_strides (q's then k's, flat) None =
    q's/k's layout; interleaved: GLM's pairs (rope's doc). Planned: checks, layouts, grid and the
    kernel's integers once per signature."""
    if out_strides is not None:
        out_strides = (tuple(out_strides[:4]), tuple(out_strides[4:]))
    ud, qo_st, ko_st, grid, ints, warps = _make_plan(q, k, cos, sin, unsqueeze_dim, out_strides)
    qo = empty(q.shape, q.dtype, q.device, like_strides=qo_st)
    ko = empty(k.shape, k.dtype, k.device, like_strides=ko_st)
    if grid is not None:
        rope_kernel[grid](q, k, qo, ko, cos, sin, *ints, backward, interleaved, num_warps=warps)
    return qo, ko


def _check(q, k, cos, sin, unsqueeze_dim, dtypes=_DTYPES):
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"rope: {name} must be a tensor, got {type(t).__name__}")
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"rope: q and k must be 4-D, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    ud = unsqueeze_dim
    if ud in (-3, -2):
        ud += 4
    if ud not in (1, 2):
        raise ValueError(f"rope: unsqueeze_dim must be 1 (q [B, H, S, D]) or 2 (q [B, S, H, D]), got {unsqueeze_dim}")
    if q.dtype not in dtypes or k.dtype != q.dtype:
        raise TypeError(f"rope: q and k must share a dtype among float32/float16/bfloat16 (float64: the reference), "
                        f"got {q.dtype} and {k.dtype}")
    if not cos.is_floating_point() or not sin.is_floating_point():
        raise TypeError(f"rope: cos and sin must be floating point, got {cos.dtype} and {sin.dtype}")
    if not (q.device == k.device == cos.device == sin.device):
        raise ValueError(f"rope: tensors on different devices: {q.device}, {k.device}, {cos.device}, {sin.device}")
    sdim = 2 if ud == 1 else 1
    B, S, D = q.shape[0], q.shape[sdim], q.shape[3]
    if k.shape[0] != B or k.shape[sdim] != S or k.shape[3] != D:
        raise ValueError(f"rope: k {tuple(k.shape)} does not match q {tuple(q.shape)} outside the head dim")
    if D % 2:
        raise ValueError(f"rope: head dim must be even, got {D}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 3 or t.shape[0] not in (1, B) or t.shape[1] != S or t.shape[2] != D:
            raise ValueError(f"rope: {name} must be [{B} or 1, {S}, {D}] for q {tuple(q.shape)} with "
                             f"unsqueeze_dim={unsqueeze_dim}, got {tuple(t.shape)}"
                             + (" (partial rotary is not supported)" if t.dim() == 3 and t.shape[2] != D else ""))
    return ud


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin, unsqueeze_dim, interleaved):
        qo, ko = _run(q, k, cos, sin, unsqueeze_dim, False, None, interleaved)
        ctx.ud = unsqueeze_dim if unsqueeze_dim > 0 else unsqueeze_dim + 4
        ctx.interleaved = interleaved
        ctx.out_strides = qo.stride() + ko.stride()
        ctx.cs_grad = ctx.needs_input_grad[2] or ctx.needs_input_grad[3]
        ctx.save_for_backward(cos, sin, *((q, k) if ctx.cs_grad else ()))
        return qo, ko

    @staticmethod
    def backward(ctx, gq, gk):
        cos, sin = ctx.saved_tensors[:2]
        # d(q), d(k) in the layouts of the forward's outputs (q's own when dense); while the kernel
        # compiles, the reference's (the rotation is linear in q and k: gq, gk stand in for them)
        dq, dk = deferral.backward(
            "rope", _run, (gq, gk, cos, sin, ctx.ud, True, ctx.out_strides, ctx.interleaved),
            lambda: deferral.reference_grads(
                lambda q, k: reference_rope(q, k, cos, sin, None, ctx.ud, ctx.interleaved),
                (gq, gk), (True, True), (gq, gk)))
        dcos = dsin = None
        if ctx.cs_grad:   # rare (HF computes cos/sin under no_grad; rope() sends interleaved ones to the reference)
            q, k = ctx.saved_tensors[2:]
            hd = ctx.ud
            c_u = cos.unsqueeze(hd)
            gq32, gk32 = gq.float(), gk.float()
            dc = (gq32 * q.float()).sum(hd, keepdim=True) + (gk32 * k.float()).sum(hd, keepdim=True)
            ds = ((gq32 * _rotate_half(q.float())).sum(hd, keepdim=True)
                  + (gk32 * _rotate_half(k.float())).sum(hd, keepdim=True))
            if c_u.shape[0] == 1:
                dc, ds = dc.sum(0, keepdim=True), ds.sum(0, keepdim=True)
            dcos = dc.squeeze(hd).to(cos.dtype) if ctx.needs_input_grad[2] else None
            dsin = ds.squeeze(hd).to(sin.dtype) if ctx.needs_input_grad[3] else None
        return dq, dk, dcos, dsin, None, None


# torch.compile: gems::rope and its backward (library.py); gradients for cos/sin take the reference
def _rope_fake(q, k, cos, sin, unsqueeze_dim, interleaved=False):
    _check(q, k, cos, sin, unsqueeze_dim)
    return tuple(torch.empty_strided(t.shape, t.stride() if non_overlapping_dense(t) else contiguous_strides(t.shape),
                                     dtype=t.dtype, device=t.device) for t in (q, k))


def _rope_save(ctx, inputs, output):
    ud = inputs[4]
    ctx.ud = ud if ud > 0 else ud + 4
    ctx.interleaved = inputs[5]
    ctx.out_strides = output[0].stride() + output[1].stride()
    ctx.save_for_backward(inputs[2], inputs[3])


def _rope_grads(ctx, gq, gk):
    cos, sin = ctx.saved_tensors
    return _ROPE_BWD(gq, gk, cos, sin, ctx.ud, ctx.out_strides, ctx.interleaved) + (None, None, None, None)


_ROPE_BWD = library.define(
    "rope_backward", "(Tensor gq, Tensor gk, Tensor cos, Tensor sin, int unsqueeze_dim, SymInt[] out_strides, "
    "bool interleaved) -> (Tensor, Tensor)",
    lambda gq, gk, cos, sin, ud, st, il: _run(gq, gk, cos, sin, ud, True, list(st), il),
    lambda gq, gk, cos, sin, ud, st, il: tuple(torch.empty_strided(g.shape, s, dtype=g.dtype, device=g.device)
                                               for g, s in ((gq, st[:4]), (gk, st[4:]))))
_ROPE_OP = library.define(
    "rope", "(Tensor q, Tensor k, Tensor cos, Tensor sin, int unsqueeze_dim, bool interleaved) -> (Tensor, Tensor)",
    lambda q, k, cos, sin, ud, il: _run(q, k, cos, sin, ud, False, None, il), _rope_fake,
    backward=_rope_grads, setup_context=_rope_save)


@deferral.deferrable
def rope(q, k, cos, sin, position_ids=None, unsqueeze_dim=1, interleaved=False):
    """Hugging Face's `apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)` in one Triton launch.

    q [B, Hq, S, D] and k [B, Hkv, S, D] (unsqueeze_dim=1) or [B, S, H, D] (unsqueeze_dim=2);
    cos/sin [B or 1, S, D]. Returns (q_embed, k_embed) in q's dtype. `position_ids` is ignored (as in HF).
    `interleaved`: GLM's form, which rotates the channel pairs (2j, 2j + 1) by cos[..., j] / sin[..., j]
    (its cos[..., :D/2] repeated pairwise) instead of the pairs (j, j + D/2).
    Without autograd (inference, decode) the call skips torch.autograd.Function: one dict lookup, two
    allocations and a launch on a repeated signature.
    """
    interleaved = bool(interleaved)
    if torch.compiler.is_compiling():   # one opaque node for Dynamo; eager keeps the cheaper Function (library.py)
        if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
            return reference_rope(q, k, cos, sin, None, unsqueeze_dim, interleaved)
        return _ROPE_OP(q, k, cos, sin, unsqueeze_dim, interleaved)
    if getattr(q, "dtype", None) == torch.float64:   # as the other fused ops: float64 runs the reference
        _check(q, k, cos, sin, unsqueeze_dim, dtypes=(torch.float64,))
        return reference_rope(q, k, cos, sin, None, unsqueeze_dim, interleaved)
    if not getattr(q, "is_cuda", True) and q.device.type != library.device_type():
        # a model left on a device the backend does not launch on (the CPU beside a GPU)
        _check(q, k, cos, sin, unsqueeze_dim)
        return reference_rope(q, k, cos, sin, None, unsqueeze_dim, interleaved)
    if torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in (q, k, cos, sin)):
        if interleaved and (cos.requires_grad or sin.requires_grad):
            _check(q, k, cos, sin, unsqueeze_dim)
            return reference_rope(q, k, cos, sin, None, unsqueeze_dim, True)   # gradients for cos/sin: rare
        return _Rope.apply(q, k, cos, sin, unsqueeze_dim, interleaved)
    return _run(q, k, cos, sin, unsqueeze_dim, False, None, interleaved)


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _rotate_pairs(x):
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def reference_rope(q, k, cos, sin, position_ids=None, unsqueeze_dim=1, interleaved=False):
    """Plain PyTorch: HF's apply_rotary_pos_emb (interleaved: GLM's)."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    if interleaved:
        h = cos.shape[-1] // 2
        cos, sin = cos[..., :h].repeat_interleave(2, -1), sin[..., :h].repeat_interleave(2, -1)
        return q * cos + _rotate_pairs(q) * sin, k * cos + _rotate_pairs(k) * sin
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
