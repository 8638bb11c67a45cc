"""Ternary / select pointwise ops: where, masked_fill, clamp (Scalar and Tensor bounds, clamp_min,
clamp_max), lerp, addcmul, addcdiv — declared through gems.codegen.

where's backward stays whole: autograd composes it from where/zeros, which go through here again.
"""
import functools
import math

import torch
import triton
import triton.language as tl

from ...codegen import pointwise
from ...codegen.generator import number_misfit
from ...codegen.tlmath import GPU, clamp_f, fma_f
from ...registry import FLOATS, INTS, register

NUMERIC = FLOATS + INTS
ALL = FLOATS + INTS + (torch.bool,)
_BOOL = (torch.bool,)


@triton.jit
def _where(c, a, b):
    """condition ? self : other"""
    return tl.where(c, a, b)


@triton.jit
def _masked_fill(a, m, v):
    """mask ? value : self (value cast to self's dtype)"""
    return tl.where(m, v.to(a.dtype), a)


@triton.jit
def _clamp_min(a, lo):
    """max(self, min); a NaN self or bound gives NaN"""
    # nested where, not `|`: a scalar bound's bool cannot be or-ed with a block in the interpreter
    return tl.where(lo != lo, lo, tl.where(a < lo, lo, a))


@triton.jit
def _clamp_max(a, hi):
    """min(self, max); a NaN self or bound gives NaN"""
    return tl.where(hi != hi, hi, tl.where(a > hi, hi, a))


@triton.jit
def _clamp(a, lo, hi):
    """min(max(self, min), max) (max wins when min > max, like ATen)"""
    return clamp_f(a, lo, hi)


@triton.jit
def lerp_f(a, b, w):
    """self + w (end - self), evaluated from the nearer end like ATen (exact at w = 0 and w = 1)

    CUDA: end - (end - self) * (1 - w) for |w| >= 0.5. CPU (ATen's vector path, fused):
    fma(w - 1, end - self, end), whose zero keeps end's sign (lerp(0, -0.0, 1) is -0.0 there)."""
    d = b - a
    small = tl.abs(w) < 0.5
    if GPU:
        return tl.where(small, a + w * d, b - d * (1.0 - w))
    else:
        return fma_f(tl.where(small, w, w - 1.0), d, tl.where(small, a, b))


@triton.jit
def addcmul_f(a, t1, t2, value):
    """self + value * tensor1 * tensor2

    In ATen's order on each device (also _foreach_addcmul's body: ATen's foreach kernels share it).
    Floats fused like ATen. The CPU's kernel (compiled with fp contraction) multiplies value by
    tensor1 first: fma(value * tensor1, tensor2, self). CUDA's multiplies the tensors first:
    fma(tensor1, tensor2, self) for value 1, else fma(value, tensor1 * tensor2, self). Near the fp32
    limit one order overflows where the other does not; an overflowing product next to an infinite
    self gives that infinity, not NaN."""
    if a.dtype.is_floating():
        if GPU:
            return tl.where(value == 1, fma_f(t1, t2, a), fma_f(value, t1 * t2, a))
        else:
            return fma_f(value * t1, t2, a)
    else:
        return a + value * t1 * t2


@triton.jit
def addcdiv_f(a, t1, t2, value):
    """self + value * tensor1 / tensor2, in ATen's order on each device (the CPU multiplies first)

    Also _foreach_addcdiv's body (ATen's foreach kernels share its order).
    CUDA's kernel divides first, self + value * (tensor1 / tensor2); the CPU's multiplies first,
    self + (value * tensor1) / tensor2: near the fp32 limit one overflows where the other does not.
    The division is IEEE-rounded as ATen's (Triton's `/` is the GPU's approximate division, which
    differs where the quotient overflows or underflows)."""
    if GPU:
        return a + value * tl.math.div_rn(t1, t2)
    else:
        return a + tl.math.div_rn(value * t1, t2)


where = pointwise("where.self", "where.self_out", body=_where, operands=("condition", "self", "other"),
                  promote=("self", "other"), operand_dtypes={"condition": _BOOL}, dtypes=ALL)


def _value_0dim(self, mask, value, *a, **k):
    # ATen requires a 0-dim value (raises otherwise): let it
    if value.dim() != 0:
        return "value is not 0-dim"
    return _value_may_overflow(value.dtype, self.dtype)


@functools.lru_cache(maxsize=None)
def _value_may_overflow(value_dtype, dtype):
    """ATen reads masked_fill's value tensor as a Scalar and converts it with c10's overflow check
    (int8 self, value 300: "value cannot be converted to type int8_t without overflow"); the kernel
    would wrap it. Where some value of `value_dtype` overflows `dtype` by that rule (number_misfit at
    the dtype's extremes), the call goes to ATen: decided by dtypes, which are part of a plan's
    signature, with no read of the value."""
    if value_dtype.is_floating_point:
        info = torch.finfo(value_dtype)
        extremes = (info.min, info.max, math.nan)
    elif value_dtype == torch.bool:
        return None
    else:
        info = torch.iinfo(value_dtype)
        extremes = (info.min, info.max)
    if any(number_misfit(v, dtype) is not None for v in extremes):
        return f"a {value_dtype} value may not fit {dtype} (ATen raises where it does not)"
    return None


