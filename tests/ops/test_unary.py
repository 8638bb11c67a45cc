"""Unary math ops (gems/ops/pointwise/unary.py) against ATen in float64, table-driven: every op gets layouts,
0-dim, empty, odd sizes, edge values (NaN/+-inf/+-0/huge/tiny), out= (poisoned and resized), in-place on
a non-contiguous view, integer/bool inputs where ATen takes them, fallback and gradients."""
import math

import pytest
import torch

import gems
from harness import DEVICE, DTYPES, ON_GPU, assert_close, check_grad, check_op, dtype_params, layouts, make, served, to_ref

ALLINT = (torch.int32, torch.int64, torch.uint8, torch.bool)
NUMINT = (torch.int32, torch.int64, torch.uint8)
BOOLINT = (torch.int32, torch.int64, torch.int16, torch.uint8, torch.bool)

# name -> (fn, domain (low, high), served overload of the functional call, in-place overload or None,
#          integer/bool dtypes served)
OPS = {
    "abs": (torch.abs, (-3, 3), "abs.out", None, NUMINT),
    "sign": (torch.sign, (-3, 3), "sign", "sign_", ALLINT),
    "reciprocal": (torch.reciprocal, (-3, 3), "reciprocal", "reciprocal_", ALLINT),
    "exp2": (torch.exp2, (-10, 10), "exp2", "exp2_", ALLINT),
    "expm1": (torch.expm1, (-3, 3), "expm1", "expm1_", ALLINT),
    "log": (torch.log, (0.01, 5), "log", "log_", ALLINT),
    "log1p": (torch.log1p, (-0.99, 5), "log1p", "log1p_", ALLINT),
    "log2": (torch.log2, (0.01, 5), "log2", "log2_", ALLINT),
    "log10": (torch.log10, (0.01, 5), "log10", "log10_", ALLINT),
    "sqrt": (torch.sqrt, (0.01, 5), "sqrt", "sqrt_", ALLINT),
    "rsqrt": (torch.rsqrt, (0.01, 5), "rsqrt", "rsqrt_", ALLINT),
    "sin": (torch.sin, (-6, 6), "sin", "sin_", ALLINT),
    "cos": (torch.cos, (-6, 6), "cos", "cos_", ALLINT),
    "tan": (torch.tan, (-1.5, 1.5), "tan", "tan_", ALLINT),
    "tanh": (torch.tanh, (-5, 5), "tanh", "tanh_", ALLINT),
    "asin": (torch.asin, (-1, 1), "asin", "asin_", ALLINT),
    "acos": (torch.acos, (-1, 1), "acos", "acos_", ALLINT),
    "atan": (torch.atan, (-8, 8), "atan", "atan_", ALLINT),
    "sinh": (torch.sinh, (-5, 5), "sinh", "sinh_", ALLINT),
    "cosh": (torch.cosh, (-5, 5), "cosh", "cosh_", ALLINT),
    "sigmoid": (torch.sigmoid, (-8, 8), "sigmoid", "sigmoid_", ALLINT),
    "erf": (torch.erf, (-3, 3), "erf", "erf_", ALLINT),
    "erfc": (torch.erfc, (-3, 5), "erfc", "erfc_", ALLINT),
    "erfinv": (torch.erfinv, (-0.999, 0.999), "erfinv", "erfinv_", ALLINT),
    "floor": (torch.floor, (-5, 5), "floor", "floor_", NUMINT),
    "ceil": (torch.ceil, (-5, 5), "ceil", "ceil_", NUMINT),
    "round": (torch.round, (-5, 5), "round", "round_", NUMINT),
    "trunc": (torch.trunc, (-5, 5), "trunc", "trunc_", NUMINT),
    "frac": (torch.frac, (-5, 5), "frac", "frac_", ()),
    "isnan": (torch.isnan, (-3, 3), "isnan", None, ALLINT),
    "logical_not": (torch.logical_not, (-3, 3), "logical_not.out", None, ALLINT),
    "nan_to_num": (torch.nan_to_num, (-3, 3), "nan_to_num.out", None, ()),
}
EDGE = [0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-30, -1e-30, 1e-7, -1e-7, 0.3, -0.7,
        0.5, 1.5, 2.5, -2.5, 1.0, -1.0, 20.0, -20.0, 80.0, -80.0, 1e20, -1e20]
