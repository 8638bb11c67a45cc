"""gems.patch / unpatch / patched on tiny Hugging Face models (CPU, fp32).

Wiring tests run with PyTorch stand-ins for gems.fused (the reference formulas, counted): they prove that
the patch routes each model's computation to gems.fused, that the patched model computes what the
unpatched one does (forward, loss, gradients, generate), and that unpatch restores the exact objects.
Integration tests at the end run the real Triton kernels (interpreter) in patched models.
"""
import collections
import contextlib
import copy
import importlib
import inspect

import pytest
import torch
import torch.nn.functional as TF

import gems
import gems.fused
import gems_models
from gems.patching.modules import GemsRMSNorm
from gems.fused.rotary import reference_rope
from harness import DEVICE, ON_GPU, assert_close, make

FUSED = ("rms_norm", "add_rms_norm", "layer_norm", "add_layer_norm", "silu_and_mul", "gelu_and_mul", "rope",
         "cross_entropy", "fused_linear_cross_entropy")


# ------------------------------------------------------------------------------------------ stand-ins
def _rms(x, w, eps, offset=0.0, casting="llama"):
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if casting == "gemma":
        return (y * (offset + w.float())).to(x.dtype)
    return (w + offset) * y.to(x.dtype)


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _standins():
    def rms_norm(x, weight, eps=1e-6, *, offset=0.0, casting="llama"):
        return _rms(x, weight, eps, offset, casting)

    def add_rms_norm(x, residual, weight, eps=1e-6, *, offset=0.0, casting="llama"):
        s = residual + x
        return _rms(s, weight, eps, offset, casting), s

    def layer_norm(x, weight, bias, eps=1e-5):
        return TF.layer_norm(x, (x.shape[-1],), weight, bias, eps)

    def add_layer_norm(x, residual, weight, bias, eps=1e-5):
        s = x + residual
        return TF.layer_norm(s, (s.shape[-1],), weight, bias, eps), s

    def silu_and_mul(gate, up):
        return TF.silu(gate) * up

    def gelu_and_mul(gate, up, approximate="none"):
        return TF.gelu(gate, approximate=approximate) * up

    def rope(q, k, cos, sin, position_ids=None, unsqueeze_dim=1, interleaved=False):
        if interleaved:
            return reference_rope(q, k, cos, sin, None, unsqueeze_dim, interleaved=True)
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin

    def _loss(logits, target, ignore_index, label_smoothing, reduction, out_dtype, divisor):
        loss = TF.cross_entropy(logits.float(), target, ignore_index=ignore_index,
                                label_smoothing=label_smoothing, reduction=reduction)
        if divisor is not None:
            loss = loss / divisor
        return loss.to(out_dtype) if out_dtype is not None else loss

    def cross_entropy(logits, target, *, ignore_index=-100, label_smoothing=0.0, reduction="mean", out_dtype=None,
                      divisor=None):
        return _loss(logits, target, ignore_index, label_smoothing, reduction, out_dtype, divisor)

    def fused_linear_cross_entropy(hidden, weight, target, bias=None, *, ignore_index=-100, label_smoothing=0.0,
                                   reduction="mean", out_dtype=None, divisor=None):
        return _loss(TF.linear(hidden, weight, bias), target, ignore_index, label_smoothing, reduction, out_dtype,
                     divisor)

    return {k: v for k, v in locals().items() if k in FUSED}


@contextlib.contextmanager
def _fused_as(fns: dict):
    """gems.fused's public names bound to `fns` for the block (counted), then exactly as before."""
    calls = collections.Counter()
    ns = gems.fused.__dict__
    saved = {k: ns[k] for k in fns if k in ns}

    def counted(name, fn):
        def f(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return f
    ns.update({k: counted(k, v) for k, v in fns.items()})
    try:
        yield calls
    finally:
        for k in fns:
            ns.pop(k, None)
        ns.update(saved)


@pytest.fixture
def standins():
    with _fused_as(_standins()) as calls:
        yield calls


# ------------------------------------------------------------------------------------------ models
_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=256)


