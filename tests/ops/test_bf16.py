"""bfloat16: correctly rounded where Gems serves it, left to ATen where it cannot be.

On CUDA, Gems serves bf16 and its results must meet the suite's rule (within 2x ATen's own bf16 error
against float64), with fp32 -> bf16 casts rounding to nearest even like ATen. The Triton interpreter
cannot round bf16 (it truncates, and its bf16 GEMM is wrong by ~1e10; shared/facts.md), so the
interpreter backend declares no bf16: every call that touches bf16 runs ATen's kernel, counted with
its reason, and the answer is ATen's exactly.
"""
import pytest
import torch
import torch.nn.functional as F

import gems
from gems import registry
from harness import DEVICE, ON_GPU, assert_close, make, to_ref

BF16 = torch.bfloat16
REASON = "bfloat16: not exact on the interpreter backend"


def _layer_norm(x):
    w = torch.linspace(0.5, 1.5, x.shape[-1], device=x.device, dtype=x.dtype)
    b = torch.linspace(-0.2, 0.3, x.shape[-1], device=x.device, dtype=x.dtype)
    return F.layer_norm(x, (x.shape[-1],), w, b)


# name: (function, input shapes, the overload Gems serves)
CASES = {
    "mm": (torch.mm, [(4, 8), (8, 3)], "mm.default"),
    "mm_large": (torch.mm, [(37, 70), (70, 45)], "mm.default"),
    "addmm": (lambda b, x, y: torch.addmm(b, x, y), [(3,), (5, 16), (16, 3)], "addmm.default"),
    "exp": (torch.exp, [(1000,)], "exp.default"),
    "silu": (F.silu, [(1000,)], "silu.default"),
    "gelu": (F.gelu, [(1000,)], "gelu.default"),
    "softmax": (lambda x: torch.softmax(x, -1), [(8, 125)], "_softmax.default"),
    "layer_norm": (_layer_norm, [(8, 125)], "native_layer_norm.default"),
    "sum": (torch.sum, [(1000,)], "sum.default"),
    "sum_dim": (lambda x: x.sum(-1), [(8, 125)], "sum.dim_IntList"),
    "add": (torch.add, [(7, 9), (9,)], "add.Tensor"),
    "mul_scalar": (lambda x: x * 1.7, [(1000,)], "mul.Tensor"),
}


def _stats(name):
    return dict(gems.stats().get(name, {"served": 0, "fallback": 0, "reasons": {}}))


@pytest.mark.parametrize("case", sorted(CASES))
def test_bf16_ops_are_exact_or_left_to_aten(case):
    fn, shapes, op = CASES[case]
    torch.manual_seed(0)
    args = [make(s, BF16) for s in shapes]
    before = _stats(op)
    with gems.use_gems():
        out = fn(*args)
    after = _stats(op)
    aten = fn(*args)
    ref = fn(*to_ref(args))
    assert out.dtype == aten.dtype == BF16
    # the suite's low-precision rule, on every backend
    assert_close(out, ref, BF16, aten, msg=case)
    if ON_GPU:
        assert after["served"] > before["served"], f"Gems must serve bf16 {op} on CUDA: {after}"
    else:
        assert after["served"] == before["served"], f"the interpreter must not serve bf16 {op}: {after}"
        assert after["reasons"].get(REASON, 0) > before["reasons"].get(REASON, 0), after
        assert torch.equal(out, aten)


def _bits(t):
    return t.view(torch.int16)


def test_fp32_to_bf16_casts_round_to_nearest_even_like_aten():
    one = 1.0
    vals = [1.01171875,            # between 1.0078125 and 1.015625: rounds up (truncation gives 1.0078125)
            1.00390625,            # a tie: rounds to even 1.0
            1.01171875 + 2 ** -20, 1.0 + 3 * 2 ** -9,      # tie to even, upwards
            3.4e38, -3.4e38,       # round to +-inf (truncation keeps them finite)
            3.3e38, 1e-40, -1e-40, 2 ** -133,             # large finite, subnormals
            0.0, -0.0, float("inf"), -float("inf"), float("nan"), -one / 3, 65504.0, 7.1e-39]
    x = torch.tensor(vals, dtype=torch.float32, device=DEVICE)
    payload_nan = torch.tensor([0x7F800001, 0x7FC00001, -8388607], dtype=torch.int32, device=DEVICE).view(torch.float32)
    x = torch.cat([x, payload_nan])
    with gems.use_gems():
        got = [x.bfloat16(), x.to(BF16), torch.empty(x.shape, dtype=BF16, device=DEVICE).copy_(x)]
    want = x.bfloat16()
    nan = torch.isnan(want)
    for g in got:
        assert torch.equal(torch.isnan(g), nan), (g, want)
        assert torch.equal(_bits(g)[~nan], _bits(want)[~nan]), (g, want)


def test_bf16_declared_for_cuda_not_for_the_interpreter():
    for name in ("mm.default", "exp.default", "_softmax.default", "_to_copy.default"):
        impl = registry.get(name)
        assert BF16 in impl.dtypes
        assert BF16 in registry.dtypes_on(impl, "cuda")
        assert BF16 not in registry.dtypes_on(impl, "interpreter")


def test_interpreter_leaves_calls_with_bf16_anywhere_to_aten():
    """Not only the first tensor: a bf16 out=, a bf16 second operand, a dtype=bfloat16 argument."""
    if ON_GPU:
        pytest.skip("the interpreter backend's rule")
    x, y = make((5,)), make((5,), BF16)
    gems.reset_stats()
    with gems.use_gems():
        a = torch.add(x, y)                                  # fp32 first, bf16 second
        b = torch.exp(x, out=torch.empty(5, dtype=BF16))     # bf16 out=
        c = x.to(BF16)                                       # dtype argument
        d = torch.sum(x, dtype=BF16)
    assert torch.equal(a, torch.add(x, y)) and torch.equal(b, torch.exp(x).bfloat16())
    assert torch.equal(c, x.bfloat16()) and torch.equal(d, torch.sum(x, dtype=BF16))
    st = gems.stats()
    for op in ("add.Tensor", "exp.out", "_to_copy.default", "sum.default"):
        assert st[op]["served"] == 0 and st[op]["reasons"].get(REASON), (op, st.get(op))
