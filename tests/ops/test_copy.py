"""Copy-like ops (gems/ops/shape/copy.py) against ATen: fill_ (Scalar, 0-dim Tensor), zero_, copy_ (casts,
non-contiguous src and dst, broadcast src), _to_copy (dtype casts, kept strides) and its fallbacks."""
import pytest
import torch

import gems
from harness import DEVICE, DTYPES, ON_GPU, assert_close, check_op, dtype_params, layouts, make, served, to_ref

ALL_DT = DTYPES + [torch.int32, torch.int64, torch.int8, torch.uint8, torch.bool]
DT_IDS = lambda d: str(d).replace("torch.", "")   # noqa: E731


def _make(shape, dtype):
    return make(shape, dtype, low=0 if dtype == torch.uint8 else -3.0)


def _views(shape, dtype):
    """(name, base, view): views into a base, so writes outside the view can be checked too."""
    out = []
    make = _make
    base = make(shape, dtype)
    out.append(("contiguous", base, base))
    base = make(shape[::-1], dtype)
    out.append(("transposed", base, base.t()))
    base = make(shape[:-1] + (shape[-1] * 2,), dtype)
    out.append(("step-sliced", base, base[..., ::2]))
    base = make((shape[0] + 2,) + shape[1:], dtype)
    out.append(("offset rows", base, base[1:-1]))
    return out


def _check_inplace(mutate, shape, dtype, served_op, expect):
    """mutate(view) with Gems on; the view must equal expect(view_before) and the rest of base be untouched."""
    for name, base, view in _views(shape, dtype):
        keep = base.clone()
        before = view.clone()
        mask = torch.zeros_like(base, dtype=torch.bool)
        mask_view = mask.t() if name == "transposed" else (mask[..., ::2] if name == "step-sliced" else
                                                          (mask[1:-1] if name == "offset rows" else mask))
        mask_view.fill_(True)
        with served(served_op), gems.use_gems():
            r = mutate(view)
        assert r is view, name
        assert torch.equal(view.cpu(), expect(before).cpu()), f"{served_op} on {name}: wrong values"
        assert torch.equal(base[~mask].cpu(), keep[~mask].cpu()), f"{served_op} on {name}: wrote outside the view"


# ------------------------------------------------------------------------------------------ fill, zero
@pytest.mark.parametrize("dtype", ALL_DT, ids=DT_IDS)
def test_fill_zero(dtype):
    v = True if dtype == torch.bool else (3 if not dtype.is_floating_point else -1.625)
    shape = (6, 9)
    _check_inplace(lambda t: t.fill_(v), shape, dtype, "fill_.Scalar", lambda b: torch.full_like(b, v))
    tv = torch.tensor(v, device=DEVICE)   # 0-dim tensor value, of its own (default) dtype
    _check_inplace(lambda t: t.fill_(tv), shape, dtype, "fill_.Tensor", lambda b: torch.full_like(b, v))
    tv = torch.tensor(v, device=DEVICE, dtype=dtype)
    _check_inplace(lambda t: t.fill_(tv), shape, dtype, "fill_.Tensor", lambda b: torch.full_like(b, v))
    _check_inplace(lambda t: t.zero_(), shape, dtype, "zero_", lambda b: torch.zeros_like(b))
    _check_inplace(torch.zero_, shape, dtype, "zero_", lambda b: torch.zeros_like(b))


@dtype_params()
def test_fill_special_values_0dim_empty(dtype):
    x = make((5, 7), dtype)
    for v in (float("nan"), float("-inf"), float("inf"), 0.0, 65504.0):
        with served("fill_.Scalar"), gems.use_gems():
            x.fill_(v)
        assert_close(x, torch.full((5, 7), v, dtype=torch.float64), dtype)
    # -0.0 goes to ATen (a zero scalar argument loses its sign in Triton): the sign must survive
    with gems.use_gems():
        x.fill_(-0.0)
    assert torch.equal(x, torch.zeros_like(x)) and bool(torch.signbit(x).all())
    s = make((), dtype)
    with served("fill_.Scalar", "zero_", "fill_.Tensor"), gems.use_gems():
        s.fill_(2.5)
        assert s.item() == 2.5
        s.zero_()
        assert s.item() == 0
        s.fill_(torch.tensor(-1.5, device=DEVICE))
    assert s.item() == -1.5
    e = make((0, 3), dtype)
    with gems.use_gems():
        assert e.fill_(1.0) is e and e.zero_() is e and e.shape == (0, 3)
    # float value into an int tensor truncates like ATen; a non-0-dim value tensor is ATen's error
    i = make((4,), torch.int32)
    with served("fill_.Scalar"), gems.use_gems():
        i.fill_(2.9)
    assert torch.equal(i, torch.full_like(i, 2))
    with gems.use_gems(), pytest.raises(RuntimeError):
        x.fill_(make((2,), dtype))


