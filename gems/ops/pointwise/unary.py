"""Unary math pointwise ops (abs, sign, reciprocal, exp/exp2/expm1, logs, sqrt/rsqrt, trig and hyperbolic,
sigmoid, erf family, rounding, isnan, logical_not, bitwise_not, nan_to_num), declared through gems.codegen.

Each declaration serves the ATen overloads that have a backend kernel (CompositeExplicit ones such as
abs.default or logical_not.default reach their `.out` overload, which Gems serves). Bodies get fp32 for
fp16/bf16/fp32 (opmath) and for integer inputs of int_to_float ops (ATen promotes them to the default
float dtype), and return fp32; the store rounds once.

The interpreter has no libdevice, so everything beyond tl core math (exp, exp2, log, log2, sin, cos,
sqrt, rsqrt, erf, floor, ceil) is written here with core math only: range-reduced polynomials and
cancellation-free forms, each within a few fp32 ulp of the float64 reference over the whole range.
"""
import math

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ...codegen import pointwise
from ...codegen.tlmath import GPU, exp_f, sigmoid, subnormal32, tanh, trunc
from ...registry import FLOATS, INTS, Unsupported, register

NUMERIC = FLOATS + INTS
ALL_IN = FLOATS + INTS + (torch.bool,)     # int_to_float ops accept ints and bool like ATen

_LN2 = tl.constexpr(0.6931471805599453)
_INV_LN10 = tl.constexpr(0.4342944819032518)
_PI_2 = tl.constexpr(1.5707963267948966)
_PI_4 = tl.constexpr(0.7853981633974483)
_TAN_PI_8 = tl.constexpr(0.41421356237309503)


# --------------------------------------------------------------------------------------------
# scalar helpers (fp32 in, fp32 out), also used by activation.py
# --------------------------------------------------------------------------------------------

@triton.jit
def expm1_f(x):
    """exp(x) - 1. On the GPU libdevice's expm1 (within 1 ulp, like ATen's expm1f; tl.exp's ex2.approx
    of x * log2(e) is off by up to ~25 ulp for x near 80). In the interpreter: Taylor series to x^9 for
    |x| < 0.5 (no cancellation; next term < 3e-10 relative), numpy's exp(x) - 1 above (the subtraction
    loses < 1 bit there)."""
    if GPU:
        # libdevice is linked with flush-to-zero on (Triton's NVVM reflect setting), so it returns 0 for
        # a subnormal x; below FLT_MIN expm1(x) rounds to x in fp32 and fp64 alike
        r = tl.where(tl.abs(x) < 1.1754943508222875e-38, x, libdevice.expm1(x))
    else:
        small = x * (1.0 + x * (0.5 + x * (1.0 / 6.0 + x * (1.0 / 24.0 + x * (1.0 / 120.0 + x * (
            1.0 / 720.0 + x * (1.0 / 5040.0 + x * (1.0 / 40320.0 + x * (1.0 / 362880.0)))))))))
        r = tl.where(tl.abs(x) < 0.5, small, tl.exp(x) - 1.0)
    return r


@triton.jit
def log1p_f(x):
    """log(1 + x) with u = 1 + x: log(u) * x / (u - 1) cancels u's rounding error (Goldberg);
    u == 1 -> x (also keeps -0.0), u == inf -> inf."""
    u = 1.0 + x
    d = u - 1.0
    r = tl.log(u) * (x / tl.where(d == 0, 1.0, d))
    r = tl.where(d == 0, x, r)
    return tl.where(u == float("inf"), u, r)


