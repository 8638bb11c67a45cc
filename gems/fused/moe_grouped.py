"""Routed SwiGLU experts through torch's grouped GEMM (`torch._grouped_mm`: CUTLASS on Hopper), with
Gems' kernels for everything around the six GEMMs: `moe.moe_experts(..., gemm="torch")` where `usable`
says it runs; the math is `moe.reference_moe_experts`'.

Rows. The S = T * k (token, slot) pairs are sorted by expert id (stable; ids outside [0, E) are sent to the
end as the sentinel E). Sorted row r is slot Perm[r] = t * k + j, token Perm[r] // k; slot s sits at row
Pos[s]. Offs[e] (int32, on the device) ends expert e's rows; rows from n_valid = Offs[E - 1] on select no
expert. torch's grouped GEMM leaves those rows of its outputs unwritten (uninitialised memory, possibly
NaN), so every kernel here that reads a GEMM output selects, never multiplies, by row validity.

Forward:  xs = hidden[Perm // k]                      [S, h]   gather
          gu = xs @ w_gate_up[e].T per expert          [S, 2I]  grouped GEMM
          a  = silu(gu[:, :I]) * gu[:, I:]             [S, I]   gated.packed_forward
          y  = a @ w_down[e].T per expert              [S, h]   grouped GEMM
          out[t] = sum_j w[t, j] * y[Pos[t k + j]]     [T, h]   combine_kernel (fp32 sum, rounded once)
Backward: dys[r] = w[Perm[r]] * dy[t(r)],  dw[Perm[r]] = <dy[t(r)], y[r]>    scatter_grad_kernel
          da = dys @ w_down[e];  dgu = gated.packed_backward(da, gu);  dx_s = dgu @ w_gate_up[e]
          dx[t] = sum_j dx_s[Pos[t k + j]]                                     combine_kernel
          d w_gate_up[e] = dgu_e.T @ xs_e,  d w_down[e] = dys_e.T @ a_e          grouped GEMMs over rows
No host sync anywhere: the expert boundaries stay on the device. Memory kept for the backward: gu [S, 2I],
a [S, I] and y [S, h] at the input dtype (xs is gathered again).

Bytes moved around the GEMMs, per layer: the gather and the combine read and write S x h each way, the
gated product reads S x 2I and writes S x I (backward: reads S x (I + 2I), writes S x 2I).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..runtime import kernel
from ..runtime.utils import cdiv, empty, next_pow2
from .gated import packed_backward, packed_forward


def usable(hidden, w_gate_up, w_down) -> bool:
    """True where this path serves the call: bf16 on a Hopper GPU (sm_90, where grouped GEMM gives zero
    weight gradients to experts without rows; Blackwell's kernels are reported not to), torch with
    `_grouped_mm`, the [E, 2I, h] gate/up tensor, and rows 16-byte aligned as the GEMM requires."""
    if w_gate_up is None or not hasattr(torch, "_grouped_mm") or hidden.device.type != "cuda" \
            or hidden.dtype != torch.bfloat16:
        return False
    if torch.cuda.get_device_capability(hidden.device)[0] != 9:
        return False
    E, I2, h = w_gate_up.shape
    return (h % 8 == 0 and I2 % 16 == 0 and w_gate_up.stride(-1) == 1 and w_down.stride(-1) == 1
            and w_gate_up.stride(-2) % 8 == 0 and w_down.stride(-2) % 8 == 0
            and w_gate_up.data_ptr() % 16 == 0 and w_down.data_ptr() % 16 == 0)


# ------------------------------------------------------------------------------------------- kernels
@kernel
@triton.jit
def combine_kernel(Y, Pos, W, Offs, Out, h, k, n_last, sY, sO, HAS_W: tl.constexpr, BLOCK_H: tl.constexpr):
    """Out[t, cols] = sum_j (w[t, j] *) Y[Pos[t k + j], cols] over the slots whose row is valid (row <
    Offs[n_last]); fp32 sum, one rounding. Grid (T, cdiv(h, BLOCK_H)). Bytes: read k rows, write one."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < h
    n_valid = tl.load(Offs + n_last)
    acc = tl.zeros((BLOCK_H,), tl.float32)
    for j in range(0, k):
        r = tl.load(Pos + t * k + j)
        v = tl.load(Y + r * sY + cols, mask=mask & (r < n_valid), other=0.0).to(tl.float32)
        if HAS_W:
            v = v * tl.load(W + t * k + j).to(tl.float32)
        acc += v
    tl.store(Out + t * sO + cols, acc.to(Out.dtype.element_ty), mask=mask)


@kernel
@triton.jit
def scatter_grad_kernel(DY, Y, Perm, W, Offs, DYS, DW, h, k, n_last, sDY, sY, sD,
                        NEED_DW: tl.constexpr, BLOCK_H: tl.constexpr):
    """Sorted row r (one program): DYS[r] = w[Perm[r]] * DY[Perm[r] // k] (zero on an invalid row) and
    DW[Perm[r]] = <DY[Perm[r] // k], Y[r]> in fp32 (zero on an invalid row). Bytes: read 2 rows, write 1."""
    r = tl.program_id(0).to(tl.int64)
    slot = tl.load(Perm + r)
    t = slot // k
    valid = r < tl.load(Offs + n_last)
    w = tl.where(valid, tl.load(W + slot).to(tl.float32), 0.0)
    dot = tl.zeros((BLOCK_H,), tl.float32)
    for c0 in range(0, h, BLOCK_H):
        cols = c0 + tl.arange(0, BLOCK_H)
        mask = cols < h
        dy = tl.load(DY + t * sDY + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(DYS + r * sD + cols, (dy * w).to(DYS.dtype.element_ty), mask=mask)
        if NEED_DW:
            y = tl.load(Y + r * sY + cols, mask=mask & valid, other=0.0).to(tl.float32)
            dot += dy * y
    if NEED_DW:
        tl.store(DW + slot, tl.where(valid, tl.sum(dot, 0), 0.0))


# ------------------------------------------------------------------------------------------- launches
def _block_h(h):
    return min(1024, next_pow2(h))


def _combine(y, pos, w, offs, T, k):
    """[T, h] at y's dtype: the valid rows of each token's k slots, weighted by w [T * k] (or not: None)."""
    h = y.shape[1]
    out = empty((T, h), y.dtype, y.device)
    bh = _block_h(h)
    combine_kernel[(T, cdiv(h, bh))](y, pos, pos if w is None else w, offs, out, h, k, offs.numel() - 1,
                                     y.stride(0), out.stride(0), w is not None, bh, num_warps=4)
    return out


def _route(topk_ids, E):
    """(Perm [S] int64, Pos [S] int64, Offs [E] int32): the expert-sorted rows (see the module docstring)."""
    ids = topk_ids.reshape(-1)
    ids = torch.where((ids >= 0) & (ids < E), ids, E)
    sorted_ids, perm = torch.sort(ids, stable=True)
    offs = torch.searchsorted(sorted_ids, torch.arange(1, E + 1, device=ids.device, dtype=sorted_ids.dtype),
                              out_int32=True)
    pos = torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))
    return perm, pos, offs