# ATen's masked_fill clones self as contiguous, then fills that in place
masked_fill = pointwise("masked_fill.Scalar", "masked_fill.Scalar_out", "masked_fill_.Scalar", body=_masked_fill,
                        operands=("self", "mask"), scalars=("value",), promote=("self",),
                        operand_dtypes={"mask": _BOOL}, dtypes=ALL,
                        result_layouts={"masked_fill.Scalar": "contiguous", "masked_fill.Scalar_out": "contiguous"})
masked_fill_tensor = pointwise("masked_fill.Tensor", "masked_fill.Tensor_out", "masked_fill_.Tensor",
                               body=_masked_fill, operands=("self", "mask", "value"), promote=("self",),
                               operand_dtypes={"mask": _BOOL, "value": ALL}, dtypes=ALL, check=_value_0dim,
                               result_layouts={"masked_fill.Tensor": "contiguous",
                                               "masked_fill.Tensor_out": "contiguous"})


def _bounds_like_aten(self, *bounds, **k):
    """bool self goes to ATen; so, on CUDA, does an integer tensor bound of a type wider than an integer
    self (or of other signedness): ATen's CUDA kernel clamps the in-place uint8 3 with the int16 bound -5
    to 3 (the bound read as uint8), its CPU kernel to 251 (the min taken in int16), and Gems computes the
    CPU's answer."""
    if self.dtype == torch.bool:
        return "bool self"
    if self.device.type == "cuda" and not self.is_floating_point():
        for b in bounds:
            if (isinstance(b, torch.Tensor) and not b.is_floating_point() and b.dtype != self.dtype
                    and torch.promote_types(self.dtype, b.dtype) != self.dtype):
                return f"a {b.dtype} bound for a {self.dtype} tensor on CUDA"
    return None


clamp_min = pointwise("clamp_min", "clamp_min.out", "clamp_min_", "clamp_min.Tensor", "clamp_min.Tensor_out",
                      "clamp_min_.Tensor", body=_clamp_min, operands=("self", "min"), dtypes=NUMERIC,
                      check=_bounds_like_aten, number_operands=False)
clamp_max = pointwise("clamp_max", "clamp_max.out", "clamp_max_", "clamp_max.Tensor", "clamp_max.Tensor_out",
                      "clamp_max_.Tensor", body=_clamp_max, operands=("self", "max"), dtypes=NUMERIC,
                      check=_bounds_like_aten, number_operands=False)

# clamp's bounds are optional: the two-bound body is generated without registering its overloads;
# the registered clamp variants below pick clamp_min / clamp_max / both by which bounds are given.
clamp_both = pointwise(body=_clamp, operands=("self", "min", "max"), dtypes=NUMERIC, number_operands=False)
for _n in ("clamp", "clamp.out", "clamp_", "clamp.Tensor", "clamp.Tensor_out", "clamp_.Tensor"):
    clamp_both.unregistered_overload(_n)


def _pick(variant):
    both = clamp_both.overloads[variant].fn
    lo = clamp_min.overloads[variant.replace("clamp", "clamp_min", 1)].fn
    hi = clamp_max.overloads[variant.replace("clamp", "clamp_max", 1)].fn
    return both, lo, hi


def _clamp_impl(name):
    both, lo_fn, hi_fn = _pick(name)

    def impl(self, min=None, max=None, **kw):
        if min is None and max is None:
            raise RuntimeError("torch.clamp: At least one of 'min' or 'max' must not be None")
        if max is None:
            return lo_fn(self, min, **kw)
        if min is None:
            return hi_fn(self, max, **kw)
        return both(self, min, max, **kw)
    impl.__name__ = name.replace(".", "_")
    impl.__doc__ = "min(max(self, min), max) with optional bounds"
    return impl


def _clamp_check(self, min=None, max=None, *a, **k):
    why = _bounds_like_aten(self, min, max)
    if why:
        return why
    lone = max if min is None else min if max is None else None
    if isinstance(lone, float) and lone != lone:
        # clamp(x, min=nan) alone reaches ATen's clamp_min kernel without clamp_min's NaN fill: CUDA's
        # fmax-like max returns x, the CPU's vector max returns x or NaN by ISA (AVX-512 vs AVX2)
        return "a lone NaN bound (ATen's result depends on the device)"
    return None


for _n in clamp_both.overloads:
    # min/max numbers are per-call kernel arguments (the inner overloads name them the same); their
    # NaN-ness is part of a plan's signature, so _clamp_check sees every NaN bound
    register(_n, category="pointwise", dtypes=NUMERIC, check=_clamp_check, dynamic=("min", "max"))(_clamp_impl(_n))


def _same_dtypes(self, end, weight, *a, **k):
    if end.dtype != self.dtype or (isinstance(weight, torch.Tensor) and weight.dtype != self.dtype):
        return "mixed dtypes (ATen raises)"
    return None


lerp = pointwise("lerp.Scalar", "lerp.Scalar_out", "lerp_.Scalar", body=lerp_f, operands=("self", "end"),
                 scalars=("weight",), check=_same_dtypes)
lerp_tensor = pointwise("lerp.Tensor", "lerp.Tensor_out", "lerp_.Tensor", body=lerp_f,
                        operands=("self", "end", "weight"), check=_same_dtypes)
addcmul = pointwise("addcmul", "addcmul.out", "addcmul_", body=addcmul_f, operands=("self", "tensor1", "tensor2"),
                    scalars=("value",), dtypes=NUMERIC)
addcdiv = pointwise("addcdiv", "addcdiv.out", "addcdiv_", body=addcdiv_f, operands=("self", "tensor1", "tensor2"),
                    scalars=("value",))
