"""gems_coverage.distributed: the torchrun training recipe, 2 processes on gloo, tiny Aquila, Gems through the
Triton interpreter.

Each run trains DDP or FSDP2 twice in the same processes (ATen, then gems.enable()) and compares the per-step
losses by parity's rule. Gems serves a few cheap ops here (--include; `mm` under the interpreter costs ~1 s a
step) to keep CI time small; the GPU run serves everything. GEMS_FAST=0 in the children: the C++ fast path
would be built on first use (~50 s), which is no part of what these tests check.
"""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gems_coverage.distributed.data import Data
from gems_coverage.distributed.launch import launch_main, main
from gems_coverage.distributed.training import RunResult
from gems_coverage.distributed.verdict import agreement

ROOT = Path(__file__).resolve().parents[2]
INCLUDE = ("rsqrt.default,silu.default,silu_backward.default,_log_softmax.default,"
           "_log_softmax_backward_data.default,embedding.default,mean.dim")
TOP_KEYS = {"model", "size", "strategy", "world_size", "backend", "device", "param_dtype", "compute_dtype",
            "mixed_precision", "checkpointing", "batch", "micro_batch_per_rank", "seq_len", "steps", "warmup",
            "seed", "lr", "clip", "optimizer", "data", "runs", "agreement", "throughput_ratio", "ops", "faults",
            "first_divergence", "divergences", "shadow_ran", "shadow_calls", "notes", "verdict", "versions"}
RUN_KEYS = {"losses", "grad_norms", "step_ms", "tokens_per_s", "peak_mib_per_rank", "peak_kind"}
STEP_KEYS = {"step", "aten_loss", "gems_loss", "rel_err", "tol", "ok", "aten_grad_norm", "gems_grad_norm"}


def _env(strict: bool):
    env = dict(os.environ)
    env.update(TRITON_INTERPRET="1", GEMS_STRICT="1" if strict else "0", GEMS_FAST="0", OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        env.pop(k, None)
    return env


def _torchrun(tmp_path, *args, strict=True, timeout=240, model="aquila"):
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "gems_coverage.distributed", model, "--device", "cpu", "--steps", "2", "--seq-len", "8",
           "--include", INCLUDE, "-q", "-o", str(out), *args]
    p = subprocess.run(cmd, cwd=ROOT, env=_env(strict), capture_output=True, text=True, timeout=timeout)
    assert out.exists(), f"no result (exit {p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    return p, json.loads(out.read_text())


def _check_common(d, strategy):
    assert TOP_KEYS <= set(d), TOP_KEYS - set(d)
    assert d["strategy"] == strategy and d["world_size"] == 2 and d["backend"] == "gloo" and d["size"] == "tiny"
    assert d["batch"] == 2 and d["micro_batch_per_rank"] == 1
    for m in ("aten", "gems"):
        r = d["runs"][m]
        assert RUN_KEYS <= set(r)
        assert len(r["losses"]) == len(r["grad_norms"]) == len(r["step_ms"]) == 2
        assert len(r["peak_mib_per_rank"]) == 2 and r["tokens_per_s"] > 0
        assert all(n > 0 for n in r["grad_norms"])
    ag = d["agreement"]
    assert len(ag["steps"]) == 2 and all(STEP_KEYS <= set(s) for s in ag["steps"])
    ops = d["ops"]
    assert ops["compute_ops"] > 10 and ops["served_compute_ops"] >= 5
    served = {o["op"] for o in ops["compute"] if o["gems"].startswith("served")}
    assert {"silu.default", "_log_softmax.default"} <= served
    assert ops["gaps"] and all(o["gems"] != "served" for o in ops["gaps"])
    assert ops["collectives"], "the traced step shows no collective"
    assert ops["wrapper_ops"], f"no op from {strategy}'s own code traced"
    return ag