# values where an op's float64 result overflows fp32 or sits on a branch cut in a way the float64
# reference cannot stand for: compared against ATen at fp32 instead
EDGE_VS_ATEN32 = {"reciprocal", "exp2", "expm1", "sinh", "cosh", "tan", "erfinv", "sin", "cos"}


def _isinf(t):
    return (t == float("inf")) | (t == -float("inf"))


def _ops(*names):
    return pytest.mark.parametrize("op", names or sorted(OPS))


def _inputs(op, dtype):
    lo, hi = OPS[op][1]
    kw = dict(low=lo, high=hi)
    xs = layouts((6, 19), dtype, **kw)
    xs += [("3d-permuted", make((3, 4, 5), dtype, **kw).permute(2, 0, 1)), ("odd", make((1031,), dtype, **kw)),
           ("0-dim", make((), dtype, **kw))]
    if op in ("floor", "ceil", "round", "trunc", "frac"):
        halves = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.49, -3.51, 4.0, -4.0], dtype=dtype).to(DEVICE)
        xs.append(("halves", halves))
    return xs


@dtype_params()
@_ops()
def test_unary_values_and_layouts(op, dtype):
    fn, _, name, _, _ = OPS[op]
    for lname, x in _inputs(op, dtype):
        out = check_op(fn, (x,), dtype=dtype, served_ops=[name])
        want = fn(x)
        assert out.dtype == want.dtype, lname
        got_st = [s for s, n in zip(out.stride(), out.shape) if n != 1]
        want_st = [s for s, n in zip(want.stride(), want.shape) if n != 1]
        assert got_st == want_st, f"{lname}: strides {out.stride()} vs ATen {want.stride()}"
    with served(name), gems.use_gems():
        e = fn(make((0, 5), dtype))
    assert e.shape == (0, 5) and e.dtype == fn(make((0, 5), dtype)).dtype


@_ops(*sorted(set(OPS) - {"nan_to_num"}))     # nan_to_num: exact values in test_nan_to_num_values
def test_unary_edge_values(op):
    fn, _, name, _, _ = OPS[op]
    x = torch.tensor(EDGE, dtype=torch.float32).to(DEVICE)
    if op in EDGE_VS_ATEN32:
        with served(name), gems.use_gems():
            out = fn(x)
        want = fn(x)
        # the same non-finite pattern as ATen at fp32, and finite values within fp32 tolerance of float64
        assert torch.equal(torch.isnan(out), torch.isnan(want)), (out, want)
        assert torch.equal(_isinf(out), _isinf(want)) and torch.equal(out[_isinf(out)], want[_isinf(want)])
        fin = torch.isfinite(want) & (x.abs() < 50)   # sin/cos/tan of huge args: both are fp32 range-reduction noise
        assert_close(out[fin], fn(to_ref(x))[fin.cpu()], torch.float32, want[fin])
    else:
        check_op(fn, (x,), dtype=torch.float32, served_ops=[name])


def test_unary_special_points():
    # exact values ATen returns at the ends of the domains and signed zeros
    x = torch.tensor([-1.0, 1.0, -0.0, 0.0, 1.0000001, -1.0000001]).to(DEVICE)
    for fn, name in [(torch.asin, "asin"), (torch.acos, "acos"), (torch.erfinv, "erfinv"), (torch.log1p, "log1p")]:
        check_op(fn, (x,), dtype=torch.float32, served_ops=[name])
    z = torch.tensor([-0.0, -0.3, -0.5, 0.0]).to(DEVICE)
    for fn in (torch.round, torch.trunc, torch.ceil, torch.sign, torch.expm1, torch.sinh, torch.atan, torch.log1p):
        with gems.use_gems():
            out = fn(z)
        assert torch.equal(torch.signbit(out), torch.signbit(fn(z))), (fn.__name__, out, fn(z))
    # erfc deep in the tail keeps relative accuracy (1 - erf would be 0)
    t = torch.tensor([3.0, 5.0, 7.0, 9.0]).to(DEVICE)
    check_op(torch.erfc, (t,), dtype=torch.float32, served_ops=["erfc"], atol=0, rtol=2e-6)


@pytest.mark.parametrize("dt", [torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8, torch.bool],
                         ids=lambda d: str(d).split(".")[1])