def _build(name, dropout=0.0, batch=2, seq_len=8):
    """(model, inference kwargs, training kwargs) of a tiny fp32 CPU model."""
    if name in ("mistral", "qwen2"):
        import transformers
        cfg_cls = {"mistral": transformers.MistralConfig, "qwen2": transformers.Qwen2Config}[name]
        mdl_cls = {"mistral": transformers.MistralForCausalLM, "qwen2": transformers.Qwen2ForCausalLM}[name]
        cfg = cfg_cls(**_TINY, attention_dropout=dropout)
        torch.manual_seed(0)
        m = mdl_cls(cfg).to(DEVICE).eval()
        inf, tr = gems_models.make_inputs("causal_lm", cfg, batch=batch, seq_len=seq_len, device=DEVICE,
                                     dtype=torch.float32)
        return m, inf, tr
    b = gems_models.build(name, size="tiny", device=DEVICE, dtype="float32", batch=batch, seq_len=seq_len, dropout=dropout)
    return b.model, b.inputs, b.train_inputs


# every option on (layer_norm is opt-in)
ALL = dict(layer_norm=True)
# model -> fused ops its report must list (with every option on: gems.patch(model, **ALL))
EXPECT = {
    "llama2": {"rms_norm": 5, "add_rms_norm": 2, "silu_and_mul": 2, "rope": 2, "cross_entropy": 1,
               "fused_linear_cross_entropy": 1},
    "bert": {"encoder_layer": 2, "layer_norm": 6, "add_layer_norm": 4, "cross_entropy": 1},
    "llava": {"rms_norm": 5, "add_rms_norm": 2, "silu_and_mul": 2, "rope": 2, "layer_norm": 6,
              "add_layer_norm": 2, "cross_entropy": 1, "fused_linear_cross_entropy": 1},
}
EXPECT["aquila"] = EXPECT["mistral"] = EXPECT["qwen2"] = EXPECT["llama2"]
# fused ops a training step must call (eval forward: the loss ops differ)
CALLED_TRAIN = {
    "llama2": {"rms_norm", "add_rms_norm", "silu_and_mul", "rope", "fused_linear_cross_entropy"},
    "bert": {"layer_norm", "add_layer_norm", "cross_entropy"},
    "llava": {"rms_norm", "add_rms_norm", "silu_and_mul", "rope", "layer_norm", "add_layer_norm",
              "fused_linear_cross_entropy"},
}
CALLED_TRAIN["aquila"] = CALLED_TRAIN["mistral"] = CALLED_TRAIN["qwen2"] = CALLED_TRAIN["llama2"]
NAMES = ["llama2", "aquila", "mistral", "qwen2", "bert", "llava"]


def _snapshot(model):
    """Everything unpatch must restore: module objects by name, instance attributes, parameters."""
    mods = dict(model.named_modules())
    inst = {n: dict(m.__dict__) for n, m in mods.items()}
    return mods, inst, dict(model.named_parameters())


def _assert_restored(model, snap):
    mods, inst, params = snap
    now = dict(model.named_modules())
    assert list(now) == list(mods)
    for n, m in now.items():
        assert m is mods[n], n
        assert set(m.__dict__) == set(inst[n]), (n, set(m.__dict__) ^ set(inst[n]))
        assert "forward" not in m.__dict__ or inst[n].get("forward") is m.__dict__["forward"]
        for k in ("_modules", "_parameters", "_buffers"):
            assert m.__dict__[k] == inst[n][k], (n, k)
    assert all(p is params[n] for n, p in model.named_parameters())


def _run(model, inf, tr, seed=0):
    """(eval logits, training loss, grads by name, training output) of one model."""
    model.eval()
    with torch.no_grad():
        logits = model(**inf).logits
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = model(**tr)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    model.eval()
    return logits, out.loss.detach(), grads, out


def _assert_same(got, ref, atol=1e-5, rtol=1e-5):
    lg, loss, grads, _ = got
    lr, lossr, gradsr, _ = ref
    torch.testing.assert_close(lg, lr, atol=atol, rtol=rtol)
    torch.testing.assert_close(loss, lossr, atol=atol, rtol=rtol)
    assert set(grads) == set(gradsr)
    for n in gradsr:
        torch.testing.assert_close(grads[n], gradsr[n], atol=atol, rtol=rtol, msg=lambda m: f"grad {n}: {m}")


