"""argmax / argmin (gems/ops/reduce/argmax.py) against ATen: indices are exact, so results must be equal,
including ties (the first index wins), NaN (the first NaN wins for both), +-inf rows, -0.0 vs 0.0;
every dim and layout, dim=None over non-contiguous inputs (logical order), keepdim, 0-dim and
empty inputs, the split path of long rows (partial winners, second stage), out=, errors, plans."""
import pytest
import torch

import gems
from harness import DEVICE, DTYPES, FLOAT_IDS, layouts, make, served, raises_like_aten

A = torch.ops.aten
INT_DT = [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8]
ALL_DT = DTYPES + INT_DT
DT_IDS = lambda d: FLOAT_IDS.get(d, str(d).replace("torch.", ""))   # noqa: E731
OPS = {"argmax": torch.argmax, "argmin": torch.argmin}


def ties(shape, dtype, seed=0):
    """Few distinct values, so ties are everywhere (the first index must win)."""
    g = torch.Generator().manual_seed(seed)
    lo = 0 if dtype == torch.uint8 else -2
    return torch.randint(lo, 3, shape, generator=g).to(dtype).to(DEVICE)


def _check(name, x, *args, **kw):
    want = OPS[name](x, *args, **kw)
    with served(f"{name}.default"), gems.use_gems():
        got = OPS[name](x, *args, **kw)
    assert got.dtype == torch.int64 and got.shape == want.shape, (got.shape, want.shape)
    assert torch.equal(got.cpu(), want.cpu()), f"{name}{args}{kw} on {tuple(x.shape)} {x.dtype}: {got} vs {want}"


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", ALL_DT, ids=DT_IDS)
def test_dims_and_ties(name, dtype):
    x = ties((4, 37, 5), dtype)
    for dim in (0, 1, 2, -1, -3, None):
        _check(name, x, dim)
        _check(name, x, dim, keepdim=True)
    # distinct random values too (no ties): the result is the unique extremum
    if dtype.is_floating_point:
        _check(name, make((6, 45), dtype), 1)
        _check(name, make((6, 45), dtype))


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_special_values(name, dtype):
    nan, inf = float("nan"), float("inf")
    rows = [[1.0, nan, 3.0, nan], [-inf, -inf, -inf, -inf], [inf, inf, 2.0, inf], [0.0, -0.0, 0.0, -0.0],
            [-0.0, 0.0, -1.0, 1.0], [nan, nan, nan, nan], [2.0, 2.0, nan, -inf]]
    x = torch.tensor(rows, dtype=dtype, device=DEVICE)
    _check(name, x, 1)
    _check(name, x, 0)
    _check(name, x)
    _check(name, x[1:3])   # no NaN: +-inf decide
    # the largest / smallest finite values of the dtype
    info = torch.finfo(dtype)
    _check(name, torch.tensor([info.min, info.max, info.max, info.min], dtype=dtype, device=DEVICE))


@pytest.mark.parametrize("dtype", INT_DT, ids=DT_IDS)
def test_integer_extremes(dtype):
    info = torch.iinfo(dtype)
    x = torch.tensor([[info.max, info.min, info.max, 0], [info.min, info.min, 1, info.min]], dtype=dtype,
                     device=DEVICE)
    for name in OPS:
        _check(name, x, 1)
        _check(name, x)


@pytest.mark.parametrize("name", OPS)
def test_layouts(name):
    for lname, x in layouts((9, 70)):
        _check(name, x, 0)
        _check(name, x, 1)
        _check(name, x)            # dim=None: the flat index follows the logical order
    x = ties((3, 4, 5, 6), torch.float32).permute(2, 0, 3, 1)   # kept dims that do not merge: a copy
    for dim in (0, 1, 2, 3, None):
        _check(name, x, dim)
    # a step slice is one stride group: no copy needed for dim=None
    _check(name, make((50,))[::3])
    _check(name, ties((40, 1, 6), torch.float32)[:, :, 1:], 0)


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int32], ids=DT_IDS)
def test_long_rows_split(name, dtype):
    # few outputs and long rows: R is split across programs (partial winners + a second launch);
    # the extremum sits in a late chunk, with an equal value in an earlier one for fp32
    n = 5000
    x = ties((n,), dtype)
    x[3100] = 100
    x[4999] = 100
    x[100] = -100
    x[2000] = -100
    _check(name, x)
    _check(name, x, 0)
    _check(name, x.reshape(2, n // 2), 1)
    _check(name, x.reshape(n // 2, 2), 0)     # K > 1 kernel, split too
    if dtype.is_floating_point:
        x[4000] = float("nan")
        _check(name, x)
        _check(name, x.reshape(2, n // 2), 1)
    # the decode step's pattern: argmax over the last logits [batch, vocab]
    _check(name, make((1, 3001), dtype) if dtype.is_floating_point else ties((1, 3001), dtype), -1)


def test_zero_dim_and_empty():
    t = torch.tensor(3.5, device=DEVICE)
    for name in OPS:
        _check(name, t)
        _check(name, t, 0)
        _check(name, t, -1, keepdim=True)
        _check(name, make((1, 1, 1)))
        _check(name, make((0, 4)), 1)
        _check(name, make((0, 4)), 1, keepdim=True)
        _check(name, make((2, 0, 3)), 2)


@pytest.mark.parametrize("name", OPS)
def test_errors_like_aten(name):
    cases = [lambda: OPS[name](make((0, 3))),                  # no dim on an empty input
             lambda: OPS[name](make((2, 0)), 1),               # an empty reduced dim
             lambda: OPS[name](make((2, 3)), 2),               # dim out of range
             lambda: OPS[name](torch.tensor(1.0, device=DEVICE), 1),
             lambda: OPS[name](torch.ones(3, dtype=torch.bool, device=DEVICE)),       # bool: ATen raises
             lambda: getattr(A, name).out(make((2, 3)), 1, out=torch.empty(2, dtype=torch.int32, device=DEVICE))]
    raises_like_aten(cases)


def test_out_variant():
    x = ties((5, 9), torch.float32)
    for name in OPS:
        op = getattr(A, name).out
        want = op(x, 1, True, out=torch.empty(0, dtype=torch.int64, device=DEVICE))
        out = torch.empty(0, dtype=torch.int64, device=DEVICE)
        with served(f"{name}.out"), gems.use_gems():
            got = op(x, 1, True, out=out)
        assert got is out and torch.equal(out.cpu(), want.cpu())
        out = torch.full((5,), -7, dtype=torch.int64, device=DEVICE)
        with served(f"{name}.out"), gems.use_gems():
            op(x, None, False, out=out[:0])
        with pytest.warns(UserWarning, match="resized"), served(f"{name}.out"), gems.use_gems():
            op(x, 0, False, out=out)              # a wrong shape is resized like ATen, with its warning
        assert torch.equal(out.cpu(), getattr(torch, name)(x, 0).cpu())


def test_fallbacks_counted():
    gems.reset_stats()
    with gems.use_gems():
        torch.argmax(make((3, 4), dtype=torch.float64), 1)
    assert gems.stats()["argmax.default"]["fallback"] == 1


def test_repeat_calls_use_a_plan():
    # the wrapper only allocates and launches: a signature's second call replays a plan
    empty_info = {"plans": 0, "no_plan": 0}
    before = gems.dispatch.plan_stats().get("argmax.default", empty_info)
    for _ in range(3):
        _check("argmax", make((4, 33)), 1)
    info = gems.dispatch.plan_stats()["argmax.default"]
    assert info["plans"] == before["plans"] + 1 and info["no_plan"] == before["no_plan"], (before, info)
