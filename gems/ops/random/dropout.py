"""native_dropout and native_dropout_backward: Philox dropout in Triton.

Forward, train mode (train = True or None), keep probability q = 1 - p, scale s = 1 / q:

    u_i   = uniform [0, 1) from Philox(seed, counter(i))   (tl.rand4x: one Philox call, 4 elements)
    mask  = u_i < q                                        (bool)
    out_i = x_i * mask_i * s                               (fp32, rounded once to x's dtype)

so a dropped NaN stays NaN, as in ATen. train = False: out = a copy of x, mask all true. p = 1: the
CUDA kernel of ATen returns zeros (and a false mask), its CPU kernel x * 0 * 0 (NaN stays NaN):
each backend follows its device, as for s, which ATen computes as f32(1 / f32(q)) on CUDA and
f32(1 / q) on the CPU. Same distribution as ATen, not the same bits (a different generator).

Randomness: each call takes a fresh (seed, offset) from torch's generator for the device, so
`torch.manual_seed` makes runs reproducible and successive calls differ: on CUDA the default CUDA
generator's seed and Philox offset (advanced by the counters used, as ATen's kernels advance it;
`plan.philox_state`), which a call plan reads per call too (`plan.philox`: the C++ fast path replays
dropout like any planned op, declining during CUDA graph capture); on the interpreter's CPU tensors
a seed drawn from the CPU generator (an ATen op: no plan there).

Backward: grad_input = grad_output * mask * scale (fp32, rounded once).
Served: contiguous inputs (others go to ATen, counted); CUDA graph capture goes to ATen (the
generator's offset is read on the host).
"""
from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from ...registry import FLOATS, Unsupported, register
from ...runtime import backend, kernel, plan
from ...runtime.utils import cdiv, empty

_BLOCK = {"cuda": 1024, "interpreter": 32}    # counters per program; each covers 4 elements


@triton.jit
def _part(X, Out, Mask, i, N, u, q, scale, TRAIN: tl.constexpr, ALL_DROPPED: tl.constexpr):
    m = i < N
    x = tl.load(X + i, mask=m, other=0.0)
    if TRAIN:
        keep = u < q
        if ALL_DROPPED:
            y = tl.zeros_like(x.to(tl.float32))
        else:
            y = x.to(tl.float32) * keep.to(tl.float32) * scale
        tl.store(Out + i, y.to(Out.dtype.element_ty), mask=m)
        tl.store(Mask + i, keep, mask=m)
    else:
        tl.store(Out + i, x, mask=m)
        tl.store(Mask + i, tl.full(x.shape, 1, tl.int1), mask=m)


@kernel
@triton.jit(do_not_specialize=["seed", "offset"])   # per-call values: no binary per divisibility class
def dropout_fwd(X, Out, Mask, N, q, scale, seed, offset,
                TRAIN: tl.constexpr, ALL_DROPPED: tl.constexpr, BLOCK: tl.constexpr):
    """Mask[i] = u(i) < q, Out[i] = X[i] * Mask[i] * scale over a contiguous X; element
    pid * 4 * BLOCK + j * BLOCK + k takes the j-th of the 4 uniforms of counter offset + pid * BLOCK + k.
    TRAIN = False: Out = X, Mask = True. ALL_DROPPED: Out = 0 (ATen's CUDA rule for p = 1)."""
    pid = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK)
    base = pid * 4 * BLOCK + k
    if TRAIN:
        u0, u1, u2, u3 = tl.rand4x(seed, offset + pid * BLOCK + k)
    else:
        u0 = tl.zeros([BLOCK], tl.float32)
        u1 = u0
        u2 = u0
        u3 = u0
    _part(X, Out, Mask, base, N, u0, q, scale, TRAIN, ALL_DROPPED)
    _part(X, Out, Mask, base + BLOCK, N, u1, q, scale, TRAIN, ALL_DROPPED)
    _part(X, Out, Mask, base + 2 * BLOCK, N, u2, q, scale, TRAIN, ALL_DROPPED)
    _part(X, Out, Mask, base + 3 * BLOCK, N, u3, q, scale, TRAIN, ALL_DROPPED)


@kernel
@triton.jit
def dropout_bwd(G, Mask, Out, N, scale, BLOCK: tl.constexpr):
    """Out[i] = G[i] * Mask[i] * scale (fp32) over contiguous tensors."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    g = tl.load(G + i, mask=m, other=0.0).to(tl.float32)
    keep = tl.load(Mask + i, mask=m, other=0).to(tl.float32)
    tl.store(Out + i, (g * keep * scale).to(Out.dtype.element_ty), mask=m)


def _f32(v: float) -> float:
    return struct.unpack("f", struct.pack("f", v))[0]


@register("native_dropout", category="pointwise", dtypes=FLOATS)
def native_dropout(input, p, train):
    """(x * mask / (1 - p), mask) with mask ~ Bernoulli(1 - p) from Philox; train=False: (copy, ones)."""
    if not input.is_contiguous():
        raise Unsupported("non-contiguous input")
    if input.numel() == 0:
        raise Unsupported("empty input")
    p = float(p)
    if not 0.0 <= p <= 1.0:
        raise Unsupported("p outside [0, 1]")
    be = backend().name
    dev = input.device
    if be == "cuda" and torch.cuda.is_current_stream_capturing():
        raise Unsupported("CUDA graph capture")
    training = train is None or bool(train)
    n = input.numel()
    block = _BLOCK[be]
    grid = cdiv(n, 4 * block)
    out = empty(input.shape, input.dtype, dev)
    mask = empty(input.shape, torch.bool, dev)
    q = 1.0 - p
    if training:
        if be == "cuda":
            scale = 0.0 if q == 0 else 1.0 / _f32(q)
        else:
            scale = 0.0 if q == 0 else 1.0 / q
        seed, offset = plan.philox_for(dev, 6, grid * block)   # dropout_fwd's arguments 6 and 7
    else:
        scale, seed, offset = 1.0, 0, 0
    all_dropped = training and p == 1.0 and be == "cuda"
    dropout_fwd[(grid,)](input, out, mask, n, q, scale, seed, offset, training, all_dropped, block, num_warps=4)
    return out, mask


@register("native_dropout_backward", category="pointwise", dtypes=FLOATS, backward=True)
def native_dropout_backward(grad_output, mask, scale):
    """grad * mask * scale (fp32, rounded once)."""
    if mask.dtype != torch.bool:
        raise Unsupported("mask is not bool")
    if mask.shape != grad_output.shape:
        raise Unsupported("mask and grad shapes differ (ATen broadcasts)")
    if not grad_output.is_contiguous() or not mask.is_contiguous():
        raise Unsupported("non-contiguous grad or mask")
    if mask.device != grad_output.device:
        raise Unsupported("mask on another device")
    n = grad_output.numel()
    out = empty(grad_output.shape, grad_output.dtype, grad_output.device)
    if n:
        block = 1024 if backend().name == "cuda" else 64
        dropout_bwd[(cdiv(n, block),)](grad_output, mask, out, n, float(scale), block, num_warps=4)
    return out
