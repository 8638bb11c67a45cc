"""softmax / log_softmax / _safe_softmax forward and backward over any dim.

A tensor is viewed as (M, N, K): N is the softmax dim, K the elements after it. One program owns
one (m, block of k) and all N: when N fits one tile (SINGLE) the row stays in registers and each
byte is read once and written once (2 passes over memory in total, the minimum); otherwise an
online max/sum pass is followed by a write pass (3 passes). Arithmetic is in fp32 for every dtype.

_safe_softmax (SDPA's math path, BERT's padding masks) is softmax with the SAFE flag: a row whose
entries are all -inf gives zeros instead of 0/0 = NaN. Such a row is exactly one whose sum is 0: in
any other row the max element adds exp(0) = 1 to the sum (a NaN anywhere makes the sum NaN).
Its backward is autograd's `_softmax_backward_data` of the zeros, which is zero.
"""
import functools

import torch
import triton
import triton.language as tl

from ...codegen.tlmath import exp_f, fma_f
from ...registry import FLOATS, Unsupported, register
from ...runtime import backend, kernel
from ...runtime.autotune import Autotuner, bench_ms
from ...runtime.utils import cdiv, next_pow2, num_warps_for, prepare_out, wrap_dim

# Warps per program for large single-tile rows: one warp count does not fit every row length and
# dtype (16 warps leave 8 elements per thread at N=4096; 4-8 keep more loads in flight per thread).
_TUNERS = {}


@kernel
@triton.jit
def softmax_fwd(X, Y, N, K, LOG: tl.constexpr, SAFE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                SINGLE: tl.constexpr):
    """Y[m, :, k] = exp(X - max) / sum(exp(X - max))   (LOG: X - max - log(sum(exp(X - max))));
    SAFE (softmax only): Y = 0 on rows where the sum is 0, i.e. rows of only -inf."""
    m = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)[:, None]
    n = tl.arange(0, BLOCK_N)[None, :]
    base = m * N * K + k
    kmask = k < K
    if SINGLE:
        mask = kmask & (n < N)
        offs = base + n * K
        x = tl.load(X + offs, mask=mask, other=-float("inf")).to(tl.float32)
        mx = tl.max(x, 1)[:, None]
        # all -inf (or masked) rows: 0 keeps exp() finite; such a row still ends as 0/0 = NaN like ATen
        mx = tl.where(mx == -float("inf"), 0.0, mx)
        e = tl.exp(x - mx)
        s = tl.sum(e, 1)[:, None]
        if LOG:
            y = x - mx - tl.log(s)
        else:
            y = e / s
            if SAFE:
                y = tl.where(s == 0.0, 0.0, y)
        tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)
    else:
        mx = tl.full([BLOCK_K, 1], -float("inf"), tl.float32)
        s = tl.zeros([BLOCK_K, 1], tl.float32)
        for start in range(0, N, BLOCK_N):
            mask = kmask & (n + start < N)
            x = tl.load(X + base + (n + start) * K, mask=mask, other=-float("inf")).to(tl.float32)
            new = tl.maximum(mx, tl.max(x, 1)[:, None])
            # a prefix of -inf must not turn the running sum into NaN (-inf - -inf)
            safe = tl.where(new == -float("inf"), 0.0, new)
            s = s * tl.exp(mx - safe) + tl.sum(tl.exp(x - safe), 1)[:, None]
            mx = new
        for start in range(0, N, BLOCK_N):
            mask = kmask & (n + start < N)
            offs = base + (n + start) * K
            x = tl.load(X + offs, mask=mask, other=-float("inf")).to(tl.float32)
            if LOG:
                y = x - mx - tl.log(s)
            else:
                y = tl.exp(x - mx) / s
                if SAFE:
                    y = tl.where(s == 0.0, 0.0, y)
            tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@kernel
