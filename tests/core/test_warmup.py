"""gems.warmup (gems/warmup.py) and its collect mode (runtime/collect.py), on the CPU.

Under the interpreter warmup compiles nothing: it says so once and leaves the model alone. The collect
mode itself is checked with stand-ins for a compiled-backend JIT function: a launch-cache miss records
the compile and raises NotCompiled (an Unsupported, so the dispatcher answers with ATen), a kernel Triton
holds in memory still launches, a tuning miss benches every config and stores nothing, and the worker
pool compiles jobs in forked processes. warmup's own loop is run with the compile steps faked: it stops
when a round records nothing new, and puts back gradients, buffers and the dispatcher's counts and plans.
The real compile path needs a GPU (docs/perf.md, cold start).
"""
import os
import time

import pytest
import torch

import gems
from gems.runtime import autotune, backends, collect, launch, progress
from gems.runtime.plan.cache import NO_PLAN, PlanCache
from harness import StandInJit as _Jit
from harness import launch_without_a_device

warmup_module = __import__("sys").modules["gems.warmup"]   # gems.warmup itself is the function


@pytest.fixture
def loud(monkeypatch):
    monkeypatch.delenv("GEMS_QUIET", raising=False)
    progress.reset()
    yield
    progress.reset()


@pytest.fixture
def collecting():
    collect.start()
    yield
    collect.stop()


def test_interpreter_warmup_is_a_no_op_said_once(loud, capsys, monkeypatch):
    monkeypatch.setattr(backends, "interpreting", lambda: True)
    # on a GPU triton was imported compiling: the guard against a changed TRITON_INTERPRET would refuse
    monkeypatch.setattr(backends, "check_environment", lambda: None)
    monkeypatch.setattr(warmup_module, "_said_interpreter", False)
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.ReLU())
    x = torch.randn(4, 5)
    before = model(x)
    with gems.use_gems():
        info = gems.warmup(model, x)
        info2 = gems.warmup(model, (x,), train=True)
    assert info["kernels"] == info2["kernels"] == 0 and info["rounds"] == 0
    err = capsys.readouterr().err
    assert err.count("nothing to compile under the Triton interpreter") == 1, err
    assert torch.equal(model(x), before)
    assert all(p.grad is None for p in model.parameters())


@pytest.fixture
def compiled_backend(monkeypatch):
    launch_without_a_device(monkeypatch)
    # the stand-in's hook call carries no real job: record a marker instead of reading Triton's objects
    recorded = []

    def record(*, key, **_):
        if not (collect.active() and getattr(collect._tls, "recording", False)):
            return False
        recorded.append(key)
        return True
    monkeypatch.setattr(collect, "_record", record)
    return recorded


def test_collect_mode_miss_records_and_raises_unsupported(compiled_backend, collecting):
    jit = _Jit(held={1})
    k = launch.LaunchCache(jit)
    k[(1,)](1)                                     # held by Triton: launched and cached
    assert k.cache_info()["entries"] == 1
    with pytest.raises(gems.Unsupported) as e:
        k[(1,)](2)                                 # not compiled: recorded, ATen will answer
    assert isinstance(e.value, collect.not_compiled())
    assert compiled_backend == [2] and 2 not in jit.held
    assert k.cache_info()["entries"] == 1          # nothing cached for the skipped launch


def test_hook_does_nothing_outside_a_collecting_miss(compiled_backend, collecting):
    # a Triton launch that does not come through a launch-cache miss compiles as usual
    jit = _Jit()
    assert jit[(1,)](7) is not None and 7 in jit.held
    assert compiled_backend == []


def test_collect_mode_puts_back_a_users_cache_hook():
    import triton
    before = triton.knobs.runtime.jit_cache_hook

    def mine(**kw):
        return False
    triton.knobs.runtime.jit_cache_hook = mine
    try:
        collect.start()
        assert triton.knobs.runtime.jit_cache_hook is not mine and collect.active()
        collect.stop()
        assert triton.knobs.runtime.jit_cache_hook is mine and not collect.active()
    finally:
        triton.knobs.runtime.jit_cache_hook = before


