"""gems-coverage bench: each workload runs with ATen and with Gems, the outputs agree, and the difference
is attributed per ATen op (tiny models on CPU: timings meaningless, all else real). Gems serves a few
cheap ops here (--include) to keep the interpreter's share of CI time small; `_log_softmax` is one of
them because it runs under the composite `cross_entropy_loss`, which is where its counts must land."""
import json
import os

import pytest
import torch

import gems_models
from gems_coverage import cli

SCHEMA_KEYS = {"model", "workload", "device", "gpu", "size", "dtype", "batch", "seq_len", "new_tokens", "steps",
               "warmup", "optimizer", "unit", "tokens_per_unit", "aten_ms", "gems_ms", "aten_ms_median",
               "gems_ms_median", "aten_tokens_per_s", "gems_tokens_per_s", "throughput_ratio", "aten_peak_mib",
               "gems_peak_mib", "agree", "agreement", "ops", "profiled_units", "totals", "no_plan", "fallbacks", "python_path",
               "meaningful",
               "notes", "versions", "baseline"}
OP_KEYS = {"op", "aten_calls", "gems_calls", "aten_host_us_per_call", "gems_host_us_per_call",
           "aten_device_us_per_call", "gems_device_us_per_call", "delta_host_ms", "delta_device_ms", "served",
           "fallback", "gems_overloads"}
TOTAL_KEYS = {"aten_host_ms", "gems_host_ms", "aten_device_ms", "gems_device_ms", "aten_wall_ms", "gems_wall_ms"}
# the tiny benches run on the CPU through the interpreter backend; under GEMS_TEST_DEVICE=cuda Gems'
# backend serves CUDA tensors, and bench rightly refuses --device cpu (the GPU benches: docs/perf.md)
pytestmark = pytest.mark.skipif(os.environ.get("GEMS_TEST_DEVICE", "cpu") != "cpu",
                                reason="tiny CPU benches: the interpreter backend only")
# tiny Llama: 2 layers x (q, k, v, o, gate, up, down) + lm_head
LINEARS_PER_TOKEN = 15


def _bench(tmp_path, *extra, include="rsqrt"):
    out = tmp_path / "bench.json"
    rc = cli.main(["-q", "bench", "llama2", "--device", "cpu", "--steps", "1", "--warmup", "0", "--seq-len", "6",
                   "--include", include, "--format", "json", "-o", str(out), *extra])
    return rc, (json.loads(out.read_text()) if out.exists() else None)


def test_train_json_follows_the_schema_and_attributes_served_ops(tmp_path):
    rc, d = _bench(tmp_path, "--workload", "train", include="rsqrt,_log_softmax,_foreach_sqrt")
    assert rc == 0
    assert SCHEMA_KEYS <= set(d), SCHEMA_KEYS - set(d)
    assert d["agree"] and d["agreement"][0]["ok"] and "loss" in d["agreement"][0]["check"]
    assert not d["meaningful"] and d["unit"] == "step" and len(d["aten_ms"]) == len(d["gems_ms"]) == 1
    assert d["throughput_ratio"] > 0 and d["aten_peak_mib"] is None and "unregistered" in d["baseline"]
    assert d["profiled_units"] == 1 and TOTAL_KEYS <= set(d["totals"]) and d["totals"]["aten_device_ms"] is None
    assert all(OP_KEYS <= set(o) for o in d["ops"])
    ops = {o["op"]: o for o in d["ops"]}
    assert ops["rsqrt"]["served"] > 0 and ops["rsqrt"]["aten_calls"] == ops["rsqrt"]["gems_calls"] > 0
    # the loss's log_softmax runs under cross_entropy_loss: its counts land on that row
    assert ops["cross_entropy_loss"]["gems_overloads"]["_log_softmax.default"]["served"] == 1
    ranks = [abs(o["delta_host_ms"]) for o in d["ops"]]
    assert ranks == sorted(ranks, reverse=True)   # no device column on CPU: ranked by host delta
    # the profiled step's calls ran from C++: rsqrt's plans and AdamW(foreach)'s sqrt (served whole by
    # fastpath.cpp foreach_serve with the binary its first, timed call published)
    from gems.runtime import fast
    if fast.status().startswith("loaded"):
        assert "_foreach_sqrt.default" not in d["python_path"], d["python_path"]
        assert "rsqrt.default" not in d["python_path"], d["python_path"]
    else:
        assert d["python_path"] is None


