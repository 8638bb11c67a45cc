"""Activations and their backward ops (silu, gelu, relu/threshold_backward, sigmoid/tanh backward, softplus,
elu, leaky_relu, hardtanh, hardsigmoid, hardswish, mish, logit), declared through gems.codegen.

Bodies get fp32 values for fp16/bf16/fp32 (opmath) and return fp32; the store rounds once. Branches
follow ATen's CPU/CUDA kernels comparison for comparison (which side of `<=` a tie or a NaN falls on),
so NaN propagation and the value at the kinks match ATen exactly.
"""
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ...codegen import pointwise
from ...codegen.tlmath import GPU, clamp_f, exp_f, sigmoid, tanh
from ...registry import FLOATS, INTS
from ...runtime import backend
from .unary import erfc_accurate, expm1_f, log1p_f


# module constants read inside @triton.jit bodies must be tl.constexpr: the GPU compiler rejects
# plain globals (the interpreter does not, so tests/core/test_kernel_globals.py checks it on CPU)
_SQRT1_2 = tl.constexpr(0.7071067811865476)
_SQRT_2_PI = tl.constexpr(0.7978845608028654)      # sqrt(2 / pi)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)   # 1 / sqrt(2 pi)
_KAPPA = tl.constexpr(0.044715)
_GELU_MODES = ("none", "tanh")


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
def _one_plus_minus_tanh(u):
    """(1 + tanh(u), 1 - tanh(u)) as 2 / (1 + e) and 2e / (1 + e), e = exp(-2|u|), each on the side u's
    sign puts it. Formed from a rounded t, 1 + t near t = -1 keeps t's absolute error (fp32: ~6e-8)
    while it is itself tiny (5e-6 at gelu's x = -4.4: 1% off); these are a few ulp of themselves."""
    e = exp_f(-2.0 * tl.abs(u))
    big = 2.0 / (1.0 + e)
    small = big * e
    return tl.where(u < 0, small, big), tl.where(u < 0, big, small)


@triton.jit
def _gelu(x, APPROX: tl.constexpr):
    """none: x/2 * (1 + erf(x/sqrt2));  tanh: x/2 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))

    tanh: 1 + tanh formed without cancellation (_one_plus_minus_tanh)."""
    if APPROX == "tanh":
        p, _ = _one_plus_minus_tanh(_SQRT_2_PI * (x + _KAPPA * x * x * x))
        return 0.5 * x * p
    else:
        return 0.5 * x * (1.0 + tl.erf(x * _SQRT1_2))


@triton.jit
def _gelu_bwd(g, x, APPROX: tl.constexpr):
    """none: g * (Phi(x) + x * phi(x)), Phi(x) = erfc(-x / sqrt(2)) / 2;
    (ATen's 0.5 * (1 + erf(x / sqrt(2))) cancels for x < 0: at x = -4.8 it cost the derivative 3e-4 of its
    value in fp32, visible times a large grad; below -5.45 it is 0)
    tanh: g * (0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)), t = tanh(inner), with
    1 + t and 1 - t^2 = (1 + t)(1 - t) formed without cancellation (_one_plus_minus_tanh)"""
    if APPROX == "tanh":
        x2 = x * x
        p, m = _one_plus_minus_tanh(_SQRT_2_PI * (x + _KAPPA * x2 * x))
        d = 0.5 * p + 0.5 * x * (p * m) * _SQRT_2_PI * (1.0 + 3.0 * _KAPPA * x2)
        # ATen's 1 + t is 0 where its fp32 t rounds to -1 (1 + t < 2^-25): its derivative is 0 there, so an
        # infinite grad gives NaN; a finite grad keeps the accurate (tiny) derivative
        return tl.where((p < 2.9802322387695312e-08) & (tl.abs(g) == float("inf")), float("nan"), g * d)
    else:
        cdf = 0.5 * erfc_accurate(-x * _SQRT1_2)
        pdf = tl.exp(-0.5 * x * x) * _INV_SQRT_2PI
        return g * (cdf + x * pdf)


@triton.jit
def _relu(x):
    """max(self, 0); NaN stays NaN (ATen's clamp_min). The sign of a zero result follows ATen on each
    device: its CUDA kernel gives relu(-0.0) = +0.0, its CPU kernel -0.0."""
    if GPU:
        return tl.where(x <= 0, 0, x)
    else:
        return tl.where(x < 0, 0, x)


@triton.jit
def _threshold_bwd(g, x, threshold):
    """self <= threshold ? 0 : grad"""
    return tl.where(x <= threshold, 0.0, g)


@triton.jit
def _sigmoid_bwd(g, y):
    """grad * (1 - y) * y, y = sigmoid output"""
    return g * (1.0 - y) * y