def test_outside_collect_mode_a_miss_compiles(compiled_backend):
    jit = _Jit()
    launch.LaunchCache(jit)[(1,)](3)
    assert 3 in jit.held and compiled_backend == []


def test_tuning_miss_in_collect_mode_benches_every_config_and_stores_nothing(monkeypatch, tmp_path, collecting):
    monkeypatch.setenv("GEMS_CACHE_DIR", str(tmp_path))
    fake = type("B", (), {"can_benchmark": True, "arch": "fake"})()
    monkeypatch.setattr(backends, "backend", lambda: fake)
    tuner = autotune.Autotuner("warm_probe", [{"B": 1}, {"B": 2}, {"B": 3}])
    benched = []

    def bench(c):
        benched.append(c["B"])
        if c["B"] == 2:
            raise collect.not_compiled()("not compiled")
        return float(c["B"])
    assert tuner.pick(64, bench) == {"B": 1}
    assert benched == [1, 2, 3]
    assert tuner.pick(64, bench) == {"B": 1} and benched == [1, 2, 3, 1, 2, 3]   # still a miss
    assert not (tmp_path / "autotune").exists()


def test_a_collecting_tuning_run_times_nothing(monkeypatch, collecting):
    # every collecting round benches each config again: timed, the picks would be thrown away anyway
    def no_device(*a, **k):
        raise AssertionError("a collecting run timed a config")
    monkeypatch.setattr(autotune, "held_ms", no_device)
    runs = []
    assert autotune.bench_ms(lambda: runs.append(1)) == 0.0 and runs == [1]


def test_outside_collect_mode_a_bench_is_timed(monkeypatch):
    monkeypatch.setattr(autotune, "TIMING", "hold")
    monkeypatch.setattr(autotune, "held_ms", lambda fn: 1.25)
    assert autotune.bench_ms(lambda: None) == 1.25


def _fake_compile(job):
    tag, delay = job
    if tag == "bad":
        raise ValueError("no such kernel")
    time.sleep(delay)
    if _PIDS is not None:
        with open(_PIDS, "a") as f:
            f.write(f"{os.getpid()}\n")
    return type("K", (), {"src": None, "metadata": None})()


_PIDS = None   # a file each fake compile appends its process id to


@pytest.mark.skipif("fork" not in __import__("multiprocessing").get_all_start_methods(), reason="needs fork")
def test_compile_jobs_run_in_forked_workers(monkeypatch, tmp_path):
    monkeypatch.setattr(collect, "compile_one", _fake_compile)
    pids = tmp_path / "pids"
    monkeypatch.setitem(globals(), "_PIDS", str(pids))
    jobs = [("a", 0.05), ("bad", 0.0), ("c", 0.05), ("d", 0.05)]
    out = collect.compile_jobs(jobs, workers=4)
    assert len(out) == 4
    assert out[1][1].startswith("ValueError: no such kernel")
    assert sum(err is None for _, err in out) == 3
    ran_in = pids.read_text().split()
    assert len(ran_in) == 3 and str(os.getpid()) not in ran_in      # each in a forked worker
    pids.unlink()
    serial = collect.compile_jobs(jobs[:2], workers=1)
    assert serial[0][1] is None and serial[1][1].startswith("ValueError")
    assert pids.read_text().split() == [str(os.getpid())]            # workers=1: in this process


class _BN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.bn = torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if collect.active() and self.calls == 1:
            raise collect.not_compiled()("outside the dispatcher")   # a patched module's fused kernel
        return self.bn(self.lin(x))


