"""Activations and backward ops (gems/ops/pointwise/activation.py) against ATen in float64, table-driven:
forward over layouts / 0-dim / empty / kinks and NaN, out= and in-place, gradients through autograd (each
op's backward overload must be served), the backward overloads called directly (non-contiguous, .grad_input),
fallback and ATen's errors."""
import pytest
import torch
import torch.nn.functional as F

import gems
from harness import DEVICE, ON_GPU, assert_close, check_grad, check_op, dtype_params, layouts, make, served, to_ref

A = torch.ops.aten
# name -> (aten op packet, kwargs variants, domain, backward overload served by autograd or None,
#          in-place overload or None, .out overload or None)
OPS = {
    "relu": (A.relu, [{}], (-3, 3), "threshold_backward", "relu_", None),
    "softplus": (A.softplus, [{}, {"beta": 2.0, "threshold": 1.5}], (-12, 12), "softplus_backward", None, "softplus.out"),
    "elu": (A.elu, [{}, {"alpha": 0.7, "scale": 1.3, "input_scale": 0.8}], (-4, 3), "elu_backward", "elu_", "elu.out"),
    "leaky_relu": (A.leaky_relu, [{}, {"negative_slope": 0.2}], (-3, 3), "leaky_relu_backward", "leaky_relu_",
                   "leaky_relu.out"),
    "hardtanh": (A.hardtanh, [{}, {"min_val": -0.5, "max_val": 2.0}], (-3, 3), "hardtanh_backward", "hardtanh_",
                 "hardtanh.out"),
    "hardsigmoid": (A.hardsigmoid, [{}], (-5, 5), "hardsigmoid_backward", "hardsigmoid_", "hardsigmoid.out"),
    "hardswish": (A.hardswish, [{}], (-5, 5), "hardswish_backward", "hardswish_", "hardswish.out"),
    "mish": (A.mish, [{}], (-6, 6), "mish_backward", "mish_", "mish.out"),
    "logit": (A.logit, [{}, {"eps": 0.05}], (0.01, 0.99), "logit_backward", "logit_", "logit.out"),
    "sigmoid": (A.sigmoid, [{}], (-6, 6), "sigmoid_backward", None, None),
    "tanh": (A.tanh, [{}], (-4, 4), "tanh_backward", None, None),
}
FWD = sorted(k for k in OPS if k not in ("sigmoid", "tanh"))     # sigmoid/tanh forward: tests/ops/test_unary.py
# values at and around every op's kinks, plus non-finite ones
KINKS = [0.0, -0.0, 1e-6, -1e-6, 3.0, -3.0, 2.9, -2.9, 6.0, -6.0, 1.0, -1.0, 2.0, -0.5, 0.5, 0.05, 0.95,
         20.0, 21.0, -20.0, 40.0, -40.0, float("nan"), float("inf"), -float("inf")]


def _fwd(op, kw):
    packet = OPS[op][0]
    return lambda x: packet.default(x, **kw)


@dtype_params()
@pytest.mark.parametrize("op", FWD)
def test_forward_layouts(op, dtype):
    packet, kws, (lo, hi), _, _, _ = OPS[op]
    for kw in kws:
        fn = _fwd(op, kw)
        xs = layouts((6, 19), dtype, low=lo, high=hi) + [("0-dim", make((), dtype, low=lo, high=hi)),
                                                         ("odd", make((1031,), dtype, low=lo, high=hi))]
        for lname, x in xs:
            out = check_op(fn, (x,), dtype=dtype, served_ops=[op])
            want = fn(x)
            assert [s for s, n in zip(out.stride(), out.shape) if n != 1] == \
                [s for s, n in zip(want.stride(), want.shape) if n != 1], lname
        with served(op), gems.use_gems():
            e = fn(make((0, 3), dtype))
        assert e.shape == (0, 3)


@pytest.mark.parametrize("op", FWD)
def test_forward_kinks_and_nonfinite(op):
    x = torch.tensor(KINKS).to(DEVICE)
    for kw in OPS[op][1]:
        check_op(_fwd(op, kw), (x,), dtype=torch.float32, served_ops=[op])