# --------------------------------------------------------------------------------------- wiring tests
@pytest.mark.parametrize("name", NAMES)
def test_patch_routes_to_fused_and_agrees(name, standins):
    model, inf, tr = _build(name)
    rope_global = importlib.import_module(type(model).__module__).__dict__.get("apply_rotary_pos_emb")
    ref = _run(model, inf, tr)
    keys = list(model.state_dict())
    snap = _snapshot(model)

    report = gems.patch(model, **ALL)
    assert report.counts() == EXPECT[name], report.summary()
    assert model._gems_patch is report
    assert list(model.state_dict()) == keys                                   # same keys ...
    assert all(p is snap[2][n] for n, p in model.named_parameters())          # ... same Parameter objects
    assert not report.notes, report.notes
    standins.clear()
    got = _run(model, inf, tr)
    _assert_same(got, ref)
    assert CALLED_TRAIN[name] <= set(standins), dict(standins)
    if name != "bert":
        assert got[3].logits is None            # training with labels: the logits are never computed
    # unpatched: the same objects as before, and no module global was ever touched
    assert gems.unpatch(model) is report
    _assert_restored(model, snap)
    assert not hasattr(model, "_gems_patch")
    assert importlib.import_module(type(model).__module__).__dict__.get("apply_rotary_pos_emb") is rope_global
    standins.clear()
    _assert_same(_run(model, inf, tr), ref)
    assert not standins                         # nothing routes to gems.fused any more


@pytest.mark.parametrize("name", ["llama2", "qwen2", "llava"])
def test_generate_patched(name, standins):
    model, inf, _ = _build(name)
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    ref = model.generate(**inf, **kw)
    with gems.patched(model) as report:
        assert report.counts()["rope"] == 2
        got = model.generate(**inf, **kw)
        assert "logits_to_keep" in inspect.signature(model.forward).parameters   # generate reads it
    assert standins["rope"] >= 2 * 4 and standins["add_rms_norm"] >= 2 * 4   # every decode step
    assert torch.equal(got, ref)


def test_layer_norm_is_opt_in(standins):
    """By default BERT keeps its LayerNorms (ATen's, or Gems' native_layer_norm under gems.enable()): only
    the loss is fused; layer_norm=True adds the fused norms."""
    model, inf, tr = _build("bert")
    ref = _run(model, inf, tr)
    with gems.patched(model) as r:
        assert r.counts() == {"encoder_layer": 2, "cross_entropy": 1} and r.options["layer_norm"] is False
        standins.clear()
        _assert_same(_run(model, inf, tr), ref)
        assert set(standins) == {"cross_entropy"}


def test_options_select_what_is_replaced(standins):
    model, inf, tr = _build("llama2")
    ref = _run(model, inf, tr)
    r = gems.patch(model, rms_norm=False, rope=True, swiglu=False, cross_entropy=True,
                   fused_linear_cross_entropy=False)
    assert r.counts() == {"rope": 2, "cross_entropy": 1}
    standins.clear()
    got = _run(model, inf, tr)
    _assert_same(got, ref)
    assert got[3].logits is not None            # no fused linear CE: logits computed, loss by cross_entropy
    assert set(standins) == {"rope", "cross_entropy"}
    gems.unpatch(model)


def test_hidden_states_and_attentions_still_recorded(standins):
    """transformers records per-layer outputs with forward hooks on the decoder layers and attentions: they
    still fire on the patched instances."""
    model, inf, _ = _build("llama2")
    model.config._attn_implementation = "eager"
    kw = dict(output_hidden_states=True, output_attentions=True)
    ref = model(**inf, **kw)
    with gems.patched(model):
        got = model(**inf, **kw)
    assert standins["add_rms_norm"] == 2
    for a, b in zip(ref.hidden_states + ref.attentions, got.hidden_states + got.attentions, strict=True):
        torch.testing.assert_close(b, a)
    assert len(got.hidden_states) == 3 and len(got.attentions) == 2


