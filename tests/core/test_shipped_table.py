"""The tuned picks Gems ships (gems/runtime/tuned/<arch>/): every pick is a config its tuner still times,
and, on a GPU the table is for, the shipped workloads (gems_coverage/tune.py: TABLE_WORKLOADS) tune nothing.

A renamed tuner or a dropped config silently sends a first call back to tuning: these tests fail instead,
and `gems-coverage tune --table` + `python scripts/ship_tuned.py` on that GPU re-ship the table."""
import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gems.ops.blas import matmul
from gems.ops.norm import softmax
from gems.runtime import autotune
from gems_coverage.tune import TABLE_WORKLOADS, table_model

ROOT = Path(__file__).resolve().parents[2]
SHIPPED_ARCHS = ("sm90",)   # the GPUs measured (H200; H100 shares sm90's kernels and picks the same way)


def _tuners() -> dict:
    """{file name in the shipped table: the configs that tuner times on a GPU}."""
    groups = sorted(matmul.DEFAULT_CANDIDATES)
    out = {}
    for itemsize in (2, 4):
        for triton_only in (False, True):
            g = groups if itemsize <= 2 else []
            out[matmul.tuner_name(itemsize, triton_only, g)] = matmul.tuner_configs(itemsize, triton_only, g)
    out.update({f"softmax_{w}": softmax.TUNE_CONFIGS for w in ("fwd", "bwd")})
    # each timing keeps its own file (autotune.Autotuner._file): "do_bench" the bare name
    suffixes = ["" if t == "do_bench" else f"-{t}" for t in autotune.TIMINGS]
    return {f"{name}{sfx}.json": configs for name, configs in out.items() for sfx in suffixes}


@pytest.mark.parametrize("arch", SHIPPED_ARCHS)
def test_every_shipped_pick_is_a_config_its_tuner_still_times(arch):
    files = sorted((autotune.SHIPPED_DIR / arch).glob("*.json"))
    assert files, f"no shipped table for {arch}"
    tuners = _tuners()
    gemm = matmul.tuner_name(2, False, sorted(matmul.DEFAULT_CANDIDATES))
    assert any(f.name.startswith(gemm) for f in files), f"the bf16 GEMM tuner {gemm} has no shipped picks"
    for f in files:
        assert f.name in tuners, f"{f.name}: no tuner of that name (renamed? re-ship the table)"
        picks = json.loads(f.read_text())
        assert picks, f.name
        for bucket, cfg in picks.items():
            assert isinstance(ast.literal_eval(bucket), tuple), (f.name, bucket)
            assert cfg in tuners[f.name], f"{f.name} {bucket}: {cfg} is no longer among the tuner's configs"


def test_the_table_workloads_resolve():
    from gems_models import resolve
    assert {w["patch"] for w in TABLE_WORKLOADS} == {False, True}
    for w in TABLE_WORKLOADS:
        assert resolve(table_model(w["model"])).kind in ("causal_lm", "masked_lm"), w


def _arch():
    from gems.runtime.backends import backend
    return backend().arch


@pytest.mark.skipif(os.environ.get("GEMS_TEST_DEVICE", "cpu") != "cuda",
                    reason="tuning needs a GPU (the interpreter times nothing)")
@pytest.mark.parametrize("spec", TABLE_WORKLOADS, ids=lambda w: f"{w['model']}{'-patched' if w['patch'] else ''}")
def test_the_table_workloads_tune_nothing_on_a_shipped_gpu(spec, tmp_path):
    """Each workload, two layers deep (the same buckets as the full model), in a fresh process with an empty
    cache: every bucket must come from the shipped table."""
    if _arch() not in SHIPPED_ARCHS:
        pytest.skip(f"no table is shipped for {_arch()}")
    args = [sys.executable, "-m", "gems_coverage.cli", "-q", "tune", table_model(spec["model"]),
            "--device", "cuda", "--layers", "2", "--workloads", ",".join(spec["workloads"]),
            "--seq-len", str(spec["seq_len"]), "--batch", str(spec.get("batch", 1)), "--format", "json"]
    # the knobs that pick another tuner (and so another table file) are the defaults a user has
    env = {k: v for k, v in os.environ.items() if k not in ("GEMS_GEMM", "GEMS_GEMM_CANDIDATES", "GEMS_TUNE_TIMING")}
    env.update(GEMS_CACHE_DIR=str(tmp_path), PYTHONPATH=str(ROOT))
    p = subprocess.run(args + (["--patch"] if spec["patch"] else []), capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(p.stdout)
    added = {w["workload"]: w["added"] for w in r["workloads"] if w["tuned"]}
    assert not added, f"tuned on a first call (not in the shipped table): {added}"
