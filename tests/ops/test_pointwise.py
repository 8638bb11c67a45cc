"""Pointwise ops from gems.codegen: add, sub, rsub, mul, div (all rounding modes), neg, exp, silu, gelu
(+ backwards) against ATen in float64, over layouts, broadcasting, scalars, 0-dim, empty, out=, in-place."""
import contextlib
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import gems
from gems.codegen.numbers import call_with_numbers, numbers_to_tensors, tensor_positions
from harness import DEVICE, DTYPES, assert_close, check_grad, check_op, dtype_params, layouts, make, served, to_ref

BINARY = {
    "add": (torch.add, "add.Tensor"),
    "sub": (torch.sub, "sub.Tensor"),
    "mul": (torch.mul, "mul.Tensor"),
    "div": (torch.div, "div.Tensor"),
}
UNARY = {
    "exp": (torch.exp, "exp"),
    "neg": (torch.neg, "neg"),
    "silu": (F.silu, "silu"),
    "gelu": (F.gelu, "gelu"),
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), "gelu"),
}


def _aten_strides(fn, *args, **kw):
    return fn(*args, **kw).stride()


def _check_strides(out, fn, args, kwargs=None):
    ref = fn(*args, **(kwargs or {}))
    # size-1 dims carry no layout; every other stride must equal ATen's
    got = [s for s, n in zip(out.stride(), out.shape) if n != 1]
    want = [s for s, n in zip(ref.stride(), ref.shape) if n != 1]
    assert got == want, f"strides {out.stride()} vs ATen {ref.stride()}"


@dtype_params()
@pytest.mark.parametrize("op", sorted(UNARY))
def test_unary_layouts(op, dtype):
    fn, name = UNARY[op]
    for lname, x in layouts((6, 19), dtype) + [("3d-permuted", make((3, 4, 5), dtype).permute(2, 0, 1)),
                                               ("odd", make((1031,), dtype))]:
        out = check_op(fn, (x,), dtype=dtype, served_ops=[name])
        _check_strides(out, fn, (x,))


def test_unary_edge_values_and_shapes():
    x = torch.tensor([0.0, -0.0, 1e-30, -50.0, 50.0, 88.0, -88.0, float("inf"), -float("inf"), float("nan"), 3.0, -3.0])
    for op in sorted(UNARY):
        fn, name = UNARY[op]
        check_op(fn, (x.to(DEVICE),), dtype=torch.float32, served_ops=[name])
        check_op(fn, (make((), torch.float32),), dtype=torch.float32, served_ops=[name])
        with gems.use_gems():
            e = fn(make((0, 5)))
        assert e.shape == (0, 5)
    # tanh helper accuracy near 0 and at moderate values (gelu tanh and its backward rely on it)
    small = torch.linspace(-1.0, 1.0, 257).to(DEVICE)
    check_op(lambda t: F.gelu(t, approximate="tanh"), (small,), dtype=torch.float32, served_ops=["gelu"])


def test_exp_on_integers_and_bool_promotes_to_float():
    for dt in (torch.int32, torch.int64, torch.uint8, torch.bool):
        x = make((5, 7), dt, low=-5, high=5) if dt != torch.uint8 else make((5, 7), dt, low=0, high=5)
        out = check_op(torch.exp, (x,), dtype=torch.float32, served_ops=["exp"])
        assert out.dtype == torch.float32


