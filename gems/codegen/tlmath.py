"""Scalar math helpers for op bodies that both the GPU and the Triton interpreter can run.

The interpreter has no libdevice, so these are written with tl core math only; where libdevice's
correctly-rounded (or few-ulp) function is what ATen's CUDA kernel computes, bodies branch on `GPU`
at compile time and use it there (`tl.exp` is `ex2.approx` on the GPU: 1.8e-6 relative at x = 88).
"""
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..runtime.backends import interpreting

# decided at import without needing a backend (the registry must import on machines with none,
# e.g. for gems-coverage on the meta device)
GPU: tl.constexpr = tl.constexpr(not interpreting())


@triton.jit
def exp_f(x):
    """exp, within 1 ulp on the GPU (libdevice) like ATen's expf; numpy's exp in the interpreter"""
    if GPU:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def fma_f(a, b, c):
    """a * b + c rounded once, like a fused multiply-add (ATen's CPU kernels are compiled with fp
    contraction: its addcmul and lerp round once). The GPU's tl.fma; the interpreter's tl.fma rounds
    twice (numpy), so there: the exact product in fp64, the fp64 sum rounded to odd (its TwoSum error
    moves an inexact sum off an even last bit), then one rounding to fp32 that equals the fused one."""
    if GPU:
        return tl.fma(a, b, c)
    else:
        p = a.to(tl.float64) * b.to(tl.float64)         # exact: 24 + 24 significant bits
        c64 = c.to(tl.float64)
        s = p + c64
        bb = s - p
        e = (p - (s - bb)) + (c64 - bb)                  # s + e == p + c exactly (s finite)
        bits = s.to(tl.int64, bitcast=True)
        odd = tl.where(e != 0, tl.where(tl.abs(s) < float("inf"), (bits & 1) == 0, False), False)
        step = tl.where((e > 0) == (s > 0), 1, -1)      # away from zero when e has s's sign
        s = tl.where(odd, (bits + step).to(tl.float64, bitcast=True), s)
        return s.to(a.dtype)


# fp32 magnitudes below 2**-102 are where a subnormal can enter or leave fmod (a result is a multiple
# of the smaller operand's ulp): the GPU's fmod takes them scaled by 2**100 (exact)
_FMOD_TINY = tl.constexpr(1.9721522630525295e-31)    # 2**-102
_FMOD_UP = tl.constexpr(1.2676506002282294e+30)      # 2**100
_FMOD_DOWN = tl.constexpr(7.888609052210118e-31)     # 2**-100


@triton.jit
def clamp_f(a, lo, hi):
    """min(max(a, lo), hi) as ATen's clamp (and hardtanh, which is clamp): a NaN a or bound gives NaN,
    and hi wins where lo > hi"""
    # nested where, not `|`: a scalar bound's bool cannot be or-ed with a block in the interpreter
    r = tl.where(lo != lo, lo, tl.where(a < lo, lo, a))
    return tl.where(hi != hi, hi, tl.where(r > hi, hi, r))


@triton.jit
def fmod_f(a, b):
    """C fmod (sign of the dividend) for floats, C remainder for integers. On the GPU Triton's
    float `%` is not fmod at the edges (inf % inf gives inf, -0.0 % 5 gives +0.0): libdevice's is,
    but it flushes fp32 subnormals (operands and result: fmod(1e-40, 1) gives 0, ATen 1e-40), so fp32
    operands below 2**-102 take it scaled: |a| < 2**-102 <= |b| gives a itself; a divisor below 2**-102
    gives fmod(fmod(a, c) * 2**100, c) * 2**-100 with c = b * 2**100 (fmod(a, b) = fmod(fmod(a, c), b)
    since c is a multiple of b; every fmod sees normal numbers, the products are exact). Ordinary
    lanes pay a few selects and a second fmod of (0, 1)."""
    if GPU and a.dtype.is_floating():
        if a.dtype == tl.float32:
            tiny_a = tl.abs(a) < _FMOD_TINY
            tiny_b = tl.abs(b) < _FMOD_TINY
            c = tl.where(tiny_b, b * _FMOD_UP, b)
            r = tl.where(tiny_a, a, libdevice.fmod(a, c))
            x = tl.where(tiny_b, r * _FMOD_UP, 0.0)
            y = tl.where(tiny_b, c, 1.0)
            r = tl.where(tiny_b, libdevice.fmod(x, y) * _FMOD_DOWN, r)
            return tl.where(b != b, b, r)        # fmod(tiny, NaN) is NaN, not the tiny a
        else:
            return libdevice.fmod(a, b)
    else:
        return a % b


@triton.jit
def tanh(x):
    """tanh in fp32: exp form for |x| >= 0.25 (no cancellation there), odd Taylor series below
    (|x|**11 term < 1e-8 relative)."""
    ax = tl.abs(x)
    # propagate_nan: the GPU's min.f32 returns the non-NaN operand (the interpreter's numpy does not)
    e = tl.exp(-2.0 * tl.minimum(ax, 20.0, propagate_nan=tl.PropagateNan.ALL))
    big = (1.0 - e) / (1.0 + e)
    x2 = x * x
    small = ax * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0)))))
    r = tl.where(ax < 0.25, small, big)
    return tl.where(x == 0, x, tl.where(x < 0, -r, r))      # tanh(-0.0) = -0.0


@triton.jit
def sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def trunc(x):
    return tl.where(x < 0, tl.ceil(x), tl.floor(x))


@triton.jit
def int_div0(a, FLOOR: tl.constexpr):
    """ATen's CUDA answer to an integer division or remainder of `a` by zero (its CPU kernels raise):
    the GPU's division routine's, all bits set (-1, 255 for uint8; int8/int16 divide in 32 bits),
    but 0xFFFFFFFF for an int64 `a` in [0, 2**32) (the routine takes a 32-bit unsigned path when
    both operands fit), and one less (-2) for a floor division of a negative `a`. Seen with torch
    2.11 on H100; written out so that the answer does not depend on how Triton's division by zero
    compiles (it differed for int64)."""
    zero = (a * 0).to(tl.int64)
    ones = zero - 1                             # -1, then all bits set in a's type
    if a.dtype == tl.int64:
        low = ((zero + 1) << 32) - 1            # 2**32 - 1, built without a literal past int32
        r = tl.where(a >= 0, tl.where(a <= low, low, ones), ones)
    else:
        r = ones.to(a.dtype)
    if FLOOR:
        r = tl.where(a < 0, r - 1, r)
    return r


@triton.jit
def subnormal32(x):
    """(x is an fp32 subnormal, x's sign bit), read from the bits: Triton compiles fp32 with
    flush-to-zero on the GPU, so compares and arithmetic there see a subnormal as 0 (ATen's kernels
    keep them: floor(-1e-40) is -1, rsqrt(1e-40) is 1e20). Bodies select their exact answer with it."""
    b = x.to(tl.int32, bitcast=True)
    return ((b & 0x7F800000) == 0) & ((b & 0x007FFFFF) != 0), b < 0