def test_causal_lm_loss_contract(standins):
    """num_items_in_batch, ignore_index, shift_labels, return_dict=False and eval-mode labels like HF."""
    model, inf, tr = _build("llama2")
    labels = tr["labels"].clone()
    labels[0, :3] = -100
    n = torch.tensor(11)
    shift = torch.roll(labels, -1, dims=1)
    sevens = tr["labels"].clone()
    sevens[1, 2:5] = 7
    model.train()
    calls = [dict(labels=labels), dict(labels=labels, num_items_in_batch=n),
             dict(labels=labels, shift_labels=shift), dict(labels=sevens, ignore_index=7)]
    ref = [model(input_ids=tr["input_ids"], **c).loss for c in calls]
    ref_tuple = model(input_ids=tr["input_ids"], labels=labels, return_dict=False)
    model.eval()
    ref_eval = model(input_ids=tr["input_ids"], labels=labels)
    with gems.patched(model):
        model.train()
        for c, r in zip(calls, ref):
            torch.testing.assert_close(model(input_ids=tr["input_ids"], **c).loss, r)
        t = model(input_ids=tr["input_ids"], labels=labels, return_dict=False)
        assert isinstance(t, tuple) and len(t) == len(ref_tuple) - 1   # (loss, past_key_values): no logits
        torch.testing.assert_close(t[0], ref_tuple[0])
        assert standins["fused_linear_cross_entropy"] == len(calls) + 1 and not standins["cross_entropy"]
        model.eval()                            # eval with labels: logits computed, loss by cross_entropy
        e = model(input_ids=tr["input_ids"], labels=labels)
        torch.testing.assert_close(e.loss, ref_eval.loss)
        torch.testing.assert_close(e.logits, ref_eval.logits)
        assert standins["cross_entropy"] == 1


def test_bert_dropout_semantics_kept(standins):
    """Training with dropout on: the patched BERT draws the same dropout masks in the same order."""
    model, _, tr = _build("bert", dropout=0.1)
    model.train()
    torch.manual_seed(3)
    ref = model(**tr).loss
    with gems.patched(model, **ALL):
        torch.manual_seed(3)
        got = model(**tr).loss
        torch.manual_seed(4)
        other = model(**tr).loss
    torch.testing.assert_close(got, ref)
    assert not torch.equal(other, ref)          # dropout is really active
    assert standins["add_layer_norm"] == 2 * 2 * 2


# ------------------------------------------------------------------------- BERT's layer as one function
@pytest.fixture
def lean_calls(monkeypatch):
    """How often gems/patching/bert_layer.py's one-function path ran (its check passed), and fell back."""
    E = importlib.import_module("gems.patching.bert_layer")
    calls = collections.Counter()
    real = E._parts

    def spy(layer, classes):
        got = real(layer, classes)
        calls["lean" if got is not None else "class forward"] += 1
        return got
    monkeypatch.setattr(E, "_parts", spy)
    return calls


@pytest.mark.parametrize("layer_norm,fuse_qkv", [(False, False), (True, False), (False, True), (True, True)])
def test_bert_layer_as_one_function_agrees(lean_calls, standins, monkeypatch, layer_norm, fuse_qkv):
    """With dropout active (the same masks drawn) and a padding mask: without the fused QKV GEMM the same
    ATen ops in the same order (loss, logits and every gradient bit-identical to the unpatched model's);
    with it, equal to rounding."""
    monkeypatch.setattr(importlib.import_module("gems.patching.bert_layer"), "FUSE_QKV", fuse_qkv)
    model, inf, tr = _build("bert", dropout=0.1)
    tr = dict(tr, attention_mask=tr["attention_mask"].clone())
    tr["attention_mask"][1, 5:] = 0
    inf = dict(inf, attention_mask=tr["attention_mask"])
    assert model.config._attn_implementation == "sdpa"
    ref = _run(model, inf, tr, seed=5)
    with gems.patched(model, cross_entropy=False, layer_norm=layer_norm) as r:
        assert r.replaced["encoder_layer"] == ["bert.encoder.layer.0", "bert.encoder.layer.1"]
        got = _run(model, inf, tr, seed=5)
    assert lean_calls == {"lean": 2 * 2}      # two layers, eval and training forward
    if layer_norm:
        assert standins["add_layer_norm"] == 2 * 2 * 2
    if layer_norm or fuse_qkv:                # the fused add + LayerNorm stand-in, one QKV GEMM: rounding
        _assert_same(got, ref)
        return
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert all(torch.equal(got[2][n], ref[2][n]) for n in ref[2])


def test_bert_layer_one_function_off(lean_calls, standins):
    model, inf, tr = _build("bert")
    with gems.patched(model, encoder_layer=False) as r:
        assert "encoder_layer" not in r.replaced
        _run(model, inf, tr)
    assert not lean_calls


