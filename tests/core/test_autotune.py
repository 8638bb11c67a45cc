"""The autotuner's choice: one timing per config, or with confirmation rounds the lowest median of the
fastest few (runtime/autotune.py)."""
import pytest

from gems.runtime import autotune, backends


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
