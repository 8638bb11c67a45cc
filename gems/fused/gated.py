"""Gated activations of LLM MLPs: silu_and_mul (= swiglu) and gelu_and_mul, forward and backward in
one Triton kernel each, with the plain PyTorch reference beside them (`reference_<name>`).

    y = act(gate) * up          Llama/Mistral/Qwen2: down_proj(silu(gate_proj(x)) * up_proj(x))

Rounding follows the unfused Hugging Face code, `act_fn(gate) * up` at the input dtype: act(gate) is
computed in fp32 and rounded once to the input dtype, then multiplied by up in fp32 and rounded
again (for fp32 inputs both roundings are exact no-ops). Gradients are computed in fp32 from the
inputs (no intermediate rounding) and rounded once:
    dup = dy * round(act(gate)),   dgate = dy * up * act'(gate).

Layout: gate and up have the same shape; each is read as M rows of N = shape[-1] elements with any
row stride and a contiguous last dim, so the two halves of one [..., 2 * I] projection output
(`gate, up = gate_up.chunk(2, -1)`) are read in place, no copy. Other layouts are copied once.
When both inputs (and so the output) are contiguous, the kernel runs over the M * N elements as
one flat range. Memory traffic: forward reads gate and up and writes y (3 passes); backward reads
dy, gate and up and writes dgate and dup (5 passes; only the gradients autograd needs are written).

Launch: programs of BLOCK elements (4096 on the GPU for large inputs, down to 512 for small ones
such as a decode step, so that enough programs are in flight), one program per BLOCK-wide piece of a
row on the strided path (flattened program index: rows times column blocks, no grid-dim limit).

Dtypes: fp32, fp16, bf16. float64 tensors and tensors on a device the active Gems backend does not
run on (CPU without the interpreter, `meta`) run the PyTorch reference; other dtypes raise ValueError.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..codegen.tlmath import sigmoid, tanh
from ..runtime import backend, kernel
from ..runtime.planned import planned
from ..runtime.utils import as_rows, cdiv, empty, next_pow2, target_programs
from . import deferral, library
from .library import first, maybe

_SERVED = (torch.float32, torch.float16, torch.bfloat16)
# activation codes (the kernels' ACT constexpr): 0 silu, 1 gelu (erf), 2 gelu (tanh)

_SQRT1_2: tl.constexpr = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI: tl.constexpr = tl.constexpr(0.3989422804014327)
_SQRT_2_PI: tl.constexpr = tl.constexpr(0.7978845608028654)   # sqrt(2 / pi)
_KAPPA: tl.constexpr = tl.constexpr(0.044715)

# block bounds (elements per program), target programs per SM, elements per warp
_CONFIGS = {
    "cuda": dict(min_block=512, max_block=4096, programs_per_sm=4, elems_per_warp=512, max_warps=8),
    # the interpreter: small blocks so that tests reach rows split over several programs
    "interpreter": dict(min_block=16, max_block=64, programs=8, elems_per_warp=512, max_warps=1),
}


# ---------------------------------------------------------------------------------------------- kernels
@triton.jit
def _act(g, ACT: tl.constexpr):
    """silu: g * sigmoid(g);  gelu: g/2 * (1 + erf(g/sqrt2));  gelu_tanh: g/2 * (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))"""
    if ACT == 0:
        return g * sigmoid(g)
    elif ACT == 1:
        return 0.5 * g * (1.0 + tl.erf(g * _SQRT1_2))
    else:
        return 0.5 * g * (1.0 + tanh(_SQRT_2_PI * (g + _KAPPA * g * g * g)))


@triton.jit
def _act_and_grad(g, ACT: tl.constexpr):
    """(act(g), act'(g)). silu': s (1 + g (1 - s)), s = sigmoid(g); gelu': Phi(g) + g phi(g);
    gelu_tanh': (1 + t)/2 + g/2 (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 g^2), t = tanh(inner)."""
    if ACT == 0:
        s = sigmoid(g)
        a = g * s
        d = s * (1.0 + g * (1.0 - s))
    elif ACT == 1:
        cdf = 0.5 * (1.0 + tl.erf(g * _SQRT1_2))
        a = g * cdf
        d = cdf + g * _INV_SQRT_2PI * tl.exp(-0.5 * g * g)
    else:
        g2 = g * g
        t = tanh(_SQRT_2_PI * (g + _KAPPA * g2 * g))
        a = 0.5 * g * (1.0 + t)
        d = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * _SQRT_2_PI * (1.0 + 3.0 * _KAPPA * g2)
    return a, d


@kernel
@triton.jit
def _gated_fwd(G, U, Y, N, sG, sU, ncb, ACT: tl.constexpr, BLOCK: tl.constexpr):
    """y = round(act(gate)) * up, fp32 math; a program covers BLOCK columns of one row (row = pid // ncb).
    Bytes per element: read gate, up; write y."""
    pid = tl.program_id(0)
    row = pid // ncb
    cols = (pid - row * ncb).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    r = row.to(tl.int64)
    mask = cols < N
    g = tl.load(G + r * sG + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + r * sU + cols, mask=mask, other=0.0).to(tl.float32)
    a = _act(g, ACT).to(Y.dtype.element_ty).to(tl.float32)
    tl.store(Y + r * N + cols, (a * u).to(Y.dtype.element_ty), mask=mask)


@kernel
@triton.jit
def _gated_bwd(DY, G, U, DG, DU, N, sDY, sG, sU, sD, ncb, ACT: tl.constexpr, DO_DG: tl.constexpr,
               DO_DU: tl.constexpr, BLOCK: tl.constexpr):
    """dgate = dy * up * act'(gate), dup = dy * round(act(gate)), fp32 math; sD: the gradients' row stride.
    Bytes per element: read dy, gate, up; write dgate and/or dup."""
    pid = tl.program_id(0)
    row = pid // ncb
    cols = (pid - row * ncb).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    r = row.to(tl.int64)
    mask = cols < N
    dy = tl.load(DY + r * sDY + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + r * sG + cols, mask=mask, other=0.0).to(tl.float32)
    a, d = _act_and_grad(g, ACT)
    if DO_DG:
        u = tl.load(U + r * sU + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(DG + r * sD + cols, (dy * u * d).to(DG.dtype.element_ty), mask=mask)
    if DO_DU:
        a = a.to(G.dtype.element_ty).to(tl.float32)
        tl.store(DU + r * sD + cols, (dy * a).to(DU.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------------ launch and autograd
@functools.lru_cache(maxsize=1024)
def _geometry(rows, n, name, dev):
    """(grid, column blocks per row, BLOCK, num_warps) for `rows` rows of `n` elements; cached by shape."""
    cfg = _CONFIGS[name]
    target = target_programs(cfg, dev)
    block = min(cfg["max_block"], max(cfg["min_block"], next_pow2(cdiv(rows * n, target))), next_pow2(n))
    ncb = cdiv(n, block)
    warps = max(1, min(cfg["max_warps"], block // cfg["elems_per_warp"]))
    return (rows * ncb,), ncb, block, warps


def _plan(shape, *views):
    """(rows, n, strides) for a launch: one flat range when every view is contiguous."""
    N = shape[-1]
    M = 1
    for s in shape[:-1]:
        M *= s
    if all(s == N for _, s in views):
        return 1, M * N, [0] * len(views)     # one row: the row stride is never used
    return M, N, [s for _, s in views]


def _check(gate, up, what):
    for name, t in (("gate", gate), ("up", up)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{what}: {name} must be a tensor, got {type(t).__name__}")
    if tuple(gate.shape) != tuple(up.shape):
        raise ValueError(f"{what}: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have the same shape")
    if gate.dtype != up.dtype:
        raise ValueError(f"{what}: gate dtype {gate.dtype} and up dtype {up.dtype} differ")
    if gate.device != up.device:
        raise ValueError(f"{what}: gate is on {gate.device}, up on {up.device}")
    if gate.dtype in _SERVED:
        if gate.dim() == 0:
            raise ValueError(f"{what}: inputs must have at least one dimension")
        return gate.device.type == library.device_type()
    if gate.dtype == torch.float64:
        return False
    raise ValueError(f"{what}: dtype {gate.dtype} is not supported (float32, float16, bfloat16; float64 runs the "
                     f"PyTorch reference)")


def _served(gate, up, what):
    """Whether the kernels serve these inputs (else the PyTorch reference runs). The common case is
    decided from gate's dtype and device; the rest of `_check` runs once per signature in the planned
    forward, and here for every call the kernels do not take."""
    try:
        if gate.dtype in _SERVED and gate.dim() and gate.device.type == library.device_type():
            return True
    except (AttributeError, RuntimeError):
        pass
    return _check(gate, up, what)


@planned("gated_forward(Tensor gate, Tensor up, int act, str what) -> Tensor")
def _gated_forward(gate, up, act, what):
    """y = act(gate) * up: one launch (planned: checks, layout and geometry once per signature)."""
    _check(gate, up, what)
    shape = gate.shape
    y = empty(shape, gate.dtype, gate.device)
    if y.numel():
        N = shape[-1]
        M = gate.numel() // N
        gv, uv = as_rows(gate, M, N), as_rows(up, M, N)
        rows, n, (sg, su) = _plan(shape, gv, uv)
        grid, ncb, block, nw = _geometry(rows, n, backend().name, gate.device.index or 0)
        _gated_fwd[grid](gv[0], uv[0], y, n, sg, su, ncb, act, block, num_warps=nw)
    return y


@planned("gated_backward(Tensor dy, Tensor gate, Tensor up, int act, bool do_dg, bool do_du) -> (Tensor?, Tensor?)")
def _gated_backward(dy, gate, up, act, do_dg, do_du):
    """(dgate, dup), each None when not needed: one launch."""
    shape = gate.shape
    dg = empty(shape, gate.dtype, gate.device) if do_dg else None
    du = empty(shape, up.dtype, up.device) if do_du else None
    if gate.numel() == 0 or not (do_dg or do_du):
        return dg, du
    N = shape[-1]
    M = gate.numel() // N
    dyv, gv, uv = as_rows(dy, M, N), as_rows(gate, M, N), as_rows(up, M, N)
    rows, n, (sdy, sg, su) = _plan(shape, dyv, gv, uv)
    grid, ncb, block, nw = _geometry(rows, n, backend().name, gate.device.index or 0)
    _gated_bwd[grid](dyv[0], gv[0], uv[0], dg, du, n, sdy, sg, su, n, ncb, act, int(do_dg), int(do_du),
                     block, num_warps=nw)
    return dg, du


def packed_forward(gate_up, act=0):
    """act(gate) * up for one [M, 2I] projection output (gate columns first, as a fused gate/up weight
    gives it) -> [M, I]: one launch, no autograd (callers that own their backward use packed_backward).
    act: 0 SiLU, 1 GELU (erf), 2 GELU (tanh)."""
    i = gate_up.shape[-1] // 2
    return _gated_forward(gate_up[..., :i], gate_up[..., i:], act, "packed_forward")


def packed_backward(dy, gate_up, act=0):
    """The gradient of packed_forward: dy [M, I], gate_up [M, 2I] -> [M, 2I], d gate then d up, packed
    as gate_up is (so it feeds the projection's backward GEMM as it is); one launch."""
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    M, i2 = gate_up.shape
    i = i2 // 2
    d = empty((M, i2), gate_up.dtype, gate_up.device)
    if d.numel():
        gate, up = gate_up[:, :i], gate_up[:, i:]
        if dy.stride(-1) != 1:
            dy = dy.contiguous()
        grid, ncb, block, nw = _geometry(M, i, backend().name, gate_up.device.index or 0)
        _gated_bwd[grid](dy, gate, up, d, d[:, i:], i, dy.stride(0), gate_up.stride(0), gate_up.stride(0), i2,
                         ncb, act, 1, 1, block, num_warps=nw)
    return d


def _no_graph(gate, up):
    """No graph recorded (inference): launch without the autograd.Function and its host cost."""
    return not torch.is_grad_enabled() or not (gate.requires_grad or up.requires_grad)


class _GatedFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, act, what):
        ctx.act = act
        ctx.save_for_backward(gate, up)
        return _gated_forward(gate, up, act, what)

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        ni = ctx.needs_input_grad
        grads = deferral.backward(
            "gated_and_mul", _gated_backward, (dy, gate, up, ctx.act, ni[0], ni[1]),
            lambda: deferral.reference_grads(_REFERENCES[ctx.act], (gate, up), ni[:2], (dy,)))
        return grads + (None, None)


# torch.compile: gems::gated_and_mul and its backward (library.py)
def _gated_save(ctx, inputs, output):
    ctx.act = inputs[2]
    ctx.save_for_backward(inputs[0], inputs[1])


def _gated_grads(ctx, dy):
    gate, up = ctx.saved_tensors
    dg, du = _GATED_BWD(dy, gate, up, ctx.act, *ctx.needs_input_grad[:2])
    return first(dg), first(du), None


def _gated_fake(gate, up, act):
    _check(gate, up, "gated_and_mul")
    return gate.new_empty(gate.shape)


def _gated_bwd_fake(dy, gate, up, act, do_dg, do_du):
    return maybe(gate.new_empty(gate.shape) if do_dg else None), maybe(up.new_empty(up.shape) if do_du else None)


_GATED_BWD = library.define(
    "gated_and_mul_backward", "(Tensor dy, Tensor gate, Tensor up, int act, bool do_dg, bool do_du) "
    "-> (Tensor[], Tensor[])", lambda *a: tuple(maybe(t) for t in _gated_backward(*a)), _gated_bwd_fake)
_GATED_OP = library.define(
    "gated_and_mul", "(Tensor gate, Tensor up, int act) -> Tensor",
    lambda gate, up, act: _gated_forward(gate, up, act, "gated_and_mul"),
    _gated_fake,
    backward=_gated_grads, setup_context=_gated_save)


@deferral.deferrable
def silu_and_mul(gate, up):
    """silu(gate) * up in one kernel (forward and backward); gate and up may be row-strided views."""
    if not _served(gate, up, "silu_and_mul"):
        return reference_silu_and_mul(gate, up)
    if torch.compiler.is_compiling():   # one opaque node for Dynamo; eager keeps the cheaper Function (library.py)
        return _GATED_OP(gate, up, 0)
    if _no_graph(gate, up):
        return _gated_forward(gate, up, 0, "silu_and_mul")
    return _GatedFn.apply(gate, up, 0, "silu_and_mul")


swiglu = silu_and_mul


@deferral.deferrable
def gelu_and_mul(gate, up, approximate="none"):
    """gelu(gate, approximate) * up in one kernel; approximate is "none" (erf) or "tanh"."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu_and_mul: approximate must be 'none' or 'tanh', got {approximate!r}")
    if not _served(gate, up, "gelu_and_mul"):
        return reference_gelu_and_mul(gate, up, approximate)
    act = 1 if approximate == "none" else 2
    if torch.compiler.is_compiling():
        return _GATED_OP(gate, up, act)
    if _no_graph(gate, up):
        return _gated_forward(gate, up, act, "gelu_and_mul")
    return _GatedFn.apply(gate, up, act, "gelu_and_mul")


# -------------------------------------------------------------------------------------------- references
def reference_silu_and_mul(gate, up):
    """silu(gate) * up, the Llama MLP's `act_fn(gate_proj(x)) * up_proj(x)`."""
    return F.silu(gate) * up


reference_swiglu = reference_silu_and_mul


def reference_gelu_and_mul(gate, up, approximate="none"):
    """gelu(gate, approximate) * up."""
    return F.gelu(gate, approximate=approximate) * up


# the kernels' ACT code -> the reference it computes
_REFERENCES = (reference_silu_and_mul, reference_gelu_and_mul,
               lambda gate, up: reference_gelu_and_mul(gate, up, "tanh"))
