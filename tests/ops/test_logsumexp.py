import pytest
import torch

import gems
from harness import DEVICE, check_grad, check_op, count_launches, dtype_params, layouts, make, raises_like_aten

# odd sizes; 1100 > the interpreter's tile (the loop runs several blocks)
CASES = [((7, 33), 1), ((7, 33), 0), ((3, 5, 17), 1), ((3, 5, 17), [1, 2]), ((3, 5, 17), [0, 1]),
         ((3, 5, 17), [2, 0, 1]), ((2, 1100), -1), ((4, 1), 1), ((1, 300), [0, 1])]


@dtype_params()
@pytest.mark.parametrize("shape,dim", CASES)
@pytest.mark.parametrize("keepdim", [False, True])
def test_forward(shape, dim, keepdim, dtype):
    check_op(torch.logsumexp, (make(shape, dtype), dim, keepdim), dtype=dtype, served_ops=["logsumexp"])


@dtype_params()
def test_layouts(dtype):
    for _, x in layouts((6, 19), dtype):
        check_op(torch.logsumexp, (x, -1), dtype=dtype, served_ops=["logsumexp"])
        check_op(torch.logsumexp, (x, 0), dtype=dtype, served_ops=["logsumexp"])


def test_one_launch(monkeypatch):
    names = count_launches(monkeypatch)
    x = make((4, 700))
    with gems.use_gems():
        torch.logsumexp(x, 1)
    assert names == ["logsumexp_kernel"], names


def test_special_values_and_edges():
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([[inf, 1.0, 2.0], [-inf, -inf, -inf], [nan, inf, 0.0], [-inf, 2.0, -inf],
                      [inf, inf, 3.0], [-inf, inf, 1.0]], device=DEVICE)
    check_op(torch.logsumexp, (x, 1), dtype=torch.float32, served_ops=["logsumexp"])
    # large values: the shift keeps exp finite
    check_op(torch.logsumexp, (make((3, 50)) * 1000, 1), dtype=torch.float32)
    x2 = make((2, 1100))
    x2[0, :700] = -inf   # a -inf prefix crossing a block
    x2[1, 900:] = inf    # +inf after finite blocks
    check_op(torch.logsumexp, (x2, 1), dtype=torch.float32, served_ops=["logsumexp"])
    # 0-dim, an empty reduced dim (-inf, as ATen), an empty kept dim
    check_op(torch.logsumexp, (make((), torch.float32), 0), dtype=torch.float32)
    check_op(torch.logsumexp, (make((), torch.float32), []), dtype=torch.float32)
    with gems.use_gems():
        e = torch.logsumexp(make((2, 0)), 1)
        z = torch.logsumexp(make((0, 3)), 1)
    assert e.shape == (2,) and bool((e == -inf).all())
    assert z.shape == (0,)


@dtype_params()
def test_rows_of_large_negative_values(dtype):
    # a row whose maximum is below -88: the running sum is rescaled from its initial shift 0 by
    # exp(0 - max), which overflows fp32 (found by the differential fuzz: NaN where ATen gives -115.17)
    x = torch.tensor([[-115.17, -238.64], [1.0, 2.0], [-300.0, -300.0]], device=DEVICE).to(dtype)
    check_op(torch.logsumexp, (x, 1), dtype=dtype, served_ops=["logsumexp"])
    check_op(torch.logsumexp, (make((3, 1100), dtype) - 200, 1), dtype=dtype, served_ops=["logsumexp"])


@dtype_params()
def test_backward(dtype):
    check_grad(lambda x: torch.logsumexp(x, -1), [make((5, 37), dtype)], dtype=dtype, served_ops=["logsumexp"])
    check_grad(lambda x: torch.logsumexp(x, [0, 2], keepdim=True), [make((3, 4, 6), dtype)], dtype=dtype)


def test_out_and_fallbacks():
    x = make((4, 9))
    with gems.use_gems():
        out = torch.full((4,), float("nan"), device=DEVICE)
        torch.logsumexp(x, 1, out=out)
    torch.testing.assert_close(out.double(), torch.logsumexp(x.double(), 1))
    # integer inputs and non-adjacent dims: ATen's composite (counted), same answers as with Gems off
    ints = torch.arange(6, device=DEVICE).view(2, 3)
    y = make((3, 4, 5))
    gems.reset_stats()
    with gems.use_gems():
        i = torch.logsumexp(ints, 1)
        n = torch.logsumexp(y, [0, 2])
    torch.testing.assert_close(i, torch.logsumexp(ints, 1))
    torch.testing.assert_close(n, torch.logsumexp(y, [0, 2]))
    st = gems.stats()["logsumexp.default"]
    assert st["fallback"] == 2 and "dims not adjacent" in st["reasons"], st


def test_rejects_like_aten():
    x = make((2, 3))
    raises_like_aten([lambda: torch.logsumexp(x, 2), lambda: torch.logsumexp(x, [0, 0]),
                      lambda: torch.logsumexp(x, [])])


def test_row_blocks_past_32_bit_offsets_go_to_aten():
    # softmax's geometry check: N x K >= 2**31 elements in one row block would wrap the kernel's 32-bit
    # offsets, so such calls go to ATen (the tensors are too large to allocate here)
    from gems.ops.reduce import logsumexp as L
    from gems.registry import Unsupported
    with pytest.raises(Unsupported):
        L._geometry((70000, 32000), (0,))
    assert L._geometry((7, 33), (1,))[:3] == (7, 33, 1)
