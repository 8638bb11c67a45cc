"""The autotuner's choice: one timing per config, or with confirmation rounds the lowest median of the
fastest few (runtime/autotune.py)."""
import json
from pathlib import Path

import pytest

from gems.runtime import autotune, backends
from harness import DEVICE


@pytest.fixture
def timing_backend(monkeypatch, tmp_path):
    monkeypatch.setenv("GEMS_CACHE_DIR", str(tmp_path))      # a fresh on-disk cache
    monkeypatch.setattr(backends, "backend", lambda: type("B", (), {"can_benchmark": True, "arch": "test"})())


def _bench(times, calls):
    """bench(cfg): the next of cfg's scripted times (a stand-in for do_bench's noisy timings)."""
    def bench(cfg):
        calls.append(cfg["name"])
        t = times[cfg["name"]].pop(0)
        if t is None:
            raise RuntimeError("launch failed")
        return t
    return bench


CONFIGS = [{"name": "a"}, {"name": "b"}, {"name": "c"}, {"name": "d"}]


def test_one_timing_each_picks_the_fastest_first_time(timing_backend, monkeypatch):
    monkeypatch.setattr(autotune, "CONFIRM_ROUNDS", 0)
    calls = []
    bench = _bench({"a": [2.0], "b": [1.0], "c": [3.0], "d": [4.0]}, calls)
    assert autotune.Autotuner("t0", CONFIGS).pick("bucket", bench)["name"] == "b"
    assert calls == ["a", "b", "c", "d"]


def test_confirmation_rounds_overrule_a_lucky_first_timing(timing_backend, monkeypatch):
    # 'b' was timed fast once (1.0) but is slower on every later run (3.0); 'a' is steady at 2.0. The three
    # fastest first times (b, a, c) are timed twice more, taking turns; 'd' (slowest) is not timed again
    monkeypatch.setattr(autotune, "CONFIRM_ROUNDS", 2)
    monkeypatch.setattr(autotune, "CONFIRM_TOP", 3)
    calls = []
    bench = _bench({"a": [2.0, 2.0, 2.1], "b": [1.0, 3.0, 3.0], "c": [2.5, 2.5, 2.5], "d": [9.0]}, calls)
    tuner = autotune.Autotuner("t1", CONFIGS)
    assert tuner.pick("bucket", bench)["name"] == "a"
    assert calls == ["a", "b", "c", "d", "b", "a", "c", "b", "a", "c"]
    # the choice is stored: a new tuner of the same name answers from the disk cache without timing
    assert autotune.Autotuner("t1", CONFIGS).pick("bucket", _bench({}, calls))["name"] == "a"
    assert len(calls) == 10


def test_a_config_failing_in_a_confirmation_round_loses(timing_backend, monkeypatch):
    monkeypatch.setattr(autotune, "CONFIRM_ROUNDS", 2)
    calls = []
    bench = _bench({"a": [1.0, None, None], "b": [1.5, 1.5, 1.5], "c": [None], "d": [5.0, 5.0, 5.0]}, calls)
    # 'c' fails its first run (skipped, as ever); 'a' fails both confirmation runs: its median is infinite
    assert autotune.Autotuner("t2", CONFIGS).pick("bucket", bench)["name"] == "b"


def test_picks_are_kept_per_timing(timing_backend, monkeypatch, tmp_path):
    # a bucket tuned under one timing is not answered for the other: do_bench charged some configs their
    # Python launch, so its stored picks must not stand for held timings, nor the reverse
    monkeypatch.setattr(autotune, "CONFIRM_ROUNDS", 0)
    monkeypatch.setattr(autotune, "TIMING", "hold")           # the default
    calls = []
    assert autotune.Autotuner("t3", CONFIGS).pick("k", _bench({"a": [2.0], "b": [1.0], "c": [3.0], "d": [4.0]},
                                                                calls))["name"] == "b"
    monkeypatch.setattr(autotune, "TIMING", "do_bench")
    assert autotune.Autotuner("t3", CONFIGS).pick("k", _bench({"a": [1.0], "b": [2.0], "c": [3.0], "d": [4.0]},
                                                                calls))["name"] == "a"
    assert len(calls) == 8                                    # both timed: neither answered from the other's file
    files = sorted(p.name for p in (tmp_path / "autotune" / "test").glob("*.json"))
    assert files == ["t3-hold.json", "t3.json"]
    monkeypatch.setattr(autotune, "TIMING", "hold")
    assert autotune.Autotuner("t3", CONFIGS).pick("k", _bench({}, calls))["name"] == "b"   # from its own file


# ------------------------------------------------------------------ timing behind a sleep kernel ("hold")
class _FakeCuda:
    """A device with a clock: the sleep kernel advances it by cycles / CPM ms, a run of fn by RUN ms, the L2
    clear by 0.05 ms; events read the clock. The log records the order of the calls."""
    CPM, RUN = 2e6, 0.1

    def __init__(self):
        self.t, self.log = 0.0, []
        fake = self

        class Event:
            def record(self):
                self.at = fake.t
                fake.log.append("rec")

            def elapsed_time(self, end):
                return end.at - self.at
        self.Event = Event

    def event(self):
        return self.Event()

    def sleep(self, cycles):
        self.t += cycles / self.CPM
        self.log.append(("sleep", cycles))

    def sync(self):
        pass

    def l2_buffer(self):
        return object()

    def clear(self, buf):
        self.t += 0.05
        self.log.append("clear")

    def device(self):
        return "fake"


