"""Fused normalizations: RMSNorm (Llama and Gemma casting), residual add + RMSNorm, LayerNorm and
residual add + LayerNorm, each a `torch.autograd.Function` over Triton forward and backward kernels,
with the plain PyTorch reference beside it (`reference_<name>`) and, for torch.compile, a custom
operator (gems::rms_norm, gems::layer_norm and their backwards; library.py). The RMSNorm Triton
kernels are in rms_norm_kernels.py.

Layout. The input is read as M rows of N = x.shape[-1] elements. Rows may have any stride as long as
the last dim is contiguous (a view of every second row, a slice of a wider tensor: no copy); other
layouts are copied once. Outputs are new contiguous tensors of the input's shape.

Forward. For N <= max_n (16384 on the GPU) a program holds BLOCK_M whole rows in registers
(BLOCK_N = next_power_of_2(N), BLOCK_M = rows filling a 4096-element tile, num_warps from the tile
size), so x (and residual) is read once and every output written once: the minimum traffic. Wider
rows loop over the row in BLOCK_N = max_n chunks: one pass for the statistics, one to write (x read
twice; with a residual, the sum is written in the first pass and read back in the second).

Backward. Each program owns a contiguous range of rows (2 programs per SM on the GPU, 1 for rows
wider than 8192; one row per program when no weight gradient is needed), recomputes the normalized row from x and the saved fp32 rstd (and mean), writes dx,
and keeps its dweight (dbias) partial sums in fp32 registers; they are written once to a workspace
[programs, N] and a column-sum kernel adds them up in a fixed order. No atomics: results are
deterministic run to run.

LayerNorm and add_layer_norm run native_layer_norm's kernels (gems/ops/norm/layer_norm.py: one kernel pair
serves both, with a residual-add flag), so their geometry and accuracy (IEEE division for the mean and
variance) are the ATen op's; only RMSNorm's kernels live here.

Statistics and all arithmetic are fp32 (fp64 for fp64 inputs on the reference path). Served dtypes:
fp32, fp16, bf16 for x (weight and bias: any of these, see the casting rules). float64 inputs, and
tensors on a device the active Gems backend does not run on (CPU without the interpreter, `meta`),
run the PyTorch reference, which has the same semantics and autograd. Other dtypes raise ValueError.

Casting rules (`casting=`):
- "llama" (Hugging Face LlamaRMSNorm; also Mistral, Qwen2, Aquila): h = x.float() * rstd;
  y = (weight + offset) * h.to(x.dtype), multiplied in fp32 and rounded once to
  promote_types(x.dtype, weight.dtype) -- the dtype HF's `weight * h.to(input_dtype)` gives (a bf16
  model: bf16; fp32 weight with bf16 x: fp32). With offset=0 this is HF's result bit for bit up to
  rsqrt's rounding.
- "gemma": y = (x.float() * rstd * (offset + weight.float())).to(x.dtype) (Gemma: offset=1.0); the
  result has x's dtype.
LayerNorm: y = ((x - mean) * rstd * weight + bias).to(x.dtype), statistics in fp32 (two-pass
variance from registers), weight/bias in any served float dtype, either may be None.
Residual variants: new_residual = (x + residual) rounded to the input dtype (HF's
`hidden_states = residual + hidden_states`), and the norm normalizes that rounded sum.
"""
from __future__ import annotations

import functools

import torch

from .. import dispatch
from ..ops.norm import layer_norm as ln
from ..ops.reduce.reduction import reduce_launch
from ..runtime import backend
from ..runtime.planned import planned
from ..runtime.utils import as_rows, cdiv, empty, next_pow2, promote_types, sm_count, zeros
from . import deferral, library
from .library import first, maybe
from .rms_norm_kernels import rms_bwd, rms_fwd

_SERVED = (torch.float32, torch.float16, torch.bfloat16)

# max_n: widest row held in registers (wider rows loop); tile: elements per forward program for short
# rows; elems_per_warp: sets num_warps (capped by max_warps); bwd_per_sm: backward programs per SM
_CONFIGS = {
    "cuda": dict(max_n=16384, tile=4096, elems_per_warp=512, bwd_elems_per_warp=256, max_warps=16,
                 bwd_per_sm=2),
    # the interpreter runs a program instance in Python: few wide programs; a small max_n so that the
    # tests reach the looping path with small rows
    "interpreter": dict(max_n=128, tile=1024, elems_per_warp=512, bwd_elems_per_warp=512, max_warps=1,
                        programs=3),
}


