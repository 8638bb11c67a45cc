"""gems-coverage bench --cuda-graphs: runs (on the CPU: the static-cache eager path; under
GEMS_TEST_DEVICE=cuda: graphs captured and replayed), agrees, and refuses what it does not measure."""
from __future__ import annotations

import os
import warnings

import pytest

from gems_coverage import bench as B

# the active Gems backend serves one device type: the benches run on the suite's device
DEVICE = os.environ.get("GEMS_TEST_DEVICE", "cpu")


def test_bench_cuda_graphs_runs_and_agrees():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = B.bench("llama2", workload="decode", device=DEVICE, size="tiny", dtype="float32", new_tokens=2,
                    steps=1, warmup=0, seq_len=4, cuda_graphs=True)   # the least the interpreter must run
    assert r.agree and len(r.aten_ms) == 1 and len(r.gems_ms) == 1
    assert [c["check"] for c in r.agreement] == ["greedy tokens", "greedy tokens, graphed vs Gems' eager steps"]
    assert any("gems.decode.graphed" in n for n in r.notes)
    assert any(n.startswith("read roof:") for n in r.notes) == (DEVICE == "cuda")


@pytest.mark.parametrize("kw", [dict(workload="prefill"), dict(workload="decode", compile=True),
                                dict(workload="decode", fresh_lengths=True)])
def test_bench_cuda_graphs_refuses(kw):
    import gems_models as M
    with pytest.raises(M.ModelError, match="--cuda-graphs"):
        B.bench("llama2", device=DEVICE, cuda_graphs=True, **kw)


@pytest.mark.parametrize("argv", [["llama2", "--cuda-graphs"],                               # prefill
                                  ["llama2", "--workload", "decode", "--cuda-graphs", "--cold"],
                                  ["llama2", "--workload", "decode", "--cuda-graphs", "--compile"],
                                  ["bert", "--workload", "decode", "--cuda-graphs"]])
def test_cli_cuda_graphs_bad_input_exits_2(argv, capsys):
    from gems_coverage import cli
    assert cli.main(["-q", "bench", *argv, "--device", "cpu"]) == 2
    assert "error" in capsys.readouterr().err


def test_fp32_step_logits_are_the_context_of_that_step():
    # the reference that judges a flip at step s: ATen in fp32 on the prompt and the s tokens before it,
    # which is what generate's own step s computed (here in fp32 already, so the two agree to rounding);
    # batch row 1 has a left-padded prompt, and the model is put back in its dtype afterwards
    import torch

    import gems_models as M
    from gems.decode.timing import generate_greedy
    b = M.build("llama2", size="tiny", device=DEVICE, dtype="float32", batch=2, seq_len=6, seed=0)
    m = b.model.eval()
    inputs = {"input_ids": b.inputs["input_ids"], "attention_mask": torch.ones_like(b.inputs["input_ids"])}
    inputs["attention_mask"][1, :2] = 0
    tokens, steps = generate_greedy(m, inputs, 3, pad_token_id=0)
    for s in (0, 2):
        for row in (0, 1):
            got = B.fp32_step_logits(b, inputs, tokens, s, row)
            torch.testing.assert_close(got, steps[s][row].float().cpu(), rtol=1e-4, atol=1e-4)
    m.half()
    B.fp32_step_logits(b, inputs, tokens, 1, 0)
    assert next(m.parameters()).dtype == torch.float16
