"""benchmarks.gemm_shapes (the GEMMs models call) and benchmarks.gemm (ATen vs Gems on them).

Expectations come from the models' structure (a Linear's weight shape, how many there are, the
autograd formulas of mm), never from recorded output; the committed gemm_cases.json is checked for
consistency and, for one cheap source, against a fresh trace."""
import json
import os
from collections import Counter

import pytest
import torch

import gems_models
from benchmarks import gemm, gemm_shapes as gs
from harness import DEVICE

BF = torch.bfloat16


class _MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(8, 16, bias=True)
        self.down = torch.nn.Linear(16, 4, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _mlp_bundle(x_needs_grad):
    with torch.device("meta"):
        m = _MLP().to(BF)
    x = torch.randn(2, 5, 8, device="meta", dtype=BF, requires_grad=x_needs_grad)
    recipe = gems_models.Recipe(name="mlp", kind="custom")
    return gems_models.ModelBundle(recipe=recipe, model=m, config=None, size="tiny", device="meta", dtype=BF,
                              custom_args=(x,))


def _key(r):
    return (r["op"], r["M"], r["N"], r["K"], r["layout"], r["bias"], r["role"])


@pytest.mark.parametrize("x_needs_grad", [False, True])
def test_linear_forward_and_backward_gemms(x_needs_grad):
    recs, other = gs.trace_gemms(_mlp_bundle(x_needs_grad), "train")
    T = 2 * 5   # tokens: a contiguous 3-D input is flattened
    want = {
        # forward: linear = x @ W.t(): B is the transposed weight; with a bias, one addmm, bias per column
        ("addmm", T, 16, 8, "NT", "row", "up"), ("mm", T, 4, 16, "NT", None, "down"),
        # backward of y = x @ W.t(): dX = dY @ W (M=T, K=out), dW = dY.t() @ x (M=out, K=T)
        ("mm", T, 16, 4, "NN", None, "down dX"), ("mm", 4, 16, T, "TN", None, "down dW"),
        ("mm", 16, 8, T, "TN", None, "up dW"),
    }
    if x_needs_grad:   # the first layer's dX only exists when its input needs a gradient
        want.add(("mm", T, 8, 16, "NN", None, "up dX"))
    assert {_key(r) for r in recs} == want
    assert all(r["count"] == 1 and r["dtype"] == "bf16" and r["batch"] == 1 for r in recs)
    assert other == {}


def test_inference_records_only_the_forward():
    recs, _ = gs.trace_gemms(_mlp_bundle(True), "prefill")
    assert sorted(r["role"] for r in recs) == ["down", "up"]


def _linears(model):
    return [(gs.role_name(n), tuple(m.weight.shape)) for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear)]


def test_tiny_llama_train_has_every_linear_and_both_gradients():
    batch, seq = 2, 6
    b = gems_models.build("llama2", size="tiny", device="meta", dtype="bfloat16", batch=batch, seq_len=seq)
    lin = _linears(b.model)
    recs, _ = gs.trace_gemms(b, "train")
    got = Counter()
    for r in recs:
        got[(r["role"], r["op"], r["M"], r["N"], r["K"], r["layout"])] += r["count"]
    T = batch * seq
    want = Counter()
    for role, (out_f, in_f) in lin:   # Llama's Linears have no bias: mm on the flattened tokens
        want[(role, "mm", T, out_f, in_f, "NT")] += 1
        want[(role + " dX", "mm", T, in_f, out_f, "NN")] += 1
        want[(role + " dW", "mm", out_f, in_f, T, "TN")] += 1
    gemms = Counter({k: v for k, v in got.items() if not k[0].endswith("rotary_emb")})
    assert gemms == want
    # the rotary embedding's fp32 outer product inv_freq x positions is a bmm with K = 1
    rope = [r for r in recs if r["role"].endswith("rotary_emb")]
    assert rope and all(r["op"] == "bmm" and r["K"] == 1 and r["dtype"] == "f32" for r in rope)
    # no attention GEMM: on meta, SDPA runs through the fused-kernel stand-in (CUDA runs fused kernels)
    assert not [r for r in recs if r["role"].endswith("self_attn") or r["role"].endswith("self_attn bwd")]


