"""benchmarks.read_roof: its read kernel touches every word of the weight exactly once (the xor of its
partials is the xor of all words, for any number of programs and blocks, ragged ends included), and the
CPU smoke run produces a row per weight."""
import json
import os

import numpy as np
import pytest
import torch

from benchmarks import read_roof
from harness import DEVICE


@pytest.mark.parametrize("n,programs,block", [(1000, 1, 64), (1000, 3, 64), (1000, 16, 64), (4096, 2, 128),
                                              (77, 5, 32)])
def test_the_read_kernel_reads_every_word_once(n, programs, block):
    g = torch.Generator().manual_seed(n + programs)
    words = torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32, generator=g).to(DEVICE)
    part = read_roof.read_weight(read_roof._kernel(), words, programs, block, 4)
    assert part.shape == (programs,)
    want = np.bitwise_xor.reduce(words.cpu().numpy())
    assert np.bitwise_xor.reduce(part.cpu().numpy()) == want   # a skipped (or twice-read) word changes it


def test_programs_cover_the_blocks():
    assert read_roof._programs(None, 1000, 64, 132) == 16          # one program per block
    assert read_roof._programs(2, 10**6, 1024, 132) == 264        # a persistent grid, 2 per SM
    assert read_roof._programs(8, 1000, 64, 132) == 16            # never more programs than blocks


@pytest.mark.skipif(DEVICE != "cpu", reason="the smoke run is the CPU's (the GPU run is the benchmark itself)")
def test_cpu_smoke_run_writes_a_row_per_weight(tmp_path, capsys):
    out = tmp_path / "roof.json"
    assert read_roof.main(["--device", "cpu", "--json", os.fspath(out)]) == 0
    data = json.loads(out.read_text())
    assert [(r["N"], r["K"]) for r in data["rows"]] == read_roof.CPU_SHAPES
    for r in data["rows"]:
        assert all(r[f"{c}_us"] > 0 for c in ("read", "sum", "gems", "cublas"))
        assert r["MB"] == r["N"] * r["K"] * 2 / 1e6
    assert "fastest read" in capsys.readouterr().out
