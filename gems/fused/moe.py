"""Routed experts of a sparse mixture-of-experts layer (Mixtral, Qwen3-MoE, OLMoE) as grouped GEMMs, forward
and backward, with the plain PyTorch reference beside them (`reference_moe_experts`).

    out[t] = sum_j topk_weights[t, j] * down[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t])),  e = topk_ids[t, j]

Weights are stored as transformers 5.x's `*Experts` modules hold them, used in place (any strides, no
copy): `w_gate_up` [E, 2I, h] (gate rows first, then up rows: `experts.gate_up_proj`) or a pair
(`w_gate` [E, I, h], `w_up` [E, I, h]); `w_down` [E, h, I] (`experts.down_proj`).

Algorithm (every step on the device; no host sync, no per-expert loop):
  1. routing: the T * k expert ids are sorted (stable), per-expert row bounds found by a binary search of
     the sorted ids, and a row-tile table built (moe_kernels.py: which expert and rows each row tile has);
  2. gate and up projections: one launch over all experts, the token rows gathered from `hidden` in the
     kernel, SiLU-and-mul in the epilogue -> H [S, I] (S = T * k, rows sorted by expert);
  3. down projection: one launch; the epilogue multiplies by the routing weight and writes each row at
     its (token, slot) position -> [T, k, h]; the combine is the sum over k (fp32 accumulation).
  Backward: one launch through the down projection, routing weight and SiLU (its epilogue also gives
  d topk_weights), one for d hidden (gate and up weights in one K loop, summed over k like the forward),
  one per weight gradient (grouped over experts, reducing over each expert's rows).
Memory kept for the backward: the gate/up projections [S, 2I] and H [S, I] at the input dtype.

With gemm="torch" (bf16 on Hopper, a [E, 2I, h] gate/up tensor: see moe_grouped.py), eager calls run the
same algorithm with its six GEMMs from `torch._grouped_mm` and Gems' kernels around them. On an H200,
ATen's `_grouped_mm` ran a Mixtral-4l layer's six expert GEMMs (4096 tokens, top-2 of 8, h 2048, I 5632)
in 2.6 ms; the Triton kernels below took 1.4 ms forward and 4.2 ms backward.

Ids outside [0, E) select no expert (their slot contributes zero), as the reference's per-expert loop
and transformers' expert-parallel sentinels. Dtypes: fp32, fp16, bf16 (the three hidden/weight tensors
alike; topk_weights any float dtype, its gradient in its own dtype). float64 and tensors on a device the
active backend does not run on go to the reference.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..runtime import backend
from . import library, moe_grouped
from .library import first, maybe
from ..runtime.utils import cdiv, empty, next_pow2, zeros
from .moe_kernels import down_bwd_kernel, gate_up_kernel, rows_mm_kernel, tile_table_kernel, wgrad_kernel

_SERVED = (torch.float32, torch.float16, torch.bfloat16)

# tile sizes: BM rows of one expert; the interpreter takes small tiles so tests reach several tiles per expert
_CONFIGS = {
    "cuda": dict(gate_up=(64, 64, 8, 3), rows_mm=(128, 64, 8, 3), down_bwd=(64, 64, 8, 3),
                 wgrad=(128, 128, 64, 8, 3), group=8),
    "interpreter": dict(gate_up=(16, 16, 1, 1), rows_mm=(16, 16, 1, 1), down_bwd=(16, 16, 1, 1),
                        wgrad=(16, 16, 16, 1, 1), group=2),
}


def _precision(dtype):
    # fp32 under torch's 'highest' matmul precision multiplies in full fp32; 16-bit inputs are exact on tensor cores
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"


@functools.lru_cache(maxsize=256)
def _row_tile(name, S, E):
    """BM: 128 rows where experts average at least 128 rows, else 64 (fewer idle rows in each expert's last
    tile); the interpreter: 16."""
    if name == "interpreter":
        return 16
    return 128 if S >= 128 * E else 64


# ------------------------------------------------------------------------------------------- checks
def _split(w_gate_up):
    """(gate, up, fused tensor or None): the two [E, I, h] halves as views of one [E, 2I, h] tensor, or a pair."""
    if isinstance(w_gate_up, (tuple, list)):
        if len(w_gate_up) != 2:
            raise ValueError("moe_experts: w_gate_up must be a [E, 2I, h] tensor or a (w_gate, w_up) pair")
        return w_gate_up[0], w_gate_up[1], None
    if not isinstance(w_gate_up, torch.Tensor) or w_gate_up.dim() != 3 or w_gate_up.shape[1] % 2:
        raise ValueError("moe_experts: w_gate_up must be a [E, 2I, h] tensor (even 2I) or a (w_gate, w_up) pair")
    i = w_gate_up.shape[1] // 2
    return w_gate_up[:, :i], w_gate_up[:, i:], w_gate_up


def _check(hidden, topk_ids, topk_weights, w_gate, w_up, w_down):
    """Shapes and dtypes; True when the kernels serve the call (else the reference runs)."""
    what = "moe_experts"
    for name, t in (("hidden", hidden), ("topk_ids", topk_ids), ("topk_weights", topk_weights),
                    ("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{what}: {name} must be a tensor, got {type(t).__name__}")
    if hidden.dim() != 2 or topk_ids.dim() != 2 or tuple(topk_weights.shape) != tuple(topk_ids.shape) \
            or topk_ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"{what}: expected hidden [T, h], topk_ids and topk_weights [T, k]; got "
                         f"{tuple(hidden.shape)}, {tuple(topk_ids.shape)}, {tuple(topk_weights.shape)}")
    if topk_ids.is_floating_point() or topk_ids.is_complex() or topk_ids.dtype == torch.bool:
        raise ValueError(f"{what}: topk_ids must be an integer tensor, got {topk_ids.dtype}")
    if not topk_weights.is_floating_point():
        raise ValueError(f"{what}: topk_weights must be a floating tensor, got {topk_weights.dtype}")
    h = hidden.shape[1]
    if w_gate.dim() != 3 or tuple(w_up.shape) != tuple(w_gate.shape) or w_gate.shape[2] != h \
            or w_down.dim() != 3 or tuple(w_down.shape) != (w_gate.shape[0], h, w_gate.shape[1]):
        raise ValueError(f"{what}: expected gate/up weights [E, I, {h}] and w_down [E, {h}, I]; got "
                         f"{tuple(w_gate.shape)}, {tuple(w_up.shape)}, {tuple(w_down.shape)}")
    dtypes = {hidden.dtype, w_gate.dtype, w_up.dtype, w_down.dtype}
    if len(dtypes) != 1:
        raise ValueError(f"{what}: hidden and the expert weights must share one dtype, got {sorted(map(str, dtypes))}")
    devices = {t.device for t in (hidden, topk_ids, topk_weights, w_gate, w_up, w_down)}
    if len(devices) != 1:
        raise ValueError(f"{what}: all tensors must be on one device, got {sorted(map(str, devices))}")
    if hidden.dtype == torch.float64:
        return False
    if hidden.dtype not in _SERVED:
        raise ValueError(f"{what}: dtype {hidden.dtype} is not supported (float32, float16, bfloat16; float64 runs "
                         f"the PyTorch reference)")
    return hidden.device.type == library.device_type()


# ------------------------------------------------------------------------------------------- launches
def _route(topk_ids, E, BM):
    """(Slot [S] int64: the slot of each sorted row, Bounds [E + 1] int32, Table [3, grid_m] int32, grid_m)."""
    ids = topk_ids.reshape(-1)
    S = ids.numel()
    sorted_ids, slot = torch.sort(ids, stable=True)
    bounds = torch.searchsorted(sorted_ids, torch.arange(E + 1, device=ids.device, dtype=sorted_ids.dtype),
                                out_int32=True)
    grid_m = min(cdiv(S, BM) + E, S)
    table = empty((3, grid_m), torch.int32, ids.device)
    block_t = 64
    tile_table_kernel[(cdiv(grid_m, block_t),)](bounds, table, E, grid_m, BM, max(16, next_pow2(E)), block_t,
                                                num_warps=4)
    return slot, bounds, table, grid_m


def _forward(hidden, topk_ids, topk_weights, w_gate, w_up, w_down, keep):
    """(out [T, h], saved tensors or None). keep: also return what the backward needs."""
    T, h = hidden.shape
    k = topk_ids.shape[1]
    E, I = w_gate.shape[0], w_gate.shape[1]
    S = T * k
    dev, dt = hidden.device, hidden.dtype
    cfg = _CONFIGS[backend().name]
    BM = _row_tile(backend().name, S, E)
    slot, bounds, table, grid_m = _route(topk_ids, E, BM)
    wts = topk_weights.contiguous().view(-1)   # the kernels index it by slot with unit stride
    prec = _precision(dt)
    g = cfg["group"]

    bn, bk, nw, ns = cfg["gate_up"]
    gu = empty((S, 2 * I), dt, dev) if keep else None
    hh = empty((S, I), dt, dev)
    grid = (grid_m * cdiv(I, bn),)
    gate_up_kernel[grid](hidden, slot, table, w_gate, w_up, gu, hh, grid_m, I, h, k,
                         hidden.stride(0), hidden.stride(1), *w_gate.stride(), *w_up.stride(),
                         keep, h % bk == 0, prec, BM, bn, bk, g, num_warps=nw, num_stages=ns)

    bn, bk, nw, ns = cfg["rows_mm"]
    # zeros: a slot whose id selects no expert is never written
    y = zeros((S, h), dt, dev)
    grid = (grid_m * cdiv(h, bn),)
    rows_mm_kernel[grid](hh, w_down, w_down, wts, slot, table, y, grid_m, h, I,
                         hh.stride(0), hh.stride(1), w_down.stride(0), w_down.stride(2), w_down.stride(1),
                         0, 0, 0, y.stride(0), False, True, I % bk == 0, prec, BM, bn, bk, g,
                         num_warps=nw, num_stages=ns)
    out = y.view(T, k, h).sum(1) if k > 1 else y.view(T, h)
    saved = (slot, bounds, table, gu, hh) if keep else None
    return out, saved, BM, grid_m


def _backward(dy, hidden, topk_ids, topk_weights, w_gate, w_up, w_down, saved, BM, grid_m, need):
    """(d hidden, d topk_weights, d gate/up weights [E, 2I, h], d w_down), each None where `need` says so."""
    need_x, need_w, need_gu, need_d = need
    slot, bounds, table, gu, hh = saved
    T, h = hidden.shape
    k = topk_ids.shape[1]
    E, I = w_gate.shape[0], w_gate.shape[1]
    S = T * k
    dev, dt = hidden.device, hidden.dtype
    dy = dy.to(dt)          # the kernels multiply dy with the weights at one dtype
    cfg = _CONFIGS[backend().name]
    wts = topk_weights.contiguous().view(-1)   # the kernels index it by slot with unit stride
    prec = _precision(dt)
    g = cfg["group"]
    dx = dwt = dwgu = dwd = None

    dgu = dwp = None
    if need_x or need_w or need_gu:
        bn, bk, nw, ns = cfg["down_bwd"]
        grid_n = cdiv(I, bn)
        dgu = empty((S, 2 * I), dt, dev) if (need_x or need_gu) else None
        dwp = zeros((grid_n, S), torch.float32, dev) if need_w else None
        down_bwd_kernel[(grid_m * grid_n,)](dy, slot, table, w_down, wts, hh, gu, dgu, dwp, grid_m, I, h, k, S,
                                            dy.stride(0), dy.stride(1), *w_down.stride(),
                                            dgu is not None, need_w, h % bk == 0, prec, BM, bn, bk, g,
                                            num_warps=nw, num_stages=ns)
        if need_w:
            dwt = dwp.sum(0).view(T, k).to(topk_weights.dtype)
    if need_x:
        bn, bk, nw, ns = cfg["rows_mm"]
        dxs = zeros((S, h), dt, dev)
        rows_mm_kernel[(grid_m * cdiv(h, bn),)](dgu, w_gate, w_up, wts, slot, table, dxs, grid_m, h, I,
                                                dgu.stride(0), dgu.stride(1),
                                                w_gate.stride(0), w_gate.stride(1), w_gate.stride(2),
                                                w_up.stride(0), w_up.stride(1), w_up.stride(2), dxs.stride(0),
                                                True, False, I % bk == 0, prec, BM, bn, bk, g,
                                                num_warps=nw, num_stages=ns)
        dx = dxs.view(T, k, h).sum(1) if k > 1 else dxs.view(T, h)
    bm, bn, bk, nw, ns = cfg["wgrad"]
    if need_gu:
        dwgu = empty((E, 2 * I, h), dt, dev)
        grid = (E * cdiv(2 * I, bm) * cdiv(h, bn),)
        wgrad_kernel[grid](dgu, hidden, wts, slot, bounds, dwgu, 2 * I, h, k,
                           dgu.stride(0), dgu.stride(1), hidden.stride(0), hidden.stride(1), *dwgu.stride(),
                           False, True, False, prec, bm, bn, bk, num_warps=nw, num_stages=ns)
    if need_d:
        dwd = empty((E, h, I), dt, dev)
        grid = (E * cdiv(h, bm) * cdiv(I, bn),)
        wgrad_kernel[grid](dy, hh, wts, slot, bounds, dwd, h, I, k,
                           dy.stride(0), dy.stride(1), hh.stride(0), hh.stride(1), *dwd.stride(),
                           True, False, True, prec, bm, bn, bk, num_warps=nw, num_stages=ns)
    return dx, dwt, dwgu, dwd


class _MoEFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, topk_weights, w_a, w_b, w_down, topk_ids):
        w_gate, w_up, _ = _split(w_a if w_b is None else (w_a, w_b))
        out, saved, ctx.bm, ctx.grid_m = _forward(hidden, topk_ids, topk_weights, w_gate, w_up, w_down, True)
        ctx.fused = w_b is None
        ctx.save_for_backward(hidden, topk_ids, topk_weights, w_a, w_b, w_down, *saved)
        return out

    @staticmethod
    def backward(ctx, dy):
        hidden, topk_ids, topk_weights, w_a, w_b, w_down, *saved = ctx.saved_tensors
        w_gate, w_up, _ = _split(w_a if w_b is None else (w_a, w_b))
        ni = ctx.needs_input_grad
        need = (ni[0], ni[1], ni[2] or ni[3], ni[4])
        dx, dwt, dwgu, dwd = _backward(dy, hidden, topk_ids, topk_weights, w_gate, w_up, w_down, saved,
                                       ctx.bm, ctx.grid_m, need)
        if dwgu is None:
            da = db = None
        elif ctx.fused:
            da, db = dwgu, None
        else:
            i = w_gate.shape[1]
            da = dwgu[:, :i] if ni[2] else None
            db = dwgu[:, i:] if ni[3] else None
        return dx, dwt, da, db, dwd, None


# torch.compile: gems::moe_experts and its backward (library.py). The forward returns what the backward
# needs (the routing and the gate/up activations) as outputs; the row tile and tile count are read back
# from their shapes.
def _moe_op_forward(hidden, topk_ids, topk_weights, w_gate, w_up, w_down):
    out, saved, _, _ = _forward(hidden, topk_ids, topk_weights, w_gate, w_up, w_down, True)
    return (out, *saved)


def _moe_route_shapes(S, E):
    BM = _row_tile(backend().name, S, E)
    return BM, torch.sym_min(cdiv(S, BM) + E, S)


def _moe_fake(hidden, topk_ids, topk_weights, w_gate, w_up, w_down):
    T, h = hidden.shape
    S, E, I = T * topk_ids.shape[1], w_gate.shape[0], w_gate.shape[1]
    _, grid_m = _moe_route_shapes(S, E)
    i32 = dict(dtype=torch.int32)
    return (hidden.new_empty((T, h)), topk_ids.new_empty((S,), dtype=torch.int64),
            topk_ids.new_empty((E + 1,), **i32), topk_ids.new_empty((3, grid_m), **i32),
            hidden.new_empty((S, 2 * I)), hidden.new_empty((S, I)))


def _moe_op_backward(dy, hidden, topk_ids, topk_weights, w_gate, w_up, w_down, saved, need_x, need_w, need_gu,
                     need_d):
    BM, grid_m = _moe_route_shapes(hidden.shape[0] * topk_ids.shape[1], w_gate.shape[0])
    return tuple(maybe(t) for t in _backward(dy, hidden, topk_ids, topk_weights, w_gate, w_up, w_down, tuple(saved),
                                             BM, grid_m, (need_x, need_w, need_gu, need_d)))


def _moe_bwd_fake(dy, hidden, topk_ids, topk_weights, w_gate, w_up, w_down, saved, need_x, need_w, need_gu, need_d):
    E, I, h = w_gate.shape
    return (maybe(hidden.new_empty(hidden.shape) if need_x else None),
            maybe(topk_weights.new_empty(topk_weights.shape) if need_w else None),
            maybe(hidden.new_empty((E, 2 * I, h)) if need_gu else None),
            maybe(hidden.new_empty((E, h, I)) if need_d else None))


def _moe_save(ctx, inputs, output):
    ctx.save_for_backward(*inputs, *output[1:])


def _moe_grads(ctx, dy, *unused):
    hidden, topk_ids, topk_weights, w_gate, w_up, w_down, *saved = ctx.saved_tensors
    ni = ctx.needs_input_grad
    dx, dwt, dwgu, dwd = _MOE_BWD(dy, hidden, topk_ids, topk_weights, w_gate, w_up, w_down, saved,
                                  ni[0], ni[2], ni[3] or ni[4], ni[5])
    dwgu, I = first(dwgu), w_gate.shape[1]
    dg = dwgu[:, :I] if dwgu is not None and ni[3] else None
    du = dwgu[:, I:] if dwgu is not None and ni[4] else None
    return first(dx), None, first(dwt), dg, du, first(dwd)


_MOE_BWD = library.define(
    "moe_experts_backward", "(Tensor dy, Tensor hidden, Tensor topk_ids, Tensor topk_weights, Tensor w_gate, "
    "Tensor w_up, Tensor w_down, Tensor[] saved, bool need_x, bool need_w, bool need_gu, bool need_d) "
    "-> (Tensor[], Tensor[], Tensor[], Tensor[])", _moe_op_backward, _moe_bwd_fake)
_MOE_OP = library.define(
    "moe_experts", "(Tensor hidden, Tensor topk_ids, Tensor topk_weights, Tensor w_gate, Tensor w_up, "
    "Tensor w_down) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)", _moe_op_forward, _moe_fake,
    backward=_moe_grads, setup_context=_moe_save)


def moe_experts(hidden, topk_ids, topk_weights, w_gate_up, w_down, *, gemm: str = "triton"):
    """Routed SwiGLU experts: hidden [T, h], topk_ids / topk_weights [T, k], w_gate_up [E, 2I, h] or a pair
    ([E, I, h], [E, I, h]), w_down [E, h, I] -> [T, h] at hidden's dtype. Differentiable in hidden,
    topk_weights and the weights (grouped-GEMM kernels; see the module docstring).
    gemm: "triton" (Gems' grouped-GEMM kernels) or "torch" (torch's grouped GEMM where moe_grouped.usable
    says it runs: bf16 on Hopper, a [E, 2I, h] gate/up tensor; the Triton kernels elsewhere)."""
    if gemm not in ("triton", "torch"):
        raise ValueError(f"moe_experts: gemm must be 'triton' or 'torch', got {gemm!r}")
    w_gate, w_up, fused = _split(w_gate_up)
    if not _check(hidden, topk_ids, topk_weights, w_gate, w_up, w_down):
        return reference_moe_experts(hidden, topk_ids, topk_weights, w_gate_up, w_down)
    if hidden.shape[0] == 0 or topk_ids.shape[1] == 0 or hidden.shape[1] == 0 or w_gate.shape[1] == 0:
        # nothing to route or an empty projection: the reference computes the (zero / empty) answer and its graph
        return reference_moe_experts(hidden, topk_ids, topk_weights, w_gate_up, w_down)
    if torch.compiler.is_compiling():   # one opaque node for Dynamo; eager keeps the cheaper Function (library.py)
        return _MOE_OP(hidden, topk_ids, topk_weights, w_gate, w_up, w_down)[0]
    if gemm == "torch" and moe_grouped.usable(hidden, fused, w_down):
        return moe_grouped.moe_experts(hidden, topk_ids, topk_weights, fused, w_down)
    tensors = (hidden, topk_weights, w_gate, w_up, w_down) if fused is None else (hidden, topk_weights, fused, w_down)
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in tensors):
        return _forward(hidden, topk_ids, topk_weights, w_gate, w_up, w_down, False)[0]
    if fused is not None:
        return _MoEFn.apply(hidden, topk_weights, fused, None, w_down, topk_ids)
    return _MoEFn.apply(hidden, topk_weights, w_gate, w_up, w_down, topk_ids)


# -------------------------------------------------------------------------------------------- reference
def reference_moe_experts(hidden, topk_ids, topk_weights, w_gate_up, w_down):
    """The per-expert loop of transformers' MixtralExperts / Qwen3MoeExperts / OlmoeExperts (eager):
    for each expert, its tokens' gate/up projections, silu(gate) * up, the down projection times the
    routing weight, added into the output by token at the input dtype. Ids outside [0, E) are skipped."""
    w_gate, w_up, _ = _split(w_gate_up)
    out = torch.zeros_like(hidden)
    for e in range(w_gate.shape[0]):
        tok, pos = torch.where(topk_ids == e)
        if tok.numel() == 0:
            continue
        x = hidden[tok]
        act = F.silu(F.linear(x, w_gate[e])) * F.linear(x, w_up[e])
        y = F.linear(act, w_down[e]) * topk_weights[tok, pos, None]
        out = out.index_add(0, tok, y.to(out.dtype))
    return out