def test_tiny_decode_step_has_m_equal_batch():
    b = gems_models.build("llama2", size="tiny", device="meta", dtype="bfloat16", batch=3, seq_len=5)
    recs, _ = gs.trace_gemms(b, "decode")
    mms = [r for r in recs if r["op"] == "mm"]
    assert {r["M"] for r in mms} == {3}
    assert sum(r["count"] for r in mms) == len(_linears(b.model))   # one step: each Linear once


def test_layouts_and_bias_kinds():
    x = torch.empty(6, 4, device="meta")
    assert gs.layout(x) == "N" and gs.layout(x.t()) == "T" and gs.layout(x[:, ::2]) == "strided"
    assert gs.layout(torch.empty(1, 4, device="meta").t()) in ("N", "T")     # size-1 dims never decide
    assert gs.compact(x) and not gs.compact(torch.empty(6, 8, device="meta")[:, :4])
    assert gs.bias_kind(torch.empty(4), (6, 4)) == "row"
    assert gs.bias_kind(torch.empty(6, 1), (6, 4)) == "col"
    assert gs.bias_kind(torch.empty(6, 4), (6, 4)) == "full"


# ------------------------------------------------------------------------------ the committed table
@pytest.fixture(scope="module")
def table():
    with open(gs.OUT_FILE) as f:
        return json.load(f)


def test_committed_table_is_consistent(table):
    assert table["command"] == gs.COMMAND and table["device"] == "meta"
    assert table["generated_with"]["torch"] and table["generated_with"]["transformers"]
    cases = table["cases"]
    assert len({c["id"] for c in cases}) == len(cases) and 20 <= len(cases) <= 200
    sources = set()
    for c in cases:
        assert c["op"] in ("mm", "addmm", "bmm", "baddbmm") and c["dtype"] in ("bf16", "f32")
        assert min(c["M"], c["N"], c["K"], c["batch"]) >= 1
        assert len(c["layout"]) == 2 and set(c["layout"]) <= {"N", "T"}
        assert c["flops"] == 2 * c["M"] * c["N"] * c["K"] * c["batch"]
        assert (c.get("bias") is not None) == (c["op"] in ("addmm", "baddbmm"))
        for s in c["sources"]:
            assert s["count"] > 0 and sum(s["roles"].values()) == s["count"]
            sources.add((s["model"], s["workload"], s["batch"]))
            if s["workload"] == "decode" and c["dtype"] == "bf16":
                assert c["M"] == s["batch"]      # a decode step multiplies one token per sequence
    assert sources == {(m, w, b) for m, w, b, _ in gs.PLAN}     # every model / workload represented
    layouts = {(s["workload"], c["layout"]) for c in cases for s in c["sources"] if c["dtype"] == "bf16"}
    assert {("prefill", "NT"), ("train", "NT"), ("train", "NN"), ("train", "TN")} <= layouts


def test_committed_table_matches_a_fresh_trace(table):
    """BERT's prefill at full size on meta (~1 s) gives exactly the committed cases of that source."""
    model, workload, batch, tokens = next(p for p in gs.PLAN if p[:2] == ("bert", "prefill"))
    recs, _ = gs.collect(model, workload, batch, tokens)
    fresh = gs.merge([({"model": model, "workload": workload, "batch": batch, "tokens": tokens}, recs)])
    committed = [dict(c, sources=[s for s in c["sources"] if (s["model"], s["workload"]) == (model, workload)])
                 for c in table["cases"]]
    committed = [c for c in committed if c["sources"]]
    assert fresh == committed, "benchmarks/gemm_cases.json is stale: run python -m benchmarks.gemm_shapes"


def test_benchmark_inputs_have_the_recorded_layouts(table):
    seen = {}
    for c in table["cases"]:
        seen.setdefault((c["op"], c["layout"], c.get("bias")), c)
    for c in seen.values():
        small = gemm.scaled(c, 8)
        fn, args, kw = gemm.make_call(small, "cpu", torch.float32)
        a, b = args[-2:]
        assert gs.layout(a) + gs.layout(b) == c["layout"]
        assert (a.shape[-2], a.shape[-1], b.shape[-1]) == (small["M"], small["K"], small["N"])
        if c.get("bias"):
            out = fn(*args, **kw)
            assert gs.bias_kind(args[0], out.shape) == c["bias"]


