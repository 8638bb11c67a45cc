import pytest
import torch
import torch.nn.functional as F

import gems
from gems.ops.norm import layer_norm as ln_mod
from harness import DEVICE, ON_GPU, assert_close, check_grad, check_op, dtype_params, layouts, make, served

LN = torch.ops.aten.native_layer_norm.default
LN_BWD = torch.ops.aten.native_layer_norm_backward.default
# (input shape, normalized_shape): short rows (several per program), a 2-d normalized shape, rows
# wider than the interpreter's register tile (1024: the looping path), odd sizes
CASES = [((7, 33), (33,)), ((3, 4, 50), (4, 50)), ((2, 3, 16), (16,)), ((5, 1100), (1100,)), ((1, 1), (1,))]


def _params(ns, dtype, affine):
    w = make(ns, dtype) if affine in ("wb", "w") else None
    b = make(ns, dtype) if affine == "wb" else None
    return w, b


def _stats_like_aten(got, x, ns, w, b):
    want = LN(x, list(ns), w, b, 1e-5)
    for g, a in zip(got, want):
        assert g.dtype == a.dtype and g.shape == a.shape


@dtype_params()
@pytest.mark.parametrize("shape,ns", CASES, ids=str)
@pytest.mark.parametrize("affine", ["wb", "w", "none"])
def test_forward(shape, ns, dtype, affine):
    x = make(shape, dtype)
    w, b = _params(ns, dtype, affine)
    got = check_op(LN, (x, list(ns), w, b, 1e-5), dtype=dtype, served_ops=["native_layer_norm"])
    _stats_like_aten(got, x, ns, w, b)


@dtype_params()
def test_layouts_and_offsets(dtype):
    w, b = make((19,), dtype), make((19,), dtype)
    for name, x in layouts((6, 19), dtype):
        check_op(LN, (x, [19], w, b, 1e-5), dtype=dtype, served_ops=["native_layer_norm"])
    big = make((12, 40), dtype)
    check_op(LN, (big[::2, 3:22], [19], w, b, 1e-5), dtype=dtype, served_ops=["native_layer_norm"])  # row stride 80
    # large mean, small spread: E[x^2] - E[x]^2 would lose ~1e-3 here in fp32; the two-pass
    # variance stays within the fp32 rounding of the mean (~5e-5)
    x = make((4, 64), dtype, low=-1, high=1) + 100
    check_op(LN, (x, [64], None, None, 1e-5), dtype=dtype, served_ops=["native_layer_norm"], atol=2e-4)


def test_int64_offsets_path(monkeypatch):
    monkeypatch.setattr(ln_mod, "_INT64_FROM", 0)  # (the dw/db column sums keep their own threshold)
    for shape, ns in [((7, 33), (33,)), ((3, 1100), (1100,))]:
        x = make(shape)
        w, b = make(ns), make(ns)
        check_op(LN, (x, list(ns), w, b, 1e-5), dtype=torch.float32, served_ops=["native_layer_norm"])
        check_grad(lambda t, w, b: F.layer_norm(t, ns, w, b), [x, w, b], dtype=torch.float32,
                   served_ops=["native_layer_norm_backward"])


@dtype_params()
@pytest.mark.parametrize("shape,ns", CASES[:4], ids=str)
@pytest.mark.parametrize("affine", ["wb", "w", "none"])
def test_backward(shape, ns, dtype, affine):
    x = make(shape, dtype)
    w, b = _params(ns, dtype, affine)
    ins = [x] + [p for p in (w, b) if p is not None]

    def fn(t, *p):
        return F.layer_norm(t, ns, p[0] if p else None, p[1] if len(p) > 1 else None, 1e-5)
    check_grad(fn, ins, dtype=dtype, served_ops=["native_layer_norm", "native_layer_norm_backward"],
               atol=_GRAD_ATOL.get(dtype))


# dw and db sum g * xhat over rows: terms of magnitude ~10 cancel, so fp16 rounding of mean/rstd (ATen
# CPU keeps them in fp16) and of the result shows as absolute, not relative, error; the per-element
# "2x ATen's error" rule is then a coin toss (ATen's max error over the tensor is the same as ours)
_GRAD_ATOL = {torch.float16: 1e-2}


