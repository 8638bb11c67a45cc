"""torch.compile of gems.fused ops and of a patched Hugging Face model (docs/torch-compile.md).

Each fused op compiled with fullgraph=True (a graph break raises) and the aot_eager backend (Dynamo and
AOTAutograd, the ops' fake kernels and autograd formulas, no code generation): forward and backward
equal the eager call (the same kernels run) and are within the dtype's tolerance of the float64
reference. `torch.library.opcheck` checks each custom operator's schema, fake kernel (shapes, dtypes,
strides against the real kernel's outputs) and autograd registration. A tiny patched Llama compiles
with no more graph breaks than the unpatched model, with and without gems.enable(); one test runs
inductor when it can build (a C++ compiler on CPU).
"""
import shutil

import pytest
import torch

import gems
import gems.fused as F
from gems.fused import cross_entropy_loss as ce
from gems.fused import gated, linear_cross_entropy as lce, norms, rotary
from harness import DEVICE, ON_GPU, assert_close, dtype_params, make, to_ref

transformers = pytest.importorskip("transformers")


def _compile(fn, backend="aot_eager", **kw):
    torch._dynamo.reset()
    return torch.compile(fn, backend=backend, fullgraph=True, **kw)


def _run(fn, inputs, seed=0):
    """(outputs, input gradients) of fn(*inputs) with a fixed random output gradient."""
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
              for t in inputs]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    g = torch.Generator(device="cpu").manual_seed(seed)
    loss = sum((o.double() * torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.device)).sum()
               for o in outs)
    loss.backward()
    grads = [t.grad if isinstance(t, torch.Tensor) and t.requires_grad else None for t in leaves]
    return [o.detach() for o in outs], grads


def _check(fn, ref, inputs, dtype, rtol=None, atol=None, bitwise=True):
    """Compiled == eager (bitwise: the same kernels; bitwise=False where the call takes the composite
    reference, whose traced graph may order its reductions differently on a GPU), and both within the
    dtype's tolerance of ref in float64, or within 2x the error of ref itself at the test dtype."""
    eager = _run(fn, inputs)
    comp = _run(_compile(fn), inputs)
    for a, b in zip(eager[0] + eager[1], comp[0] + comp[1]):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
            if bitwise:
                assert torch.equal(a, b) or (a.isnan().any() and torch.allclose(a, b, equal_nan=True))
            else:
                assert_close(b, a.double(), dtype)
    # every tensor to the float64 CPU world (integer targets too: only float ones become float64)
    refd = _run(ref, [to_ref(t).requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
                      for t in inputs])
    low = _run(ref, inputs)    # the reference at the test dtype: its own rounding error (harness' 2x rule)
    for got, want, aten in zip(comp[0] + comp[1], refd[0] + refd[1], low[0] + low[1]):
        if want is not None:
            assert_close(got, want, dtype, aten=aten, rtol=rtol, atol=atol)


def _req(t):
    return t.requires_grad_(True)


# ------------------------------------------------------------------------------------------ norms
@dtype_params()
@pytest.mark.parametrize("casting", ["llama", "gemma"])
def test_rms_norm(dtype, casting):
    big = make((6, 2 * 37), dtype)
    x = _req(big[:, :37].detach())                  # row-strided: read in place
    r = _req(make((6, 37), dtype))
    w = _req(make((37,), dtype))
    off = 1.0 if casting == "gemma" else 0.0
    _check(lambda x, w: F.rms_norm(x, w, 1e-6, offset=off, casting=casting),
           lambda x, w: norms.reference_rms_norm(x, w, 1e-6, offset=off, casting=casting), [x, w], dtype)
    _check(lambda x, r, w: F.add_rms_norm(x, r, w, 1e-6, offset=off, casting=casting),
           lambda x, r, w: norms.reference_add_rms_norm(x, r, w, 1e-6, offset=off, casting=casting), [x, r, w], dtype)


@dtype_params()
@pytest.mark.parametrize("affine", ["both", "weight", "none"])
def test_layer_norm(dtype, affine):
    x, r = _req(make((5, 3, 40), dtype)), _req(make((5, 3, 40), dtype))
    w = _req(make((40,), dtype)) if affine != "none" else None
    b = _req(make((40,), dtype)) if affine == "both" else None
    _check(lambda x, w, b: F.layer_norm(x, w, b), norms.reference_layer_norm, [x, w, b], dtype)
    _check(lambda x, r, w, b: F.add_layer_norm(x, r, w, b), norms.reference_add_layer_norm, [x, r, w, b], dtype)


