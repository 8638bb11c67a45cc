"""Binary pointwise ops (gems/ops/pointwise/binary.py) against ATen in float64: one table, shared checks for
layouts, broadcast, 0-dim, empty, Python scalars, out=, in-place, NaN/Inf, integer signs, fallbacks."""
import contextlib

import pytest
import torch

import gems
from harness import (DEVICE, DTYPES, ON_GPU, FLOAT_IDS, assert_close, check_op, dtype_params, layouts, make,
                     raises_like_aten, served, to_ref)

# On CUDA, pow.Tensor_Tensor is deliberately left to ATen (see gems/ops/pointwise/binary.py)
POW_TT = "pow.Tensor_Tensor" if DEVICE == "cpu" else None

POS = dict(low=0.2, high=3.0)
# name: (fn, overload served for two tensors, input kwargs for make)
FLOAT_OPS = {
    "remainder": (torch.remainder, "remainder.Tensor", {}),
    "fmod": (torch.fmod, "fmod.Tensor", {}),
    "pow": (torch.pow, "pow.Tensor_Tensor" if DEVICE == "cpu" else None, POS),
    "maximum": (torch.maximum, "maximum.default", {}),
    "minimum": (torch.minimum, "minimum.default", {}),
    "fmax": (torch.fmax, "fmax.default", {}),
    "fmin": (torch.fmin, "fmin.default", {}),
    "hypot": (torch.hypot, "hypot.default", {}),
    "eq": (torch.eq, "eq.Tensor", {}), "ne": (torch.ne, "ne.Tensor", {}), "lt": (torch.lt, "lt.Tensor", {}),
    "le": (torch.le, "le.Tensor", {}), "gt": (torch.gt, "gt.Tensor", {}), "ge": (torch.ge, "ge.Tensor", {}),
    "logical_and": (torch.logical_and, "logical_and.default", {}),
    "logical_or": (torch.logical_or, "logical_or.default", {}),
    "logical_xor": (torch.logical_xor, "logical_xor.default", {}),
}
INT_OPS = {
    "remainder": (torch.remainder, "remainder.Tensor"), "fmod": (torch.fmod, "fmod.Tensor"),
    "maximum": (torch.maximum, "maximum.default"), "minimum": (torch.minimum, "minimum.default"),
    "eq": (torch.eq, "eq.Tensor"), "lt": (torch.lt, "lt.Tensor"), "ge": (torch.ge, "ge.Tensor"),
    "bitwise_and": (torch.bitwise_and, "bitwise_and.Tensor"), "bitwise_or": (torch.bitwise_or, "bitwise_or.Tensor"),
    "bitwise_xor": (torch.bitwise_xor, "bitwise_xor.Tensor"),
    "logical_xor": (torch.logical_xor, "logical_xor.default"),
}


def _pairs(dtype, kw):
    out = [(n, x, make((6, 19), dtype, **kw)) for n, x in layouts((6, 19), dtype, **kw)]
    out += [("row", make((6, 19), dtype, **kw), make((19,), dtype, **kw)),
            ("col x row", make((6, 1), dtype, **kw), make((1, 19), dtype, **kw)),
            ("0-dim", make((6, 19), dtype, **kw), make((), dtype, **kw)),
            ("both 0-dim", make((), dtype, **kw), make((), dtype, **kw)),
            ("a+a.T", make((8, 8), dtype, **kw), make((8, 8), dtype, **kw).t())]
    return out


@dtype_params()
@pytest.mark.parametrize("op", sorted(FLOAT_OPS))
def test_float_layouts_broadcast(op, dtype):
    fn, name, kw = FLOAT_OPS[op]
    names = [name] if name else []   # None: deliberately left to ATen on this backend
    for lname, x, y in _pairs(dtype, kw):
        check_op(fn, (x, y), dtype=dtype, served_ops=names)
    with served(*names), gems.use_gems():
        e = fn(make((0, 4), dtype, **kw), make((4,), dtype, **kw))
    assert e.shape == (0, 4) and e.dtype == fn(make((1,), dtype, **kw), make((1,), dtype, **kw)).dtype


