"""nll_loss_forward and nll_loss_backward: the negative log-likelihood of class scores, as ATen's
cross_entropy (log_softmax + nll_loss) calls them in training.

Forward, input X [N, C] (or [C] with a 0-dim target), target T [N], optional class weights w [C]:

    l_i = -w[T_i] * X[i, T_i]          (l_i = 0 and weight 0 where T_i == ignore_index)
    none: out = l (shape [N]), total_weight = 0
    sum:  out = sum_i l_i,             total_weight = sum_i w[T_i]
    mean: out = sum_i l_i / total_weight   (0 / 0 = NaN when every target is ignored, like ATen)

A [C] input with reduction none is the sum case over its single sample (ATen's rule); with mean, ATen's
CUDA kernel answers -X[T] (0 when the target is ignored, NaN for a zero weight) where its CPU kernel
divides (NaN when ignored): each backend follows its device. Sums accumulate in fp32 in one program,
in a fixed order (deterministic; ATen's CUDA kernel is one block too: the loss reads only N values).

Backward: grad_input = 0 except grad_input[i, T_i] = w[T_i] * -(g_i [/ total_weight for mean]),
g_i = grad_output[i] for none over a batch, the single grad_output otherwise. Every element of
grad_input is written once (no separate zero fill).

Targets outside [0, C) other than ignore_index: ATen's CPU kernel raises IndexError, its CUDA kernel
stops the process with a device-side assert. Checking on the host needs the targets there (a device
sync per call), so: on the interpreter (CPU tensors) the wrapper checks and raises IndexError like
ATen; on the GPU the kernels `tl.device_assert` (active under TRITON_DEBUG=1) and, with asserts
compiled out, make the affected results NaN (the loss, or the sample's row of the gradient), never a
plausible number.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...registry import FLOATS, Unsupported, register
from ...runtime import backend, kernel
from ...runtime.utils import cdiv, empty, next_pow2, prepare_out

_NONE, _MEAN, _SUM = 0, 1, 2


@triton.jit
def _targets(T, Wt, i, m, C, st, sw, ignore_index, HAS_W: tl.constexpr):
    """For the samples i (mask m): their targets t, which count (ok: not ignored, in range), which are out
    of range (oob: asserted under TRITON_DEBUG, NaN results otherwise) and their weights w[t] (1 without
    weights, 0 where not ok), fp32."""
    t = tl.load(T + i * st, mask=m, other=ignore_index).to(tl.int64)
    valid = m & (t != ignore_index)
    oob = valid & ((t < 0) | (t >= C))
    tl.device_assert(~oob, "nll_loss: target out of bounds")
    ok = valid & ~oob
    if HAS_W:
        w = tl.load(Wt + t * sw, mask=ok, other=0.0).to(tl.float32)
    else:
        w = tl.where(ok, 1.0, 0.0)
    return t, ok, oob, w


@kernel
@triton.jit
def nll_fwd_none(X, T, Wt, Out, TW, N, C, sxn, sxc, st, sw, ignore_index,
                 HAS_W: tl.constexpr, BLOCK: tl.constexpr):
    """Out[i] = -w[T_i] * X[i, T_i] (0 where T_i == ignore_index); TW = 0."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    t, ok, oob, w = _targets(T, Wt, i, m, C, st, sw, ignore_index, HAS_W)
    x = tl.load(X + i * sxn + t * sxc, mask=ok, other=0.0).to(tl.float32)
    loss = tl.where(oob, float("nan"), -(w * x))
    tl.store(Out + i, loss.to(Out.dtype.element_ty), mask=m)
    if tl.program_id(0) == 0:
        tl.store(TW, tl.sum(tl.zeros([BLOCK], tl.float32), 0).to(TW.dtype.element_ty))


