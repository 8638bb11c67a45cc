"""Ternary / select pointwise ops (gems/ops/pointwise/ternary.py) against ATen in float64: where, masked_fill,
clamp / clamp_min / clamp_max, lerp, addcmul, addcdiv. Functional, out= and in-place variants,
broadcasting, layouts, 0-dim and empty inputs, NaN propagation, integer inputs, and gradients."""
import pytest
import torch

import gems
from harness import DEVICE, DTYPES, assert_close, check_grad, check_op, dtype_params, layouts, make, served, to_ref

aten = torch.ops.aten
NAN, INF = float("nan"), float("inf")


def _other(dtype):
    return torch.float16 if dtype == torch.float32 else torch.float32


def _mask(shape):
    return make(shape, torch.bool)


def _out_impl(op, args, kwargs):
    proto = _functional(op)(*args, **kwargs)
    fill = NAN if proto.is_floating_point() else 7
    o = torch.full(proto.shape, fill, dtype=proto.dtype, device=proto.device)
    r = op(*args, **kwargs, out=o)
    assert r is o
    return o


def _functional(op):
    """aten.X.Y_out -> the functional overload with the same arguments (run under whatever mode is on)."""
    name = op._schema.name.split("::")[1]
    ov = op._overloadname
    fn = getattr(aten, name)
    return getattr(fn, {"out": "default", "self_out": "self", "Scalar_out": "Scalar",
                        "Tensor_out": "Tensor"}[ov])


def outfn(op):
    def f(*args, **kwargs):
        return _out_impl(op, args, kwargs)
    f.__name__ = str(op)
    return f


def inplace(method, *extra, **kw):
    """x.clone().method_(*rest): in place on a copy, so check_op's reference calls see fresh inputs."""
    def f(x, *rest):
        y = x.clone()
        r = getattr(y, method)(*rest, *extra, **kw)
        assert r is y
        return y
    f.__name__ = method
    return f


# ---------------------------------------------------------------------------------------------- where
WHERE_CASES = [
    ("same", (6, 19), (6, 19), (6, 19)),
    ("cond row", (19,), (6, 19), (6, 19)),
    ("col x row", (6, 1), (1, 19), (6, 19)),
    ("3-way", (6, 1), (19,), (1, 1)),
    ("0-dim other", (6, 19), (6, 19), ()),
    ("all 0-dim", (), (), ()),
    ("empty", (0, 5), (0, 5), (5,)),
]


@dtype_params()
def test_where_broadcast_layouts(dtype):
    for name, cs, xs, ys in WHERE_CASES:
        check_op(torch.where, (_mask(cs), make(xs, dtype), make(ys, dtype)), dtype=dtype, served_ops=["where.self"])
    for lname, x in layouts((6, 19), dtype):
        c = _mask((19, 6)).t()
        check_op(torch.where, (c, x, make((6, 19), dtype)), dtype=dtype, served_ops=["where.self"])
    check_op(outfn(aten.where.self_out), (_mask((6, 1)), make((6, 19), dtype), make((19,), dtype)),
             dtype=dtype, served_ops=["where.self_out"])


@pytest.mark.parametrize("dt", [torch.int32, torch.int64, torch.int8, torch.bool])
def test_where_int_bool(dt):
    lo = 0 if dt == torch.bool else -50
    c, x, y = _mask((7, 9)), make((7, 9), dt, low=lo, high=50), make((9,), dt, low=lo, high=50)
    check_op(torch.where, (c, x, y), dtype=dt, served_ops=["where.self"])
    check_op(outfn(aten.where.self_out), (c, x, y), dtype=dt, served_ops=["where.self_out"])


def test_where_mixed_dtypes_promote():
    c = _mask((5, 8))
    x, y = make((5, 8), torch.float16), make((5, 8), torch.float32)
    out = check_op(torch.where, (c, x, y), dtype=torch.float16, served_ops=["where.self"])
    assert out.dtype == torch.where(c, x, y).dtype == torch.float32
    out = check_op(torch.where, (c, make((5, 8), torch.int32), make((5, 8), torch.float32)),
                   dtype=torch.float32, served_ops=["where.self"])
    assert out.dtype == torch.float32