@triton.jit
def _tanh_bwd(g, y):
    """grad * (1 - y^2), y = tanh output"""
    return g * (1.0 - y * y)


@triton.jit
def _softplus(x, beta, threshold):
    """x * beta > threshold ? x : log1p(exp(x * beta)) / beta"""
    xb = x * beta
    return tl.where(xb > threshold, x, log1p_f(tl.exp(xb)) / beta)


# softplus_backward: below _SP_LOW, z = exp(x * beta) may be an fp32 subnormal; below _SP_ZERO
# (-150 ln 2) it rounds to 0
_SP_LOW = tl.constexpr(-87.0)
_SP_ZERO = tl.constexpr(-103.97207708399179)


@triton.jit
def _softplus_bwd(g, x, beta, threshold):
    """x * beta > threshold ? grad : grad * z / (z + 1), z = exp(x * beta) (= grad * sigmoid(x * beta))

    ATen's formula on both devices: an inf grad times a tiny z stays inf (grad * sigmoid gave
    inf * 0 = NaN), z = inf gives NaN, a z that rounds to 0 gives grad * 0. Where z is subnormal
    (z + 1 is 1 there) the product is taken as grad * h * h, h = exp(x * beta / 2): no subnormal
    intermediate for the GPU's exp, which flushes them."""
    xb = x * beta
    low = xb < _SP_LOW
    h = exp_f(tl.where(low, xb * 0.5, xb))
    d = tl.where(low, g * h * h, tl.math.div_rn(g * h, h + 1.0))
    d = tl.where(xb < _SP_ZERO, g * 0.0, d)
    return tl.where(xb > threshold, g, d)


@triton.jit
def _elu(x, alpha, scale, input_scale):
    """x <= 0 ? alpha * scale * expm1(x * input_scale) : x * scale

    A zero takes the branch each device's ATen kernel gives it, which shows when input_scale is infinite
    (0 * inf = NaN) or alpha NaN: CUDA's tests x > 0 (a zero is NaN there), the CPU's x >= 0 (a zero
    is x * scale)."""
    neg = alpha * scale * expm1_f(x * input_scale)
    if GPU:
        if x.dtype == tl.float32:
            # fp32 arithmetic flushes a subnormal x (x * input_scale is 0); ATen's kernel keeps it
            # (elu(-1e-40) is -1e-40): those lanes in float64, where x is a normal number
            tiny = (tl.abs(x) < 1.1754943508222875e-38) & (x != 0.0)
            x64 = x.to(tl.float64)
            neg = tl.where(tiny, (libdevice.expm1(x64 * input_scale) * scale * alpha).to(tl.float32), neg)
        return tl.where(x > 0, x * scale, neg)
    else:
        return tl.where(x >= 0, x * scale, neg)


@triton.jit
def _elu_bwd(g, x, alpha, scale, input_scale, IS_RESULT: tl.constexpr):
    """is_result (x = elu output): x <= 0 ? g * input_scale * (x + alpha * scale) : g * scale;
    else: x <= 0 ? g * input_scale * alpha * scale * exp(x * input_scale) : g * scale"""
    if IS_RESULT:
        neg = g * input_scale * (x + alpha * scale)
    else:
        neg = g * input_scale * alpha * scale * tl.exp(x * input_scale)
    # a NaN x: CUDA's kernel tests x <= 0 (grad * scale), ATen's CPU vector path x > 0 (NaN)
    if GPU:
        return tl.where(x <= 0, neg, g * scale)
    else:
        return tl.where(x > 0, g * scale, neg)


@triton.jit
def _leaky_relu(x, slope):
    """x > 0 ? x : x * negative_slope"""
    return tl.where(x > 0, x, x * slope)


@triton.jit
def _leaky_relu_bwd(g, x, slope):
    """x > 0 ? grad : grad * negative_slope"""
    return tl.where(x > 0, g, g * slope)


@triton.jit
def _hardtanh(x, lo, hi):
    """clamp(self, min_val, max_val), as ATen's (max_val wins where min_val > max_val)

    ATen's hardtanh calls clamp: a NaN self or bound gives NaN too."""
    return clamp_f(x, lo, hi)


@triton.jit
def _hardtanh_bwd(g, x, lo, hi):
    """x <= min_val || x >= max_val ? 0 : grad

    A NaN x: grad on CUDA (its test), 0 on ATen's CPU vector path (min_val < x < max_val ? grad : 0)."""
    if GPU:
        return tl.where((x <= lo) | (x >= hi), 0.0, g)
    else:
        return tl.where((x > lo) & (x < hi), g, 0.0)


@triton.jit
def _relu6(x):
    """min(max(x, 0), 6) with NaN passing through (std::min/max argument order in ATen)"""
    return tl.where(x < 0, 0.0, tl.where(x > 6.0, 6.0, x))


