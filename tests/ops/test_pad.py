"""constant_pad_nd and slice_backward (gems/ops/shape/pad.py) against ATen: bit-identical values and ATen's
strides; positive and negative pads on any number of trailing dims, pad values (NaN, -inf, ints,
the loss's ignore_index padding of labels), every dtype, layouts, memory formats, empty and 0-size
results, errors, gradients through F.pad and slicing, plans."""
import pytest
import torch
import torch.nn.functional as F

import gems
from harness import DEVICE, DTYPES, FLOAT_IDS, ON_GPU, check_grad, dtype_params, layouts, make, served

ALL_DT = DTYPES + [torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool]
DT_IDS = lambda d: FLOAT_IDS.get(d, str(d).replace("torch.", ""))   # noqa: E731
sb = torch.ops.aten.slice_backward


def _make(shape, dtype):
    return make(shape, dtype, low=0 if dtype == torch.uint8 else -3.0)


def _same(got, want, msg):
    assert got.dtype == want.dtype and got.shape == want.shape, f"{msg}: {got.dtype}{tuple(got.shape)} vs " \
                                                                f"{want.dtype}{tuple(want.shape)}"
    if want.numel() > 1:
        assert got.stride() == want.stride(), f"{msg}: strides {got.stride()} vs {want.stride()}"
    assert torch.equal(got.cpu().nan_to_num(7.0) if got.is_floating_point() else got.cpu(),
                       want.cpu().nan_to_num(7.0) if want.is_floating_point() else want.cpu()), f"{msg}: values differ"


def _pad(x, pad, value=0, op="constant_pad_nd"):
    want = F.pad(x, pad, value=value)
    with served(op), gems.use_gems():
        got = F.pad(x, pad, value=value)
    _same(got, want, f"pad {pad} value {value}")


PADS = [(1, 2), (0, 3), (2, 0, 1, 1), (-1, 2), (1, -2, 2, 0), (-1, -1), (0, 0, -1, 1), (1, 1, 1, 1, 1, 1),
        (3, 0, 0, 0, 2, 0)]


@pytest.mark.parametrize("dtype", ALL_DT, ids=DT_IDS)
def test_pads_and_dtypes(dtype):
    x = _make((2, 3, 5), dtype)
    v = True if dtype == torch.bool else (2 if not dtype.is_floating_point else -1.5)
    for pad in PADS:
        _pad(x, pad, v)
    _pad(_make((7,), dtype), (2, 1), v)
    _pad(_make((2, 3, 2, 2, 3), dtype), (1, 0, 0, 1, 1, 1, 0, 0), v)


@dtype_params()
def test_values_and_layouts(dtype):
    for value in (0, 0.0, float("nan"), float("-inf"), 65504.0, 2.0 ** -20):
        _pad(make((3, 4), dtype), (1, 2, 1, 0), value)
    # -0.0 goes to ATen (a zero scalar argument loses its sign in Triton): the sign of the padding is ATen's
    x = make((3, 4), dtype)
    gems.reset_stats()
    with gems.use_gems():
        got = torch.constant_pad_nd(x, (1, 2, 1, 0), -0.0)
    want = torch.constant_pad_nd(x, (1, 2, 1, 0), -0.0)
    assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want))
    assert "-0.0" in " ".join(gems.stats()["constant_pad_nd.default"]["reasons"])
    for name, x in layouts((4, 6), dtype):
        for pad in [(1, 2), (2, 1, -1, 1), (-2, -1)]:
            _pad(x, pad, 0.5)
    # channels_last input: the padded output keeps the format
    cl = make((2, 3, 4, 5), dtype).to(memory_format=torch.channels_last)
    _pad(cl, (1, 1, 2, 0), 1.0)
    _pad(cl, (-1, 0, 0, -1))
    _pad(make((2, 3, 4, 5), dtype).permute(0, 2, 3, 1), (1, 0))


def test_model_patterns():
    # labels shifted by padding with ignore_index (transformers' ForCausalLMLoss)
    labels = torch.randint(0, 100, (2, 9), device=DEVICE)
    _pad(labels, (0, 1), -100)
    _pad(labels[:, 1:], (0, 1), -100)
    # an attention mask padded with zeros on the key axis, a float mask with -inf
    _pad(torch.ones(2, 1, 4, 4, dtype=torch.bool, device=DEVICE), (0, 3), False)
    _pad(make((1, 1, 4, 4)), (0, 2), float("-inf"))


def test_edges():
    _pad(make((0, 3)), (1, 1))
    _pad(make((2, 0)), (1, 2))          # an empty input padded to a non-empty output: all value
    _pad(make((3,)), (-3, 0))           # a 0-size result
    _pad(make(()), ())                  # no pad on a 0-dim tensor: a copy
    with gems.use_gems():
        assert F.pad(make((2, 3)), (0, 0)).shape == (2, 3)


