"""cumsum / cumsum.out / cumsum_ (gems/ops/reduce/cumsum.py) against ATen: result dtypes (integer and bool
inputs to int64, dtype=, out='s dtype), values against float64 (fp16 accumulates in fp32: rounded
once per output; integer sums exact, narrower results wrap like ATen's), every dim and layout, rows
longer than one block (the carry loop), 0-dim, empty, in-place on views, out= resizing, errors,
fallbacks, plans."""
import pytest
import torch

import gems
from harness import DEVICE, FLOAT_IDS, assert_close, dtype_params, layouts, make, raises_like_aten, served

A = torch.ops.aten
INT_DT = [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]
DT_IDS = lambda d: FLOAT_IDS.get(d, str(d).replace("torch.", ""))   # noqa: E731


def _close(got, x, dim, dtype=None):
    """got vs the float64 prefix sums of x (converted to the result dtype first, as ATen does).

    fp32: a blocked scan adds up to log2(block) + rows/block partial sums per output, so the bound is
    relative to the prefix sums of |x| (cancellation makes the result itself a poor scale)."""
    want_dt = dtype or (x.dtype if x.dtype.is_floating_point else torch.int64)
    assert got.dtype == want_dt, (got.dtype, want_dt)
    xr = x.to(got.dtype).cpu()
    if not got.dtype.is_floating_point:
        want = torch.cumsum(xr, dim, dtype=got.dtype)   # ATen's exact integer sums (wrapping alike)
        assert torch.equal(got.cpu(), want), f"integer cumsum differs on {tuple(x.shape)} dim {dim}"
        return
    ref = torch.cumsum(xr.double(), dim)
    if got.dtype == torch.float32:
        scale = torch.cumsum(xr.double().abs(), dim)
        err = (got.cpu().double() - ref).abs()
        bound = 2e-6 * scale + 1e-6
        assert (err <= bound).all(), f"fp32 cumsum off by {err.max().item():.3e} (bound {bound.max().item():.3e})"
    else:
        aten = torch.cumsum(x.to(got.dtype), dim)
        assert_close(got, ref, got.dtype, aten, msg="cumsum")


def _run(x, dim, **kw):
    with served("cumsum.default"), gems.use_gems():
        return torch.cumsum(x, dim, **kw)


@dtype_params()
def test_floats_every_dim(dtype):
    x = make((3, 150, 5), dtype)
    for dim in (0, 1, 2, -1, -2):
        _close(_run(x, dim), x, dim)
    # long rows: many blocks per row (the carry), K == 1 and K > 1
    y = make((2, 700), dtype)
    _close(_run(y, 1), y, 1)
    _close(_run(y.t().contiguous(), 0), y.t(), 0)


@pytest.mark.parametrize("dtype", INT_DT, ids=DT_IDS)
def test_integer_and_bool_inputs(dtype):
    lo = 0 if dtype in (torch.uint8, torch.bool) else -100
    x = torch.randint(lo, 100, (4, 90, 3)).to(dtype).to(DEVICE)
    for dim in (0, 1, -1):
        got = _run(x, dim)
        assert got.dtype == torch.int64
        _close(got, x, dim)
    # the dtype's extremes: int64 sums of many int8 max values do not wrap; int64 wraps like ATen
    if dtype != torch.bool:
        info = torch.iinfo(dtype)
        big = torch.full((300,), info.max, dtype=dtype, device=DEVICE)
        _close(_run(big, 0), big, 0)
        # dtype= narrower than int64: the sums wrap in that dtype, as ATen's do
        _close(_run(big, 0, dtype=dtype), big, 0, dtype)


def test_dtype_argument():
    x = make((5, 70), torch.float16)
    _close(_run(x, 1, dtype=torch.float32), x, 1, torch.float32)    # fp16 read, fp32 sums
    y = make((5, 70), torch.float32)
    _close(_run(y, 1, dtype=torch.float16), y, 1, torch.float16)    # converted to fp16 first
    i = torch.randint(-50, 50, (4, 66), dtype=torch.int32, device=DEVICE)
    _close(_run(i, 1, dtype=torch.float32), i, 1, torch.float32)
    _close(_run(i, 1, dtype=torch.float16), i, 1, torch.float16)
    _close(_run(i, 0, dtype=torch.int16), i, 0, torch.int16)
    _close(_run(i > 0, 1, dtype=torch.int32), i > 0, 1, torch.int32)


def test_layouts():
    for name, x in layouts((7, 80)):
        for dim in (0, 1):
            _close(_run(x, dim), x, dim)
    x = make((3, 4, 5, 6)).permute(0, 2, 1, 3)     # dims around the scanned one that do not merge: a copy
    for dim in range(4):
        _close(_run(x, dim), x, dim)


