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