def test_unary_integer_and_bool_inputs(dt):
    lo, hi = (0, 5) if dt == torch.uint8 else (-5, 5)
    x = make((5, 7), dt, low=lo, high=hi) if dt != torch.bool else make((5, 7), dt)
    x_pos = make((5, 7), dt, low=1, high=5) if dt != torch.bool else make((5, 7), dt)
    for op, (fn, dom, name, _, ints) in OPS.items():
        if dt not in ints:
            continue
        arg = x_pos if dom[0] >= 0 or op in ("asin", "acos", "erfinv", "log1p") else x
        out = check_op(fn, (arg,), dtype=torch.float32, served_ops=[name])
        assert out.dtype == fn(arg).dtype, op
    out = check_op(torch.bitwise_not, (x,), dtype=dt, served_ops=["bitwise_not"])
    assert out.dtype == dt
    with served("bitwise_not_"), gems.use_gems():
        y = x.clone().t().bitwise_not_()
    assert torch.equal(y, x.t().bitwise_not())


@dtype_params()
@_ops()
def test_unary_out_and_inplace(op, dtype):
    fn, (lo, hi), name, inplace, _ = OPS[op]
    aten = getattr(torch.ops.aten, op)
    x = make((4, 9), dtype, low=lo, high=hi)
    ref = aten.default(to_ref(x)) if op not in ("abs", "logical_not") else fn(to_ref(x))
    rdt = fn(x).dtype
    out = torch.full((4, 9), float("nan"), dtype=dtype, device=DEVICE).to(rdt)
    if op == "isnan":     # isnan.out is CompositeExplicit (isnan + copy): only isnan.default is served
        return
    out_name = op + ".out"
    with served(out_name), gems.use_gems():
        r = fn(x, out=out)
    assert r is out
    assert_close(out, ref, dtype, fn(x))
    wrong = torch.zeros((2,), dtype=rdt, device=DEVICE)
    with gems.use_gems(), pytest.warns(UserWarning, match="resized"):
        fn(x.t(), out=wrong)
    assert wrong.shape == (9, 4) and wrong.stride() == fn(x.t()).stride()
    assert_close(wrong, ref.t(), dtype, fn(x.t()))
    if inplace is None:
        return
    base = make((9, 8), dtype, low=lo, high=hi)
    keep = base.clone()
    view = base.t()[:, ::2]
    with served(inplace), gems.use_gems():
        r = getattr(torch.ops.aten, inplace).default(view)
    assert r is view
    assert_close(view, fn(to_ref(keep.t()[:, ::2])), dtype, fn(keep.t()[:, ::2]))
    assert torch.equal(base.t()[:, 1::2], keep.t()[:, 1::2])


def test_round_decimals_past_the_16_bit_range():
    # fp16 x * 10^d past 65504: ATen's CPU kernel scales in fp32 (finite), its CUDA kernel in fp16 (inf
    # there); Gems gives ATen's answer on each device
    x = torch.tensor([100.0, -70.5, 65.0, 0.001, 60000.0], dtype=torch.float16, device=DEVICE)
    for d in (3, 4, 5, -2):
        want = torch.round(x, decimals=d)
        with gems.use_gems():
            got = torch.round(x, decimals=d)
        assert torch.equal(got.isinf(), want.isinf()) and torch.equal(got.isnan(), want.isnan()), (d, got, want)
        fin = torch.isfinite(want)
        assert_close(got[fin], to_ref(want)[fin.cpu()], torch.float16)


@dtype_params()
def test_round_decimals(dtype):
    # 16-bit on CUDA goes to ATen, whose kernel computes x * 10^d in the 16-bit dtype (it overflows to
    # inf where the CPU's fp32 does not: test_round_decimals_past_the_16_bit_range)
    n = 0 if ON_GPU and dtype in (torch.float16, torch.bfloat16) else 1
    x = make((6, 19), dtype, low=-50, high=50)
    for d in (0, 1, 2, -1):
        for t in (x, x.t()):
            # round(x * 10^d) / 10^d is defined in x's dtype: a value such as fp32 -45.975 scales to an exact
            # tie there (-4597.5) but not in float64, so ATen's own result at this dtype sets the bound.
            with served("round.decimals", at_least=n), gems.use_gems():
                out = torch.round(t, decimals=d)
            assert_close(out, torch.round(to_ref(t), decimals=d), dtype, torch.round(t, decimals=d))
    out = torch.full((6, 19), float("nan"), dtype=dtype, device=DEVICE)
    with served("round.decimals_out", "round_.decimals", at_least=n), gems.use_gems():
        torch.round(x, decimals=1, out=out)
        y = x.clone().round_(decimals=1)
    assert_close(out, torch.round(to_ref(x), decimals=1), dtype, torch.round(x, decimals=1))
    assert_close(y, torch.round(to_ref(x), decimals=1), dtype, torch.round(x, decimals=1))


