"""gems.patch family by family: a tiny random model (seeded, fp32, 2 layers, hidden 32) of each
architecture, run forward + backward unpatched (ATen) and patched (the fused ops alone: no
gems.use_gems()), compared, and the report's counts checked against what the architecture holds.

The expected counts are read off each architecture's structure, not off a patch report: per layer, an
RMSNorm decoder has its input and post-attention norms (+ q/k norms for Qwen3 / OLMo2 style, + pre/post
feed-forward norms for Gemma 2/3, + post norms for OLMo2 / GLM4), one final norm; one MLP and one rotary
attention per layer; a causal LM one loss. What must be left out is checked too (GLM4's interleaved
rotary; Granite's scaled and Gemma 2's soft-capped logits, and the MoE models' router loss, for the fused
linear loss; GPT-2's ungated MLP). MoE blocks count as 'moe' when gems/patching/moe.py takes them.

The models run on the test device (GEMS_TEST_DEVICE). Tolerance: fp32 throughout; the fused kernels reorder fp32 sums (row reductions, the loss's logsumexp),
so results agree to 2e-4 relative plus 2e-5 of the tensor's largest magnitude (absolute: an element that
cancels, e.g. a sum of a gradient's contributions, keeps the others' rounding), far below what a wrong
casting, offset, activation or gate/up swap produces (O(1e-2) or more at these sizes).
"""
from __future__ import annotations

import importlib

import pytest
import torch
import transformers as T

import gems
from harness import DEVICE

pytestmark = pytest.mark.filterwarnings("ignore")

L = 2     # layers
D = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=L, num_attention_heads=4, num_key_value_heads=2,
         vocab_size=64, max_position_embeddings=64, attention_dropout=0.0)
CAUSAL = {"cross_entropy": 1, "fused_linear_cross_entropy": 1}


def _dec(cls_cfg, cls_model, **kw):
    return lambda: cls_model(cls_cfg(**{**D, **kw}))