@triton.jit
def _hardsigmoid(x):
    """min(max(x + 3, 0), 6) / 6"""
    return _relu6(x + 3.0) / 6.0


@triton.jit
def _hardsigmoid_bwd(g, x):
    """-3 < x < 3 ? grad / 6 : 0"""
    return tl.where((x > -3.0) & (x < 3.0), g / 6.0, 0.0)


@triton.jit
def _hardswish(x):
    """x * min(max(x + 3, 0), 6) / 6"""
    return x * _relu6(x + 3.0) / 6.0


@triton.jit
def _hardswish_bwd(g, x):
    """x <= -3 ? 0 : x < 3 ? grad * (x / 3 + 0.5) : grad

    A NaN x: grad on CUDA (its tests), NaN on ATen's CPU vector path
    (x >= 3 ? grad : grad * (x / 3 + 0.5))."""
    if GPU:
        return tl.where(x <= -3.0, 0.0, tl.where(x < 3.0, g * (x / 3.0 + 0.5), g))
    else:
        return tl.where(x <= -3.0, 0.0, tl.where(x >= 3.0, g, g * (x / 3.0 + 0.5)))


@triton.jit
def _mish(x):
    """x * tanh(softplus(x)), softplus = log1p(exp(x))"""
    return x * tanh(log1p_f(tl.exp(x)))


@triton.jit
def _mish_bwd(g, x):
    """grad * (t + x * sigmoid(x) * (1 - t^2)), t = tanh(softplus(x))"""
    t = tanh(log1p_f(tl.exp(x)))
    return g * (t + x * sigmoid(x) * (1.0 - t * t))


@triton.jit
def _logit(x, EPS: tl.constexpr):
    """log(z / (1 - z)), z = clamp(x, eps, 1 - eps) when eps is given and >= 0 (ATen: None or < 0 -> x)"""
    if EPS == "none":
        z = x
    elif EPS < 0:
        z = x
    else:
        # the lower bound first, as CUDA and ATen's CPU scalar path do: with eps > 0.5 the bounds cross
        # and z = eps (+inf), where ATen's CPU vector path clamps max-then-min (-inf)
        z = tl.where(x < EPS, EPS, tl.where(x > 1.0 - EPS, 1.0 - EPS, x))
    return tl.log(z / (1.0 - z))


@triton.jit
def _logit_bwd(g, x, EPS: tl.constexpr):
    """eps None / < 0: x outside [0, 1] -> NaN, else grad / (x (1 - x));
    eps >= 0: x outside [eps, 1 - eps] -> 0, else grad / (x (1 - x)) (a NaN x: see below)"""
    d = g / (x * (1.0 - x))
    if EPS == "none":
        return tl.where((x < 0) | (x > 1.0), float("nan"), d)
    elif EPS < 0:
        return tl.where((x < 0) | (x > 1.0), float("nan"), d)
    elif GPU:
        return tl.where((x < EPS) | (x > 1.0 - EPS), 0.0, d)
    else:
        # a NaN x: 0 on ATen's CPU vector path (eps <= x <= 1 - eps ? d : 0), d = NaN on CUDA's
        return tl.where((x >= EPS) & (x <= 1.0 - EPS), d, 0.0)


def _elu_bwd_check(grad_output, alpha, scale, input_scale, is_result, self_or_result, **kw):
    if is_result and not alpha >= 0:   # ATen's check: NaN is rejected too
        return "negative alpha with is_result: ATen raises"
    return None


def _leaky_bwd_check(grad_output, self, negative_slope, self_is_result, **kw):
    if self_is_result and not negative_slope >= 0:   # ATen's check: NaN is rejected too
        return "negative slope with self_is_result: ATen raises"
    return None


_UN = ("self",)
_BW = ("grad_output", "self")

# relu.out is CompositeExplicit (relu + copy)
silu = pointwise("silu", "silu.out", "silu_", body=_silu, operands=("self",))
silu_backward = pointwise("silu_backward", "silu_backward.grad_input", body=_silu_bwd,
                          operands=("grad_output", "self"), backward=True)
gelu = pointwise("gelu", "gelu.out", "gelu_", body=_gelu, operands=("self",),
                 constexprs={"approximate": _GELU_MODES})
gelu_backward = pointwise("gelu_backward", "gelu_backward.grad_input", body=_gelu_bwd,
                          operands=("grad_output", "self"), constexprs={"approximate": _GELU_MODES},
                          backward=True)