def test_round_via_abs_and_logical_not_composites():
    # abs.default / abs_ / logical_not.default / logical_not_ are CompositeExplicit: they reach the .out overloads
    x = make((5, 6))
    with served("abs.out", at_least=2), gems.use_gems():
        a = torch.abs(x)
        y = x.clone()
        y.abs_()
    assert torch.equal(a, x.abs()) and torch.equal(y, x.abs())
    with served("logical_not.out"), gems.use_gems():
        b = torch.logical_not(x)
        f = torch.empty(5, 6, device=DEVICE)
        torch.logical_not(x, out=f)      # bool result into a float out: the generator hands it to ATen
    assert b.dtype == torch.bool and torch.equal(b, x == 0) and torch.equal(f, (x == 0).float())


@dtype_params()
def test_nan_to_num_values(dtype):
    x = torch.tensor([[float("nan"), float("inf"), -float("inf"), 1.5], [2.0, float("nan"), -3.0, float("inf")]],
                     dtype=dtype).to(DEVICE)
    for kw in ({}, {"nan": 1.0}, {"nan": -2.0, "posinf": 7.0, "neginf": -9.0}, {"posinf": 1e6}):
        with served("nan_to_num.out"), gems.use_gems():
            out = torch.nan_to_num(x, **kw)
        assert torch.equal(out, torch.nan_to_num(x, **kw)), (kw, out)
    with served("nan_to_num.out"), gems.use_gems():
        y = x.t().clone().t()
        y.nan_to_num_(nan=3.0)
    assert torch.equal(y, torch.nan_to_num(x, nan=3.0))


def test_fallbacks_counted_and_right():
    x = make((4, 5), torch.float64, low=0.1, high=2)
    gems.reset_stats()
    with gems.use_gems():
        y = torch.sqrt(x)
        z = torch.frac(x)
        w = torch.nan_to_num(make((3,), torch.int32))
    assert torch.equal(y, torch.sqrt(x)) and torch.equal(z, torch.frac(x)) and w.dtype == torch.int32
    st = gems.stats()
    assert st["sqrt.default"]["fallback"] == 1 and st["frac.default"]["fallback"] == 1
    assert st["nan_to_num.out"]["fallback"] == 1


def test_errors_like_aten():
    with gems.use_gems(), pytest.raises(RuntimeError):
        torch.bitwise_not(make((3,)))                    # float: ATen rejects
    with gems.use_gems(), pytest.raises(RuntimeError):
        torch.frac(make((3,), torch.int32))               # integer frac: ATen rejects
    with gems.use_gems(), pytest.raises(RuntimeError):
        make((3,), torch.int32).sqrt_()                   # float result into an int tensor
    with gems.use_gems(), pytest.raises(RuntimeError):
        make((1, 3)).expand(2, 3).sin_()                  # self has overlapping elements
    from gems.ops.pointwise import unary
    with pytest.raises(RuntimeError):
        unary.sqrt.overloads["sqrt_"].fn(make((4,), torch.int64))


@dtype_params()
def test_unary_gradients(dtype):
    # backward formulas of these ops run on Gems ops (mul, div, the ops themselves, sigmoid/tanh backward)
    x = make((6, 11), dtype, low=0.2, high=2.0)
    check_grad(lambda t: torch.sqrt(t) + torch.rsqrt(t) + torch.log(t), [x], dtype=dtype,
               served_ops=["sqrt", "rsqrt", "log"])
    y = make((6, 11), dtype, low=-2.0, high=2.0)
    check_grad(lambda t: torch.sin(t) * torch.cos(t) + torch.tanh(t) + torch.sigmoid(t), [y], dtype=dtype,
               # fp16 sigmoid_backward and CUDA's fp16 tanh_backward are ATen's (its kernels round each
               # step to fp16 there)
               served_ops=["sin", "cos"] + ([] if dtype == torch.float16 and ON_GPU else ["tanh_backward"])
               + (["sigmoid_backward"] if dtype != torch.float16 else []))
    check_grad(lambda t: torch.atan(t) + torch.erf(t) + torch.expm1(t) + torch.reciprocal(t), [y], dtype=dtype,
               served_ops=["atan", "erf", "expm1", "reciprocal"])
