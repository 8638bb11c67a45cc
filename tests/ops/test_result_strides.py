"""Strides of fresh results against ATen's (TensorIterator's fast setup and memory-order rule, the ops
that allocate a contiguous result, the operand order of each op's iterator), for pointwise ops on
permuted, sliced, expanded, channels_last, size-1-dim and zero-size inputs with number and 0-dim
second operands; and clone / _to_copy keeping a zero-strided empty tensor's strides."""
import pytest
import torch

import gems
from gems.codegen import layout, result_layout
from gems.ops.memory import preserved_strides
from harness import DEVICE, served

A = torch.ops.aten


def _inputs():
    base = torch.randn(5, 1, 4, 3, device=DEVICE)
    return {
        # the hand-checked case: (0.5 ** x).view(-1) raised only under Gems
        "permuted": base.permute(2, 0, 3, 1),
        "permuted3": torch.randn(4, 5, 3, device=DEVICE).permute(2, 0, 1),
        "transposed": torch.randn(6, 4, device=DEVICE).t(),
        "sliced": torch.randn(4, 8, device=DEVICE)[:, ::2],
        "expanded": torch.randn(4, 1, device=DEVICE).expand(4, 5),
        "channels_last": torch.randn(2, 3, 4, 5, device=DEVICE).to(memory_format=torch.channels_last),
        "channels_last_1x1": torch.randn(2, 3, 1, 1, device=DEVICE).to(memory_format=torch.channels_last),
        "channels_last_c1": torch.randn(2, 1, 4, 5, device=DEVICE).to(memory_format=torch.channels_last),
        "size1_transposed": torch.randn(3, 1, 4, device=DEVICE).transpose(0, 2),
        "odd_size1_stride": torch.randn(12, device=DEVICE).as_strided((3, 1, 4), (4, 7, 1)),
        "zero_size": torch.randn(0, 3, 4, device=DEVICE).permute(2, 0, 1),
        "zero_size_mid": torch.randn(4, 0, 3, device=DEVICE).permute(2, 1, 0),
        "contiguous": torch.randn(3, 4, device=DEVICE),
    }


# (name, fn, the overload Gems must serve)
OPS = [
    ("pow.Scalar", lambda x: 0.5 ** x, "pow.Scalar"),
    ("pow.Tensor_Scalar", lambda x: x ** 2, "pow.Tensor_Scalar"),
    ("rsub.Scalar", lambda x: 1 - x, "rsub.Scalar"),
    ("rsub.Tensor", lambda x: torch.rsub(x.contiguous(), x), "rsub.Tensor"),
    ("rsub.Tensor_swapped", lambda x: torch.rsub(x, x.contiguous()), "rsub.Tensor"),
    ("masked_fill.Scalar", lambda x: x.masked_fill(x > 0, 1.0), "masked_fill.Scalar"),
    ("masked_fill.Tensor", lambda x: x.masked_fill(x > 0, torch.tensor(1.0, device=x.device)),
     "masked_fill.Tensor"),
    ("threshold_backward", lambda x: A.threshold_backward(x, x, 0.0), "threshold_backward"),
    ("threshold_backward_mixed", lambda x: A.threshold_backward(x.contiguous(), x, 0.0), "threshold_backward"),
    ("leaky_relu_backward_mixed", lambda x: A.leaky_relu_backward(x.contiguous(), x, 0.01, False),
     "leaky_relu_backward"),
    ("add_number", lambda x: x + 1, "add.Tensor"),
    ("add_0dim", lambda x: x + torch.tensor(2.0, device=x.device), "add.Tensor"),
    ("add_self", lambda x: x + x, "add.Tensor"),
    ("add_contiguous_second", lambda x: x + x.contiguous(), "add.Tensor"),
    ("add_contiguous_first", lambda x: x.contiguous() + x, "add.Tensor"),
    ("mul_number", lambda x: x * 3, "mul.Tensor"),
    ("neg", lambda x: -x, "neg"),
    ("exp", torch.exp, "exp"),
    ("where_number", lambda x: torch.where(x > 0, x, 0.0), None),
    ("where_tensors", lambda x: torch.where(x > 0, x.contiguous(), x), "where.self"),
    ("clamp_numbers", lambda x: x.clamp(-0.5, 0.5), "clamp"),
    ("clamp_0dim", lambda x: x.clamp(torch.tensor(-0.5, device=x.device), torch.tensor(0.5, device=x.device)),
     "clamp.Tensor"),
    ("clamp_min_number", lambda x: x.clamp_min(0.0), "clamp_min"),
    ("lerp", lambda x: torch.lerp(x, x.contiguous(), 0.3), "lerp.Scalar"),
    ("hardtanh", torch.nn.functional.hardtanh, "hardtanh"),
    ("eq_number", lambda x: x == 0.5, "eq.Scalar"),
    ("remainder_number", lambda x: x % 2.0, "remainder.Scalar"),
    ("div_floor_number", lambda x: torch.div(x, 3, rounding_mode="floor"), "div.Tensor_mode"),
    ("where_number_self", lambda x: torch.where(x > 0, 1.0, x), None),
    ("addcmul_0dim_self", lambda x: torch.addcmul(torch.tensor(1.0, device=x.device), x, x), "addcmul"),
]
INPUTS = list(_inputs())