relu = pointwise("relu", "relu_", body=_relu, operands=_UN, dtypes=FLOATS + INTS)
# threshold_backward and leaky_relu_backward add self to their TensorIterator before grad_output
_BW_ITER = ("self", "grad_output")
threshold_backward = pointwise("threshold_backward", "threshold_backward.grad_input", body=_threshold_bwd,
                               operands=_BW, scalars=("threshold",), backward=True, iter_order=_BW_ITER)
def _sigmoid_bwd_check(grad_output, output, *args, **kwargs):
    # ATen's fp16 kernels (c10::Half arithmetic on CUDA, the Half kernel on the CPU) round every step to
    # fp16: grad * (1 - y) overflows to inf for an output outside [0, 1] where the body's fp32 does not.
    # Those calls go to ATen. bf16 shares fp32's range: its per-step rounding differs in the last bit only
    if grad_output.dtype == torch.float16:
        return "float16 sigmoid_backward (ATen rounds each step to fp16)"
    return None


sigmoid_backward = pointwise("sigmoid_backward", "sigmoid_backward.grad_input", body=_sigmoid_bwd,
                             operands=("grad_output", "output"), backward=True, check=_sigmoid_bwd_check)
def _tanh_bwd_check(grad_output, output, *args, **kwargs):
    # ATen's CUDA fp16 kernel rounds every step to fp16 (c10::Half): y * y overflows to inf for |y| past
    # 256 where the body's fp32 does not. Those calls go to ATen; its CPU kernel computes in fp32 as the
    # body does, and bf16 shares fp32's range
    if grad_output.dtype == torch.float16 and backend().name != "interpreter":
        return "float16 tanh_backward on CUDA (ATen rounds each step to fp16)"
    return None


tanh_backward = pointwise("tanh_backward", "tanh_backward.grad_input", body=_tanh_bwd,
                          operands=("grad_output", "output"), backward=True, check=_tanh_bwd_check)
softplus = pointwise("softplus", "softplus.out", body=_softplus, operands=_UN, scalars=("beta", "threshold"))
softplus_backward = pointwise("softplus_backward", "softplus_backward.grad_input", body=_softplus_bwd,
                              operands=_BW, scalars=("beta", "threshold"), backward=True)
elu = pointwise("elu", "elu.out", "elu_", body=_elu, operands=_UN, scalars=("alpha", "scale", "input_scale"))
elu_backward = pointwise("elu_backward", "elu_backward.grad_input", body=_elu_bwd,
                         operands=("grad_output", "self_or_result"), scalars=("alpha", "scale", "input_scale"),
                         constexprs={"is_result": (False, True)}, backward=True, check=_elu_bwd_check)
leaky_relu = pointwise("leaky_relu", "leaky_relu.out", "leaky_relu_", body=_leaky_relu, operands=_UN,
                       scalars=("negative_slope",))
leaky_relu_backward = pointwise("leaky_relu_backward", "leaky_relu_backward.grad_input", body=_leaky_relu_bwd,
                                operands=_BW, scalars=("negative_slope",), backward=True, check=_leaky_bwd_check,
                                iter_order=_BW_ITER)
# ATen's hardtanh allocates empty_like(self) and clamps into it
hardtanh = pointwise("hardtanh", "hardtanh.out", "hardtanh_", body=_hardtanh, operands=_UN,
                     scalars=("min_val", "max_val"), result_layouts={"hardtanh": "like_self"})
hardtanh_backward = pointwise("hardtanh_backward", "hardtanh_backward.grad_input", body=_hardtanh_bwd,
                              operands=_BW, scalars=("min_val", "max_val"), backward=True)
hardsigmoid = pointwise("hardsigmoid", "hardsigmoid.out", "hardsigmoid_", body=_hardsigmoid, operands=_UN)
hardsigmoid_backward = pointwise("hardsigmoid_backward", "hardsigmoid_backward.grad_input",
                                 body=_hardsigmoid_bwd, operands=_BW, backward=True)
hardswish = pointwise("hardswish", "hardswish.out", "hardswish_", body=_hardswish, operands=_UN)
# hardswish_backward.out is CompositeExplicit
hardswish_backward = pointwise("hardswish_backward", body=_hardswish_bwd, operands=_BW, backward=True)
mish = pointwise("mish", "mish.out", "mish_", body=_mish, operands=_UN)
# ATen allocates mish_backward's result with input's options (silu_backward's is structured: promoted)
mish_backward = pointwise("mish_backward", body=_mish_bwd, operands=_BW, backward=True, result_dtype="self")
# eps is a compile-time constant (models use None or one fixed eps): one kernel per distinct value
logit = pointwise("logit", "logit.out", "logit_", body=_logit, operands=_UN, promotion="int_to_float",
                  constexprs=("eps",))
logit_backward = pointwise("logit_backward", "logit_backward.grad_input", body=_logit_bwd, operands=_BW,
                           constexprs=("eps",), backward=True)
