import pytest
import torch

import gems
from harness import DEVICE, check_grad, check_op, dtype_params, layouts, make

SHAPES = [(7, 33), (4, 1), (3, 5, 17), (2, 1100)]   # odd sizes; 1100 > the interpreter's tile: online path


@dtype_params()
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_forward_all_dims(shape, dtype, log):
    fn = torch.log_softmax if log else torch.softmax
    for dim in range(-len(shape), len(shape)):
        check_op(fn, (make(shape, dtype), dim), dtype=dtype, served_ops=["_log_softmax" if log else "_softmax"])


@dtype_params()
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_layouts(dtype, log):
    fn = torch.log_softmax if log else torch.softmax
    for name, x in layouts((6, 19), dtype):
        check_op(fn, (x, -1), dtype=dtype)
        check_op(fn, (x, 0), dtype=dtype)


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_edge_cases(log):
    fn = torch.log_softmax if log else torch.softmax
    check_op(fn, (make((), torch.float32), 0), dtype=torch.float32)
    with gems.use_gems():
        e = fn(make((0, 5)), 1)
    assert e.shape == (0, 5)
    # -inf entries (attention masks) and a fully masked row
    x = make((3, 40))
    x[0, :20] = float("-inf")
    x[1, ::3] = float("-inf")
    x[2] = float("-inf")
    check_op(fn, (x, 1), dtype=torch.float32)
    x2 = make((2, 1100))
    x2[0, :600] = float("-inf")  # -inf prefix crossing a tile in the online path
    check_op(fn, (x2, 1), dtype=torch.float32)


@dtype_params()
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("shape,dim", [((5, 37), 1), ((4, 6, 3), 1), ((2, 1100), -1)])
def test_backward(shape, dim, dtype, log):
    fn = torch.log_softmax if log else torch.softmax
    op = "_log_softmax_backward_data" if log else "_softmax_backward_data"
    check_grad(lambda x: fn(x, dim), [make(shape, dtype)], dtype=dtype, served_ops=[op])


def test_out_variant_and_errors():
    x = make((4, 9))
    out = torch.full((4, 9), float("nan"), device=DEVICE)
    with gems.use_gems():
        torch._softmax(x, 1, False, out=out)
        torch.testing.assert_close(out.double(), torch.softmax(x.double(), 1))
        wrong = torch.full((2,), float("nan"), device=DEVICE)
        with pytest.warns(UserWarning, match="resized"):
            torch._softmax(x, 1, False, out=wrong)
        assert wrong.shape == (4, 9)
        with pytest.raises(IndexError):
            torch.softmax(x, 2)
        if DEVICE == "cpu":  # ATen rejects half_to_float on CPU; so must Gems
            with pytest.raises(RuntimeError):
                torch._softmax(x.half(), 1, True)


@pytest.mark.parametrize("log", [False, True])
def test_backward_dtype_combinations_answer_or_raise_like_aten(log):
    # the result dtype (or the error) of a grad/input_dtype mismatch differs between ATen's CPU and
    # CUDA kernels: whatever ATen does on this device, Gems must do
    op = torch.ops.aten._log_softmax_backward_data if log else torch.ops.aten._softmax_backward_data
    x = make((3, 5))
    y = torch.log_softmax(x, -1) if log else torch.softmax(x, -1)
    g = make((3, 5))
    for gdt in (torch.float32, torch.float16):
        for idt in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            args = (g.to(gdt), y.to(gdt), -1, idt)
            try:
                want = op(*args)
            except RuntimeError:
                with pytest.raises(RuntimeError):
                    with gems.use_gems():
                        op(*args)
                continue
            with gems.use_gems():
                got = op(*args)
            assert got.dtype == want.dtype, (gdt, idt, got.dtype, want.dtype)
            torch.testing.assert_close(got.double(), want.double(), rtol=2e-3, atol=2e-3)