@dtype_params()
@pytest.mark.parametrize("op", FWD)
def test_out_and_inplace(op, dtype):
    packet, kws, (lo, hi), _, inplace, out_name = OPS[op]
    kw = kws[-1]
    x = make((4, 9), dtype, low=lo, high=hi)
    if out_name is not None:
        out = torch.full((4, 9), float("nan"), dtype=dtype, device=DEVICE)
        with served(out_name), gems.use_gems():
            r = packet.out(x, out=out, **kw)
        assert r is out
        assert_close(out, packet.default(to_ref(x), **kw), dtype, packet.default(x, **kw))
        wrong = torch.zeros((3,), dtype=dtype, device=DEVICE)
        with gems.use_gems(), pytest.warns(UserWarning, match="resized"):
            packet.out(x.t(), out=wrong, **kw)
        assert wrong.shape == (9, 4)
        assert_close(wrong, packet.default(to_ref(x.t()), **kw), dtype, packet.default(x.t(), **kw))
    if inplace is not None:
        base = make((9, 8), dtype, low=lo, high=hi)
        keep = base.clone()
        view = base.t()[:, ::2]
        with served(inplace), gems.use_gems():
            r = getattr(A, inplace).default(view, **kw)
        assert r is view
        ref_in = to_ref(keep.t()[:, ::2])
        assert_close(view, packet.default(ref_in, **kw), dtype, packet.default(keep.t()[:, ::2], **kw))
        assert torch.equal(base.t()[:, 1::2], keep.t()[:, 1::2])


# autograd: the module-level functions that models call, each must reach its backward overload
GRAD_FNS = {
    "relu": lambda t: F.relu(t),
    "softplus": lambda t: F.softplus(t, beta=1.5, threshold=4.0),
    "elu": lambda t: F.elu(t, alpha=0.8),
    "elu_inplace": lambda t: F.elu(t * 1.0, alpha=0.8, inplace=True),          # is_result=True path
    "selu": lambda t: F.selu(t),
    "leaky_relu": lambda t: F.leaky_relu(t, 0.1),
    "leaky_relu_inplace": lambda t: F.leaky_relu(t * 1.0, 0.1, inplace=True),  # self_is_result=True
    "hardtanh": lambda t: F.hardtanh(t, -1.5, 1.5),
    "hardsigmoid": F.hardsigmoid,
    "hardswish": F.hardswish,
    "mish": F.mish,
    "logit": lambda t: torch.logit(t.sigmoid()),
    "logit_eps": lambda t: torch.logit(t.sigmoid(), eps=0.2),
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
}
GRAD_SERVED = {"elu_inplace": "elu_backward", "selu": "elu_backward", "leaky_relu_inplace": "leaky_relu_backward",
               "logit_eps": "logit_backward"}


def _served(name, dtype):
    # ATen's fp16 kernels that round each step to fp16 serve those calls (sigmoid_backward everywhere,
    # tanh_backward on CUDA): test_fp16_backward_like_aten
    rounds = name.startswith("sigmoid_backward") or (name.startswith("tanh_backward") and ON_GPU)
    return [] if rounds and dtype == torch.float16 else [name]


@dtype_params()
@pytest.mark.parametrize("name", sorted(GRAD_FNS))
def test_gradients(name, dtype):
    bw = GRAD_SERVED.get(name) or OPS[name][3]
    x = make((7, 13), dtype, low=-4, high=4)
    check_grad(GRAD_FNS[name], [x], dtype=dtype, served_ops=_served(bw, dtype))


@pytest.mark.parametrize("name", ["sigmoid_backward", "tanh_backward"])
def test_fp16_backward_like_aten(name):
    # products past fp16's range on the way (an output outside the function's range): ATen's fp16
    # kernels round each step to fp16 (inf here; tanh_backward's CPU kernel computes in fp32: finite).
    # Gems gives ATen's answer on each device
    g = torch.tensor([64992.0, -1.85, 0.97, 30000.0, 1.0], dtype=torch.float16, device=DEVICE)
    y = torch.tensor([-0.6196, -0.6196, 0.3, 2.5, 300.0], dtype=torch.float16, device=DEVICE)
    op = getattr(A, name)
    want = op(g, y)
    with served(*_served(name, torch.float16)), gems.use_gems():
        got = op(g, y)
    assert want.isinf().any() or (name == "tanh_backward" and not ON_GPU)
    assert torch.equal(got.isinf(), want.isinf()), (got, want)
    fin = ~want.isinf()
    assert_close(got[fin], to_ref(want)[fin.cpu()], torch.float16)


