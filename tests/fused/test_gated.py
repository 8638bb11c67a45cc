"""gems.fused gated activations (silu_and_mul / swiglu, gelu_and_mul) against their PyTorch references
run in float64, forward and backward, with per-dtype tolerances: fp32 1e-5 relative; fp16/bf16 by
the flash-attention rule (harness.assert_close with the reference computed at the low precision)."""
import pytest
import torch

import gems.fused as F
from gems.fused import gated
from harness import DEVICE, ON_GPU, assert_close, dtype_params, make, to_ref

ACTS = {
    "silu": (F.silu_and_mul, gated.reference_silu_and_mul),
    "gelu": (F.gelu_and_mul, gated.reference_gelu_and_mul),
    "gelu_tanh": (lambda g, u: F.gelu_and_mul(g, u, approximate="tanh"),
                  lambda g, u: gated.reference_gelu_and_mul(g, u, approximate="tanh")),
}
CPU_SHAPES = [(1, 37), (3, 5, 100), (7, 64), (2, 300)]
GPU_SHAPES = [(1, 11008), (4, 11008), (3, 7, 3072), (16, 4096), (2, 100003)]
SHAPES = CPU_SHAPES + (GPU_SHAPES if ON_GPU else [])
FP32_TOL = dict(rtol=1e-5, atol=1e-5)


def _run(fn, leaves_in, need, view, post, seed=1):
    leaves = [t.detach().clone().requires_grad_(rg) for t, rg in zip(leaves_in, need)]
    gate, up = view(*leaves)
    y = post(fn(gate, up))
    gen = torch.Generator().manual_seed(seed)
    dy = torch.empty(y.shape, dtype=torch.float64).uniform_(-1, 1, generator=gen).to(y)
    req = [t for t in leaves if t.requires_grad]
    grads = torch.autograd.grad(y, req, dy) if req else ()
    return y, grads


def check(act, leaves, dtype, need=None, view=None, *, ours=None, post=None):
    """Ours vs the reference in float64 (output and gradients of the leaves); view(*leaves) -> (gate, up),
    post(y) is what the loss sees."""
    fn, ref = ACTS[act]
    fn = ours or fn
    need = need or [True] * len(leaves)
    view = view or (lambda g, u: (g, u))
    post = post or (lambda y: y)
    y, g = _run(fn, leaves, need, view, post)
    ry, rg = _run(ref, [to_ref(t) for t in leaves], need, view, post)
    ly, lg = _run(ref, leaves, need, view, post)
    assert y.dtype == ly.dtype and y.shape == ly.shape
    kw = FP32_TOL if dtype == torch.float32 else {}
    low = None if dtype == torch.float32 else (ly, lg)
    assert_close((y, g), (ry, rg), dtype, low, msg=act, **kw)
    return y, g


@dtype_params()
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("act", list(ACTS))
def test_gated(dtype, shape, act):
    check(act, [make(shape, dtype), make(shape, dtype)], dtype)


@dtype_params()
@pytest.mark.parametrize("act", list(ACTS))
def test_halves_of_one_projection(dtype, act):
    """gate, up = gate_up.chunk(2, -1): row-strided views, read in place."""
    shape = (3, 4, 2 * 37)
    check(act, [make(shape, dtype)], dtype, view=lambda t: t.chunk(2, -1))


@dtype_params()
@pytest.mark.parametrize("layout", ["batch-step", "transposed", "expanded-up"])
def test_layouts(dtype, layout):
    """Views whose rows cannot be read in place (a copy), and non-contiguous gradients."""
    if layout == "batch-step":
        leaves, view = [make((6, 3, 37), dtype), make((6, 3, 37), dtype)], lambda g, u: (g[::2], u[::2])
    elif layout == "transposed":
        leaves, view = [make((37, 5), dtype), make((5, 37), dtype)], lambda g, u: (g.t(), u)
    else:
        leaves, view = [make((5, 37), dtype), make((1, 37), dtype)], lambda g, u: (g, u.expand(5, 37))
    check("silu", leaves, dtype, view=view)
    # the loss sees y transposed: the gradient reaching the op is non-contiguous
    check("gelu", leaves, dtype, view=view, post=lambda y: y.transpose(-1, -2))


def test_halves_read_in_place(monkeypatch):
    seen = []
    real = gated._gated_fwd

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append((args[0].data_ptr(), args[1].data_ptr(), args[4], args[5]))
                return real[grid](*args, **kw)
            return launch
    monkeypatch.setattr(gated, "_gated_fwd", Spy())
    t = make((4, 2 * 37), torch.float32)
    g, u = t.chunk(2, -1)
    F.silu_and_mul(g, u)
    assert seen == [(t.data_ptr(), t.data_ptr() + 37 * 4, 74, 74)]