class _Scaled(torch.nn.Linear):
    """A subclass of nn.Linear with its own forward (as adapters such as LoRA wrap a projection)."""

    def forward(self, x):
        return super().forward(x) * 1.5


@pytest.mark.parametrize("case", ["hook", "subclass", "eager", "output_attentions", "instance_forward"])
def test_bert_layer_one_function_falls_back(lean_calls, standins, case):
    """Where the one-function path would not compute what the class forward does, the class forward
    runs: a hook on a submodule it would skip, a submodule of another class, another attention
    implementation, keyword arguments it does not know, an instance forward set by another library."""
    model, inf, tr = _build("bert")
    layer = model.bert.encoder.layer[1]
    fired = []
    if case == "hook":
        layer.attention.self.query.register_forward_hook(lambda m, a, o: fired.append(1))
    elif case == "subclass":
        old = layer.attention.self.value
        new = _Scaled(old.in_features, old.out_features).to(old.weight.device)
        new.load_state_dict(old.state_dict())
        layer.attention.self.value = new
    elif case == "eager":
        model.config._attn_implementation = "eager"
    elif case == "instance_forward":
        d = layer.intermediate.dense
        d.forward = lambda x, _f=type(d).forward, _d=d: _f(_d, x) * 0.5
    kw = {"output_attentions": True} if case == "output_attentions" else {}
    model.eval()
    with torch.no_grad():
        ref = model(**inf, **kw)
        with gems.patched(model, cross_entropy=False) as r:
            assert len(r.replaced["encoder_layer"]) == 2
            got = model(**inf, **kw)
    torch.testing.assert_close(got.logits, ref.logits)     # (the other layer: one QKV GEMM, rounding)
    if case == "hook":
        assert len(fired) == 2                # fired unpatched and patched
    if case == "output_attentions":           # (sdpa records none; transformers' capture hooks are installed)
        assert len(got.attentions) == len(ref.attentions)
    # the layers the case touches (all of them, for model-wide cases) ran the class forward
    touched = 1 if case in ("hook", "subclass", "instance_forward") else 2
    if case == "output_attentions":           # an unknown keyword: the class forward, without the check
        assert not lean_calls
    else:
        assert lean_calls == {"class forward": touched, **({"lean": 2 - touched} if touched < 2 else {})}


def test_bert_layer_one_function_gradient_checkpointing(lean_calls, standins):
    model, inf, tr = _build("bert")
    model.gradient_checkpointing_enable()
    ref = _run(model, inf, tr)
    with gems.patched(model, cross_entropy=False):
        got = _run(model, inf, tr)
    _assert_same(got, ref)
    assert lean_calls["lean"] == 2 * 3        # eval, training forward, the backward's recomputation


def test_clip_vision_tower_alone(standins):
    import transformers
    cfg = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, image_size=28, patch_size=14)
    torch.manual_seed(0)
    m = transformers.CLIPVisionModel(cfg).to(DEVICE).eval()
    pix = torch.randn(2, 3, 28, 28, device=DEVICE)
    ref = m(pixel_values=pix)
    with gems.patched(m) as r:
        assert r.counts() == {}                 # layer_norm is opt-in: nothing else to fuse here
    with gems.patched(m, **ALL) as r:
        assert r.counts() == {"add_layer_norm": 2, "layer_norm": 6}
        got = m(pixel_values=pix)
    torch.testing.assert_close(got.last_hidden_state, ref.last_hidden_state)
    torch.testing.assert_close(got.pooler_output, ref.pooler_output)
    assert standins["add_layer_norm"] == 2 and standins["layer_norm"] == 4


def test_modules_with_their_own_forward_are_left_alone(standins):
    """A module another library wrapped (an instance forward, or accelerate's _hf_hook) keeps its wrapper."""
    model, inf, tr = _build("llama2")
    layer0, norm = model.model.layers[0], model.model.norm
    wrapper = layer0.forward          # a bound method of the class: stands for a hook's wrapper
    layer0.forward = wrapper
    norm._hf_hook = object()
    ref = _run(model, inf, tr)
    with gems.patched(model) as r:
        assert r.replaced["add_rms_norm"] == ["model.layers.1"] and "model.norm" not in r.replaced["rms_norm"]
        assert "2 module(s) with their own forward" in r.notes[0]
        assert layer0.forward is wrapper and model.model.norm is norm
        _assert_same(_run(model, inf, tr), ref)
    assert layer0.__dict__["forward"] is wrapper


