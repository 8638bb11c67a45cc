"""parity on the tiny variants of the four models, inference and training, Gems on through the interpreter;
and a deliberately broken kernel (a test double) must be named as the first divergent op."""
import pytest
import torch

import gems
from gems_coverage import parity as P
from gems_coverage.cli import main

BUILTINS = ["llama2", "bert", "llava", "aquila"]


@pytest.mark.parametrize("model", BUILTINS)
def test_parity_tiny(model, record_property):
    r = P.parity(model, modes=("inference", "training"), new_tokens=2)
    report = P.format_result(r)
    print(report)
    assert r.ok, report
    names = [c.name for c in r.checks]
    assert "logits" in names and "loss" in names
    assert any(n.startswith("gradients") for n in names) and any(n.startswith("params after") for n in names)
    if model != "bert":
        assert "greedy tokens" in names
    served = r.served_compute_ops
    registered = {i.name for i in gems.registry.all_impls()}
    called_and_registered = r.compute_ops & registered
    # Gems actually served compute ops, only ones it registers, and the shadow compared them op by op
    assert called_and_registered, "the model calls no op Gems registers"
    assert served and set(served) <= registered
    assert r.shadow_calls > 0 and r.shadow_ops <= registered
    served_called = set(served) & r.compute_ops
    summary = (f"{r.model}: agreement in inference and training; Gems served {len(served_called)} of the "
               f"{len(r.compute_ops)} compute ops the model called ({len(called_and_registered)} registered), "
               f"{r.shadow_calls} calls checked op by op")
    record_property("parity_summary", summary)
    print(summary)


def _victim():
    """A compute op Gems registers that the tiny BERT training step is sure to call."""
    for name in ("mm.default", "addmm.default", "native_layer_norm.default", "gelu.default", "add.Tensor",
                 "_log_softmax.default"):
        if name in {i.name for i in gems.registry.all_impls()}:
            return name
    pytest.fail("Gems registers none of the ops BERT needs")


def test_broken_kernel_is_named(capsys):
    name = _victim()
    op = getattr(getattr(torch.ops.aten, name.split(".")[0]), name.split(".")[1])

    def broken(*args, **kwargs):
        out = op(*args, **kwargs)          # inside a Gems implementation, ATen serves nested calls
        return out * 1.001 + 1e-3          # small, silent numeric bug

    with gems.registry.override_impl(name, broken):
        r = P.parity("bert", modes=("training",))
        rc = main(["-q", "parity", "bert", "--mode", "training"])
    out, err = capsys.readouterr()
    assert not r.ok
    first = r.divergences[0]
    assert first.op == name and first.phase == "training"
    assert first.inputs and first.output and first.max_abs > first.allowed
    assert rc == 1
    assert f"FIRST DIVERGENT OP  aten::{name}" in out and "verdict FAIL" in out
    assert f"first divergent op aten::{name}" in err


def test_tolerances_are_dtype_aware():
    a = torch.randn(64, 64)
    ok, err, _ = P._allclose_elementwise(a * (1 + 1e-6), a)
    assert ok
    ok, err, allowed = P._allclose_elementwise(a * (1 + 1e-3), a)
    assert not ok and err > allowed
    b = a.to(torch.bfloat16)
    ok, _, _ = P._allclose_elementwise((a * (1 + 4e-3)).to(torch.bfloat16), b)   # within 1 bf16 ulp
    assert ok
    ok, rel, _, tol = P.compare_e2e(a + 1e-7, a)
    assert ok and rel < tol
    ok, rel, _, _ = P.compare_e2e(a * 1.01, a)
    assert not ok
    ids = torch.tensor([1, 2, 3])
    assert P.compare_e2e(ids, ids)[0] and not P.compare_e2e(ids, ids + 1)[0]


def test_low_precision_rule():
    torch.manual_seed(0)
    hi = torch.randn(1000)
    aten = (hi + 0.01 * torch.randn(1000)).to(torch.bfloat16)
    close = (hi + 0.012 * torch.randn(1000)).to(torch.bfloat16)    # as far from fp32 as ATen is
    far = (hi + 0.2 * torch.randn(1000)).to(torch.bfloat16)
    assert P.lowp_rule(close, aten, hi)[0]
    assert not P.lowp_rule(far, aten, hi)[0]
    assert P.e2e_check("inference", "logits", close, aten, hi).ok
    assert not P.e2e_check("inference", "logits", far, aten, hi).ok