def test_rms_norm_frozen_weight_and_residual_only():
    """Only the gradients autograd needs are computed; an output that does not reach the loss is fine."""
    x, r, w = _req(make((4, 24))), _req(make((4, 24))), make((24,))
    _check(lambda x, r, w: F.add_rms_norm(x, r, w)[1] * 2, lambda x, r, w: (x + r) * 2, [x, r, w], torch.float32)
    _check(lambda x, w: F.rms_norm(x, w), norms.reference_rms_norm, [x, w], torch.float32)


# ------------------------------------------------------------------------------------------ gated
@dtype_params()
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh"])
def test_gated(dtype, act):
    gu = make((3, 5, 2 * 48), dtype)
    gate, up = (_req(t.detach()) for t in gu.chunk(2, -1))   # row-strided halves of one projection
    fn = {"silu": lambda g, u: F.silu_and_mul(g, u),
          "gelu": lambda g, u: F.gelu_and_mul(g, u),
          "gelu_tanh": lambda g, u: F.gelu_and_mul(g, u, approximate="tanh")}[act]
    ref = {"silu": gated.reference_silu_and_mul, "gelu": gated.reference_gelu_and_mul,
           "gelu_tanh": lambda g, u: gated.reference_gelu_and_mul(g, u, "tanh")}[act]
    _check(fn, ref, [gate, up], dtype)
    _check(fn, ref, [gate, up.detach()], dtype)       # up frozen: only dgate


# ------------------------------------------------------------------------------------------ rope
@dtype_params()
@pytest.mark.parametrize("unsqueeze_dim", [1, 2])
def test_rope(dtype, unsqueeze_dim):
    B, S, Hq, Hkv, D = 2, 5, 4, 2, 16
    if unsqueeze_dim == 1:   # HF's transposed views of the projections
        q = _req(make((B, S, Hq, D), dtype).transpose(1, 2).detach())
        k = _req(make((B, S, Hkv, D), dtype).transpose(1, 2).detach())
    else:
        q, k = _req(make((B, S, Hq, D), dtype)), _req(make((B, S, Hkv, D), dtype))
    cos, sin = make((1, S, D), dtype), make((1, S, D), dtype)
    _check(lambda q, k, c, s: F.rope(q, k, c, s, unsqueeze_dim=unsqueeze_dim),
           lambda q, k, c, s: rotary.reference_rope(q, k, c, s, unsqueeze_dim=unsqueeze_dim), [q, k, cos, sin], dtype)


def test_rope_cos_sin_grad_takes_the_reference():
    q, k = _req(make((1, 2, 3, 8))), _req(make((1, 2, 3, 8)))
    cos, sin = _req(make((1, 3, 8))), _req(make((1, 3, 8)))
    _check(lambda *a: F.rope(*a), rotary.reference_rope, [q, k, cos, sin], torch.float32, bitwise=False)


# ------------------------------------------------------------------------------------------ losses
@dtype_params()
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy(dtype, reduction):
    logits = _req(make((7, 50), dtype))
    target = torch.randint(0, 50, (7,), device=DEVICE)
    target[2] = -100
    _check(lambda x, t: F.cross_entropy(x, t, reduction=reduction, label_smoothing=0.1),
           lambda x, t: ce.reference_cross_entropy(x, t, reduction=reduction, label_smoothing=0.1),
           [logits, target], dtype)


def test_cross_entropy_weight_and_divisor():
    logits, target = _req(make((6, 30))), torch.randint(0, 30, (6,), device=DEVICE)
    w = make((30,), low=0.5, high=2.0)
    _check(lambda x, t: F.cross_entropy(x, t, weight=w),
           lambda x, t: torch.nn.functional.cross_entropy(x, t, w.to(x)), [logits, target], torch.float32)
    _check(lambda x, t: F.cross_entropy(x, t, reduction="sum", divisor=4),
           lambda x, t: ce.reference_cross_entropy(x, t, reduction="sum", divisor=4), [logits, target], torch.float32)


@dtype_params()
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_linear_cross_entropy(dtype, reduction, bias):
    N, H, V = 9, 16, 40
    h, w = _req(make((N, H), dtype, low=-1, high=1)), _req(make((V, H), dtype, low=-1, high=1))
    b = _req(make((V,), dtype)) if bias else None
    target = torch.randint(0, V, (N,), device=DEVICE)
    target[0] = -100
    tol = dict(rtol=2e-2, atol=2e-2) if dtype != torch.float32 else {}
    _check(lambda h, w, t, b: F.fused_linear_cross_entropy(h, w, t, b, reduction=reduction, chunk_size=4),
           lambda h, w, t, b: lce.reference_fused_linear_cross_entropy(h, w, t, b, reduction=reduction),
           [h, w, target, b], dtype, **tol)