# direct calls of the backward overloads: (aten packet, extra positional args, operand domain)
BWD = {
    "threshold_backward": (A.threshold_backward, (0.5,), (-3, 3)),
    "sigmoid_backward": (A.sigmoid_backward, (), (0.01, 0.99)),
    "tanh_backward": (A.tanh_backward, (), (-0.99, 0.99)),
    "softplus_backward": (A.softplus_backward, (2.0, 3.0), (-4, 4)),
    "elu_backward": (lambda g, x, *a, **k: A.elu_backward.default(g, 0.9, 1.2, 0.7, False, x, **k)
                     if not k else A.elu_backward.grad_input(g, 0.9, 1.2, 0.7, False, x, **k), (), (-3, 3)),
    "leaky_relu_backward": (A.leaky_relu_backward, (0.3, False), (-3, 3)),
    "hardtanh_backward": (A.hardtanh_backward, (-1.0, 1.5), (-3, 3)),
    "hardsigmoid_backward": (A.hardsigmoid_backward, (), (-5, 5)),
    "hardswish_backward": (A.hardswish_backward, (), (-5, 5)),
    "mish_backward": (A.mish_backward, (), (-5, 5)),
    "logit_backward": (A.logit_backward, (None,), (-0.2, 1.2)),
}


def _bcall(name, g, x, **k):
    p, extra, _ = BWD[name]
    if callable(p) and not hasattr(p, "default"):
        return p(g, x, **k)
    return (p.grad_input if k else p.default)(g, x, *extra, **k)


@dtype_params()
@pytest.mark.parametrize("name", sorted(BWD))
def test_backward_ops_direct(name, dtype):
    lo, hi = BWD[name][2]
    g = make((5, 6), dtype)
    for x in (make((5, 6), dtype, low=lo, high=hi), make((6, 5), dtype, low=lo, high=hi).t()):
        check_op(lambda a, b: _bcall(name, a, b), (g, x), dtype=dtype, served_ops=_served(name, dtype))
    if name in ("hardswish_backward", "mish_backward"):      # no .grad_input overload with a backend kernel
        return
    gi = torch.full((5, 6), float("nan"), dtype=dtype, device=DEVICE)
    with served(*_served(f"{name}.grad_input", dtype)), gems.use_gems():
        r = _bcall(name, g, x, grad_input=gi)
    assert r is gi
    assert_close(gi, _bcall(name, to_ref(g), to_ref(x)), dtype, _bcall(name, g, x))


def _check_nan_apart(fn, args, name):
    """check_op with the NaN inputs checked on their own. At NaN ATen's CPU vector path disagrees with
    its scalar path (the last elements of a call) and with CUDA for several of these ops (e.g.
    hardtanh_backward gives 0 and elu_backward NaN where the scalar/CUDA formula gives grad or
    grad * scale). Gems follows each device's kernel: CUDA's, and on the CPU the vector path
    (docs/known-differences.md). The float64 reference runs on the CPU: 64 copies take its vector
    path, one element its scalar path (CUDA's formula)."""
    x = args[-1]
    nan = torch.isnan(x)
    check_op(fn, tuple(a[~nan] for a in args), dtype=torch.float32, served_ops=[name])
    copies = 64 if DEVICE == "cpu" else 1
    check_op(fn, tuple(a[nan].repeat(copies) for a in args), dtype=torch.float32, served_ops=[name])


