"""Background compilation (runtime/background.py; the default, GEMS_COMPILE=inline turns it off), on the CPU.

The interpreter compiles nothing, so the launch path is checked with a stand-in for a compiled-backend
JIT function and a fake compile: a launch-cache miss in a deferrable call queues the compile on the
pool and raises NotCompiled (ATen answers); the next launch finds the binary the worker put into the
function's cache; outside a deferrable call, or after a failed background compile, the miss compiles
on the calling thread; a tuning miss stores nothing until every config's kernels are in; `ahead`
queues a later launch's compile and launches nothing; the GIL's switch interval is short while
compiles are queued and put back after. The
dispatcher's part runs in a process with the variable set: functional overloads run deferrable,
in-place and out= ones only at a launch declared their first write, and a NotCompiled answer is counted and leaves the signature's plan
state alone. The real compiles need a GPU (`gems-coverage bench MODEL --cold --cold-modes
gems`).
"""
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import triton.language as tl

import gems
from gems.runtime import autotune, background, backends, collect, launch, progress, tritonkey
from harness import DEVICE
from harness import StandInJit as _Jit
from harness import launch_without_a_device


@pytest.fixture
def pool(monkeypatch):
    """Fresh background state with a fake hook (the job is the stand-in and its value) and a fake
    compile (value 'bad' fails; `gate` holds compiles back until set)."""
    launch_without_a_device(monkeypatch)
    monkeypatch.setenv("GEMS_QUIET", "1")
    gate = threading.Event()
    gate.set()

    def record(*, key, fn, **_):
        if not getattr(collect._tls, "recording", False):
            return False
        sink = getattr(collect._tls, "sink", None)
        job = (fn, "dev", key)
        return sink(job) is not False if sink is not None else True

    def compile_one(job):
        gate.wait(10)
        if job[2] == "bad":
            raise ValueError("no such kernel")
        return type("K", (), {"src": None, "metadata": None})()

    monkeypatch.setattr(collect, "_record", record)
    monkeypatch.setattr(collect, "compile_one", compile_one)
    # no C launcher for a stand-in: on a GPU machine Triton's driver would load (up to seconds, the
    # first time in a process) on a worker, and past a test's note delay
    monkeypatch.setattr(collect, "build_launcher", lambda kernel: None)
    # a fake compile needs no Triton key: workers must not wait for one hashing on a GPU machine
    monkeypatch.setattr(tritonkey, "wait", lambda: None)
    for name, value in (("_pool", None), ("_queued", set()), ("_failed", set()), ("_pending", 0), ("_said", False),
                        ("_look_on_disk", False), ("_note_timer", None), ("_switch", None),
                        ("_stats", {"submitted": 0, "compiled": 0, "failed": 0, "loaded": 0, "compile_s": 0.0})):
        monkeypatch.setattr(background, name, value)
    prev = background.set_deferring(True)
    yield gate
    background.set_deferring(prev)
    gate.set()
    if background._note_timer is not None:   # a test's note must not fire inside a later test
        background._note_timer.cancel()
    if background._pool is not None:
        background._pool.shutdown(wait=True)
        collect.uninstall_hook()


def test_a_deferred_miss_compiles_on_the_pool_and_the_next_launch_finds_it(pool):
    jit = _Jit(held={1})
    k = launch.LaunchCache(jit)
    k[(1,)](1)                                    # in Triton's memory already: launched
    pool.clear()
    with pytest.raises(gems.Unsupported) as e:
        k[(1,)](2)                                # not compiled: queued, ATen answers
    assert isinstance(e.value, collect.not_compiled())
    with pytest.raises(collect.not_compiled()):
        k[(1,)](2)                                # still compiling: queued once, ATen again
    assert background.stats()["submitted"] == 1 and background.stats()["pending"] == 1
    pool.set()
    assert background.wait(10)
    k[(1,)](2)                                    # the worker's binary
    assert jit.inline == [] and k.cache_info()["entries"] == 2
    st = background.stats()
    assert (st["submitted"], st["compiled"], st["failed"], st["pending"]) == (1, 1, 0, 0)