@dtype_params()
def test_where_grad(dtype):
    c = _mask((6, 1))
    x, y = make((6, 9), dtype), make((9,), dtype)
    # the reference runs on CPU: captured tensors follow the inputs' device
    check_grad(lambda a, b: torch.where(c.to(a.device), a, b), [x, y], dtype=dtype, served_ops=["where.self"])
    # where after a pointwise op: the typical "safe" pattern
    check_grad(lambda a: torch.where(a > 0, a * a, -a), [x], dtype=dtype, served_ops=["where.self"])


# ---------------------------------------------------------------------------------------- masked_fill
@dtype_params()
def test_masked_fill_variants(dtype):
    x, m = make((6, 19), dtype), _mask((6, 19))
    v = make((), dtype)
    for lname, xl in layouts((6, 19), dtype):
        check_op(torch.masked_fill, (xl, _mask((19,))), {"value": 1.25}, dtype=dtype,
                 served_ops=["masked_fill.Scalar"])
        check_op(torch.masked_fill, (xl, m, v), dtype=dtype, served_ops=["masked_fill.Tensor"])
    check_op(torch.masked_fill, (x, m, -INF), dtype=dtype, served_ops=["masked_fill.Scalar"])
    check_op(torch.masked_fill, (x, m, torch.tensor(-INF, dtype=dtype, device=DEVICE)), dtype=dtype,
             served_ops=["masked_fill.Tensor"])
    # a value of another dtype is cast to self's where none of its values can overflow self's dtype
    # (fp16 into fp32); a wider one (fp32 into fp16) goes to ATen, which checks the value for overflow
    wider = _other(dtype) == torch.float32
    check_op(torch.masked_fill, (x, m, torch.tensor(2.5, dtype=_other(dtype), device=DEVICE)), dtype=dtype,
             served_ops=[] if wider else ["masked_fill.Tensor"])
    check_op(inplace("masked_fill_", -2.5), (x, m), dtype=dtype, served_ops=["masked_fill_.Scalar"])
    check_op(inplace("masked_fill_"), (x, m, v), dtype=dtype, served_ops=["masked_fill_.Tensor"])
    check_op(inplace("masked_fill_", 3.0), (x.t().contiguous().t(), _mask((6, 1))), dtype=dtype,
             served_ops=["masked_fill_.Scalar"])
    check_op(outfn(aten.masked_fill.Scalar_out), (x, m, 0.5), dtype=dtype, served_ops=["masked_fill.Scalar_out"])
    check_op(outfn(aten.masked_fill.Tensor_out), (x, m, v), dtype=dtype, served_ops=["masked_fill.Tensor_out"])
    # 0-dim and empty
    check_op(torch.masked_fill, (make((), dtype), torch.tensor(True, device=DEVICE), 4.0), dtype=dtype,
             served_ops=["masked_fill.Scalar"])
    check_op(torch.masked_fill, (make((0, 3), dtype), _mask((3,)), 4.0), dtype=dtype,
             served_ops=["masked_fill.Scalar"])


@dtype_params()
def test_masked_fill_attention_mask(dtype):
    B, H, S = 2, 3, 16
    scores = make((B, H, S, S), dtype)
    causal = torch.ones(S, S, dtype=torch.bool, device=DEVICE).triu(1)[None, None]   # (1, 1, S, S)
    out = check_op(torch.masked_fill, (scores, causal, -INF), dtype=dtype, served_ops=["masked_fill.Scalar"])
    assert torch.isinf(out[..., 0, 1:]).all() and not torch.isinf(out[..., :, 0]).any()
    check_op(lambda s, c: torch.softmax(s.masked_fill(c, float("-inf")).float(), -1), (scores, causal),
             dtype=dtype, served_ops=["masked_fill.Scalar"])
    check_op(inplace("masked_fill_", torch.finfo(dtype).min), (scores, causal), dtype=dtype,
             served_ops=["masked_fill_.Scalar"])
    pad = _mask((B, 1, 1, S))   # padding mask
    check_op(torch.masked_fill, (scores, pad, -INF), dtype=dtype, served_ops=["masked_fill.Scalar"])