# family -> (builder, kind, expected counts); 'kind' picks the inputs and the loss
FAMILIES = {
    "llama": (_dec(T.LlamaConfig, T.LlamaForCausalLM), "causal",
              {"rms_norm": 2 * L + 1, "add_rms_norm": L, "silu_and_mul": L, "rope": L, **CAUSAL}),
    "mistral": (_dec(T.MistralConfig, T.MistralForCausalLM), "causal",
                {"rms_norm": 2 * L + 1, "add_rms_norm": L, "silu_and_mul": L, "rope": L, **CAUSAL}),
    "qwen2": (_dec(T.Qwen2Config, T.Qwen2ForCausalLM), "causal",
              {"rms_norm": 2 * L + 1, "add_rms_norm": L, "silu_and_mul": L, "rope": L, **CAUSAL}),
    "qwen3": (_dec(T.Qwen3Config, T.Qwen3ForCausalLM, head_dim=8), "causal",   # + q_norm, k_norm
              {"rms_norm": 4 * L + 1, "add_rms_norm": L, "silu_and_mul": L, "rope": L, **CAUSAL}),
    "gemma": (_dec(T.GemmaConfig, T.GemmaForCausalLM, head_dim=8), "causal",   # gelu-tanh, 1 + w
              {"rms_norm": 2 * L + 1, "add_rms_norm": L, "gelu_and_mul": L, "rope": L, **CAUSAL}),
    "gemma2": (_dec(T.Gemma2Config, T.Gemma2ForCausalLM, head_dim=8), "causal",   # 4 norms, soft-capped logits
               {"rms_norm": 4 * L + 1, "gelu_and_mul": L, "rope": L, "cross_entropy": 1}),
    "gemma3_text": (_dec(T.Gemma3TextConfig, T.Gemma3ForCausalLM, head_dim=8), "causal",   # + q/k norms
                    {"rms_norm": 6 * L + 1, "gelu_and_mul": L, "rope": L, **CAUSAL}),
    "phi3": (_dec(T.Phi3Config, T.Phi3ForCausalLM, pad_token_id=0), "causal",   # fused gate_up_proj
             {"rms_norm": 2 * L + 1, "silu_and_mul": L, "rope": L, **CAUSAL}),
    "olmo2": (_dec(T.Olmo2Config, T.Olmo2ForCausalLM, pad_token_id=0), "causal",   # post norms + q/k norms
              {"rms_norm": 4 * L + 1, "silu_and_mul": L, "rope": L, **CAUSAL}),
    "glm4": (_dec(T.Glm4Config, T.Glm4ForCausalLM, head_dim=8, pad_token_id=0), "causal",   # interleaved, partial rope
             {"rms_norm": 4 * L + 1, "silu_and_mul": L, "rope": L, **CAUSAL}),
    "granite": (_dec(T.GraniteConfig, T.GraniteForCausalLM, logits_scaling=2.0), "causal",   # scaled logits
                {"rms_norm": 2 * L + 1, "silu_and_mul": L, "rope": L, "cross_entropy": 1}),
    "mixtral": (_dec(T.MixtralConfig, T.MixtralForCausalLM, num_local_experts=4, num_experts_per_tok=2), "causal",
                {"rms_norm": 2 * L + 1, "add_rms_norm": L, "rope": L, "cross_entropy": 1}),
    "qwen3_moe": (_dec(T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM, head_dim=8, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32), "causal",
                  {"rms_norm": 4 * L + 1, "add_rms_norm": L, "rope": L, "cross_entropy": 1}),
    "gpt2": (lambda: T.GPT2LMHeadModel(T.GPT2Config(n_layer=L, n_embd=32, n_head=4, vocab_size=64, n_positions=64,
                                                    resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)), "causal",
             {"activation": L, **CAUSAL}),    # gelu_new's eight operations -> F.gelu(approximate="tanh")
    "gpt_neox": (lambda: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(hidden_size=32, intermediate_size=64,
                                                              num_hidden_layers=L, num_attention_heads=4,
                                                              vocab_size=64, max_position_embeddings=64,
                                                              rotary_pct=1.0, hidden_dropout=0.0,
                                                              attention_dropout=0.0)),
                 "causal", {"rope": L, **CAUSAL}),
    "bert": (lambda: T.BertForMaskedLM(T.BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=L,
                                                    num_attention_heads=4, vocab_size=64, hidden_dropout_prob=0.0,
                                                    attention_probs_dropout_prob=0.0)),
             "masked", {"encoder_layer": L, "cross_entropy": 1}),
    "roberta": (lambda: T.RobertaForMaskedLM(T.RobertaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=L,
                                                             num_attention_heads=4, vocab_size=64, pad_token_id=1,
                                                             max_position_embeddings=64, hidden_dropout_prob=0.0,
                                                             attention_probs_dropout_prob=0.0)),
                "masked", {"encoder_layer": L, "cross_entropy": 1}),   # BertLayer's code: one function
    "vit": (lambda: T.ViTForImageClassification(T.ViTConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=L,
                                                           num_attention_heads=4, image_size=16, patch_size=8,
                                                           num_labels=3, hidden_dropout_prob=0.0,
                                                           attention_probs_dropout_prob=0.0)), "image", {}),
    "clip": (lambda: T.CLIPVisionModel(T.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=L,
                                                          num_attention_heads=4, image_size=16, patch_size=8)),
             "image", {}),
}


def _llava():
    text = T.LlamaConfig(**{**D, "vocab_size": 80})
    vision = T.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=L, num_attention_heads=4,
                                image_size=16, patch_size=8, projection_dim=32)
    return T.LlavaForConditionalGeneration(T.LlavaConfig(vision_config=vision, text_config=text, image_token_id=79,
                                                         vision_feature_layer=-1))


FAMILIES["llava"] = (_llava, "llava", {"rms_norm": 2 * L + 1, "add_rms_norm": L, "silu_and_mul": L, "rope": L,
                                       **CAUSAL})


