import pytest
import torch

import gems
from harness import DEVICE, DTYPES, check_grad, check_op, dtype_params, layouts, make

OPS = {"tril": torch.tril, "triu": torch.triu}
SHAPES = [(5, 7), (7, 5), (1, 1), (3, 4, 6), (2, 3, 33, 17), (3, 1100)]   # 1100: a row longer than a GPU tile
DIAGONALS = [0, 1, -1, 3, -4, 16, -40, 2 ** 40, -(2 ** 40)]
EXACT = dict(rtol=0, atol=0)
OTHER_DTYPES = [torch.int8, torch.int16, torch.uint8, torch.int32, torch.int64, torch.bool, torch.float64]


def _apply(name):
    return lambda x, d: OPS[name](x, d)


@pytest.mark.parametrize("name", OPS)
@dtype_params()
@pytest.mark.parametrize("shape", SHAPES)
def test_forward(name, shape, dtype):
    x = make(shape, dtype)
    for d in DIAGONALS:
        out = check_op(OPS[name], (x, d), dtype=dtype, served_ops=[name], **EXACT)
        assert out.is_contiguous()


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", OTHER_DTYPES, ids=str)
def test_integer_bool_float64(name, dtype):
    x = make((3, 6, 9), dtype, low=0 if dtype == torch.uint8 else -100, high=100)
    for d in (0, 2, -3):
        check_op(OPS[name], (x, d), dtype=dtype, served_ops=[name], **EXACT)


@pytest.mark.parametrize("name", OPS)
def test_layouts_and_special_values(name):
    for label, x in layouts((2, 9, 13)):
        check_op(OPS[name], (x, 1), dtype=torch.float32, served_ops=[name], **EXACT)
    # batch dims that do not merge into one stride: read through a contiguous copy
    x = make((3, 2, 5, 6)).permute(1, 0, 2, 3)
    check_op(OPS[name], (x, -1), dtype=torch.float32, served_ops=[name], **EXACT)
    # NaN/inf/-0.0 inside the triangle survive; outside they become (+)0 like ATen
    x = make((6, 6))
    x[2, 1], x[1, 2], x[4, 4], x[0, 5], x[5, 0] = float("nan"), float("inf"), -0.0, float("nan"), float("-inf")
    with gems.use_gems():
        got = OPS[name](x)
    want = OPS[name](x)
    assert torch.equal(got.isnan(), want.isnan())
    same = ~want.isnan()
    assert torch.equal(got[same], want[same]) and torch.equal(got.signbit(), want.signbit())


@pytest.mark.parametrize("name", OPS)
def test_empty_and_rank_errors(name):
    for shape in [(0, 3), (3, 0), (2, 0, 4)]:
        check_op(OPS[name], (make(shape), 0), dtype=torch.float32, **EXACT)
    with gems.use_gems():
        for bad in (make((4,)), make(())):
            with pytest.raises(RuntimeError):
                OPS[name](bad)


@pytest.mark.parametrize("name", OPS)
def test_out_variant(name):
    x = make((3, 5, 7))
    want = OPS[name](x, 1)
    out = torch.full((3, 5, 7), float("nan"), device=DEVICE)
    with gems.use_gems():
        OPS[name](x, 1, out=out)
        assert torch.equal(out, want)
        wrong = torch.full((2,), float("nan"), device=DEVICE)
        with pytest.warns(UserWarning, match="resized"):
            OPS[name](x, 1, out=wrong)
        assert torch.equal(wrong, want)
        y = x.clone()
        OPS[name](y, 1, out=y)                      # out is self: the in-place path
        assert torch.equal(y, want)
    impl = gems.registry.get(f"{name}.out")
    before = gems.dispatch.op_runtime(impl.name).fell_back
    nc = torch.full((7, 5, 3), float("nan"), device=DEVICE).permute(2, 1, 0)
    with gems.use_gems():
        OPS[name](x, 1, out=nc)                     # a non-contiguous out: ATen writes it (counted)
    assert gems.dispatch.op_runtime(impl.name).fell_back == before + 1 and torch.equal(nc, want)


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", DTYPES + [torch.bool, torch.int32], ids=str)
def test_inplace(name, dtype):
    method = name + "_"
    views = [((5, 8), lambda t: t), ((8, 5), lambda t: t.t()), ((2, 3, 4, 12), lambda t: t[..., ::2]),
             ((3, 1100), lambda t: t)]
    for shape, view in views:
        base = make(shape, dtype)
        for d in (0, 2, -1):
            parent, ref_parent = base.clone(), base.clone()
            y = view(parent)
            getattr(view(ref_parent), method)(d)
            strides = y.stride()
            with gems.use_gems():
                ret = getattr(y, method)(d)
            # the view's own elements and nothing else in its storage
            assert ret is y and y.stride() == strides and torch.equal(parent, ref_parent)
    # inputs the kernel leaves to ATen (counted): an expanded self, batch dims that do not merge
    impl = gems.registry.get(method)
    before = gems.dispatch.op_runtime(impl.name).fell_back
    e = make((1, 4, 4), dtype).expand(3, 4, 4)
    p = make((3, 2, 4, 4), dtype).permute(1, 0, 2, 3)
    want_p = getattr(p.clone(), method)(1)
    with gems.use_gems():
        getattr(e, method)(1)
        getattr(p, method)(1)
    assert gems.dispatch.op_runtime(impl.name).fell_back == before + 2 and torch.equal(p, want_p)


@pytest.mark.parametrize("name", OPS)
@dtype_params()
def test_backward(name, dtype):
    # autograd's formula is tril/triu of the gradient: served again
    check_grad(lambda x: OPS[name](x, -1), [make((2, 6, 9), dtype)], dtype=dtype, served_ops=[name], **EXACT)


def test_causal_mask_call():
    # SDPA's math path: ones(L, S, dtype=bool).tril() per layer when is_causal=True
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with gems.use_gems():
        m = torch.ones(5, 9, dtype=torch.bool, device=DEVICE).tril()
    assert torch.equal(m, torch.ones(5, 9, dtype=torch.bool).tril().to(DEVICE))
    q, k, v = make((1, 2, 6, 8)), make((1, 2, 6, 8)), make((1, 2, 6, 8))
    with sdpa_kernel(SDPBackend.MATH):
        check_op(torch.nn.functional.scaled_dot_product_attention, (q, k, v), {"is_causal": True},
                 dtype=torch.float32, served_ops=["tril"])