@pytest.mark.parametrize("dt", [torch.int32, torch.int64, torch.uint8, torch.bool])
def test_masked_fill_int_bool(dt):
    lo = 0 if dt in (torch.uint8, torch.bool) else -50
    x, m = make((5, 9), dt, low=lo, high=50), _mask((5, 9))
    v = True if dt == torch.bool else 3
    check_op(torch.masked_fill, (x, m, v), dtype=dt, served_ops=["masked_fill.Scalar"])
    check_op(torch.masked_fill, (x, m, torch.tensor(v, dtype=dt, device=DEVICE)), dtype=dt,
             served_ops=["masked_fill.Tensor"])
    check_op(inplace("masked_fill_", v), (x, m), dtype=dt, served_ops=["masked_fill_.Scalar"])


def test_masked_fill_grad_and_errors():
    for dtype in DTYPES:
        m = _mask((4, 7))
        check_grad(lambda a: a.masked_fill(m.to(a.device), 0.0) * a, [make((4, 7), dtype)], dtype=dtype,
                   served_ops=["masked_fill.Scalar"])
    x = make((4, 7))
    with gems.use_gems(), pytest.raises(RuntimeError):
        x.masked_fill(_mask((4, 7)), make((2,)))          # non-0-dim value: ATen's error
    with gems.use_gems(), pytest.raises(RuntimeError):
        x.clone().masked_fill_(_mask((2, 4, 7)), 1.0)     # mask would grow self


# ---------------------------------------------------------------------------------------------- clamp
# (call, overload served)
CLAMP_SCALAR = [
    (lambda x: torch.clamp(x, -1.0, 1.5), "clamp.default"),
    (lambda x: torch.clamp(x, min=-0.5), "clamp.default"),
    (lambda x: torch.clamp(x, max=0.5), "clamp.default"),
    (lambda x: torch.clamp(x, 1.0, -1.0), "clamp.default"),   # min > max: max wins
    (lambda x: torch.clamp_min(x, 0.25), "clamp_min.default"),
    (lambda x: torch.clamp_max(x, -0.25), "clamp_max.default"),
    (lambda x: torch.clamp(x, min=2), "clamp.default"),       # int bound on a float tensor
]


def _bounds(dtype):
    lo, hi = make((6, 1), dtype, low=-2, high=-0.1), make((19,), dtype, low=0.1, high=2)
    return lo, hi


@dtype_params()
def test_clamp_scalar_and_tensor(dtype):
    for lname, x in layouts((6, 19), dtype):
        for fn, name in CLAMP_SCALAR:
            check_op(fn, (x,), dtype=dtype, served_ops=[name])
    x = make((6, 19), dtype)
    lo, hi = _bounds(dtype)
    check_op(torch.clamp, (x, lo, hi), dtype=dtype, served_ops=["clamp.Tensor"])
    check_op(lambda a, b: torch.clamp(a, min=b), (x, lo), dtype=dtype, served_ops=["clamp.Tensor"])
    check_op(lambda a, b: torch.clamp(a, max=b), (x, hi), dtype=dtype, served_ops=["clamp.Tensor"])
    check_op(torch.clamp_min, (x, lo), dtype=dtype, served_ops=["clamp_min.Tensor"])
    check_op(torch.clamp_max, (x, hi), dtype=dtype, served_ops=["clamp_max.Tensor"])
    check_op(torch.clamp, (x, make((), dtype), None), dtype=dtype, served_ops=["clamp.Tensor"])
    # 0-dim and empty
    check_op(torch.clamp, (make((), dtype), -0.5, 0.5), dtype=dtype, served_ops=["clamp.default"])
    check_op(torch.clamp, (make((0, 19), dtype), lo[:0], hi), dtype=dtype, served_ops=["clamp.Tensor"])