def test_gradient_checkpointing(standins):
    model, inf, tr = _build("qwen2")
    model.gradient_checkpointing_enable()
    ref = _run(model, inf, tr)
    with gems.patched(model):
        standins.clear()
        got = _run(model, inf, tr)
    _assert_same(got, ref)
    # 2 layers: eval forward, training forward, and once more in the backward (the recomputation)
    assert standins["add_rms_norm"] == 2 * 3


def test_any_model_is_walked_by_structure():
    # GPT-2: no model-type list refuses it; its loss is proven and fused, its Conv1D + gelu_new MLP has no
    # fused op (left, not strict) but gelu_new's eight operations become one, its LayerNorms are opt-in
    import transformers
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    m = transformers.GPT2LMHeadModel(cfg)
    r = gems.patch(m, strict=True)
    assert r.counts() == {"activation": 1, "cross_entropy": 1, "fused_linear_cross_entropy": 1}, r.summary()
    assert [(e["module"], e["op"], e["strict"]) for e in r.left] == [("transformer.h.0.mlp", "mlp", False)]
    gems.unpatch(m)
    # a module without a config: walked too, nothing to replace
    lin = torch.nn.Linear(2, 2)
    r = gems.patch(lin)
    assert r.counts() == {} and r.model_type == "Linear" and not r.left
    gems.unpatch(lin)
    with pytest.raises(TypeError, match="takes a torch.nn.Module"):
        gems.patch(object())


def test_strict_refuses_what_is_not_proven(standins):
    # a Llama whose RMSNorm forward is not any casting rule (an extra scale): recognized, not proven
    model, _, _ = _build("llama2")
    norm = model.model.norm
    base = type(norm)

    def odd(self, x):
        return base.forward(self, x) * 2
    norm.__class__ = type("OddRMSNorm", (base,), {"forward": odd})
    snap = _snapshot(model)
    with pytest.raises(ValueError, match=r"strict=True.*model.norm \(rms_norm\): its forward matches no RMSNorm"):
        gems.patch(model, strict=True)
    _assert_restored(model, snap)
    r = gems.patch(model)
    assert [e["module"] for e in r.unproven()] == ["model.norm"] and model.model.norm is norm
    assert r.counts()["rms_norm"] == 4 and "not proven equivalent" in r.summary()
    gems.unpatch(model)


def test_patch_twice_and_unpatch_twice(standins):
    model, inf, tr = _build("llama2")
    r1 = gems.patch(model)
    fwd = model.model.layers[0].forward
    assert gems.patch(model) is r1                                  # same options: a no-op
    assert model.model.layers[0].forward == fwd
    with pytest.raises(RuntimeError, match="already patched with other options"):
        gems.patch(model, rope=False)
    with gems.patched(model) as r:                                  # already patched: left patched on exit
        assert r is r1
    assert model._gems_patch is r1
    assert gems.unpatch(model) is r1
    assert gems.unpatch(model) is None


def test_context_manager_restores_on_exception(standins):
    model, inf, tr = _build("llava")
    snap = _snapshot(model)
    with pytest.raises(KeyError):
        with gems.patched(model):
            assert model._gems_patch.counts()
            raise KeyError("boom")
    _assert_restored(model, snap)


def test_deepcopy_of_patched_model(standins):
    model, inf, tr = _build("llama2")
    ref = _run(model, inf, tr)
    gems.patch(model)
    twin = copy.deepcopy(model)
    snap_twin = None
    standins.clear()
    _assert_same(_run(twin, inf, tr), ref)
    assert standins["add_rms_norm"] and standins["fused_linear_cross_entropy"]
    gems.unpatch(twin)
    assert type(twin.model.norm).__name__ == "LlamaRMSNorm" and type(model.model.norm) is GemsRMSNorm
    assert "forward" not in twin.__dict__ and "forward" in model.__dict__
    _assert_same(_run(twin, inf, tr), ref)
    del snap_twin
    gems.unpatch(model)


