"""Binary pointwise ops: remainder, fmod, pow, maximum/minimum, fmax/fmin, hypot, comparisons,
logical and bitwise ops, shifts — declared through gems.codegen (every ATen overload variant).

Bodies get operands in the compute dtype (fp32 for fp16/bf16/fp32, the promoted integer type for
integers, int1 for bool). isclose is CompositeImplicit in ATen (built from the ops here): not declared.
"""
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ...codegen import pointwise
from ...codegen.tlmath import GPU, fmod_f, int_div0
from ...registry import FLOATS, INTS, restrict_backends
from ...runtime import backend

NUMERIC = FLOATS + INTS
ALL = FLOATS + INTS + (torch.bool,)
BITS = INTS + (torch.bool,)


# ---- division-like ---------------------------------------------------------------------------

@triton.jit
def _remainder(a, b):
    """Python-style remainder: fmod(a, b), moved by b when its sign differs from b's (ATen's rule)."""
    if a.dtype.is_floating():
        m = fmod_f(a, b)                        # sign of a
    else:
        # an integer zero divisor is replaced (a division by zero is undefined behaviour: the compiler
        # may drop the `b == 0` select below); ATen CUDA's answer for it (its CPU raises: see divisor=)
        m = fmod_f(a, tl.where(b == 0, b + 1, b))
    # nested where, not `&`: a scalar operand's bool cannot be and-ed with a block in the interpreter
    r = tl.where(m != 0, tl.where((m < 0) != (b < 0), m + b, m), m)
    if not a.dtype.is_floating():
        r = tl.where(b == 0, int_div0(a, False), r)
    return r


@triton.jit
def _fmod(a, b):
    """C fmod / integer remainder with the sign of the dividend"""
    if a.dtype.is_floating():
        return fmod_f(a, b)
    else:
        # a zero divisor replaced first: division by zero is undefined behaviour (see _remainder)
        return tl.where(b == 0, int_div0(a, False), fmod_f(a, tl.where(b == 0, b + 1, b)))


# ---- pow -------------------------------------------------------------------------------------

@triton.jit
def c_pow_f(a, b):
    """C's pow, which ATen computes for a tensor exponent on both devices (and for a scalar one but
    the special exponents of pow_f)"""
    if GPU:
        r = libdevice.pow(a, b)
        if a.dtype == tl.float32:
            # a subnormal fp32 base: libdevice's powf answered (1e-40) ** -0.455 with 2.5e17 (1.6e18 is
            # right; found by the GPU fuzz): those lanes in float64, where the base is a normal number
            tiny = (tl.abs(a) < 1.1754943508222875e-38) & (a != 0.0)
            r = tl.where(tiny, libdevice.pow(a.to(tl.float64), b.to(tl.float64)).to(tl.float32), r)
        return r
    else:
        # the interpreter: exp2(b * log2|a|) in fp64 (numpy), C pow's special cases by hand
        a64 = a.to(tl.float64)
        b64 = b.to(tl.float64)
        mag = tl.exp2(b64 * tl.log2(tl.abs(a64)))       # +-inf and zero bases too: 0 or inf
        b_int = tl.floor(b64) == b64                     # +-inf count as even integers
        odd = tl.where(b_int, tl.floor(b64 * 0.5) * 2.0 != b64, False)
        neg = tl.where(a64 == 0, 1.0 / a64 < 0, a64 < 0)     # the sign bit: -0.0 and -inf too
        r = tl.where(neg, tl.where(odd, mag * -1.0, mag), mag)     # not -mag: Triton's -x is 0 - x
        # a negative finite base to a finite non-integer power: NaN (-0.0 and -inf give the magnitude)
        r = tl.where(a64 < 0, tl.where(a64 > float("-inf"), tl.where(b_int, r, float("nan")), r), r)
        r = tl.where(a64 == -1, tl.where(tl.abs(b64) == float("inf"), 1.0, r), r)
        r = tl.where(b64 == 0, 1.0, r)
        r = tl.where(a64 == 1, 1.0, r)
        return r.to(a.dtype)