@dtype_params()
def test_backward_output_mask(dtype):
    shape, ns = (9, 40), [40]
    x, g, w, b = make(shape, dtype), make(shape, dtype), make(ns, dtype), make(ns, dtype)
    _, mean, rstd = LN(x, ns, w, b, 1e-5)
    ref = LN_BWD(g.double().cpu(), x.double().cpu(), ns, mean.double().cpu(), rstd.double().cpu(),
                 w.double().cpu(), b.double().cpu(), [True, True, True])
    aten = LN_BWD(g, x, ns, mean, rstd, w, b, [True, True, True])
    for mask in ([True, False, False], [False, True, True], [False, True, False], [True, False, True]):
        with served("native_layer_norm_backward"), gems.use_gems():
            got = LN_BWD(g, x, ns, mean, rstd, w, b, mask)
        for m, o, r, a in zip(mask, got, ref, aten):
            if m:
                assert o.dtype == a.dtype
                assert_close(o, r, dtype, a, atol=_GRAD_ATOL.get(dtype))
            else:
                assert o is None
    # strided grad_out and input (rows sliced: no copy) and a transposed grad_out (copied)
    gt = make((40, 9), dtype).t()
    xs = make((18, 40), dtype)[::2]
    _, mean, rstd = LN(xs, ns, w, b, 1e-5)
    with served("native_layer_norm_backward"), gems.use_gems():
        got = LN_BWD(gt, xs, ns, mean, rstd, w, b, [True, True, True])
    want = LN_BWD(gt.double(), xs.double(), ns, mean.double(), rstd.double(), w.double(), b.double(),
                  [True, True, True])
    aten = LN_BWD(gt, xs, ns, mean, rstd, w, b, [True, True, True])
    assert_close(got, [t.cpu() for t in want], dtype, aten, atol=_GRAD_ATOL.get(dtype))


def test_out_variants():
    x, w, b = make((5, 24)), make((24,)), make((24,))
    want = LN(x.double(), [24], w.double(), b.double(), 1e-5)
    outs = [torch.full((5, 24), float("nan"), device=DEVICE), torch.full((5, 1), float("nan"), device=DEVICE),
            torch.full((5, 1), float("nan"), device=DEVICE)]
    with served("native_layer_norm.out"), gems.use_gems():
        r = torch.ops.aten.native_layer_norm.out(x, [24], w, b, 1e-5, out0=outs[0], out1=outs[1], out2=outs[2])
    assert all(a is o for a, o in zip(r, outs))
    assert_close(outs, [t.cpu() for t in want], torch.float32)
    wrong = [torch.full((2,), float("nan"), device=DEVICE) for _ in range(3)]
    with served("native_layer_norm.out"), gems.use_gems(), pytest.warns(UserWarning, match="resized"):
        torch.ops.aten.native_layer_norm.out(x, [24], w, b, 1e-5, out0=wrong[0], out1=wrong[1], out2=wrong[2])
    assert_close(wrong, [t.cpu() for t in want], torch.float32)

    g = make((5, 24))
    _, mean, rstd = LN(x, [24], w, b, 1e-5)
    want = LN_BWD(g.double(), x.double(), [24], mean.double(), rstd.double(), w.double(), b.double(),
                  [True, True, True])
    outs = [torch.full((5, 24), float("nan"), device=DEVICE), torch.full((24,), float("nan"), device=DEVICE),
            torch.full((24,), float("nan"), device=DEVICE)]
    with served("native_layer_norm_backward.out"), gems.use_gems():
        r = torch.ops.aten.native_layer_norm_backward.out(g, x, [24], mean, rstd, w, b, [True, True, True],
                                                          out0=outs[0], out1=outs[1], out2=outs[2])
    assert all(a is o for a, o in zip(r, outs))
    assert_close(outs, [t.cpu() for t in want], torch.float32)