@dtype_params()
def test_unary_out_and_inplace(dtype):
    for op, (fn, name) in UNARY.items():
        x = make((4, 9), dtype)
        kw = {"approximate": "tanh"} if op == "gelu_tanh" else {}
        aten = getattr(torch.ops.aten, name)
        out = torch.full((4, 9), float("nan"), dtype=dtype, device=DEVICE)
        with served(f"{name}.out"), gems.use_gems():
            aten.out(x, out=out, **kw)
        assert_close(out, aten.default(to_ref(x), **kw), dtype, aten.default(x, **kw))
        wrong = torch.full((2,), float("nan"), dtype=dtype, device=DEVICE)
        with gems.use_gems(), pytest.warns(UserWarning, match="resized"):
            aten.out(x, out=wrong, **kw)
        assert wrong.shape == (4, 9)
        assert_close(wrong, aten.default(to_ref(x), **kw), dtype, aten.default(x, **kw))
        # in-place on a non-contiguous view writes through the view only
        base = make((9, 8), dtype)
        keep = base.clone()
        view = base.t()[:, ::2]
        with served(f"{name}_"), gems.use_gems():
            r = getattr(torch.ops.aten, name + "_").default(view, **kw)
        assert r is view
        assert_close(view, aten.default(to_ref(keep.t()[:, ::2]), **kw), dtype, aten.default(keep.t()[:, ::2], **kw))
        assert torch.equal(base.t()[:, 1::2], keep.t()[:, 1::2])


def test_gelu_rejects_unknown_approximation_like_aten():
    with gems.use_gems(), pytest.raises(RuntimeError):
        F.gelu(make((3,)), approximate="erf")


@dtype_params()
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_backward(dtype, approximate):
    check_grad(lambda x: F.gelu(x, approximate=approximate), [make((7, 33), dtype)], dtype=dtype,
               served_ops=["gelu_backward"])
    gelu_bwd = torch.ops.aten.gelu_backward
    g, x = make((5, 6), dtype), make((6, 5), dtype).t()         # non-contiguous self
    check_op(lambda a, b: gelu_bwd(a, b, approximate=approximate), (g, x), dtype=dtype,
             served_ops=["gelu_backward"])
    gi = torch.empty(5, 6, dtype=dtype, device=DEVICE)
    with served("gelu_backward.grad_input"), gems.use_gems():
        gelu_bwd.grad_input(g, x, approximate=approximate, grad_input=gi)
    assert_close(gi, gelu_bwd(to_ref(g), to_ref(x), approximate=approximate), dtype,
                 gelu_bwd(g, x, approximate=approximate))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_gelu_tanh_negative_tail_is_accurate(dtype):
    # x in [-5.5, -3]: 1 + tanh(inner) is ~1e-5..1e-3, and forming it from a rounded tanh leaves
    # tanh's absolute error in it (fp16 results 2% off at x = -4.4); Gems forms it without the
    # cancellation: fp16 results correctly rounded from the float64 value (the fp32 compute is far
    # finer than fp16), fp32 within the error the rounded cubic argument carries (~8 ulp per unit)
    x = torch.linspace(-5.5, -3.0, 2001, device=DEVICE).to(dtype)
    g = torch.ones_like(x)
    tiny, rel, ulps = (2.0 ** -24, 2.0 ** -10, 1.0) if dtype == torch.float16 else (2.0 ** -149, 2.0 ** -23, 64.0)
    for name, fn in (("gelu", lambda t, gr: torch.ops.aten.gelu(t, approximate="tanh")),
                     ("gelu_backward", lambda t, gr: torch.ops.aten.gelu_backward(gr, t, approximate="tanh"))):
        with served(name), gems.use_gems():
            got = fn(x, g).cpu().double()
        ref = fn(to_ref(x), to_ref(g)).cpu()
        spacing = (ref.abs() * rel).clamp(min=tiny)
        worst = ((got - ref).abs() / spacing).max().item()
        assert worst <= ulps, f"{name}: {worst:.2f} ulps off the float64 value"


