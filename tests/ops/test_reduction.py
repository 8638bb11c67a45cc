import pytest
import torch

import gems
from gems.ops.reduce import reduction
from harness import DEVICE, check_grad, check_op, dtype_params, layouts, make, served

# odd sizes; on the interpreter tiles are <= 128 wide, so 300 and 1100 go through the loops and
# through the two-stage split (few programs, long R)
SHAPES = [(7, 33), (3, 5, 17), (1100,), (2, 300)]
OPS = {"sum": (torch.sum, "sum.dim_IntList"), "mean": (torch.mean, "mean.dim"), "amax": (torch.amax, "amax")}


def _check(fn, args, kwargs=None, *, dtype, served_ops):
    """check_op with an absolute tolerance for fp32 sums that grows with the number of terms
    (ATen's own fp32 rounding error grows the same way; a lost element is off by ~1, far above it)."""
    atol = None
    if fn is torch.sum and dtype == torch.float32:
        with torch.no_grad():
            terms = args[0].numel() // max(fn(*args, **(kwargs or {})).numel(), 1)
        atol = 1e-5 * max(1.0, terms / 64)
    return check_op(fn, args, kwargs, dtype=dtype, served_ops=served_ops, atol=atol)


def _dim_lists(nd):
    lists = [[d] for d in range(nd)] + [[-1]]
    if nd >= 2:
        lists += [[0, nd - 1], list(range(nd))]
    if nd >= 3:
        lists += [[0, 1], [-1, 1]]
    return lists


@dtype_params()
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("op", list(OPS))
def test_dims(shape, dtype, op):
    fn, name = OPS[op]
    for dims in _dim_lists(len(shape)):
        for keepdim in (False, True):
            _check(fn, (make(shape, dtype), dims), {"keepdim": keepdim}, dtype=dtype, served_ops=[name])


@dtype_params()
@pytest.mark.parametrize("op", list(OPS))
def test_all_elements(dtype, op):
    fn, name = OPS[op]
    full = {"sum": "sum.default", "mean": "mean.default", "amax": "amax"}[op]
    for shape in [(7, 33), (3000,), (4, 5, 6)]:
        _check(fn, (make(shape, dtype),), dtype=dtype, served_ops=[full])
    # 0-dim input: dim 0 / -1 are valid, the result is 0-dim
    _check(fn, (make((), dtype), 0), dtype=dtype, served_ops=[name])
    _check(fn, (make((), dtype), [-1]), {"keepdim": True}, dtype=dtype, served_ops=[name])
    _check(fn, (make((), dtype),), dtype=dtype, served_ops=[full])


@dtype_params()
@pytest.mark.parametrize("op", list(OPS))
def test_layouts(dtype, op):
    fn, name = OPS[op]
    for shape in [(6, 19), (4, 5, 6)]:
        for lname, x in layouts(shape, dtype):
            for dims in _dim_lists(len(shape)):
                _check(fn, (x, dims), dtype=dtype, served_ops=[name])


@dtype_params()
def test_permuted_and_split_paths(dtype):
    x = make((4, 5, 6, 7), dtype)
    p = x.permute(2, 0, 3, 1)              # reduced dims merge through strides, no copy
    for dims in ([1, 3], [0, 2], [1, 2], [0, 1, 3]):
        _check(torch.sum, (p, dims), dtype=dtype, served_ops=["sum.dim_IntList"])
        _check(torch.amax, (p, dims), dtype=dtype, served_ops=["amax"])
    # reduced dims apart in a contiguous tensor: two passes through an fp32 intermediate
    for dims in ([0, 2], [1, 3], [0, 3], [0, 2, 3]):
        _check(torch.mean, (x, dims), dtype=dtype, served_ops=["mean.dim"])
    # mean over dim 0 of a tall matrix: coalesced [R, K] tiles with R split across programs
    _check(torch.mean, (make((700, 40), dtype), 0), dtype=dtype, served_ops=["mean.dim"])
    _check(torch.sum, (make((900, 3), dtype), 0), dtype=dtype, served_ops=["sum.dim_IntList"])
    # long rows, few of them: split of the inner reduction
    _check(torch.sum, (make((3, 2000), dtype), 1), dtype=dtype, served_ops=["sum.dim_IntList"])
    # a stride-0 reduced dim (expanded) and a stride-0 kept dim
    _check(torch.sum, (make((1, 9), dtype).expand(500, 9), 0), dtype=dtype, served_ops=["sum.dim_IntList"])
    _check(torch.sum, (make((9, 1), dtype).expand(9, 500), 0), dtype=dtype, served_ops=["sum.dim_IntList"])


