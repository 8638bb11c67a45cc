"""The launch cache's binary key: what selects a Triton binary, and nothing else."""
import torch
import triton
import triton.language as tl

from gems.runtime.launch import LaunchCache, binary_key
from harness import DEVICE


def test_constexprs_key_by_value_runtime_args_by_specialization():
    x = torch.empty(64)
    c = frozenset({2, 3})
    assert binary_key((x, 1008, 1024, True), c) != binary_key((x, 1008, 2048, True), c)
    assert binary_key((x, 1008, 1024, True), c) != binary_key((x, 1008, 1024, False), c)
    # sizes with the same specialization share a binary
    assert binary_key((x, 1008, 1024, True), c) == binary_key((x, 4096, 1024, True), c)
    # Triton specializes ints equal to 1, divisible by 16, and wider than 32 bits
    assert binary_key((x, 1), ()) != binary_key((x, 17), ())
    assert binary_key((x, 16), ()) != binary_key((x, 17), ())
    assert binary_key((x, 2**31 + 16), ()) != binary_key((x, 16), ())
    # dtype and 16-byte alignment of tensors
    assert binary_key((x,), ()) != binary_key((x.half(),), ())
    assert binary_key((x,), ()) != binary_key((x[1:],), ())


@triton.jit
def _scale(X, Y, n, s, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + i, tl.load(X + i, mask=i < n) * s, mask=i < n)


def test_launch_cache_runs_kernels():
    k = LaunchCache(_scale)
    assert k.interpreted or k._constexpr_pos == frozenset({4})
    x = torch.randn(100, device=DEVICE)
    y = torch.full((100,), float("nan"), device=DEVICE)
    k[(triton.cdiv(100, 32),)](x, y, 100, 3.0, 32)
    torch.testing.assert_close(y, x * 3.0)