@pytest.mark.parametrize("need", [(True, False), (False, True)], ids=["gate", "up"])
@pytest.mark.parametrize("act", list(ACTS))
def test_partial_grads(need, act):
    check(act, [make((5, 37), torch.float32), make((5, 37), torch.float32)], torch.float32, need=list(need))


@pytest.mark.parametrize("act", list(ACTS))
def test_large_gate_values(act):
    """|gate| up to 40: sigmoid/erf/tanh saturate without inf or NaN in values or gradients."""
    g = make((4, 64), torch.float32, low=-40, high=40)
    check(act, [g, make((4, 64), torch.float32)], torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("act", list(ACTS))
def test_forward_without_graph(dtype, act):
    """Inputs that need no gradient launch without the autograd.Function: same results."""
    y, _ = check(act, [make((3, 5, 100), dtype), make((3, 5, 100), dtype)], dtype, need=[False, False])
    assert not y.requires_grad


def test_sum_backward():
    """y.sum().backward(): the incoming gradient is an expanded (stride 0) tensor."""
    check("silu", [make((4, 37), torch.float32), make((4, 37), torch.float32)], torch.float32, post=lambda y: y.sum())


def test_swiglu_is_silu_and_mul():
    assert F.swiglu is F.silu_and_mul


def test_empty_and_no_grad():
    e = torch.empty((0, 37), device=DEVICE, requires_grad=True)
    y = F.silu_and_mul(e, e)
    assert y.shape == (0, 37)
    y.sum().backward()
    assert e.grad.shape == (0, 37)
    g, u = make((3, 37), torch.float16), make((3, 37), torch.float16)
    with torch.no_grad():
        y = F.gelu_and_mul(g, u)
    assert not y.requires_grad and y.dtype == torch.float16


def test_float64_and_meta_run_reference():
    g = make((3, 37), torch.float64, requires_grad=True)
    u = make((3, 37), torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda g, u: F.gelu_and_mul(g, u, "tanh"), (g, u))
    m = torch.empty((2, 8), device="meta", dtype=torch.bfloat16)
    assert F.silu_and_mul(m, m).shape == (2, 8)


def test_errors():
    g = make((3, 37), torch.float32)
    with pytest.raises(ValueError, match="same shape"):
        F.silu_and_mul(g, make((3, 36), torch.float32))
    with pytest.raises(ValueError, match="dtype"):
        F.silu_and_mul(g, g.half())
    with pytest.raises(ValueError, match="approximate"):
        F.gelu_and_mul(g, g, approximate="sigmoid")
    with pytest.raises(ValueError, match="not supported"):
        F.silu_and_mul(g.to(torch.int32), g.to(torch.int32))


def test_check_can_fail():
    """The comparison catches a wrong answer: gelu's tanh form against the erf reference (they differ
    by up to ~5e-4), swapped operands in fp16."""
    g, u = make((4, 64), torch.float32), make((4, 64), torch.float32)
    with pytest.raises(AssertionError):
        check("gelu", [g, u], torch.float32, ours=lambda g, u: F.gelu_and_mul(g, u, approximate="tanh"))
    with pytest.raises(AssertionError):
        check("silu", [g.half(), u.half()], torch.float16, ours=lambda g, u: F.silu_and_mul(u, g))


@dtype_params()
@pytest.mark.parametrize("act", [0, 1, 2], ids=["silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("rows", [1, 13] + ([4096] if ON_GPU else []))
def test_packed(dtype, act, rows):
    """packed_forward / packed_backward (no autograd; the MoE grouped path owns its backward): one
    [M, 2I] projection output in, the gradient packed the same way out, against the reference's autograd."""
    name = ["silu", "gelu", "gelu_tanh"][act]
    ref_fn = ACTS[name][1]
    gu = make((rows, 2 * 37), dtype)
    dy = make((rows, 37), dtype)
    y = gated.packed_forward(gu, act)
    d = gated.packed_backward(dy, gu, act)

    def ref(t):
        t = t.detach().clone().requires_grad_()
        out = ref_fn(*t.chunk(2, -1))
        return out, torch.autograd.grad(out, t, to_ref(dy).to(out.device, out.dtype))[0]
    ry, rd = ref(to_ref(gu))
    ly, ld = ref(gu)
    kw = FP32_TOL if dtype == torch.float32 else {}
    assert d.shape == gu.shape and y.shape == dy.shape
    assert_close((y, d), (ry, rd), dtype, None if dtype == torch.float32 else (ly, ld), msg=name, **kw)