@pytest.mark.parametrize("dt", [torch.int32, torch.int64, torch.int8, torch.uint8, torch.bool])
def test_integer_and_bool(dt):
    lo = 0 if dt in (torch.uint8, torch.bool) else -20
    x, y = make((5, 9), dt, low=lo, high=20), make((5, 9), dt, low=lo, high=20)
    for op, (fn, name) in INT_OPS.items():
        if dt == torch.bool and op in ("remainder", "fmod"):
            continue   # ATen rejects bool remainder: checked below
        check_op(fn, (x, y), dtype=dt, served_ops=[name])
        check_op(fn, (x.t().contiguous().t(), y[:, :1]), dtype=dt, served_ops=[name])
    if dt == torch.bool:
        with gems.use_gems(), pytest.raises(RuntimeError):
            torch.remainder(x, y)
        return
    # signs of integer remainder / fmod like ATen (Python vs C)
    a = torch.tensor([7, -7, 7, -7, 6, -6], dtype=dt if dt != torch.uint8 else torch.int16).to(DEVICE)
    b = torch.tensor([3, 3, -3, -3, 4, -4], dtype=a.dtype).to(DEVICE)
    for fn, name in ((torch.remainder, "remainder.Tensor"), (torch.fmod, "fmod.Tensor")):
        check_op(fn, (a, b), dtype=a.dtype, served_ops=[name])
        check_op(fn, (a, 3), dtype=a.dtype, served_ops=[name.replace("Tensor", "Scalar")])
    # shifts, in and out of range
    if dt != torch.uint8:
        s = torch.tensor([0, 1, 3, 7, 40, 70, -1], dtype=dt if dt == torch.int64 else torch.int64).to(DEVICE)
        v = torch.tensor([5, -5, 3, -1, 1, -9, 6], dtype=s.dtype).to(DEVICE)
        check_op(torch.bitwise_left_shift, (v, s), dtype=s.dtype, served_ops=["bitwise_left_shift.Tensor"])
        check_op(torch.bitwise_right_shift, (v, s), dtype=s.dtype, served_ops=["bitwise_right_shift.Tensor"])
    check_op(lambda t: t << 2, (x,), dtype=dt, served_ops=["__lshift__.Scalar"])
    check_op(lambda t: t >> 1, (x,), dtype=dt, served_ops=["__rshift__.Scalar"])
    # integer pow: non-negative exponents (negative integer powers are an ATen error)
    e = make((5, 9), dt, low=0, high=4, nonzero=False)
    check_op(torch.pow, (x.clamp(-3, 3) if dt != torch.uint8 else x % 4, e), dtype=dt,
             served_ops=[POW_TT] if POW_TT else [])


@dtype_params()
def test_scalars_and_pow_special_exponents(dtype):
    x = make((5, 7), dtype)
    p = make((5, 7), dtype, low=0.2, high=3)
    # fp16 ** number on the CPU goes to ATen (its Half kernel's C pow for +-0.5: test_special_values)
    pw = [] if dtype == torch.float16 and DEVICE == "cpu" else ["pow.Tensor_Scalar"]
    for e in (2, 3, 0.5, -1, 2.5, -0.5, 0):
        check_op(torch.pow, (p, e), dtype=dtype, served_ops=pw)
    check_op(torch.pow, (x, 2), dtype=dtype, served_ops=pw)
    check_op(torch.pow, (x.round(), 3.0), dtype=dtype, served_ops=pw)
    check_op(torch.pow, (2.0, x), dtype=dtype, served_ops=["pow.Scalar"])
    for fn, name in ((torch.eq, "eq.Scalar"), (torch.lt, "lt.Scalar"), (torch.ge, "ge.Scalar"),
                     (torch.remainder, "remainder.Scalar"), (torch.fmod, "fmod.Scalar")):
        check_op(fn, (x, 0.75), dtype=dtype, served_ops=[name])
    check_op(lambda t: 1.5 % t, (x,), dtype=dtype, served_ops=["remainder.Scalar_Tensor"])


