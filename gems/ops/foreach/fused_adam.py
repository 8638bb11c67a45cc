"""_fused_adamw_ (what torch.optim.AdamW(fused=True) calls): one AdamW step over every parameter in one
launch, on launch.py's pointer table (rows [n_i, param_i, grad_i, exp_avg_i, exp_avg_sq_i,
(max_exp_avg_sq_i,) step_i], one program per chunk, the tensor found by binary search).

Per element, in fp32 (ATen's opmath; ATen's fused kernel's order of operations), with t the tensor's
step count read on the device (the optimizer increments it before the call: no host read):
    g = grad / grad_scale (stored back into grad when grad_scale is given, as ATen does); -g if maximize
    p = p - (lr * weight_decay) * p                                     (decoupled decay)
    m = beta1 * m + (1 - beta1) * g       v = beta2 * v + (1 - beta2) * g * g   (as fma's, like ATen)
    vmax = max(vmax, v) if amsgrad
    p = p - (lr / bc1) * m / (sqrt(v or vmax) / sqrt(bc2) + eps)      bc_k = 1 - beta_k ** t
Nothing is written when found_inf == 1 (GradScaler found an inf or NaN: the step is skipped; the
optimizer then takes 1 off the step counts). The bias corrections are computed in fp64, as
1 - exp(t * ln beta) with ln beta from the host, then rounded to fp32: no worse than ATen's fp32 pow,
and better for beta2 near 1, where 1 - beta2 ** t cancels.
Bytes moved: params, grads, exp_avgs, exp_avg_sqs (max_exp_avg_sqs) read once and written once (grads
only with grad_scale), plus one step count per tensor and the table.

Served: contiguous tensors of one float dtype and device across the lists of tensors, float32 step
counts (1 element each), lr a float or a 1-element float tensor, grad_scale / found_inf 1-element
float32 tensors, on the same device. Anything else (mixed dtypes, which ATen groups; non-contiguous
tensors; overlapping written tensors; lists that ATen rejects) goes to ATen, counted.
"""
from __future__ import annotations

import math
import struct

import torch
import triton
import triton.language as tl

from ...registry import FLOATS, Unsupported, register
from ...runtime import backend, kernel
from .launch import CONFIGS, address, data_ptr, lists_overlap, locate, table, uniform_lists