def test_fused_linear_cross_entropy_frozen_weight():
    h, w, t = _req(make((5, 8))), make((12, 8)), torch.randint(0, 12, (5,), device=DEVICE)
    _check(lambda h, w, t: F.fused_linear_cross_entropy(h, w, t), lce.reference_fused_linear_cross_entropy,
           [h, w, t], torch.float32)


# ------------------------------------------------------------------------------------------ operators
def _opcheck_cases():
    x, w, r = make((4, 24)), make((24,)), make((4, 24))
    b = make((24,))
    q, k = make((1, 3, 2, 8)).transpose(1, 2), make((1, 3, 2, 8)).transpose(1, 2)
    cs = make((1, 3, 8))
    logits, t = make((5, 20)), torch.randint(0, 20, (5,), device=DEVICE)
    h, lw = make((5, 8)), make((20, 8))
    ops = torch.ops.gems
    return [
        (ops.rms_norm.default, (x, None, w, 1e-6, 0.0, False)),
        (ops.rms_norm.default, (x, r, w, 1e-6, 1.0, True)),
        (ops.layer_norm.default, (x, r, w, b, 1e-5)),
        (ops.layer_norm.default, (x, None, None, None, 1e-5)),
        (ops.gated_and_mul.default, (x, r, 0)),
        (ops.rope.default, (q, k, cs, cs, 1, False)),
        (ops.cross_entropy.default, (logits, t, None, None, -100, 0.0, "mean", torch.float32, True)),
        (ops.cross_entropy.default, (logits, t, None, None, -100, 0.1, "none", torch.float32, True)),
        (ops.fused_linear_cross_entropy.default, (h, lw, t, None, None, -100, 0.0, "mean", 2, torch.float32,
                                                  True, True, False)),
        (ops.fused_linear_cross_entropy.default, (h, lw, t, None, None, -100, 0.0, "none", 2, torch.float32,
                                                  True, True, False)),
        (ops.moe_experts.default, _moe_op_args()),
        (ops.rope.default, (q, k, cs, cs, 1, True)),
    ]


def _moe_inputs(T=6, h=16, E=4, k=2, I=8):
    """hidden, topk_ids, topk_weights, w_gate_up [E, 2I, h], w_down [E, h, I] (fixed seed)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(DEVICE)
    return make((T, h)), ids, make((T, k)).softmax(-1), make((E, 2 * I, h)), make((E, h, I))


def _moe_op_args():
    """gems::moe_experts' arguments: the gate and up weights as tensors of their own."""
    x, ids, w, wgu, wd = _moe_inputs()
    i = wd.shape[2]
    return x, ids, w, wgu[:, :i].contiguous(), wgu[:, i:].contiguous(), wd


@pytest.mark.parametrize("case", range(12))
def test_opcheck(case):
    # the families define their operators when imported (gems.fused resolves names lazily)
    F.rms_norm, F.layer_norm, F.silu_and_mul, F.rope, F.cross_entropy, F.fused_linear_cross_entropy  # noqa: B018
    F.moe_experts  # noqa: B018
    op, args = _opcheck_cases()[case]
    args = tuple(a.requires_grad_(True) if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dim() > 1
                 else a for a in args)
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_autograd_registration",
                                                "test_aot_dispatch_static"))


@dtype_params()
def test_moe_experts(dtype):
    from gems.fused import moe
    hidden, ids, wts, wgu, wd = (t.to(dtype) if t.is_floating_point() else t for t in _moe_inputs())
    _check(lambda x, w, a, b: F.moe_experts(x, ids, w, a, b),
           lambda x, w, a, b: moe.reference_moe_experts(x, ids.to(x.device), w, a, b),
           [_req(hidden), _req(wts), _req(wgu), _req(wd)], dtype)


def test_dynamic_shapes():
    """A second size recompiles with symbolic sizes: the fake kernels take SymInts."""
    def fn(x, w, q, k, c, s):
        qo, ko = F.rope(q, k, c, s)
        return F.rms_norm(x, w).sum() + qo.sum() + ko.sum()
    comp = _compile(fn, dynamic=True)
    for n in (3, 5):
        args = [_req(make((n, 16))), _req(make((16,))), _req(make((1, 2, n, 8))), _req(make((1, 2, n, 8))),
                make((1, n, 8)), make((1, n, 8))]
        out = comp(*args)
        out.backward()
        ref = fn(*[a.detach() for a in args])
        assert_close(out.detach(), ref, torch.float32)