@triton.jit
def pow_f(a, b):
    """self ** exponent (a scalar exponent 2, 3, -2, 0.5, -0.5 or -1 computed like ATen's special cases)

    Those scalar exponents: products (2, 3, -2) and sqrt, 1 / sqrt, reciprocal, whose special values
    differ from pow's ((-inf) ** 0.5 is NaN, not inf). A tensor exponent: C pow for every element
    (ATen's tensor-exponent kernels have no special cases). ATen's CPU kernel skips the sqrt forms for
    fp16 tensors, which a body computing in fp32 cannot tell apart: there fp16 ** number goes to ATen
    (_pow_check). Integers: ATen's powi, wrapping
    like its C++ on overflow."""
    if a.dtype.is_floating():
        if len(b.shape) == 0:
            # a scalar exponent (x.pow(2) in RMSNorm): a uniform branch, so the special cases skip
            # libdevice's pow entirely (it made pow compute-bound: ~100 instructions per element)
            if b == 2.0:
                g = a * a
            elif b == 3.0:
                g = a * a * a
            elif b == 0.5:
                g = tl.sqrt_rn(a)
            elif b == -0.5:
                g = tl.math.div_rn(tl.full(a.shape, 1.0, a.dtype), tl.sqrt_rn(a))
            elif b == -1.0:
                g = tl.math.div_rn(tl.full(a.shape, 1.0, a.dtype), a)
            elif b == -2.0:
                g = tl.math.div_rn(tl.full(a.shape, 1.0, a.dtype), a * a)
            else:
                g = c_pow_f(a, b)
        else:
            g = c_pow_f(a, b)
        return g
    else:
        # integers by squaring over every bit of the exponent: products wrap like ATen's; negative
        # exponents: 1 ** e = 1, (-1) ** e = +-1, else 0 (ATen)
        BITS: tl.constexpr = a.dtype.primitive_bitwidth
        r = tl.full(a.shape, 1, a.dtype) if len(a.shape) else a * 0 + 1
        base = a
        e = b
        for _ in tl.static_range(BITS):
            r = tl.where((e & 1) != 0, r * base, r)
            base = base * base
            e = e >> 1
        neg = b < 0
        r = tl.where(neg, tl.where(a == 1, 1, tl.where(a == -1, tl.where((b & 1) != 0, -1, 1), 0)), r)
        return r


# ---- min / max ------------------------------------------------------------------------------

@triton.jit
def maximum_f(a, b):
    """max(self, other), NaN if either is NaN"""
    if a.dtype.is_floating():
        return tl.where(a != a, a, tl.where(b != b, b, tl.where(a > b, a, b)))
    else:
        return tl.where(a > b, a, b)


@triton.jit
def minimum_f(a, b):
    """min(self, other), NaN if either is NaN"""
    if a.dtype.is_floating():
        return tl.where(a != a, a, tl.where(b != b, b, tl.where(a < b, a, b)))
    else:
        return tl.where(a < b, a, b)


@triton.jit
def _fmax(a, b):
    """max(self, other) ignoring a NaN operand (NaN only when both are)"""
    return tl.where(b != b, a, tl.where(a > b, a, b))


@triton.jit
def _fmin(a, b):
    """min(self, other) ignoring a NaN operand (NaN only when both are)"""
    return tl.where(b != b, a, tl.where(a < b, a, b))


@triton.jit
def _hypot(a, b):
    """sqrt(self^2 + other^2) without overflow: m * sqrt(1 + (n/m)^2), m = max(|a|,|b|); inf wins over NaN"""
    x = tl.abs(a)
    y = tl.abs(b)
    m = tl.maximum(x, y)
    n = tl.minimum(x, y)
    q = tl.where(m == 0, 0.0, n / m)
    r = m * tl.sqrt_rn(1.0 + q * q)
    r = tl.where(x != x, x, tl.where(y != y, y, r))
    return tl.where(x == float("inf"), x, tl.where(y == float("inf"), y, r))


# ---- comparisons, logical, bitwise ----------------------------------------------------------

@triton.jit
def _eq(a, b):
    return a == b


@triton.jit
def _ne(a, b):
    return a != b


@triton.jit
def _lt(a, b):
    return a < b


@triton.jit
def _le(a, b):
    return a <= b


@triton.jit
def _gt(a, b):
    return a > b


@triton.jit
def _ge(a, b):
    return a >= b


@triton.jit
def _logical_and(a, b):
    return (a != 0) & (b != 0)


@triton.jit
def _logical_or(a, b):
    return (a != 0) | (b != 0)