def test_ddp_agrees_and_a_failing_kernel_on_one_rank_falls_back_there(tmp_path):
    p, d = _torchrun(tmp_path, "--strategy", "ddp", "--inject-fault", "rsqrt.default@1:raise", strict=False)
    assert p.returncode == 0, p.stderr[-3000:]
    ag = _check_common(d, "ddp")
    assert ag["ok"] and d["verdict"] == "PASS", ag
    assert any(c["op"].startswith("c10d::allreduce") for c in d["ops"]["collectives"])
    # rank 1's rsqrt raised: ATen answered there; rank 0 kept Gems; nobody hung
    assert [(f["rank"], f["op"]) for f in d["faults"]] == [(1, "rsqrt.default")]
    stats = d["runs"]["gems"]["gems_stats_per_rank"]
    assert stats[0]["rsqrt.default"]["served"] > 0 and stats[0]["rsqrt.default"]["fallback"] == 0
    assert stats[1]["rsqrt.default"]["served"] == 0 and stats[1]["rsqrt.default"]["fallback"] > 0
    rs = {o["op"]: o for o in d["ops"]["compute"]}["rsqrt.default"]
    assert rs in d["ops"]["gaps"]    # partly fell back: listed as a gap with its reason
    assert any(k.startswith("gems error") for k in rs["fallback_reasons"])


def test_fsdp2_agrees_with_the_shadow_check_on(tmp_path):
    p, d = _torchrun(tmp_path, "--strategy", "fsdp2", "--shadow", "on")
    assert p.returncode == 0, p.stderr[-3000:]
    ag = _check_common(d, "fsdp2")
    assert ag["ok"] and d["verdict"] == "PASS", ag
    names = {c["op"] for c in d["ops"]["collectives"]}
    assert any("allgather" in n for n in names) and any("reduce_scatter" in n for n in names), names
    assert d["shadow_ran"] and d["shadow_calls"] > 0 and d["first_divergence"] is None
    assert not d["faults"]


def test_a_wrong_kernel_on_one_rank_fails_and_is_named(tmp_path):
    p, d = _torchrun(tmp_path, "--strategy", "ddp", "--no-trace", "--steps", "1", "--warmup", "0",
                     "--inject-fault", "_log_softmax.default@1:wrong")
    assert p.returncode == 1, p.stderr[-3000:]
    assert d["verdict"] == "FAIL" and d["agreement"]["first_failing_step"] == 0
    assert d["shadow_ran"]
    first = d["first_divergence"]
    assert first["op"] == "_log_softmax.default" and first["rank"] == 1 and first["phase"] == "step 0"
    assert first["max_abs"] > first["allowed"]
    assert {x["rank"] for x in d["divergences"]} == {1}


def test_patch_fuses_the_gems_run_only_and_its_losses_agree_with_unpatched_aten(tmp_path):
    """--patch: the fused ops' end-to-end rule (losses within parity's rule of the unpatched ATen run)."""
    p, d = _torchrun(tmp_path, "--strategy", "ddp", "--no-trace", "--steps", "2", "--warmup", "0", "--patch")
    assert p.returncode == 0, p.stderr[-3000:]
    assert d["patch"] is True and d["runs"]["aten"]["patched"] is None
    fused = d["runs"]["gems"]["patched"]
    assert {"add_rms_norm", "silu_and_mul", "rope", "cross_entropy"} <= set(fused), fused
    assert d["agreement"]["ok"] and d["verdict"] == "PASS", d["agreement"]
    # (the tiny fp32 model's losses may agree to the last bit: logits differ by ~4e-8, below a loss's ulp)


def test_a_masked_lm_trains_too(tmp_path):
    """BERT (labels = the tokens: every position predicted) under DDP, its Gems run patched (the fused loss)."""
    p, d = _torchrun(tmp_path, "--strategy", "ddp", "--no-trace", "--steps", "2", "--warmup", "0", "--patch",
                     model="bert")
    assert p.returncode == 0, p.stderr[-3000:]
    assert d["model"] == "bert-base-uncased" and d["runs"]["gems"]["patched"] == {"encoder_layer": 2, "cross_entropy": 1}
    assert d["agreement"]["ok"] and d["verdict"] == "PASS", d["agreement"]
    assert all(math.isfinite(x) and x > 0 for x in d["runs"]["aten"]["losses"])


