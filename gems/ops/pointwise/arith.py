"""Arithmetic pointwise ops (add, sub, mul, div, neg, rsub), declared through gems.codegen.

Each declaration serves every ATen variant of the op (functional .Tensor/.Scalar, .out, in-place).
Bodies receive operands in the compute dtype (fp32 for fp16/bf16/fp32; the integer type for
integer ops), so fp16/bf16 inputs are computed in fp32 like ATen's opmath.
"""
import torch
import triton
import triton.language as tl

from ...codegen import pointwise
from ...codegen.tlmath import fma_f, int_div0, trunc
from ...registry import FLOATS, INTS

NUMERIC = FLOATS + INTS


@triton.jit
def add_f(a, b, alpha):
    """self + alpha * other

    Floats as one fused multiply-add, as ATen computes it on both devices (its CPU kernel's fmadd,
    CUDA's contraction): the product is not rounded on its own, so a product past the dtype's range
    plus an infinity of the same sign is that infinity, and inf - inf never appears."""
    if a.dtype.is_floating():
        # casts: foreach kernels pass alpha, and a scalar other, as Python numbers
        return fma_f(tl.cast(alpha, a.dtype), tl.cast(b, a.dtype), a)
    else:
        return a + alpha * b


@triton.jit
def sub_f(a, b, alpha):
    """self - alpha * other

    ATen's self + (-alpha) * other, fused for floats (add_f)."""
    if a.dtype.is_floating():
        # not -alpha: Triton's -x is 0 - x (+0.0 for alpha = 0); casts as in add_f
        return fma_f(tl.cast(alpha * -1.0, a.dtype), tl.cast(b, a.dtype), a)
    else:
        return a - alpha * b


@triton.jit
def _rsub(a, b, alpha):
    """other - alpha * self

    ATen's sub(other, self, alpha), fused for floats (add_f)."""
    if a.dtype.is_floating():
        return fma_f(tl.cast(alpha * -1.0, a.dtype), a, tl.cast(b, a.dtype))
    else:
        return b - alpha * a


@triton.jit
def mul_f(a, b):
    """self * other"""
    return a * b


@triton.jit
def neg_f(a):
    """-self (floats: times -1, since Triton compiles -x as 0 - x, which gives +0.0 for +0.0)"""
    if a.dtype.is_floating():
        return a * -1.0
    else:
        return -a


@triton.jit
def div_f(a, b, MODE: tl.constexpr):
    """self / other; rounding_mode trunc/floor like ATen (integers: C division fixed up by the
    remainder's sign, independent of how the backend rounds; floats: ATen's fmod-based floor)."""
    if MODE == "none":
        return tl.math.div_rn(a, b)
    elif a.dtype.is_floating():
        if MODE == "trunc":
            return trunc(tl.math.div_rn(a, b))
        else:
            mod = a % b                      # fmod (sign of a) on the GPU and in the interpreter
            d = (a - mod) / b
            d = tl.where((mod != 0) & ((b < 0) != (mod < 0)), d - 1.0, d)
            fl = tl.floor(d)
            fl = tl.where(d - fl > 0.5, fl + 1.0, fl)
            fl = tl.where(d == 0, 0.0 * (a / b), fl)
            return tl.where(b == 0, a / b, fl)
    else:
        # a zero divisor is replaced (division by zero is undefined behaviour: the compiler may drop
        # the `b == 0` select below); ATen CUDA's answer for it (its CPU kernels raise: see divisor=)
        bs = tl.where(b == 0, b + 1, b)
        q = a // bs
        r = a - q * bs
        if MODE == "trunc":
            q = tl.where((r != 0) & ((r < 0) != (a < 0)), q + 1, q)
        else:
            q = tl.where((r != 0) & ((r < 0) != (b < 0)), q - 1, q)
        return tl.where(b == 0, int_div0(a, MODE == "floor"), q)


def _alpha_kind(self, other, *args, **kwargs):
    """ATen's alpha_check (add, sub, rsub): "Boolean alpha only supported for Boolean results." and
    "For integral input tensors, argument alpha must not be a floating point number." -- it raises,
    so such calls go to ATen. Decided by classes, which a plan's signature keys."""
    alpha = kwargs["alpha"] if "alpha" in kwargs else args[0] if args else 1
    if isinstance(alpha, (bool, float)):
        dt = torch.result_type(self, other)
        if isinstance(alpha, bool) and dt != torch.bool:
            return "bool alpha with non-bool tensors"
        if isinstance(alpha, float) and not (dt.is_floating_point or dt.is_complex):
            return "float alpha with integer tensors"
    return None


def _no_bool_sub(self, other, *args, **kwargs):
    # ATen rejects `-` with a bool operand (tensor or Python bool) with a RuntimeError: let it raise
    for a in (self, other):
        if a.__class__ is bool or (isinstance(a, torch.Tensor) and a.dtype == torch.bool):
            return "bool operand of sub"
    return _alpha_kind(self, other, *args, **kwargs)


add = pointwise("add.Tensor", "add.Scalar", "add.out", "add.Scalar_out", "add_.Tensor", "add_.Scalar",
                body=add_f, promotion="default", scalars=("alpha",), dtypes=NUMERIC, check=_alpha_kind)
sub = pointwise("sub.Tensor", "sub.Scalar", "sub.out", "sub.Scalar_out", "sub_.Tensor", "sub_.Scalar",
                body=sub_f, promotion="default", scalars=("alpha",), dtypes=NUMERIC, check=_no_bool_sub)
rsub = pointwise("rsub.Tensor", "rsub.Scalar", "rsub.Tensor_out", "rsub.Scalar_out",
                 body=_rsub, promotion="default", scalars=("alpha",), dtypes=NUMERIC, check=_no_bool_sub,
                 iter_order=("other", "self"))   # ATen's rsub is sub(other, self)
# mul and div: ATen's CPU kernels read a 0-dim `other` beside fp16/bf16 tensors at fp32, unrounded
mul = pointwise("mul.Tensor", "mul.Scalar", "mul.out", "mul.Scalar_out", "mul_.Tensor", "mul_.Scalar",
                body=mul_f, promotion="default", dtypes=NUMERIC, cpu_exact_scalar="other")
div = pointwise("div.Tensor", "div.Scalar", "div.out", "div.Scalar_out", "div_.Tensor", "div_.Scalar",
                body=div_f, promotion="int_to_float", constexprs=("rounding_mode",),
                defaults={"rounding_mode": None}, dtypes=NUMERIC, cpu_exact_scalar="other")
div_mode = pointwise("div.Tensor_mode", "div.Scalar_mode", "div.out_mode", "div.Scalar_mode_out",
                     "div_.Tensor_mode", "div_.Scalar_mode",
                     body=div_f, promotion=lambda mode: "int_to_float" if mode is None else "default",
                     constexprs={"rounding_mode": (None, "trunc", "floor")}, dtypes=NUMERIC, divisor="other",
                     cpu_exact_scalar="other")
neg = pointwise("neg", "neg.out", "neg_", body=neg_f, operands=("self",), dtypes=NUMERIC)