@dtype_params()
def test_clamp_out_and_inplace(dtype):
    x = make((6, 19), dtype)
    lo, hi = _bounds(dtype)
    check_op(outfn(aten.clamp.out), (x, -1.0, 1.0), dtype=dtype, served_ops=["clamp.out"])
    check_op(outfn(aten.clamp.Tensor_out), (x, lo, hi), dtype=dtype, served_ops=["clamp.Tensor_out"])
    check_op(outfn(aten.clamp_min.out), (x, 0.5), dtype=dtype, served_ops=["clamp_min.out"])
    check_op(outfn(aten.clamp_max.out), (x, 0.5), dtype=dtype, served_ops=["clamp_max.out"])
    check_op(outfn(aten.clamp_min.Tensor_out), (x, lo), dtype=dtype, served_ops=["clamp_min.Tensor_out"])
    check_op(outfn(aten.clamp_max.Tensor_out), (x, hi), dtype=dtype, served_ops=["clamp_max.Tensor_out"])
    check_op(inplace("clamp_", -1.0, 1.0), (x,), dtype=dtype, served_ops=["clamp_.default"])
    check_op(inplace("clamp_", max=0.0), (x,), dtype=dtype, served_ops=["clamp_.default"])
    check_op(inplace("clamp_"), (x, lo, hi), dtype=dtype, served_ops=["clamp_.Tensor"])
    check_op(inplace("clamp_min_", 0.5), (x.t().contiguous().t(),), dtype=dtype, served_ops=["clamp_min_.default"])
    check_op(inplace("clamp_max_", 0.5), (x[:, ::2],), dtype=dtype, served_ops=["clamp_max_.default"])
    check_op(inplace("clamp_min_"), (x, lo), dtype=dtype, served_ops=["clamp_min_.Tensor"])
    check_op(inplace("clamp_max_"), (x, hi), dtype=dtype, served_ops=["clamp_max_.Tensor"])
    with gems.use_gems(), pytest.raises(RuntimeError):
        torch.clamp(x)                                      # neither bound


def test_clamp_nan_propagation():
    v = torch.tensor([NAN, 1.0, -3.0, 0.5, INF, -INF, NAN, 2.0], device=DEVICE)
    lo = torch.tensor([0.0, NAN, -1.0, 1.0, 0.0, NAN, NAN, -INF], device=DEVICE)
    hi = torch.tensor([1.0, 2.0, NAN, 2.0, NAN, 0.0, 1.0, INF], device=DEVICE)
    f32 = torch.float32
    check_op(torch.clamp, (v, lo, hi), dtype=f32, served_ops=["clamp.Tensor"])
    check_op(torch.clamp_min, (v, lo), dtype=f32, served_ops=["clamp_min.Tensor"])
    check_op(torch.clamp_max, (v, hi), dtype=f32, served_ops=["clamp_max.Tensor"])
    for a, b in ((-1.0, 1.0), (NAN, 1.0), (-1.0, NAN), (NAN, NAN), (-INF, INF)):
        check_op(torch.clamp, (v, a, b), dtype=f32, served_ops=["clamp.default"])
    check_op(torch.clamp_min, (v, NAN), dtype=f32, served_ops=["clamp_min.default"])
    check_op(torch.clamp_max, (v, NAN), dtype=f32, served_ops=["clamp_max.default"])



def test_clamp_lone_nan_bound_goes_to_aten():
    # ATen's own answer for clamp(x, min=nan) with no max depends on the device and on the CPU's
    # vector ISA (x on CUDA and AVX-512, NaN on AVX2): Gems leaves it to ATen, counted, and a NaN
    # bound after a plan for a finite one (same signature class) still reaches the check
    v = torch.tensor([NAN, 1.0, -3.0, 0.5, INF, -INF, NAN, 2.0], device=DEVICE)
    for kw in ({"min": NAN}, {"max": NAN}):
        gems.reset_stats()
        with gems.use_gems():
            finite = torch.clamp(v, **{k: 0.25 for k in kw})
            out = torch.clamp(v, **kw)
            inplace = v.clone().clamp_(**kw)
        st = gems.stats()
        assert st["clamp.default"]["served"] == 1 and st["clamp.default"]["fallback"] == 1, st
        assert st["clamp_.default"]["fallback"] == 1, st
        assert any("lone NaN" in r for r in st["clamp.default"]["reasons"]), st
        ref = torch.clamp(v, **kw)
        assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.nan_to_num(), ref.nan_to_num())
        assert torch.equal(inplace.nan_to_num(), ref.nan_to_num())
        assert_close(finite, torch.clamp(to_ref(v), **{k: 0.25 for k in kw}), torch.float32)