@pytest.mark.parametrize("layout_name", INPUTS)
@pytest.mark.parametrize("name,fn,overload", OPS, ids=[o[0] for o in OPS])
def test_pointwise_result_strides_match_aten(name, fn, overload, layout_name):
    torch.manual_seed(0)
    x = _inputs()[layout_name]
    want = fn(x)
    with served(*([overload] if overload and x.numel() else []), at_least=1), gems.use_gems():
        got = fn(x)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert got.stride() == want.stride(), f"{name} on {layout_name}: Gems {got.stride()}, ATen {want.stride()}"
    torch.testing.assert_close(got, want, equal_nan=True)


def test_scalar_base_pow_result_views_flat():
    # the hand-checked snippet: ATen's result is contiguous, so .view(-1) works
    x = torch.randn(5, 1, 4, 3, device=DEVICE).permute(2, 0, 3, 1)
    want = (0.5 ** x).view(-1)
    with served("pow.Scalar"), gems.use_gems():
        got = (0.5 ** x).view(-1)
    torch.testing.assert_close(got, want)


ZERO_STRIDED = dict(size=(5, 1, 4, 0), stride=(0, 0, 0, 1))


@pytest.mark.parametrize("call", [
    lambda x: x.clone(),
    lambda x: x.clone(memory_format=torch.preserve_format),
    lambda x: x.clone(memory_format=torch.contiguous_format),
    lambda x: A._to_copy(x),
    lambda x: A._to_copy(x, memory_format=torch.preserve_format),
    lambda x: A._to_copy(x, memory_format=torch.contiguous_format),
    lambda x: x.to(torch.float64),
], ids=["clone", "clone_preserve", "clone_contiguous", "_to_copy", "_to_copy_preserve", "_to_copy_contiguous",
        "to_float64"])
@pytest.mark.parametrize("src", ["zero_strided_empty", "channels_last_1x1", "channels_last_c1", "zero_size"])
def test_copies_keep_aten_strides(call, src):
    x = {"zero_strided_empty": torch.empty_strided(**ZERO_STRIDED, device=DEVICE),
         "channels_last_1x1": _inputs()["channels_last_1x1"],
         "channels_last_c1": _inputs()["channels_last_c1"],
         "zero_size": _inputs()["zero_size"]}[src]
    want = call(x)
    with gems.use_gems():
        got = call(x)
    assert got.stride() == want.stride(), (got.stride(), want.stride())
    assert torch.equal(got, want)


def test_zero_strided_empty_clone_strides_are_atens():
    # ATen keeps (0, 0, 0, 1): an empty tensor is contiguous, hence non-overlapping and dense
    x = torch.empty_strided(**ZERO_STRIDED, device=DEVICE)
    with served("clone", "_to_copy"), gems.use_gems():
        assert x.clone().stride() == (0, 0, 0, 1)
        assert A._to_copy(x).stride() == (0, 0, 0, 1)


@pytest.mark.parametrize("shape", [(2, 0, 3, 4), (2, 3, 0, 4), (0, 3, 4, 5), (2, 3, 4, 0), (2, 1, 1, 1), (2, 3, 1, 1)])
def test_channels_last_strides_are_c10s(shape):
    assert layout.channels_last_strides(shape) == torch.empty(shape, memory_format=torch.channels_last).stride()


def test_preserved_strides_follow_c10s_dense_flag():
    cases = [((5, 1, 4, 0), (0, 0, 0, 1)), ((4, 5), (1, 4)), ((4, 5), (5, 2)), ((4, 1), (1, 9)), ((3,), (2,)),
             ((1,), (7,)), ((2, 3), (0, 1)), ((2, 2), (1, 1))]
    for shape, strides in cases:
        t = torch.empty_strided(shape, strides)
        want = torch._prims_common.is_non_overlapping_and_dense_or_false(t)
        assert (preserved_strides(t) is not None) == want, (shape, strides)
        assert want == (t.is_contiguous() or layout.non_overlapping_and_dense(shape, strides)), (shape, strides)