@triton.jit
def _logical_xor(a, b):
    return (a != 0) != (b != 0)


@triton.jit
def _bitwise_and(a, b):
    return a & b


@triton.jit
def _bitwise_or(a, b):
    return a | b


@triton.jit
def _bitwise_xor(a, b):
    return a ^ b


@triton.jit
def _lshift(a, b):
    """self << other; shifts outside [0, bits) give 0 (ATen)"""
    BITS: tl.constexpr = a.dtype.primitive_bitwidth
    ok = tl.where(b >= 0, b < BITS, False)
    return tl.where(ok, a << tl.where(ok, b, 0), 0)


@triton.jit
def _rshift(a, b):
    """self >> other (arithmetic for signed types); shifts outside [0, bits) give the sign fill (ATen)"""
    BITS: tl.constexpr = a.dtype.primitive_bitwidth
    ok = tl.where(b >= 0, b < BITS, False)
    return a >> tl.where(ok, b, BITS - 1) if a.dtype.is_int_signed() else tl.where(ok, a >> tl.where(ok, b, 0), 0)


def _variants(base, *ovs, inplace=(), scalar_out=True):
    return tuple(f"{base}.{o}" for o in ovs) + tuple(f"{base}_.{o}" for o in inplace)


def _no_bool(self, other, *args, **kwargs):
    for a in (self, other):
        if a.__class__ is bool or (isinstance(a, torch.Tensor) and a.dtype == torch.bool):
            return "bool operand"
    return None


def _no_float_number(self, other, *args, **kwargs):
    # ATen's bitwise and shift kernels have no floating dtype: a float number makes the common dtype
    # floating and ATen raises ("not implemented for 'Float'") even for an empty tensor, where Gems'
    # kernel launches nothing and would answer
    if isinstance(self, float) or isinstance(other, float):
        return "float number: ATen has no floating bitwise kernel"
    return None


def _pow_check(self, exponent, *args, **kwargs):
    if isinstance(self, torch.Tensor) and not self.is_floating_point() and exponent.__class__ is int \
            and exponent < 0:
        # pow.Tensor_Scalar's meta function raises "Integers to negative integer powers are not allowed."
        # (the exponent's sign is part of a plan's signature, so a plan never sees this call)
        return "integer tensor to a negative integer power"
    if isinstance(self, torch.Tensor) and self.dtype == torch.float16 and not isinstance(exponent, torch.Tensor) \
            and backend().name == "interpreter":
        # ATen's CPU Half kernel takes C pow for the exponents 0.5 and -0.5 ((-inf) ** 0.5 = inf), where
        # its Float kernel and CUDA take sqrt forms (NaN); the body computes fp16 in fp32 and cannot tell
        # them apart, and a plan keys the exponent by its sign only: every fp16 scalar power goes to ATen
        return "float16 ** number on the CPU (ATen's Half kernel takes C pow for +-0.5)"
    return _no_bool(self, exponent)


# round_numbers: ATen converts a number operand to an fp16/bf16 common dtype first, and the remainder
# of a rounded divisor differs from the exact one by up to the divisor (half(0.1) % 0.1 is 0 in ATen).
# add/sub/rsub convert too, but there the difference is one rounding of the result (mul and div read the
# number unrounded), and with alpha ATen's CPU kernel reads it unrounded: left as they are.
# divisor="other": ATen's CPU kernels raise ZeroDivisionError for an integer zero there (Gems checks
# on the CPU backend and leaves the call to ATen); on CUDA the bodies give ATen's answer
remainder = pointwise(*_variants("remainder", "Tensor", "Scalar", "Scalar_Tensor", "Tensor_out", "Scalar_out",
                                 "Scalar_Tensor_out", inplace=("Tensor", "Scalar")),
                      body=_remainder, dtypes=NUMERIC, check=_no_bool, divisor="other", round_numbers=True)
fmod = pointwise(*_variants("fmod", "Tensor", "Scalar", "Tensor_out", "Scalar_out", inplace=("Tensor", "Scalar")),
                 body=_fmod, dtypes=NUMERIC, check=_no_bool, divisor="other", round_numbers=True)