@pytest.fixture
def int64_offsets(monkeypatch):
    """Lower the int64-offset threshold to 0 (schedules are cached: clear them on both sides)."""
    def clear():
        reduction._schedule.cache_clear()
        reduction._RECIPES.clear()
    clear()
    monkeypatch.setattr(reduction, "_INT64_FROM", 0)
    yield
    monkeypatch.undo()
    clear()


def test_int64_offsets_path(int64_offsets):
    # the GPU switches to int64 offsets past 2**31 elements; run that code path on small inputs
    x = make((50, 70))
    for fn, name in OPS.values():
        _check(fn, (x, 0), dtype=torch.float32, served_ops=[name])
        _check(fn, (x.t(), [1]), dtype=torch.float32, served_ops=[name])
    _check(torch.sum, (make((2500,)),), dtype=torch.float32, served_ops=["sum.default"])


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.int64, torch.uint8, torch.bool], ids=str)
def test_integer_sum_and_amax(dtype):
    x = make((37, 41), dtype, low=0 if dtype == torch.uint8 else -50, high=50)
    for args in [(x,), (x, 0), (x, [1], True), (x.t(), [0, 1])]:
        with served("sum.dim_IntList" if len(args) > 1 else "sum.default"), gems.use_gems():
            got = torch.sum(*args)
        want = torch.sum(*args)
        assert got.dtype == want.dtype == torch.int64 and torch.equal(got, want)
    if dtype != torch.bool:
        for dims in (0, 1, [0, 1]):
            with served("amax"), gems.use_gems():
                got = torch.amax(x, dims)
            want = torch.amax(x, dims)
            assert got.dtype == want.dtype and torch.equal(got, want)
    # int64 accumulation: sums past the int32 range are exact
    big = torch.full((3000,), 2 ** 30, dtype=torch.int64, device=DEVICE)
    with served("sum.default"), gems.use_gems():
        assert int(torch.sum(big)) == 3000 * 2 ** 30


def test_amax_nan_and_inf():
    x = make((6, 300))
    x[1, 5] = float("nan")
    x[2, 299] = float("nan")
    x[3] = float("-inf")
    x[4, 7] = float("inf")
    for dims in (0, 1, [0, 1]):
        _check(torch.amax, (x, dims), dtype=torch.float32, served_ops=["amax"])
    _check(torch.sum, (x, 1), dtype=torch.float32, served_ops=["sum.dim_IntList"])


@dtype_params()
def test_dtype_kwarg(dtype):
    x = make((9, 130), dtype)
    for fn, name, out_dtype in [(torch.sum, "sum.dim_IntList", torch.float32),
                                (torch.sum, "sum.dim_IntList", torch.float64),
                                (torch.mean, "mean.dim", torch.float32),
                                (torch.mean, "mean.dim", torch.float64)]:
        with served(name), gems.use_gems():
            got = fn(x, 1, dtype=out_dtype)
        want = fn(x.double(), 1).to(out_dtype)
        assert got.dtype == out_dtype
        torch.testing.assert_close(got, want, rtol=1e-9 if out_dtype == torch.float64 else 1e-5,
                                   atol=1e-9 if out_dtype == torch.float64 else 1e-4)
    with served("sum.default"), gems.use_gems():
        got = torch.sum(x, dtype=torch.float32)
    torch.testing.assert_close(got.double(), x.double().sum(), rtol=1e-5, atol=1e-3)
    ints = make((5, 7), torch.int32)
    with served("sum.dim_IntList"), gems.use_gems():
        got = torch.sum(ints, 1, dtype=torch.float32)
    assert got.dtype == torch.float32 and torch.equal(got, ints.sum(1).float())


def test_narrower_dtype_kwarg_casts_first():
    """sum(x, dtype=d) reads x cast to d (ATen's TensorIterator), then accumulates in fp32: in fp16,
    [2049, 1, 1] is 2048 + 1 + 1 = 2050 (not 2051 rounded to 2052), and 7e4 is inf, so [7e4, -7e4]
    sums to NaN (not 0). mean follows ATen's device: CUDA's reads the cast input, the CPU's sums the
    input as it is in fp32."""
    f16 = torch.float16
    ints, big = torch.tensor([2049, 1, 1], device=DEVICE), torch.tensor([7e4, -7e4], device=DEVICE)
    with served("sum.default"), gems.use_gems():
        a, b = torch.sum(ints, dtype=f16), torch.sum(big, dtype=f16)
    assert a.item() == 2050 and a.dtype == f16 and torch.isnan(b)
    with served("sum.dim_IntList"), gems.use_gems():
        c, d = torch.sum(ints[None], 1, dtype=f16), torch.sum(big[None], -1, keepdim=True, dtype=f16)
    assert c.tolist() == [2050] and torch.isnan(d).all() and d.shape == (1, 1)
    with served("sum.IntList_out"), gems.use_gems():
        o = torch.sum(ints[None], 1, dtype=f16, out=torch.empty(1, dtype=f16, device=DEVICE))
    assert o.tolist() == [2050]
    # many elements that each round in fp16: the reference is the float64 sum of the rounded input
    x = make((9, 130), low=500, high=3000)
    with served("sum.dim_IntList"), gems.use_gems():
        got = torch.sum(x, 1, dtype=f16)
    want = x.to(f16).double().sum(1).to(f16)
    assert torch.equal(got.cpu(), want.cpu())
    for t in (big, ints.float(), x):
        with served("mean.default"), gems.use_gems():
            m = torch.mean(t, dtype=f16)
        torch.testing.assert_close(m, torch.mean(t, dtype=f16), equal_nan=True, rtol=0, atol=0)


