"""The LM head fused with the cross-entropy: cross_entropy(hidden @ weight.T + bias, target) without the
[N, V] logits in memory.

    loss = fused_linear_cross_entropy(hidden, lm_head.weight, target)   # hidden [N, H], weight [V, H]

Semantics (ignore_index, label_smoothing, reduction, divisor, dtypes) are `cross_entropy`'s
(cross_entropy_loss.py, whose Triton kernels this op launches on each chunk of logits).

Memory contract: the gradients are computed in the forward, chunk by chunk over tokens (`default_chunk(N)` = min(N, 2048) rows at a time, `chunk_rows(N, H, V)` with
chunk_size="low_memory", or `chunk_size` rows; one [C, V] buffer reused):
logits_c = hidden_c @ weight.T (+ bias) through torch.mm/addmm (Gems' mm under gems.enable()),
loss and d(logits_c) in one Triton kernel written over logits_c in place, then
grad_hidden_c = d(logits_c) @ weight and grad_weight += d(logits_c).T @ hidden_c (the first chunk's mm
writes it, later chunks addmm_ into it, in the weight's dtype: cuBLAS accumulates each chunk in fp32
and rounds once per chunk),
grad_bias += column sums (fp32). Peak extra memory: one chunk of logits [C, V] plus grad_hidden
[N, H] and grad_weight [V, H]. Chunk size trades time for memory: every chunk after the first
reads and writes grad_weight once more (4 x V x H bytes; 262 MB each way for Llama-2-7B's lm_head),
so small chunks are slower than the unfused linear + cross-entropy (see `DEFAULT_ROWS`).
Backward only scales the stored gradients by the incoming scalar
gradient, in place and only when it is not 1 (decided on the device, no host sync): it may run
once (a second backward through the same graph raises). reduction="none": the per-row output
gradients are unknown in forward, so the forward computes losses and log-sum-exps only and keeps
hidden/weight (by reference); backward recomputes each chunk's logits (one more GEMM per chunk) and
writes d(logits) over them before the two gradient GEMMs. Same peak memory.
"""
from __future__ import annotations

import torch
import torch.utils.checkpoint

from ..runtime.alloc import empty, zeros
from ..runtime.utils import next_pow2
from . import deferral, library
from .cross_entropy_loss import (DTYPES, REDUCTIONS, autocast_on, ce_bwd_kernel, ce_count_kernel, ce_fwd_kernel,
                                 ce_reduce_kernel, check_common, divisor_arg, empty_result, launch_config,
                                 reference_cross_entropy, scale_in_place)

# Default rows per chunk. Each chunk after the first adds one read and one write of grad_weight [V, H]
# (cuBLAS's beta = 1 epilogue); against the chunk's three GEMMs (6 x C x V x H flops) that costs about
# (4 x V x H / bandwidth) / (6 x C x V x H / flop rate) ~ 120 / C of the time on an H200, whatever V and
# H are. Measured there (bf16, fwd+bwd, do_bench time / the unfused linear + F.cross_entropy's, peak
# MiB above the inputs in brackets):
#   N x H x V            C = 512        1024        2048        4096
#   4096 x 4096 x 32000  1.11 (313)     1.00 (345)  0.97 (407)  0.95 (532)   unfused 750 MiB; Liger 1.22 (313)
#   8192 x 4096 x 32000  1.13 (345)     1.02 (377)  0.97 (440)  1.00 (564)   unfused 1500 MiB; Liger 1.10 (377)
#   4096 x 2048 x 32000  1.13 (172)     1.00 (204)  0.92 (266)  0.90 (391)   unfused 750 MiB; Liger 2.14 (157)
# 2048 rows keep the fused op at or under the unfused sequence's time with a peak bounded by one
# 2048 x V buffer (2048 / N of the logits the unfused sequence keeps, besides its other copies).
# chunk_size="low_memory" takes Liger's rule instead: its peak, at ~1.1x the unfused time.
DEFAULT_ROWS = 2048


def default_chunk(N: int) -> int:
    """Rows per chunk by default: min(N, DEFAULT_ROWS) (the time-first choice; see DEFAULT_ROWS)."""
    return max(1, min(N, DEFAULT_ROWS))