# out= overloads, each resized from empty: (overload, call(x, out), out dtype, ATen generates it from the
# functional op (native_functions.yaml `autogen:`: result computed, then copied into a contiguous out))
OUT_CALLS = [
    ("rsub.Scalar_out", lambda x, o: A.rsub.Scalar_out(x, -1, 1, out=o), torch.float32, True),
    ("rsub.Tensor_out", lambda x, o: A.rsub.Tensor_out(x, x.contiguous(), alpha=1, out=o), torch.float32, True),
    ("add.Scalar_out", lambda x, o: A.add.Scalar_out(x, 2.0, out=o), torch.float32, True),
    ("div.Scalar_mode_out", lambda x, o: A.div.Scalar_mode_out(x, 2.0, rounding_mode="floor", out=o), torch.float32,
     True),
    ("remainder.Scalar_Tensor_out", lambda x, o: A.remainder.Scalar_Tensor_out(1.5, x, out=o), torch.float32, True),
    ("bitwise_and.Scalar_Tensor_out", lambda x, o: A.bitwise_and.Scalar_Tensor_out(3, x.long(), out=o), torch.int64,
     True),
    ("__lshift__.Tensor_out", lambda x, o: A.__lshift__.Tensor_out(x.long(), x.long().abs(), out=o), torch.int64, True),
    ("__lshift__.Scalar_out", lambda x, o: A.__lshift__.Scalar_out(x.long(), 2, out=o), torch.int64, True),
    # written by hand in ATen around the structured kernel: TensorIterator's strides
    ("remainder.Scalar_out", lambda x, o: torch.remainder(x, 1.5, out=o), torch.float32, False),
    ("bitwise_left_shift.Tensor_Scalar_out", lambda x, o: torch.bitwise_left_shift(x.long(), 2, out=o), torch.int64,
     False),
    ("hypot.out", lambda x, o: torch.hypot(x, x, out=o), torch.float32, False),
    ("pow.Tensor_Scalar_out", lambda x, o: torch.pow(x, 2.0, out=o), torch.float32, False),
]


@pytest.mark.parametrize("layout_name", ["transposed", "permuted", "sliced", "expanded", "channels_last"])
@pytest.mark.parametrize("name,call,dtype,generated", OUT_CALLS, ids=[c[0] for c in OUT_CALLS])
def test_out_resized_from_empty_strides_match_aten(name, call, dtype, generated, layout_name):
    x = _inputs()[layout_name]
    assert (name in result_layout.generated_out_overloads()) == generated   # the yaml, read by Gems
    want = call(x, torch.empty(0, dtype=dtype, device=DEVICE))
    out = torch.empty(0, dtype=dtype, device=DEVICE)
    with served(name), gems.use_gems():
        got = call(x, out)
    assert got is out and got.stride() == want.stride(), f"{name}: Gems {got.stride()}, ATen {want.stride()}"
    if generated:   # the hand-checked rule
        assert got.is_contiguous()
    torch.testing.assert_close(got, want, equal_nan=True)


def test_cpu_inputs_converted_to_the_common_dtype_vote_dense():
    # ATen's CPU TensorIterator converts an input of another dtype to the common one first (a dense
    # temporary): an expanded bool or int input then votes for the logical order, and the result is
    # contiguous; CUDA converts while loading, so the permuted input alone orders the dims
    cases = [
        ("ge.Tensor", lambda: torch.ge((torch.rand(5, 1, device=DEVICE) > 0.5).expand(5, 16),
                                       torch.randint(-5, 5, (16, 5), device=DEVICE).t())),
        ("div.Tensor", lambda: torch.div(torch.randint(1, 5, (5, 1), device=DEVICE).expand(5, 16),
                                         torch.randint(1, 5, (16, 5), device=DEVICE).t())),
        ("logical_and", lambda: torch.logical_and((torch.rand(5, 1, device=DEVICE) > 0.5).expand(5, 16),
                                                  torch.randn(16, 5, device=DEVICE).t())),
    ]
    for name, fn in cases:
        torch.manual_seed(0)
        want = fn()
        torch.manual_seed(0)
        with served(name), gems.use_gems():
            got = fn()
        assert got.stride() == want.stride() == ((16, 1) if DEVICE == "cpu" else (1, 5)), (name, got.stride())
        assert torch.equal(got, want)
