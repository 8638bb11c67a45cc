"""gems.fused while its kernels compile in the background (gems/fused/deferral.py): the reference
answers a call whose forward kernel is not compiled, and a backward whose kernel is not compiled takes
the reference's gradients; no launch of theirs compiles on the calling thread, and each answer is
counted in gems.stats() as `fused::<name>`."""
import textwrap

import pytest
import torch

from gems.fused import linear_cross_entropy as lce
from harness import while_compiling

# every kernel the families below launch, forward and backward
KERNELS = ["rms_fwd", "rms_bwd", "reduce_outer", "layer_norm_fwd", "layer_norm_bwd", "layer_norm_bwd_colsum",
           "_gated_fwd", "_gated_bwd", "rope_kernel", "ce_fwd_kernel", "ce_count_kernel", "ce_reduce_kernel",
           "ce_scale_kernel", "ce_bwd_kernel"]

# each case: (name, inputs, the fused call, its reference); outputs and every input's gradient are compared
_CASES = f"ALL = {KERNELS!r}\n" + '''
import gems.fused as F
from gems.fused import cross_entropy_loss as cel, gated, linear_cross_entropy as lce, norms, rotary
torch.manual_seed(0)
def leaf(*shape):
    return torch.randn(*shape, device=dev, requires_grad=True)
x, r, w, b, g, u = leaf(6, 40), leaf(6, 40), leaf(40), leaf(40), leaf(6, 24), leaf(6, 24)
q, k = leaf(2, 4, 5, 16), leaf(2, 2, 5, 16)
cos, sin = torch.randn(1, 5, 16, device=dev), torch.randn(1, 5, 16, device=dev)
logits, tgt = leaf(7, 33), torch.randint(0, 33, (7,), device=dev)
tgt[2] = -100
hid, lm = leaf(7, 12), leaf(33, 12)
CASES = [
    ("rms_norm", (x, w), lambda x, w: F.rms_norm(x, w, 1e-5, offset=0.5),
     lambda x, w: norms.reference_rms_norm(x, w, 1e-5, offset=0.5)),
    ("add_rms_norm", (x, r, w), lambda x, r, w: F.add_rms_norm(x, r, w, 1e-5, casting="gemma"),
     lambda x, r, w: norms.reference_add_rms_norm(x, r, w, 1e-5, casting="gemma")),
    ("layer_norm", (x, w, b), F.layer_norm, norms.reference_layer_norm),
    ("add_layer_norm", (x, r, w, b), F.add_layer_norm, norms.reference_add_layer_norm),
    ("silu_and_mul", (g, u), F.silu_and_mul, gated.reference_silu_and_mul),
    ("gelu_and_mul", (g, u), lambda g, u: F.gelu_and_mul(g, u, "tanh"),
     lambda g, u: gated.reference_gelu_and_mul(g, u, "tanh")),
    ("rope", (q, k), lambda q, k: F.rope(q, k, cos, sin), lambda q, k: rotary.reference_rope(q, k, cos, sin)),
    ("cross_entropy", (logits,), lambda lg: F.cross_entropy(lg, tgt, label_smoothing=0.1),
     lambda lg: cel.reference_cross_entropy(lg, tgt, label_smoothing=0.1)),
    ("cross_entropy_none", (logits,), lambda lg: F.cross_entropy(lg, tgt, reduction="none"),
     lambda lg: cel.reference_cross_entropy(lg, tgt, reduction="none")),
    ("fused_linear_cross_entropy", (hid, lm),
     lambda h, w: F.fused_linear_cross_entropy(h, w, tgt, chunk_size=3, label_smoothing=0.1),
     lambda h, w: lce.chunked_reference(h, w, tgt, chunk_size=3, label_smoothing=0.1)),
]
def step(fn, inputs, before_backward=lambda: None):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    loss = sum((o.float().sin() * (i + 1)).sum() for i, o in enumerate(outs))
    before_backward()
    loss.backward()
    return [o.detach() for o in outs] + [t.grad for t in leaves]
def diff(a, b):
    return max((x - y).abs().max().item() if x.numel() else 0.0 for x, y in zip(a, b))
'''


