"""gems-coverage bench/parity --patch: the Gems run uses gems.patch(model), the ATen run the unpatched model,
and the result records it. gems.fused is bound to PyTorch stand-ins here (fast, and independent of the
kernels); tests/fused/test_patch.py covers the patch itself."""
import json

import pytest
import torch
import torch.nn.functional as TF

import gems.fused
from gems.fused.rotary import reference_rope
from gems_coverage import cli


def _rot(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _rms(x, w, eps, offset=0.0, casting="llama"):
    xf = x.float()
    return (w + offset) * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


CALLS = []
STANDINS = {
    "rms_norm": lambda x, w, eps=1e-6, **k: _rms(x, w, eps, **k),
    "add_rms_norm": lambda x, r, w, eps=1e-6, **k: (_rms(r + x, w, eps, **k), r + x),
    "layer_norm": lambda x, w, b, eps=1e-5: TF.layer_norm(x, (x.shape[-1],), w, b, eps),
    "add_layer_norm": lambda x, r, w, b, eps=1e-5: (TF.layer_norm(x + r, (x.shape[-1],), w, b, eps), x + r),
    "silu_and_mul": lambda g, u: TF.silu(g) * u,
    "gelu_and_mul": lambda g, u, approximate="none": TF.gelu(g, approximate=approximate) * u,
    "rope": lambda q, k, c, s, position_ids=None, unsqueeze_dim=1, interleaved=False: (
        reference_rope(q, k, c, s, None, unsqueeze_dim, interleaved) if interleaved else (
            q * c.unsqueeze(unsqueeze_dim) + _rot(q) * s.unsqueeze(unsqueeze_dim),
            k * c.unsqueeze(unsqueeze_dim) + _rot(k) * s.unsqueeze(unsqueeze_dim))),
    "cross_entropy": lambda x, t, **k: _ce(x, t, **k),
    "fused_linear_cross_entropy": lambda h, w, t, bias=None, **k: _ce(TF.linear(h, w, bias), t, **k),
}


def _ce(logits, target, out_dtype=None, divisor=None, **k):
    # gems.fused's extra keywords (HF's sum / num_items_in_batch and an fp32 loss) on top of torch's
    loss = TF.cross_entropy(logits.float(), target, **k)
    if divisor is not None:
        loss = loss / divisor
    return loss if out_dtype is None else loss.to(out_dtype)


@pytest.fixture(autouse=True)
def standins():
    ns = gems.fused.__dict__
    saved = {k: ns[k] for k in STANDINS if k in ns}

    def counted(name, fn):
        def f(*a, **k):
            CALLS.append(name)
            return fn(*a, **k)
        return f
    ns.update({k: counted(k, v) for k, v in STANDINS.items()})
    CALLS.clear()
    try:
        yield
    finally:
        for k in STANDINS:
            ns.pop(k, None)
        ns.update(saved)


def _run(tmp_path, *args):
    out = tmp_path / "out.json"
    rc = cli.main(["-q", *args, "--format", "json", "-o", str(out)])
    return rc, (json.loads(out.read_text()) if out.exists() else None)


def test_flag_parses():
    p = cli.build_parser()
    assert p.parse_args(["bench", "llama2", "--patch"]).patch is True
    assert p.parse_args(["bench", "llama2"]).patch is False
    assert p.parse_args(["parity", "bert", "--patch"]).patch is True
    assert p.parse_args(["parity", "bert"]).patch is False


def test_bench_train_patch_is_recorded(tmp_path):
    rc, d = _run(tmp_path, "bench", "llama2", "--device", "cpu", "--steps", "1", "--warmup", "0", "--seq-len", "6",
                 "--include", "rsqrt", "--workload", "train", "--no-attribution", "--patch")
    assert rc == 0, d
    assert d["patched"] is True and d["agree"]
    assert d["patch"]["model_type"] == "llama"
    assert d["patch"]["replaced"] == {"add_rms_norm": 2, "rope": 2, "silu_and_mul": 2, "rms_norm": 5,
                                      "cross_entropy": 1, "fused_linear_cross_entropy": 1}
    # the Gems turns (agreement + timed) ran patched: one fused linear CE per training step
    assert CALLS.count("fused_linear_cross_entropy") == 2


def test_bench_decode_patch_with_attribution(tmp_path):
    rc, d = _run(tmp_path, "bench", "llama2", "--device", "cpu", "--steps", "1", "--warmup", "0", "--seq-len", "4",
                 "--include", "rsqrt", "--workload", "decode", "--new-tokens", "2", "--patch")
    assert rc == 0, d
    assert d["patched"] and d["agree"] and d["profiled_units"] == 1 and "rope" in CALLS
    rc, d = _run(tmp_path, "bench", "bert", "--device", "cpu", "--steps", "1", "--warmup", "0", "--seq-len", "6",
                 "--include", "rsqrt", "--no-attribution")
    assert rc == 0 and d["patched"] is False and d["patch"] is None


def test_parity_patch_is_recorded(tmp_path, capsys):
    rc, d = _run(tmp_path, "parity", "bert", "--include", "rsqrt", "--patch", "--no-shadow")
    assert rc == 0, d
    assert d["patched"] is True and d["verdict"] == "PASS"
    assert d["patch"]["replaced"] == {"encoder_layer": 2, "cross_entropy": 1}   # layer_norm is opt-in
    assert "cross_entropy" in CALLS and "add_layer_norm" not in CALLS
    rc = cli.main(["-q", "parity", "bert", "--include", "rsqrt", "--patch", "--no-shadow", "--mode", "inference"])
    assert rc == 0 and "patched gems.patch on the Gems run: encoder_layer x2, cross_entropy x1" in capsys.readouterr().out


def test_attribution_counts_fused_functions_as_ops():
    """With --patch, gems.fused's autograd Functions are rows of their own (their kernels launch outside
    any ATen op), and the ATen calls inside them are not outermost ops."""
    import importlib
    from torch.profiler import ProfilerActivity, profile
    from gems_coverage.bench import fused_event_names, outermost_ops
    norms, gated = importlib.import_module("gems.fused.norms"), importlib.import_module("gems.fused.gated")
    x = torch.randn(4, 64, requires_grad=True)
    w = torch.ones(64, requires_grad=True)
    u = torch.randn(4, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        y = gated.silu_and_mul(norms.rms_norm(x, w, 1e-6), u)
        (y * 2).sum().backward()
    ops, inner = outermost_ops(prof.events(), False, fused_event_names())
    fused = {k for k in ops if k.startswith("fused::")}
    assert len(fused) == 4 and sum(k.endswith("Backward") for k in fused) == 2, ops
    assert {"mul", "sum"} <= set(ops) and "empty" not in ops and "set_" not in ops
    plain, _ = outermost_ops(prof.events(), False)       # without --patch: as before, ATen events only
    assert not any(k.startswith("fused::") for k in plain)


def test_parity_patch_of_a_model_it_cannot_patch_is_bad_input(tmp_path, capsys, monkeypatch):
    # GPT-2 is walked by structure: its loss is fused, its Conv1D + gelu_new MLP has no fused op, its
    # LayerNorms are opt-in; with the losses off nothing is left to replace, and parity --patch says so
    # before running anything (no run: the comparison is never reached)
    from gems_coverage import parity as P
    monkeypatch.setattr(P, "ShadowMode", None)     # any run would call it
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 1,
                               "n_embd": 32, "n_head": 2, "vocab_size": 64, "n_positions": 32}))
    rc = cli.main(["-q", "parity", str(cfg), "--include", "rsqrt", "--patch-options",
                   "cross_entropy=off,fused_linear_cross_entropy=off,activation=off"])
    assert rc == 2
    assert "--patch: gems.patch replaces nothing in" in capsys.readouterr().err
    assert not CALLS