# ------------------------------------------------------------------------------ the benchmark's smoke run
@pytest.fixture(autouse=True)
def _gemm_policy_env(monkeypatch):
    # gemm.main sets GEMS_GEMM=triton for its own process (docs/design.md, decision 12): undone after each test
    monkeypatch.setenv("GEMS_GEMM", os.environ.get("GEMS_GEMM", "triton"))


@pytest.mark.parametrize("filters", [["--model", "bert", "--max-cases", "2"],
                                     ["--model", "llama-1.1b", "--max-cases", "2"]], ids=["addmm", "bmm+mm"])
def test_smoke_run_writes_json(tmp_path, capsys, filters):
    # CPU: the interpreter at dims capped to 64 and its one config; GPU: the cases at their model sizes,
    # tuned (an interpreter-only run on a GPU machine would serve nothing: Triton there compiles for CUDA)
    out = tmp_path / "gemm.json"
    assert gemm.main(["--device", DEVICE, "--quick", *filters, "-o", str(out)]) == 0
    d = json.loads(out.read_text())
    assert len(d["rows"]) == 2 and d["env"]["cap"] == (64 if DEVICE == "cpu" else None)
    for r in d["rows"]:
        assert "error" not in r, r
        assert r["served"] > 0 and not r["fallback"] and r["correct"], r
        assert r["ratio"] > 0 and r["aten_TFLOPs"] > 0
        if DEVICE == "cpu":
            assert max(r["M"], r["N"], r["K"]) <= 64
            assert r["config"].startswith("ptr 32x32x32")    # the interpreter's one config, named
        else:
            assert r["aten_kernel"] and r["config"].split()[0] in ("ptr", "tma", "gluon"), r
    assert d["summary"]["counted"] == 2 and d["summary"]["geomean_ratio"] > 0
    assert "geomean ratio" in capsys.readouterr().out


def test_candidates_flag_picks_the_extra_search_space(tmp_path, monkeypatch):
    # candidate groups beyond the base 16-bit search space (the Gluon wide, wave and deep tiles are offered
    # by default),
    # each set under its own tuning cache; --candidates picks them for an A/B run ('' none), the JSON says
    # which ran, and a group the library does not know is an error, not a silently smaller space
    from gems.ops.blas import matmul as blas
    # scoped: monkeypatch.undo() would also undo the module's GEMS_GEMM fixture, and gemm.main below would then
    # set GEMS_GEMM=triton for the rest of the worker (its later subprocesses tuned the Triton-only space)
    with monkeypatch.context() as m:
        m.setattr(blas, "_TUNERS", {})
        m.setattr(blas, "backend", lambda: type("B", (), {"name": "cuda"})())   # the GPU's search space
        assert blas.CANDIDATES == ("wide", "wave", "deep")
        space = blas._tuner(2, triton_only=True)
        every = blas._GLUON_WIDE + blas._GLUON_WAVE + blas._GLUON_DEEP
        assert all(c in space.configs for c in every) and space.name == "mm16v4dqw"
        m.setattr(blas, "CANDIDATES", ("wide",))
        wide = blas._tuner(2, triton_only=True)
        assert wide.name == "mm16v4w" and not any(c in wide.configs for c in blas._GLUON_WAVE)
        assert not any(c in blas._tuner(4).configs for c in blas._GLUON_WIDE)      # 16-bit inputs only
        m.setattr(blas, "CANDIDATES", ("wave", "wide"))
        both = blas._tuner(2, triton_only=True)
        assert both.name == "mm16v4qw" and all(c in both.configs for c in blas._GLUON_WAVE + blas._GLUON_WIDE)
        m.setattr(blas, "CANDIDATES", ("tall",))
        with pytest.raises(ValueError, match="unknown group"):
            blas._tuner(2)
    monkeypatch.setattr(blas, "CANDIDATES", ("wide",))
    monkeypatch.setattr(blas, "_TUNERS", {})
    for arg, want in (("", []), ("wide,wave", ["wide", "wave"])):
        out = tmp_path / f"gemm{len(want)}.json"
        assert gemm.main(["--device", DEVICE, "--quick", "--model", "bert", "--max-cases", "1", "--candidates", arg,
                          "-o", str(out)]) == 0
        assert json.loads(out.read_text())["env"]["candidates"] == want
        assert list(blas.CANDIDATES) == want
    with pytest.raises(SystemExit):
        gemm.main(["--device", DEVICE, "--quick", "--candidates", "wide,tall", "-o", str(tmp_path / "x.json")])