@triton.jit
def softmax_bwd(G, Y, DX, N, K, LOG: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                SINGLE: tl.constexpr):
    """softmax:     dX = Y * (G - sum(G * Y))
    log_softmax: dX = G - exp(Y) * sum(G)          (Y is the forward output)
    log_softmax's product and difference are one fused multiply-add, as ATen's kernels (CPU and CUDA)
    compute them: exp(Y) * sum(G) may pass fp32's range where dX does not."""
    m = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)[:, None]
    n = tl.arange(0, BLOCK_N)[None, :]
    base = m * N * K + k
    kmask = k < K
    if SINGLE:
        mask = kmask & (n < N)
        offs = base + n * K
        g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
        y = tl.load(Y + offs, mask=mask, other=0.0).to(tl.float32)
        if LOG:
            dx = fma_f(exp_f(y) * -1.0, tl.sum(g, 1)[:, None], g)   # (* -1: -x is 0 - x, +0.0 for 0)
        else:
            dx = y * (g - tl.sum(g * y, 1)[:, None])
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros([BLOCK_K, 1], tl.float32)
        for start in range(0, N, BLOCK_N):
            mask = kmask & (n + start < N)
            offs = base + (n + start) * K
            g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
            if LOG:
                acc += tl.sum(g, 1)[:, None]
            else:
                y = tl.load(Y + offs, mask=mask, other=0.0).to(tl.float32)
                acc += tl.sum(g * y, 1)[:, None]
        for start in range(0, N, BLOCK_N):
            mask = kmask & (n + start < N)
            offs = base + (n + start) * K
            g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
            y = tl.load(Y + offs, mask=mask, other=0.0).to(tl.float32)
            if LOG:
                dx = fma_f(exp_f(y) * -1.0, acc, g)
            else:
                dx = y * (g - acc)
            tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=4096)