def test_empty():
    x = make((0, 5))
    with gems.use_gems():
        for dims, shape in [(0, (5,)), (1, (0,)), ([0, 1], ())]:
            s = torch.sum(x, dims)
            assert s.shape == shape and torch.equal(s, torch.zeros(shape, device=DEVICE))
            m = torch.mean(x, dims)
            assert m.shape == shape and (m.numel() == 0 or torch.isnan(m).all())
        assert torch.sum(x).item() == 0
        assert torch.amax(x, 1).shape == (0,)
        assert torch.sum(make((3, 0, 2)), 1, keepdim=True).shape == (3, 1, 2)
        with pytest.raises(IndexError):
            torch.amax(x, 0)
        with pytest.raises(RuntimeError):
            torch.amax(x)


def test_errors():
    x = make((4, 5))
    with gems.use_gems():
        for fn in (torch.sum, torch.mean, torch.amax):
            with pytest.raises(IndexError):
                fn(x, 2)
            with pytest.raises(IndexError):
                fn(x, [0, -3])
            with pytest.raises(RuntimeError):
                fn(x, [0, -2])
        with pytest.raises(RuntimeError):
            torch.mean(make((4, 5), torch.int32))
        with pytest.raises(RuntimeError):
            torch.mean(x, 1, dtype=torch.int64)


def test_out_variants():
    x = make((6, 11))
    with gems.use_gems():
        for fn, name, dims in [(torch.sum, "sum.IntList_out", [1]), (torch.mean, "mean.out", [0]),
                               (torch.amax, "amax.out", [1])]:
            want = fn(x.double(), dims)
            out = torch.full(tuple(want.shape), float("nan"), device=DEVICE)
            with served(name):
                r = fn(x, dims, out=out)
            assert r is out
            torch.testing.assert_close(out, want.float())
            wrong = torch.full((2, 2), float("nan"), device=DEVICE)
            with served(name), pytest.warns(UserWarning, match="resized"):
                fn(x, dims, out=wrong)
            assert wrong.shape == want.shape
            torch.testing.assert_close(wrong, want.float())
        out = torch.full((), float("nan"), device=DEVICE)
        with served("sum.out"):
            torch.ops.aten.sum.out(x, out=out)
        torch.testing.assert_close(out, x.double().sum().float())
        with served("mean.dtype_out"):
            torch.ops.aten.mean.dtype_out(x, out=out)
        torch.testing.assert_close(out, x.double().mean().float())
        # an out of another dtype is ATen's business (counted as a fallback), still right
        gems.reset_stats()
        out64 = torch.empty((6,), dtype=torch.float64, device=DEVICE)
        torch.sum(x, [1], out=out64)
        torch.testing.assert_close(out64, x.double().sum(1))
    assert gems.stats()["sum.IntList_out"]["fallback"] == 1


def test_fallback_float64_is_counted():
    gems.reset_stats()
    x = make((5, 7), torch.float64)
    with gems.use_gems():
        got = torch.sum(x, 1)
        got_m = torch.mean(x, 0)
    torch.testing.assert_close(got, x.sum(1))
    torch.testing.assert_close(got_m, x.mean(0))
    st = gems.stats()
    assert st["sum.dim_IntList"]["fallback"] == 1 and st["sum.dim_IntList"]["served"] == 0
    assert st["mean.dim"]["fallback"] == 1


@dtype_params()
def test_backward(dtype):
    x = make((5, 37), dtype)
    check_grad(lambda t: torch.sum(t, 1), [x], dtype=dtype, served_ops=["sum.dim_IntList"])
    check_grad(lambda t: torch.mean(t, 0, keepdim=True), [x], dtype=dtype, served_ops=["mean.dim"])
    # amax's backward spreads the gradient over ties with a sum (served by Gems too)
    xt = x.detach().clone()
    xt[1, 3] = xt[1].max()  # a tie
    check_grad(lambda t: torch.amax(t, 1), [xt], dtype=dtype, served_ops=["amax", "sum.dim_IntList"])