def test_gelu_backward_negative_tail_is_accurate():
    # 'none' in x in [-13, -3]: Phi(x) = (1 + erf(x / sqrt(2))) / 2 cancels (1 + erf is ~1e-6 at x = -4.8,
    # 0 below -5.45 in fp32) while x phi(x) does not: formed so, the derivative was 3e-4 off its value at
    # -4.8 and wholly x phi(x) below; Gems takes Phi = erfc(-x / sqrt(2)) / 2. fp32 within 64 ulp of float64
    # (exp's and erfc's own errors, times the terms' partial cancellation), and an infinite grad gives the
    # opposite infinity where the derivative is a tiny negative number
    x = torch.linspace(-13.0, -3.0, 2001, device=DEVICE)
    g = torch.full_like(x, 65000.0)
    with served("gelu_backward"), gems.use_gems():
        got = torch.ops.aten.gelu_backward(g, x).cpu().double()
        inf = torch.ops.aten.gelu_backward(torch.full_like(x, float("-inf")), x).cpu()
    x64 = x.cpu().double()     # (ATen's formula cancels in float64 too, below x = -8)
    ref = 65000.0 * (0.5 * torch.erfc(-x64 / math.sqrt(2)) + x64 * torch.exp(-0.5 * x64 * x64) / math.sqrt(2 * math.pi))
    worst = ((got - ref).abs() / (ref.abs() * 2.0 ** -23).clamp(min=2.0 ** -149)).max().item()
    assert worst <= 64, f"{worst:.1f} ulps off the float64 value"
    assert (inf == float("inf")).all(), inf[inf != float("inf")]


@dtype_params()
def test_silu_exp_backward(dtype):
    check_grad(F.silu, [make((7, 33), dtype)], dtype=dtype, served_ops=["silu_backward"])
    g, x = make((4, 5), dtype), make((4, 5), dtype)
    gi = torch.empty(4, 5, dtype=dtype, device=DEVICE)
    with served("silu_backward.grad_input"), gems.use_gems():
        torch.ops.aten.silu_backward.grad_input(g, x, grad_input=gi)
    assert_close(gi, torch.ops.aten.silu_backward(to_ref(g), to_ref(x)), dtype, torch.ops.aten.silu_backward(g, x))
    # exp's backward is grad * result: mul.Tensor, served once binary overloads are registered
    check_grad(torch.exp, [make((6, 7), dtype, low=-2, high=2)], dtype=dtype, served_ops=["exp"])


# ---------------------------------------------------------------------------------------------
# binary ops
# ---------------------------------------------------------------------------------------------

def _pairs(dtype):
    a = make((6, 19), dtype)
    out = [(n, x, make((6, 19), dtype)) for n, x in layouts((6, 19), dtype)]
    out += [("t+t", make((6, 19), dtype).t(), make((6, 19), dtype).t()),      # a.T + a.T: transposed result
            ("a+a.T", make((8, 8), dtype), make((8, 8), dtype).t()),
            ("row", make((6, 19), dtype), make((19,), dtype)),
            ("col x row", make((6, 1), dtype), make((1, 19), dtype)),
            ("rank-3 bcast", make((3, 1, 5), dtype), make((4, 1), dtype)),
            ("0-dim", make((6, 19), dtype), make((), dtype)),
            ("0-dim first", make((), dtype), make((2, 3), dtype)),
            ("both 0-dim", make((), dtype), make((), dtype)),
            ("permuted 3d", make((4, 5, 6), dtype).permute(1, 2, 0), make((5, 6, 4), dtype)),
            ("empty", make((0, 4), dtype), make((0, 4), dtype))]
    return out


@dtype_params()
@pytest.mark.parametrize("op", sorted(BINARY))
def test_binary_layouts_broadcast(op, dtype):
    fn, name = BINARY[op]
    for lname, x, y in _pairs(dtype):
        if x.numel() == 0:   # harness.assert_close's 2x-ATen rule cannot reduce over empty tensors
            with gems.use_gems():
                out = fn(x, y)
            assert out.shape == fn(x, y).shape and out.dtype == dtype
            continue
        out = check_op(fn, (x, y), dtype=dtype, served_ops=[name])
        _check_strides(out, fn, (x, y))


@dtype_params()
@pytest.mark.parametrize("op", sorted(BINARY))
def test_binary_python_scalars(op, dtype):
    fn, name = BINARY[op]
    x = make((5, 7), dtype)
    for s in (2.5, -3) + ((True,) if op != "sub" else ()):
        check_op(fn, (x, s), dtype=dtype, served_ops=[name])
    if op == "sub":
        with gems.use_gems(), pytest.raises(RuntimeError):
            fn(x, True)                               # ATen rejects `-` with bool
    for s in (2.5, 3):   # reflected: `2 - x` reaches rsub.Scalar -> sub.Tensor(2, x)
        check_op(lambda t: {"add": s + t, "sub": s - t, "mul": s * t, "div": s / t}[op], (x,), dtype=dtype)