def test_a_fused_op_whose_kernels_are_compiling_is_answered_by_its_reference():
    r = while_compiling(KERNELS, _CASES + textwrap.dedent("""
        diffs = {}
        for name, inputs, fused, ref in CASES:
            n = len(asked)
            got, want = step(fused, inputs), step(ref, inputs)
            diffs[name] = [diff(got, want), len(asked) - n]
        report(diffs=diffs)
    """))
    for name, (d, launches) in r["diffs"].items():
        assert d == 0.0, (name, d)        # the reference itself answered, on the same inputs
        assert launches >= 1, name        # its kernels were asked for (and so would have compiled)
    assert r["asked"] and all(deferring for _, _, deferring in r["asked"]), r["asked"]
    assert {"fused::rms_norm", "fused::add_rms_norm", "fused::layer_norm", "fused::add_layer_norm",
            "fused::silu_and_mul", "fused::gelu_and_mul", "fused::rope", "fused::cross_entropy",
            "fused::fused_linear_cross_entropy"} <= set(r["aten"]), r


def test_a_backward_whose_kernel_is_compiling_takes_the_references_gradients():
    # the forward runs the kernels (compiled beforehand); only then do they all "compile", so the
    # backward misses (without call plans, which would replay the compiled kernels past the miss path)
    r = while_compiling([], _CASES + textwrap.dedent("""
        diffs = {}
        for name, inputs, fused, ref in CASES:
            COMPILING.clear()
            for _ in range(8):  # on a GPU the real compiles defer too: each of the forward's, then the backward's
                before = background.stats()["submitted"]
                step(fused, inputs)
                background.wait()
                if background.stats()["submitted"] == before:
                    break
            n = len(asked)
            got = step(fused, inputs, before_backward=lambda: COMPILING.update(ALL))
            COMPILING.clear()
            diffs[name] = [diff(got, step(fused, inputs)), diff(got, step(ref, inputs)), len(asked) - n]
        report(diffs=diffs)
    """), env={"GEMS_PLANS": "0"})
    for name, (to_kernels, to_reference, launches) in r["diffs"].items():
        assert launches >= 1, name
        assert to_kernels < 1e-4, (name, to_kernels)        # fp32: the kernels' and the reference's rounding
        if name not in ("cross_entropy", "fused_linear_cross_entropy"):   # their backward scales the forward's gradient
            assert to_reference < 1e-5, (name, to_reference)
    assert r["asked"] and all(deferring for _, _, deferring in r["asked"]), r["asked"]
    assert {"fused::rms_norm", "fused::layer_norm", "fused::gated_and_mul", "fused::rope",
            "fused::cross_entropy", "fused::fused_linear_cross_entropy"} <= set(r["aten"]), r


@pytest.mark.parametrize("kw", [dict(), dict(reduction="sum", label_smoothing=0.2), dict(reduction="none"),
                                dict(reduction="sum", divisor=5.0), dict(chunk_size="low_memory")])
def test_the_chunked_answer_of_fused_linear_cross_entropy_is_its_reference(kw):
    # what answers fused_linear_cross_entropy while its kernels compile: chunk by chunk, each chunk's
    # logits recomputed in backward; the same loss and gradients as the full-logits reference
    torch.manual_seed(0)
    h, w, b = (torch.randn(*s, dtype=torch.float64, requires_grad=True) for s in ((11, 6), (9, 6), (9,)))
    t = torch.randint(0, 9, (11,))
    t[3] = -100
    got = lce.chunked_reference(h, w, t, b, chunk_size=kw.pop("chunk_size", 4), **kw)
    want = lce.reference_fused_linear_cross_entropy(h, w, t, b, **kw)
    g = torch.randn(got.shape, dtype=torch.float64)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    for a, e in zip(torch.autograd.grad(got, (h, w, b), g), torch.autograd.grad(want, (h, w, b), g)):
        assert torch.allclose(a, e, rtol=1e-12, atol=1e-12)