def test_held_timing_sleeps_past_the_hosts_launch_then_times_the_run_alone(monkeypatch):
    import time
    dev = _FakeCuda()
    monkeypatch.setattr(autotune, "_CYCLES_PER_MS", {})

    def fn():                      # a launch whose host side takes >= 1 ms (a slow Python path)
        time.sleep(0.001)
        dev.t += dev.RUN
        dev.log.append("fn")
    ms = autotune.held_ms(fn, dev=dev)
    assert autotune._CYCLES_PER_MS["fake"] == pytest.approx(dev.CPM)          # calibrated on the sleep kernel
    assert ms == pytest.approx(dev.RUN)                                       # the run's time alone
    last = max(i for i, x in enumerate(dev.log) if x == "clear")
    first = min(i for i, x in enumerate(dev.log) if x == "clear")
    reps = dev.log[first:last + 5]
    assert len(reps) % 5 == 0 and len(reps) >= 25
    for i in range(0, len(reps), 5):
        clear, (sleep, cycles), rec0, run, rec1 = reps[i:i + 5]
        assert (clear, sleep, rec0, run, rec1) == ("clear", "sleep", "rec", "fn", "rec")
        assert cycles >= (2 * 1.0 + 0.02) * dev.CPM                          # twice the host's >= 1 ms


def test_unknown_timing_is_an_error(monkeypatch):
    monkeypatch.setattr(autotune, "TIMING", "fastest")
    with pytest.raises(ValueError, match="do_bench, hold"):
        autotune.bench_ms(lambda: None)


@pytest.mark.skipif(DEVICE != "cuda", reason="times a real kernel: GPU only (GEMS_TEST_DEVICE=cuda)")
def test_held_timing_leaves_a_slow_hosts_launch_out_on_the_gpu():
    # a ~10 us kernel behind 400 us of host work per call: do_bench's L2 clear (~75 us of GPU work) cannot
    # cover the host, so its events bracket most of the 400 us; the held timing measures the kernel
    import time
    import torch
    x = torch.randn(2**22, device="cuda")
    plain = autotune.held_ms(lambda: x.mul_(1.0001))

    def slow():
        time.sleep(0.0004)
        x.mul_(1.0001)
    held = autotune.held_ms(slow)
    from triton.testing import do_bench
    bench = do_bench(slow, warmup=5, rep=20, return_mode="median")
    # (bounds far from the 0.4 ms of host: other test processes may share the GPU)
    assert held < plain + 0.1, (held, plain)
    assert bench > held + 0.15, (bench, held)         # what the tuner's do_bench timing would have counted


def _ship(monkeypatch, tmp_path, name, picks):
    shipped = tmp_path / "shipped"
    (shipped / "test").mkdir(parents=True)
    (shipped / "test" / f"{name}-hold.json").write_text(json.dumps(picks))
    monkeypatch.setattr(autotune, "SHIPPED_DIR", shipped)
    monkeypatch.setattr(autotune, "TIMING", "hold")


def test_a_shipped_pick_answers_without_tuning(timing_backend, monkeypatch, tmp_path):
    _ship(monkeypatch, tmp_path, "s0", {repr("bucket"): {"name": "c"}})
    calls = []
    bench = _bench({"a": [2.0], "b": [1.0], "c": [3.0], "d": [4.0]}, calls)
    assert autotune.Autotuner("s0", CONFIGS).pick("bucket", bench)["name"] == "c"
    assert calls == []                                   # nothing timed
    assert autotune.Autotuner("s0", CONFIGS).pick("other", bench)["name"] == "b"   # not shipped: tuned
    assert calls == ["a", "b", "c", "d"]


def test_this_machines_pick_overrides_the_shipped_one(timing_backend, monkeypatch, tmp_path):
    _ship(monkeypatch, tmp_path, "s1", {repr("bucket"): {"name": "c"}})
    monkeypatch.setattr(autotune, "CONFIRM_ROUNDS", 0)
    t = autotune.Autotuner("s1", CONFIGS)
    t._store(repr("bucket"), {"name": "d"})            # an earlier process's own tuning
    assert t.pick("bucket", _bench({}, []))["name"] == "d"


def test_a_shipped_pick_of_a_dropped_config_is_tuned_again(timing_backend, monkeypatch, tmp_path):
    _ship(monkeypatch, tmp_path, "s2", {repr("bucket"): {"name": "gone"}})
    monkeypatch.setattr(autotune, "CONFIRM_ROUNDS", 0)
    calls = []
    bench = _bench({"a": [2.0], "b": [1.0], "c": [3.0], "d": [4.0]}, calls)
    assert autotune.Autotuner("s2", CONFIGS).pick("bucket", bench)["name"] == "b"
    assert calls == ["a", "b", "c", "d"]


def test_ship_tuned_merges_a_machines_picks_into_the_table(timing_backend, monkeypatch, tmp_path):
    import importlib.util
    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("ship_tuned", root / "scripts" / "ship_tuned.py")
    ship = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ship)
    _ship(monkeypatch, tmp_path, "s3", {repr("old"): {"name": "a"}, repr("bucket"): {"name": "a"}})
    autotune.Autotuner("s3", CONFIGS)._store(repr("bucket"), {"name": "b"})
    assert ship.main(["--arch", "test"]) == 0
    table = json.loads((tmp_path / "shipped" / "test" / "s3-hold.json").read_text())
    assert table == {repr("old"): {"name": "a"}, repr("bucket"): {"name": "b"}}