def test_alpha_and_rsub():
    x, y = make((4, 6)), make((4, 6))
    for alpha in (2, -0.5):
        check_op(torch.add, (x, y), {"alpha": alpha}, dtype=torch.float32, served_ops=["add.Tensor"])
        check_op(torch.sub, (x, y), {"alpha": alpha}, dtype=torch.float32, served_ops=["sub.Tensor"])
        check_op(torch.rsub, (x, y), {"alpha": alpha}, dtype=torch.float32, served_ops=["rsub.Tensor"])
        check_op(torch.add, (x, 1.5), {"alpha": alpha}, dtype=torch.float32)
    check_op(torch.rsub, (x, 2.0), dtype=torch.float32, served_ops=["rsub.Scalar"])


def test_alpha_product_is_fused_like_aten():
    # ATen computes self + alpha * other as one fused multiply-add (CPU fmadd, CUDA contraction): a
    # product past fp32's range beside an infinity of its sign is that infinity (unfused: inf - inf =
    # NaN), and the product's own rounding error survives a cancellation (unfused: exactly 0)
    inf = float("inf")
    big = torch.tensor([3.0, 200.0, 1.0], device=DEVICE)
    far = torch.tensor([inf, -inf, 1e38], device=DEVICE)
    cases = [(torch.add, (-far, big), -far), (torch.sub, (far, big), far), (torch.rsub, (big, far), far)]
    for fn, args, want_first2 in cases:
        name = fn.__name__ + ".Tensor"
        with served(name), gems.use_gems():
            got = fn(*args, alpha=3e38)
        assert got[:2].tolist() == want_first2[:2].tolist(), fn
        # finite: one rounding of the exact value (alpha read at fp32, ATen's opmath)
        ref = fn(*(t.double() for t in args), alpha=torch.tensor(3e38).item()).float()
        assert got[2].item() == ref[2].item(), fn
        assert torch.equal(got, fn(*args, alpha=3e38))
    with served("rsub.Scalar"), gems.use_gems():
        got = torch.rsub(torch.tensor(200, dtype=torch.uint8, device=DEVICE), inf, alpha=3e38)
    assert got.item() == inf
    # cancellation: a = -(b * alpha) rounded; b * alpha + a is then the product's rounding error, exact
    alpha = 1.0000001
    a32 = torch.tensor(alpha, dtype=torch.float32).item()
    b = torch.full((7,), 1.0000001, device=DEVICE)
    a = -(b * a32)
    err = b[0].double().item() * a32 + a[0].double().item()
    assert err != 0
    for fn, args, sign in ((torch.add, (a, b), 1), (torch.sub, (-a, b), -1), (torch.rsub, (b, -a), -1)):
        with served(fn.__name__ + ".Tensor"), gems.use_gems():
            got = fn(*args, alpha=alpha)
        assert got.double().tolist() == [sign * err] * 7, fn
        assert torch.equal(got, fn(*args, alpha=alpha))


@pytest.mark.parametrize("dt", [torch.int32, torch.int64, torch.int8, torch.uint8])
def test_integer_arithmetic(dt):
    lo = 0 if dt == torch.uint8 else -20
    x, y = make((5, 9), dt, low=lo, high=20), make((5, 9), dt, low=lo, high=20)
    for fn, name in [(torch.add, "add.Tensor"), (torch.sub, "sub.Tensor"), (torch.mul, "mul.Tensor")]:
        out = check_op(fn, (x, y), dtype=dt, served_ops=[name])
        assert out.dtype == dt
    check_op(torch.neg, (x,), dtype=dt, served_ops=["neg"]) if dt != torch.uint8 else None
    out = check_op(torch.div, (x, y), dtype=torch.float32, served_ops=["div.Tensor"])
    assert out.dtype == torch.float32                                   # true division promotes
    for mode in ("trunc", "floor"):
        out = check_op(torch.div, (x, y), {"rounding_mode": mode}, dtype=dt, served_ops=["div.Tensor_mode"])
        assert out.dtype == dt
    check_op(torch.add, (x, 3), dtype=dt)
    out = check_op(torch.mul, (x, 2.5), dtype=torch.float32)             # int tensor * float -> float
    assert out.dtype == torch.float32