# ------------------------------------------------------------------------------------------------ copy_
CASTS = [
    (torch.float32, torch.float16), (torch.float16, torch.float32), (torch.float32, torch.float32),
    (torch.float32, torch.int32), (torch.float16, torch.int64), (torch.float32, torch.bool),
    (torch.float16, torch.bool), (torch.int32, torch.float32), (torch.int64, torch.float16),
    (torch.bool, torch.float32), (torch.int32, torch.int8), (torch.bool, torch.int64),
    (torch.int64, torch.bool),
] + ([(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)] if ON_GPU else [])


def _src(shape, dt):
    if dt.is_floating_point:
        t = make(shape, dt, low=-40.0, high=40.0)
        t.view(-1)[::5] = 0.0                  # exact zeros: bool(0) and int(0)
        t.view(-1)[1::7] = -0.75               # truncation toward zero
        return t
    if dt == torch.bool:
        return make(shape, dt)
    t = make(shape, dt, low=-300, high=300)
    t.view(-1)[::4] = 0
    return t


@pytest.mark.parametrize("src_dt,dst_dt", CASTS, ids=[f"{DT_IDS(a)}->{DT_IDS(b)}" for a, b in CASTS])
def test_copy_casts_layouts(src_dt, dst_dt):
    shape = (6, 19)
    srcs = [("contiguous", _src(shape, src_dt)), ("transposed", _src(shape[::-1], src_dt).t()),
            ("step-sliced", _src((6, 38), src_dt)[:, ::2]), ("row broadcast", _src((19,), src_dt)),
            ("col expand", _src((6, 1), src_dt).expand(shape)), ("0-dim", _src((), src_dt))]
    for sname, src in srcs:
        for dname, base, dst in _views(shape, dst_dt):
            keep = base.clone()
            with served("copy_"), gems.use_gems():
                r = dst.copy_(src)
            assert r is dst
            expect = torch.empty(shape, dtype=dst_dt, device=DEVICE).copy_(src)
            assert torch.equal(dst, expect), f"copy_ {src_dt}->{dst_dt}, src {sname}, dst {dname}: wrong values"
            if dname != "contiguous":
                m = torch.ones_like(base, dtype=torch.bool)
                {"transposed": lambda: m.t(), "step-sliced": lambda: m[..., ::2],
                 "offset rows": lambda: m[1:-1]}[dname]().fill_(False)
                assert torch.equal(base[m], keep[m]), f"copy_ into {dname} wrote outside the view"


@pytest.mark.parametrize("src_dt", DTYPES, ids=DT_IDS)
def test_float_to_uint8_like_aten(src_dt):
    # c10 casts a float to uint8 through int64 (-3.7 stores 253); the GPU's direct conversion would
    # saturate (0), so CUDA leaves these copies to ATen; the interpreter serves them
    src = torch.tensor([-3.7, -0.5, 0.0, 2.9, 200.0, 255.0, -128.0, -255.0], dtype=src_dt, device=DEVICE)
    n = 0 if ON_GPU else 1
    dst = torch.empty(8, dtype=torch.uint8, device=DEVICE)
    with served("copy_", at_least=n), served("_to_copy", at_least=n), gems.use_gems():
        dst.copy_(src)
        got = src.to(torch.uint8)
    want = torch.empty_like(dst).copy_(src)
    assert torch.equal(dst, want) and torch.equal(got, src.to(torch.uint8)), (dst, got, want)


def test_copy_0dim_empty_and_errors():
    d = make((), torch.float16)
    with served("copy_"), gems.use_gems():
        d.copy_(torch.tensor(3.25, device=DEVICE))
    assert d.item() == 3.25
    e = make((0, 4))
    with gems.use_gems():
        assert e.copy_(make((0, 4), torch.float16)) is e
        assert e.copy_(make((4,))) is e
    with gems.use_gems(), pytest.raises(RuntimeError):
        make((3,)).copy_(make((2, 3)))            # src does not broadcast to dst


@dtype_params()
def test_copy_no_recursion_and_autograd(dtype):
    # the interpreter copies storages with copy_ while a Gems kernel runs: this must not recurse
    x = make((33, 17), dtype)
    y = torch.empty((17, 33), dtype=dtype, device=DEVICE).t()
    gems.reset_stats()
    with served("copy_"), gems.use_gems():
        y.copy_(x)
    assert torch.equal(y, x)
    assert gems.stats()["copy_.default"]["fallback"] == 0
    # gradient flows through copy_ (to src) and through .to()
    a = make((4, 5), dtype, requires_grad=True)
    with gems.use_gems():
        b = torch.zeros((4, 5), dtype=torch.float32, device=DEVICE)
        b.copy_(a)
        (b * 2).sum().backward()
    assert a.grad is not None and torch.equal(a.grad, torch.full_like(a, 2))


