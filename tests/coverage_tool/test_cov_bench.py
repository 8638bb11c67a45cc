"""gems-coverage bench: the model benchmark runs each workload with ATen and Gems, checks agreement and
attributes the difference per ATen op (tiny models on CPU: timings meaningless, everything else real).
Gems serves a few ops here (--include) to keep the interpreter's share of CI time small."""
import json

import pytest

from coverage_tool import cli

SCHEMA_KEYS = {"model", "workload", "device", "gpu", "size", "dtype", "batch", "seq_len", "new_tokens", "steps",
               "unit", "tokens_per_unit", "aten_ms", "gems_ms", "aten_ms_median", "gems_ms_median",
               "aten_tokens_per_s", "gems_tokens_per_s", "throughput_ratio", "aten_peak_mib", "gems_peak_mib",
               "agree", "agreement", "ops", "totals", "meaningful", "versions", "no_plan"}
OP_KEYS = {"op", "aten_calls", "gems_calls", "aten_host_us", "gems_host_us", "aten_device_us", "gems_device_us",
           "served", "fallback", "delta_host_ms", "delta_device_ms"}


def _bench(tmp_path, *extra):
    out = tmp_path / "bench.json"
    rc = cli.main(["-q", "bench", "llama2", "--device", "cpu", "--steps", "1", "--warmup", "0", "--seq-len", "6",
                   "--include", "rsqrt", "--format", "json", "-o", str(out), *extra])
    return rc, (json.loads(out.read_text()) if out.exists() else None)


def test_train_bench_json_follows_the_schema(tmp_path):
    rc, d = _bench(tmp_path, "--workload", "train")
    assert rc == 0
    assert SCHEMA_KEYS <= set(d), SCHEMA_KEYS - set(d)
    assert d["agree"] and d["agreement"][0]["ok"]
    assert not d["meaningful"] and d["unit"] == "step" and len(d["aten_ms"]) == len(d["gems_ms"]) == 1
    assert d["throughput_ratio"] > 0
    ops = {o["op"]: o for o in d["ops"]}
    assert all(OP_KEYS <= set(o) for o in d["ops"])
    assert ops["rsqrt"]["served"] > 0 and ops["rsqrt"]["aten_calls"] > 0
    assert sum(o["served"] for o in d["ops"]) > 0


@pytest.mark.parametrize("workload", ["prefill", "decode"])
def test_inference_workloads(tmp_path, workload):
    rc, d = _bench(tmp_path, "--workload", workload, "--new-tokens", "3", "--no-attribution")
    assert rc == 0, d
    assert d["agree"]
    assert d["unit"] == ("token" if workload == "decode" else "step")
    assert d["tokens_per_unit"] == (1 if workload == "decode" else 6)


def test_table_output_names_the_ratio(tmp_path, capsys):
    rc = cli.main(["-q", "bench", "bert", "--device", "cpu", "--steps", "1", "--warmup", "0", "--seq-len", "6",
                   "--include", "rsqrt", "--no-attribution"])
    out = capsys.readouterr().out
    assert rc == 0 and "ratio" in out and "meaningless" in out


def test_bad_input_exits_2(capsys):
    assert cli.main(["-q", "bench", "no-such-model", "--device", "cpu"]) == 2
    assert cli.main(["-q", "bench", "bert", "--device", "cpu", "--workload", "decode"]) == 2
    assert cli.main(["-q", "bench", "llama2", "--device", "meta"]) == 2