@dtype_params()
def test_div_rounding_modes_floats(dtype):
    x = make((6, 50), dtype, low=-10, high=10)
    y = make((6, 50), dtype, low=-3, high=3)
    x[0, :4] = torch.tensor([7.0, -7.0, 6.0, -6.0])
    y[0, :4] = torch.tensor([2.0, 2.0, -3.0, 3.0])
    for mode in (None, "trunc", "floor"):
        check_op(torch.div, (x, y), {"rounding_mode": mode}, dtype=dtype, served_ops=["div.Tensor_mode"], atol=1e-3)
        check_op(torch.div, (x, 2.5), {"rounding_mode": mode}, dtype=dtype, atol=1e-3)


def test_nan_inf_propagation():
    v = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0, 0.0, -0.0, 3.0, float("inf")])
    w = torch.tensor([1.0, float("inf"), 2.0, float("nan"), 0.0, 5.0, 0.0, -float("inf")])
    for fn, name in BINARY.values():
        check_op(fn, (v.to(DEVICE), w.to(DEVICE)), dtype=torch.float32, served_ops=[name])


@dtype_params()
def test_binary_out_and_inplace(dtype):
    x, y = make((4, 9), dtype), make((9,), dtype)
    out = torch.full((4, 9), float("nan"), dtype=dtype, device=DEVICE)
    with served("add.out"), gems.use_gems():
        r = torch.add(x, y, alpha=2, out=out)
    assert r is out
    assert_close(out, to_ref(x) + 2 * to_ref(y), dtype, torch.add(x, y, alpha=2))
    wrong = torch.full((3,), float("nan"), dtype=dtype, device=DEVICE)
    with gems.use_gems(), pytest.warns(UserWarning, match="resized"):
        torch.mul(x.t(), 3.0, out=wrong)
    assert wrong.shape == (9, 4) and wrong.stride() == torch.mul(x.t(), 3.0).stride()   # resized like ATen
    assert_close(wrong, to_ref(x.t()) * 3.0, dtype, x.t() * 3.0)
    # in-place with a broadcast operand, on a non-contiguous self
    base = make((9, 4), dtype)
    keep = base.clone()
    a = base.t()
    with served("add_.Tensor"), gems.use_gems():
        r = a.add_(y.unsqueeze(0).expand(4, 9)[:, :], alpha=-1)
    assert r is a
    assert_close(a, to_ref(keep.t()) - to_ref(y), dtype, keep.t() - y)
    # in-place with Python scalars and 0-dim tensors
    z = make((3, 5), dtype)
    zk = z.clone()
    with gems.use_gems():
        z.mul_(2.0).sub_(make((), dtype).fill_(1.0)).div_(4)
    assert_close(z, (to_ref(zk) * 2 - 1) / 4, dtype, (zk * 2 - 1) / 4)


def _direct(name):
    # the generated wrapper itself (registered or held back): the checks run in Gems, not in ATen
    from gems.ops.pointwise import arith
    for op in (arith.add, arith.sub, arith.mul, arith.div, arith.div_mode):
        if name in op.overloads:
            return op.overloads[name].fn
    raise KeyError(name)