def test_decode_bf16_checks_against_fp32_and_attributes_decode_steps_only(tmp_path):
    rc, d = _bench(tmp_path, "--workload", "decode", "--new-tokens", "3", "--dtype", "bfloat16", include="rsqrt,silu")
    assert rc == 0, d
    assert d["agree"] and d["unit"] == "token" and d["tokens_per_unit"] == 1 and d["new_tokens"] == 3
    checks = {c["check"]: c for c in d["agreement"]}
    assert "vs fp32" in checks["prompt logits (last position)"]["detail"]
    assert checks["greedy tokens"]["ok"]
    # two one-token steps profiled, the prompt's forward left out: one token's worth of linears each
    assert d["profiled_units"] == 2
    ops = {o["op"]: o for o in d["ops"]}
    assert ops["linear"]["aten_calls"] == ops["linear"]["gems_calls"] == LINEARS_PER_TOKEN
    # the interpreter computes no bf16: every silu (of bf16 activations) of the profiled steps went to
    # ATen, and the result says why
    (why, calls), = d["fallbacks"]["silu.default"].items()
    assert calls == ops["silu"]["fallback"] * d["profiled_units"] > 0 and "bfloat16" in why, d["fallbacks"]


def test_decode_bf16_judges_a_token_flip_against_fp32_logits_of_its_context(tmp_path, monkeypatch):
    # the greedy-token check gets ATen's fp32 logits of a flip's context (prompt and the tokens before it)
    # for the low-precision rule: the reference the check is handed computes them
    import torch

    from gems_coverage import parity
    real, seen = parity.token_check, []

    def spy(g, a, ref_steps, got_steps=None, dtype=None, reference=None):
        out = reference(1, 0)
        seen.append((out.dtype, tuple(out.shape), bool(torch.isfinite(out).all()), tuple(ref_steps[1][0].shape)))
        return real(g, a, ref_steps, got_steps, dtype, reference)
    monkeypatch.setattr(parity, "token_check", spy)
    rc, d = _bench(tmp_path, "--workload", "decode", "--new-tokens", "3", "--dtype", "bfloat16", include="rsqrt")
    assert rc == 0, d
    (dtype, shape, finite, vocab), = seen
    assert dtype == torch.float32 and finite and shape == vocab


def test_decode_fresh_lengths_gives_every_run_new_kv_lengths(tmp_path, monkeypatch):
    from gems_coverage import runner
    seen = []
    real = runner.run_generate

    def spy(bundle, new_tokens=4, times=None, sync=None, sampling=None, prompt_len=None):
        seen.append((prompt_len, times is not None))
        out = real(bundle, new_tokens, times=times, sync=sync, sampling=sampling, prompt_len=prompt_len)
        if prompt_len is not None:
            assert out.shape[1] == new_tokens
        return out
    monkeypatch.setattr(runner, "run_generate", spy)
    rc, d = _bench(tmp_path, "--workload", "decode", "--new-tokens", "3", "--seq-len", "12", "--warmup", "1",
                   "--steps", "2", "--no-attribution", "--fresh-lengths")
    assert rc == 0 and d["agree"] and d["fresh_lengths"], d
    assert any("fresh lengths" in n for n in d["notes"])
    # run k (warm-up, then timed) decodes from 12 - 3k tokens in both modes: windows [9, 11], [6, 8], [3, 5]
    timed = [p for p, t in seen if t]
    assert timed == [9, 9, 6, 6, 3, 3], seen
    assert len(d["aten_ms"]) == len(d["gems_ms"]) == 2