def test_patch_options_select_the_fused_parts(tmp_path, capsys):
    # parity: layer_norm is opt-in in gems.patch; --patch-options turns it on (and implies --patch)
    rc, d = _run(tmp_path, "parity", "bert", "--include", "rsqrt", "--patch-options", "layer_norm=on",
                 "--no-shadow", "--mode", "inference")
    assert rc == 0, d
    assert d["patched"] is True and d["patch"]["options"]["layer_norm"] is True
    assert d["patch"]["replaced"] == {"encoder_layer": 2, "add_layer_norm": 4, "layer_norm": 6, "cross_entropy": 1}
    # bench: the options that apply to BERT all off: nothing would be patched, so --patch is bad input
    rc, d = _run(tmp_path, "bench", "bert", "--device", "cpu", "--steps", "1", "--warmup", "0", "--seq-len", "6",
                 "--include", "rsqrt", "--no-attribution", "--patch-options", "cross_entropy=off,encoder_layer=off")
    assert rc == 2
    assert "--patch: gems.patch replaces nothing in" in capsys.readouterr().err


@pytest.mark.parametrize("value, message", [("layer_norm", "is not NAME=on or NAME=off"),
                                            ("layer_norm=maybe", "is not NAME=on or NAME=off"),
                                            ("fused_mlp=on", "unknown gems.patch option(s) fused_mlp")])
def test_patch_options_bad_input(tmp_path, capsys, value, message):
    rc, d = _run(tmp_path, "bench", "bert", "--device", "cpu", "--steps", "1", "--seq-len", "6",
                 "--patch-options", value)
    assert rc == 2 and d is None
    assert message in capsys.readouterr().err