def test_backward_kinks():
    x = torch.tensor(KINKS).to(DEVICE)
    g = make((len(KINKS),))
    for name in sorted(BWD):
        _check_nan_apart(lambda a, b: _bcall(name, a, b), (g, x), name)
    _check_nan_apart(lambda a, b: A.logit_backward(a, b, 0.05), (g, x), "logit_backward")
    _check_nan_apart(lambda a, b: A.logit_backward(a, b, -1.0), (g, x), "logit_backward")
    _check_nan_apart(lambda a: A.logit(a, -1.0), (x,), "logit")
    _check_nan_apart(lambda a, b: A.elu_backward(a, 0.9, 1.2, 0.7, True, b), (g, x), "elu_backward")


@dtype_params()
def test_elu_zero_with_infinite_input_scale(dtype):
    # a zero meets input_scale = +-inf (0 * inf = NaN in the exponential branch) or alpha = NaN: ATen's CPU
    # kernel sends zeros to x * scale (x >= 0), its CUDA kernel to the exponential (x > 0 only)
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([-2.0, -0.0, 0.0, 3.0, nan] * 5, dtype=dtype, device=DEVICE)
    cpu = DEVICE == "cpu"
    for alpha, scale, input_scale, want in (
            (1.0, -1.0, -inf, [-inf, 0.0 if cpu else nan, -0.0 if cpu else nan, -3.0, nan]),
            (1.0, 2.0, inf, [-2.0, -0.0 if cpu else nan, 0.0 if cpu else nan, 6.0, nan]),
            (nan, 1.0, 1.0, [nan, -0.0 if cpu else nan, 0.0 if cpu else nan, 3.0, nan])):
        want_t = torch.tensor(want * 5, dtype=dtype)
        with served("elu"), gems.use_gems():
            got = A.elu(x, alpha, scale, input_scale).cpu()
        assert torch.equal(got.isnan(), want_t.isnan()), (alpha, scale, input_scale, got)
        keep = ~want_t.isnan()
        assert torch.equal(got[keep], want_t[keep]) and torch.equal(got[keep].signbit(), want_t[keep].signbit())
        aten = A.elu(x, alpha, scale, input_scale).cpu()
        assert torch.equal(aten.isnan(), want_t.isnan()) and torch.equal(aten[keep].signbit(), want_t[keep].signbit())


def test_mish_backward_result_takes_the_input_dtype():
    # ATen allocates mish_backward's grad_input with input's options (not the promoted dtype, unlike
    # silu_backward): fp32 grad with fp16 input gives fp16, computed in fp32 and rounded once
    g32, x32 = make((5, 7), low=-4, high=4), make((5, 7), low=-4, high=4)
    pairs = [(g32, x32.half()), (g32.t(), x32.half().t()), (g32.half(), x32), (g32[:, ::2], x32.half()[:, ::2])]
    if DEVICE != "cpu":   # bf16 is not exact in the interpreter: ATen's there
        pairs += [(g32, x32.bfloat16()), (g32.bfloat16(), x32.half())]
    for g, x in pairs:
        with served("mish_backward"), gems.use_gems():
            got = A.mish_backward(g, x)
        assert got.dtype == x.dtype, (g.dtype, x.dtype)
        xd, gd = to_ref(x), to_ref(g)
        sp = torch.tanh(F.softplus(xd))
        ref = gd * (sp + xd * torch.sigmoid(xd) * (1 - sp * sp))
        assert_close(got, ref, x.dtype, A.mish_backward(g, x))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_logit_eps_bounds_in_fp32(dtype):
    # logit(clamp(x, eps, 1 - eps)): Gems computes the bounds in fp32 like ATen's CUDA kernel, so an x at
    # or past them gives log((1 - eps) / eps), finite (docs/known-differences.md: ATen's CPU Half kernel
    # rounds 1 - 1e-5 to 1 and answers inf); the reference is that formula in float64
    x = torch.tensor([1.0, 1.5, 0.9995, 0.5, 0.25, 1e-6, 0.0, -1.0], dtype=dtype, device=DEVICE)
    for eps in (1e-5, 3e-4, 0.1):
        # the fp32 bounds the kernels clamp to (1 - eps rounded to fp32), then exact arithmetic
        e32 = torch.tensor(eps, dtype=torch.float32)
        z = to_ref(x).cpu().clamp(e32.double().item(), (1 - e32).double().item())
        ref = torch.log(z / (1 - z))
        with served("logit"), gems.use_gems():
            got = A.logit(x, eps)
        assert torch.isfinite(got).all(), (eps, got)
        assert_close(got, ref, dtype)