def test_nan_inf_propagation():
    v = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0, 0.0, -0.0, 3.0, float("nan"), -2.0, 1.0])
    w = torch.tensor([1.0, float("inf"), 2.0, float("nan"), 0.0, 5.0, -float("inf"), float("nan"), 3.0, -1.0])
    v, w = v.to(DEVICE), w.to(DEVICE)
    for op, (fn, name, _) in FLOAT_OPS.items():
        check_op(fn, (v, w), dtype=torch.float32, served_ops=[name] if name else [])
    for e in (0.0, float("nan"), 3.0, -3.0, 0.5, 2.0, -1.0, float("inf")):
        check_op(torch.pow, (v, e), dtype=torch.float32, served_ops=["pow.Tensor_Scalar"])


@dtype_params()
def test_out_and_inplace(dtype):
    x, y = make((4, 9), dtype), make((9,), dtype)
    out = torch.full((4, 9), float("nan"), dtype=dtype, device=DEVICE)
    with served("maximum.out"), gems.use_gems():
        r = torch.maximum(x, y, out=out)
    assert r is out
    assert_close(out, torch.maximum(to_ref(x), to_ref(y)), dtype)
    wrong = torch.ones(3, dtype=torch.bool, device=DEVICE)
    with served("lt.Tensor_out"), gems.use_gems(), pytest.warns(UserWarning, match="resized"):
        torch.lt(x, y, out=wrong)
    assert torch.equal(wrong, x < y)
    base = make((9, 4), dtype)
    keep = base.clone()
    a = base.t()
    pw = () if dtype == torch.float16 and DEVICE == "cpu" else ("pow_.Scalar",)   # fp16 ** number: ATen on the CPU
    with served("remainder_.Tensor", "eq_.Scalar", *pw), gems.use_gems():
        a.remainder_(y).pow_(2)
        c = x.clone().eq_(x[0, 0].item())
    ref = torch.remainder(to_ref(keep.t()), to_ref(y)) ** 2
    assert_close(a, ref, dtype, torch.remainder(keep.t(), y) ** 2)
    assert torch.equal(c, (x == x[0, 0]).to(dtype))
    with gems.use_gems(), pytest.raises(RuntimeError):
        make((3,), dtype).pow_(make((2, 3), dtype))          # broadcast would grow self
    with gems.use_gems(), pytest.raises(RuntimeError):
        make((3,), torch.int32).remainder_(1.5)                # float result into an int tensor


def test_fallbacks_counted_and_right():
    x, y = make((4, 5), torch.float64), make((4, 5), torch.float64)
    gems.reset_stats()
    with gems.use_gems():
        r = torch.maximum(x, y)
        s = x.pow(2)
    assert torch.equal(r, torch.maximum(x, y)) and torch.equal(s, x.pow(2))
    st = gems.stats()
    assert st["maximum.default"]["fallback"] == 1 and st["pow.Tensor_Scalar"]["fallback"] == 1


def test_autograd_through_pow_maximum():
    from harness import DTYPES, check_grad
    for dtype in DTYPES:
        a, b = make((5, 6), dtype, low=0.5, high=2.0), make((6,), dtype, low=0.5, high=2.0)
        pw = [] if dtype == torch.float16 and DEVICE == "cpu" else ["pow.Tensor_Scalar"]   # (see above)
        check_grad(lambda p, q: torch.maximum(p.pow(2), q) * p.pow(q), [a, b], dtype=dtype,
                   served_ops=pw + ["maximum.default"] + ([POW_TT] if POW_TT else []))