def test_ahead_queues_a_later_launch_and_launches_nothing(pool):
    # an op whose kernels each read the last one's output queues them all before its first launch
    jit = _Jit(held={1})
    k = launch.LaunchCache(jit)
    pool.clear()
    k.ahead((2,))                                 # not compiled: queued, no NotCompiled, no launch
    k.ahead((2,))                                 # queued once
    k.ahead((1,))                                 # in Triton's memory: nothing to do
    st = background.stats()
    assert (st["submitted"], st["pending"]) == (1, 1) and jit.launched == [] and jit.inline == []
    pool.set()
    assert background.wait(10)
    k[(1,)](2)                                    # the pool's binary, launched
    assert jit.launched == [2] and jit.inline == []


def test_ahead_outside_a_deferrable_call_does_nothing(pool):
    background.set_deferring(False)
    jit = _Jit()
    launch.LaunchCache(jit).ahead((3,))
    assert jit.inline == [] and jit.launched == [] and background.stats()["submitted"] == 0


def test_ahead_in_collect_mode_records_without_compiling_or_launching(pool):
    background.set_deferring(False)
    jit = _Jit()
    collect.start()
    try:
        launch.LaunchCache(jit).ahead((4,))
    finally:
        collect.stop()
    assert jit.inline == [] and jit.launched == [] and background.stats()["submitted"] == 0


@pytest.mark.parametrize("meanwhile", [None, 0.001], ids=["put-back", "users-own-kept"])
def test_the_gil_switches_quickly_while_compiles_are_queued(pool, meanwhile):
    before = sys.getswitchinterval()
    k = launch.LaunchCache(_Jit())
    pool.clear()
    try:
        with pytest.raises(collect.not_compiled()):
            k[(1,)](5)
        assert sys.getswitchinterval() == pytest.approx(background.SWITCH_S)
        if meanwhile is not None:
            sys.setswitchinterval(meanwhile)      # the user's own setting, made while compiles ran
        pool.set()
        assert background.wait(10)
        # once the queue drained: the interval before, unless the user's own was set meanwhile
        assert sys.getswitchinterval() == pytest.approx(meanwhile or before)
    finally:
        sys.setswitchinterval(before)


def test_in_a_writing_call_only_a_launch_declared_its_first_write_defers(pool):
    # an in-place or out= call: a miss at its first write leaves nothing half-written, so ATen can
    # answer it; a miss at any other launch (a kernel before may have written) compiles here
    background.set_deferring(background.WRITES)
    assert not background.deferring() and background.deferring(first=True)
    jit = _Jit()
    k = launch.LaunchCache(jit)
    pool.clear()
    with pytest.raises(collect.not_compiled()):
        k.run((1,), (5,), first=True)
    assert background.stats()["submitted"] == 1 and jit.inline == []
    k.run((1,), (6,))
    assert jit.inline == [6] and background.stats()["submitted"] == 1
    with background.inline():                     # a capture or parity check: no deferral at all
        assert not background.deferring(first=True)
        k.run((1,), (7,), first=True)
    assert jit.inline == [6, 7]
    pool.set()
    assert background.wait(10)


def test_outside_a_deferrable_call_a_miss_compiles_inline(pool):
    background.set_deferring(False)
    jit = _Jit()
    launch.LaunchCache(jit)[(1,)](3)
    assert jit.inline == [3] and background.stats()["submitted"] == 0


def test_inside_inline_a_deferrable_miss_compiles_on_the_calling_thread(pool):
    # what a CUDA graph's capture needs: Gems' kernels, not ATen's answers, from the first call
    jit = _Jit()
    assert background.deferring()
    with background.inline():
        assert not background.deferring()
        with background.inline():
            pass
        assert not background.deferring()          # a nested block leaves the outer one's setting
        launch.LaunchCache(jit)[(1,)](4)
    assert background.deferring()
    assert jit.inline == [4] and background.stats()["submitted"] == 0