@triton.jit
def atan_f(x):
    """atan: |x| > 1 -> pi/2 - atan(1/|x|); > tan(pi/8) -> pi/4 + atan((t-1)/(t+1)); then the odd
    Taylor series to t^17 on |t| <= tan(pi/8) (next term < 2e-8 relative). inf -> pi/2."""
    ax = tl.abs(x)
    inv = ax > 1.0
    t = tl.where(inv, 1.0 / ax, ax)
    mid = t > _TAN_PI_8
    t = tl.where(mid, (t - 1.0) / (t + 1.0), t)
    t2 = t * t
    p = t * (1.0 + t2 * (-1.0 / 3.0 + t2 * (1.0 / 5.0 + t2 * (-1.0 / 7.0 + t2 * (1.0 / 9.0 + t2 * (
        -1.0 / 11.0 + t2 * (1.0 / 13.0 + t2 * (-1.0 / 15.0 + t2 * (1.0 / 17.0)))))))))
    p = tl.where(mid, _PI_4 + p, p)
    p = tl.where(inv, _PI_2 - p, p)
    return tl.where(x < 0, -p, tl.where(x == 0, x, p))     # atan(-0) = -0


@triton.jit
def erfc_f(x):
    """erfc: 1 - erf(x) where that loses nothing (x < 0.5); above, the Chebyshev-fitted form
    t * exp(-x^2 + P(t)), t = 1 / (1 + x/2) (fractional error < 1.2e-7 for x >= 0)."""
    ax = tl.abs(x)
    t = 1.0 / (1.0 + 0.5 * ax)
    p = -1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (-0.18628806 + t * (
        0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277))))))))
    tail = t * tl.exp(-ax * ax + p)
    big = tl.where(x < 0, 2.0 - tail, tail)
    return tl.where(tl.abs(x) < 0.5, 1.0 - tl.erf(x), big)


@triton.jit
def erfinv_f(x):
    """erfinv: Giles' single-precision polynomial in w = -log((1-x)(1+x)), then one Newton step on
    erf(y) = x (f' = 2/sqrt(pi) exp(-y^2)) to reach fp32 accuracy. |x| == 1 -> +-inf, |x| > 1 -> NaN."""
    w = -tl.log((1.0 - x) * (1.0 + x))
    wa = w - 2.5
    pa = 2.81022636e-08
    pa = 3.43273939e-07 + pa * wa
    pa = -3.5233877e-06 + pa * wa
    pa = -4.39150654e-06 + pa * wa
    pa = 0.00021858087 + pa * wa
    pa = -0.00125372503 + pa * wa
    pa = -0.00417768164 + pa * wa
    pa = 0.246640727 + pa * wa
    pa = 1.50140941 + pa * wa
    wb = tl.sqrt(tl.maximum(w, 5.0, propagate_nan=tl.PropagateNan.ALL)) - 3.0
    pb = -0.000200214257
    pb = 0.000100950558 + pb * wb
    pb = 0.00134934322 + pb * wb
    pb = -0.00367342844 + pb * wb
    pb = 0.00573950773 + pb * wb
    pb = -0.0076224613 + pb * wb
    pb = 0.00943887047 + pb * wb
    pb = 1.00167406 + pb * wb
    pb = 2.83297682 + pb * wb
    y = tl.where(w < 5.0, pa, pb) * x
    # Newton: y -= (erf(y) - x) / (2/sqrt(pi) * exp(-y^2)); skipped where the derivative underflows
    dy = tl.exp(-y * y) * 1.1283791670955126
    ok = (dy > 1e-30) & (tl.abs(x) < 1.0)
    y = tl.where(ok, y - (tl.erf(y) - x) / tl.where(ok, dy, 1.0), y)
    ax = tl.abs(x)
    y = tl.where(ax == 1.0, x * float("inf"), y)
    return tl.where(ax > 1.0, float("nan"), y)


@triton.jit
def rint_f(x):
    """round half to even: f = floor(x), d = x - f is exact for |x| < 2^23 (and |x| >= 2^23 is
    already an integer); a zero result keeps x's sign like rint."""
    f = tl.floor(x)
    d = x - f
    even = (f - 2.0 * tl.floor(f * 0.5)) == 0
    r = tl.where(d > 0.5, f + 1.0, tl.where(d < 0.5, f, tl.where(even, f, f + 1.0)))
    r = tl.where(r == 0, x * 0.0, r)
    return tl.where(tl.abs(x) >= 8388608.0, x, r)


# --------------------------------------------------------------------------------------------
# op bodies
# --------------------------------------------------------------------------------------------