# family -> the ops recognized but not proven (report.unproven()), each for a reason in the architecture
UNPROVEN = {"gemma2": {"fused_linear_cross_entropy"},           # final_logit_softcapping
            "granite": {"fused_linear_cross_entropy"},          # logits / logits_scaling
            "mixtral": {"fused_linear_cross_entropy"},          # the router's auxiliary loss path
            "qwen3_moe": {"fused_linear_cross_entropy"}}


def _inputs(kind, model):
    """(inference inputs, training inputs) on the model's device."""
    dev = next(model.parameters()).device
    inf, tr = _cpu_inputs(kind)
    return ({k: v.to(dev) for k, v in inf.items()}, {k: v.to(dev) for k, v in tr.items()})


def _cpu_inputs(kind):
    g = torch.Generator().manual_seed(1)
    if kind in ("causal", "masked"):
        ids = torch.randint(2, 60, (2, 6), generator=g)
        labels = ids.clone()
        labels[0, 2] = -100
        return {"input_ids": ids}, {"input_ids": ids, "labels": labels}
    if kind == "image":
        px = torch.randn(2, 3, 16, 16, generator=g)
        return {"pixel_values": px}, {"pixel_values": px}
    # llava: 4 image tokens (16 / 8 squared) then text
    ids = torch.cat([torch.full((1, 4), 79), torch.randint(2, 60, (1, 4), generator=g)], dim=1)
    px = torch.randn(1, 3, 16, 16, generator=g)
    labels = ids.clone()
    labels[0, :4] = -100
    return {"input_ids": ids, "pixel_values": px}, {"input_ids": ids, "pixel_values": px, "labels": labels}


def _run(model, inf, tr):
    """(eval output, training loss, parameter grads): the loss is the model's own with labels, else the
    sum of the output (image models without labels)."""
    model.eval()
    with torch.no_grad():
        out = model(**inf)
        ev = out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(**tr)
    loss = out.loss if getattr(out, "loss", None) is not None else (
        out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state).square().sum()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return ev, loss.detach(), grads


def _assert_close(got, ref, what=""):
    atol = 2e-5 * max(1.0, float(ref.abs().max())) if ref.numel() else 0.0
    torch.testing.assert_close(got, ref, rtol=2e-4, atol=atol, msg=lambda m: f"{what}: {m}")


def _assert_same(got, ref):
    _assert_close(got[0], ref[0], "output")
    _assert_close(got[1], ref[1], "loss")
    assert set(got[2]) == set(ref[2])
    for n in ref[2]:
        _assert_close(got[2][n], ref[2][n], f"grad {n}")


def _expected(name, report):
    """(counts, unproven ops) expected of `name`'s report."""
    exp, unproven = dict(FAMILIES[name][2]), set(UNPROVEN.get(name, ()))
    if name in ("mixtral", "qwen3_moe"):
        if "moe" in report.counts():   # gems/patching/moe.py is installed and took the MoE blocks
            exp["moe"] = L
        else:
            unproven.add("moe")
    return exp, unproven


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_patched_agrees_and_counts(name):
    build, kind, _ = FAMILIES[name]
    torch.manual_seed(0)
    model = build().float().to(DEVICE)
    model.config.use_cache = False
    inf, tr = _inputs(kind, model)
    ref = _run(model, inf, tr)
    report = gems.patch(model)
    counts, unproven = _expected(name, report)
    assert report.counts() == counts, report.summary()
    assert {e["op"] for e in report.unproven()} == unproven, report.unproven()
    if unproven:
        with pytest.raises(ValueError, match="strict=True"):
            gems.patch(model, strict=True)
    _assert_same(_run(model, inf, tr), ref)
    gems.unpatch(model)


# with layer_norm=True: every plain LayerNorm, and the residual add + norm where the structure is
# LayerNorm(dropout(dense(h)) + input) (RoBERTa, as BERT), CLIP's encoder layer or GPT-2's block
LAYER_NORM = {"roberta": {"encoder_layer": L, "add_layer_norm": 2 * L, "layer_norm": 6, "cross_entropy": 1},
              "vit": {"layer_norm": 2 * L + 1},
              "gpt2": {"add_layer_norm": L, "layer_norm": 2 * L + 1, "activation": L, **CAUSAL},
              "clip": {"add_layer_norm": L, "layer_norm": 2 * L + 2}}


