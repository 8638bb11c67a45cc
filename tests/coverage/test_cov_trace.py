"""Tracing: every built-in model at full size on meta (inference and training), tiny on CPU with the
profiler and Gems enabled through the interpreter; the JSON document's schema."""
import json

import pytest

import gems
from gems_coverage import classify as C
from gems_coverage import report, runner, tracer

BUILTINS = ["llama2", "bert", "llava", "aquila"]


def _names(res):
    return set(res.ops)


@pytest.mark.parametrize("model", BUILTINS)
@pytest.mark.parametrize("mode", ["inference", "training"])
def test_full_size_on_meta(model, mode):
    res = tracer.trace(model, mode=mode, device="meta", seq_len=16)
    names = _names(res)
    assert res.size == "full" and res.device == "meta" and res.times is None and not res.gems_enabled
    assert "mm.default" in names or "addmm.default" in names
    assert res.ops["view.default"].category == C.VIEW
    if mode == "training":
        # backward ops and the optimizer step (AdamW, foreach=True as on CUDA) are in the trace
        assert any(n.endswith("_backward.default") or "backward" in n for n in names)
        assert "_foreach_addcdiv_.ScalarList" in names and "_foreach_lerp_.Scalar" in names
        assert "addcdiv_.default" not in names
    if model == "llava":
        assert "convolution.default" in names and "masked_scatter.default" in names
    if model in ("llama2", "aquila", "llava"):
        assert "silu.default" in names and "rsqrt.default" in names
    if model == "bert":
        assert "native_layer_norm.default" in names and "gelu.default" in names
    d = report.trace_to_dict(res)
    assert d["summary"]["distinct_ops"] == len(names)
    # every registered overload the model calls is marked covered, and nothing else
    impls = {i.name for i in gems.registry.all_impls()}
    for o in d["ops"]:
        assert o["covered"] == (o["name"] in impls)


def test_generate_on_meta_uses_the_kv_cache():
    res = tracer.trace("llama2", mode="generate", device="meta", seq_len=16, new_tokens=3)
    # 3 forward passes: 32 layers x 3 calls of silu
    assert res.ops["silu.default"].calls == 32 * 3
    assert res.new_tokens == 3


def test_generate_sampling_on_meta():
    # do_sample's path at full size on meta: no .item() on meta values anywhere in the loop
    res = tracer.trace("llama2", mode="generate", device="meta", seq_len=16, new_tokens=3,
                       sampling=runner.Sampling())
    assert res.ops["silu.default"].calls == 32 * 3
    for op in ("multinomial.default", "topk.default", "sort.default", "cumsum.default", "scatter.src",
               "_softmax.default", "masked_fill.Scalar"):
        assert res.ops[op].calls >= 3, op
    assert "argmax.default" not in res.ops


def test_generate_sampling_tiny_cpu_with_gems():
    # the sampling decode's own ops are served by Gems (sort/topk may still fall back to ATen)
    res = tracer.trace("llama2", mode="generate", device="cpu", new_tokens=3, profile=False,
                       sampling=runner.Sampling())
    assert res.gems_enabled
    for op in ("multinomial.default", "cumsum.default", "scatter.src", "stack.default"):
        assert res.served[op]["served"] >= 1, (op, res.served.get(op))
    greedy = tracer.trace("llama2", mode="generate", device="cpu", new_tokens=3, profile=False)
    assert greedy.served["argmax.default"]["served"] == 3


def test_run_generate_sampling():
    import torch
    import gems_models
    b = gems_models.build(gems_models.resolve("llama2"), size="tiny", device="cpu", dtype=torch.float32, batch=2, seq_len=6,
                     seed=0)
    greedy = runner.run_generate(b, 4)
    vocab = b.model.config.vocab_size
    torch.manual_seed(1)
    a = runner.run_generate(b, 4, sampling=runner.Sampling())
    torch.manual_seed(1)
    again = runner.run_generate(b, 4, sampling=runner.Sampling())
    assert a.shape == (2, 4) and a.dtype == torch.int64 and ((a >= 0) & (a < vocab)).all()
    assert torch.equal(a, again)
    # top_k = 1 keeps only the argmax: sampling must reproduce greedy decoding exactly
    assert torch.equal(runner.run_generate(b, 4, sampling=runner.Sampling(temperature=1.0, top_k=1, top_p=1.0)),
                       greedy)
    # a very high temperature over the whole vocabulary: the draws differ from greedy
    hot = runner.run_generate(b, 4, sampling=runner.Sampling(temperature=100.0, top_k=0, top_p=1.0))
    assert not torch.equal(hot, greedy)
    for bad in (dict(temperature=0.0), dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5)):
        with pytest.raises(ValueError):
            runner.Sampling(**bad)


