"""Every fused op given tensors on a device the active backend does not launch on (a model left on the
CPU of a GPU machine) runs its PyTorch reference, forward and backward, instead of handing CPU pointers
to a GPU kernel. Here the backend is made to claim another device type; no Triton kernel may run."""
import pytest
import torch
import triton

import gems.fused as F
from gems.fused import (cross_entropy_loss, gated, library, linear_cross_entropy, moe, norms, rotary)


@pytest.fixture
def elsewhere(monkeypatch):
    """The backend launches on 'cuda' (as on a GPU machine); any Triton launch fails the test."""
    monkeypatch.setattr(library, "device_type", lambda: "cuda")

    def no_launch(*a, **kw):
        raise AssertionError("a Triton kernel was launched on tensors of another device")
    monkeypatch.setattr(triton.runtime.jit.JITFunction, "run", no_launch)
    if hasattr(triton.runtime, "interpreter"):
        monkeypatch.setattr(triton.runtime.interpreter.InterpretedFunction, "run", no_launch)


def _leaves(*shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).requires_grad_(True) for s in shapes]


def _same(fn, ref, leaves, *extra):
    """fn and ref agree bitwise on outputs and on the leaves' gradients (the same PyTorch ops run)."""
    outs = []
    for f in (fn, ref):
        ls = [t.detach().clone().requires_grad_(True) for t in leaves]
        out = f(*ls, *extra)
        out = out if isinstance(out, tuple) else (out,)
        sum(o.float().sum() * (i + 1) for i, o in enumerate(out)).backward()
        outs.append(([o.detach() for o in out], [t.grad for t in ls]))
    for a, b in zip(outs[0][0] + outs[0][1], outs[1][0] + outs[1][1]):
        assert torch.equal(a, b)


def test_norms(elsewhere):
    x, r, w, b = _leaves((4, 16), (4, 16), (16,), (16,))
    _same(lambda x, w: F.rms_norm(x, w, 1e-6), lambda x, w: norms.reference_rms_norm(x, w, 1e-6), [x, w])
    _same(lambda x, r, w: F.add_rms_norm(x, r, w, 1e-6), lambda x, r, w: norms.reference_add_rms_norm(x, r, w, 1e-6),
          [x, r, w])
    _same(F.layer_norm, norms.reference_layer_norm, [x, w, b])
    _same(F.add_layer_norm, norms.reference_add_layer_norm, [x, r, w, b])


def test_gated(elsewhere):
    _same(F.silu_and_mul, gated.reference_silu_and_mul, _leaves((3, 8), (3, 8)))


def test_rope(elsewhere):
    q, k, cos, sin = _leaves((1, 2, 3, 8), (1, 1, 3, 8), (1, 3, 8), (1, 3, 8))
    _same(F.rope, rotary.reference_rope, [q, k], cos.detach(), sin.detach())


def test_losses(elsewhere):
    (logits,) = _leaves((5, 7))
    t = torch.tensor([1, -100, 6, 0, 3])
    _same(lambda z: F.cross_entropy(z, t, label_smoothing=0.1),
          lambda z: cross_entropy_loss.reference_cross_entropy(z, t, label_smoothing=0.1), [logits])
    h, w = _leaves((5, 4), (7, 4))
    _same(lambda h, w: F.fused_linear_cross_entropy(h, w, t, reduction="sum"),
          lambda h, w: linear_cross_entropy.reference_fused_linear_cross_entropy(h, w, t, reduction="sum"), [h, w])


def test_moe(elsewhere):
    x, tw, wgu, wd = _leaves((3, 8), (3, 2), (4, 12, 8), (4, 8, 6))
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]])
    _same(lambda *a: F.moe_experts(a[0], ids, *a[1:]),
          lambda *a: moe.reference_moe_experts(a[0], ids, *a[1:]), [x, tw, wgu, wd])


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_reference_cross_entropy_class_weights_as_torch(reduction, smoothing):
    # the reference's class weights (the path fused ops take off the backend's device) against torch's own
    g = torch.Generator().manual_seed(3)
    z = torch.randn(6, 5, generator=g, dtype=torch.float64)
    wt = torch.rand(5, generator=g, dtype=torch.float64) + 0.5
    t = torch.tensor([0, 4, -100, 2, 2, 1])
    got = cross_entropy_loss.reference_cross_entropy(z, t, weight=wt, reduction=reduction, label_smoothing=smoothing)
    want = torch.nn.functional.cross_entropy(z, t, weight=wt, reduction=reduction, label_smoothing=smoothing)
    torch.testing.assert_close(got, want)
    unweighted = cross_entropy_loss.reference_cross_entropy(z, t, reduction=reduction, label_smoothing=smoothing)
    assert not torch.allclose(got, unweighted)