def geometry(shape, dim):
    """(M, N, K) of a contiguous tensor reduced along `dim`, and the tile for it (memoized: the
    host path of a small softmax is what an eager model pays per call)."""
    n_dim = len(shape)
    dim = wrap_dim(dim, n_dim)
    N = shape[dim] if n_dim else 1
    K = 1
    for s in shape[dim + 1:]:
        K *= s
    M = 1
    for s in shape[:dim]:
        M *= s
    _offsets_fit(N, K)    # once per signature (a raise is not memoized: such calls go to ATen each time)
    max_block = backend().config("row")["max_block"]
    if K == 1:
        block_k = 1
        block_n = min(next_pow2(N), max_block)
    else:
        block_k = min(next_pow2(K), 64)
        block_n = min(next_pow2(N), max(max_block // block_k, 1))
    return M, N, K, block_k, block_n


def _offsets_fit(N, K):
    """The kernels address a row block with 32-bit offsets n * K (only m is 64-bit): N x K elements
    past 2**31 (e.g. softmax over dim 0 of a [70000, 32000] tensor) go to ATen rather than wrap."""
    if N * K >= 2**31:
        raise Unsupported("N x K >= 2**31 elements (32-bit offsets within a row block)")


def _launch_fwd(x, dim, out_dtype, log, out=None, safe=False):
    if x.numel() == 0:
        wrap_dim(dim, x.dim())   # ATen's IndexError for a dim out of range (geometry() checks the others)
    y = prepare_out(out, x.shape, out_dtype, x.device)
    if x.numel() == 0:
        return y
    x = x.contiguous()
    M, N, K, bk, bn = geometry(x.shape, dim)
    grid, args = (M, cdiv(K, bk)), (x, y, N, K, log, safe, bk, bn, N <= bn)
    softmax_fwd.run(grid, args, _warps("fwd", x, M, bk, bn, lambda w: softmax_fwd.run(grid, args, w)))
    return y


def _launch_bwd(grad, y, dim, in_dtype, log, out=None):
    if y.numel() == 0:
        wrap_dim(dim, y.dim())   # ATen's IndexError for a dim out of range (geometry() checks the others)
    dx = prepare_out(out, y.shape, in_dtype, y.device)
    if y.numel() == 0:
        return dx
    if grad.shape != y.shape:
        raise RuntimeError(f"grad_output shape {list(grad.shape)} does not match output shape {list(y.shape)}")
    grad, y = grad.contiguous(), y.contiguous()
    M, N, K, bk, bn = geometry(y.shape, dim)
    grid, args = (M, cdiv(K, bk)), (grad, y, dx, N, K, log, bk, bn, N <= bn)
    softmax_bwd.run(grid, args, _warps("bwd", y, M, bk, bn, lambda w: softmax_bwd.run(grid, args, w)))
    return dx


# the num_warps a large softmax times (tuners softmax_fwd and softmax_bwd)
TUNE_CONFIGS = [{"num_warps": w} for w in (4, 8, 16, 32)]


def _warps(which, x, M, bk, bn, launch):
    """num_warps: the heuristic for small problems, tuned once per (rows bucket, tile, dtype) otherwise."""
    block = bk * bn
    guess = num_warps_for(block)
    if M * block < (1 << 22) or not backend().can_benchmark:
        return guess
    tuner = _TUNERS.get(which)
    if tuner is None:
        tuner = _TUNERS[which] = Autotuner(f"softmax_{which}", TUNE_CONFIGS)
    bucket = (next_pow2(M), bk, bn, str(x.dtype))
    return tuner.pick(bucket, lambda c: bench_ms(lambda: launch(c["num_warps"])))["num_warps"]


def _half_to_float_like_aten(x, dim, half_to_float, **_):
    # ATen takes half_to_float for a float16 input on CUDA only: on the CPU it raises for every input,
    # on CUDA for any other dtype ("conversion is supported for Half type only"), and so must we (by
    # letting it run)
    if half_to_float and (x.device.type == "cpu" or x.dtype != torch.float16):
        return f"half_to_float with a {x.dtype} input on {x.device.type}"
    return None


def _fwd_dtype(x, half_to_float):
    return torch.float32 if half_to_float else x.dtype


@register("_softmax", "_softmax.out", category="norm", dtypes=FLOATS, check=_half_to_float_like_aten)
def softmax(x, dim, half_to_float, *, out=None):
    """softmax along one dim (fp32 math; half_to_float on CUDA)."""
    return _launch_fwd(x, dim, _fwd_dtype(x, half_to_float), False, out)


@register("_log_softmax", "_log_softmax.out", category="norm", dtypes=FLOATS, check=_half_to_float_like_aten)
def log_softmax(x, dim, half_to_float, *, out=None):
    """log_softmax along one dim (fp32 math)."""
    return _launch_fwd(x, dim, _fwd_dtype(x, half_to_float), True, out)


def _safe_dtype(x, dim, dtype=None):
    # ATen converts the input to `dtype` before the softmax: the kernel reproduces that only where the
    # conversion is exact (none, or a 16-bit float input read as fp32); a narrowing or float64 dtype
    # (and an integer one, which ATen rejects) goes to ATen
    if dtype is None or dtype == x.dtype:
        return None
    if dtype == torch.float32 and x.dtype in (torch.float16, torch.bfloat16):
        return None
    return f"dtype {dtype} for a {x.dtype} input"


@register("_safe_softmax", category="norm", dtypes=FLOATS, check=_safe_dtype)
def safe_softmax(x, dim, dtype=None):
    """softmax along one dim; a row of only -inf gives zeros, not NaN (SDPA's math path)."""
    return _launch_fwd(x, dim, dtype or x.dtype, False, safe=True)


def _bwd_dtypes(grad, output, dim, input_dtype, **_):
    # served: one dtype throughout, or CUDA's half_to_float backward (fp32 grad and output of a half
    # input, the result in half). ATen's other answers differ by device (its CPU kernel
    # keeps grad's dtype where input_dtype is wider and raises for fp32 grad of a half input): it decides
    if output.dtype != grad.dtype:
        return f"grad {grad.dtype} with output {output.dtype}"
    if grad.dtype == input_dtype:
        return None
    if grad.is_cuda and grad.dtype == torch.float32 and input_dtype == torch.float16:
        return None   # (ATen 2.11's CUDA kernel raises for a bfloat16 input_dtype: it decides that one)
    return f"grad {grad.dtype} with input_dtype {input_dtype}"


@register("_softmax_backward_data", "_softmax_backward_data.out", category="norm", dtypes=FLOATS, backward=True,
          check=_bwd_dtypes)
def softmax_backward(grad, y, dim, input_dtype, *, grad_input=None):
    """dX = Y * (dY - sum(dY * Y))."""
    return _launch_bwd(grad, y, dim, input_dtype, False, grad_input)


@register("_log_softmax_backward_data", "_log_softmax_backward_data.out", category="norm", dtypes=FLOATS,
          backward=True, check=_bwd_dtypes)
def log_softmax_backward(grad, y, dim, input_dtype, *, out=None):
    """dX = dY - exp(Y) * sum(dY)."""
    return _launch_bwd(grad, y, dim, input_dtype, True, out)