def chunk_rows(N: int, H: int, V: int) -> int:
    """Rows per chunk for chunk_size="low_memory": a chunk's logits [C, V] about the size of the
    hidden [N, H] (C = next_pow2(cdiv(N, cdiv(V, H))): 512 rows for 4096 tokens of Llama-2-7B; Liger's
    rule, and its peak memory), at least 256 rows (GEMM efficiency for a large V and few tokens) and
    at most 4096, never more than N."""
    c = next_pow2(max(1, -(-N // -(-V // H))))
    return max(1, min(N, max(256, min(c, 4096))))


def _chunk_logits(buf, h, weight, bias):
    """h @ weight.T (+ bias) into the first rows of the reused [C, V] buffer."""
    logits = buf[: h.shape[0]]
    if bias is not None:
        torch.addmm(bias, h, weight.t(), out=logits)
    else:
        torch.mm(h, weight.t(), out=logits)
    return logits


def _weight_grad(gw, logits, h, first):
    """grad_weight (+)= d(logits_c)^T @ hidden_c: [V, C] x [C, H]. The first chunk writes it (mm into an
    empty buffer) rather than adding to zeros: no [V, H] zero fill and no read of it (2 x 262 MB for
    Llama-2-7B's lm_head, about 0.13 ms on an H200)."""
    if first:
        torch.mm(logits.t(), h, out=gw)
    else:
        gw.addmm_(logits.t(), h)


def _flce_chunks(hidden, weight, target, bias, rows, cnt, gh, gw, gb, chunk, ignore_index, eps, divide,
                 need, need_h, need_w, need_b, fb, fw, single):
    """The chunk loop of fused_linear_cross_entropy's forward (autocast off)."""
    N, V = hidden.shape[0], weight.shape[0]
    # one [C, V] buffer for every chunk's logits: the only V-wide tensor (2 bytes x C x V in bf16)
    buf = empty((min(chunk, N), V), hidden.dtype, hidden.device)
    for c0 in range(0, N, chunk):
        c1 = min(N, c0 + chunk)
        h = hidden[c0:c1]
        logits = _chunk_logits(buf, h, weight, bias)
        t = target[c0:c1]
        ce_fwd_kernel[(c1 - c0,)](logits, t, rows[c0:c1], rows, cnt, logits, logits, logits, V, logits.stride(0),
                                  logits.stride(1), logits.stride(0), t.stride(0), ignore_index, eps, eps > 0.0,
                                  False, False, need, divide, single, fb, num_warps=fw)
        if need_h:   # d(hidden_c) = d(logits_c) @ W: [C, V] x [V, H]
            torch.mm(logits, weight, out=gh[c0:c1])
        if need_w:
            _weight_grad(gw, logits, h, c0 == 0)
        if need_b:
            gb += logits.sum(0, dtype=torch.float32)


class _FusedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, bias, ignore_index, eps, reduction, chunk, out_dtype, divisor, grad_on):
        N, H = hidden.shape
        V = weight.shape[0]
        dev = hidden.device
        # (needs_input_grad is True under torch.no_grad() too: grad mode is checked by the caller)
        need_h, need_w = grad_on and ctx.needs_input_grad[0], grad_on and ctx.needs_input_grad[1]
        need_b = grad_on and bias is not None and ctx.needs_input_grad[3]
        need = need_h or need_w or need_b
        mode = REDUCTIONS[reduction]
        fb, fw, single, _, _ = launch_config(V, hidden.dtype)
        ctx.lazy = mode == 0
        if mode == 0:
            return _FusedLinearCE._forward_none(ctx, hidden, weight, target, bias, ignore_index, eps, chunk,
                                                out_dtype, need, fb, fw, single)
        rows = empty((N,), torch.float32, dev)
        divide = mode == 2 or divisor is not None
        if divisor is not None:   # sum / divisor (HF's num_items_in_batch), folded into the gradients
            cnt = divisor
        else:
            cnt = empty((1,), torch.float32, dev)
            ce_count_kernel[(1,)](target, cnt, cnt, N, weight.shape[0], target.stride(0), ignore_index, False, 1024,
                                  num_warps=4)
        gh = empty((N, H), hidden.dtype, dev) if need_h else None
        gw = empty((V, H), weight.dtype, dev) if need_w else None
        gb = zeros((V,), torch.float32, dev) if need_b else None
        with torch.autocast(dev.type, enabled=False):
            _flce_chunks(hidden, weight, target, bias, rows, cnt, gh, gw, gb, chunk, ignore_index, eps,
                         divide, need, need_h, need_w, need_b, fb, fw, single)
        out = empty((), out_dtype, dev)
        ce_reduce_kernel[(1,)](rows, target, out, cnt, cnt, N, V, target.stride(0), ignore_index, divide, False,
                               False, 1024, num_warps=4)
        if need:
            ctx.save_for_backward(gh, gw, gb.to(bias.dtype) if gb is not None else None)
            ctx.used = False
        return out

    @staticmethod
    def _forward_none(ctx, hidden, weight, target, bias, ignore_index, eps, chunk, out_dtype, need, fb, fw, single):
        """reduction="none": per-row losses and log-sum-exps, chunk by chunk; the inputs are kept (by
        reference) and backward recomputes each chunk's logits (one more [C, H] x [H, V] GEMM per chunk)
        because the per-row output gradients are not known before."""
        N, V, dev = hidden.shape[0], weight.shape[0], hidden.device
        out = empty((N,), out_dtype, dev)
        lse = empty((N,), torch.float32, dev) if need else out
        buf = empty((min(chunk, N), V), hidden.dtype, dev)
        with torch.autocast(dev.type, enabled=False):
            for c0 in range(0, N, chunk):
                c1 = min(N, c0 + chunk)
                logits = _chunk_logits(buf, hidden[c0:c1], weight, bias)
                t = target[c0:c1]
                ce_fwd_kernel[(c1 - c0,)](logits, t, out[c0:c1], lse[c0:c1], lse, logits, lse, lse, V,
                                          logits.stride(0), logits.stride(1), logits.stride(0), t.stride(0),
                                          ignore_index, eps, eps > 0.0, False, need, False, False, single, fb,
                                          num_warps=fw)
        if need:
            ctx.save_for_backward(hidden, weight, target, bias, lse)
            ctx.args = (ignore_index, eps, chunk)
        return out

    @staticmethod
    def _backward_none(ctx, grad):
        hidden, weight, target, bias, lse = ctx.saved_tensors
        ignore_index, eps, chunk = ctx.args
        (N, H), V, dev = hidden.shape, weight.shape[0], hidden.device
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[3]
        _, _, _, bb, bw = launch_config(V, hidden.dtype)
        gh = empty((N, H), hidden.dtype, dev) if need_h else None
        gw = empty((V, H), weight.dtype, dev) if need_w else None
        gb = zeros((V,), torch.float32, dev) if need_b else None
        buf = empty((min(chunk, N), V), hidden.dtype, dev)
        with torch.autocast(dev.type, enabled=False):
            for c0 in range(0, N, chunk):
                c1 = min(N, c0 + chunk)
                h = hidden[c0:c1]
                logits = _chunk_logits(buf, h, weight, bias)
                t, g = target[c0:c1], grad[c0:c1]
                # d(logits) = (softmax - smoothing - one-hot) * grad_output[i], over the logits in place
                ce_bwd_kernel[(c1 - c0, -(-V // bb))](logits, t, lse[c0:c1], g, lse, logits, lse, lse, V,
                                                      logits.stride(0), logits.stride(1), t.stride(0), g.stride(0),
                                                      ignore_index, eps, False, 0, bb, num_warps=bw)
                if need_h:
                    torch.mm(logits, weight, out=gh[c0:c1])
                if need_w:
                    _weight_grad(gw, logits, h, c0 == 0)
                if need_b:
                    gb += logits.sum(0, dtype=torch.float32)
        return gh, gw, None, gb.to(bias.dtype) if gb is not None else None, None, None, None, None, None, None, None

    @staticmethod
    def backward(ctx, grad):
        if ctx.lazy:
            return _FusedLinearCE._backward_none(ctx, grad)
        if ctx.used:
            raise RuntimeError("fused_linear_cross_entropy: backward through the same graph twice is not supported "
                               "(the gradients computed in forward are scaled in place)")
        ctx.used = True
        gh, gw, gb = ctx.saved_tensors
        # scaled in place by the incoming scalar gradient, only when it is not 1 (decided on the
        # device: loss.backward() costs three launches and no pass): then one read+write of
        # grad_hidden (N*H), grad_weight (V*H) and grad_bias (V); no extra memory
        for t in (gh, gw, gb):
            if t is not None and t.numel():
                deferral.backward("fused_linear_cross_entropy", scale_in_place, (t, grad), lambda: t.mul_(grad))
        return gh, gw, None, gb, None, None, None, None, None, None, None


# torch.compile: gems::fused_linear_cross_entropy and its backward (library.py) run _FusedLinearCE's
# bodies. The forward's `Tensor[]` output: [grad_hidden, grad_weight, grad_bias] for "mean"/"sum" (a
# 0-element placeholder for one not needed), [lse] for "none" with grad (hidden, weight, target and
# bias are inputs, saved as such), nothing without grad. Backward scales copies of the stored
# gradients (an operator does not write its saved inputs): under compile, "mean"/"sum" hold one more
# grad_hidden and grad_weight during backward than in eager mode.
def _flce_fwd_impl(hidden, weight, target, bias, divisor, ignore_index, eps, reduction, chunk, out_dtype, need_h,
                   need_w, need_b):
    ctx = library.FunctionContext((need_h, need_w, False, need_b))
    out = _FusedLinearCE.forward(ctx, hidden, weight, target, bias, ignore_index, eps, reduction, chunk, out_dtype,
                                 divisor, True)
    saved = ctx.saved_tensors
    if reduction == "none":
        return out, [saved[4]] if saved else []
    return out, [library.placeholder(t, hidden) for t in (saved or (None, None, None))]


def _flce_fwd_fake(hidden, weight, target, bias, divisor, ignore_index, eps, reduction, chunk, out_dtype, need_h,
                   need_w, need_b):
    N = hidden.shape[0]
    if reduction == "none":
        out = hidden.new_empty((N,), dtype=out_dtype)
        return out, [hidden.new_empty((N,), dtype=torch.float32)] if need_h or need_w or need_b else []
    grads = [t.new_empty(t.shape) if need else hidden.new_empty((0,))
             for t, need in ((hidden, need_h), (weight, need_w), (bias, need_b))]
    return hidden.new_empty((), dtype=out_dtype), grads


def _flce_bwd_impl(grad, saved, hidden, weight, target, bias, ignore_index, eps, reduction, chunk, need_h, need_w,
                   need_b):
    needs = (need_h, need_w, need_b)
    if reduction == "none":
        ctx = library.FunctionContext((need_h, need_w, False, need_b), (hidden, weight, target, bias, saved[0]))
        ctx.lazy, ctx.args = True, (ignore_index, eps, chunk)
    else:
        ctx = library.FunctionContext(saved=[t.clone() if need else None for t, need in zip(saved, needs)])
        ctx.lazy, ctx.used = False, False
    gh, gw, _, gb = _FusedLinearCE.backward(ctx, grad)[:4]
    return [library.placeholder(t, grad if reduction == "none" else s) for t, s in zip((gh, gw, gb), saved * 3)]


def _flce_bwd_fake(grad, saved, hidden, weight, target, bias, ignore_index, eps, reduction, chunk, need_h, need_w,
                   need_b):
    if reduction != "none":
        return [t.new_empty(t.shape) for t in saved]
    return [t.new_empty(t.shape) if need else grad.new_empty((0,))
            for t, need in ((hidden, need_h), (weight, need_w), (bias, need_b))]


def _flce_save(ctx, inputs, output):
    hidden, weight, target, bias, _, ctx.ignore_index, ctx.eps, ctx.reduction, ctx.chunk, _, *ctx.needs = inputs
    lazy = ctx.reduction == "none"
    ctx.save_for_backward(*output[1], *((hidden, weight, target, bias) if lazy else ()))


def _flce_grads(ctx, grad, _):
    saved = ctx.saved_tensors
    lazy = ctx.reduction == "none"
    inputs = saved[1:] if lazy else (None, None, None, None)
    gh, gw, gb = _FLCE_BWD(grad, saved[:1] if lazy else saved, *inputs, ctx.ignore_index, ctx.eps, ctx.reduction,
                           ctx.chunk, *ctx.needs)
    needs = ctx.needs
    return (gh if needs[0] else None, gw if needs[1] else None, None, gb if needs[2] else None) + (None,) * 9


_FLCE_BWD = library.define(
    "fused_linear_cross_entropy_backward", "(Tensor grad, Tensor[] saved, Tensor? hidden, Tensor? weight, "
    "Tensor? target, Tensor? bias, int ignore_index, float eps, str reduction, int chunk, bool need_h, bool need_w, "
    "bool need_b) -> Tensor[]", _flce_bwd_impl, _flce_bwd_fake)
_FLCE_OP = library.define(
    "fused_linear_cross_entropy", "(Tensor hidden, Tensor weight, Tensor target, Tensor? bias, Tensor? divisor, "
    "int ignore_index, float eps, str reduction, int chunk, ScalarType out_dtype, bool need_h, bool need_w, "
    "bool need_b) -> (Tensor, Tensor[])", _flce_fwd_impl, _flce_fwd_fake,
    backward=_flce_grads, setup_context=_flce_save)


@deferral.deferrable(answer="chunked_reference")
def fused_linear_cross_entropy(hidden, weight, target, bias=None, *, ignore_index=-100, label_smoothing=0.0,
                               reduction="mean", chunk_size=None, out_dtype=None, divisor=None):
    """cross_entropy(hidden @ weight.T + bias, target) without the [N, V] logits in memory.

    hidden [N, H], weight [V, H] (nn.Linear's), bias [V] or None, target [N]. Chunks of `chunk_size`
    rows: None (default) `default_chunk(N)` = min(N, 2048), at or under the unfused sequence's time;
    "low_memory" `chunk_rows(N, H, V)`, Liger's smaller chunks and peak memory at ~1.1x that time; or
    an int. Gradients computed in forward (see the module docstring for the memory contract). reduction "mean", "sum" or "none" (its backward recomputes the
    logits chunk by chunk).
    `divisor` (with "sum", e.g. HF's num_items_in_batch): sum / divisor, folded into the gradients.
    The loss has hidden's dtype (fp32 under autocast) unless `out_dtype` is given.
    """
    for name, t in (("hidden", hidden), ("weight", weight)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"fused_linear_cross_entropy: {name} must be a 2-D tensor, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if autocast_on(hidden):
        # autocast would run the LM head in its low-precision dtype: cast like it does (differentiable,
        # outside the Function, so fp32 master weights get fp32 gradients)
        ad = torch.get_autocast_dtype(hidden.device.type)
        hidden, weight = hidden.to(ad), weight.to(ad)
        bias = bias.to(ad) if bias is not None else None
    if hidden.dtype not in DTYPES or weight.dtype != hidden.dtype:
        raise TypeError(f"fused_linear_cross_entropy: hidden and weight must share a dtype among float32/float16/"
                        f"bfloat16, got {hidden.dtype} and {weight.dtype}")
    N, H = hidden.shape
    V = weight.shape[0]
    if weight.shape[1] != H:
        raise ValueError(f"fused_linear_cross_entropy: weight {tuple(weight.shape)} does not match hidden "
                         f"{tuple(hidden.shape)} (weight is [V, H] like nn.Linear's)")
    if bias is not None and (bias.shape != (V,) or bias.dtype != hidden.dtype):
        raise ValueError(f"fused_linear_cross_entropy: bias must be [{V}] of {hidden.dtype}, got "
                         f"{tuple(bias.shape)} {bias.dtype}")
    if weight.device != hidden.device or (bias is not None and bias.device != hidden.device):
        raise ValueError("fused_linear_cross_entropy: hidden, weight and bias must be on one device")
    check_common("fused_linear_cross_entropy", target, N, ignore_index, label_smoothing, reduction, hidden.device)
    if V == 0:
        raise ValueError("fused_linear_cross_entropy: weight has 0 classes")
    if out_dtype is None:
        out_dtype = torch.float32 if autocast_on(hidden) else hidden.dtype
    if N == 0:
        z = hidden.sum() * 0 + weight.sum() * 0 + (bias.sum() * 0 if bias is not None else 0)
        return empty_result(N, reduction, out_dtype, hidden.device) + z
    if chunk_size is None:
        chunk = default_chunk(N)
    elif isinstance(chunk_size, str) and chunk_size == "low_memory":
        chunk = chunk_rows(N, H, V)
    elif isinstance(chunk_size, (str, bool)):
        raise ValueError(f"fused_linear_cross_entropy: chunk_size must be None, 'low_memory' or a number of rows, "
                         f"got {chunk_size!r}")
    else:
        chunk = int(chunk_size)
    if chunk < 1:
        raise ValueError(f"fused_linear_cross_entropy: chunk_size must be >= 1, got {chunk_size}")
    if hidden.device.type != library.device_type():   # the CPU beside a GPU backend: no kernel launches there
        return reference_fused_linear_cross_entropy(hidden, weight, target, bias, ignore_index=ignore_index,
                                                    label_smoothing=label_smoothing, reduction=reduction,
                                                    out_dtype=out_dtype, divisor=divisor)
    d = divisor_arg(divisor, reduction, hidden.device, "fused_linear_cross_entropy")
    if torch.compiler.is_compiling():   # one opaque node for Dynamo; eager keeps the cheaper Function (library.py)
        g = torch.is_grad_enabled()
        needs = (g and hidden.requires_grad, g and weight.requires_grad, g and bias is not None and bias.requires_grad)
        return _FLCE_OP(hidden, weight, target, bias, d, ignore_index, float(label_smoothing), reduction, chunk,
                        out_dtype, *needs)[0]
    return _FusedLinearCE.apply(hidden, weight, target, bias, ignore_index, float(label_smoothing), reduction,
                                chunk, out_dtype, d, torch.is_grad_enabled())


def reference_fused_linear_cross_entropy(hidden, weight, target, bias=None, *, ignore_index=-100,
                                         label_smoothing=0.0, reduction="mean", chunk_size=None, out_dtype=None,
                                         divisor=None):
    """Plain PyTorch: the full logits, then the cross-entropy."""
    logits = hidden @ weight.t()
    if bias is not None:
        logits = logits + bias
    loss = torch.nn.functional.cross_entropy(logits, target, ignore_index=ignore_index,
                                             label_smoothing=label_smoothing, reduction=reduction)
    if divisor is not None:
        loss = loss / divisor
    return loss.to(out_dtype or hidden.dtype)


def chunked_reference(hidden, weight, target, bias=None, *, ignore_index=-100, label_smoothing=0.0,
                      reduction="mean", chunk_size=None, out_dtype=None, divisor=None):
    """The reference chunk by chunk, each chunk's logits recomputed in backward (torch.utils.checkpoint):
    at most one chunk's logits (in fp32) are held, as the fused op promises. It answers the fused op's
    calls while its kernels compile (deferral.py)."""
    N, V = hidden.shape[0], weight.shape[0]
    chunk = (default_chunk(N) if chunk_size is None else chunk_rows(N, hidden.shape[1], V)
             if chunk_size == "low_memory" else int(chunk_size))
    per = "none" if reduction == "none" else "sum"
    acc = torch.promote_types(hidden.dtype, torch.float32)   # the per-chunk losses, unrounded

    def piece(h, t):
        logits = torch.nn.functional.linear(h, weight, bias)
        return reference_cross_entropy(logits, t, ignore_index=ignore_index, label_smoothing=label_smoothing,
                                       reduction=per, out_dtype=acc)

    parts = [torch.utils.checkpoint.checkpoint(piece, hidden[c0:c0 + chunk], target[c0:c0 + chunk],
                                               use_reentrant=False) for c0 in range(0, N, chunk)]
    if reduction == "none":
        loss = torch.cat(parts)
    else:
        loss = torch.stack(parts).sum()
        if reduction == "mean":
            loss = loss / (target != ignore_index).sum()
    if divisor is not None:
        loss = loss / divisor
    return loss.to(out_dtype or (torch.float32 if autocast_on(hidden) else hidden.dtype))