@kernel
@triton.jit
def nll_fwd_reduce(X, T, Wt, Out, TW, N, C, sxn, sxc, st, sw, ignore_index,
                   HAS_W: tl.constexpr, MEAN: tl.constexpr, CUDA_1D_MEAN: tl.constexpr, BLOCK: tl.constexpr):
    """Out = sum_i -w[T_i] * X[i, T_i] (/ TW for MEAN), TW = sum_i w[T_i]; one program, fp32.
    CUDA_1D_MEAN: ATen's CUDA rule for a single unbatched sample (0 if ignored, NaN for w = 0, else -X[T])."""
    acc = tl.zeros([BLOCK], tl.float32)
    wacc = tl.zeros([BLOCK], tl.float32)
    bad = tl.zeros([BLOCK], tl.int32)
    for start in range(0, N, BLOCK):
        i = start + tl.arange(0, BLOCK).to(tl.int64)
        m = i < N
        t, ok, oob, w = _targets(T, Wt, i, m, C, st, sw, ignore_index, HAS_W)
        x = tl.load(X + i * sxn + t * sxc, mask=ok, other=0.0).to(tl.float32)
        acc += -(w * x)
        wacc += w
        bad |= oob.to(tl.int32)
    total = tl.sum(acc, 0)
    wsum = tl.sum(wacc, 0)
    if MEAN:
        if CUDA_1D_MEAN:
            t0 = tl.load(T).to(tl.int64)
            ok0 = (t0 != ignore_index) & (t0 >= 0) & (t0 < C)
            x0 = tl.load(X + t0 * sxc, mask=ok0, other=0.0).to(tl.float32)
            total = tl.where(t0 == ignore_index, 0.0, tl.where(wsum == 0.0, float("nan"), -x0))
        else:
            total = total / wsum
    anybad = tl.max(bad, 0) > 0
    total = tl.where(anybad, float("nan"), total)
    wsum = tl.where(anybad, float("nan"), wsum)
    tl.store(Out, total.to(Out.dtype.element_ty))
    tl.store(TW, wsum.to(TW.dtype.element_ty))