# --------------------------------------------------------------------------------------------- _to_copy
@pytest.mark.parametrize("src_dt,dst_dt", CASTS, ids=[f"{DT_IDS(a)}->{DT_IDS(b)}" for a, b in CASTS])
def test_to_copy_casts(src_dt, dst_dt):
    for name, x in [("contiguous", _src((6, 19), src_dt)), ("transposed", _src((19, 6), src_dt).t()),
                    ("3d permuted", _src((3, 4, 5), src_dt).permute(2, 0, 1))]:
        expect = x.to(dst_dt)
        with served("_to_copy", at_least=int(src_dt != dst_dt)), gems.use_gems():
            got = x.to(dst_dt)
        assert got.dtype == dst_dt and torch.equal(got, expect), f"{name}: wrong values"
        if src_dt != dst_dt:
            assert got.stride() == expect.stride(), f"{name}: strides {got.stride()} vs ATen's {expect.stride()}"
            assert got.data_ptr() != x.data_ptr()


@dtype_params()
def test_to_copy_calls(dtype):
    other = torch.float16 if dtype == torch.float32 else torch.float32
    x = make((6, 19), other)
    check_op(lambda t: t.to(dtype), (x,), dtype=dtype, served_ops=["_to_copy"])
    check_op(lambda t: t.to(dtype), (x.t(),), dtype=dtype, served_ops=["_to_copy"])
    check_op(lambda t: t.to(dtype=dtype, copy=True), (make((6, 19), dtype),), dtype=dtype, served_ops=["_to_copy"])
    check_op(lambda t: torch.ops.aten._to_copy(t, dtype=dtype), (make((3, 4, 5), other).permute(1, 2, 0),),
             dtype=dtype, served_ops=["_to_copy"])
    # a non-dense input (step-sliced): Gems may fall back (its declared limit), the result must be ATen's
    s = x[:, ::3]
    with gems.use_gems():
        got = s.to(dtype)
    assert torch.equal(got, s.to(dtype)) and got.stride() == s.to(dtype).stride()
    check_op(lambda t: t.to(dtype, memory_format=torch.contiguous_format), (x.t(),), dtype=dtype,
             served_ops=["_to_copy"])
    with served("_to_copy"), gems.use_gems():
        c = x.t().to(dtype, memory_format=torch.contiguous_format)
        h = {torch.float16: x.half, torch.bfloat16: x.bfloat16}.get(dtype, x.float)()
        z = make((), other).to(dtype)
        e = make((0, 3), other).to(dtype)
    assert c.is_contiguous() and torch.equal(c, x.t().to(dtype))
    assert h.dtype == dtype and z.shape == () and e.shape == (0, 3) and e.dtype == dtype


def _fallback_reasons(fn):
    gems.reset_stats()
    with gems.use_gems():
        out = fn()
    st = gems.stats().get("_to_copy.default", {"served": 0, "fallback": 0, "reasons": {}})
    return out, st


def test_to_copy_fallbacks():
    x4 = make((2, 3, 4, 5))
    # memory_format=channels_last: ATen's layout, right values
    out, st = _fallback_reasons(lambda: x4.to(torch.float16, memory_format=torch.channels_last))
    ref = x4.to(torch.float16, memory_format=torch.channels_last)
    assert torch.equal(out, ref) and out.stride() == ref.stride()
    assert st["served"] == 0 and st["fallback"] >= 1 and any("channels_last" in r for r in st["reasons"]), st
    # float64 input (and output): not a Gems dtype
    d = make((4, 5), torch.float64)
    out, st = _fallback_reasons(lambda: d.to(torch.float32))
    assert torch.equal(out, d.to(torch.float32))
    assert st["served"] == 0 and st["fallback"] >= 1 and any("float64" in r for r in st["reasons"]), st
    out, st = _fallback_reasons(lambda: x4.to(torch.float64))
    assert torch.equal(out, x4.double())
    assert st["served"] == 0 and st["fallback"] >= 1 and any("float64" in r for r in st["reasons"]), st
    # device change
    x = make((4, 5))
    if ON_GPU:
        out, st = _fallback_reasons(lambda: x.to("cpu", torch.float16))
        assert out.device.type == "cpu" and torch.equal(out, x.cpu().half())
        assert st["served"] == 0 and st["fallback"] >= 1 and any("device" in r for r in st["reasons"]), st
    else:
        out, st = _fallback_reasons(lambda: torch.ops.aten._to_copy(x, device=torch.device("meta")))
        assert out.device.type == "meta" and out.shape == x.shape
        assert st["served"] == 0, st
        if st["fallback"]:
            assert any("device" in r for r in st["reasons"]), st
        # the implementation itself refuses a device change (so the dispatcher falls back)
        from gems.registry import Unsupported
        with pytest.raises(Unsupported, match="device"):
            gems.registry.get("_to_copy").fn(x, device=torch.device("meta"))
