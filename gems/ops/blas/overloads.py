"""The ATen GEMM overloads Gems serves (mm, addmm, addmm_, bmm and their out / out_dtype variants): ATen's
argument checks and result dtypes, then matmul.launch. ATen semantics kept here: beta == 0 ignores bias
entirely (NaN/inf in it do not propagate), alpha == 0 ignores A @ B in fp32 (the BLAS convention, cuBLAS'
sgemm too) except on cuBLASLt's bias epilogue, and computes 0 * (A @ B) for fp16/bf16 on the CPU (NaN
where the product has an inf or a NaN; on CUDA such calls go to ATen, whose cuBLAS kernel decides); K == 0 gives
beta * bias (or zeros), empty M/N gives an empty result, shape and dtype mismatches raise RuntimeError
(ATen's own kernel raises them: we hand such calls to it).

Each overload writes its result only through matmul.launch, after its checks: that launch is declared
the call's first write (`first=True`), so with background compilation an out= or in-place call whose
GEMM kernel is still compiling is answered by ATen, like a functional one.
"""
import math

import torch

from ...codegen.generator import number_misfit
from ...registry import FLOATS, Unsupported, register
from ...runtime.utils import prepare_out
from .matmul import launch

# fp32 GEMMs read torch's matmul precision setting: it is part of every GEMM call plan's signature
_precision_key = torch.get_float32_matmul_precision


def _check_mats(a, b, batched):
    want = 3 if batched else 2
    if a.dim() != want or b.dim() != want:
        what = "batch1" if batched else "self"
        bad = a if a.dim() != want else b
        raise RuntimeError(f"{what} must be a {want}D tensor" if batched else
                           f"{'self' if bad is a else 'mat2'} must be a matrix")
    if a.dtype != b.dtype:
        raise RuntimeError(f"expected m1 and m2 to have the same dtype, but got: {a.dtype} != {b.dtype}")
    if batched and a.shape[0] != b.shape[0]:
        raise RuntimeError(f"batch1 and batch2 must have same number of batches, got {a.shape[0]} and {b.shape[0]}")
    if a.shape[-1] != b.shape[-2]:
        if batched:
            raise RuntimeError(f"Expected size for first two dimensions of batch2 tensor to be: "
                               f"[{b.shape[0]}, {a.shape[-1]}] but got: [{b.shape[0]}, {b.shape[1]}].")
        raise RuntimeError(f"mat1 and mat2 shapes cannot be multiplied ({a.shape[0]}x{a.shape[1]} and "
                           f"{b.shape[0]}x{b.shape[1]})")
    if b.device != a.device:
        raise Unsupported("operands on different devices")


def _dtype_out_shape(out, out_dtype, shape):
    # ATen's CUDA .dtype_out overloads write into out= as given (mm's raises "tensors must be 2-D" for a
    # 1-D out, an empty bmm leaves it as it is): an out= of another shape goes to ATen
    if out is not None and out_dtype is not None and tuple(out.shape) != tuple(shape):
        raise Unsupported("out= of another shape with out_dtype (ATen does not resize it)")


def _result_dtype(a, out_dtype):
    if out_dtype is None or out_dtype == a.dtype:
        return a.dtype
    if out_dtype == torch.float32 and a.dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    raise Unsupported(f"out_dtype {out_dtype} for {a.dtype} inputs")


def _mm(a, b, out=None, out_dtype=None):
    _check_mats(a, b, False)
    _dtype_out_shape(out, out_dtype, (a.shape[0], b.shape[1]))
    c = prepare_out(out, (a.shape[0], b.shape[1]), _result_dtype(a, out_dtype), a.device)
    launch(a, b, c, None, 1.0, 0.0, first=True)
    return c


def _bmm(a, b, out=None, out_dtype=None):
    _check_mats(a, b, True)
    _dtype_out_shape(out, out_dtype, (a.shape[0], a.shape[1], b.shape[2]))
    c = prepare_out(out, (a.shape[0], a.shape[1], b.shape[2]), _result_dtype(a, out_dtype), a.device)
    launch(a, b, c, None, 1.0, 0.0, first=True)
    return c


def _scalar(v, name):
    if isinstance(v, complex):
        raise Unsupported(f"complex {name}")
    return float(v)