def test_pow_tensor_tensor_backend_choice():
    # On CUDA, ATen's pow.Scalar calls pow.Tensor_Tensor with a CUDA wrapped number, which cannot
    # reach a Python kernel: Gems leaves that overload unregistered there and serves it elsewhere.
    assert ("pow.Tensor_Tensor" in gems.registered_ops()) == (DEVICE == "cpu")
    x = make((5,), low=0.5, high=2.0)
    with gems.use_gems():
        got = 2.0 ** x
    assert_close(got, 2.0 ** to_ref(x), torch.float32)


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.float32], ids=lambda d: FLOAT_IDS[d])
@pytest.mark.parametrize("op", ["eq", "ne", "lt", "le", "gt", "ge"])
def test_comparison_rounds_numbers_to_the_tensor_dtype(op, dtype):
    """ATen converts a number (and a 0-dim tensor of a wider dtype) to the fp16/bf16 common dtype before
    comparing: x == 0.1 holds for x = half(0.1). The float64 reference cannot show that; ATen's result on
    the same device is the expected value, and these are discrete answers (no tolerance)."""
    vals = [0.1, 1 / 3, 0.7071, 2.5, -1e-3, 1e-40, 6e4]
    x = torch.tensor(vals + [-v for v in vals] + [0.0], dtype=dtype, device=DEVICE)
    x = torch.cat([x, (x * 3.7).to(dtype)])      # neighbours that round differently
    f = getattr(torch, op)
    others = vals + [torch.tensor(0.1), torch.tensor(1 / 3, dtype=torch.float64),
                     torch.tensor(0.7071, device=DEVICE)]
    for v in others:
        for args in ((x, v), (v if isinstance(v, torch.Tensor) else torch.tensor(v, device=DEVICE), x)):
            want = f(*args)
            # a float64 operand is not a dtype Gems serves here: ATen answers (counted), still compared
            ovl = f"{op}.Scalar" if not isinstance(args[1], torch.Tensor) else f"{op}.Tensor"
            f64 = any(isinstance(a, torch.Tensor) and a.dtype == torch.float64 for a in args)
            with (contextlib.nullcontext() if f64 else served(ovl)), gems.use_gems():
                got = f(*args)
            assert torch.equal(got, want), (op, v, x[got != want], got[got != want])


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.float32], ids=lambda d: FLOAT_IDS[d])
@pytest.mark.parametrize("op", ["remainder", "fmod"])
def test_remainder_rounds_a_number_divisor_to_the_tensor_dtype(op, dtype):
    """x % 0.1 divides by half(0.1) in ATen: for x = half(0.1) the answer is 0, not 0.0999 (what the exact
    divisor, and so the float64 reference, gives). Compared with ATen on the same device."""
    x = torch.cat([torch.tensor([0.1, 0.2, 0.3, 1.0, -0.7071, 5.0], dtype=dtype), make((257,), dtype).cpu()])
    x = x.to(DEVICE)
    f = getattr(torch, op)
    for v in (0.1, 0.7071, 1 / 3, -0.3):
        want = f(x, v)
        with served(f"{op}.Scalar"), gems.use_gems():
            got = f(x, v)
        bad = (got != want) & ~(got.isnan() & want.isnan())
        assert not bad.any(), (v, x[bad][:4], got[bad][:4], want[bad][:4])
    if op == "remainder":   # the number as the dividend (remainder.Scalar_Tensor) goes through the same rule
        want = torch.remainder(0.1, x)
        with served("remainder.Scalar_Tensor"), gems.use_gems():
            got = torch.remainder(0.1, x)
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.float32], ids=lambda d: FLOAT_IDS[d])
def test_wider_zero_dim_tensor_reads_like_aten(dtype):
    """x * s with s a 0-dim fp32 (or int64) tensor beside fp16/bf16 x (capturable Adam's step
    tensors): ATen's CUDA kernels round s to x's dtype before computing in fp32; its CPU kernels too,
    except mul's and div's for their second operand, which they read at fp32. Either way Gems gives
    ATen's bits on the same device (no tolerance: 1001 * x differs from bf16(1001) * x by a rounding
    the float64 reference cannot show)."""
    x = make((517,), dtype)
    for s in (torch.tensor(0.1, device=DEVICE), torch.tensor(1 / 3, device=DEVICE),
              torch.tensor(1001, device=DEVICE)):
        for f, ovl in ((torch.mul, "mul.Tensor"), (torch.div, "div.Tensor"), (torch.sub, "sub.Tensor"),
                       (torch.add, "add.Tensor")):
            # s first as well on the CPU, where which operand it is decides (on CUDA: x first only)
            for a, b in ((x, s),) + ((s, x),) * (not ON_GPU):
                want = f(a, b)
                with served(ovl), gems.use_gems():
                    got = f(a, b)
                bad = got != want
                assert got.dtype == want.dtype and torch.equal(got, want), (ovl, s, a.dim(), got[bad][:4], want[bad][:4])