def test_while_a_cuda_graph_captures_a_miss_compiles_on_the_calling_thread(pool, monkeypatch):
    # the graph would replay ATen's answer for good: Gems' kernel is compiled and recorded instead
    monkeypatch.setattr(background, "capturing", lambda: True)
    jit = _Jit()
    assert not background.deferring()
    launch.LaunchCache(jit)[(1,)](7)
    assert jit.inline == [7] and background.stats()["submitted"] == 0


def test_background_is_the_default_and_inline_turns_it_off():
    code = "from gems.runtime import settings; print(settings.BACKGROUND_COMPILE)"
    env = {k: v for k, v in os.environ.items() if k != "GEMS_COMPILE"}
    for value, want in ((None, "True"), ("background", "True"), ("inline", "False")):
        e = env if value is None else dict(env, GEMS_COMPILE=value)
        p = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=300)
        assert p.stdout.strip() == want, (value, p.stderr[-1000:])


def test_a_miss_whose_binary_is_on_disk_loads_on_the_calling_thread(pool, monkeypatch):
    # a process after the first: reading a binary Triton has on disk beats ATen's answer plus a hand-off
    on_disk = {5}
    monkeypatch.setattr(collect, "on_disk", lambda job: job[2] in on_disk)
    # Triton's cache folder held entries when the pool started (whatever this machine's folder holds)
    monkeypatch.setattr(collect, "disk_cache_used", lambda: True)
    jit = _Jit()
    k = launch.LaunchCache(jit)
    k[(1,)](5)                                    # on disk: Triton loads it here, no ATen answer
    assert jit.inline == [5]
    with pytest.raises(collect.not_compiled()):
        k[(1,)](6)                                # not on disk: compiled on the pool as before
    st = background.stats()
    assert (st["loaded"], st["submitted"]) == (1, 1)


def test_the_first_process_never_looks_on_disk(pool, monkeypatch, tmp_path):
    # with an empty cache folder at the pool's start no miss can be on disk: no lookup is paid for
    import triton
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path))
    looked = []
    monkeypatch.setattr(collect, "on_disk", lambda job: looked.append(job) or True)
    with pytest.raises(collect.not_compiled()):
        launch.LaunchCache(_Jit())[(1,)](8)
    assert looked == [] and background._look_on_disk is False
    (tmp_path / "ABC").mkdir()
    assert collect.disk_cache_used()


def _double(x, y, n, B: "tl.constexpr"):
    i = tl.program_id(0) * B + tl.arange(0, B)
    tl.store(y + i, tl.load(x + i, mask=i < n) * 2, mask=i < n)


