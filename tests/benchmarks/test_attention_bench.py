"""benchmarks/attention.py: a row alternates ATen and Gems `rounds` times, Gems serves it, and the
ratios are Gems' time over ATen's (CPU: the interpreter, tiny shapes; GPU: a small decode shape)."""
import pytest
import torch

from benchmarks import attention as bench_attention
from harness import DEVICE


def test_row_alternates_rounds_and_is_served(monkeypatch):
    if DEVICE == "cpu":
        case, dtype = ("decode-tiny", 1, 2, 2, 1, 256, 32, False, False, False), torch.float16
    else:
        case, dtype = ("decode KV256", 1, 4, 4, 1, 256, 128, False, False, False), torch.bfloat16
    sides = []
    real = bench_attention.bench

    def spy(fn, device):
        sides.append(bench_attention.gems.is_enabled())
        return real(fn, device)
    monkeypatch.setattr(bench_attention, "bench", spy)
    (row,) = bench_attention.run_case(case, dtype, DEVICE, rounds=2)
    assert sides == [False, True, False, True]
    assert row["pass_"] == "fwd" and row["rounds"] == 2 and row["served"], row
    assert row["ratio"] == pytest.approx(row["gems_ms"] / row["aten_ms"])
    assert row["max_abs_diff"] is not None and row["max_abs_diff"] < 2e-2
    (k,) = bench_attention.run_case(case, dtype, DEVICE, kernel_time=True)
    assert k["pass_"] == "fwd" and len(sides) == 4
    if DEVICE == "cpu":
        assert k["device_ratio"] is None
    else:
        assert k["gems_device_ms"] > 0 and k["device_ratio"] == pytest.approx(k["gems_device_ms"] / k["aten_device_ms"])
