"""benchmarks.decode_profile: the CPU smoke run goes through every part (kernels are CUDA-only) and
prints the graphed ms per token, the same with generate's own ops on ATen, and the host phases with the
prompt's forward left out of the forward's calls."""
import pytest
from harness import DEVICE

from benchmarks import decode_profile


# the interpreter is chosen before triton is imported: a GPU test process cannot switch to it
@pytest.mark.skipif(DEVICE != "cpu", reason="the smoke run is the CPU's (the GPU run is the benchmark itself)")
def test_cpu_smoke_run(capsys):
    assert decode_profile.main(["--device", "cpu", "--batch", "1", "--seq-len", "4", "--new-tokens", "3",
                                "--runs", "1"]) == 0
    out = capsys.readouterr().out
    assert "graphed generate:" in out and "generate's own ops on ATen:" in out
    lines = {line.split()[-1]: line for line in out.splitlines() if line.startswith("  ")}
    # 3 new tokens: the prompt's forward and 2 decode steps; the forward's line counts the steps only
    assert "x  2  forward" in lines["forward"]
    assert "x  3  prepare_inputs_for_generation" in lines["prepare_inputs_for_generation"]