@pytest.mark.parametrize("dt", [torch.int32, torch.int64, torch.int8, torch.uint8])
def test_clamp_int(dt):
    lo_v = 0 if dt == torch.uint8 else -20
    x = make((5, 9), dt, low=lo_v, high=20)
    check_op(torch.clamp, (x, 3, 10), dtype=dt, served_ops=["clamp.default"])
    check_op(torch.clamp_min, (x, 5), dtype=dt, served_ops=["clamp_min.default"])
    check_op(torch.clamp, (x, make((9,), dt, low=lo_v, high=5), make((5, 1), dt, low=6, high=20)), dtype=dt,
             served_ops=["clamp.Tensor"])
    check_op(inplace("clamp_", 2, 8), (x,), dtype=dt, served_ops=["clamp_.default"])
    # float bounds on an int tensor: ATen promotes the result to the default float dtype
    for fn in (lambda t: torch.clamp(t, 0.5, 7.5), lambda t: torch.clamp(t, min=2.5),
               lambda t: torch.clamp(t, max=2.5), lambda t: torch.clamp_min(t, 2.5),
               lambda t: torch.clamp_max(t, 2.5)):
        expect = fn(x)
        assert expect.dtype == torch.float32
        with gems.use_gems():
            got = fn(x)
        assert got.dtype == expect.dtype, f"dtype {got.dtype} vs ATen's {expect.dtype}"
        assert torch.equal(got, expect)
    with gems.use_gems():
        got = torch.clamp(x, max=torch.tensor(2.5, device=DEVICE))
    assert got.dtype == torch.float32 and torch.equal(got, torch.clamp(x, max=torch.tensor(2.5, device=DEVICE)))
    with gems.use_gems(), pytest.raises(RuntimeError):
        x.clone().clamp_(0.5)                               # float result into an int tensor


def test_clamp_grad():
    for dtype in DTYPES:
        x = make((6, 9), dtype)
        lo, hi = make((6, 1), dtype, low=-2, high=-0.1), make((9,), dtype, low=0.1, high=2)
        check_grad(lambda a: torch.clamp(a, -1.0, 1.0), [x], dtype=dtype, served_ops=["clamp.default"])
        check_grad(lambda a: torch.clamp(a, min=0.0) * a, [x], dtype=dtype, served_ops=["clamp.default"])
        check_grad(lambda a: a.clamp_min(0.5) + a.clamp_max(-0.5), [x], dtype=dtype,
                   served_ops=["clamp_min.default", "clamp_max.default"])
        check_grad(lambda a, b, c: torch.clamp(a, b, c), [x, lo, hi], dtype=dtype, served_ops=["clamp.Tensor"])


