"""Activation / unary math pointwise ops (exp, silu, gelu and their backwards), via gems.codegen.

Bodies get fp32 values for fp16/bf16/fp32 inputs (opmath) and return fp32; the store rounds once.
"""
import torch
import triton
import triton.language as tl

from ..codegen import pointwise
from ..codegen.tlmath import exp_f, sigmoid, tanh
from ..registry import FLOATS, INTS

# module constants read inside @triton.jit bodies must be tl.constexpr: the GPU compiler rejects
# plain globals (the interpreter does not, so tests/core/test_kernel_globals.py checks it on CPU)
_SQRT1_2 = tl.constexpr(0.7071067811865476)
_SQRT_2_PI = tl.constexpr(0.7978845608028654)      # sqrt(2 / pi)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)   # 1 / sqrt(2 pi)
_KAPPA = tl.constexpr(0.044715)
_GELU_MODES = ("none", "tanh")


@triton.jit
def _exp(x):
    """exp(self)"""
    return exp_f(x)


@triton.jit
def _silu(x):
    """self * sigmoid(self)"""
    return x * sigmoid(x)


@triton.jit
def _silu_bwd(g, x):
    """grad * s * (1 + x * (1 - s)),  s = sigmoid(x)"""
    s = sigmoid(x)
    return g * s * (1.0 + x * (1.0 - s))


@triton.jit
def _gelu(x, APPROX: tl.constexpr):
    """none: x/2 * (1 + erf(x/sqrt2));  tanh: x/2 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))"""
    if APPROX == "tanh":
        return 0.5 * x * (1.0 + tanh(_SQRT_2_PI * (x + _KAPPA * x * x * x)))
    else:
        return 0.5 * x * (1.0 + tl.erf(x * _SQRT1_2))


@triton.jit
def _gelu_bwd(g, x, APPROX: tl.constexpr):
    """none: g * (Phi(x) + x * phi(x));
    tanh: g * (0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)), t = tanh(inner)"""
    if APPROX == "tanh":
        x2 = x * x
        t = tanh(_SQRT_2_PI * (x + _KAPPA * x2 * x))
        d = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _SQRT_2_PI * (1.0 + 3.0 * _KAPPA * x2)
        return g * d
    else:
        cdf = 0.5 * (1.0 + tl.erf(x * _SQRT1_2))
        pdf = tl.exp(-0.5 * x * x) * _INV_SQRT_2PI
        return g * (cdf + x * pdf)


exp = pointwise("exp", "exp.out", "exp_", body=_exp, operands=("self",), promotion="int_to_float",
                dtypes=FLOATS + INTS + (torch.bool,))
silu = pointwise("silu", "silu.out", "silu_", body=_silu, operands=("self",))
silu_backward = pointwise("silu_backward", "silu_backward.grad_input", body=_silu_bwd,
                          operands=("grad_output", "self"), backward=True)
gelu = pointwise("gelu", "gelu.out", "gelu_", body=_gelu, operands=("self",),
                 constexprs={"approximate": _GELU_MODES})
gelu_backward = pointwise("gelu_backward", "gelu_backward.grad_input", body=_gelu_bwd,
                          operands=("grad_output", "self"), constexprs={"approximate": _GELU_MODES},
                          backward=True)
