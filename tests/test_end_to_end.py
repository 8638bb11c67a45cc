"""The core issue's acceptance checks, end to end on the active backend (interpreter on CPU in CI)."""
import copy

import pytest
import torch

import gems
from harness import DEVICE, assert_close, make, to_ref


def test_first_ops_agree_and_are_served():
    gems.reset_stats()
    x = make((6, 40))
    w, b = make((40,)), make((40,))
    a, m = make((7, 13)), make((13, 9))
    row = make((40,))
    with gems.use_gems():
        got = [torch.softmax(x, -1), torch.nn.functional.layer_norm(x, (40,), w, b), torch.mm(a, m),
               x + row, torch.sum(x, 1), torch.nn.functional.silu(x)]
    ref = [torch.softmax(to_ref(x), -1), torch.nn.functional.layer_norm(*to_ref((x, (40,), w, b))),
           torch.mm(to_ref(a), to_ref(m)), to_ref(x) + to_ref(row), torch.sum(to_ref(x), 1),
           torch.nn.functional.silu(to_ref(x))]
    for g, r in zip(got, ref):
        assert_close(g, r, torch.float32, atol=1e-4)
    st = gems.stats()
    for op in ["_softmax.default", "native_layer_norm.default", "mm.default", "add.Tensor", "sum.dim_IntList",
               "silu.default"]:
        assert st.get(op, {}).get("served", 0) >= 1, (op, st.get(op))


def test_complex_add_falls_back_and_is_right():
    gems.reset_stats()
    z = torch.randn(5, dtype=torch.complex64, device=DEVICE)
    with gems.use_gems():
        got = z + z
    torch.testing.assert_close(got, z * 2)
    assert gems.stats()["add.Tensor"]["fallback"] == 1


@pytest.mark.parametrize("train", [False, True], ids=["forward", "forward+backward"])
def test_tiny_llama_agrees_with_aten(train):
    from gems_models import build, training_loss
    bundle = build("llama2", size="tiny", device=DEVICE, dtype="float32", seq_len=8, dropout=0.0)
    model_ref, model_gems = bundle.model, copy.deepcopy(bundle.model)
    inputs = bundle.train_inputs if train else bundle.inputs

    def run(model, on):
        model.train(train)
        with gems.use_gems() if on else torch.enable_grad():
            out = model(**inputs)
            if not train:
                return [out.logits.detach()]
            loss = training_loss(out)
            loss.backward()
            return [loss.detach()] + [p.grad for p in model.parameters()]

    gems.reset_stats()
    got = run(model_gems, True)
    served = sum(v["served"] for v in gems.stats().values())
    ref = run(model_ref, False)
    assert served > 10, gems.stats()
    for g, r in zip(got, ref):
        # fp32 through a 2-layer model: kernel-order rounding differences, scaled by the tensor's size
        tol = 1e-4 * max(1.0, r.abs().max().item())
        torch.testing.assert_close(g, r, atol=tol, rtol=1e-3)