def test_zero_dim_and_empty():
    for t in (torch.tensor(2.5, device=DEVICE), torch.tensor(7, device=DEVICE), torch.tensor(True, device=DEVICE)):
        for dim in (0, -1):
            got = _run(t, dim)
            want = torch.cumsum(t, dim)
            assert got.shape == want.shape and got.dtype == want.dtype and torch.equal(got.cpu(), want.cpu())
    for shape, dim in (((0, 3), 1), ((0, 3), 0), ((4, 0), 1)):
        e = make(shape)
        got = _run(e, dim)
        assert got.shape == e.shape and got.dtype == e.dtype


@dtype_params()
def test_inplace(dtype):
    base = make((6, 130), dtype)
    for view in (lambda t: t, lambda t: t.t(), lambda t: t[:, ::2], lambda t: t[1:4]):
        for dim in (0, -1):
            want = view(base.clone()).cumsum_(dim)
            ref = view(base.double()).cumsum_(dim)
            y = base.clone()
            v = view(y)
            with served("cumsum_.default"), gems.use_gems():
                r = v.cumsum_(dim)
            assert r is v
            # vs float64, within the dtype's tolerance or 2x ATen's own error (ATen's CUDA scan adds in
            # another order than a sequential one: at fp16/bf16 the two differ by an ulp here and there)
            assert_close(v, ref, dtype, want)
            # elements outside the view are untouched
            mask = torch.ones_like(y, dtype=torch.bool)
            view(mask).fill_(False)
            assert torch.equal(y[mask].cpu(), base[mask].cpu())
    i = torch.randint(-9, 9, (3, 40), dtype=torch.int32, device=DEVICE)
    want = i.clone().cumsum_(1)
    with served("cumsum_.default"), gems.use_gems():
        i.cumsum_(1)
    assert i.dtype == torch.int32 and torch.equal(i.cpu(), want.cpu())


def test_out_variant():
    x = torch.randint(-9, 9, (4, 50), dtype=torch.int32, device=DEVICE)
    for out_dtype in (torch.int64, torch.int32, torch.float32):
        want = torch.cumsum(x, 1, out=torch.empty(0, dtype=out_dtype, device=DEVICE))
        out = torch.empty(0, dtype=out_dtype, device=DEVICE)
        with served("cumsum.out"), gems.use_gems():
            got = torch.cumsum(x, 1, out=out)
        assert got is out and out.dtype == out_dtype and torch.equal(out.cpu(), want.cpu())
    out = torch.empty(3, device=DEVICE)
    y = make((4, 50))
    with pytest.warns(UserWarning, match="resized"), served("cumsum.out"), gems.use_gems():
        torch.cumsum(y, 0, out=out)
    _close(out, y, 0)
    # a transposed out of the right shape is written through its strides
    out = torch.empty(50, 4, device=DEVICE).t()
    with served("cumsum.out"), gems.use_gems():
        torch.cumsum(y, 1, out=out)
    _close(out, y, 1)


def test_errors_like_aten():
    f32 = make((3, 4))
    cases = [lambda: torch.cumsum(f32, 2),                                              # dim out of range
             lambda: torch.cumsum(torch.tensor(1.0, device=DEVICE), 1),
             lambda: f32.clone().cumsum_(0, dtype=torch.float16),                      # in-place dtype change
             lambda: torch.tensor([1, 2], dtype=torch.int8, device=DEVICE).cumsum_(0, dtype=torch.int64),
             lambda: torch.cumsum(f32, 0, dtype=torch.int64, out=torch.empty(3, 4, dtype=torch.int32,
                                                                              device=DEVICE)),
             lambda: torch.ones(3, dtype=torch.bool, device=DEVICE).cumsum_(0)]       # no bool kernel
    raises_like_aten(cases)


def test_fallbacks_counted():
    gems.reset_stats()
    x = make((3, 5))
    with gems.use_gems():
        a = torch.cumsum(x, 1, dtype=torch.int64)       # a float input summed as integers: ATen
        b = torch.cumsum(x.double(), 1)                 # float64: ATen
    assert torch.equal(a, torch.cumsum(x, 1, dtype=torch.int64)) and b.dtype == torch.float64
    assert gems.stats()["cumsum.default"]["fallback"] == 2


def test_repeat_calls_use_a_plan():
    empty_info = {"plans": 0, "no_plan": 0}
    before = gems.dispatch.plan_stats().get("cumsum.default", empty_info)
    for _ in range(3):
        x = make((2, 77))
        _close(_run(x, -1), x, -1)
    info = gems.dispatch.plan_stats()["cumsum.default"]
    assert info["plans"] == before["plans"] + 1 and info["no_plan"] == before["no_plan"], (before, info)