@pytest.mark.parametrize("workload", ["train", "prefill"])
def test_fresh_lengths_cut_prefill_and_training_inputs_shorter_every_run(tmp_path, monkeypatch, workload):
    # dynamic padding: run k (warm-up, then timed; both modes) takes the inputs' first seq_len - k
    # positions, labels and mask included; the agreement runs keep the whole inputs
    from gems_coverage import runner
    seen = []
    real = runner.forward

    def spy(bundle, train=False):
        d = bundle.train_inputs if train else bundle.inputs
        lens = {v.shape[1] for v in d.values() if isinstance(v, torch.Tensor) and v.dim() == 2}
        assert len(lens) == 1, {k: tuple(v.shape) for k, v in d.items()}
        # a collator's batch is contiguous (on the H200 BERT's loss failed to .view a sliced label tensor)
        assert all(v.is_contiguous() for v in d.values() if isinstance(v, torch.Tensor)), d
        seen.append(lens.pop())
        return real(bundle, train)
    monkeypatch.setattr(runner, "forward", spy)
    rc, d = _bench(tmp_path, "--workload", workload, "--seq-len", "12", "--batch", "2", "--warmup", "1",
                   "--steps", "2", "--no-attribution", "--fresh-lengths")
    assert rc == 0 and d["agree"] and d["fresh_lengths"], d
    assert any("dynamic padding" in n for n in d["notes"])
    assert seen[-6:] == [11, 11, 10, 10, 9, 9] and set(seen[:-6]) == {12}, seen
    assert len(d["aten_ms"]) == len(d["gems_ms"]) == 2


def test_run_generate_prompt_len_trims_the_prompt():
    from gems_coverage import runner
    b = gems_models.build(gems_models.resolve("llama2"), size="tiny", device="cpu", dtype="float32", batch=2, seq_len=8,
                     seed=0)
    full = runner.run_generate(b, new_tokens=2)
    short = runner.run_generate(b, new_tokens=2, prompt_len=5)
    ids = b.inputs["input_ids"]
    b.inputs = dict(b.inputs, input_ids=ids[:, :5], attention_mask=b.inputs["attention_mask"][:, :5])
    assert torch.equal(short, runner.run_generate(b, new_tokens=2)) and full.shape == short.shape
    with pytest.raises(ValueError, match="prompt_len 9"):
        runner.run_generate(b, new_tokens=2, prompt_len=9)