def test_empty_and_edge_cases():
    w, b = make((6,)), make((6,))
    with served("native_layer_norm"), gems.use_gems():
        y, mean, rstd = LN(make((0, 6)), [6], w, b, 1e-5)
    assert y.shape == (0, 6) and mean.shape == (0, 1) and rstd.shape == (0, 1)
    with served("native_layer_norm_backward"), gems.use_gems():
        dx, dw, db = LN_BWD(make((0, 6)), make((0, 6)), [6], make((0, 1)), make((0, 1)), w, b, [True, True, True])
    assert dx.shape == (0, 6) and torch.equal(dw, torch.zeros(6, device=DEVICE)) and torch.equal(db, dw)
    # normalizing over every dim (one row), and a constant row (variance 0: rstd = 1/sqrt(eps))
    check_op(LN, (make((3, 5)), [3, 5], w.new_ones(3, 5), None, 1e-5), dtype=torch.float32,
             served_ops=["native_layer_norm"])
    const = torch.full((2, 6), 1.5, device=DEVICE)
    check_op(LN, (const, [6], w, b, 1e-5), dtype=torch.float32, served_ops=["native_layer_norm"])
    # N = 1 (Triton specializes an int argument equal to 1 into a compile-time constant)
    check_op(LN, (make((4, 1)), [1], make((1,)), make((1,)), 1e-5), dtype=torch.float32,
             served_ops=["native_layer_norm"])


def test_errors_and_fallbacks():
    x = make((4, 6))
    with gems.use_gems():
        with pytest.raises(RuntimeError):
            LN(x, [5], None, None, 1e-5)
        with pytest.raises(RuntimeError):
            LN(x, [6], make((5,)), None, 1e-5)
    gems.reset_stats()
    with gems.use_gems():
        y64 = LN(x.double(), [6], None, None, 1e-5)[0]                 # float64: ATen's
        ye = LN(make((3, 0)), [0], None, None, 1e-5)                    # empty rows: ATen's
        if DEVICE == "cpu":                                             # ATen CPU's mixed-dtype path
            ym = LN(x.half(), [6], make((6,)), make((6,)), 1e-5)
            assert ym[0].dtype == torch.float16 and ym[1].dtype == torch.float32
    torch.testing.assert_close(y64, F.layer_norm(x.double(), [6]))
    assert ye[0].shape == (3, 0)
    st = gems.stats()["native_layer_norm.default"]
    assert st["fallback"] == (3 if DEVICE == "cpu" else 2) and st["served"] == 0


def test_multi_dim_normalized_shape_of_strided_inputs():
    """A 2-d input normalized over both dims is one row of N = M * N' elements: its own row stride is not
    the stride within that row (sliced, expanded: copied, never read past the storage)."""
    x = make((7, 12))[:, 6:]
    w, b = make((7, 6)), make((7, 6))
    check_op(LN, (x, [7, 6], w, b, 0.1), dtype=torch.float32, served_ops=["native_layer_norm"])
    check_grad(lambda t, w, b: F.layer_norm(t, (7, 6), w, b), [x, w, b], dtype=torch.float32,
               served_ops=["native_layer_norm", "native_layer_norm_backward"])
    xe = make((1, 1)).expand(7, 1)
    w1, b1 = make((7, 1)), make((7, 1))
    check_op(F.layer_norm, (xe, (7, 1), w1, b1), dtype=torch.float32, served_ops=["native_layer_norm"])
    xa = torch.arange(16.0, device=DEVICE)[:8].expand(3, 8)
    check_op(F.layer_norm, (xa, (3, 8)), dtype=torch.float32, served_ops=["native_layer_norm"])
    # 3-d: the normalized block is the last two dims of sliced rows, and the whole of a transposed input
    for t, ns in [(make((4, 5, 12))[:, :, 3:9], (5, 6)), (make((6, 5)).t(), (5, 6))]:
        check_op(LN, (t, list(ns), None, None, 1e-5), dtype=torch.float32, served_ops=["native_layer_norm"])