def test_inplace_errors_like_aten():
    add_, add = _direct("add_.Tensor"), _direct("add.Tensor")
    x = make((3,))
    with pytest.raises(RuntimeError, match="doesn't match the broadcast shape"):
        add_(x, make((2, 3)))                         # broadcast would grow self
    with pytest.raises(RuntimeError, match="can't be cast"):
        add_(make((4,), torch.int64), 1.5)            # float result cannot be stored in an int tensor
    with pytest.raises(gems.Unsupported):             # self has overlapping elements: ATen decides
        add_(make((1, 3)).expand(2, 3), 1.0)
    with gems.use_gems(), pytest.raises(RuntimeError, match="single memory location"):
        make((1, 3)).expand(2, 3).add_(1.0)           # and raises, as it does for add_
    w = make((8,))
    with pytest.raises(RuntimeError, match="single memory location"):
        add_(w[1:], w[:-1])                           # partial overlap with an input
    with pytest.raises(RuntimeError):
        add(make((2, 3)), make((4,)))                 # not broadcastable
    v = make((5,))
    vk = v.clone()
    add_(v, v)                                        # full overlap is fine
    assert torch.equal(v, vk * 2)
    # and through the dispatcher: ATen (or Gems, once registered) raises the same type
    with gems.use_gems(), pytest.raises(RuntimeError):
        x.add_(make((2, 3)))


def test_direct_wrappers_cover_binary_semantics():
    add, mul, sub, div = (_direct(n) for n in ("add.Tensor", "mul.Tensor", "sub.Tensor", "div.Tensor"))
    divm = _direct("div.Tensor_mode")
    a, b = make((6, 19)), make((19, 6)).t()
    assert_close(add(a, b, alpha=2), to_ref(a) + 2 * to_ref(b), torch.float32)
    r = add(a.t(), a.t())
    assert r.stride() == (a.t() + a.t()).stride()
    assert_close(mul(a, 2.5), to_ref(a) * 2.5, torch.float32)
    assert_close(sub(3, a), 3 - to_ref(a), torch.float32)
    assert_close(div(a, b), to_ref(a) / to_ref(b), torch.float32)
    xi, yi = make((7, 9), torch.int32, low=-20, high=20), make((7, 9), torch.int32, low=-6, high=6)
    for mode in ("trunc", "floor"):
        assert torch.equal(divm(xi, yi, rounding_mode=mode), torch.div(xi, yi, rounding_mode=mode))
    assert torch.equal(mul(xi, 3), xi * 3) and mul(xi, 3).dtype == torch.int32
    assert div(xi, yi).dtype == torch.float32
    with pytest.warns(UserWarning, match="resized"):
        o = _direct("add.out")(a, b, out=torch.empty(2, device=DEVICE))
    assert_close(o, to_ref(a) + to_ref(b), torch.float32)


def test_numbers_to_tensors_matches_wrapped_number_promotion():
    pos = tensor_positions(torch.ops.aten.mul.Tensor._schema)
    assert pos == (0, 1)
    cases = [(make((3,)), 2.5), (make((3,), torch.float16), 2.5), (make((3,), torch.int32), 2.5),
             (make((3,), torch.int8), 3), (make((3,), torch.bool), 3), (make((), torch.float16), 2.5),
             (make((3,), torch.float64), 0.1), (make((), torch.int16), 7), (make((3,), torch.bool), True)]
    for t, n in cases:
        args = numbers_to_tensors((t, n), pos)
        assert isinstance(args[1], torch.Tensor)
        want = torch.mul(t, n)
        got = torch.mul(*args)
        assert got.dtype == want.dtype, (t.dtype, n, got.dtype, want.dtype)
        assert torch.equal(got, want)


def test_a_complex_number_reaches_division_unrounded():
    # ATen's CUDA division reads a wrapped complex number as complex128 (x * (1 / v)); a complex64 copy of
    # v rounds it first. The integer, bool or 0-dim tensors are cast to the result dtype instead, so the
    # number can stay complex128 without changing the result dtype
    seen = []

    def call(*args, **kwargs):
        seen.append(args)
        return torch.div(*args, **kwargs)
    pos = tensor_positions(torch.ops.aten.div.Tensor._schema)
    for t in (make((3,), torch.int64), make((2,), torch.bool), make((), torch.float32), make((), torch.int8)):
        seen.clear()
        got = call_with_numbers(call, (t, 0.1 - 1e-3j), pos, {}, promotes_all=True)
        (a, v), = seen
        assert v.dtype == torch.complex128 and v.dim() == 0 and a.dtype == torch.complex64 and a.dim() == 1
        want = torch.div(t, 0.1 - 1e-3j)
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    # a dimensioned float tensor decides the precision: nothing is cast
    seen.clear()
    x = make((3,))
    call_with_numbers(call, (x, 2j), pos, {}, promotes_all=True)
    assert seen[0][0] is x and seen[0][1].dtype == torch.complex128