# ------------------------------------------------------------------------------- lerp, addcmul, addcdiv
@dtype_params()
def test_lerp(dtype):
    for lname, x in layouts((6, 19), dtype):
        e = make((6, 19), dtype)
        for w in (0.0, 0.3, 0.5, 1.0, -0.7, 1.8):
            check_op(torch.lerp, (x, e, w), dtype=dtype, served_ops=["lerp.Scalar"])
        check_op(torch.lerp, (x, e, make((6, 19), dtype, low=-0.5, high=1.5)), dtype=dtype,
                 served_ops=["lerp.Tensor"])
    x, e, w = make((6, 19), dtype), make((19,), dtype), make((6, 1), dtype, low=0, high=1)
    check_op(torch.lerp, (x, e, w), dtype=dtype, served_ops=["lerp.Tensor"])
    check_op(torch.lerp, (x, e, 0.25), dtype=dtype, served_ops=["lerp.Scalar"])
    check_op(torch.lerp, (x, e, make((), dtype)), dtype=dtype, served_ops=["lerp.Tensor"])
    check_op(outfn(aten.lerp.Scalar_out), (x, e, 0.75), dtype=dtype, served_ops=["lerp.Scalar_out"])
    check_op(outfn(aten.lerp.Tensor_out), (x, e, w), dtype=dtype, served_ops=["lerp.Tensor_out"])
    check_op(inplace("lerp_", 0.6), (x, e), dtype=dtype, served_ops=["lerp_.Scalar"])
    check_op(inplace("lerp_"), (x, e, w), dtype=dtype, served_ops=["lerp_.Tensor"])
    check_op(torch.lerp, (make((), dtype), make((), dtype), 0.4), dtype=dtype, served_ops=["lerp.Scalar"])
    check_op(torch.lerp, (make((0, 3), dtype), make((3,), dtype), 0.4), dtype=dtype, served_ops=["lerp.Scalar"])


@dtype_params()
def test_addcmul_addcdiv(dtype):
    t2pos = dict(low=0.5, high=3.0)
    for lname, x in layouts((6, 19), dtype):
        a, b = make((6, 19), dtype), make((6, 19), dtype, **t2pos)
        check_op(torch.addcmul, (x, a, b), dtype=dtype, served_ops=["addcmul.default"])
        check_op(torch.addcdiv, (x, a, b), dtype=dtype, served_ops=["addcdiv.default"])
    x, a, b = make((6, 19), dtype), make((6, 1), dtype), make((19,), dtype, **t2pos)
    for v in (1, 0.5, -2.0):
        check_op(torch.addcmul, (x, a, b), {"value": v}, dtype=dtype, served_ops=["addcmul.default"])
        check_op(torch.addcdiv, (x, a, b), {"value": v}, dtype=dtype, served_ops=["addcdiv.default"])
    check_op(torch.addcmul, (make((19,), dtype), a, b), {"value": 0.1}, dtype=dtype,
             served_ops=["addcmul.default"])   # self broadcasts too
    check_op(outfn(aten.addcmul.out), (x, a, b), {"value": 0.3}, dtype=dtype, served_ops=["addcmul.out"])
    check_op(outfn(aten.addcdiv.out), (x, a, b), {"value": 0.3}, dtype=dtype, served_ops=["addcdiv.out"])
    check_op(inplace("addcmul_", value=-0.5), (x, a, b), dtype=dtype, served_ops=["addcmul_.default"])
    check_op(inplace("addcdiv_", value=-0.5), (x, a, b), dtype=dtype, served_ops=["addcdiv_.default"])
    for fn, name in ((torch.addcmul, "addcmul.default"), (torch.addcdiv, "addcdiv.default")):
        check_op(fn, (make((), dtype), make((), dtype), make((), dtype, **t2pos)), dtype=dtype, served_ops=[name])
        check_op(fn, (make((0, 4), dtype), make((4,), dtype), make((4,), dtype, **t2pos)), dtype=dtype,
                 served_ops=[name])


def test_addcdiv_addcmul_order_near_the_fp32_limit():
    """Near 3e38 the order of the multiply and the divide decides whether a term overflows. ATen's CPU
    addcdiv is self + (value * t1) / t2, its CUDA one self + value * (t1 / t2); addcmul is
    self + (value * t1) * t2 on both. Gems follows each device's: ATen on the same device is the
    reference, bit for bit, infinities included."""
    f32 = torch.float32
    x = torch.tensor([0.0, 0.0, 1e38, -1e38, 0.0, 2.0], device=DEVICE).repeat(3)
    t1 = torch.tensor([3e38, 3e38, 3e38, 3e38, 1e-30, -7.0], device=DEVICE).repeat(3)
    t2 = torch.tensor([0.5, 2.0, 1.45, 3.0, 1e-30, 3.0], device=DEVICE).repeat(3)
    for v in (0.5, 2.0, 0.69, -1.3):
        for fn, name in ((torch.addcdiv, "addcdiv.default"), (torch.addcmul, "addcmul.default")):
            with served(name), gems.use_gems():
                got = fn(x, t1, t2, value=v)
            assert torch.equal(got, fn(x, t1, t2, value=v)), (name, v, got, fn(x, t1, t2, value=v))
        with served("addcdiv_.default"), gems.use_gems():
            got = x.clone().addcdiv_(t1, t2, value=v)
        assert torch.equal(got, x.clone().addcdiv_(t1, t2, value=v)), v
    # the hand-checked case: 0.5 * 3e38 / 0.5 is 3e38 on the CPU; 0.5 * (3e38 / 0.5) overflows on CUDA
    one = [torch.tensor([t], device=DEVICE, dtype=f32) for t in (0.0, 3e38, 0.5)]
    with served("addcdiv_.default"), gems.use_gems():
        got = one[0].clone().addcdiv_(one[1], one[2], value=0.5)
    assert torch.isfinite(got).item() == (DEVICE == "cpu")