def test_int64_pow_of_large_exponents_wraps_like_aten():
    # exponents in [2**31, 2**32) reach the interpreter as uint32 scalars (its right shift read them as
    # negative); the reference is Python's exact power reduced mod 2**64, which is what C's wrapping
    # products give
    x = torch.tensor([3, -3, 2, 5, 7, -1, 1, 0, -2], dtype=torch.int64, device=DEVICE)
    for e in (2 ** 31, 2 ** 31 + 1, 2 ** 32 - 1, 2 ** 32 + 3, 2 ** 40 + 5):
        want = [((pow(v, e, 2 ** 64) + 2 ** 63) % 2 ** 64) - 2 ** 63 for v in x.tolist()]
        with served("pow.Tensor_Scalar"), gems.use_gems():
            got = x ** e
        assert got.tolist() == want, e
        assert torch.equal(got, x ** e)
        et = torch.full_like(x, e)
        with served(*([POW_TT] if POW_TT else [])), gems.use_gems():
            got = x ** et
        assert got.tolist() == want, e


@pytest.mark.parametrize("n", [0, 3])
def test_bitwise_and_shifts_with_a_float_number_raise_like_aten(n):
    # ATen has no floating bitwise or shift kernel: an integer tensor with a float number raises
    # ("not implemented for 'Float'"), for an empty tensor too, where a kernel would launch nothing
    x = torch.ones(n, dtype=torch.int32, device=DEVICE)
    raises_like_aten([
        lambda: torch.bitwise_and(x, 1.5), lambda: x | 2.5, lambda: torch.bitwise_xor(x, -0.5),
        lambda: torch.bitwise_and(1.5, x), lambda: x << 1.5, lambda: x >> 2.0,
        lambda: torch.bitwise_left_shift(x, 1.5), lambda: torch.bitwise_right_shift(1.5, x),
        lambda: x.clone().__iand__(1.5), lambda: x.clone().__ilshift__(1.0)])
    # an int or bool number is served
    with served("bitwise_and.Scalar", "__lshift__.Scalar"), gems.use_gems():
        r, s = torch.bitwise_and(x, 3), x << 2
    assert r.tolist() == [1] * n and s.tolist() == [4] * n


def test_pow_of_a_subnormal_base():
    # an fp32 subnormal base to a tensor exponent (the GPU fuzz found libdevice's powf several-fold off
    # there: (1e-40) ** -0.455 gave 2.5e17 for 1.6e18); the float64 answer within fp32's tolerance
    base = torch.full((6,), 9.99994610111476e-41, device=DEVICE)
    e = torch.tensor([-0.455, 0.856, -0.384, -0.646, 0.695, -1.1], device=DEVICE)
    want = base.double() ** e.double()
    with served(POW_TT) if POW_TT else contextlib.nullcontext(), gems.use_gems():
        got = torch.pow(base, e)
    assert_close(got, want.float().double(), torch.float32)
    with served("_foreach_pow_.List"), gems.use_gems():
        xs = [base.clone()]
        torch._foreach_pow_(xs, [e])
    assert_close(xs[0], want.float().double(), torch.float32)