def test_prefill_table_says_ratio_na_and_meaningless(capsys):
    rc = cli.main(["-q", "bench", "bert", "--device", "cpu", "--steps", "1", "--warmup", "0", "--seq-len", "6",
                   "--include", "rsqrt", "--no-attribution"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "ratio" in out and "meaningless (CPU interpreter)" in out and "n/a" in out and "agree    yes" in out


def broken_model(device, dtype, **_):
    """A module:function model whose forward fails: the CLI says so in one line and exits 3."""
    class Broken(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(4, device=device, dtype=dtype))

        def forward(self, x):
            raise RuntimeError("boom in forward")
    return Broken(), {"x": torch.ones(4, device=device, dtype=dtype)}


def test_error_while_running_exits_3(capsys):
    assert cli.main(["-q", "bench", "test_cov_bench:broken_model", "--device", "cpu", "--steps", "1",
                     "--warmup", "0"]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "boom in forward" in err[0]


@pytest.mark.parametrize("argv", [
    ["no-such-model"],
    ["bert", "--workload", "decode"],                  # not a causal LM
    ["llama2", "--device", "meta"],                    # bench runs real kernels
    ["llama2", "--workload", "decode", "--new-tokens", "1"],
    ["llama2", "--include", "no_such_aten_op"],
    ["llama2", "--warmup", "-1"],
    ["llama2", "--workload", "pretrain"],
    ["llama2", "--fresh-lengths", "--seq-len", "3", "--warmup", "1", "--steps", "1"],   # 3 - 2 runs: 1 token
    ["llama2", "--workload", "decode", "--fresh-lengths", "--seq-len", "6", "--new-tokens", "3",
     "--warmup", "1", "--steps", "1"],                                   # 6 - 2 runs x 3 leaves no prompt
    ["llama2", "--cold", "--compile"],                                   # --cold times eager first steps
])
def test_bad_input_exits_2_before_starting_anything(argv, capsys):
    device = [] if "--device" in argv else ["--device", "cpu"]
    assert cli.main(["-q", "bench", *argv, *device]) == 2
    assert "error" in capsys.readouterr().err


def test_llama_1_1b_recipe_is_tinyllama_and_not_a_default_builtin():
    r = gems_models.resolve("llama-1.1b")
    assert gems_models.resolve("tinyllama") is r and r.name not in gems_models.builtin_names()
    c = gems_models.load_config(r, "full")
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.num_attention_heads,
            c.num_key_value_heads, c.vocab_size, c.rms_norm_eps, c.max_position_embeddings,
            c.tie_word_embeddings) == (2048, 5632, 22, 32, 4, 32000, 1e-5, 2048, False)
    b = gems_models.build(r, size="full", device="meta", dtype="bfloat16", seq_len=16)
    n = sum(p.numel() for p in b.model.parameters())
    assert 1.0e9 < n < 1.2e9
    t = gems_models.load_config(r, "tiny")
    assert t.num_key_value_heads < t.num_attention_heads   # the tiny variant keeps grouped-query attention


def _gpu_like_result():
    from gems_coverage.bench_result import BenchResult, OpRow
    rows = [OpRow("fused::FusedLinearCrossEntropyFunctionBackward", 1, 1, 12345.6, 123456.7, 98765.4, 987654.3,
                  +1234.567, +9876.543, 1, 0),
            OpRow("_scaled_dot_product_flash_attention_backward", 22, 22, 118.2, 138398.6, 5123.4, 4987.1,
                  +2378.809, -2.99, 22, 0),
            OpRow("mm", 180, 180, 6242.5, 38398.6, 512.5, 498.7, +2378.809, -2.52, 170, 10)]
    return BenchResult("TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T", "train", "cuda", "NVIDIA H200",
                       "full", "bfloat16", 8, 2048, 0, 5, 2, "adamw", "step", 8 * 2048, aten_ms=[1.0],
                       gems_ms=[1.0], ops=rows, profiled_units=1,
                       totals={"aten_host_ms": 1.0, "gems_host_ms": 1.0, "aten_device_ms": 1.0,
                               "gems_device_ms": 1.0, "aten_wall_ms": 1.0, "gems_wall_ms": 1.0})


def test_attribution_table_fits_120_columns_and_wide_has_every_column():
    from gems_coverage.bench_result import format_result
    r = _gpu_like_result()
    table = format_result(r, "table")
    rows = table[table.index("\nop "):].splitlines()[1:]
    assert max(len(x) for x in rows) <= 120, "\n".join(rows)
    assert "dev A" in table and "Δdev ms" in table and "22/22" in table and "170/10" in table
    assert "fused::FusedLine…" in table and "--wide" in table
    wide = format_result(r, "table", wide=True)
    assert "fused::FusedLinearCrossEntropyFunctionBackward" in wide and "served/fell back" in wide
    assert max(len(x) for x in wide.splitlines()) > 120
    r.device, r.gpu = "cpu", "cpu"   # on CPU: no device columns
    for o in r.ops:
        o.aten_device_us_per_call = o.gems_device_us_per_call = o.delta_device_ms = None
    r.totals.update(aten_device_ms=None, gems_device_ms=None)
    cpu = format_result(r, "table")
    assert "dev A" not in cpu and "Δdev" not in cpu


def test_train_agrees_on_a_gpt2_config_folder(tmp_path):
    """GPT-2 names its dropouts attn_pdrop / resid_pdrop / embd_pdrop: left on, the two modes' dropout
    masks differed and the training agreement failed (rel err ~3e-3) while parity passed."""
    import transformers
    d = transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4, bos_token_id=1,
                                eos_token_id=2, architectures=["GPT2LMHeadModel"]).to_dict()
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps(d))
    out = tmp_path / "bench.json"
    rc = cli.main(["-q", "bench", str(tmp_path / "gpt2"), "--device", "cpu", "--workload", "train", "--steps", "1",
                   "--warmup", "0", "--seq-len", "6", "--no-attribution", "--include", "native_dropout",
                   "--format", "json", "-o", str(out)])
    d = json.loads(out.read_text())
    assert rc == 0 and d["agree"], d["agreement"]


