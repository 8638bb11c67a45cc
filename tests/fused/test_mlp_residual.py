"""The patched decoder layer's closing residual add in the down projection's GEMM (`addmm`) on decode
steps without autograd (gems/patching/modules.py: mlp_plus_residual): same logits as the unpatched model,
one addmm per layer in place of a GEMM and an add; training, prefill-sized inputs and hooked modules take
the layer's own add."""
from __future__ import annotations

import pytest
import torch
import transformers as T

import gems
from gems.patching import modules
from harness import DEVICE, assert_close

pytestmark = pytest.mark.filterwarnings("ignore")

LAYERS = 2


def _model():
    torch.manual_seed(0)
    cfg = T.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=64, max_position_embeddings=64)
    return T.LlamaForCausalLM(cfg).to(DEVICE).eval()


class _CountAddmm(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.addmm and args[0].dim() == 2:
            self.n += 1
        return func(*args, **(kwargs or {}))


def _run(model, ids, grad=False):
    with torch.set_grad_enabled(grad), _CountAddmm() as c:
        out = model(input_ids=ids).logits
    return out, c.n


@pytest.mark.parametrize("pack", [False, True])
def test_decode_rows_add_in_the_gemm_and_match(pack):
    model = _model()
    ids = torch.randint(0, 64, (3, 1), device=DEVICE)          # three sequences, one token each
    ref, _ = _run(model, ids)
    gems.patch(model, pack_projections=pack)
    try:
        got, n = _run(model, ids)
    finally:
        gems.unpatch(model)
    assert n == LAYERS
    assert_close(got, ref, torch.float32, rtol=2e-5, atol=2e-5)


def test_training_prefill_and_hooks_take_the_layers_own_add():
    model = _model()
    gems.patch(model)
    try:
        one = torch.randint(0, 64, (2, 1), device=DEVICE)
        assert _run(model, one, grad=True)[1] == 0           # autograd: the layer's own ops
        rows = modules.ADD_IN_GEMM_MAX_ROWS + 1
        assert _run(model, torch.randint(0, 64, (1, rows), device=DEVICE))[1] == 0   # a prefill
        seen = []
        h = model.model.layers[0].mlp.register_forward_hook(lambda m, a, o: seen.append(1))
        try:
            assert _run(model, one)[1] == LAYERS - 1           # the hooked MLP is called as a module
        finally:
            h.remove()
        assert seen == [1]
        assert _run(model, one)[1] == LAYERS
    finally:
        gems.unpatch(model)