@triton.jit
def _abs(x):
    """|self|"""
    return tl.abs(x)


@triton.jit
def _sign(x):
    """(self > 0) - (self < 0); bool: self; NaN -> 0 like ATen"""
    if x.dtype == tl.int1:
        return x
    else:
        return (x > 0).to(x.dtype) - (x < 0).to(x.dtype)


@triton.jit
def reciprocal_f(x):
    """1 / self (IEEE division: ATen's reciprocal is correctly rounded)"""
    return tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), x)


@triton.jit
def _exp(x):
    """exp(self)"""
    return exp_f(x)


@triton.jit
def _exp2(x):
    """2 ** self"""
    return tl.exp2(x)


@triton.jit
def _expm1(x):
    """exp(self) - 1"""
    return expm1_f(x)


@triton.jit
def _log(x):
    """log(self)"""
    return tl.log(x)


@triton.jit
def _log1p(x):
    """log(1 + self)"""
    return log1p_f(x)


@triton.jit
def _log2(x):
    """log2(self)"""
    return tl.log2(x)


@triton.jit
def _log10(x):
    """log(self) / log(10)"""
    return tl.log(x) * _INV_LN10


@triton.jit
def sqrt_f(x):
    """sqrt(self), correctly rounded like ATen"""
    return tl.sqrt_rn(x)


# 2^74.5: a subnormal x = m * 2^-149 (m its 23-bit mantissa) has rsqrt(x) = rsqrt(m) * 2^74.5
_RSQRT_SUB = tl.constexpr(2.671373890628154e22)


@triton.jit
def _rsqrt(x):
    """1 / sqrt(self); fp32 subnormals through their mantissa (the GPU would flush them: inf)"""
    y = tl.rsqrt(x)
    if x.dtype == tl.float32:
        sub, neg = subnormal32(x)
        m = (x.to(tl.int32, bitcast=True) & 0x007FFFFF).to(tl.float32)
        y = tl.where(sub, tl.where(neg, float("nan"), tl.rsqrt(m) * _RSQRT_SUB), y)
    return y


@triton.jit
def _sin(x):
    """sin(self); sin(x) = x for fp32 subnormals (the GPU would flush them to 0)"""
    y = tl.sin(x)
    if x.dtype == tl.float32:
        sub, _neg = subnormal32(x)
        y = tl.where(sub, x, y)
    return y


@triton.jit
def _cos(x):
    """cos(self)"""
    return tl.cos(x)


@triton.jit
def _tan(x):
    """sin(self) / cos(self); tan(x) = x for fp32 subnormals (the GPU would flush them to 0)"""
    y = tl.math.div_rn(tl.sin(x), tl.cos(x))
    if x.dtype == tl.float32:
        sub, _neg = subnormal32(x)
        y = tl.where(sub, x, y)
    return y


@triton.jit
def _tanh(x):
    """tanh(self)"""
    return tanh(x)


@triton.jit
def _asin(x):
    """asin = atan(x / sqrt((1 - x)(1 + x))) (|x| == 1 -> +-pi/2, |x| > 1 -> NaN)"""
    return atan_f(x / tl.sqrt_rn((1.0 - x) * (1.0 + x)))


@triton.jit
def _acos(x):
    """acos = 2 atan(sqrt((1 - x) / (1 + x))): no cancellation near x = 1"""
    return 2.0 * atan_f(tl.sqrt_rn((1.0 - x) / (1.0 + x)))


@triton.jit
def _atan(x):
    """atan(self)"""
    return atan_f(x)


@triton.jit
def _sinh(x):
    """sinh: odd Taylor series to x^9 for |x| < 0.5; t - 1/(4t) with t = exp(|x| - ln2) = e^|x|/2
    above (finite up to sinh's own overflow at 89.4)"""
    ax = tl.abs(x)
    x2 = x * x
    small = x * (1.0 + x2 * (1.0 / 6.0 + x2 * (1.0 / 120.0 + x2 * (1.0 / 5040.0 + x2 * (1.0 / 362880.0)))))
    t = tl.exp(ax - _LN2)
    big = t - 0.25 / t
    big = tl.where(x < 0, -big, big)
    return tl.where(ax < 0.5, small, big)