def _cuda_job(block: int):
    """A compile job (collect's tuple) of a small kernel for an sm_90 target, built without a GPU (a
    JITFunction made directly: under the interpreter triton.jit would make an interpreted one)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import compiler as tc
    from triton.runtime.jit import JITFunction
    target = GPUTarget("cuda", 90, 32)
    options = tc.make_backend(target).parse_options({})
    sig = {"x": "*fp32", "y": "*fp32", "n": "i32", "B": "constexpr"}
    jf = JITFunction(_double)
    jf.ASTSource, jf.compile = tc.ASTSource, tc.compile    # as its first launch's binder sets them
    return (jf, 0, ("key", block), sig, {(3,): block}, {}, options, target)


def test_on_disk_finds_exactly_the_binaries_triton_compiled(monkeypatch, tmp_path):
    # the lookup Triton's compile makes first, on a real compile (for an sm_90 target: Triton's ptxas
    # runs on any host) into an empty cache folder
    import triton
    from triton.runtime import cache as tcache
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    a, b = _cuda_job(128), _cuda_job(256)
    try:
        collect.compile_one(a)
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"Triton cannot compile for sm_90 on this host: {type(e).__name__}: {str(e)[:200]}")
    assert tcache.triton_key.cache_info().currsize == 1
    assert collect.on_disk(a)
    assert not collect.on_disk(b)                 # another specialization: not compiled
    monkeypatch.setattr(triton.knobs.compilation, "always_compile", True)
    assert not collect.on_disk(a)                 # TRITON_ALWAYS_COMPILE: loading it would compile
    monkeypatch.setattr(triton.knobs.compilation, "always_compile", False)
    collect.compile_one(b)
    assert collect.on_disk(b)


def test_a_failed_background_compile_compiles_inline_next_time(pool):
    jit = _Jit()
    k = launch.LaunchCache(jit)
    with pytest.raises(collect.not_compiled()):
        k[(1,)]("bad")
    assert background.wait(10) and background.stats()["failed"] == 1
    k[(1,)]("bad")                                # on the calling thread: a real compile would raise here
    assert jit.inline == ["bad"]


def test_background_work_past_a_few_seconds_says_so_once(pool, monkeypatch, capsys):
    monkeypatch.delenv("GEMS_QUIET")
    monkeypatch.setattr(background, "NOTE_AFTER_S", 0.2)
    k = launch.LaunchCache(_Jit())
    pool.clear()                                  # the compiles take longer than the note's delay
    for v in (5, 6):
        with pytest.raises(collect.not_compiled()):
            k[(1,)](v)
    time.sleep(0.6)
    pool.set()
    assert background.wait(10)
    err = capsys.readouterr().err
    assert err.count("compiling kernels in the background") == 1 and "2 so far" in err


def test_background_work_done_within_a_few_seconds_is_silent(pool, monkeypatch, capsys):
    # a run after the first: its few misses load from disk on the pool in milliseconds
    monkeypatch.delenv("GEMS_QUIET")
    monkeypatch.setattr(background, "NOTE_AFTER_S", 0.3)
    with pytest.raises(collect.not_compiled()):
        launch.LaunchCache(_Jit())[(1,)](5)
    assert background.wait(10)
    time.sleep(0.6)
    assert "compiling kernels" not in capsys.readouterr().err


def test_a_tuning_miss_stores_nothing_until_every_config_is_compiled(pool, monkeypatch, tmp_path):
    monkeypatch.setenv("GEMS_CACHE_DIR", str(tmp_path))
    fake = type("B", (), {"can_benchmark": True, "arch": "fake"})()
    monkeypatch.setattr(backends, "backend", lambda: fake)
    monkeypatch.setattr(autotune, "CONFIRM_ROUNDS", 0)
    tuner = autotune.Autotuner("background_probe", [{"B": 1}, {"B": 2}, {"B": 3}])
    compiled, timed = {1, 3}, []

    def bench(c):
        if c["B"] not in compiled:
            raise collect.not_compiled()("not compiled")
        return autotune.bench_ms(lambda: timed.append(c["B"]))
    monkeypatch.setattr(autotune, "held_ms", lambda fn: (fn(), {1: 3.0, 2: 1.0, 3: 2.0}[timed[-1]])[1])
    with pytest.raises(collect.not_compiled()):
        tuner.pick(64, bench)                     # config 2 still compiling: ATen answers
    assert timed == [1, 3]                        # the probe ran the compiled ones once, untimed
    assert not (tmp_path / "autotune").exists()
    compiled.add(2)
    timed.clear()
    assert tuner.pick(64, bench) == {"B": 2}      # all in: timed as usual, and stored
    assert timed == [1, 2, 3, 1, 2, 3]            # the probe's runs, then the timed ones


def test_only_functional_overloads_are_deferrable():
    from gems.dispatch.kernel import writes_an_argument
    from gems.registry import aten_overload
    assert not writes_an_argument(aten_overload("add.Tensor")._schema)
    assert writes_an_argument(aten_overload("add_.Tensor")._schema)
    assert writes_an_argument(aten_overload("add.out")._schema)


_DISPATCH = textwrap.dedent("""
    import json, sys, torch, gems
    from gems import registry
    from gems.runtime import background, collect
    seen = {}
    def spy(name):
        impl = registry.get(name)
        real = impl.fn
        def fn(*a, **k):
            seen[name] = [background.deferring(), background.deferring(first=True)]
            if name == "mul.Tensor":
                raise collect.not_compiled()("kernel not compiled yet")
            return real(*a, **k)
        return fn
    x, y = torch.randn(5, device=sys.argv[1]), torch.randn(5, device=sys.argv[1])
    with registry.override_impl("add.Tensor", spy("add.Tensor")), \\
            registry.override_impl("add_.Tensor", spy("add_.Tensor")), \\
            registry.override_impl("mul.Tensor", spy("mul.Tensor")), gems.use_gems():
        z = x + y
        z.add_(y)
        m = [x * y for _ in range(3)]
    assert torch.equal(m[0], torch.mul(x, y)) and torch.allclose(z, x + 2 * y)
    st = gems.stats()["mul.Tensor"]
    from gems.dispatch.state import STATE
    plans = STATE.ops["mul.Tensor"].plans
    print(json.dumps({"seen": seen, "after": background.deferring(), "fallback": st["fallback"],
                      "reasons": st["reasons"], "declined": plans.declined if plans is not None else 0}))