def test_parity_bad_input(capsys):
    assert main(["parity", "llama2", "--device", "meta"]) == 2
    assert "parity needs data" in capsys.readouterr().err
    assert main(["parity", "llama2", "--exclude", "not_an_aten_op_xyz"]) == 2


def test_parity_on_a_module_function_model(tmp_path, monkeypatch, capsys):
    (tmp_path / "parity_models.py").write_text(
        "import torch\n"
        "def mlp(device='cpu', dtype=torch.float32):\n"
        "    torch.manual_seed(0)\n"
        "    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))\n"
        "    return m.to(device=device, dtype=dtype), (torch.randn(4, 16, device=device, dtype=dtype),)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["parity", "parity_models:mlp"]) == 0
    out = capsys.readouterr().out
    assert "logits" in out and "gradients (4)" in out and "verdict PASS" in out


GPT2_TINY = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 256, "n_positions": 64,
             "n_embd": 64, "n_layer": 2, "n_head": 4, "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1,
             "layer_norm_epsilon": 1e-5, "activation_function": "gelu_new", "bos_token_id": 1, "eos_token_id": 2}


def test_no_dropout_holds_for_any_architecture(tmp_path):
    """GPT-2 names its dropouts resid_pdrop / embd_pdrop / attn_pdrop: config keys named "dropout" miss
    them; no_dropout() zeroes every dropout module and every *drop* probability."""
    import json
    import gems_models
    f = tmp_path / "gpt2.json"
    f.write_text(json.dumps(GPT2_TINY))
    b = gems_models.build(str(f), size="tiny", device="cpu", dtype="float32", seq_len=8)
    drops = [m for m in b.model.modules() if isinstance(m, torch.nn.modules.dropout._DropoutNd)]
    assert drops and all(m.p > 0 for m in drops)
    P.no_dropout(b.model)
    assert all(m.p == 0 for m in drops)
    b.model.train()
    x = b.train_inputs["input_ids"]
    torch.testing.assert_close(b.model(x).logits, b.model(x).logits, rtol=0, atol=0)


def test_parity_gpt2_with_pdrop_names(tmp_path, capsys):
    import json
    f = tmp_path / "gpt2.json"
    f.write_text(json.dumps(GPT2_TINY))
    from harness import DEVICE
    dtype = "float32"
    rc = main(["-q", "parity", str(f), "--mode", "training", "--device", DEVICE, "--dtype", dtype, "--seq-len", "8"])
    out, err = capsys.readouterr()
    assert rc == 0 and "verdict PASS" in out, out + err


def test_parity_refuses_a_dtype_gems_does_not_serve(capsys):
    """float64 (and bf16 on the interpreter, which cannot round it) would compare ATen with itself."""
    from harness import DEVICE
    rc = main(["parity", "llama2", "--device", DEVICE, "--dtype", "float64"])
    err = capsys.readouterr().err
    assert rc == 2 and "Gems serves no f64 op" in err and "compare ATen with itself" in err
    if DEVICE == "cpu":
        rc = main(["parity", "llama2", "--dtype", "bfloat16"])
        err = capsys.readouterr().err
        assert rc == 2 and "Gems serves no bf16 op on the 'interpreter' backend" in err


def test_shadow_ignores_generator_state_results():
    # SDPA's fused overloads return their Philox seed/offset (placeholders without dropout): generator state,
    # not a computed value, so the op-by-op comparison leaves them out and compares the rest
    import torch
    from gems_coverage.parity import drop_rng_state
    op = torch.ops.aten._scaled_dot_product_cudnn_attention.default
    out = tuple(torch.full((), float(i)) for i in range(9))
    kept = drop_rng_state(op, out)
    assert [i for i, t in enumerate(kept) if t is None] == [6, 7]
    assert all(kept[i] is out[i] for i in range(6)) and kept[8] is out[8]
    flash = torch.ops.aten._scaled_dot_product_flash_attention.default
    assert [i for i, t in enumerate(drop_rng_state(flash, out)) if t is None] == [6, 7]
    x = torch.ones(2)
    assert drop_rng_state(torch.ops.aten.exp.default, x) is x


