"""gems-coverage tune: runs the workloads once with Gems on and reports what the autotune cache gained."""
import json

import pytest

from gems_coverage import cli
from gems_coverage import tune as T


def test_added_counts_new_buckets_and_cublas_choices(tmp_path):
    (tmp_path / "mm16-auto2.json").write_text(json.dumps({"a": {"BLOCK_M": 64}}))
    before = T._snapshot(tmp_path)
    (tmp_path / "mm16-auto2.json").write_text(json.dumps({"a": {"BLOCK_M": 64}, "b": {"aten": True},
                                                           "c": {"BLOCK_M": 128}}))
    (tmp_path / "mm32-auto2.json").write_text(json.dumps({"d": {"aten": True}}))
    (tmp_path / "broken.json").write_text("{not json")
    after = T._snapshot(tmp_path)
    assert after["broken"] == {}
    assert T._added(before, after) == {"mm16-auto2": {"tuned": 2, "aten": 1}, "mm32-auto2": {"tuned": 1, "aten": 1}}
    assert T._added(after, after) == {}


def test_tune_on_the_interpreter_runs_and_says_nothing_is_tuned(tmp_path, monkeypatch):
    monkeypatch.setenv("GEMS_CACHE_DIR", str(tmp_path))
    out = tmp_path / "t.json"
    rc = cli.main(["-q", "tune", "llama2", "--device", "cpu", "--seq-len", "6", "--format", "json", "-o", str(out)])
    assert rc == 0
    d = json.loads(out.read_text())
    assert [w["workload"] for w in d["workloads"]] == ["prefill", "train"]
    assert d["can_tune"] is False and all(w["tuned"] == 0 for w in d["workloads"])
    assert "nothing is tuned or stored" in d["notes"][0]
    assert d["cache"].startswith(str(tmp_path))


@pytest.mark.parametrize("args,msg", [(["--workloads", "foo"], "unknown workload 'foo'"),
                                      (["--workloads", "decode"], "needs a causal LM"),
                                      (["--workloads", ""], "no workload given"),
                                      (["--device", "meta"], "tune runs real kernels")])
def test_tune_bad_input_is_exit_2(capsys, args, msg):
    assert cli.main(["-q", "tune", "bert", "--device", "cpu", *args]) == 2
    assert msg in capsys.readouterr().err


def test_tune_patch_refuses_an_unpatchable_model_before_running(capsys, tmp_path, monkeypatch):
    """With its losses and activation off gems.patch replaces nothing in GPT-2 (ungated MLP, LayerNorms off by
    default): --patch is bad input (exit 2, one line), found before any run."""
    monkeypatch.setenv("GEMS_CACHE_DIR", str(tmp_path))
    f = tmp_path / "gpt2.json"
    f.write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 256,
                             "n_positions": 64, "n_embd": 64, "n_layer": 2, "n_head": 4}))
    rc = cli.main(["tune", str(f), "--device", "cpu", "--seq-len", "6", "--patch", "--patch-options",
                   "cross_entropy=off,fused_linear_cross_entropy=off,activation=off"])
    err = capsys.readouterr().err
    assert rc == 2 and "--patch: gems.patch replaces nothing in" in err, err
    assert "one run with Gems on" not in err, err


def test_tune_layers_is_reported_and_table_takes_no_model(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GEMS_CACHE_DIR", str(tmp_path))
    out = tmp_path / "t.json"
    assert cli.main(["-q", "tune", "bert", "--device", "cpu", "--seq-len", "6", "--workloads", "prefill",
                     "--layers", "1", "--format", "json", "-o", str(out)]) == 0
    assert json.loads(out.read_text())["layers"] == 1
    assert cli.main(["-q", "tune", "bert", "--table"]) == 2
    assert "give no MODEL with it" in capsys.readouterr().err
    assert cli.main(["-q", "tune"]) == 2
    assert "give a MODEL, or --table" in capsys.readouterr().err