def test_errors_and_fallbacks():
    x = make((2, 3))
    with gems.use_gems():
        with pytest.raises(RuntimeError, match="even"):
            torch.constant_pad_nd(x, [1, 2, 3])
        with pytest.raises(RuntimeError, match="no more than twice"):
            torch.constant_pad_nd(x, [1, 1, 1, 1, 1, 1])
        with pytest.raises(RuntimeError):   # ATen: "narrow(): length must be non-negative."
            torch.constant_pad_nd(x, [-2, -2])
        with pytest.raises(RuntimeError):
            torch.constant_pad_nd(x.half(), [1, 1], 1e6)       # does not fit fp16: ATen raises
    gems.reset_stats()
    with gems.use_gems():
        got = torch.constant_pad_nd(x.half(), [1, 1], 0.1)    # 0.1 is not exact in fp32: left to ATen
        i = torch.constant_pad_nd(torch.ones(3, dtype=torch.int32, device=DEVICE), [1, 0], 2.5)
    assert torch.equal(got, torch.constant_pad_nd(x.half(), [1, 1], 0.1))
    assert torch.equal(i, torch.constant_pad_nd(torch.ones(3, dtype=torch.int32, device=DEVICE), [1, 0], 2.5))
    assert gems.stats()["constant_pad_nd.default"]["fallback"] == 2


@dtype_params()
def test_pad_grad(dtype):
    # F.pad's backward is a narrow (a view) of the gradient: pad itself runs in the forward
    check_grad(lambda a: F.pad(a, (1, 2, 0, 1), value=0.5), [make((3, 4), dtype)], dtype=dtype,
               served_ops=["constant_pad_nd"])


# ------------------------------------------------------------------------------------------ slice_backward
SLICES = [(1, 1, 5, 1), (1, 0, 5, 2), (2, -4, 2 ** 63 - 1, 3), (0, 1, 3, 1), (-1, 0, 1, 1), (2, 5, 100, 1),
          (1, -100, -1, 2)]


@pytest.mark.parametrize("dtype", ALL_DT, ids=DT_IDS)
def test_slice_backward(dtype):
    sizes = [3, 6, 7]
    for dim, start, end, step in SLICES:
        view = torch.empty(sizes)[(slice(None),) * (dim % 3) + (slice(start, end, step),)]
        g = _make(tuple(view.shape), dtype)
        want = sb(g, sizes, dim, start, end, step)
        with served("slice_backward"), gems.use_gems():
            got = sb(g, sizes, dim, start, end, step)
        _same(got, want, f"slice_backward dim={dim} {start}:{end}:{step}")


@dtype_params()
def test_slice_backward_layouts_and_grad(dtype):
    g = make((5, 3), dtype).t()          # a transposed gradient, [3, 5]
    want = sb(g, [3, 11], 1, 1, 11, 2)
    with served("slice_backward"), gems.use_gems():
        got = sb(g, [3, 11], 1, 1, 11, 2)
    _same(got, want, "transposed grad")
    g = make((1, 4), dtype).expand(3, 4)
    with served("slice_backward"), gems.use_gems():
        got = sb(g, [3, 9], 1, 2, 6, 1)
    _same(got, sb(g, [3, 9], 1, 2, 6, 1), "expanded grad")
    # autograd of a slice (rotate_half's halves, a shifted sequence)
    check_grad(lambda a: a[..., 2:] * 3, [make((2, 3, 8), dtype)], dtype=dtype, served_ops=["slice_backward"])
    check_grad(lambda a: a[:, ::2], [make((4, 7), dtype)], dtype=dtype, served_ops=["slice_backward"])


def test_slice_backward_edges_and_errors():
    with gems.use_gems():
        assert sb(make((0, 4)), [0, 4], 1, 0, 4, 1).shape == (0, 4)
        z = sb(make((3, 0)), [3, 5], 1, 5, 9, 1)        # an empty slice: all zeros
    assert torch.equal(z.cpu(), torch.zeros(3, 5))
    with gems.use_gems(), pytest.raises(RuntimeError):
        sb(make((3, 2)), [3, 5], 1, 0, 5, 0)


def _slice_backward_call():
    g = make((5, 3))
    want = sb(g, [5, 9], 1, 1, 9, 3)
    with served("slice_backward"), gems.use_gems():
        got = sb(g, [5, 9], 1, 1, 9, 3)
    _same(got, want, "slice_backward plan")


def test_repeat_calls_run_plans():
    for name, call in [("constant_pad_nd.default", lambda: _pad(make((5, 3)), (0, 1, 2, 0), 0.25)),
                       ("slice_backward.default", _slice_backward_call)]:
        empty_info = {"plans": 0, "no_plan": 0}
        before = gems.dispatch.plan_stats().get(name, empty_info)
        for _ in range(3):
            call()
        info = gems.dispatch.plan_stats()[name]
        assert info["plans"] == before["plans"] + 1 and info["no_plan"] == before["no_plan"], (name, before, info)


@pytest.mark.skipif(not ON_GPU, reason="bf16 is left to ATen by the interpreter backend")
def test_bf16_gpu():
    _pad(make((3, 4), torch.bfloat16), (1, 2, -1, 0), -0.5)
    g = make((3, 2), torch.bfloat16)
    with served("slice_backward"), gems.use_gems():
        got = sb(g, [3, 5], 1, 0, 4, 2)
    _same(got, sb(g, [3, 5], 1, 0, 4, 2), "bf16")