def _out_of_range_int_cases():
    i8 = lambda v: torch.tensor(v, dtype=torch.int8, device=DEVICE)  # noqa: E731
    f32 = lambda: torch.empty((), device=DEVICE)  # noqa: E731
    return {
        # all-0-dim integer tensors and an int beyond their dtype: ATen wraps it where it computes
        # in that dtype and reads it exactly where it computes in float
        "add": lambda: i8(1) + 300, "sub": lambda: i8(1) - 300, "mul": lambda: i8(3) * 300,
        "rsub": lambda: 300 - i8(44), "eq": lambda: i8(44) == 300, "lt": lambda: i8(44) < 300,
        "and": lambda: i8(44) & 300, "remainder": lambda: torch.remainder(i8(100), 300),
        "div": lambda: i8(100) / 300, "rdiv": lambda: 300 / i8(44), "xlogy": lambda: torch.xlogy(i8(44), 300),
        "copysign": lambda: torch.copysign(i8(44), 300), "u8 sub": lambda: torch.tensor(5, dtype=torch.uint8,
                                                                                          device=DEVICE) - 300,
        "add_": lambda: i8(1).add_(300), "add float out": lambda: torch.add(i8(1), 300, out=f32()),
        "div float out": lambda: torch.div(i8(100), 300, out=f32()),
        "float 0-dim beside": lambda: torch.add(i8(1), 300) + torch.tensor(0.5, device=DEVICE),
        "i8 + f32 0-dim + 300": lambda: torch.where(torch.tensor(True, device=DEVICE), i8(1), 300),
    }


def test_out_of_range_int_numbers_like_aten():
    # reference: ATen alone (Gems' registrations removed). Gems on, or registered and out of scope
    # (its Python kernel passes numbers back to ATen as tensors), must give ATen's value and dtype
    gems.disable()
    want = {}
    for k, f in _out_of_range_int_cases().items():
        try:
            want[k] = f()
        except Exception as e:  # noqa: BLE001
            want[k] = type(e)
    with gems.use_gems():
        pass                      # registered from here on
    for mode in ("out of scope", "on"):
        for k, f in _out_of_range_int_cases().items():
            with (gems.use_gems() if mode == "on" else contextlib.nullcontext()):
                try:
                    got = f()
                except Exception as e:  # noqa: BLE001
                    got = type(e)
            w = want[k]
            if isinstance(w, type):
                assert got is w, (mode, k, got, w)
            else:
                assert isinstance(got, torch.Tensor) and got.dtype == w.dtype and torch.equal(got, w), \
                    (mode, k, got, w)


def test_fallbacks_are_counted_and_right():
    x = make((4, 5), torch.float64)
    gems.reset_stats()
    with gems.use_gems():
        y = torch.exp(x)
    assert torch.equal(y, torch.exp(x))
    assert gems.stats()["exp.default"]["fallback"] == 1
    with gems.use_gems():
        y = F.silu(make((4, 5), torch.float64))
    assert gems.stats()["silu.default"]["fallback"] == 1


def test_fallback_with_python_number_in_tensor_slot():
    x = make((4, 5), torch.float64)
    with gems.use_gems():
        y = x * 0.1
        z = 2 - x
    assert torch.equal(y, x.double() * 0.1) and torch.equal(z, 2 - x)


def test_autograd_through_binary_ops():
    for dtype in DTYPES:
        # |p*q + p/q - q| <= 6 keeps exp() far from fp16's overflow
        a, b = make((5, 6), dtype, low=-1.0, high=1.0), make((6,), dtype, low=0.5, high=2.0)
        check_grad(lambda p, q: (p * q + p / q - q).exp() * 0.5, [a, b], dtype=dtype,
                   served_ops=["mul.Tensor", "div.Tensor"])
