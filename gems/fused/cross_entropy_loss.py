"""Cross-entropy over a large vocabulary: torch.nn.functional.cross_entropy for class-index targets,
log-sum-exp in fp32 in one Triton pass over each row, the gradient written by the forward.

    loss = cross_entropy(logits, target)                       # logits [N, V], target [N] (int64/int32)

The LM head fused with it (no full logits in memory) is `linear_cross_entropy.py`, on these kernels.

Semantics are torch.nn.functional.cross_entropy's for class-index targets: `ignore_index` rows
contribute nothing, `label_smoothing` eps mixes in the uniform distribution
    loss_i = (1 - eps) * (lse_i - x_i[t_i]) + eps * (lse_i - mean_j x_ij),   lse_i = log sum_j exp(x_ij)
and `reduction` is "mean" (sum over rows / number of non-ignored rows; all ignored gives nan, like
torch), "sum" or "none" (one value per row, 0 for ignored rows). `divisor=` with "sum" gives
sum / divisor (Hugging Face's `num_items_in_batch`), folded into the gradient written in forward.
Class weights (`weight=`) follow torch: loss_i scaled by w[t_i] (the smoothing
term by w_j inside its sum), mean divided by the sum of w[t_i] over non-ignored rows. A target outside
[0, V) that is not `ignore_index` gives a nan loss (and a nan gradient row) instead of torch's error
or device assert.

Dtypes: logits fp32/fp16/bf16; all arithmetic in fp32 (log-sum-exp over V in blocks, so any V
works). The loss has the logits' dtype like torch's, fp32 under autocast like torch's;
`out_dtype=torch.float32` returns the fp32 value computed internally (what Hugging Face gets by
upcasting the logits, without the fp32 copy). Gradients have the inputs' dtypes.

Memory contract. Reduction "mean"/"sum" with grad: the forward writes d(logits) for
grad_output = 1 into a new [N, V] tensor (logits dtype; already divided by the count or divisor)
and keeps no reference to the logits; a row of up to 32768 16-bit (16384 fp32) elements is read
once and kept in registers, longer rows are streamed twice. Backward returns that tensor, scaled in
place only when grad_output != 1 (decided on the device: no host sync; one extra read+write then);
it may run once (a second backward through the same graph raises). Traffic for loss.backward():
one read and one write of N x V, the lower bound.
Reduction "none" with grad: the forward keeps the logits (by reference) and an fp32 log-sum-exp per
row; backward reads them once and writes d(logits) scaled per row (3 x N x V in all).
Without grad: one read of the logits. The caller's logits are never written.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..runtime import kernel
from ..runtime.alloc import empty
from ..runtime.utils import next_pow2
from . import deferral, library

DTYPES = (torch.float32, torch.float16, torch.bfloat16)   # served logits dtypes
REDUCTIONS = {"none": 0, "sum": 1, "mean": 2}             # reduction -> the kernels' MODE


# ----------------------------------------------------------------------------------------- kernels
@triton.jit
def _ce_grad(x, cols, t, lse, a, b, c, scale, valid):
    """d(loss)/dx_j = (a * exp(x_j - lse) - b*[j == t] - c_j) * scale (nan for an invalid target), with
    a = (1-eps)*w_t + eps*sum(w)/V, b = (1-eps)*w_t, c_j = eps*w_j/V (w = 1 without class weights)."""
    g = a * tl.exp(x - lse) - tl.where(cols == t, b, 0.0) - c
    return tl.where(valid, g, float("nan")) * scale


@triton.jit
def _ce_coefs(W, WSUM, t, valid, eps, V, HAS_W: tl.constexpr):
    """(w_t, sum_j w_j): the target's class weight and the weights' sum (1 and V without weights)."""
    if HAS_W:
        w_t = tl.load(W + tl.where(valid, t, 0)).to(tl.float32)
        wsum = tl.load(WSUM).to(tl.float32)
    else:
        w_t = 1.0
        wsum = V * 1.0
    return w_t, wsum


@kernel
@triton.jit
def ce_fwd_kernel(X, TGT, LOSS, LSE, CNT, DX, W, WSUM, V, x_sr, x_sv, dx_sr, t_s, ignore_index, eps,
                  HAS_LS: tl.constexpr, HAS_W: tl.constexpr, STORE_LSE: tl.constexpr, WRITE_GRAD: tl.constexpr,
                  MEAN: tl.constexpr, SINGLE: tl.constexpr, BLOCK_V: tl.constexpr):
    """One program per row i, x = X[i, :], t = TGT[i], class weights w (all 1 without HAS_W):
        lse  = log sum_j exp(x_j)                        (online: running max m, running sum d)
        loss = (1-eps)*w_t*(lse - x_t) + eps/V * (sum_j w_j * lse - sum_j w_j*x_j);  0 if t == ignore_index
    (= (1-eps)*(lse - x_t) + eps*(lse - mean_j x_j) without weights: torch's formula).
    WRITE_GRAD: DX[i, j] = ((1-eps)*w_t*(p_j - [j == t]) + eps/V*(sum(w)*p_j - w_j)) * scale,
    p = softmax(x), scale = 1/CNT[0] (MEAN) or 1; 0 for an ignored row. DX may be X itself (fused
    linear CE writes over its logits chunk). SINGLE (BLOCK_V >= V): the row is loaded once and kept in
    registers. Bytes per row: V reads; with WRITE_GRAD + V writes (SINGLE) or + V reads + V writes
    (the second read of the row mostly from L2); 4-8 bytes of loss/lse (+ V weights from L2 with
    HAS_W).
    """
    row = tl.program_id(0).to(tl.int64)
    xrow = X + row * x_sr
    dxrow = DX + row * dx_sr
    t = tl.load(TGT + row * t_s).to(tl.int64)
    offs = tl.arange(0, BLOCK_V)
    if t == ignore_index:
        tl.store(LOSS + row, tl.full((), 0.0, tl.float32).to(LOSS.dtype.element_ty))
        if STORE_LSE:
            tl.store(LSE + row, tl.full((), 0.0, tl.float32))
        if WRITE_GRAD:
            for v0 in range(0, V, BLOCK_V):
                cols = v0 + offs
                tl.store(dxrow + cols, tl.zeros((BLOCK_V,), tl.float32).to(DX.dtype.element_ty), mask=cols < V)
    else:
        valid = (t >= 0) & (t < V)
        x_t = tl.load(xrow + tl.where(valid, t, 0) * x_sv).to(tl.float32)
        w_t, wsum = _ce_coefs(W, WSUM, t, valid, eps, V, HAS_W)
        a = (1.0 - eps) * w_t + eps * wsum / V
        b = (1.0 - eps) * w_t
        scale = 1.0
        if MEAN:
            scale = 1.0 / tl.load(CNT).to(tl.float32)
        if SINGLE:
            mask = offs < V
            x = tl.load(xrow + offs * x_sv, mask=mask, other=-float("inf")).to(tl.float32)
            m = tl.max(x, 0)
            lse = m + tl.log(tl.sum(tl.exp(x - m), 0))
            c = eps / V
            sx = 0.0
            if HAS_W:
                wv = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
                c = c * wv
                if HAS_LS:
                    sx = tl.sum(tl.where(mask, x * wv, 0.0), 0)
            elif HAS_LS:
                sx = tl.sum(tl.where(mask, x, 0.0), 0)
            if WRITE_GRAD:
                g = _ce_grad(x, offs, t, lse, a, b, c, scale, valid)
                tl.store(dxrow + offs, g.to(DX.dtype.element_ty), mask=mask)
        else:
            m = -float("inf")
            d = 0.0
            sx = 0.0
            for v0 in range(0, V, BLOCK_V):
                cols = v0 + offs
                x = tl.load(xrow + cols * x_sv, mask=cols < V, other=-float("inf")).to(tl.float32)
                m_new = tl.maximum(m, tl.max(x, 0))
                d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
                m = m_new
                if HAS_LS:
                    if HAS_W:
                        wv = tl.load(W + cols, mask=cols < V, other=0.0).to(tl.float32)
                        sx += tl.sum(tl.where(cols < V, x * wv, 0.0), 0)
                    else:
                        sx += tl.sum(tl.where(cols < V, x, 0.0), 0)
            lse = m + tl.log(d)
            if WRITE_GRAD:
                for v0 in range(0, V, BLOCK_V):
                    cols = v0 + offs
                    mask = cols < V
                    x = tl.load(xrow + cols * x_sv, mask=mask, other=0.0).to(tl.float32)
                    c = eps / V
                    if HAS_W:
                        c = c * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
                    g = _ce_grad(x, cols, t, lse, a, b, c, scale, valid)
                    tl.store(dxrow + cols, g.to(DX.dtype.element_ty), mask=mask)
        loss = w_t * (lse - x_t)
        if HAS_LS:
            loss = (1.0 - eps) * loss + eps / V * (wsum * lse - sx)
        loss = tl.where(valid, loss, float("nan"))
        tl.store(LOSS + row, loss.to(LOSS.dtype.element_ty))
        if STORE_LSE:
            tl.store(LSE + row, lse)


@kernel
@triton.jit
def ce_scale_kernel(DX, G, NUMEL, BLOCK: tl.constexpr):
    """DX *= G[0] in place, unless G[0] == 1 (then every program returns after one scalar load: the
    usual loss.backward() costs a launch, no pass over DX and no host sync). Bytes: 2 * NUMEL or 0."""
    g = tl.load(G).to(tl.float32)
    if g != 1.0:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < NUMEL
        x = tl.load(DX + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + offs, (x * g).to(DX.dtype.element_ty), mask=mask)


@kernel
@triton.jit
def ce_reduce_kernel(LOSS, TGT, OUT, CNT, W, N, V, t_s, ignore_index,
                     MEAN: tl.constexpr, COUNT: tl.constexpr, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    """One program: OUT = sum_i LOSS[i] (/ CNT for MEAN), CNT = sum over non-ignored rows of 1
    (w[TGT[i]] with class weights), computed when COUNT, else read from CNT. Bytes: 4N (+ 8N)."""
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), tl.float32)
    cnt = tl.zeros((BLOCK,), tl.float32)
    for i0 in range(0, N, BLOCK):
        rows = i0 + offs
        mask = rows < N
        acc += tl.load(LOSS + rows, mask=mask, other=0.0)
        if COUNT:
            cnt += _ce_count_block(TGT, W, rows, mask, N, V, t_s, ignore_index, HAS_W)
    total = tl.sum(acc, 0)
    if COUNT:
        c = tl.sum(cnt, 0)
        tl.store(CNT, c)
    else:
        c = tl.load(CNT).to(tl.float32)
    if MEAN:
        total = total / c
    tl.store(OUT, total.to(OUT.dtype.element_ty))


@kernel
@triton.jit
def ce_count_kernel(TGT, CNT, W, N, V, t_s, ignore_index, HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    """CNT[0] = sum over rows with TGT[i] != ignore_index of 1 (w[TGT[i]] with class weights), fp32.
    Bytes: 8N (+ 4N weights)."""
    offs = tl.arange(0, BLOCK)
    cnt = tl.zeros((BLOCK,), tl.float32)
    for i0 in range(0, N, BLOCK):
        rows = i0 + offs
        cnt += _ce_count_block(TGT, W, rows, rows < N, N, V, t_s, ignore_index, HAS_W)
    tl.store(CNT, tl.sum(cnt, 0))


@triton.jit
def _ce_count_block(TGT, W, rows, mask, N, V, t_s, ignore_index, HAS_W: tl.constexpr):
    t = tl.load(TGT + rows.to(tl.int64) * t_s, mask=mask, other=ignore_index).to(tl.int64)
    keep = t != ignore_index
    if HAS_W:
        inside = keep & (t >= 0) & (t < V)
        return tl.where(keep, tl.load(W + tl.where(inside, t, 0), mask=mask & inside, other=0.0).to(tl.float32), 0.0)
    else:
        return tl.where(keep, 1.0, 0.0)


@kernel
@triton.jit
def ce_bwd_kernel(X, TGT, LSE, G, CNT, DX, W, WSUM, V, x_sr, x_sv, t_s, g_s, ignore_index, eps,
                  HAS_W: tl.constexpr, MODE: tl.constexpr, BLOCK_V: tl.constexpr):
    """Grid (N, cdiv(V, BLOCK_V)); row i, columns of block j (class weights w, all 1 without HAS_W):
        DX[i, c] = ((1-eps)*w_t*(p_c - [c == t_i]) + eps/V*(sum(w)*p_c - w_c)) * s_i,  p = exp(x - lse_i)
        0 for an ignored row; s_i = G[i] (MODE 0, none), G[0] (1, sum), G[0] / CNT[0] (2, mean)
    Bytes: V reads + V writes per row (the logits read once, the gradient written once)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < V
    t = tl.load(TGT + row * t_s).to(tl.int64)
    dxp = DX + row * V + cols
    if t == ignore_index:
        tl.store(dxp, tl.zeros((BLOCK_V,), tl.float32).to(DX.dtype.element_ty), mask=mask)
    else:
        if MODE == 0:
            s = tl.load(G + row * g_s).to(tl.float32)
        else:
            s = tl.load(G).to(tl.float32)
            if MODE == 2:
                s = s / tl.load(CNT).to(tl.float32)
        lse = tl.load(LSE + row)
        x = tl.load(X + row * x_sr + cols * x_sv, mask=mask, other=0.0).to(tl.float32)
        valid = (t >= 0) & (t < V)
        w_t, wsum = _ce_coefs(W, WSUM, t, valid, eps, V, HAS_W)
        c = eps / V
        if HAS_W:
            c = c * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
        g = _ce_grad(x, cols, t, lse, (1.0 - eps) * w_t + eps * wsum / V, (1.0 - eps) * w_t, c, s, valid)
        tl.store(dxp, g.to(DX.dtype.element_ty), mask=mask)



# ------------------------------------------------------------------------------------ host side
def autocast_on(t) -> bool:
    """Whether autocast is on for t's device type (the result dtype then follows torch's: fp32)."""
    return torch.is_autocast_enabled(t.device.type)


_CONFIGS: dict = {}


# a row of up to this many elements is kept in registers by the forward (one read of the logits)
_SINGLE_MAX = {torch.float32: 16384, torch.float16: 32768, torch.bfloat16: 32768}


def launch_config(V: int, dtype):
    """(fwd BLOCK_V, fwd warps, fwd SINGLE, bwd BLOCK_V, bwd warps), cached per (V, dtype).

    Forward, one program per row: a row of up to 32768 16-bit (16384 fp32) elements in one block of
    next_pow2(V) (32 elements per thread at 16-32 warps), else streamed in blocks of 8192 (16-bit) /
    4096 (fp32), 16 elements per thread. Backward: one program per (row, block of 4096)."""
    key = (V, dtype)
    cfg = _CONFIGS.get(key)
    if cfg is None:
        p2 = next_pow2(V)
        single = p2 <= _SINGLE_MAX[dtype]
        fb = p2 if single else (4096 if dtype == torch.float32 else 8192)
        fw = max(1, min(32 if single else 16, fb // (32 * 32 if single else 512)))
        bb = min(p2, 4096)
        bw = max(1, min(8, bb // 512))
        cfg = _CONFIGS[key] = (fb, fw, single, bb, bw)
    return cfg


def check_common(name, target, N, ignore_index, label_smoothing, reduction, device):
    """The argument checks `cross_entropy` and `fused_linear_cross_entropy` share (target, reduction,
    label_smoothing, ignore_index), with `name` in the messages."""
    if not isinstance(target, torch.Tensor) or target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name}: target must be an int64 (or int32) tensor of class indices, got "
                        f"{getattr(target, 'dtype', type(target).__name__)} (probability targets are not supported)")
    if target.dim() != 1 or target.shape[0] != N:
        raise ValueError(f"{name}: target must be 1-D with {N} elements, got shape {tuple(target.shape)}")
    if target.device != device:
        raise ValueError(f"{name}: target on {target.device}, input on {device}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"{name}: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"{name}: label_smoothing must be between 0.0 and 1.0, got {label_smoothing}")
    if not isinstance(ignore_index, int):
        raise TypeError(f"{name}: ignore_index must be an int, got {type(ignore_index).__name__}")


def empty_result(N, reduction, dtype, device):
    """The loss of zero rows, as torch gives it: empty for "none", nan for "mean", 0 for "sum"."""
    if reduction == "none":
        return torch.empty(0, dtype=dtype, device=device)
    return torch.full((), float("nan") if reduction == "mean" else 0.0, dtype=dtype, device=device)


def divisor_arg(divisor, reduction, device, name):
    """`divisor` as a 1-element fp32 tensor on the device (HF's num_items_in_batch), or None."""
    if divisor is None:
        return None
    if reduction != "sum":
        raise ValueError(f"{name}: divisor= goes with reduction='sum' (loss = sum / divisor), got {reduction!r}")
    if isinstance(divisor, torch.Tensor):
        if divisor.numel() != 1:
            raise ValueError(f"{name}: divisor must have one element, got shape {tuple(divisor.shape)}")
        return divisor.detach().reshape(1).to(device=device, dtype=torch.float32)
    return torch.full((1,), float(divisor), dtype=torch.float32, device=device)


class _CrossEntropy(torch.autograd.Function):
    """mean/sum with grad: the forward writes d(logits) for grad_output = 1 (the logits read once when
    a row fits in registers) and backward scales it in place only if grad_output != 1 (checked on the
    device). "none" with grad: the forward keeps the logits and lse, backward writes d(logits) in one
    pass. Without grad: one read of the logits."""

    @staticmethod
    def forward(ctx, logits, target, ignore_index, eps, reduction, out_dtype, divisor, grad_on, weight):
        N, V = logits.shape
        has_w = weight is not None
        # class weights (fp32 sum on the device), or the logits as an unused pointer
        w, wsum = (weight, weight.sum(dtype=torch.float32).reshape(1)) if has_w else (logits, logits)
        mode = REDUCTIONS[reduction]
        fb, fw, single, _, _ = launch_config(V, logits.dtype)
        dev = logits.device
        # (needs_input_grad is True under torch.no_grad() too: grad mode is checked by the caller)
        need_grad = grad_on and ctx.needs_input_grad[0]
        eager = need_grad and mode != 0
        divide = mode == 2 or divisor is not None
        # per-row loss: fp32 workspace for mean/sum, the result itself for none
        rows = empty((N,), out_dtype if mode == 0 else torch.float32, dev)
        lse = empty((N,), torch.float32, dev) if need_grad and not eager else rows
        # the divisor: the count of non-ignored targets (mean) or the caller's (sum / divisor)
        cnt = divisor if divisor is not None else empty((1,), torch.float32, dev)
        if eager and mode == 2:   # the count first: the gradient is written already divided by it
            ce_count_kernel[(1,)](target, cnt, w, N, V, target.stride(0), ignore_index, has_w, 1024, num_warps=4)
        dx = empty((N, V), logits.dtype, dev) if eager else logits
        ce_fwd_kernel[(N,)](logits, target, rows, lse, cnt, dx, w, wsum, V, logits.stride(0), logits.stride(1), V,
                            target.stride(0), ignore_index, eps, eps > 0.0, has_w, need_grad and not eager, eager,
                            eager and divide, single, fb, num_warps=fw)
        if mode == 0:
            out = rows
        else:
            out = empty((), out_dtype, dev)
            ce_reduce_kernel[(1,)](rows, target, out, cnt, w, N, V, target.stride(0), ignore_index,
                                   divide, mode == 2 and not eager, has_w, 1024, num_warps=4)
        ctx.eager = eager
        if eager:
            ctx.save_for_backward(dx)
            ctx.used = False
        elif need_grad:
            ctx.save_for_backward(logits, target, lse, cnt, *((w, wsum) if has_w else ()))
            ctx.args = (ignore_index, eps, mode)
        return out

    @staticmethod
    def backward(ctx, grad):
        if ctx.eager:
            if ctx.used:
                raise RuntimeError("gems.fused.cross_entropy: backward through the same graph twice is not "
                                   "supported with reduction 'mean'/'sum' (the gradient computed in forward is "
                                   "scaled in place)")
            ctx.used = True
            (dx,) = ctx.saved_tensors
            dx = deferral.backward("cross_entropy", scale_in_place, (dx, grad), lambda: dx.mul_(grad))
            return dx, None, None, None, None, None, None, None, None
        logits, target, lse, cnt = ctx.saved_tensors[:4]
        has_w = len(ctx.saved_tensors) > 4
        w, wsum = ctx.saved_tensors[4:] if has_w else (logits, logits)
        ignore_index, eps, mode = ctx.args
        dx = deferral.backward(
            "cross_entropy", _backward, (grad, logits, target, lse, cnt, w, wsum, has_w, ignore_index, eps, mode),
            lambda: deferral.reference_grads(
                lambda lg: reference_cross_entropy(lg, target, weight=w if has_w else None, ignore_index=ignore_index,
                                                   label_smoothing=eps, reduction="none", out_dtype=grad.dtype),
                (logits,), (True,), (grad,))[0])
        return dx, None, None, None, None, None, None, None, None


def scale_in_place(dx, grad):
    """dx *= grad (the loss's gradient, a device scalar) in place, unless grad is 1; dx."""
    n = dx.numel()
    if n:
        ce_scale_kernel[(-(-n // 4096),)](dx, grad, n, 4096, num_warps=8)
    return dx


def _backward(grad, logits, target, lse, cnt, w, wsum, has_w, ignore_index, eps, mode):
    """d(logits) of reduction "none" from the saved lse, in one pass."""
    N, V = logits.shape
    _, _, _, bb, bw = launch_config(V, logits.dtype)
    dx = empty((N, V), logits.dtype, logits.device)
    g_s = grad.stride(0) if mode == 0 else 0
    ce_bwd_kernel[(N, -(-V // bb))](logits, target, lse, grad, cnt, dx, w, wsum, V, logits.stride(0),
                                    logits.stride(1), target.stride(0), g_s, ignore_index, eps, has_w, mode, bb,
                                    num_warps=bw)
    return dx


# torch.compile: gems::cross_entropy and its backward (library.py) run _CrossEntropy's bodies. The
# forward's `Tensor[]` output holds what backward reads: d(logits) for "mean"/"sum", lse for "none"
# (the logits, target and weight are inputs, saved as such), nothing without grad. Backward scales a
# copy of the stored d(logits): an operator does not write its saved inputs.
def _ce_fwd_impl(logits, target, weight, divisor, ignore_index, eps, reduction, out_dtype, need_grad):
    ctx = library.FunctionContext((need_grad,))
    out = _CrossEntropy.forward(ctx, logits, target, ignore_index, eps, reduction, out_dtype, divisor, need_grad,
                                weight)
    saved = ctx.saved_tensors
    return out, (list(saved) if ctx.eager else [saved[2]] if need_grad else [])


def _ce_fwd_fake(logits, target, weight, divisor, ignore_index, eps, reduction, out_dtype, need_grad):
    N = logits.shape[0]
    out = logits.new_empty((N,) if reduction == "none" else (), dtype=out_dtype)
    if not need_grad:
        return out, []
    if reduction == "none":
        return out, [logits.new_empty((N,), dtype=torch.float32)]
    return out, [logits.new_empty(logits.shape)]


def _ce_bwd_impl(grad, saved, logits, target, weight, ignore_index, eps, reduction):
    if reduction != "none":
        ctx = library.FunctionContext(saved=(saved[0].clone(),))
        ctx.eager, ctx.used = True, False
    else:
        w = (weight, weight.sum(dtype=torch.float32).reshape(1)) if weight is not None else ()
        ctx = library.FunctionContext(saved=(logits, target, saved[0], saved[0], *w))
        ctx.eager, ctx.args = False, (ignore_index, eps, REDUCTIONS[reduction])
    return _CrossEntropy.backward(ctx, grad)[0]


def _ce_save(ctx, inputs, output):
    logits, target, weight, _, ctx.ignore_index, ctx.eps, ctx.reduction, _, _ = inputs
    lazy = ctx.reduction == "none"
    ctx.save_for_backward(*output[1], *((logits, target, weight) if lazy else ()))


def _ce_grads(ctx, grad, _):
    saved = ctx.saved_tensors
    logits, target, weight = saved[1:] if ctx.reduction == "none" else (None, None, None)
    return (_CE_BWD(grad, saved[:1], logits, target, weight, ctx.ignore_index, ctx.eps, ctx.reduction),
            None, None, None, None, None, None, None, None)


_CE_BWD = library.define(
    "cross_entropy_backward", "(Tensor grad, Tensor[] saved, Tensor? logits, Tensor? target, Tensor? weight, "
    "int ignore_index, float eps, str reduction) -> Tensor", _ce_bwd_impl,
    lambda grad, saved, logits, *_: saved[0].new_empty(saved[0].shape) if logits is None else
    logits.new_empty(logits.shape))
_CE_OP = library.define(
    "cross_entropy", "(Tensor logits, Tensor target, Tensor? weight, Tensor? divisor, int ignore_index, float eps, "
    "str reduction, ScalarType out_dtype, bool need_grad) -> (Tensor, Tensor[])", _ce_fwd_impl, _ce_fwd_fake,
    backward=_ce_grads, setup_context=_ce_save)


@deferral.deferrable
def cross_entropy(logits, target, *, weight=None, ignore_index=-100, label_smoothing=0.0, reduction="mean",
                  out_dtype=None, divisor=None):
    """torch.nn.functional.cross_entropy(logits, target, ...) for logits [N, V] and class-index targets [N].

    Log-sum-exp in fp32 over V (see the module docstring for when d(logits) is written). The loss has
    the logits' dtype (fp32 under autocast, like torch) unless `out_dtype` (e.g. torch.float32) is
    given. `weight`: class weights [V] (torch's semantics: mean divides by the summed weights of the
    non-ignored targets). `divisor` (with reduction="sum"; a number or a
    1-element tensor such as HF's num_items_in_batch) returns sum / divisor with the division folded
    into the gradient written in forward, so backward has nothing to scale.
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ValueError(f"cross_entropy: logits must be a 2-D tensor [N, V], got "
                         f"{tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__}")
    if logits.dtype not in DTYPES:
        raise TypeError(f"cross_entropy: logits dtype must be float32, float16 or bfloat16, got {logits.dtype}")
    N, V = logits.shape
    check_common("cross_entropy", target, N, ignore_index, label_smoothing, reduction, logits.device)
    if out_dtype is None:
        # under autocast torch computes cross_entropy in fp32 (its result is fp32): same result dtype here,
        # without the fp32 copy of the logits
        out_dtype = torch.float32 if autocast_on(logits) else logits.dtype
    if V == 0:
        raise ValueError("cross_entropy: logits have 0 classes")
    if N == 0:
        return empty_result(N, reduction, out_dtype, logits.device) + logits.sum() * 0   # sum / divisor = 0
    if weight is not None:
        if not isinstance(weight, torch.Tensor) or weight.shape != (V,) or not weight.is_floating_point():
            raise ValueError(f"cross_entropy: weight must be a floating-point tensor of shape [{V}], got "
                             f"{tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}")
        if weight.device != logits.device:
            raise ValueError(f"cross_entropy: weight on {weight.device}, logits on {logits.device}")
        if weight.requires_grad and torch.is_grad_enabled():
            raise NotImplementedError("cross_entropy: gradients with respect to the class weights are not supported")
        weight = weight.detach().contiguous()
    if logits.device.type != library.device_type():   # the CPU beside a GPU backend: no kernel launches there
        return reference_cross_entropy(logits, target, weight=weight, ignore_index=ignore_index,
                                       label_smoothing=label_smoothing, reduction=reduction, out_dtype=out_dtype,
                                       divisor=divisor)
    d = divisor_arg(divisor, reduction, logits.device, "cross_entropy")
    if (V - 1) * abs(logits.stride(1)) >= 2**31:
        # the kernels' column offsets (cols x stride) are 32-bit; rows are 64-bit: a column-strided view
        # this wide (e.g. a [V, N] buffer's transpose) is read from a contiguous copy instead
        logits = logits.contiguous()
    if torch.compiler.is_compiling():   # one opaque node for Dynamo; eager keeps the cheaper Function (library.py)
        need = torch.is_grad_enabled() and logits.requires_grad
        return _CE_OP(logits, target, weight, d, ignore_index, float(label_smoothing), reduction, out_dtype, need)[0]
    return _CrossEntropy.apply(logits, target, ignore_index, float(label_smoothing), reduction, out_dtype, d,
                               torch.is_grad_enabled(), weight)


def reference_cross_entropy(logits, target, *, weight=None, ignore_index=-100, label_smoothing=0.0,
                            reduction="mean", out_dtype=None, divisor=None):
    """Plain PyTorch, written out: log_softmax, gather, smoothing, masked reduction (with class weights:
    torch's cross_entropy in fp32, whose weighted mean divides by the targets' summed weights)."""
    h = logits.float() if logits.dtype != torch.float64 else logits
    if weight is not None:
        loss = torch.nn.functional.cross_entropy(h, target.long(), weight=weight.to(h.dtype), ignore_index=ignore_index,
                                                 label_smoothing=label_smoothing, reduction=reduction)
        return (loss / divisor if divisor is not None else loss).to(out_dtype or logits.dtype)
    logp = torch.log_softmax(h, dim=-1)
    valid = target != ignore_index
    t = torch.where(valid, target, torch.zeros_like(target))
    nll = -logp.gather(1, t[:, None].long())[:, 0]
    loss = (1 - label_smoothing) * nll - label_smoothing * logp.mean(-1)
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    if reduction == "sum":
        loss = loss.sum()
    elif reduction == "mean":
        loss = loss.sum() / valid.sum()
    if divisor is not None:
        loss = loss / divisor
    return loss.to(out_dtype or logits.dtype)