def test_meta_and_cpu_differ_in_attention():
    meta = _names(tracer.trace("llama2", device="meta", size="tiny"))
    cpu = _names(tracer.trace("llama2", device="cpu", use_gems=False, profile=False))
    assert "_safe_softmax.default" in meta and "bmm.default" in meta
    assert any("scaled_dot_product" in n for n in cpu)


@pytest.mark.parametrize("model", BUILTINS)
def test_tiny_on_cpu_with_profiler_and_gems(model):
    res = tracer.trace(model, mode="inference", device="cpu")
    assert res.size == "tiny" and res.gems_enabled and res.times is not None
    d = report.trace_to_dict(res)
    assert d["timed"] and d["time_source"] == "cpu"
    shares = [o["time_share_pct"] for o in d["ops"]]
    assert 99.0 < sum(shares) < 101.0
    # ranked: compute ops by time, most expensive first
    comp = [o["time_us"] for o in d["ops"] if o["category"] == C.COMPUTE]
    assert comp == sorted(comp, reverse=True)
    # with Gems on, served ops are registered ones (counts include ATen's internal calls that reach Gems)
    served = {o["name"]: o for o in d["ops"] if o["served"]}
    assert served, "Gems served no op at all"
    for o in served.values():
        assert o["covered"] and o["served"] > 0
    assert d["summary"]["served_compute_ops"] == sum(1 for o in served.values() if o["category"] == C.COMPUTE)


SCHEMA_TOP = {"schema_version": int, "tool": str, "model": str, "model_source": str, "size": str,
              "parameters": int, "mode": str, "device": str, "dtype": str, "batch": int, "seq_len": int,
              "gems": dict, "timed": bool, "trace_seconds": float, "summary": dict, "gaps": list,
              "notes": list, "ops": list}
SCHEMA_SUMMARY = {"distinct_ops": int, "compute_ops": int, "covered_compute_ops": int, "coverage_pct": float,
                  "total_calls": int, "compute_calls": int, "covered_compute_calls": int,
                  "calls_coverage_pct": float, "by_category": dict}
SCHEMA_OP = {"name": str, "category": str, "calls": int, "covered": bool, "dtypes": list, "devices": list,
             "example_shapes": str, "distinct_shapes": int, "first_call": int}
OPTIONAL_OP = ("gems_category", "backward", "dtype_supported", "served", "fallback", "fallback_reasons",
               "time_us", "time_share_pct")


def check_schema(d):
    for k, t in SCHEMA_TOP.items():
        assert isinstance(d[k], t), k
    for k, t in SCHEMA_SUMMARY.items():
        assert isinstance(d["summary"][k], t), k
    for o in d["ops"]:
        for k, t in SCHEMA_OP.items():
            assert isinstance(o[k], t), (o["name"], k)
        for k in OPTIONAL_OP:
            assert k in o
        assert o["category"] in C.CATEGORIES
    s = d["summary"]
    comp = [o for o in d["ops"] if o["category"] == "compute"]
    assert s["compute_ops"] == len(comp)
    assert s["covered_compute_ops"] == sum(o["covered"] for o in comp)
    assert s["coverage_pct"] == round(100 * s["covered_compute_ops"] / s["compute_ops"], 1)
    assert d["gaps"] == [o["name"] for o in comp if not o["covered"]]
    assert set(d["gems"]) >= {"available", "registered_ops", "backend", "enabled", "note"}


def test_json_schema_meta():
    d = report.trace_to_dict(tracer.trace("bert", mode="training", device="meta", seq_len=16))
    check_schema(json.loads(json.dumps(d)))
    assert d["model"] == "bert-base-uncased" and d["device"] == "meta" and d["dtype"] == "bfloat16"
    # untimed: gaps ranked by calls
    calls = [o["calls"] for o in d["ops"] if o["category"] == "compute"]
    assert calls == sorted(calls, reverse=True)


def test_training_optimizer_choices(capsys):
    # adamw-loop: the per-parameter loop's ops instead of the _foreach_ ones
    names = _names(tracer.trace("llama2", mode="training", device="meta", seq_len=16, optimizer="adamw-loop"))
    assert "addcdiv_.default" in names and "lerp_.Scalar" in names
    assert not any(n.startswith("_foreach_") for n in names)
    from gems_coverage.cli import main
    # bad input, one line, exit 2: --optimizer without training; fused AdamW on meta (no kernel there)
    assert main(["-q", "trace", "llama2", "--optimizer", "sgd"]) == 2
    assert "--optimizer applies with --mode training only" in capsys.readouterr().err
    assert main(["-q", "trace", "llama2", "--mode", "training", "--optimizer", "adamw-fused"]) == 2
    assert "adamw-fused" in capsys.readouterr().err
