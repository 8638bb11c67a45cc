"""The one-line note on slow first-call work (runtime/progress.py): a launch-cache miss that compiles and a
bucket's first tuning add up per process; past a few seconds one line goes to stderr, then at most one a
minute; fast misses print nothing, GEMS_QUIET=1 prints nothing, and hits never read the clock. Runs on CPU
with a stand-in for a compiled Triton kernel and a fake clock."""
import pytest

from gems.runtime import autotune, backends, launch, progress
from harness import launch_without_a_device


class _Clock:
    def __init__(self):
        self.now, self.reads = 100.0, 0

    def __call__(self):
        self.reads += 1
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = _Clock()
    monkeypatch.setattr(progress, "clock", c)
    monkeypatch.delenv("GEMS_QUIET", raising=False)
    progress.reset()
    yield c
    progress.reset()


class _Kernel:
    """What JITFunction.run returns: a compiled kernel (no direct C launcher: launch.run calls its run)."""
    function = packed_metadata = None

    def __init__(self):
        self.launches = 0

    def run(self, *a):
        self.launches += 1


class _Jit:
    """A stand-in for a compiled-backend JITFunction with one constexpr parameter: each new value is a
    new binary, whose first launch 'compiles' for `cost` seconds of the fake clock."""
    __name__ = "fake_kernel"
    device_caches = {}
    params = [type("P", (), {"num": 0, "is_constexpr": True})()]

    def __init__(self, clock, cost):
        self.clock, self.cost, self.compiles = clock, cost, 0

    def __getitem__(self, grid):
        def run(*args, **opts):
            self.compiles += 1
            self.clock.now += self.cost
            return _Kernel()
        return run


@pytest.fixture
def compiled_backend(monkeypatch):
    launch_without_a_device(monkeypatch)


def _launch(k, value):
    k[(1,)](value)


def test_a_slow_miss_prints_one_line_and_later_misses_stay_silent(clock, compiled_backend, capsys):
    jit = _Jit(clock, cost=4.0)
    k = launch.LaunchCache(jit)
    _launch(k, 1)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("gems: compiling kernels for new shapes"), err
    for v in (2, 3, 4):              # 12 s more, within the minute: nothing more
        _launch(k, v)
    assert capsys.readouterr().err == ""
    assert jit.compiles == 4


def test_fast_misses_print_nothing(clock, compiled_backend, capsys):
    k = launch.LaunchCache(_Jit(clock, cost=0.05))
    for v in range(50):              # 2.5 s in all: under the threshold
        _launch(k, v)
    assert capsys.readouterr().err == ""


def test_many_fast_misses_adding_up_print_one_line(clock, compiled_backend, capsys):
    k = launch.LaunchCache(_Jit(clock, cost=0.05))
    for v in range(100):             # 5 s in all
        _launch(k, v)
    assert capsys.readouterr().err.count("\n") == 1


def test_gems_quiet_prints_nothing(clock, compiled_backend, capsys, monkeypatch):
    monkeypatch.setenv("GEMS_QUIET", "1")
    k = launch.LaunchCache(_Jit(clock, cost=30.0))
    for v in range(5):
        _launch(k, v)
    assert capsys.readouterr().err == ""


def test_totals_count_each_kernels_waits_and_reset_forgets_them(clock, compiled_backend, capsys):
    a, b = _Jit(clock, cost=0.5), _Jit(clock, cost=2.0)
    b.__name__ = "other_kernel"
    ka, kb = launch.LaunchCache(a), launch.LaunchCache(b)
    for v in (1, 2, 1):              # the repeated value hits: not counted
        _launch(ka, v)
    _launch(kb, 1)
    t = progress.totals()
    assert t["compile"] == [3, 3.0] and t["tune"] == [0, 0.0]
    assert t["kernels"] == {"fake_kernel": [2, 1.0], "other_kernel": [1, 2.0]}
    progress.reset()
    assert progress.totals() == {"compile": [0, 0.0], "tune": [0, 0.0], "kernels": {}}


def test_a_hit_reads_no_clock(clock, compiled_backend, capsys):
    k = launch.LaunchCache(_Jit(clock, cost=4.0))
    _launch(k, 1)
    reads = clock.reads
    kernel = k.entry((1,))[0]
    for _ in range(10):
        _launch(k, 1)
    assert clock.reads == reads and kernel.launches == 10 and k.hits == 10


def test_after_a_minute_one_more_line_with_counts(clock, compiled_backend, capsys):
    k = launch.LaunchCache(_Jit(clock, cost=20.0))
    for v in range(5):               # lines at 20 s (the threshold) and 80 s (a minute later) only
        _launch(k, v)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2, lines
    assert lines[1].startswith("gems: still compiling and tuning") and "4 kernel launches compiled" in lines[1]


def test_a_slow_first_tuning_names_the_bucket_device_and_file(clock, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("GEMS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(backends, "backend", lambda: type("B", (), {"can_benchmark": True, "arch": "test"})())
    tuner = autotune.Autotuner("gemm", [{"n": 1}, {"n": 2}])

    def bench(cfg):
        clock.now += 2.0             # each config's compile and timing
        return cfg["n"]
    assert tuner.pick((512, 768), bench) == {"n": 1}
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "tuning gemm for (512, 768)" in err and str(tmp_path / "autotune" / "test" / "gemm") in err
    before = clock.reads
    assert tuner.pick((512, 768), bench) == {"n": 1}     # the stored pick: no tuning, no clock, no line
    assert clock.reads == before and capsys.readouterr().err == ""