def test_parity_patch_refuses_an_unpatchable_model_before_running(tmp_path, capsys):
    """With its losses and activation switched off gems.patch replaces nothing in GPT-2 (its MLP is not gated, its norms
    are LayerNorms, off by default): --patch is bad input, found right after the build, before the ATen
    run."""
    import json
    f = tmp_path / "gpt2.json"
    f.write_text(json.dumps(GPT2_TINY))
    rc = main(["parity", str(f), "--mode", "inference", "--patch", "--patch-options",
               "cross_entropy=off,fused_linear_cross_entropy=off,activation=off"])
    err = capsys.readouterr().err
    assert rc == 2 and "--patch: gems.patch replaces nothing in" in err, err
    assert "ATen ..." not in err and "Gems ..." not in err, err


def _steps(rows):
    return [torch.tensor([r], dtype=torch.bfloat16) for r in rows]


def test_token_check_judges_a_flip_at_its_first_step():
    from gems_coverage.parity import token_check
    # step 1: token 0 leads token 2 by 0.125
    ref_rows = [[0.0, 4.0, 1.0, 0.5, 0.0, 0.0], [3.0, 0.0, 2.875, 0.0, -3.0, 2.5]]
    a = torch.tensor([[1, 0]])
    g = torch.tensor([[1, 2]])
    assert token_check(a.clone(), a, _steps(ref_rows)).ok
    # 0.125 is above the bf16 tie tolerance here (3e-2 x max |logit| 3 = 0.09): without Gems' logits, a failure
    c = token_check(g, a, _steps(ref_rows))
    assert not c.ok and "first difference at step 1" in c.detail
    # Gems' logits of that step within the end-to-end rule of ATen's (rel err 0.14 / 5.7): the flip is rounding
    close = _steps([ref_rows[0], [2.9375, 0.0, 3.0, 0.0, -3.0, 2.5]])
    c = token_check(g, a, _steps(ref_rows), close)
    assert c.ok and "within the rule" in c.detail, c.detail
    # ... and far from them (a wrong kernel): a failure that says so
    far = _steps([ref_rows[0], [0.0, 3.0, 4.0, 0.0, -3.0, 2.5]])
    c = token_check(g, a, _steps(ref_rows), far)
    assert not c.ok and "outside the rule" in c.detail, c.detail
    # a margin inside the tie tolerance passes on its own
    tie = _steps([ref_rows[0], [3.0, 0.0, 2.9375, 0.0, -3.0, 2.5]])
    assert "near tie" in token_check(g, a, tie).detail


def test_token_check_takes_the_runs_dtype_and_an_fp32_reference():
    from gems_coverage.parity import token_check
    # generate hands logits over in fp32 whatever the model computed in: a bf16 run's flip is judged by
    # bf16's tolerance when the dtype is given (rel err 0.02 here: within bf16's 3e-2, far outside fp32's)
    a, g = torch.tensor([[1, 0]]), torch.tensor([[1, 2]])
    ref = [torch.tensor([r]) for r in ([0.0, 4.0, 1.0], [3.0, 0.0, 2.5])]
    got = [ref[0], torch.tensor([[2.95, 0.0, 2.56]])]
    assert not token_check(g, a, ref, got).ok
    c = token_check(g, a, ref, got, dtype=torch.bfloat16)
    assert c.ok and "within the rule" in c.detail, c.detail
    # farther than bf16's tolerance (rel err 0.1): the fp32 reference of that step decides, Gems' logits at
    # most twice as far from it as ATen's
    far = [ref[0], torch.tensor([[2.7, 0.0, 2.9]])]
    calls = []

    def reference(step, row):
        calls.append((step, row))
        return torch.tensor([2.75, 0.0, 2.85])     # nearer Gems' logits than ATen's
    c = token_check(g, a, ref, far, dtype=torch.bfloat16, reference=reference)
    assert c.ok and calls == [(1, 0)] and "vs fp32" in c.detail, c.detail
    c = token_check(g, a, ref, far, dtype=torch.bfloat16, reference=lambda s, b: ref[1][0])
    assert not c.ok and "outside the rule" in c.detail, c.detail
