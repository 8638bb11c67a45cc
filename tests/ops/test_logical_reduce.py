"""all / any (every overload) and _is_all_true / _is_any_true (gems/ops/reduce/logical.py) against
ATen: exact bool (uint8 for uint8 input) results for every dtype, NaN and -0.0, any dims and layouts,
keepdim, empty inputs and empty reductions, 0-dim, the split path of full reductions, out=, errors,
plans."""
import pytest
import torch

import gems
from harness import DEVICE, DTYPES, FLOAT_IDS, ON_GPU, layouts, make, served

ALL_DT = DTYPES + [torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool]
DT_IDS = lambda d: FLOAT_IDS.get(d, str(d).replace("torch.", ""))   # noqa: E731


def sparse_zeros(shape, dtype, frac=0.3, seed=0):
    """Values with zeros sprinkled in, a fully nonzero row and a fully zero row (so all/any differ)."""
    g = torch.Generator().manual_seed(seed)
    x = make(shape, torch.float32, device="cpu")
    x = torch.where(torch.rand(shape, generator=g) < frac, torch.zeros_like(x), x)
    if len(shape) >= 2:
        x[0] = 1.0
        x[-1] = 0.0
    if dtype == torch.bool:
        x = x != 0
    elif dtype == torch.uint8:
        x = x.abs().ceil()
    return x.to(dtype).to(DEVICE)


def _same(got, want, msg):
    assert got.dtype == want.dtype, f"{msg}: dtype {got.dtype} vs {want.dtype}"
    assert got.shape == want.shape, f"{msg}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    assert torch.equal(got.cpu(), want.cpu()), f"{msg}: values differ"


CALLS = [
    ("all.default", lambda x: torch.all(x)),
    ("any.default", lambda x: torch.any(x)),
    ("all.dim", lambda x: torch.all(x, 1)),
    ("any.dim", lambda x: torch.any(x, -1, keepdim=True)),
    ("all.dims", lambda x: torch.all(x, (0, 2))),
    ("any.dims", lambda x: torch.any(x, (0, 2), keepdim=True)),
    ("all.dims", lambda x: torch.ops.aten.all.dims(x, None)),
    ("any.dims", lambda x: torch.ops.aten.any.dims(x, [])),      # no dims: elementwise x != 0
    ("all.dim", lambda x: torch.all(x, 0)),
    ("any.dims", lambda x: torch.any(x, (2, 1))),
]


def _check(name, fn, x):
    want = fn(x)
    with served(name), gems.use_gems():
        got = fn(x)
    _same(got, want, f"{name} on {tuple(x.shape)} {x.dtype}")


@pytest.mark.parametrize("dtype", ALL_DT, ids=DT_IDS)
def test_overloads_and_dtypes(dtype):
    x = sparse_zeros((4, 5, 6), dtype)
    for name, fn in CALLS:
        _check(name, fn, x)


def test_special_values():
    x = torch.tensor([[float("nan"), 1.0], [-0.0, 0.0], [float("inf"), -0.0], [float("-inf"), 2.0]], device=DEVICE)
    for name, fn in [("all.dim", lambda t: torch.all(t, 1)), ("any.dim", lambda t: torch.any(t, 1)),
                     ("all.default", torch.all), ("any.default", torch.any)]:
        _check(name, fn, x)
        _check(name, fn, x.half())
    _check("all.default", torch.all, torch.tensor([float("nan")], device=DEVICE))
    _check("any.default", torch.any, torch.tensor([-0.0, 0.0], device=DEVICE))
    i = torch.tensor([[torch.iinfo(torch.int64).min, 0], [1, -1]], device=DEVICE)
    _check("all.dim", lambda t: torch.all(t, 0), i)


def test_layouts():
    for name, x in layouts((6, 9)):
        x = torch.where(x.abs() < 1.0, torch.zeros_like(x), x)
        for call, fn in [("all.dim", lambda t: torch.all(t, 0)), ("any.dim", lambda t: torch.any(t, 1)),
                         ("all.default", torch.all), ("any.dims", lambda t: torch.any(t, []))]:
            _check(call, fn, x)
    # reduced dims apart in a permuted tensor (contiguous copy / two passes)
    x = sparse_zeros((3, 4, 5, 2), torch.float32).permute(2, 0, 3, 1)
    _check("any.dims", lambda t: torch.any(t, (0, 2)), x)
    _check("all.dims", lambda t: torch.all(t, (1, 3), keepdim=True), x)