@kernel
@triton.jit
def nll_bwd(G, T, Wt, TWp, GI, N, C, sg, st, sw, ignore_index,
            HAS_W: tl.constexpr, MEAN: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    """GI[i, c] = (c == T_i != ignore_index) ? w[T_i] * -(G[i * sg] [/ TW]) : 0, GI contiguous [N, C]."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    rm = rows < N
    t, ok, oob, w = _targets(T, Wt, rows, rm, C, st, sw, ignore_index, HAS_W)
    g = tl.load(G + rows * sg, mask=ok, other=0.0).to(tl.float32)
    if MEAN:
        g = g / tl.load(TWp).to(tl.float32)
    grad = -g
    if HAS_W:
        grad = w * grad
    hit = (cols[None, :] == t[:, None]) & ok[:, None]
    v = tl.where(hit, grad[:, None], 0.0)
    v = tl.where(oob[:, None], float("nan"), v)
    tl.store(GI + rows[:, None] * C + cols[None, :], v.to(GI.dtype.element_ty),
             mask=rm[:, None] & (cols < C)[None, :])


_BLOCK = {"cuda": 1024, "interpreter": 4}          # the interpreter's small block tests the loop
# the reduction's one program: rows per iteration and warps (its N gathered loads are latency-bound: more
# in flight is faster). [8192, 32000] fp32, mean: 6.8 us of device time against ATen's 9.0 (1024 rows at
# 4 warps: 9.3; H200, out-of-tree sweep of profiler sums)
_REDUCE = {"cuda": dict(block=4096, warps=16), "interpreter": dict(block=4, warps=4)}
# the backward is a store of N x C (1 GB for [8192, 32000] fp32): one row of 32000 per program with 16
# warps measured 233.6 us on an H200 against 249.4 for tiles of 4096 with 4 warps (ATen 239.1)
_BWD_TILE = {"cuda": 32768, "interpreter": 64}


def _check(self, target, weight):
    """ATen's argument checks; returns (N, C, batched)."""
    if self.dim() not in (1, 2):
        raise ValueError("input tensor should be 1D or 2D")
    if target.dim() > 1:
        raise RuntimeError("0D or 1D target tensor expected, multi-target not supported")
    no_batch = self.dim() == 1 and target.dim() == 0
    if not no_batch and self.shape[0] != target.shape[0]:
        raise ValueError(f"Expected input batch_size ({self.shape[0]}) to match target batch_size "
                         f"({target.shape[0]}).")
    if self.dim() == 1 and not no_batch:
        raise Unsupported("1-D input with a 1-D target")
    if target.dtype != torch.int64:
        raise Unsupported(f"target dtype {target.dtype}")
    C = self.shape[-1]
    if weight is not None:
        if weight.numel() != C:
            raise RuntimeError(f"weight tensor should be defined either for all {C} classes or no classes but got "
                               f"weight tensor of shape: {list(weight.shape)}")
        if weight.dtype != self.dtype:
            raise Unsupported("weight dtype differs from the input's")
        if weight.device != self.device:
            raise Unsupported("weight on another device")
    if target.device != self.device:
        raise Unsupported("target on another device")
    return (self.shape[0] if self.dim() == 2 else 1), C, self.dim() == 2


def _host_check_targets(target, C, ignore_index):
    # the interpreter's tensors are on the CPU: checking costs no device sync, and ATen's CPU kernel raises
    if target.device.type == "cpu" and target.numel():
        bad = (target != ignore_index) & ((target < 0) | (target >= C))
        if bool(bad.any()):
            raise IndexError(f"Target {int(target[bad].reshape(-1)[0])} is out of bounds.")


def _weight_args(weight):
    if weight is None:
        return None, 0
    w = weight.reshape(-1)
    return w, w.stride(0)


@register("nll_loss_forward", "nll_loss_forward.output", category="reduction", dtypes=FLOATS)
def nll_loss_forward(self, target, weight, reduction, ignore_index, *, output=None, total_weight=None):
    """Negative log-likelihood: -w[t] * x[t] per sample, summed or averaged by total weight (fp32)."""
    N, C, batched = _check(self, target, weight)
    reduction = int(reduction)
    if reduction not in (_NONE, _MEAN, _SUM):
        raise ValueError(f"{reduction} is not a valid value for reduction")
    ii = int(ignore_index)
    if total_weight is not None and (total_weight.dtype != self.dtype or total_weight.device != self.device):
        raise Unsupported("total_weight dtype or device")
    none = reduction == _NONE and batched
    if not none and self.dtype == torch.float16 and backend().name == "interpreter":
        # ATen's CPU kernel sums fp16 losses and weights in fp16 (a cascade of fp16 partial sums): a sum
        # past 65504 is inf there (inf / inf: NaN) where the kernels' fp32 sums are finite
        raise Unsupported("float16 sum on the CPU (ATen sums in fp16)")
    out = prepare_out(output, (N,) if none else (), self.dtype, self.device)
    if total_weight is None:
        tw = empty((), self.dtype, self.device)
    else:
        if total_weight.dim() != 0:
            total_weight.resize_(())
        tw = total_weight
    _host_check_targets(target, C, ii)
    w, sw = _weight_args(weight)
    sxn = self.stride(0) if batched else 0
    sxc = self.stride(-1)
    st = target.stride(0) if target.dim() else 0
    be = backend().name
    if none:
        block = min(_BLOCK[be], max(next_pow2(N), 1))
        nll_fwd_none[(max(cdiv(N, block), 1),)](self, target, w, out, tw, N, C, sxn, sxc, st, sw, ii,
                                                  w is not None, block, num_warps=4)
    else:
        cfg = _REDUCE[be]
        block = min(cfg["block"], max(next_pow2(N), 1))
        cuda_1d = reduction == _MEAN and not batched and be == "cuda"
        nll_fwd_reduce[(1,)](self, target, w, out, tw, N, C, sxn, sxc, st, sw, ii,
                             w is not None, reduction == _MEAN, cuda_1d, block, num_warps=cfg["warps"])
    return out, tw


@register("nll_loss_backward", "nll_loss_backward.grad_input", category="reduction", dtypes=FLOATS,
          backward=True)
def nll_loss_backward(grad_output, self, target, weight, reduction, ignore_index, total_weight, *,
                      grad_input=None):
    """d nll_loss / d input: w[t] * -(grad [/ total_weight]) at each sample's target, 0 elsewhere."""
    N, C, batched = _check(self, target, weight)
    reduction = int(reduction)
    if reduction not in (_NONE, _MEAN, _SUM):
        raise ValueError(f"{reduction} is not a valid value for reduction")
    if grad_output.dtype != self.dtype or total_weight.dtype != self.dtype:
        raise Unsupported("grad_output or total_weight dtype differs from the input's")
    if grad_output.device != self.device or total_weight.device != self.device:
        raise Unsupported("grad_output or total_weight on another device")
    if total_weight.numel() != 1:
        raise RuntimeError(f"expected total_weight to be a single element tensor, got: {list(total_weight.shape)} "
                           f"({total_weight.numel()} elements)")
    if reduction == _NONE and batched:
        if grad_output.dim() != 1 or grad_output.shape[0] != N:
            raise RuntimeError(f"Expected a tensor of dimension 1 and tensor.size[0] == {N} but got: dimension "
                               f"{grad_output.dim()} and tensor.size[0] == "
                               f"{grad_output.shape[0] if grad_output.dim() else 'undefined'}")
        sg = grad_output.stride(0)
    else:
        if grad_output.dim() > 1 or grad_output.numel() != 1:
            raise RuntimeError(f"Expected a single element grad_output tensor, but got: {list(grad_output.shape)}")
        sg = 0
    gi = prepare_out(grad_input, tuple(self.shape), self.dtype, self.device)
    if gi.numel() == 0:
        return gi
    ii = int(ignore_index)
    _host_check_targets(target, C, ii)
    w, sw = _weight_args(weight)
    st = target.stride(0) if target.dim() else 0
    tile = _BWD_TILE[backend().name]
    bc = min(next_pow2(C), tile)
    bn = min(next_pow2(N), max(1, tile // bc))
    nll_bwd[(cdiv(N, bn), cdiv(C, bc))](grad_output, target, w, total_weight, gi, N, C, sg, st, sw, ii,
                                        w is not None, reduction == _MEAN, bn, bc,
                                        num_warps=max(4, min(16, bn * bc // 2048)))
    return gi