def _cold(tmp_path, modes):
    """bench --cold of a tiny Llama on the CPU with `modes`: its JSON result, after checking the exit
    status and that the modes ran in the order given."""
    out = tmp_path / "cold.json"
    rc = cli.main(["-q", "bench", "llama2", "--device", "cpu", "--seq-len", "6", "--include", "rsqrt", "--cold",
                   "--cold-modes", ",".join(modes), "--format", "json", "-o", str(out)])
    assert rc == 0
    d = json.loads(out.read_text())
    assert list(d["modes"]) == list(modes)
    return d


def test_cold_runs_each_mode_in_a_fresh_process_from_empty_caches(tmp_path, monkeypatch):
    # --cold: ATen, Gems (compiling in the background) and Gems after gems.warmup (and, asked for, Gems
    # compiling every kernel at its first launch), each in its own process with its own empty Triton and
    # Gems cache folders, first and second step timed (two modes here: CI time)
    from gems_coverage import cold
    d = _cold(tmp_path, ["gems+warmup", "gems"])
    for mode, row in d["modes"].items():
        assert row["mode"] == mode and row["caches_empty"] is True
        assert row["first_s"] > 0 and row["second_s"] > 0
        assert 0 <= row["enter_s"] < row["first_s"]     # entering the mode is part of the first step
    # the interpreter compiles nothing: warmup has no kernels to compile, nothing waits in the background
    assert d["modes"]["gems+warmup"]["kernels"] == 0
    assert "background" not in d["modes"]["gems+warmup"]     # warmup's steps compile inline
    bg = d["modes"]["gems"]
    assert bg["background"] is True and bg["kernels"] == 0 and bg["aten_answers"] == 0 and bg["third_s"] > 0
    table = cold.format_cold(d)
    assert "to 1st step s" in table and "nothing compiles" in table and "third step" in table
    assert "of the first step entering the mode" in table
    # the interpreter compiles nothing on the calling thread either; the row says so, and the table too
    assert bg["inline_compiles"] == 0 and bg["inline_compile_s"] == 0 and bg["inline_slowest"] == {}
    assert "the calling thread waited 0.00 s for 0 kernel compiles" in table


def test_cold_again_reruns_gems_on_the_caches_it_left(tmp_path):
    # a user's second run: the same cache folders as the gems mode's, in a fresh process
    d = _cold(tmp_path, ["gems", "gems+again"])
    assert d["modes"]["gems"]["caches_empty"] is True
    assert d["modes"]["gems+again"]["caches_empty"] is False and d["modes"]["gems+again"]["background"] is True
    assert cli.main(["-q", "bench", "llama2", "--device", "cpu", "--cold", "--cold-modes", "gems+again,gems"]) == 2


def test_cold_with_patch_runs_the_gems_modes_patched(tmp_path, monkeypatch):
    """--cold --patch: the child builds the model, proves gems.patch replaces something (its report's
    counts in the row) and times the Gems mode on the patched model."""
    from gems_coverage import cold
    monkeypatch.setattr(cold, "MODES", ("gems",))
    out = tmp_path / "cold.json"
    rc = cli.main(["-q", "bench", "llama2", "--device", "cpu", "--seq-len", "6", "--include", "rsqrt", "--cold",
                   "--patch", "--format", "json", "-o", str(out)])
    assert rc == 0
    row = json.loads(out.read_text())["modes"]["gems"]
    assert row["patched"] and row["first_s"] > 0
    # the child's spec carries the options; without --patch it carries none
    spec = {}
    monkeypatch.setattr(cold.subprocess, "run", lambda argv, **kw: spec.update(json.loads(argv[-1])) or
                        type("P", (), {"returncode": 1, "stdout": "stop"})())
    with pytest.raises(RuntimeError, match="stop"):
        cold.cold_bench("llama2", patch={"layer_norm": True})
    assert spec["patch"] == {"layer_norm": True}
    with pytest.raises(RuntimeError):
        cold.cold_bench("llama2")
    assert spec["patch"] is None