def _addmm(bias, a, b, beta, alpha, out=None, out_dtype=None, inplace=False):
    _check_mats(a, b, False)
    beta, alpha = _scalar(beta, "beta"), _scalar(alpha, "alpha")
    M, N = a.shape[0], b.shape[1]
    _dtype_out_shape(out, out_dtype, (M, N))
    dtype = _result_dtype(a, out_dtype)
    if bias.dtype != dtype:
        raise Unsupported(f"bias dtype {bias.dtype} differs from the result dtype {dtype}")
    if bias.device != a.device:
        raise Unsupported("bias on another device")
    if inplace:
        if tuple(bias.shape) != (M, N):
            raise RuntimeError(f"The input tensor must have the shape of the result: expected {[M, N]}, "
                               f"got {list(bias.shape)}")
        if torch._debug_has_internal_overlap(bias) == 1:
            raise RuntimeError("unsupported operation: more than one element of the written-to tensor refers "
                               "to a single memory location. Please clone() the tensor before performing the "
                               "operation.")
        c = bias
    else:
        if bias.dim() > 2:
            raise RuntimeError(f"addmm: self must be at most 2-D (broadcastable to [{M}, {N}]), got "
                               f"{list(bias.shape)}")
        lt = _cublaslt_bias_epilogue(bias, a, b, beta)
        bias = bias.expand(M, N)  # raises RuntimeError when not broadcastable, like ATen; no copy
        c = prepare_out(out, (M, N), dtype, a.device)
        if lt and alpha == 0:
            launch(a, b, c, bias, alpha, beta, alpha0_reads_product=True, first=True)
            return c
    launch(a, b, c, bias, alpha, beta, first=True)
    return c


def _cublaslt_bias_epilogue(bias, a, b, beta):
    """Whether ATen's CUDA addmm takes cuBLASLt's bias epilogue (a 1-D contiguous bias, beta == 1, every
    dim of A and B above 1): that path computes 0 * (A @ B) for alpha == 0 (NaN where the product meets
    an inf or a NaN) also in fp32, where cuBLAS' sgemm skips the product."""
    return (a.device.type == "cuda" and bias.dim() == 1 and beta == 1 and bias.is_contiguous()
            and min(a.shape[0], a.shape[1], b.shape[1]) > 1)


@register("mm", "mm.out", category="blas", dtypes=FLOATS, plan_key=_precision_key)
def mm(self, mat2, *, out=None):
    """Matrix product (tiled Triton GEMM, fp32 accumulation, strided operands)."""
    return _mm(self, mat2, out)


@register("mm.dtype", "mm.dtype_out", category="blas", dtypes=FLOATS, plan_key=_precision_key, backends=("cuda",))
def mm_dtype(self, mat2, out_dtype, *, out=None):
    """Matrix product with an fp32 result for 16-bit inputs (CUDA only, like ATen)."""
    return _mm(self, mat2, out, out_dtype)


def _addmm_numbers(self, mat1, mat2, *args, beta=1, alpha=1, **kwargs):
    # ATen converts alpha/beta with an overflow check (1e40 into fp32 raises): a number that does
    # not fit goes to ATen, which raises or answers; numbers key plans by value here, so this runs
    # once per value
    for v in (beta, alpha):
        why = number_misfit(v, mat1.dtype)
        if why is not None:
            return f"alpha/beta {why}"
        if not isinstance(v, complex) and not math.isfinite(v):
            # an infinite or NaN scale: which terms meet it (0 * inf) is the BLAS's order of work
            return "alpha/beta not finite"
    if alpha == 0 and mat1.device.type == "cuda" and mat1.dtype in (torch.float16, torch.bfloat16):
        # whether ATen's 16-bit CUDA GEMM computes 0 * (A @ B) (NaN where the product meets an inf or a
        # NaN) or skips the product depends on the cuBLAS kernel it picks: ATen answers these calls
        return "alpha == 0 with 16-bit operands on CUDA"
    return None


@register("addmm", "addmm.out", category="blas", dtypes=FLOATS, plan_key=_precision_key, check=_addmm_numbers)
def addmm(self, mat1, mat2, *, beta=1, alpha=1, out=None):
    """beta * self + alpha * (mat1 @ mat2), bias broadcast and scaling fused in the epilogue."""
    return _addmm(self, mat1, mat2, beta, alpha, out)


@register("addmm_", category="blas", dtypes=FLOATS, plan_key=_precision_key, check=_addmm_numbers)
def addmm_(self, mat1, mat2, *, beta=1, alpha=1):
    """In-place addmm: self = beta * self + alpha * (mat1 @ mat2)."""
    return _addmm(self, mat1, mat2, beta, alpha, inplace=True)


@register("addmm.dtype", "addmm.dtype_out", category="blas", dtypes=FLOATS, plan_key=_precision_key, backends=("cuda",),
          check=_addmm_numbers)
def addmm_dtype(self, mat1, mat2, out_dtype, *, beta=1, alpha=1, out=None):
    """addmm with an fp32 result for 16-bit inputs (CUDA only, like ATen)."""
    return _addmm(self, mat1, mat2, beta, alpha, out, out_dtype)


@register("bmm", "bmm.out", category="blas", dtypes=FLOATS, plan_key=_precision_key)
def bmm(self, mat2, *, out=None):
    """Batched matrix product (the GEMM kernel with a batch axis and batch strides)."""
    return _bmm(self, mat2, out)


@register("bmm.dtype", "bmm.dtype_out", category="blas", dtypes=FLOATS, plan_key=_precision_key, backends=("cuda",))
def bmm_dtype(self, mat2, out_dtype, *, out=None):
    """Batched matrix product with an fp32 result for 16-bit inputs (CUDA only, like ATen)."""
    return _bmm(self, mat2, out, out_dtype)