@triton.jit
def _adamw_chunk(Base, GS, dp, dg, dm, dv, dx, lo, n, beta1, beta2, eps, decay, step_size, bc2_sqrt,
                 AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr, HAS_GS: tl.constexpr, BLOCK: tl.constexpr,
                 CHUNK: tl.constexpr, MASK: tl.constexpr):
    """One chunk of fused_adamw_kernel: CHUNK elements from lo (MASK: those below n only)."""
    for k in tl.static_range(CHUNK // BLOCK):
        offs = lo + k * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n if MASK else None   # whole chunks unmasked (see foreach_kernel)
        p = tl.load(Base + dp + offs, mask=mask).to(tl.float32)
        g = tl.load(Base + dg + offs, mask=mask).to(tl.float32)
        m = tl.load(Base + dm + offs, mask=mask).to(tl.float32)
        v = tl.load(Base + dv + offs, mask=mask).to(tl.float32)
        if HAS_GS:
            g = tl.math.div_rn(g, tl.load(GS))
            tl.store(Base + dg + offs, g.to(Base.dtype.element_ty), mask=mask)
        if MAXIMIZE:
            g = -g
        p = p - decay * p
        m = tl.fma(beta1 + 0.0 * g, m, tl.fma(-beta1 + 0.0 * g, g, g))
        gg = g * g
        v = tl.fma(beta2 + 0.0 * g, v, tl.fma(-beta2 + 0.0 * g, gg, gg))
        if AMSGRAD:
            x = tl.maximum(tl.load(Base + dx + offs, mask=mask).to(tl.float32), v)
            tl.store(Base + dx + offs, x.to(Base.dtype.element_ty), mask=mask)
            den = tl.math.div_rn(tl.sqrt_rn(x), bc2_sqrt) + eps
        else:
            den = tl.math.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
        p = p - tl.math.div_rn(step_size * m, den)
        tl.store(Base + dp + offs, p.to(Base.dtype.element_ty), mask=mask)
        tl.store(Base + dm + offs, m.to(Base.dtype.element_ty), mask=mask)
        tl.store(Base + dv + offs, v.to(Base.dtype.element_ty), mask=mask)


@kernel
@triton.jit
def fused_adamw_kernel(Base, Step, LR, GS, FI, Tab, N, TOP, LOGN, B0, ST0, lr, beta1, beta2, wd, eps, lnb1, lnb2,
                       AMSGRAD: tl.constexpr, MAXIMIZE: tl.constexpr, LR_T: tl.constexpr, HAS_GS: tl.constexpr,
                       HAS_FI: tl.constexpr, W: tl.constexpr, ES: tl.constexpr, SES: tl.constexpr,
                       VEC: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """One AdamW step (module doc) on chunk p - S_i of tensor i: Base the params' dtype (every list's
    addresses are offsets from it), Step the first step count (step_i at Step + (address - ST0) / SES)."""
    i, row, n, lo = locate(Tab, N, TOP, LOGN, W, CHUNK)
    dp = address(row, 1, B0, ES, VEC)
    dg = address(row, 2, B0, ES, VEC)
    dm = address(row, 3, B0, ES, VEC)
    dv = address(row, 4, B0, ES, VEC)
    if AMSGRAD:
        dx = address(row, 5, B0, ES, VEC)
    t = tl.load(Step + (tl.load(row + W - 1) - ST0) // SES).to(tl.float64)
    # ln beta's float64 bits (a Python float argument would be fp32); 1 - beta ** t in fp64
    bc1 = (1.0 - tl.exp(t * lnb1.to(tl.int64).to(tl.float64, bitcast=True))).to(tl.float32)
    bc2 = 1.0 - tl.exp(t * lnb2.to(tl.int64).to(tl.float64, bitcast=True))
    bc2_sqrt = tl.sqrt_rn(bc2.to(tl.float32))
    if LR_T:
        lrv = tl.load(LR).to(tl.float32)
    else:
        lrv = lr
    step_size = tl.math.div_rn(lrv, bc1)
    decay = lrv * wd
    if HAS_FI:
        # a skipped step: no element in range, nothing loaded or stored
        n = tl.where(tl.load(FI) != 1.0, n, 0)
    if not AMSGRAD:
        dx = dp
    # a whole chunk unmasked (foreach_kernel says why); a skipped step (n = 0) takes the masked path
    if lo + CHUNK <= n:
        _adamw_chunk(Base, GS, dp, dg, dm, dv, dx, lo, n, beta1, beta2, eps, decay, step_size, bc2_sqrt,
                     AMSGRAD, MAXIMIZE, HAS_GS, BLOCK, CHUNK, False)
    else:
        _adamw_chunk(Base, GS, dp, dg, dm, dv, dx, lo, n, beta1, beta2, eps, decay, step_size, bc2_sqrt,
                     AMSGRAD, MAXIMIZE, HAS_GS, BLOCK, CHUNK, True)


def _ln_bits(beta):
    """ln beta's float64 bits as a signed int64 (beta 0: -inf, so that beta ** t = 0)."""
    if not 0.0 <= beta <= 1.0:
        raise Unsupported("beta outside [0, 1]")
    return struct.unpack("<q", struct.pack("<d", math.log(beta) if beta > 0 else -math.inf))[0]


def _one_float32(t, device, what):
    """A 1-element float32 tensor on the lists' device (what ATen's kernel reads through a float*)."""
    if t.dtype is not torch.float32 or t.numel() != 1 or t.device != device:
        raise Unsupported(f"{what}: not one float32 element on the lists' device")
    return t


def _fused_adamw(self, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr, beta1, beta2,
                 weight_decay, eps, amsgrad, maximize, grad_scale, found_inf):
    n = len(self)
    # ATen rejects these (lengths, max_exp_avg_sqs empty unless amsgrad): let it raise
    if n == 0 or any(len(x) != n for x in (grads, exp_avgs, exp_avg_sqs, state_steps)):
        raise Unsupported("empty or unequal tensor lists")
    if len(max_exp_avg_sqs) != (n if amsgrad else 0):
        raise Unsupported("max_exp_avg_sqs does not match amsgrad")
    lists = [self, grads, exp_avgs, exp_avg_sqs] + ([max_exp_avg_sqs] if amsgrad else [])
    uniform_lists(lists)
    device = self[0].device
    if any(s.dtype is not torch.float32 or s.numel() != 1 or s.device != device for s in state_steps):
        raise Unsupported("step counts: not one float32 element each on the lists' device")
    lr_t = isinstance(lr, torch.Tensor)
    if lr_t:
        if not lr.is_floating_point() or lr.numel() != 1 or lr.device != device:
            raise Unsupported("lr tensor: not one float element on the lists' device")
    gs = None if grad_scale is None else _one_float32(grad_scale, device, "grad_scale")
    fi = None if found_inf is None else _one_float32(found_inf, device, "found_inf")
    numel = [t.numel() for t in self]
    es = self[0].element_size()
    nbytes = [k * es for k in numel]
    # every element is read and written by one lane, but a tensor written in one list and met in
    # another at another position (or read by every program: lr, grad_scale, found_inf, the steps)
    # would race: such calls go to ATen, which updates the tensors one after another
    ptr_cols = [list(map(data_ptr, x)) for x in lists]
    written = self + exp_avgs + exp_avg_sqs + (max_exp_avg_sqs if amsgrad else [])
    sptrs = list(map(data_ptr, state_steps))
    reads = [(ptr_cols[1], nbytes, True), (sptrs, [4] * n, False)]
    reads += [([x.data_ptr()], [x.numel() * x.element_size()], False) for x in (lr if lr_t else None, gs, fi)
              if x is not None]
    if lists_overlap(written, nbytes * (len(lists) - 1), reads):
        raise Unsupported("overlapping operands")
    lnb1, lnb2 = _ln_bits(beta1), _ln_bits(beta2)
    cfg = CONFIGS[backend().name]
    t = table(self, numel, ptr_cols, [sptrs], cfg["CHUNK"])
    if t is None:
        return None
    tab, total, top, base, aligned = t
    # the call's one write (first=True): a binary still compiling lets ATen answer the step
    fused_adamw_kernel.run((total,), (
        base, state_steps[0], lr if lr_t else None, gs, fi, tab, n, top, top.bit_length(), base.data_ptr(),
        sptrs[0], 0.0 if lr_t else float(lr), float(beta1), float(beta2), float(weight_decay), float(eps),
        lnb1, lnb2, bool(amsgrad), bool(maximize), lr_t, gs is not None, fi is not None,
        len(lists) + 2, es, 4, 16 // es if aligned else 1, cfg["BLOCK"], cfg["CHUNK"]), cfg["num_warps"], first=True)
    return None


@register("_fused_adamw_", "_fused_adamw_.tensor_lr", category="pointwise", dtypes=FLOATS, plan=False)
def fused_adamw_(self, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, lr, beta1, beta2,
                 weight_decay, eps, amsgrad, maximize, grad_scale=None, found_inf=None):
    """AdamW step over every parameter (lr a float or a tensor; grad_scale, found_inf): one launch"""
    return _fused_adamw(self, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr, beta1, beta2,
                        weight_decay, eps, amsgrad, maximize, grad_scale, found_inf)