""")


def test_the_dispatcher_marks_functional_calls_and_counts_their_aten_answers():
    env = dict(os.environ, GEMS_COMPILE="background", GEMS_PLAN_AFTER="1")
    p = subprocess.run([sys.executable, "-c", _DISPATCH, DEVICE], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    import json
    r = json.loads(p.stdout.strip().splitlines()[-1])
    # a functional call defers at any miss, an in-place one only at a launch declared its first write
    assert r["seen"] == {"add.Tensor": [True, True], "add_.Tensor": [False, True], "mul.Tensor": [True, True]}
    assert r["after"] is False
    # every call answered by ATen and counted; no signature marked "no plan" for it
    assert r["fallback"] == 3 and r["reasons"] == {"kernel not compiled yet": 3} and r["declined"] == 0


def test_an_unknown_compile_setting_is_refused():
    env = dict(os.environ, GEMS_COMPILE="later")
    p = subprocess.run([sys.executable, "-c", "import gems"], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode != 0 and "GEMS_COMPILE must be 'inline' or 'background'" in p.stderr


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_starts_without_the_parents_pool(pool):
    pool.clear()                                   # a compile in flight in the parent
    with pytest.raises(collect.not_compiled()):
        launch.LaunchCache(_Jit())[(1,)](9)
    assert background._pool is not None and background.stats()["pending"] == 1
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child: no pool, nothing pending, its own lock
        ok = background._pool is None and background.stats()["pending"] == 0 and background.wait(0)
        os.write(w, b"1" if ok else b"0")
        os._exit(0)
    os.close(w)
    got = os.read(r, 1)
    os.waitpid(pid, 0)
    pool.set()
    assert got == b"1" and background.wait(10)


def test_tritons_key_hashes_on_a_thread_and_a_miss_waits_for_it(pool, monkeypatch):
    # the first compile or disk load of a process starts from Triton's key (a hash of its installed
    # files): computed on a thread when Gems is switched on for a GPU, waited for, never computed twice
    from triton.runtime import cache
    cache.triton_key.cache_clear()
    monkeypatch.setattr(tritonkey, "_thread", None)
    assert not tritonkey.ready() and not collect.on_disk(("any job",))
    tritonkey.start()
    assert tritonkey._thread.name == "gems-triton-key"
    waited = []
    monkeypatch.setattr(tritonkey, "wait", lambda: waited.append(threading.current_thread().name))
    me = threading.current_thread().name
    k = launch.LaunchCache(_Jit(held={1}))
    with pytest.raises(collect.not_compiled()):
        k[(1,)](2)                                # a miss waits for the hash in progress, then defers
    assert background.wait(10)
    assert waited.count(me) == 1 and [n for n in waited if n.startswith("gems-compile")]   # its worker too
    with background.inline():
        k[(1,)](3)                                # a miss Triton serves here waits as well
    assert waited.count(me) == 2
    tritonkey._thread.join()
    assert tritonkey.ready() and cache.triton_key.cache_info().currsize == 1
    k[(1,)](3)                                    # a hit asks nothing
    assert waited.count(me) == 2
    tritonkey.start()                             # computed: nothing more starts
    assert not tritonkey._thread.is_alive()