def _col_sum_into(ws, out, P, N):
    """out[n] = sum_p ws[p, n] (fp32 workspace [P, N]) in a fixed order, rounded once to out's dtype."""
    reduce_launch(ws, out, (1, 0, P, N, N, 1) if N > 1 else (1, 0, P, 1, 1, 0), 0, torch.float32, 1.0)


def _pair(ctx, dx):
    """(grad of x, grad of residual): the same tensor for both (ATen's add backward also returns one
    tensor for both operands; autograd copies before accumulating into a shared one)."""
    ni = ctx.needs_input_grad
    return (dx if ni[0] else None, dx if ctx.has_res and ni[1] else None)


# --------------------------------------------------------------------------------------------- helpers
def _warps(elems, key, cfg):
    return max(1, min(cfg["max_warps"], next_pow2(max(elems // cfg[key], 1))))


@functools.lru_cache(maxsize=1024)
def _fwd_config(M, N, name):
    """(grid, SINGLE, BLOCK_M, BLOCK_N, num_warps) of a forward launch; cached by shape."""
    cfg = _CONFIGS[name]
    block_n = next_pow2(N)
    if block_n <= cfg["max_n"]:
        block_m = min(next_pow2(M), max(1, cfg["tile"] // block_n))
        return (cdiv(M, block_m),), 1, block_m, block_n, _warps(block_m * block_n, "elems_per_warp", cfg)
    block_n = cfg["max_n"]
    return (M,), 0, 1, block_n, _warps(block_n, "elems_per_warp", cfg)


@functools.lru_cache(maxsize=1024)
def _bwd_config(M, N, name, dev, need_w):
    """(programs, rows per program, SINGLE, BLOCK_N, num_warps) of a backward launch: a few programs
    per SM each looping over a range of rows when weight gradients are accumulated, one row per
    program when only dx is needed (frozen weights)."""
    cfg = _CONFIGS[name]
    block_n = next_pow2(N)
    single = int(block_n <= cfg["max_n"])
    if not single:
        block_n = cfg["max_n"]
    if "programs" in cfg:
        target = cfg["programs"]
    elif not need_w:
        target = M
    else:
        target = sm_count(dev) * (cfg["bwd_per_sm"] if block_n <= 8192 else 1)
    rows = cdiv(M, max(1, min(target, M)))
    return cdiv(M, rows), rows, single, block_n, _warps(block_n, "bwd_elems_per_warp", cfg)


def _use_kernels(what, x, residual, weight, bias=None):
    """Whether the Triton kernels serve this call (else the PyTorch reference runs). The common case
    is decided from dtypes and the device alone; shapes and devices are checked by the planned
    forward (once per signature), and here for every call that does not take the kernels."""
    dev_type = library.device_type()
    T = torch.Tensor
    if (isinstance(x, T) and x.dtype in _SERVED and x.device.type == dev_type and isinstance(weight, (T, type(None)))
            and (weight is None or weight.dtype in _SERVED) and (bias is None or bias.dtype in _SERVED)):
        return True
    _check(x, residual, weight, bias, what)
    if x.dtype not in _SERVED:
        if x.dtype == torch.float64:
            return False
        raise ValueError(f"gems.fused norms: input dtype {x.dtype} is not supported (float32, float16, bfloat16; "
                         f"float64 runs the PyTorch reference)")
    for t in (weight, bias):
        if t is not None and t.dtype not in _SERVED:
            if t.dtype == torch.float64:
                return False
            raise ValueError(f"gems.fused norms: parameter dtype {t.dtype} is not supported")
    return dev_type is not None and x.device.type == dev_type


def _check(x, residual, weight, bias, what):
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"{what}: x must be a floating-point tensor, got "
                         f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.dim() == 0:
        raise ValueError(f"{what}: x must have at least one dimension (the normalized one)")
    N = x.shape[-1]
    if N == 0:
        raise ValueError(f"{what}: the normalized (last) dimension is empty")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is None:
            continue
        if not p.is_floating_point():
            raise ValueError(f"{what}: {name} must be floating point, got {p.dtype}")
        if tuple(p.shape) != (N,):
            raise ValueError(f"{what}: {name} shape {tuple(p.shape)} must be ({N},), the last dim of x "
                             f"{tuple(x.shape)}")
        if p.device != x.device:
            raise ValueError(f"{what}: {name} is on {p.device}, x on {x.device}")
    if residual is not None:
        if tuple(residual.shape) != tuple(x.shape):
            raise ValueError(f"{what}: residual shape {tuple(residual.shape)} differs from x {tuple(x.shape)}")
        if residual.dtype != x.dtype:
            raise ValueError(f"{what}: residual dtype {residual.dtype} differs from x {x.dtype}")
        if residual.device != x.device:
            raise ValueError(f"{what}: residual is on {residual.device}, x on {x.device}")


def _no_graph(*ts):
    """No autograd graph will be recorded (inference, decode): launch without the autograd.Function
    (its apply costs more host time than the rest of the call)."""
    if not torch.is_grad_enabled():
        return True
    return not any(t is not None and t.requires_grad for t in ts)


# ------------------------------------------------------------------------------------------- RMSNorm
@planned("rms_forward(Tensor x, Tensor? residual, Tensor weight, float eps, float offset, bool gemma, str what)"
         " -> (Tensor, Tensor?, Tensor)")
def _rms_forward(x, residual, weight, eps, offset, gemma, what):
    """(y, new residual or None, rstd): one forward launch. Planned: the checks, layouts and launch
    geometry run once per signature."""
    if weight is None:
        raise ValueError(f"{what}: weight is required")
    _check(x, residual, weight, None, what)
    shape, N = x.shape, x.shape[-1]
    M = x.numel() // N
    dev = x.device
    y_dtype = x.dtype if gemma else promote_types(x.dtype, weight.dtype)
    y = empty(shape, y_dtype, dev)
    s = empty(shape, x.dtype, dev) if residual is not None else None
    rstd = empty((M,), torch.float32, dev)
    if M:
        xv, sx = as_rows(x, M, N)
        rv, sr = as_rows(residual, M, N) if residual is not None else (None, N)
        grid, single, bm, bn, nw = _fwd_config(M, N, backend().name)
        rms_fwd[grid](xv, rv, weight.contiguous(), y, s, rstd, M, N, sx, sr, float(eps), float(offset),
                       int(residual is not None), int(gemma), single, bm, bn, num_warps=nw)
    return y, s, rstd


@planned("rms_backward(Tensor dy, Tensor? ds, Tensor x, Tensor weight, Tensor rstd, float offset, bool gemma, "
         "bool need_x, bool need_w) -> (Tensor?, Tensor?)")
def _rms_backward(dy, ds, x, weight, rstd, offset, gemma, need_x, need_w):
    """(dx or None, dweight or None): the backward launch and, for dweight, the column sum of the
    per-program partial sums. Planned like the forward."""
    shape, N = x.shape, x.shape[-1]
    M = x.numel() // N
    dx = empty(shape, x.dtype, x.device) if need_x else None
    if M == 0:
        return dx, zeros(weight.shape, weight.dtype, weight.device) if need_w else None
    dw = empty(weight.shape, weight.dtype, weight.device) if need_w else None
    xv, sx = as_rows(x, M, N)
    dyv, sdy = as_rows(dy, M, N)
    dsv, sds = as_rows(ds, M, N) if ds is not None else (None, N)
    P, rows, single, bn, nw = _bwd_config(M, N, backend().name, x.device.index or 0, bool(need_w))
    ws = (empty if single else zeros)((P, N), torch.float32, x.device) if need_w else None
    rms_bwd[(P,)](dyv, dsv, xv, weight.contiguous(), rstd, dx, ws, M, N, sdy, sds, sx, rows, offset,
                   int(gemma), int(ds is not None), int(need_x), int(need_w), single, bn, num_warps=nw)
    if need_w:
        _col_sum_into(ws, dw, P, N)
    return dx, dw


class _RMSNormFn(torch.autograd.Function):
    """rms_norm (residual None) and add_rms_norm (returns (y, new_residual))."""

    @staticmethod
    def forward(ctx, x, residual, weight, eps, offset, gemma, what):
        y, s, rstd = _rms_forward(x, residual, weight, eps, offset, gemma, what)
        ctx.gemma, ctx.offset, ctx.eps, ctx.has_res = gemma, float(offset), eps, residual is not None
        ctx.set_materialize_grads(False)
        if s is not None and not (ctx.needs_input_grad[0] or ctx.needs_input_grad[1]):
            ctx.mark_non_differentiable(s)      # residual + x needs no graph when neither does
        ctx.save_for_backward(s if residual is not None else x, weight, rstd)
        if residual is not None:
            return y, s
        return y

    @staticmethod
    def backward(ctx, dy, ds=None):
        x, weight, rstd = ctx.saved_tensors
        ni = ctx.needs_input_grad
        need_x, need_w = ni[0] or ni[1], ni[2]
        if dy is None:       # only the residual output reached the loss
            dw = torch.zeros_like(weight) if need_w else None
            dx = (ds if ds is not None else torch.zeros_like(x)) if need_x else None
        else:
            dx, dw = deferral.backward("rms_norm", _rms_backward,
                                       (dy, ds, x, weight, rstd, ctx.offset, ctx.gemma, need_x, need_w),
                                       lambda: _rms_grads_by_reference(ctx, dy, ds, x, weight, need_x, need_w))
        return _pair(ctx, dx) + (dw, None, None, None, None)


def _rms_grads_by_reference(ctx, dy, ds, x, weight, need_x, need_w):
    """(dx, dweight) from the reference, while the backward's kernels compile (x: the normalized input,
    the new residual of add_rms_norm, whose gradient ds adds to dx)."""
    casting = "gemma" if ctx.gemma else "llama"
    dx, dw = deferral.reference_grads(
        lambda h, w: reference_rms_norm(h, w, ctx.eps, offset=ctx.offset, casting=casting),
        (x, weight), (need_x, need_w), (dy,))
    if need_x and ds is not None:
        dx = ds if dx is None else dx + ds
    return dx, dw


# torch.compile: gems::rms_norm (residual: Tensor? in, Tensor[] out) and its backward (library.py)
def _rms_fake(x, residual, weight, eps, offset, gemma):
    _check(x, residual, weight, None, "rms_norm")
    y = x.new_empty(x.shape, dtype=x.dtype if gemma else promote_types(x.dtype, weight.dtype))
    s = maybe(None if residual is None else x.new_empty(x.shape))
    return y, s, x.new_empty((x.numel() // x.shape[-1],), dtype=torch.float32)


def _rms_save(ctx, inputs, output):
    x, residual, weight, _, ctx.offset, ctx.gemma = inputs
    ctx.has_res = residual is not None
    ctx.save_for_backward(first(output[1]) if ctx.has_res else x, weight, output[2])


def _rms_grads(ctx, dy, ds, _):
    x, weight, rstd = ctx.saved_tensors
    ni = ctx.needs_input_grad
    dx, dw = _RMS_BWD(dy, first(ds) if ctx.has_res else None, x, weight, rstd, ctx.offset, ctx.gemma,
                      ni[0] or ni[1], ni[2])
    return _pair(ctx, first(dx)) + (first(dw), None, None, None)


def _rms_bwd_fake(dy, ds, x, weight, rstd, offset, gemma, need_x, need_w):
    return (maybe(x.new_empty(x.shape) if need_x else None), maybe(weight.new_empty(weight.shape) if need_w else None))


_RMS_BWD = library.define(
    "rms_norm_backward", "(Tensor dy, Tensor? ds, Tensor x, Tensor weight, Tensor rstd, float offset, bool gemma, "
    "bool need_x, bool need_w) -> (Tensor[], Tensor[])",
    lambda *a: tuple(maybe(t) for t in _rms_backward(*a)), _rms_bwd_fake)
_RMS_OP = library.define(
    "rms_norm", "(Tensor x, Tensor? residual, Tensor weight, float eps, float offset, bool gemma) "
    "-> (Tensor, Tensor[], Tensor)",
    lambda x, r, w, eps, off, g: library.optional_at(
        _rms_forward(x, r, w, eps, off, g, "rms_norm" if r is None else "add_rms_norm"), 1),
    _rms_fake, backward=_rms_grads, setup_context=_rms_save)


def _casting(casting):
    if casting not in ("llama", "gemma"):
        raise ValueError(f"casting must be 'llama' or 'gemma', got {casting!r}")
    return casting == "gemma"


@deferral.deferrable
def rms_norm(x, weight, eps=1e-6, *, offset=0.0, casting="llama"):
    """RMSNorm over the last dim: Llama's casting rule (HF LlamaRMSNorm) or Gemma's (offset=1.0).

    llama: y = (weight + offset) * (x.float() * rstd).to(x.dtype), in promote_types(x, weight) dtype;
    gemma: y = (x.float() * rstd * (offset + weight.float())).to(x.dtype). rstd = rsqrt(mean(x^2) + eps).
    """
    gemma = _casting(casting)
    if not _use_kernels("rms_norm", x, None, weight):
        return reference_rms_norm(x, weight, eps, offset=offset, casting=casting)
    if torch.compiler.is_compiling():   # one opaque node for Dynamo; eager keeps the cheaper Function (library.py)
        return _RMS_OP(x, None, weight, eps, offset, gemma)[0]
    if _no_graph(x, weight):
        return _rms_forward(x, None, weight, eps, offset, gemma, "rms_norm")[0]
    return _RMSNormFn.apply(x, None, weight, eps, offset, gemma, "rms_norm")


@deferral.deferrable
def add_rms_norm(x, residual, weight, eps=1e-6, *, offset=0.0, casting="llama"):
    """(rms_norm(residual + x), residual + x) in one kernel reading x and residual once."""
    gemma = _casting(casting)
    if not _use_kernels("add_rms_norm", x, residual, weight):
        return reference_add_rms_norm(x, residual, weight, eps, offset=offset, casting=casting)
    if torch.compiler.is_compiling():
        y, s, _ = _RMS_OP(x, residual, weight, eps, offset, gemma)
        return y, s[0]
    if _no_graph(x, residual, weight):
        return _rms_forward(x, residual, weight, eps, offset, gemma, "add_rms_norm")[:2]
    return _RMSNormFn.apply(x, residual, weight, eps, offset, gemma, "add_rms_norm")


# ----------------------------------------------------------------------------------------- LayerNorm
@planned("ln_forward(Tensor x, Tensor? residual, Tensor? weight, Tensor? bias, float eps, str what)"
         " -> (Tensor, Tensor?, Tensor, Tensor)")
def _ln_forward(x, residual, weight, bias, eps, what):
    """(y, new residual or None, mean, rstd): one forward launch of native_layer_norm's kernel
    (planned, like _rms_forward)."""
    _check(x, residual, weight, bias, what)
    shape, N = x.shape, x.shape[-1]
    M = x.numel() // N
    dev = x.device
    y = empty(shape, x.dtype, dev)
    s = empty(shape, x.dtype, dev) if residual is not None else None
    mean = empty((M,), torch.float32, dev)
    rstd = empty((M,), torch.float32, dev)
    if M:
        xv, sx = as_rows(x, M, N)
        rv, sr = as_rows(residual, M, N) if residual is not None else (None, 0)
        ln.forward_rows(xv, sx, weight.contiguous() if weight is not None else None,
                        bias.contiguous() if bias is not None else None, y, mean, rstd, M, N, eps, rv, sr, s)
    return y, s, mean, rstd


@planned("ln_backward(Tensor dy, Tensor? ds, Tensor x, Tensor? weight, Tensor? bias, Tensor mean, Tensor rstd, "
         "bool need_x, bool need_w, bool need_b) -> (Tensor?, Tensor?, Tensor?)")
def _ln_backward(dy, ds, x, weight, bias, mean, rstd, need_x, need_w, need_b):
    """(dx, dweight, dbias), each None when not needed: native_layer_norm's backward kernels."""
    shape, N = x.shape, x.shape[-1]
    M = x.numel() // N
    dx = empty(shape, x.dtype, x.device) if need_x else None
    alloc = zeros if M == 0 else empty
    dw = alloc(weight.shape, weight.dtype, weight.device) if need_w else None
    db = alloc(bias.shape, bias.dtype, bias.device) if need_b else None
    if M:
        xv, sx = as_rows(x, M, N)
        dyv, sdy = as_rows(dy, M, N)
        dsv, sds = as_rows(ds, M, N) if ds is not None else (None, 0)
        ln.backward_rows(dyv, sdy, xv, sx, weight.contiguous() if weight is not None else None, mean, rstd,
                         dx, dw, db, M, N, x.device, dsv, sds)
    return dx, dw, db


class _LayerNormFn(torch.autograd.Function):
    """layer_norm (residual None) and add_layer_norm (returns (y, new_residual))."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps, what):
        y, s, mean, rstd = _ln_forward(x, residual, weight, bias, eps, what)
        ctx.has_res, ctx.eps = residual is not None, eps
        ctx.set_materialize_grads(False)
        if s is not None and not (ctx.needs_input_grad[0] or ctx.needs_input_grad[1]):
            ctx.mark_non_differentiable(s)
        ctx.save_for_backward(s if residual is not None else x, weight, bias, mean, rstd)
        if residual is not None:
            return y, s
        return y

    @staticmethod
    def backward(ctx, dy, ds=None):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        ni = ctx.needs_input_grad
        need_x, need_w, need_b = ni[0] or ni[1], ni[2] and weight is not None, ni[3] and bias is not None
        if dy is None:
            dw = torch.zeros_like(weight) if need_w else None
            db = torch.zeros_like(bias) if need_b else None
            dx = (ds if ds is not None else torch.zeros_like(x)) if need_x else None
        else:
            dx, dw, db = deferral.backward(
                "layer_norm", _ln_backward, (dy, ds, x, weight, bias, mean, rstd, need_x, need_w, need_b),
                lambda: _ln_grads_by_reference(ctx, dy, ds, x, weight, bias, need_x, need_w, need_b))
        return _pair(ctx, dx) + (dw, db, None, None)


def _ln_grads_by_reference(ctx, dy, ds, x, weight, bias, need_x, need_w, need_b):
    """(dx, dweight, dbias) from the reference, while the backward's kernels compile (as for RMSNorm)."""
    dx, dw, db = deferral.reference_grads(lambda h, w, b: reference_layer_norm(h, w, b, ctx.eps),
                                          (x, weight, bias), (need_x, need_w, need_b), (dy,))
    if need_x and ds is not None:
        dx = ds if dx is None else dx + ds
    return dx, dw, db


# torch.compile: gems::layer_norm (residual, weight, bias optional) and its backward (library.py)
def _ln_fake(x, residual, weight, bias, eps):
    _check(x, residual, weight, bias, "layer_norm")
    stat = x.new_empty((x.numel() // x.shape[-1],), dtype=torch.float32)
    return (x.new_empty(x.shape), maybe(None if residual is None else x.new_empty(x.shape)), stat,
            torch.empty_like(stat))


def _ln_save(ctx, inputs, output):
    x, residual, weight, bias, _ = inputs
    ctx.has_res = residual is not None
    ctx.save_for_backward(first(output[1]) if ctx.has_res else x, weight, bias, output[2], output[3])


def _ln_grads(ctx, dy, ds, *_):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    ni = ctx.needs_input_grad
    dx, dw, db = _LN_BWD(dy, first(ds) if ctx.has_res else None, x, weight, bias, mean, rstd, ni[0] or ni[1],
                         ni[2] and weight is not None, ni[3] and bias is not None)
    return _pair(ctx, first(dx)) + (first(dw), first(db), None)


def _ln_bwd_fake(dy, ds, x, weight, bias, mean, rstd, need_x, need_w, need_b):
    return tuple(maybe(x.new_empty(t.shape, dtype=t.dtype) if need else None)
                 for t, need in ((x, need_x), (weight, need_w), (bias, need_b)))


_LN_BWD = library.define(
    "layer_norm_backward", "(Tensor dy, Tensor? ds, Tensor x, Tensor? weight, Tensor? bias, Tensor mean, "
    "Tensor rstd, bool need_x, bool need_w, bool need_b) -> (Tensor[], Tensor[], Tensor[])",
    lambda *a: tuple(maybe(t) for t in _ln_backward(*a)), _ln_bwd_fake)
_LN_OP = library.define(
    "layer_norm", "(Tensor x, Tensor? residual, Tensor? weight, Tensor? bias, float eps) "
    "-> (Tensor, Tensor[], Tensor, Tensor)",
    lambda x, r, w, b, eps: library.optional_at(
        _ln_forward(x, r, w, b, eps, "layer_norm" if r is None else "add_layer_norm"), 1),
    _ln_fake, backward=_ln_grads, setup_context=_ln_save)


# a plain LayerNorm is one ATen op already (native_layer_norm, whose kernels _LayerNormFn launches)
_NATIVE_LN = ("native_layer_norm.default", "native_layer_norm_backward.default")


def _native_ln_served():
    """Whether Gems serves native_layer_norm and its backward on this thread now (gems.enable()).
    Then a plain layer_norm goes through F.layer_norm: the same Triton kernels, replayed from the C++
    fast path's plans under ATen's C++ autograd node. _LayerNormFn's Python autograd costs about twice
    ATen's whole layer_norm forward + backward at BERT's 4096 x 768 (0.120 vs 0.063 ms on an H200):
    nothing is fused away to pay for it."""
    cfg = dispatch.active_config()
    return cfg is not None and _NATIVE_LN[0] in cfg and _NATIVE_LN[1] in cfg


@deferral.deferrable
def layer_norm(x, weight, bias, eps=1e-5):
    """LayerNorm over the last dim (F.layer_norm(x, (N,), weight, bias, eps)), fp32 statistics.
    With gems.enable() (native_layer_norm served) it is F.layer_norm itself, on Gems' kernels."""
    if not _use_kernels("layer_norm", x, None, weight, bias):
        return reference_layer_norm(x, weight, bias, eps)
    if torch.compiler.is_compiling():   # one opaque node for Dynamo; eager keeps the cheaper Function (library.py)
        return _LN_OP(x, None, weight, bias, eps)[0]
    if _native_ln_served():
        return torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    if _no_graph(x, weight, bias):
        return _ln_forward(x, None, weight, bias, eps, "layer_norm")[0]
    return _LayerNormFn.apply(x, None, weight, bias, eps, "layer_norm")


@deferral.deferrable
def add_layer_norm(x, residual, weight, bias, eps=1e-5):
    """(layer_norm(x + residual), x + residual): BERT's `LayerNorm(hidden_states + input_tensor)`."""
    if not _use_kernels("add_layer_norm", x, residual, weight, bias):
        return reference_add_layer_norm(x, residual, weight, bias, eps)
    if torch.compiler.is_compiling():
        y, s, _, _ = _LN_OP(x, residual, weight, bias, eps)
        return y, s[0]
    if _no_graph(x, residual, weight, bias):
        return _ln_forward(x, residual, weight, bias, eps, "add_layer_norm")[:2]
    return _LayerNormFn.apply(x, residual, weight, bias, eps, "add_layer_norm")


# ------------------------------------------------------------------------------------------ references
def _acc(t):
    """The reference's compute dtype: fp32, or fp64 for fp64 tensors (tests run it in fp64)."""
    return t if t.dtype == torch.float64 else t.float()


def reference_rms_norm(x, weight, eps=1e-6, *, offset=0.0, casting="llama"):
    """RMSNorm in plain PyTorch, Hugging Face's code (LlamaRMSNorm / GemmaRMSNorm)."""
    h = _acc(x)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if casting == "gemma":
        return (h * (offset + _acc(weight))).to(x.dtype)
    if not offset:
        return weight * h.to(x.dtype)                  # HF's LlamaRMSNorm
    # with an offset: (weight + offset) in fp32 (no rounding of the shifted weight), one rounding
    out = (_acc(weight) + offset) * _acc(h.to(x.dtype))
    return out.to(torch.promote_types(x.dtype, weight.dtype))


def reference_add_rms_norm(x, residual, weight, eps=1e-6, *, offset=0.0, casting="llama"):
    """new_residual = residual + x (input dtype); (rms_norm(new_residual), new_residual)."""
    s = residual + x
    return reference_rms_norm(s, weight, eps, offset=offset, casting=casting), s


def reference_layer_norm(x, weight, bias, eps=1e-5):
    """LayerNorm over the last dim with fp32 statistics, result in x's dtype."""
    h = _acc(x)
    mean = h.mean(-1, keepdim=True)
    var = (h - mean).pow(2).mean(-1, keepdim=True)
    y = (h - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * _acc(weight)
    if bias is not None:
        y = y + _acc(bias)
    return y.to(x.dtype)


def reference_add_layer_norm(x, residual, weight, bias, eps=1e-5):
    """BERT's `LayerNorm(hidden_states + input_tensor)`: (layer_norm(x + residual), x + residual)."""
    s = x + residual
    return reference_layer_norm(s, weight, bias, eps), s