@triton.jit
def _cosh(x):
    """cosh = t + 1/(4t), t = exp(|x| - ln2) = e^|x|/2"""
    t = tl.exp(tl.abs(x) - _LN2)
    return t + 0.25 / t


@triton.jit
def _sigmoid(x):
    """1 / (1 + exp(-self))"""
    return sigmoid(x)


@triton.jit
def _erf(x):
    """erf(self)"""
    return tl.erf(x)


@triton.jit
def erfc_accurate(x):
    """1 - erf(self): libdevice's erfc on the GPU (the fitted tail is 1.2e-7 absolute, ATen's erfcf
    keeps relative accuracy down to 1e-38); the fitted form in the interpreter"""
    if GPU:
        return libdevice.erfc(x)
    else:
        return erfc_f(x)


@triton.jit
def _erfinv(x):
    """erf^-1(self)"""
    return erfinv_f(x)


@triton.jit
def _floor(x):
    """floor(self); integers: self. fp32 subnormals: -1 below zero, +0 above (the GPU would flush)"""
    if x.dtype.is_floating():
        y = tl.floor(x)
        if x.dtype == tl.float32:
            sub, neg = subnormal32(x)
            # a flushed positive subnormal floors to +0 as it should; a negative one to -0, not -1
            y = tl.where(sub & neg, -1.0, y)
        return y
    else:
        return x


@triton.jit
def _ceil(x):
    """ceil(self); integers: self. fp32 subnormals: 1 above zero, -0 below (the GPU would flush)"""
    if x.dtype.is_floating():
        y = tl.ceil(x)
        if x.dtype == tl.float32:
            sub, neg = subnormal32(x)
            # a flushed negative subnormal ceils to -0 as it should; a positive one to +0, not 1
            y = tl.where(sub & ~neg, 1.0, y)
        return y
    else:
        return x


@triton.jit
def _round(x):
    """round half to even; integers: self"""
    if x.dtype.is_floating():
        return rint_f(x)
    else:
        return x


@triton.jit
def _round_dec(x, DECIMALS: tl.constexpr):
    """ATen's round.decimals: d >= 0: rint(x * 10^d) / 10^d; d < 0: rint(x / 10^-d) * 10^-d"""
    if DECIMALS >= 0:
        p = 10.0 ** DECIMALS
        return tl.math.div_rn(rint_f(x * p), tl.full(x.shape, p, tl.float32))
    else:
        p = 10.0 ** (-DECIMALS)
        return rint_f(tl.math.div_rn(x, tl.full(x.shape, p, tl.float32))) * p


@triton.jit
def _trunc(x):
    """trunc(self); integers: self"""
    if x.dtype.is_floating():
        return trunc(x)
    else:
        return x


@triton.jit
def _frac(x):
    """self - trunc(self)"""
    return x - trunc(x)


@triton.jit
def _isnan(x):
    """self != self"""
    return x != x


@triton.jit
def _logical_not(x):
    """self == 0"""
    return x == 0


@triton.jit
def _bitwise_not(x):
    """~self (bool: not self); uint8: self ^ 0xFF (the interpreter cannot build ~'s -1 mask for unsigned)"""
    if x.dtype == tl.int1:
        return x == 0
    elif x.dtype == tl.uint8:
        return x ^ 255
    else:
        return -1 - x      # == ~x in two's complement, wraps like ~ at the type's minimum


@triton.jit
def _nan_to_num(x, nan, posinf, neginf):
    """NaN -> nan, +inf -> posinf, -inf -> neginf"""
    r = tl.where(x != x, nan, x)
    r = tl.where(x == float("inf"), posinf, r)
    return tl.where(x == -float("inf"), neginf, r)


def _unary(name, body, promotion="int_to_float", dtypes=ALL_IN, variants=("", ".out", "_")):
    names = [name + v if v != "_" else name + "_" for v in variants]
    return pointwise(*names, body=body, operands=("self",), promotion=promotion, dtypes=dtypes)