# ------------------------------------------------------------------------------------------ models
def _llama(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg).to(DEVICE)


def _step(model, fwd, ids):
    model.zero_grad(set_to_none=True)
    out = fwd(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _breaks(model, ids):
    torch._dynamo.reset()
    return torch._dynamo.explain(model)(input_ids=ids, labels=ids).graph_break_count


def _compare(a, b, atol=1e-5):
    assert_close(a[0], b[0], torch.float32, atol=atol)
    assert a[1].keys() == b[1].keys()
    for n in a[1]:
        assert_close(a[1][n], b[1][n], torch.float32, atol=atol, msg=n)


@pytest.mark.parametrize("patch,enabled", [(True, False), (True, True), (False, True)],
                         ids=["patch", "patch+enable", "enable"])
def test_llama_compiles_without_graph_breaks_from_gems(patch, enabled):
    """A tiny Llama's training step (forward, loss, backward) compiled with fullgraph=True: patched
    (fused ops as custom operators), with Gems serving the graph's ATen ops, or both."""
    ids = torch.randint(0, 128, (2, 8), device=DEVICE)
    plain = _llama()
    plain_breaks = _breaks(plain, ids)
    ref = _step(plain, plain, ids)
    model = _llama()
    if patch:
        report = gems.patch(model)
        assert {"rms_norm", "add_rms_norm", "silu_and_mul", "rope"} <= set(report.replaced)
    if enabled:
        gems.enable()
        gems.reset_stats()
    try:
        assert _breaks(model, ids) <= plain_breaks       # Gems adds no graph break
        eager = _step(model, model, ids)
        torch._dynamo.reset()
        if enabled:
            gems.reset_stats()
        got = _step(model, torch.compile(model, backend="aot_eager", fullgraph=True), ids)
        if enabled:    # the compiled graph's ATen ops are Gems' (served at run time, below the graph)
            assert sum(s["served"] for s in gems.stats().values()) > 0
    finally:
        if enabled:
            gems.disable()
        torch._dynamo.reset()
    _compare(got, eager)
    _compare(got, ref, atol=1e-4)


def test_glm4_partial_interleaved_rotary_compiles():
    """GLM4's rotary (interleaved pairs on the first half of each head) patched and compiled with
    fullgraph=True: Dynamo reads the patched attention's apply_rotary_pos_emb, whose closure says
    which form it computes, through the module namespace Gems gives the patched forward."""
    torch.manual_seed(0)
    cfg = transformers.Glm4Config(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, vocab_size=128, pad_token_id=0)
    ids = torch.randint(1, 128, (2, 8), device=DEVICE)
    plain = transformers.Glm4ForCausalLM(cfg).to(DEVICE)
    model = transformers.Glm4ForCausalLM(cfg).to(DEVICE)
    model.load_state_dict(plain.state_dict())
    assert "rope" in gems.patch(model).replaced
    try:
        assert _breaks(model, ids) <= _breaks(plain, ids)
        eager = _step(model, model, ids)
        got = _step(model, torch.compile(model, backend="aot_eager", fullgraph=True), ids)
    finally:
        torch._dynamo.reset()
    _compare(got, eager)
    _compare(got, _step(plain, plain, ids), atol=1e-4)


def _inductor_available():
    if ON_GPU:
        return True
    return shutil.which("g++") is not None or shutil.which("c++") is not None


@pytest.mark.skipif(not _inductor_available(), reason="inductor needs a C++ compiler on CPU")
def test_inductor():
    """The default backend: inductor generates code around the custom operators, which it calls as
    extern kernels."""
    x, w = _req(make((4, 32))), _req(make((32,)))
    g, u = _req(make((4, 32))), _req(make((4, 32)))
    t = torch.randint(0, 32, (4,), device=DEVICE)

    def fn(x, w, g, u, t):
        h = F.rms_norm(x, w) * F.silu_and_mul(g, u)
        return F.cross_entropy(h.sin(), t)
    eager = _run(fn, [x, w, g, u, t])
    got = _run(_compile(fn, backend="inductor"), [x, w, g, u, t])
    for a, b in zip(eager[0] + eager[1], got[0] + got[1]):
        if a is not None:
            assert_close(b, a, torch.float32, atol=1e-5)