def test_warmup_loop_rounds_and_puts_state_back(monkeypatch, loud, capsys):
    monkeypatch.setattr(backends, "interpreting", lambda: False)
    # round 1: two new jobs, round 2: one new and one seen, round 3: nothing new -> stop
    rounds = iter([[("f", "k1"), ("f", "k2")], [("f", "k2"), ("f", "k3")], [("f", "k1")], [("f", "k9")]])
    monkeypatch.setattr(collect, "stop", lambda: [(j[0], 0, j[1]) for j in next(rounds)])
    monkeypatch.setattr(collect, "start", lambda: None)
    compiled, loaded = [], []
    monkeypatch.setattr(collect, "compile_jobs", lambda jobs, w: compiled.append(len(jobs)) or [(0.1, None)] * len(jobs))
    monkeypatch.setattr(collect, "load_jobs", lambda jobs: loaded.append(len(jobs)) or len(jobs))
    monkeypatch.setattr(collect, "active", lambda: True)
    model = _BN().train()
    x = torch.randn(8, 4)
    sentinel = [torch.full_like(p, 7.0) for p in model.parameters()]
    for p, g in zip(model.parameters(), sentinel):
        p.grad = g
    mean, var = model.bn.running_mean.clone(), model.bn.running_var.clone()
    info = gems.warmup(model, x, train=True, workers=3)
    assert info["rounds"] == 3 and info["kernels"] == 3 and compiled == [2, 1] and loaded == [2, 1]
    assert [r["kernels"] for r in info["per_round"]] == [2, 1, 0]
    assert all(r["slowest_s"] == (0.1 if r["kernels"] else 0.0) for r in info["per_round"])
    assert [len(r["slowest"]) for r in info["per_round"]] == [2, 1, 0]
    assert all(s.endswith(" 0.10") for r in info["per_round"] for s in r["slowest"])
    assert all(p.grad is g for p, g in zip(model.parameters(), sentinel))
    assert torch.equal(model.bn.running_mean, mean) and torch.equal(model.bn.running_var, var)
    assert model.calls == 3          # the first round ended early at the raise, the others ran through
    err = capsys.readouterr().err
    assert "compiling 2 kernels for this model in 2 processes" in err
    assert "compiling 1 kernels for this model in 1 process " in err


def test_dispatcher_state_is_put_back(monkeypatch):
    from gems.dispatch.state import STATE, OpRuntime
    rt = OpRuntime()
    rt.plans = PlanCache()
    rt.plans.put(("old",), None, "real reason")
    rt.counts[:] = [5, 1]
    rt.reasons["real"] = 1
    monkeypatch.setitem(STATE.ops, "warm_probe.op", rt)
    snap = warmup_module._snapshot_dispatch()
    rt.plans.put(("new",), None, "unsupported: gems warmup: kernel not compiled yet")
    rt.plans.put_seen(("seen",))
    rt.counts[:] = [9, 4]
    rt.reasons["unsupported: gems warmup"] = 3
    warmup_module._restore_dispatch(snap)
    assert rt.counts == [5, 1] and rt.reasons == {"real": 1}
    assert rt.plans.plans[("old",)] is NO_PLAN and ("new",) not in rt.plans.plans
    assert ("seen",) in rt.plans.plans
    assert rt.plans.declined == 1 and rt.plans.reasons == {"real reason": 1}


@pytest.mark.parametrize("out,expected", [
    (torch.tensor([1.0, 2.0], requires_grad=True), 3.0),
    ((torch.tensor([4, 5]), torch.tensor([1.5, 1.5])), 3.0),
    ({"logits": torch.tensor([2.0])}, 2.0),
    (type("O", (), {"loss": torch.tensor(6.0)})(), 6.0),
])
def test_training_loss_of_an_output(out, expected):
    assert float(warmup_module._loss(out).detach()) == expected


def test_a_job_is_described_by_its_kernel_and_configuration():
    # warmup's per-round "slowest" list names the kernel and the constexprs and launch options it compiles
    # with, so that the compile bounding a round can be found
    import triton
    import triton.language as tl

    @triton.jit
    def probe_kernel(x_ptr, n, BLOCK: tl.constexpr, ACC: tl.constexpr):
        pass

    options = type("Options", (), {"num_warps": 8, "num_stages": 3})()
    job = (probe_kernel, 0, "key", {}, {(2,): 64, (3,): tl.float32}, {}, options, None)
    assert collect.describe(job) == "probe_kernel[BLOCK=64, num_warps=8, num_stages=3]"