def test_not_launched_by_torchrun_says_how():
    p = subprocess.run([sys.executable, "-m", "gems_coverage.distributed", "aquila", "--device", "cpu"], cwd=ROOT,
                       env=_env(True), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "torchrun --standalone --nproc-per-node N -m gems_coverage.distributed" in p.stderr
    assert "Traceback" not in p.stderr


@pytest.fixture
def fake_rank(monkeypatch):
    """torchrun's environment for rank 0 of 2, without a process group: checks that run before one."""
    for k, v in dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT="1").items():
        monkeypatch.setenv(k, v)


@pytest.mark.parametrize("args, message", [
    (["--batch", "3"], "--batch 3 does not divide over 2 ranks"),
    (["--dtype", "bf16"], "the Triton interpreter leaves bf16 to ATen"),
    (["--mixed-precision"], "--mixed-precision computes in --dtype"),
    (["--inject-fault", "rsqrt.default@5"], "rank 5 does not exist"),
    (["--steps", "1"], "no timed step"),
    (["--seq-len", "4096"], "takes at most 256 positions"),
])
def test_bad_input_is_one_line_before_any_process_group(fake_rank, capsys, args, message):
    assert main(["aquila", "--device", "cpu", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_cuda_without_gpu_or_nccl_is_bad_input(fake_rank, capsys):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert main(["aquila", "--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_synthetic_data_is_the_same_global_batch_on_every_rank():
    rows = [Data(256, 4, 2, 16, r, seed=0).rows(3) for r in range(2)]
    both = Data(256, 4, 4, 16, 0, seed=0).rows(3)
    assert rows[0].shape == (2, 16) and bool((both[:2] == rows[0]).all()) and bool((both[2:] == rows[1]).all())
    assert int(both.min()) >= 3 and int(both.max()) < 256
    assert not bool((Data(256, 4, 4, 16, 0, seed=0).rows(4) == both).all())


def test_loss_agreement_is_parity_rule_per_step():
    import torch
    from gems_coverage import parity as P

    def run(losses):
        return RunResult("x", losses=list(losses), grad_norms=[1.0] * len(losses))
    aten = run([10.0, 10.0, 10.0, float("nan")])
    gems = run([10.0 * (1 + P.E2E_TOL[torch.bfloat16] / 2), 10.0 * 1.1, 10.0, float("nan")])
    ag = agreement(aten, gems, torch.bfloat16, None)
    assert [s["ok"] for s in ag["steps"]] == [True, False, True, False]
    assert ag["first_failing_step"] == 1 and "ATen diverged too" in ag["steps"][3]["detail"]
    # the low-precision rule: Gems no further from the fp32 run than 2x ATen's own error passes
    ref = run([11.0, 11.05, 10.0, 10.0])
    ag = agreement(aten, gems, torch.bfloat16, ref)
    assert [s["ok"] for s in ag["steps"]] == [True, True, True, False] and "vs fp32" in ag["steps"][1]["detail"]


def test_launcher_checks_the_options_before_starting_processes(capsys):
    assert launch_main(["--nproc", "2", "aquila", "--device", "cpu", "--batch", "3"]) == 2
    assert "--batch 3 does not divide over 2 ranks" in capsys.readouterr().err
    assert "RANK" not in os.environ and "WORLD_SIZE" not in os.environ
    assert launch_main(["--nproc", "x", "aquila"]) == 2


def test_compile_compiles_the_gems_run_only(monkeypatch):
    """--compile: build_model compiles (in place, after gems.patch) the model of the Gems run only; the
    ATen and fp32 runs stay eager (their losses are the reference). model.compile is recorded, not run:
    inductor on the CPU takes minutes."""
    import socket
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    import gems_models as M
    from gems_coverage.distributed.options import Env, Plan
    from gems_coverage.distributed.training import build_model
    compiled = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, *a, **k: compiled.append(type(self).__name__))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        a = SimpleNamespace(seed=0, mixed_precision=False, checkpointing=False, strategy="ddp", lr=1e-3)
        p = Plan(M.resolve("aquila"), "tiny", torch.float32, torch.float32, 8, 1, 1, 0, None, None, [])
        env = Env(0, 1, 0, 1, "cpu", "gloo")
        wrapped, *_ = build_model(a, p, env, compile=False)
        assert compiled == []
        wrapped, _, _, patched = build_model(a, p, env, patch=True, compile=True)
        assert len(compiled) == 1 and patched
    finally:
        dist.destroy_process_group()