def test_hardtanh_is_clamp():
    """ATen's hardtanh is clamp: max_val wins where min_val > max_val (-1 everywhere for (1, -1)), and a
    NaN bound gives NaN; the .out and in-place overloads too, and clamp with the same bounds. The backward
    with min_val > max_val is 0 at every number (x <= min_val or x >= max_val)."""
    nan = float("nan")
    x = torch.tensor(KINKS).to(DEVICE)
    xs = x.repeat(3)[::2]                                                   # strided, in place
    for lo, hi in ((1.0, -1.0), (0.5, 0.5), (3.0, -20.0), (nan, 1.0), (-1.0, nan)):
        check_op(lambda t: torch._C._nn.hardtanh(t, lo, hi), (x,), dtype=torch.float32, served_ops=["hardtanh"])
        check_op(lambda t: A.hardtanh.out(t, lo, hi, out=torch.empty_like(t)), (x,), dtype=torch.float32,
                 served_ops=["hardtanh.out"])
        check_op(lambda t: torch._C._nn.hardtanh_(t.clone(), lo, hi), (xs,), dtype=torch.float32,
                 served_ops=["hardtanh_"])
        check_op(lambda t: torch.clamp(t, lo, hi), (x,), dtype=torch.float32, served_ops=["clamp.default"])
        check_op(lambda t: t.clone().clamp_(lo, hi), (xs,), dtype=torch.float32, served_ops=["clamp_.default"])
    with served("hardtanh"), gems.use_gems():
        y = torch._C._nn.hardtanh(make((5, 4)), 1.0, -1.0)
    assert torch.equal(y, torch.full_like(y, -1.0))
    check_op(lambda t: torch.clamp(t, 3, -2), (make((4, 5), torch.int32, low=-9, high=9),), dtype=torch.int32,
             served_ops=["clamp.default"])
    lo_t, hi_t = make((6, 1), low=0.5, high=2), make((9,), low=-2, high=-0.5)
    check_op(torch.clamp, (make((6, 9)), lo_t, hi_t), dtype=torch.float32, served_ops=["clamp.Tensor"])
    finite = x[~torch.isnan(x)]
    check_op(lambda g, t: A.hardtanh_backward(g, t, 1.0, -1.0), (make(finite.shape), finite), dtype=torch.float32,
             served_ops=["hardtanh_backward"])


def test_relu_integers_and_fallbacks():
    for dt in (torch.int32, torch.int64, torch.uint8):
        x = make((5, 7), dt, low=0 if dt == torch.uint8 else -5, high=5)
        out = check_op(torch.relu, (x,), dtype=dt, served_ops=["relu"])
        assert out.dtype == dt
    gems.reset_stats()
    x = make((4, 5), torch.float64)
    with gems.use_gems():
        y = F.softplus(x)
        z = F.hardswish(x)
    assert torch.equal(y, F.softplus(x)) and torch.equal(z, F.hardswish(x))
    st = gems.stats()
    assert st["softplus.default"]["fallback"] == 1 and st["hardswish.default"]["fallback"] == 1


def test_errors_like_aten():
    g, x = make((4,)), make((4,))
    # negative slope with a result input: ATen refuses; Gems hands it to ATen, which raises
    with gems.use_gems(), pytest.raises(RuntimeError):
        A.leaky_relu_backward(g, x, -0.1, True)
    with gems.use_gems(), pytest.raises(RuntimeError):
        A.elu_backward(g, -0.5, 1.0, 1.0, True, x)
    with gems.use_gems(), pytest.raises(RuntimeError):
        F.relu(make((3,), torch.bool))
    with gems.use_gems(), pytest.raises(RuntimeError):
        A.threshold_backward(make((2, 3)), make((4,)), 0.0)        # not broadcastable
    with gems.use_gems(), pytest.raises(RuntimeError):
        A.hardtanh_(make((1, 3)).expand(2, 3))                      # overlapping self