# pow: floats only (integer pow is served too, but only for integer tensors with integer exponents).
# A number exponent is a Scalar to ATen's kernel (not a 0-dim operand); pow.Scalar's meta function
# allocates a contiguous result.
pow = pointwise(*_variants("pow", "Tensor_Tensor", "Tensor_Scalar", "Scalar", "Tensor_Tensor_out",
                           "Tensor_Scalar_out", "Scalar_out", inplace=("Tensor", "Scalar")),
                operands=("self", "exponent"), body=pow_f, dtypes=NUMERIC, check=_pow_check,
                number_operands=False, result_layouts={"pow.Scalar": "contiguous", "pow.Scalar_out": "contiguous"})
# ATen's CUDA pow.Scalar (`2.0 ** x`) calls pow.Tensor_Tensor with a *CUDA* wrapped-number tensor,
# which the dispatcher cannot hand to any Python kernel (INTERNAL ASSERT in pybind_utils), even one
# that would only pass it on: on CUDA these overloads stay unregistered (Tensor ** Tensor runs ATen).
for _name in ("pow.Tensor_Tensor", "pow.Tensor_Tensor_out", "pow_.Tensor"):
    restrict_backends(_name, ("interpreter",))
maximum = pointwise("maximum", "maximum.out", body=maximum_f, dtypes=ALL)
minimum = pointwise("minimum", "minimum.out", body=minimum_f, dtypes=ALL)
fmax = pointwise("fmax", "fmax.out", body=_fmax, dtypes=NUMERIC)
fmin = pointwise("fmin", "fmin.out", body=_fmin, dtypes=NUMERIC)
hypot = pointwise("hypot", "hypot.out", "hypot_", body=_hypot, dtypes=FLOATS)

_CMP = {}
for _name, _body in (("eq", _eq), ("ne", _ne), ("lt", _lt), ("le", _le), ("gt", _gt), ("ge", _ge)):
    _CMP[_name] = pointwise(*_variants(_name, "Tensor", "Scalar", "Tensor_out", "Scalar_out",
                                       inplace=("Tensor", "Scalar")),
                            body=_body, promotion="always_bool", dtypes=ALL, round_numbers=True)
eq, ne, lt, le, gt, ge = (_CMP[n] for n in ("eq", "ne", "lt", "le", "gt", "ge"))

logical_and = pointwise("logical_and", "logical_and.out", "logical_and_", body=_logical_and,
                        promotion="always_bool", dtypes=ALL)
logical_or = pointwise("logical_or", "logical_or.out", "logical_or_", body=_logical_or,
                       promotion="always_bool", dtypes=ALL)
logical_xor = pointwise("logical_xor", "logical_xor.out", "logical_xor_", body=_logical_xor,
                        promotion="always_bool", dtypes=ALL)

_BIT = {}
for _name, _body in (("bitwise_and", _bitwise_and), ("bitwise_or", _bitwise_or), ("bitwise_xor", _bitwise_xor)):
    _BIT[_name] = pointwise(*_variants(_name, "Tensor", "Scalar", "Scalar_Tensor", "Tensor_out", "Scalar_out",
                                       "Scalar_Tensor_out", inplace=("Tensor", "Scalar")),
                            body=_body, dtypes=BITS, check=_no_float_number)
bitwise_and, bitwise_or, bitwise_xor = _BIT["bitwise_and"], _BIT["bitwise_or"], _BIT["bitwise_xor"]

bitwise_left_shift = pointwise(
    *_variants("bitwise_left_shift", "Tensor", "Tensor_Scalar", "Scalar_Tensor", "Tensor_out", "Tensor_Scalar_out",
               "Scalar_Tensor_out", inplace=("Tensor", "Tensor_Scalar")),
    "__lshift__.Tensor", "__lshift__.Scalar", "__lshift__.Tensor_out", "__lshift__.Scalar_out",
    "__ilshift__.Tensor", "__ilshift__.Scalar", body=_lshift, dtypes=INTS, check=_no_float_number)
bitwise_right_shift = pointwise(
    *_variants("bitwise_right_shift", "Tensor", "Tensor_Scalar", "Scalar_Tensor", "Tensor_out",
               "Tensor_Scalar_out", "Scalar_Tensor_out", inplace=("Tensor", "Tensor_Scalar")),
    "__rshift__.Tensor", "__rshift__.Scalar", "__rshift__.Tensor_out", "__rshift__.Scalar_out",
    "__irshift__.Tensor", "__irshift__.Scalar", body=_rshift, dtypes=INTS, check=_no_float_number)