def test_addcmul_int():
    for dt in (torch.int32, torch.int64):
        x, a, b = make((5, 9), dt, low=-20, high=20), make((5, 9), dt, low=-20, high=20), make((9,), dt, low=-5, high=5)
        check_op(torch.addcmul, (x, a, b), {"value": 3}, dtype=dt, served_ops=["addcmul.default"])


def test_lerp_addc_grads():
    for dtype in DTYPES:
        x, e = make((6, 9), dtype), make((9,), dtype)
        w = make((6, 1), dtype, low=0, high=1)
        d = make((6, 9), dtype, low=0.5, high=3.0)
        check_grad(lambda p, q: torch.lerp(p, q, 0.3), [x, e], dtype=dtype, served_ops=["lerp.Scalar"])
        check_grad(lambda p, q, r: torch.lerp(p, q, r), [x, e, w], dtype=dtype, served_ops=["lerp.Tensor"])
        check_grad(lambda p, q, r: torch.addcmul(p, q, r, value=0.7), [x, e, d], dtype=dtype,
                   served_ops=["addcmul.default"])
        check_grad(lambda p, q, r: torch.addcdiv(p, q, r, value=-1.5), [x, e, d], dtype=dtype,
                   served_ops=["addcdiv.default"])


def test_fallbacks_counted_and_right():
    x, y = make((4, 5), torch.float64), make((4, 5), torch.float64)
    gems.reset_stats()
    with gems.use_gems():
        r = torch.lerp(x, y, 0.5)
        s = torch.clamp(x, -1, 1)
    assert torch.equal(r, torch.lerp(x, y, 0.5)) and torch.equal(s, torch.clamp(x, -1, 1))
    st = gems.stats()
    assert st["lerp.Scalar"]["fallback"] == 1 and st["clamp.default"]["fallback"] == 1
    # mixed dtypes in lerp: ATen raises, and so must Gems
    with gems.use_gems(), pytest.raises(RuntimeError):
        torch.lerp(make((3,)), make((3,), torch.float16), 0.5)


def test_integer_bounds_of_a_wider_type_like_aten():
    # the in-place uint8 3 clamped by the int16 bound -5: ATen's CPU kernel takes the min in int16 (251
    # after the cast back), its CUDA kernel reads the bound as uint8 (3); Gems serves the CPU and hands
    # the CUDA call to ATen (found by the GPU fuzz)
    x, hi = torch.tensor([3, 200], dtype=torch.uint8, device=DEVICE), torch.tensor([-5, 7], dtype=torch.int16,
                                                                                  device=DEVICE)
    want = [x.clone().clamp_max_(hi), x.clone().clamp_min_(hi), x.clone().clamp_(hi, hi), torch.clamp_max(x, hi)]
    gems.reset_stats()
    with gems.use_gems():
        got = [x.clone().clamp_max_(hi), x.clone().clamp_min_(hi), x.clone().clamp_(hi, hi), torch.clamp_max(x, hi)]
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w), (g, w)
    fell_back = gems.stats()["clamp_max_.Tensor"]["fallback"]
    assert fell_back == (1 if DEVICE == "cuda" else 0)