def test_cold_says_each_modes_times_as_it_finishes(monkeypatch):
    """A cold run takes minutes per mode: each mode's times are printed when it ends, so a run cut off by a
    time limit still tells what it measured."""
    from gems_coverage import cold
    rows = {"aten": {"first_s": 1.25, "second_s": 0.5}, "gems+warmup": {"first_s": 2.0, "second_s": 0.5,
                                                                      "warmup_s": 30.0, "kernels": 41}}
    monkeypatch.setattr(cold.subprocess, "run", lambda argv, **kw: type("P", (), {"returncode": 0, "stdout": (
        cold.COLD_TAG + json.dumps(rows[json.loads(argv[-1])["mode"]]) + "\n")})())
    said = []
    cold.cold_bench("llama2", modes=("aten", "gems+warmup"), progress=said.append)
    assert "cold: aten: first step 1.25 s, second 0.50 s" in said
    assert "cold: gems+warmup: warmup 30.00 s (41 kernels), then first step 2.00 s, second 0.50 s" in said


def test_cold_modes_selects_the_modes_run(tmp_path, monkeypatch, capsys):
    from gems_coverage import cold
    ran = []
    monkeypatch.setattr(cold.subprocess, "run", lambda argv, **kw: ran.append(json.loads(argv[-1])["mode"]) or type(
        "P", (), {"returncode": 0, "stdout": cold.COLD_TAG + json.dumps({"first_s": 1.0, "second_s": 0.5}) + "\n"})())
    out = tmp_path / "cold.json"
    assert cli.main(["-q", "bench", "llama2", "--device", "cpu", "--cold", "--cold-modes", "gems,aten",
                     "--format", "json", "-o", str(out)]) == 0
    assert ran == ["gems", "aten"] and list(json.loads(out.read_text())["modes"]) == ["gems", "aten"]
    assert cli.main(["-q", "bench", "llama2", "--device", "cpu", "--cold", "--cold-modes", "gems,hot"]) == 2
    assert "unknown mode(s) ['hot']" in capsys.readouterr().err
    assert cli.main(["-q", "bench", "llama2", "--device", "cpu", "--cold-modes", "gems"]) == 2
    assert "give --cold too" in capsys.readouterr().err


def test_cold_table_names_each_rounds_slowest_compiles():
    # a warmup's rounds that compiled something get a line with their three slowest compiles, so the
    # kernel that bounds a round is named where the first-step times are
    from gems_coverage import cold
    row = {"mode": "gems+warmup", "first_s": 2.0, "second_s": 0.1, "warmup_s": 23.2, "kernels": 72,
           "warmup_rounds": [{"run_s": 2.6, "kernels": 71, "compile_s": 13.9, "slowest_s": 11.8, "load_s": 0.2,
                              "slowest": ["embedding_bwd_sort[BLOCK=4096, num_warps=4, num_stages=3] 11.80"]},
                             {"run_s": 0.5, "kernels": 1, "compile_s": 1.6, "slowest_s": 1.5, "load_s": 0.0,
                              "slowest": ["k[num_warps=4, num_stages=3] 1.50"]},
                             {"run_s": 0.5, "kernels": 0, "compile_s": 0.0, "slowest_s": 0.0, "load_s": 0.0,
                              "slowest": []}]}
    table = cold.format_cold({"model": "m", "workload": "train", "device": "cuda", "modes": {"gems+warmup": row}})
    lines = [line for line in table.splitlines() if " round " in line]
    assert lines == ["gems+warmup round 1: 71 kernels compiled in 13.90 s; slowest: "
                     "embedding_bwd_sort[BLOCK=4096, num_warps=4, num_stages=3] 11.80",
                     "gems+warmup round 2: 1 kernels compiled in 1.60 s; slowest: k[num_warps=4, num_stages=3] 1.50"]
