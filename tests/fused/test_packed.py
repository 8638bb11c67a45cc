"""gems.patch(model, pack_projections=True) (gems/patching/packed.py): q/k/v and gate/up as one GEMM in calls
without autograd, and the separate Linears' results in every case: inference (fewer GEMMs, same logits and
greedy tokens), training (each Linear's own GEMM, same gradients), weights moved or replaced after the
patch, a sibling called with another input; unpatch gives every Parameter its own storage back."""
from __future__ import annotations

import pytest
import torch
import transformers as T

import gems
from gems.patching import packed
from harness import DEVICE, assert_close

pytestmark = pytest.mark.filterwarnings("ignore")

D = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
         vocab_size=64, max_position_embeddings=64, attention_dropout=0.0)
FAMILIES = {"llama": (T.LlamaConfig, T.LlamaForCausalLM),       # GQA 4 / 2
            "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM)}       # q/k/v with biases
TOL = dict(rtol=2e-5, atol=2e-5)
# the packing alone: the other replacements are tested elsewhere
ONLY_PACK = dict(pack_projections=True, rms_norm=False, rope=False, swiglu=False, cross_entropy=False,
                 fused_linear_cross_entropy=False)


def _model(family):
    torch.manual_seed(0)
    cfg_cls, cls = FAMILIES[family]
    return cls(cfg_cls(**D)).to(DEVICE).eval()


class _CountLinear(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.linear:
            self.n += 1
        return func(*args, **(kwargs or {}))


def _logits(model, ids):
    with torch.no_grad(), _CountLinear() as c:
        out = model(input_ids=ids).logits
    return out, c.n


@pytest.mark.parametrize("family", list(FAMILIES))
def test_inference_one_gemm_per_group(family):
    model = _model(family)
    ids = torch.randint(0, 64, (2, 7), device=DEVICE)
    ref, n_ref = _logits(model, ids)
    report = gems.patch(model, **ONLY_PACK)
    assert report.counts() == {"packed_linear": 2 * D["num_hidden_layers"]}
    q = model.model.layers[0].self_attn.q_proj.weight
    k = model.model.layers[0].self_attn.k_proj.weight
    assert k.data_ptr() == q.data_ptr() + q.numel() * q.element_size()     # rows of one tensor, no copy
    got, n = _logits(model, ids)
    assert n == n_ref - 3 * D["num_hidden_layers"]     # per layer: q/k/v one GEMM (-2), gate/up one (-1)
    assert_close(got, ref, torch.float32, **TOL)
    with torch.no_grad():
        tokens = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
        gems.unpatch(model)
        ref_tokens = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(tokens, ref_tokens)


def test_training_runs_each_linear_and_matches():
    model = _model("qwen2").train()
    ids = torch.randint(0, 64, (2, 7), device=DEVICE)
    model(input_ids=ids, labels=ids).loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    gems.patch(model, **ONLY_PACK)
    with _CountLinear() as c:
        model(input_ids=ids, labels=ids).loss.backward()
    assert c.n == 7 * D["num_hidden_layers"] + 1          # every Linear its own GEMM, and the lm_head
    for n, p in model.named_parameters():
        assert p.grad is not None, n
        assert_close(p.grad, ref[n], torch.float32, msg=n, **TOL)
    gems.unpatch(model)


def test_moved_or_replaced_weights_and_other_inputs():
    model = _model("llama")
    ids = torch.randint(0, 64, (1, 5), device=DEVICE)
    gems.patch(model, pack_projections=True)
    attn = model.model.layers[0].self_attn
    x = torch.randn(1, 5, 32, device=DEVICE)
    with torch.no_grad():
        q = attn.q_proj(x)
        y = torch.randn(1, 5, 32, device=DEVICE)
        assert_close(attn.k_proj(y), torch.nn.functional.linear(y, attn.k_proj.weight), torch.float32, **TOL)
        x.mul_(2)        # changed in place since q_proj read it: v_proj computes its own
        assert_close(attn.v_proj(x), torch.nn.functional.linear(x, attn.v_proj.weight), torch.float32, **TOL)
        assert_close(q, torch.nn.functional.linear(x / 2, attn.q_proj.weight), torch.float32, **TOL)
        attn.k_proj.weight = torch.nn.Parameter(torch.randn_like(attn.k_proj.weight))   # no longer packed rows
        z = torch.randn(1, 5, 32, device=DEVICE)
        attn.q_proj(z)
        assert_close(attn.k_proj(z), torch.nn.functional.linear(z, attn.k_proj.weight), torch.float32, **TOL)
    ref = model(input_ids=ids).logits
    model.double()     # every Parameter moved: the packed tensor is stale, each Linear runs its own
    with torch.no_grad():
        assert_close(model(input_ids=ids).logits, ref.double(), torch.float32, **TOL)
    gems.unpatch(model)


def test_unpatch_gives_each_parameter_its_storage():
    model = _model("qwen2")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    objs = {n: p for n, p in model.named_parameters()}
    gems.patch(model, pack_projections=True)
    gems.unpatch(model)
    ptrs = [p.data_ptr() for p in model.parameters()]
    assert len(set(ptrs)) == len(ptrs)
    for n, p in model.named_parameters():
        assert p is objs[n] and torch.equal(p, before[n]), n
        assert p.untyped_storage().nbytes() == p.numel() * p.element_size(), n
    assert "forward" not in model.model.layers[0].self_attn.k_proj.__dict__


def test_what_is_not_packed():
    lins = [torch.nn.Linear(8, 4, bias=True), torch.nn.Linear(8, 4, bias=False)]
    assert "bias" in packed.packable(lins)
    assert "input" in packed.packable([torch.nn.Linear(8, 4), torch.nn.Linear(6, 4)])
    assert "dtype" in packed.packable([torch.nn.Linear(8, 4), torch.nn.Linear(8, 4).double()])
    assert packed.packable([torch.nn.Linear(8, 4), torch.nn.Linear(8, 2)]) is None