def _forward(hidden, topk_ids, topk_weights, w_gate_up, w_down):
    T, k = topk_ids.shape
    perm, pos, offs = _route(topk_ids, w_gate_up.shape[0])
    xs = hidden.index_select(0, perm // k)
    gu = torch._grouped_mm(xs, w_gate_up.transpose(1, 2), offs=offs)
    a = packed_forward(gu)
    y = torch._grouped_mm(a, w_down.transpose(1, 2), offs=offs)
    w = topk_weights.reshape(-1)
    return _combine(y, pos, w, offs, T, k), (perm, pos, offs, gu, a, y)


class GroupedMoEFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, topk_weights, w_gate_up, w_down, topk_ids):
        out, saved = _forward(hidden, topk_ids, topk_weights, w_gate_up, w_down)
        ctx.save_for_backward(hidden, topk_ids, topk_weights, w_gate_up, w_down, *saved)
        return out

    @staticmethod
    def backward(ctx, dy):
        hidden, topk_ids, topk_weights, w_gate_up, w_down, perm, pos, offs, gu, a, y = ctx.saved_tensors
        need_x, need_w, need_gu, need_d = ctx.needs_input_grad[:4]
        T, k = topk_ids.shape
        S, h = y.shape
        dy = dy.to(hidden.dtype).contiguous()
        w = topk_weights.reshape(-1).contiguous()
        dys = empty((S, h), hidden.dtype, hidden.device)
        dw = empty((S,), torch.float32, hidden.device) if need_w else None
        bh = _block_h(h)
        scatter_grad_kernel[(S,)](dy, y, perm, w, offs, dys, dw if need_w else dys, h, k, offs.numel() - 1,
                                  dy.stride(0), y.stride(0), dys.stride(0), need_w, bh, num_warps=4)
        dx = dwgu = dwd = None
        if need_x or need_gu:
            da = torch._grouped_mm(dys, w_down, offs=offs)
            dgu = packed_backward(da, gu)
            if need_x:
                dx = _combine(torch._grouped_mm(dgu, w_gate_up, offs=offs), pos, None, offs, T, k)
            if need_gu:
                dwgu = torch._grouped_mm(dgu.t(), hidden.index_select(0, perm // k), offs=offs)
        if need_d:
            dwd = torch._grouped_mm(dys.t(), a, offs=offs)
        dwt = dw.view(T, k).to(topk_weights.dtype) if need_w else None
        return dx, dwt, dwgu, dwd, None


def moe_experts(hidden, topk_ids, topk_weights, w_gate_up, w_down):
    """moe.moe_experts through this path (the caller checked `usable` and the shapes)."""
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in (hidden, topk_weights, w_gate_up, w_down)):
        return _forward(hidden, topk_ids, topk_weights, w_gate_up, w_down)[0]
    return GroupedMoEFn.apply(hidden, topk_weights, w_gate_up, w_down, topk_ids)