def test_tuner_flags_set_its_confirm_rounds_and_timing(tmp_path, monkeypatch):
    from gems.runtime import autotune
    monkeypatch.setattr(autotune, "CONFIRM_ROUNDS", 0)
    out = tmp_path / "gemm.json"
    assert gemm.main(["--device", DEVICE, "--quick", "--model", "bert", "--max-cases", "1", "--confirm-rounds", "2",
                      "-o", str(out)]) == 0
    assert autotune.CONFIRM_ROUNDS == 2 and json.loads(out.read_text())["env"]["confirm_rounds"] == 2
    monkeypatch.setattr(autotune, "TIMING", "do_bench")
    assert gemm.main(["--device", DEVICE, "--quick", "--model", "bert", "--max-cases", "1", "--tuner-timing", "hold",
                      "-o", str(out)]) == 0
    assert autotune.TIMING == "hold" and json.loads(out.read_text())["env"]["tuner_timing"] == "hold"
    with pytest.raises(SystemExit):
        gemm.main(["--device", DEVICE, "--quick", "--confirm-rounds", "-1", "-o", str(tmp_path / "x.json")])


def test_cpu_run_in_a_gpu_process_is_refused_not_half_switched(monkeypatch):
    # triton fixes the interpreter at import: in a process that imported it for the GPU, --device cpu must
    # stop with why, not set TRITON_INTERPRET under the process's later Gems calls (they would all raise)
    import triton.language.standard as std
    from benchmarks.interpreter import use_interpreter_for
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    use_interpreter_for("cuda")
    assert "TRITON_INTERPRET" not in os.environ
    monkeypatch.setattr(std, "sigmoid", lambda x: x)          # what a GPU process's triton defines
    with pytest.raises(SystemExit, match="before triton is imported"):
        use_interpreter_for("cpu")
    assert "TRITON_INTERPRET" not in os.environ


def test_rounds_time_both_sides_in_turns(tmp_path, monkeypatch):
    # --rounds N: ATen and Gems timed alternately N times after the untimed first call; each side's time
    # is its median and the row keeps the per-round ratios' range (fake times: 1, 2, 3, ... per timing)
    import gems
    seen = []
    monkeypatch.setattr(gemm.Timer, "__call__", lambda self, fn: seen.append(gems.is_enabled()) or float(len(seen)))
    out = tmp_path / "gemm.json"
    assert gemm.main(["--device", DEVICE, "--quick", "--model", "bert", "--max-cases", "1", "--rounds", "3",
                      "-o", str(out)]) == 0
    d = json.loads(out.read_text())
    first = len(seen) - 5                    # the case's timings are the last six (the GPU times a copy first)
    assert seen[-6:] == [False, True] * 3
    r = d["rows"][0]
    assert d["env"]["rounds"] == 3 and r["served"] > 0
    assert (r["aten_ms"], r["gems_ms"]) == (first + 2, first + 3)
    ratios = [(first + k + 1) / (first + k) for k in (0, 2, 4)]
    assert r["round_ratios"] == pytest.approx([min(ratios), max(ratios)])
    with pytest.raises(SystemExit):
        gemm.main(["--device", DEVICE, "--quick", "--rounds", "0", "-o", str(tmp_path / "x.json")])


def test_tile_of_reads_the_tile_a_kernel_name_states():
    # what the GPU table shows of `aten_kernel` (cuBLAS's kernel, profiled once per case on the GPU)
    assert gemm.tile_of("nvjet_sm90_tst_192x96_64x5_1x2_h_bz_coopB_bias_TNT") == "192x96"
    assert gemm.tile_of("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1") == "128x256"
    assert gemm.tile_of("ampere_sgemm_128x64_nn") == "128x64"
    assert gemm.tile_of("gemv2T_kernel") == "" and gemm.tile_of(None) == ""