def test_edges():
    # 0-dim
    for v in (0.0, 2.0, float("nan")):
        t = torch.tensor(v, device=DEVICE)
        _check("all.default", torch.all, t)
        _check("any.dim", lambda x: torch.any(x, 0), t)
        _check("all.dims", lambda x: torch.all(x, [-1], keepdim=True), t)
    # empty input: the identity over empty reductions, nothing over empty results
    e = make((2, 0, 3))
    _check("all.dim", lambda x: torch.all(x, 1), e)
    _check("any.dim", lambda x: torch.any(x, 1), e)
    _check("all.default", torch.all, e)
    _check("any.default", torch.any, e)
    with gems.use_gems():
        assert torch.all(e, 0).shape == (0, 3)
    # long rows: the split path (partial flags, then a second launch), a single zero / nonzero
    for n in (3000, 20000):
        x = torch.ones(n, device=DEVICE)
        x[n // 3] = 0
        _check("all.default", torch.all, x)
        _check("any.default", torch.any, x - 1)
        z = torch.zeros(n, device=DEVICE)
        z[-1] = 5
        _check("any.default", torch.any, z)
        _check("all.dim", lambda t: torch.all(t, 0), z + 1)
        _check("any.dim", lambda t: torch.any(t, 0), z.reshape(-1, 4))


def test_is_all_true_is_any_true():
    for x in (torch.tensor([True, True], device=DEVICE), torch.tensor([True, False], device=DEVICE),
              torch.zeros(0, dtype=torch.bool, device=DEVICE), torch.tensor(False, device=DEVICE),
              sparse_zeros((7, 3), torch.bool)):
        _check("_is_all_true", torch.ops.aten._is_all_true, x)
        _check("_is_any_true", torch.ops.aten._is_any_true, x)
    with gems.use_gems():
        with pytest.raises(RuntimeError):
            torch.ops.aten._is_all_true(make((3,)))


def test_out_variants():
    x = sparse_zeros((4, 5, 6), torch.float32)
    with gems.use_gems():
        for name, call, want in [
            ("all.out", lambda o: torch.all(x, 1, out=o), torch.all(x, 1)),
            ("any.dims_out", lambda o: torch.any(x, (0, 2), out=o), torch.any(x, (0, 2))),
            ("all.all_out", lambda o: torch.ops.aten.all.all_out(x, out=o), torch.all(x)),
            ("any.all_out", lambda o: torch.ops.aten.any.all_out(x, out=o), torch.any(x)),
        ]:
            o = torch.empty(want.shape, dtype=torch.bool, device=DEVICE)
            with served(name):
                r = call(o)
            assert r is o
            _same(o, want, name)
            o8 = torch.full(want.shape, 7, dtype=torch.uint8, device=DEVICE)   # uint8 out: 0/1
            if ON_GPU:   # (on the CPU ATen converts a float self to uint8 first: ATen's, below)
                with served(name):
                    call(o8)
                _same(o8, want.to(torch.uint8), name + " uint8")
        wrong = torch.empty(2, dtype=torch.bool, device=DEVICE)
        with served("all.out"), pytest.warns(UserWarning, match="resized"):
            torch.all(x, 1, out=wrong)
        _same(wrong, torch.all(x, 1), "resized")
        with pytest.raises(RuntimeError, match="only supports bool"):
            torch.all(x, 1, out=torch.empty(4, 6, device=DEVICE))


def test_uint8_out_reads_self_like_aten():
    # a uint8 out= with another self dtype: ATen's CPU reduction converts self to uint8 before testing
    # it (0.5 -> 0, 256 -> 0, so all is False), its CUDA one tests self as it is (all is True). Gems
    # serves the CUDA rule and leaves the CPU's conversion to ATen (counted as a fallback)
    cases = [(torch.tensor([0.5, 1.0, 2.0], device=DEVICE), 0 if not ON_GPU else 1),
             (torch.tensor([256, 1, 3], dtype=torch.int32, device=DEVICE), 0 if not ON_GPU else 1)]
    for x, want in cases:
        for name, fn in (("all.all_out", lambda t, o: torch.ops.aten.all.all_out(t, out=o)),
                         ("all.out", lambda t, o: torch.all(t, 0, out=o))):
            o = torch.full((), 7, dtype=torch.uint8, device=DEVICE)
            gems.reset_stats()
            with gems.use_gems():
                fn(x, o)
            assert o.item() == want, (name, x.dtype)
            st = gems.stats()[name]
            assert (st["served"], st["fallback"]) == ((1, 0) if ON_GPU else (0, 1)), st
    # uint8 self into a uint8 out: served on every device (no conversion changes it)
    x8 = torch.tensor([[0, 3], [255, 1]], dtype=torch.uint8, device=DEVICE)
    o = torch.empty(2, dtype=torch.uint8, device=DEVICE)
    with served("all.out"), gems.use_gems():
        torch.all(x8, 1, out=o)
    assert o.tolist() == [0, 1]


def test_errors_and_fallbacks():
    x = make((3, 4))
    with gems.use_gems():
        with pytest.raises(IndexError):
            torch.all(x, 2)
        with pytest.raises(RuntimeError):
            torch.any(x, (0, 0))
    gems.reset_stats()
    c = torch.ones(3, dtype=torch.complex64, device=DEVICE)
    d = torch.tensor([1.0, 0.0], dtype=torch.float64, device=DEVICE)
    with gems.use_gems():
        assert torch.all(c).item()
        assert torch.any(d).item() and not torch.all(d).item()
    assert gems.stats()["all.default"]["fallback"] == 2
    assert gems.stats()["any.default"]["fallback"] == 1


def test_repeat_calls_run_a_plan():
    empty_info = {"plans": 0, "no_plan": 0}
    before = gems.dispatch.plan_stats().get("any.dim", empty_info)
    for seed in range(3):
        _check("any.dim", lambda t: torch.any(t, 1), sparse_zeros((7, 13), torch.float32, seed=seed))
    info = gems.dispatch.plan_stats()["any.dim"]
    assert info["plans"] == before["plans"] + 1 and info["no_plan"] == before["no_plan"], (before, info)


@pytest.mark.skipif(not ON_GPU, reason="bf16 is left to ATen by the interpreter backend")
def test_bf16_gpu():
    x = sparse_zeros((4, 5, 6), torch.bfloat16)
    for name, fn in CALLS:
        _check(name, fn, x)