def test_missing_fused_op_is_a_clear_error(standins):
    model, _, _ = _build("llama2")
    ns, where = gems.fused.__dict__, gems.fused._WHERE
    saved = ns.pop("rope")
    where["rope"] = "no_such_module"
    try:
        snap = _snapshot(model)
        with pytest.raises(RuntimeError, match=r"not available: rope .*Pass the option"):
            gems.patch(model)
        _assert_restored(model, snap)
        assert gems.patch(model, rope=False).counts().get("rope") is None
        gems.unpatch(model)
    finally:
        where["rope"] = "rotary"
        ns["rope"] = saved


def test_report_summary_and_dict(standins):
    model, _, _ = _build("bert")
    r = gems.patch(model, **ALL)
    d = r.to_dict()
    assert d["model_type"] == "bert" and d["replaced"] == EXPECT["bert"]
    assert "bert.encoder.layer.0.attention.output" in d["modules"]["add_layer_norm"]
    assert r.summary().startswith("gems.patch(bert): ")
    gems.unpatch(model)


# ----------------------------------------------------------------------------- real kernels (interpreter)
# gems.fused's Triton kernels (all nine ops) in the patched models: fp32 on CPU, so the patched model must
# match the unpatched one to rounding. Gradients that are zero in exact arithmetic (attention key biases)
# hold only rounding noise: compared with an absolute floor.
TOL = dict(atol=1e-4, rtol=1e-3) if ON_GPU else dict(atol=2e-5, rtol=1e-4)


def _assert_close_run(got, ref):
    _assert_same(got, ref, **TOL)


@pytest.mark.parametrize("name", [n for n in NAMES if n != "aquila"])   # aquila: llama's code path, above
def test_real_kernels_patched_agrees(name):
    for op in FUSED:    # every fused op the patch uses is the real one (not a stand-in left behind)
        assert getattr(gems.fused, op).__module__.startswith("gems.fused."), op
    model, inf, tr = _build(name, batch=1, seq_len=5)    # the interpreter: one program per row
    ref = _run(model, inf, tr)
    with gems.patched(model, **ALL) as report:
        assert report.counts() == EXPECT[name]
        got = _run(model, inf, tr)
    _assert_close_run(got, ref)
    if name != "bert":
        assert got[3].logits is None


def test_real_kernels_generate_and_compose_with_gems_ops():
    model, inf, tr = _build("llama2", batch=1, seq_len=4)
    kw = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    ref_tokens = model.generate(**inf, **kw)
    with torch.no_grad():
        ref_logits = model(**inf).logits
    with gems.patched(model):
        assert torch.equal(model.generate(**inf, **kw), ref_tokens)
        with gems.use_gems(include=["add.Tensor", "mul.Tensor"]), torch.no_grad():   # the unfused remainder
            before = gems.stats()
            logits = model(**inf).logits
            served = gems.stats()
    torch.testing.assert_close(logits, ref_logits, **TOL)
    n = lambda st: sum(v["served"] for k, v in st.items() if k in ("add.Tensor", "mul.Tensor"))  # noqa: E731
    assert n(served) > n(before)


def test_composite_activations_become_one_operator():
    # transformers' activation modules built from several operations are replaced by the one operator
    # they compute; single-operator ones, parameterized ones and ones computing something else are not
    from transformers.activations import ACT2FN
    from gems.patching import probes
    want = {"gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu_python": "gelu", "gelu": None,
            "gelu_pytorch_tanh": None, "silu": None, "quick_gelu": None, "relu": None}
    assert {k: probes.composite_activation(ACT2FN[k]) for k in want} == want
    assert probes.composite_activation(torch.nn.PReLU()) is None          # a parameter
    # the replaced module computes the same, forward and backward, and unpatch restores it
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), ACT2FN["gelu_new"], torch.nn.Linear(16, 8))
    x = make((5, 8))
    mlp = mlp.to(x.device)
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    ref = mlp(xa)
    ref.sum().backward()
    r = gems.patch(mlp)
    assert r.counts() == {"activation": 1}
    got = mlp(xb)
    got.sum().backward()
    assert_close(got, ref, torch.float32)
    assert_close(xb.grad, xa.grad, torch.float32)
    gems.unpatch(mlp)
    assert "forward" not in mlp[1].__dict__
    # activation=False leaves it
    assert gems.patch(mlp, activation=False).counts() == {}
    gems.unpatch(mlp)