@pytest.mark.parametrize("n", [3, 7, 100, 300])   # 300: wider than the interpreter's register row
@pytest.mark.parametrize("value", [0.1, 1.7, -2.3])
def test_constant_row_normalizes_to_zero(n, value):
    """An fp32 sum of n copies of a value is not n * value: the statistics of a constant row are still
    exact (mean == the value, y == bias), as ATen's on the CPU. (ATen's CUDA kernel folds the mean
    into an fma, x * rstd - mean * rstd, so its y there is the bias only up to rounding.)"""
    x = torch.full((3, n), value, device=DEVICE)
    b = make((n,))
    with served("native_layer_norm"), gems.use_gems():
        y, mean, rstd = LN(x, [n], None, b, 1e-5)
    ya, meana, rstda = LN(x, [n], None, b, 1e-5)
    assert torch.equal(y, b.expand(3, n))
    assert torch.equal(mean, torch.full_like(mean, value))
    if x.device.type == "cpu":
        assert torch.equal(y, ya) and torch.equal(mean, meana)
    else:
        torch.testing.assert_close(y, ya, rtol=1e-5, atol=1e-3)
        torch.testing.assert_close(mean, meana)
    torch.testing.assert_close(rstd, rstda)


@pytest.mark.parametrize("n", [240, 300])   # 240: one block of registers, 300: the looping path on the interpreter
def test_values_near_the_mean_keep_their_digits(n):
    """A row whose first element is far from its mean (3 against values near 0.09): x - mean at an
    element close to the mean is small beside x - x[0], and a weight of 3e38 shows every lost digit.
    Gems' y and mean are within 2x ATen's own error of the float64 answer."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, n, generator=g) * 0.01 - 0.086).to(DEVICE)
    x[:, 0] = 2.97
    w = torch.full((n,), 3e38, device=DEVICE)
    with served("native_layer_norm"), gems.use_gems():
        y, mean, _ = LN(x, [n], w, None, 2.5)
    ya, meana, _ = LN(x, [n], w, None, 2.5)
    ry, rmean, _ = LN(x.double(), [n], w.double(), None, 2.5)
    for got, aten, ref in ((y, ya, ry), (mean, meana, rmean)):
        err = ((got.double() - ref).abs() / ref.abs()).max()
        aten_err = ((aten.double() - ref).abs() / ref.abs()).max()
        assert err <= 2 * aten_err + 2e-6, (err, aten_err)


@pytest.mark.parametrize("n", [4, 33, 300])   # 300: the looping path on the interpreter
def test_rows_whose_statistics_overflow_fp32(n):
    """A row with |x| past 2^64 (its squares, or its sum shifted by the first element, overflow fp32):
    Gems gives the float64 answer (the row normalized from x * 2^-80), where ATen's Welford lanes give
    NaN or 0 by the element's position (docs/known-differences.md); the other rows of the same program
    are untouched, and a row holding an infinity is NaN as in ATen, its mean that infinity."""
    x = make((6, n), torch.float32)
    x[0, 0], x[0, n - 1] = 3e38, -2e38       # x - x[0] overflows
    x[1, n // 2] = 1e20                        # squares overflow
    x[2, :2] = torch.tensor([3e38, 3e38])      # the sum overflows
    x[3, 1] = float("inf")
    w, b = make((n,)), make((n,))
    with served("native_layer_norm"), gems.use_gems():
        y, mean, rstd = LN(x, [n], w, b, 1e-5)
        y4, mean4, rstd4 = LN(x[4:], [n], w, b, 1e-5)
    ry, rmean, rrstd = LN(x.double(), [n], w.double(), b.double(), 1e-5)
    for g, r in ((y[:3], ry[:3]), (mean[:3], rmean[:3]), (rstd[:3], rrstd[:3])):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g.double(), r, rtol=1e-5, atol=1e-6)
    # the other rows as in a call without the overflowing ones (bitwise on the CPU; on a GPU the rows
    # per program, set by M, change the reduction's lane layout and so its rounding)
    close = torch.equal if x.device.type == "cpu" else (lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6))
    assert close(y[4:], y4) and close(mean[4:], mean4) and close(rstd[4:], rstd4)
    assert_close([y[4:], mean[4:], rstd[4:]], [ry[4:], rmean[4:], rrstd[4:]], torch.float32)
    ya, meana, rstda = LN(x, [n], w, b, 1e-5)
    assert y[3].isnan().all() and ya[3].isnan().all() and rstd[3].isnan() and rstda[3].isnan()
    assert mean[3] == float("inf")     # ATen: NaN, or +-inf by the position (its Welford's inf - inf)
    # fp16 rows: fp32 statistics never overflow; an infinity as above
    xh = x[4:].half()
    xh[0, 2] = -float("inf")
    with served("native_layer_norm"), gems.use_gems():
        yh, meanh, rstdh = LN(xh, [n], None, None, 1e-5)
    yha, _, rstdha = LN(xh, [n], None, None, 1e-5)
    assert torch.equal(yh.isnan(), yha.isnan()) and torch.equal(rstdh.isnan(), rstdha.isnan())
    assert meanh[0] == -float("inf")
    assert_close([yh[1:], meanh[1:], rstdh[1:]], [t[1:] for t in LN(xh.double(), [n], None, None, 1e-5)], torch.float16)


@pytest.mark.parametrize("n", [7, 300])   # 300: the looping path on the interpreter
def test_huge_values_that_cancel_keep_the_small_ones(n):
    """A row holding 3e38 and -3e38 (its statistics overflow fp32, so it is normalized from x * 2^-80):
    the two cancel, and the mean is that of the small values, as the exact (math.fsum) mean says; ATen's
    Welford answers NaN there (docs/known-differences.md)."""
    import math
    x = make((2, n), torch.float32)
    x[0, 1], x[0, n - 2] = 3e38, -3e38
    with served("native_layer_norm"), gems.use_gems():
        y, mean, rstd = LN(x, [n], None, None, 1e-5)
    exact = math.fsum(x[0].double().tolist()) / n
    assert abs(float(mean[0]) - exact) <= 1e-6 * max(1.0, abs(exact)), (float(mean[0]), exact)
    ry, _, rrstd = LN(x.double(), [n], None, None, 1e-5)
    torch.testing.assert_close(rstd[0].double(), rrstd[0], rtol=1e-5, atol=0)
    torch.testing.assert_close(y.double(), ry, rtol=1e-5, atol=1e-6)


def test_constant_row_with_an_infinite_weight_is_nan():
    """docs/known-differences.md: x - mean is exactly 0 on a constant row, and 0 * inf NaN (ATen's CUDA
    formula); ATen's CPU leaves a rounding residue there (+-inf)."""
    x = torch.tensor([[50.46875], [-0.25], [3.0]], device=DEVICE).expand(3, 4).contiguous()
    w = torch.tensor([float("inf"), -float("inf"), 1.0, 2.0], device=DEVICE)
    with served("native_layer_norm"), gems.use_gems():
        y, mean, rstd = LN(x, [4], w, None, 1e-5)
    assert y[:, :2].isnan().all() and torch.equal(y[:, 2:], torch.zeros_like(y[:, 2:]))
    assert torch.equal(mean, x[:, :1])
    torch.testing.assert_close(rstd, torch.full_like(rstd, 1e-5).rsqrt())
    if ON_GPU:
        assert LN(x, [4], w, None, 1e-5)[0][:, :2].isnan().all()


@pytest.mark.parametrize("n", [3, 4099], ids=["one-block", "looping"])
def test_a_product_past_fp32s_range_plus_an_infinite_bias_is_that_infinity(n):
    """y = xhat * w + b rounded once, as ATen's kernels (a fused multiply-add): xhat * w = -4.2e38 rounded
    alone is -inf, which would meet b = +inf as NaN; the exact value, and ATen's, is +inf. Both the
    one-block path and the looping one (rows longer than a block)."""
    x = make((1, n), torch.float32)
    x[0, -3:] = torch.tensor([-1.5868253707885742, -2.1238176822662354, 6.232839584350586])
    w, b = make((n,), torch.float32), make((n,), torch.float32)
    w[-1], b[-1] = -3e38, float("inf")
    with served("native_layer_norm"), gems.use_gems():
        y, _, _ = LN(x, [n], w, b, 0.1)
    ry, _, _ = LN(x.double(), [n], w.double(), b.double(), 0.1)
    assert float(y[0, -1]) == float("inf") and float(ry[0, -1]) == float("inf")
    torch.testing.assert_close(y[:, :-1].double().cpu(), ry[:, :-1].cpu(), rtol=1e-5, atol=1e-5)