@pytest.mark.parametrize("name", sorted(LAYER_NORM))
def test_family_layer_norm_patched_agrees(name):
    build, kind, _ = FAMILIES[name]
    torch.manual_seed(0)
    model = build().float().to(DEVICE)
    inf, tr = _inputs(kind, model)
    ref = _run(model, inf, tr)
    report = gems.patch(model, layer_norm=True, strict=True)
    assert report.counts() == LAYER_NORM[name], report.summary()
    _assert_same(_run(model, inf, tr), ref)


def test_gpt2_block_add_layer_norm_keeps_the_blocks_other_calls():
    # GPT-2's block with add_layer_norm: a call with cross-attention runs GPT2Block's own forward; under
    # autocast (LayerNorm in fp32, attention output in bf16: two dtypes) the add and ln_2 run as before
    cfg = T.GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64, n_positions=64, resid_pdrop=0, embd_pdrop=0,
                       attn_pdrop=0, add_cross_attention=True)
    torch.manual_seed(0)
    model = T.GPT2LMHeadModel(cfg).float().to(DEVICE).eval()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(2, 60, (2, 6), generator=g).to(DEVICE)
    enc = torch.randn(2, 5, 32, generator=g).to(DEVICE)
    dev = torch.device(DEVICE).type

    def outputs():
        with torch.no_grad():
            cross = model(input_ids=ids, encoder_hidden_states=enc).logits
            with torch.autocast(dev, dtype=torch.bfloat16):
                auto = model(input_ids=ids).logits
        return cross, auto

    ref = outputs()
    report = gems.patch(model, layer_norm=True)
    assert report.counts()["add_layer_norm"] == 1, report.summary()
    got = outputs()
    _assert_close(got[0], ref[0], "cross-attention logits")
    assert got[1].dtype == ref[1].dtype
    torch.testing.assert_close(got[1].float(), ref[1].float(), rtol=2e-2, atol=2e-2)   # bf16 GEMMs
    gems.unpatch(model)


# ------------------------------------------------------------------------------------ the proofs themselves
def _module(mt, cls, *args):
    return getattr(importlib.import_module(f"transformers.models.{mt}.modeling_{mt}"), cls)(*args)


@pytest.mark.parametrize("mt, cls, expect", [
    ("llama", "LlamaRMSNorm", ("llama", 0.0)),       # weight * h.to(x.dtype): two roundings in bf16
    ("gemma", "GemmaRMSNorm", ("gemma", 1.0)),       # (h * (1 + w)).to(x.dtype): one rounding
    ("olmo2", "Olmo2RMSNorm", ("gemma", 0.0)),       # (w * h).to(x.dtype): one rounding, no offset
])
def test_rms_norm_casting_is_proven(mt, cls, expect):
    from gems.fused.norms import reference_rms_norm
    from gems.patching import probes
    m = _module(mt, cls, 48, 1e-5)
    casting, offset, eps = probes.prove_rms_norm(m)
    assert (casting, offset, eps) == (*expect, 1e-5)
    # the proven rule reproduces the module bit for bit in bf16 on an input and weight the probe never saw
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        m.weight.copy_(torch.randn(48, generator=g))
        m.to(torch.bfloat16)
        x = (torch.randn(5, 48, generator=g) * 3).to(torch.bfloat16)
        assert torch.equal(m(x), reference_rms_norm(x, m.weight, eps, offset=offset, casting=casting))
        other = "llama" if casting == "gemma" else "gemma"
        assert not torch.equal(m(x), reference_rms_norm(x, m.weight, eps, offset=offset, casting=other))