# abs.default / abs_ are CompositeExplicit (they call abs.out)
abs_op = _unary("abs", _abs, "default", NUMERIC, variants=(".out",))
sign = _unary("sign", _sign, "default", ALL_IN)
reciprocal = _unary("reciprocal", reciprocal_f)
exp = pointwise("exp", "exp.out", "exp_", body=_exp, operands=("self",), promotion="int_to_float",
                dtypes=FLOATS + INTS + (torch.bool,))
exp2 = _unary("exp2", _exp2)
expm1 = _unary("expm1", _expm1)
log = _unary("log", _log)
log1p = _unary("log1p", _log1p)
log2 = _unary("log2", _log2)
log10 = _unary("log10", _log10)
sqrt = _unary("sqrt", sqrt_f)
rsqrt = _unary("rsqrt", _rsqrt)
sin = _unary("sin", _sin)
cos = _unary("cos", _cos)
tan = _unary("tan", _tan)
tanh_ = _unary("tanh", _tanh)
asin = _unary("asin", _asin)
acos = _unary("acos", _acos)
atan = _unary("atan", _atan)
sinh = _unary("sinh", _sinh)
cosh = _unary("cosh", _cosh)
sigmoid_ = _unary("sigmoid", _sigmoid)
erf = _unary("erf", _erf)
erfc = _unary("erfc", erfc_accurate)
erfinv = _unary("erfinv", _erfinv)
floor = _unary("floor", _floor, "default", NUMERIC)
ceil = _unary("ceil", _ceil, "default", NUMERIC)
round_op = _unary("round", _round, "default", NUMERIC)
# decimals is a compile-time constant: one kernel per distinct value (models use one or two)
def _round_dec_check(self, *args, **kwargs):
    # ATen's CUDA kernel computes x * 10^d in fp16/bf16 (x * 1000 overflows to inf past 65.5 in fp16,
    # and 10^d itself is rounded to the dtype); its CPU kernel, which the body follows, in fp32
    if self.device.type == "cuda" and self.dtype in (torch.float16, torch.bfloat16):
        return "16-bit round(decimals) on CUDA (ATen computes x * 10^d in the 16-bit dtype)"
    return None


round_decimals = pointwise("round.decimals", "round.decimals_out", "round_.decimals", body=_round_dec,
                           operands=("self",), constexprs=("decimals",), dtypes=FLOATS, check=_round_dec_check)
trunc_ = _unary("trunc", _trunc, "default", NUMERIC)
frac = _unary("frac", _frac, "default", FLOATS)
# isnan.out, isinf, isfinite are CompositeExplicit/Implicit: only isnan.default has a backend kernel
isnan = _unary("isnan", _isnan, "always_bool", ALL_IN, variants=("",))
# logical_not.default / logical_not_ are CompositeExplicit (they call logical_not.out)
logical_not = _unary("logical_not", _logical_not, "always_bool", ALL_IN, variants=(".out",))
bitwise_not = _unary("bitwise_not", _bitwise_not, "default", INTS + (torch.bool,))

# nan_to_num's replacement values are `float?` (None -> 0 / the output dtype's max / min): the
# registered wrapper fills them in and runs the general path with them as runtime scalars.
nan_to_num_op = pointwise(body=_nan_to_num, operands=("self",), scalars=("nan", "posinf", "neginf"),
                          promotion="default", dtypes=FLOATS)


@register("nan_to_num.out", category="pointwise", dtypes=FLOATS)
def nan_to_num_out(self, nan=None, posinf=None, neginf=None, *, out):
    """NaN / +inf / -inf -> nan (0) / posinf (dtype max) / neginf (dtype min)"""
    if out.dtype not in FLOATS:
        raise Unsupported(f"out dtype {out.dtype}")
    fi = torch.finfo(out.dtype)
    vals = (0.0 if nan is None else float(nan), fi.max if posinf is None else float(posinf),
            fi.min if neginf is None else float(neginf))
    return nan_to_num_op(self, scalars=vals, out=out)