def test_what_cannot_be_proven_is_left():
    from gems.patching import probes
    cfg = T.LlamaConfig(**D)
    mlp = _module("llama", "LlamaMLP", cfg)

    class Swapped(type(mlp)):      # gate and up exchanged: the same modules, another function
        def forward(self, x):
            return self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))
    mlp.__class__ = Swapped
    assert "is not down_proj(silu(gate) * up)" in probes.prove_gated_mlp(mlp, "split")
    mlp.__class__ = type(_module("llama", "LlamaMLP", cfg))
    mlp.act_fn = torch.nn.ReLU()
    assert "is not silu / gelu / gelu-tanh" in probes.prove_gated_mlp(mlp, "split")
    assert probes.activation_kind(T.activations.NewGELUActivation()) == "gelu_tanh"
    assert probes.activation_kind(torch.nn.GELU()) == "gelu"
    # RMSNorm-like without an eps, and a forward with an extra scale
    norm = _module("llama", "LlamaRMSNorm", 16)
    del norm.variance_epsilon
    assert probes.prove_rms_norm(norm) == "no float eps attribute (variance_epsilon / eps)"
    glm = importlib.import_module("transformers.models.glm4.modeling_glm4")
    assert "not the rotate-half form" in probes.prove_rope(glm.apply_rotary_pos_emb)
    assert probes.prove_rope(glm.apply_rotary_pos_emb, interleaved=True) is None
    assert probes.proves_partial_rope(glm.apply_rotary_pos_emb, interleaved=True)
    assert "not the interleaved form" in probes.prove_rope(
        importlib.import_module("transformers.models.llama.modeling_llama").apply_rotary_pos_emb, interleaved=True)
    neox = importlib.import_module("transformers.models.gpt_neox.modeling_gpt_neox")
    assert probes.prove_rope(neox.apply_rotary_pos_emb) is None     # full width; partial runs its own


def test_partial_rotary(monkeypatch):
    from gems.patching import probes
    from gems.patching.modules import gems_rope_for
    calls = []

    def orig(q, k, cos, sin, unsqueeze_dim=1):
        calls.append(cos.shape[-1])
        return q, k
    q = torch.randn(1, 2, 3, 8)
    cs = torch.randn(1, 3, 4), torch.randn(1, 3, 4)
    gems_rope_for(orig)(q, q, *cs)     # not proven to handle partial rotary: its own function runs
    assert calls == [4]
    llama = importlib.import_module("transformers.models.llama.modeling_llama").apply_rotary_pos_emb
    neox = importlib.import_module("transformers.models.gpt_neox.modeling_gpt_neox").apply_rotary_pos_emb
    assert not probes.proves_partial_rope(llama) and probes.proves_partial_rope(neox)
    # GPT-NeoX's default: a quarter of each head rotated, through the fused op on strided views
    model = T.GPTNeoXForCausalLM(T.GPTNeoXConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                 num_attention_heads=2, vocab_size=64, rotary_pct=0.25,
                                                 hidden_dropout=0.0, attention_dropout=0.0)).to(DEVICE)
    inf, tr = _inputs("causal", model)
    ref = _run(model, inf, tr)
    assert gems.patch(model).counts()["rope"] == 1
    fused_rope, widths = gems.fused.rope, []
    monkeypatch.setattr(gems.fused, "rope", lambda q, k, *a, **kw: (widths.append(q.shape[-1]), fused_rope(q, k, *a, **kw))[1])
    _assert_same(_run(model, inf, tr), ref)
    assert widths == [4, 4]      # eval and training forward: the rotated quarter of 16-wide heads


def test_moe_blocks_without_the_moe_module(monkeypatch):
    # gems/patching/moe.py absent (an import of it fails): the MoE blocks are left, listed as unproven
    monkeypatch.setitem(__import__("sys").modules, "gems.patching.moe", None)
    torch.manual_seed(0)
    model = FAMILIES["mixtral"][0]()
    report = gems.patch(model)
    assert "moe" not in report.counts()
    moe = [e for e in report.unproven() if e["op"] == "moe"]
    assert [e["module"] for e in moe] == [f"model.layers.{i}.mlp" for i in range(L)]
    assert all("gems.patching.moe is not available" in e["why"] for e in moe)
    gems.unpatch(model)
    report = gems.patch(model, moe=False)           # asked not to: nothing about MoE in the report
    assert not [e for e in report.left if e["op"] == "moe"] and "moe" not in report.counts()
    gems.unpatch(model)
