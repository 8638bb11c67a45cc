"""Inputs ATen rejects raise what ATen raises with Gems on (docs/design.md, decision 3), and inputs ATen answers get
ATen's answer: a table of inputs by class, each run on every registered overload that can meet it,
compared with ATen alone (exception type and first line of the message, or the value).

Classes (what ATen checks; what Gems does about it):
* integer division by zero -- remainder, fmod, div(rounding_mode=trunc|floor): ATen's CPU kernels
  raise RuntimeError("ZeroDivisionError"), its CUDA kernels return the GPU's answer. Gems checks
  the divisor on the CPU backend and leaves such calls to ATen; on CUDA the bodies give ATen's values.
* Scalar arguments ATen converts with an overflow check (alpha, clamp bounds, fill values, pow's
  exponent, activation parameters, ...): "value cannot be converted to type int8_t without
  overflow", and alpha's kind ("For integral input tensors, argument alpha must not be a floating
  point number.", "Boolean alpha only supported for Boolean results."). Gems leaves every number
  that does not fit the common dtype, every float meeting integer tensors and every bool meeting
  non-bool ones to ATen (gems.codegen.generator.number_misfit).
* integers to negative integer powers: pow.Tensor_Scalar's meta function raises.
* negative slopes with in-place results in elu_backward / leaky_relu_backward.
* Python numbers at Tensor positions (wrapped numbers) when ATen runs the call (Gems off for the op,
  or falling back): ATen wraps out-of-range ints (`int8 + 300` is 45) and reads floats at opmath
  precision; the fallback's 0-dim tensors must too (gems.codegen.numbers).

Each rejected call follows an accepted call of the same overload that differs only in the value, so
a call plan exists for its neighbour: what decides is part of the plan signature (Python and C++),
or the rejected call would replay the neighbour's plan.
"""
from __future__ import annotations

import pytest
import torch

import gems
import gems.dispatch
from harness import DEVICE

A = torch.ops.aten
INT_DTYPES = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]


def _overload(name):
    base, ov = name.split(".", 1)
    return getattr(getattr(A, base), ov)


def _registered(*bases):
    return [n for n in gems.registered_ops() if n.split(".", 1)[0] in bases]


def _schema(name):
    return _overload(name)._schema


def _is_out(a):
    return a.kwarg_only and a.alias_info is not None and a.alias_info.is_write


def _tensor_typed(a):
    return str(a.type).replace("Optional[", "").rstrip("]") == "Tensor"


def _t(values, dtype):
    return torch.tensor(values, dtype=dtype).to(DEVICE)


def call(name, args: dict, out_dtype=None):
    """A factory of one call of aten::`name`: `args` by schema name (callables give fresh tensors per
    call), outputs (out=) fresh empty tensors of `out_dtype`; arguments not given keep defaults."""
    op, schema = _overload(name), _schema(name)

    def run():
        pos, kw = [], {}
        for a in schema.arguments:
            if _is_out(a):
                v = torch.empty(0, dtype=out_dtype, device=DEVICE)
            elif a.name in args:
                v = args[a.name]
                v = v() if callable(v) else v
            else:
                continue
            if a.kwarg_only:
                kw[a.name] = v
            else:
                pos.append(v)
        return op(*pos, **kw)
    run.__name__ = name
    return run


class Raised:
    def __init__(self, e):
        self.type, self.msg = type(e), str(e).split("\n")[0]

    def __eq__(self, other):
        return isinstance(other, Raised) and self.type is other.type and self.msg == other.msg

    def __repr__(self):
        return f"{self.type.__name__}({self.msg[:90]!r})"


def _outcome(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - the outcome under test
        return Raised(e)


def _host(r):
    """A result on the host (outside Gems' scope: copies and comparisons are ATen's own)."""
    if isinstance(r, torch.Tensor):
        return r.detach().cpu()
    return tuple(_host(x) for x in r) if isinstance(r, (tuple, list)) else r


def _same(want, got):
    if isinstance(want, Raised) or isinstance(got, Raised):
        return want == got
    if isinstance(want, tuple):
        return isinstance(got, tuple) and len(got) == len(want) and all(map(_same, want, got))
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor) or got.dtype != want.dtype or got.shape != want.shape:
            return False
        if want.is_floating_point():
            # accepted calls compute in floating point (a few ulps apart); rejects raise or wrap exactly
            rtol = 2e-3 if want.dtype in (torch.float16, torch.bfloat16) else 1e-5
            return torch.allclose(got.double(), want.double(), rtol=rtol, atol=1e-6, equal_nan=True)
        if want.is_complex():   # torch.equal has no complex32 kernel
            return torch.equal(want.to(torch.complex128), got.to(torch.complex128))
        return torch.equal(want, got)
    return want == got


def aten_outcomes(fns):
    """Each call's outcome with ATen alone: Gems unregistered (no scope is active in the tests)."""
    gems.disable()
    assert not gems.dispatch.is_registered(), "Gems is still registered: ATen's own outcome cannot be taken"
    return [_host(_outcome(f)) for f in fns]


def check_table(rows, include=None, exclude=None):
    """rows: (label, accepted call or None, call under test). With Gems on, each accepted call runs
    right before its call under test (both compared with ATen); every mismatch is listed."""
    flat = [f for _, ok, bad in rows for f in ((ok, bad) if ok is not None else (bad,))]
    want = iter(aten_outcomes(flat))
    expect = [(next(want) if ok is not None else None, next(want)) for _, ok, _ in rows]
    got = []
    with gems.use_gems(include=include, exclude=exclude):
        for _, ok, rej in rows:
            got.append((_outcome(ok) if ok is not None else None, _outcome(rej)))
    bad_rows = []
    for (label, ok, _), (w_ok, w_rej), (g_ok, g_rej) in zip(rows, expect, got):
        if ok is not None and not _same(w_ok, _host(g_ok)):
            bad_rows.append(f"{label} (accepted neighbour): ATen {w_ok!r}, Gems {_host(g_ok)!r}")
        if not _same(w_rej, _host(g_rej)):
            bad_rows.append(f"{label}: ATen {w_rej!r}, Gems {_host(g_rej)!r}")
    assert not bad_rows, f"{len(bad_rows)} of {len(rows)} differ from ATen:\n" + "\n".join(bad_rows)
    return expect


# ------------------------------------------------------------------------------------------------
# integer division by zero
# ------------------------------------------------------------------------------------------------

def _dividend(dtype):
    if dtype == torch.uint8:
        return [7, 0, 255, 1, 9, 200]
    if dtype == torch.int64:
        return [7, -7, 0, 2 ** 33, -(2 ** 33), 2 ** 62]
    info = torch.iinfo(dtype)
    return [7, -7, 0, info.max, info.min, -1]


DIVISION = ("remainder", "remainder_", "fmod", "fmod_", "div", "div_")


@pytest.mark.parametrize("dtype", INT_DTYPES, ids=str)
def test_integer_division_by_zero(dtype):
    a = _dividend(dtype)
    zeros = [0, 3, 0, 2, 0, 0]
    rows = []
    for name in _registered(*DIVISION):
        schema = _schema(name)
        names = [x.name for x in schema.arguments]
        modes = ["trunc", "floor"] if "rounding_mode" in names else [None]
        if name.startswith("div") and modes == [None]:
            continue                          # true division: a float result, no integer zero
        typed = {x.name: _tensor_typed(x) for x in schema.arguments}
        for mode in modes:
            for label, div, ok_div in (("tensor divisor", lambda: _t(zeros, dtype), lambda: _t([2, 3, 5, 2, 1, 7], dtype)),
                                       ("number divisor", 0, 16)):
                if label == "tensor divisor" and not typed["other"]:
                    continue
                if label == "number divisor" and typed["other"] and not typed["self"]:
                    continue
                self_v = (lambda: _t(a, dtype)) if typed["self"] else 7
                extra = {"rounding_mode": mode} if mode else {}
                ok = call(name, {"self": self_v, "other": ok_div, **extra}, dtype)
                rej = call(name, {"self": self_v, "other": div, **extra}, dtype)
                rows.append((f"{name} {label} {mode or ''} {dtype}", ok, rej))
    # an empty iteration never divides: ATen answers
    rows.append(("remainder.Scalar empty", None, call("remainder.Scalar", {"self": lambda: _t([], dtype), "other": 0})))
    assert len(rows) >= 20
    check_table(rows)


# ------------------------------------------------------------------------------------------------
# Scalar arguments: alpha's kind, values out of the dtype's range
# ------------------------------------------------------------------------------------------------

ALPHA = ("add", "add_", "sub", "sub_", "rsub")


@pytest.mark.parametrize("dtype,alpha", [(torch.int32, 0.5), (torch.int64, 2.0), (torch.uint8, 0.5),
                                         (torch.float32, True), (torch.int32, True), (torch.int8, 300),
                                         (torch.float16, 1e40), (torch.float32, -1e39)], ids=str)
def test_alpha(dtype, alpha):
    rows = []
    for name in _registered(*ALPHA):
        typed = {x.name: _tensor_typed(x) for x in _schema(name).arguments}
        args = {"self": lambda: _t([1, 2, 3], dtype), "other": (lambda: _t([3, 2, 1], dtype)) if typed["other"] else 2}
        rows.append((f"{name} alpha={alpha!r} {dtype}", call(name, {**args, "alpha": 2}, dtype),
                     call(name, {**args, "alpha": alpha}, dtype)))
    assert len(rows) >= 14
    check_table(rows)


# valid values of the number arguments of registered overloads, by name
_VALID = {"other": 2, "alpha": 2, "value": 2, "min": 0, "max": 2, "exponent": 2, "self": 2, "weight": 0.5,
          "negative_slope": 0.5, "min_val": -1, "max_val": 1, "beta": 1, "threshold": 1, "eps": 0.1,
          "scale": 1, "input_scale": 1}
# arguments that are not numbers: valid values by name
_OTHER = {"is_result": False, "self_is_result": False, "approximate": "none", "normalized_shape": [3], "dim": 0}
# per dtype of the tensors: numbers that do not fit it (or are of another kind), and a tensor's values
_MISFITS = {torch.int8: (300, 2.5), torch.uint8: (-256, True), torch.int16: (40000,), torch.int32: (-2 ** 31 - 1,),
            torch.float16: (-1e9, 70000), torch.float32: (1e40, True)}
_VALUES = {torch.int8: [1, 2, 3], torch.uint8: [1, 2, 3], torch.int16: [1, 2, 3], torch.int32: [1, 2, 3],
           torch.float16: [0.25, 0.5, 0.75], torch.float32: [0.25, 0.5, 0.75]}
_BOOL_OUT = ("eq", "ne", "lt", "le", "gt", "ge")


def _number_rows(dtype):
    """(label, accepted call, rejected call) for every registered overload with a number argument."""
    rows = []
    for name in gems.registered_ops():
        base = name.split(".", 1)[0].rstrip("_")
        schema = _schema(name)
        nums = [a.name for a in schema.arguments
                if str(a.type).replace("Optional[", "").rstrip("]") in ("number", "float") and a.name in _VALID]
        if not nums:
            continue
        args = {}
        matrix = base == "addmm"
        for a in schema.arguments:
            if _is_out(a) or a.name in nums:
                continue
            if _tensor_typed(a):
                if a.name in ("mask", "condition"):
                    args[a.name] = (lambda: _t([True, False, True], torch.bool))
                elif a.name == "index":    # scatter.value's index along dim 0
                    args[a.name] = (lambda: _t([2, 0], torch.int64))
                elif matrix:
                    args[a.name] = (lambda: _t([[0.25, 0.5], [0.75, 1.0]], dtype))
                else:
                    args[a.name] = (lambda: _t(_VALUES[dtype], dtype))
            elif str(a.type) == "List[Tensor]":   # _foreach_ ops: two tensors per list
                args[a.name] = (lambda: [_t(_VALUES[dtype], dtype), _t(_VALUES[dtype][:2], dtype)])
            elif a.name in _OTHER:
                args[a.name] = _OTHER[a.name]
        valid = {n: _VALID[n] for n in nums}
        out_dtype = torch.bool if base in _BOOL_OUT else dtype
        if base == "div" and not dtype.is_floating_point and "rounding_mode" not in [a.name for a in schema.arguments]:
            out_dtype = torch.float32
        for n in nums:
            for bad in _MISFITS[dtype]:
                # the accepted neighbour's number is of the same class: only what the plan signature
                # keys beyond the class (range, sign) tells the two apart
                near = valid[n] if isinstance(bad, bool) else type(bad)(valid[n])
                rows.append((f"{name} {n}={bad!r} {dtype}", call(name, {**args, **valid, n: near}, out_dtype),
                             call(name, {**args, **valid, n: bad}, out_dtype)))
    return rows


# overloads whose number checks live outside the pointwise generator (gems/ops/blas/matmul.py)
_KNOWN = ("addmm",)


@pytest.mark.parametrize("dtype", list(_MISFITS), ids=str)
def test_number_arguments_out_of_range(dtype):
    rows = [r for r in _number_rows(dtype) if r[0].split(".")[0].rstrip("_") not in _KNOWN]
    assert len(rows) > 60
    check_table(rows)


def test_number_arguments_out_of_range_blas():
    rows = [r for r in _number_rows(torch.float32) if r[0].split(".")[0].rstrip("_") in _KNOWN]
    assert rows
    check_table(rows)


# ------------------------------------------------------------------------------------------------
# integers to negative integer powers
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.int8], ids=str)
def test_negative_integer_exponent(dtype):
    rows = []
    base = lambda: _t([2, 3, 1, 0], dtype)
    for name in _registered("pow", "pow_"):
        typed = {x.name: _tensor_typed(x) for x in _schema(name).arguments}
        if not typed["self"]:             # number ** tensor: ATen answers (0, 1 or +-1)
            args = {"self": 2}
            ok, bad = (lambda: _t([2, 1, 0, 3], dtype)), (lambda: _t([-1, 2, -2, 0], torch.int64 if dtype == torch.uint8 else dtype))
        elif typed["exponent"]:           # tensor ** tensor: ATen answers
            args = {"self": base}
            ok, bad = (lambda: _t([2, 1, 0, 3], dtype)), (lambda: _t([-1, 2, -2, 0], torch.int64 if dtype == torch.uint8 else dtype))
        else:                             # tensor ** int: ATen raises for a negative int
            args = {"self": base}
            ok, bad = 2, -1
        if dtype == torch.uint8 and name.startswith("pow_") and typed["exponent"]:
            continue                      # an int64 exponent cannot be cast into uint8 self in place
        rows.append((f"{name} {dtype}", call(name, {**args, "exponent": ok}, dtype), call(name, {**args, "exponent": bad}, dtype)))
    rows.append(("pow.Tensor_Scalar -2", None, call("pow.Tensor_Scalar", {"self": base, "exponent": -2})))
    rows.append(("pow.Tensor_Scalar -1.0", None, call("pow.Tensor_Scalar", {"self": base, "exponent": -1.0})))
    check_table(rows)


# ------------------------------------------------------------------------------------------------
# numbers whose sign a check reads: negative slopes with in-place results
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_negative_slope_with_inplace_result(dtype):
    g, x = (lambda: _t([0.5, -0.25, 1.0], dtype)), (lambda: _t([1.0, -0.5, 0.25], dtype))
    rows = []
    for name in _registered("elu_backward"):
        args = {"grad_output": g, "scale": 1.0, "input_scale": 1.0, "is_result": True, "self_or_result": x}
        rows.append((name, call(name, {**args, "alpha": 1.0}, dtype), call(name, {**args, "alpha": -1.0}, dtype)))
        # ATen requires alpha >= 0, which NaN is not
        rows.append((name + " nan", None, call(name, {**args, "alpha": float("nan")}, dtype)))
    for name in _registered("leaky_relu_backward"):
        args = {"grad_output": g, "self": x, "self_is_result": True}
        rows.append((name, call(name, {**args, "negative_slope": 0.5}, dtype),
                     call(name, {**args, "negative_slope": -0.5}, dtype)))
        rows.append((name + " nan", None, call(name, {**args, "negative_slope": float("nan")}, dtype)))
    assert len(rows) == 8
    check_table(rows)


# ------------------------------------------------------------------------------------------------
# Python numbers at Tensor positions when ATen runs the call (Gems off for the op, or falling back)
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_wrapped_numbers_out_of_a_float_range(dtype):
    # ATen converts a wrapped number to the common dtype (inf) or reads it at opmath precision, by op
    # and variant: Gems leaves such calls to ATen
    x = lambda: _t([0.25, 0.5, 3.0], dtype)
    big = 1e6 if dtype == torch.float16 else 1e39
    rows = []
    for bad, near in ((big, 2.0), (-big, -2.0), (70000, 2)) if dtype == torch.float16 else ((big, 2.0), (-big, -2.0)):
        for label, f in (("add", lambda v: x() + v), ("mul_", lambda v: x().mul_(v)), ("rsub", lambda v: v - x()),
                         ("remainder", lambda v: torch.remainder(x(), v)), ("pow", lambda v: torch.pow(v, x())),
                         ("fmod", lambda v: torch.fmod(x(), v)), ("maximum", lambda v: torch.maximum(x(), torch.tensor(v))),
                         ("lt", lambda v: x() < v), ("where", lambda v: torch.where(x() > 1, x(), v))):
            rows.append((f"{label} {bad!r} {dtype}", (lambda f=f, near=near: f(near)), (lambda f=f, bad=bad: f(bad))))
    check_table(rows)


def test_wrapped_numbers_when_aten_runs_the_call():
    # the overloads are registered but excluded: each call reaches ATen through Gems' fallback path,
    # which hands ATen the wrapped number as a 0-dim tensor (gems.codegen.numbers)
    i8, u8 = (lambda: _t([1, 44, -3], torch.int8)), (lambda: _t([255, 1, 0], torch.uint8))
    f16 = lambda: _t([1000.0, 3.0, -2.0], torch.float16)
    exprs = {"add": lambda x, v: x + v, "mul": lambda x, v: x * v, "sub": lambda x, v: x - v,
             "rsub": lambda x, v: v - x, "div": lambda x, v: x / v, "remainder": torch.remainder}
    rows = []
    for a, b in ((i8, 300), (i8, -129), (u8, -1), (u8, 256), (f16, 1e-8), (f16, 0.1), (f16, 1e6),
                 (lambda: _t([1.0, 2.0], torch.float32), 1e40), (lambda: _t(5, torch.int8), 100),
                 (lambda: _t([1, 2], torch.int32), 2.5), (lambda: _t(5, torch.int8), 2.5)):
        for name, f in exprs.items():
            rows.append((f"{name} {b!r}", None, (lambda f=f, a=a, b=b: f(a(), b))))
    check_table(rows, exclude=list(exprs))


# ------------------------------------------------------------------------------------------------
# Python complex numbers: no Gems kernel takes one; ATen runs the call, counted as a fallback
# ------------------------------------------------------------------------------------------------

def _complex_number_rows():
    tensors = {"f32": lambda: _t([0.25, 0.5, 3.0], torch.float32), "f64": lambda: _t([0.1, -2.0, 7.5], torch.float64),
               "f16": lambda: _t([0.25, 0.5, 3.0], torch.float16), "i64": lambda: _t([1, 44, -3], torch.int64),
               "i8": lambda: _t([1, 44, -3], torch.int8), "f32 0-dim": lambda: _t(1.5, torch.float32),
               "bool": lambda: _t([True, False], torch.bool)}
    exprs = {"add": lambda x, v: x + v, "sub": lambda x, v: x - v, "mul": lambda x, v: x * v,
             "div": lambda x, v: x / v, "rsub": lambda x, v: v - x, "torch.rsub": lambda x, v: torch.rsub(x, v),
             "add alpha": lambda x, v: torch.add(x, v, alpha=2), "add_": lambda x, v: x.add_(v),
             "f64 0-dim +": lambda x, v: x + _t(0.5, torch.float64) + v}
    return [(f"{e} {k} {v!r}", None, (lambda f=f, t=t, v=v: f(t(), v)))
            for v in (1j, 2 + 3j, 0.1 - 1e-3j) for e, f in exprs.items() for k, t in tensors.items()
            if not (k == "f16" and e == "div")]   # complex32 division has no CPU kernel in ATen


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_complex_numbers_go_to_aten():
    rows = _complex_number_rows()
    gems.reset_stats()
    expect = check_table(rows)
    assert sum(not isinstance(w, Raised) for _, w in expect) > len(rows) // 2   # mostly answered, not raised
    stats = gems.stats()
    for name in ("add.Tensor", "sub.Tensor", "mul.Tensor", "div.Tensor"):
        reasons = stats[name]["reasons"]
        assert stats[name]["fallback"] and any("complex" in r for r in reasons), (name, stats[name])


def test_complex_number_snippets():
    # the hand-checked calls, as a user writes them with Gems on for the whole process
    want = [torch.ones(3) + 1j, torch.ones(3) * (2 + 3j), torch.ones(3) - 1j, torch.arange(3) / 1j, 1j - torch.ones(3)]
    gems.enable()
    try:
        got = [torch.ones(3) + 1j, torch.ones(3) * (2 + 3j), torch.ones(3) - 1j, torch.arange(3) / 1j,
               1j - torch.ones(3)]
    finally:
        gems.disable()
    for w, g in zip(want, got):
        assert g.dtype == w.dtype and torch.equal(g, w), (w, g)


# ------------------------------------------------------------------------------------------------
# answers where ATen raises: cropping pads, masked_fill's value tensor, out= that is an input
# ------------------------------------------------------------------------------------------------

def test_pad_cropping_past_the_input():
    # ATen narrows by the negative pads before anything else: narrow() raises even where the padded
    # size is not negative (F.pad(zeros(4, 2), (1, -3)) has size 2 + 1 - 3 = 0)
    import torch.nn.functional as F
    rows = []
    for shape, ok, bad in (((4, 2), (1, -1), (1, -3)), ((4, 2), (-1, 1), (-3, 1)), ((4, 2), (-1, 0), (-1, -2)),
                           ((4, 2), (2, -2), (2, -4)), ((4, 2), (-1, -1), (-3, -3)),
                           ((2, 4, 2), (1, 1, -3, 1), (1, 1, -5, 1)), ((2, 4, 2), (0, 0, -2, -2), (0, 0, -2, -3))):
        x = lambda shape=shape: _t(torch.arange(float(torch.Size(shape).numel())).reshape(shape).tolist(),
                                   torch.float32)
        rows.append((f"pad {shape} {bad}", (lambda x=x, p=ok: F.pad(x(), p)), (lambda x=x, p=bad: F.pad(x(), p))))
    check_table(rows)


def test_masked_fill_value_tensor_out_of_range():
    # ATen reads the 0-dim value as a Scalar and converts it with an overflow check
    mask = lambda: _t([True, False, True], torch.bool)  # noqa: E731
    rows = []
    for dtype, ok, bad in ((torch.int8, _t(100, torch.int64), _t(300, torch.int64)),
                           (torch.int8, _t(-100, torch.int64), _t(-300, torch.int64)),
                           (torch.int16, _t(7, torch.int32), _t(40000, torch.int32)),
                           (torch.uint8, _t(-1, torch.int64), _t(256, torch.int64)),
                           (torch.int32, _t(2.5, torch.float32), _t(float("nan"), torch.float32)),
                           (torch.int64, _t(3.0, torch.float64), _t(1e19, torch.float64)),
                           (torch.float16, _t(100.0, torch.float32), _t(7e4, torch.float32)),
                           (torch.float16, _t(100, torch.int32), _t(70000, torch.int32)),
                           (torch.float32, _t(1.0, torch.float64), _t(1e39, torch.float64)),
                           (torch.bool, _t(1, torch.int64), _t(5, torch.int64))):
        x = lambda dtype=dtype: _t([1, 2, 3], dtype)
        for label, f in (("masked_fill", lambda x, v: x.masked_fill(mask(), v)),
                         ("masked_fill_", lambda x, v: x.masked_fill_(mask(), v)),
                         ("masked_fill out", lambda x, v: A.masked_fill.Tensor_out(x, mask(), v, out=torch.empty_like(x)))):
            rows.append((f"{label} {dtype} {bad.item()!r}", (lambda f=f, x=x, v=ok: f(x(), v)),
                         (lambda f=f, x=x, v=bad: f(x(), v))))
    check_table(rows)


def test_masked_fill_value_tensor_snippet():
    def run():
        return _outcome(lambda: _t([1, 2], torch.int8).masked_fill(_t([True, False], torch.bool), torch.tensor(300)))
    gems.disable()
    want = run()
    with gems.use_gems():
        got = run()
    assert isinstance(want, Raised) and "without overflow" in want.msg and got == want, (want, got)


@pytest.mark.filterwarnings("ignore:An output with one or more elements was resized")
def test_cat_and_stack_into_an_input():
    # ATen rejects out= being one of cat's inputs even where they are empty; stack resizes out (and so
    # that input) first, then raises or answers by what the input became
    rows = []
    for shape, dim in (((0,), 0), ((0, 3), 0), ((0, 3), -1), ((3, 0), 0), ((2, 0, 2), 1), ((3,), 0)):
        x, y = (lambda shape=shape: _t(torch.zeros(shape).tolist(), torch.float32)), \
            (lambda shape=shape: _t(torch.ones(shape).tolist(), torch.float32))

        def into_first(op, x=x, y=y, dim=dim):
            a = x()
            return op([a, y()], dim, out=a)

        def into_second(op, x=x, y=y, dim=dim):
            b = y()
            return op([x(), b], dim, out=b)

        def fresh(op, x=x, y=y, dim=dim):
            return op([x(), y()], dim, out=torch.empty(0, device=DEVICE))

        for op in (torch.cat, torch.stack):
            rows.append((f"{op.__name__} {shape} dim {dim} out=first", (lambda op=op, f=fresh: f(op)),
                         (lambda op=op, f=into_first: f(op))))
            rows.append((f"{op.__name__} {shape} dim {dim} out=second", (lambda op=op, f=fresh: f(op)),
                         (lambda op=op, f=into_second: f(op))))
    x = lambda: torch.empty(0, device=DEVICE)  # noqa: E731
    rows.append(("cat snippet", None, lambda: (lambda a: torch.cat([a, _t([1.0, 2.0, 3.0], torch.float32)], 0,
                                                                    out=a))(x())))
    check_table(rows)


@pytest.mark.parametrize("case", ["fill_", "zero_", "masked_fill_", "add_", "mul_out"])
def test_written_tensor_that_overlaps_itself_is_atens_call(case):
    """An expanded written-to tensor: fill_, zero_ and masked_fill_ write it in ATen, most ops raise.
    Gems hands such calls to ATen (counted), never answering differently nor warning as if it failed."""
    import warnings

    def run(fn):
        base = torch.arange(3.0, device=DEVICE).reshape(1, 3)
        x = base.expand(4, 3)
        mask = torch.tensor([[True, False, True]], device=DEVICE).expand(4, 3)
        calls = {"fill_": lambda: x.fill_(2.5), "zero_": lambda: x.zero_(),
                 "masked_fill_": lambda: x.masked_fill_(mask, -1.0), "add_": lambda: x.add_(1.0),
                 "mul_out": lambda: torch.mul(torch.ones(4, 3, device=DEVICE), 2.0, out=x)}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")      # ATen's own deprecation warning of masked_fill_
                calls[case]()
        except RuntimeError as e:
            return "raises", str(e).splitlines()[0]
        return "writes", base.cpu()

    want = run(None)
    gems.reset_stats()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a Gems error would warn (and fail under GEMS_STRICT)
        with gems.use_gems():
            got = run(None)
            again = run(None)                        # the signature's second call (its plan, if any)
    for g in (got, again):
        assert g[0] == want[0]
        if want[0] == "raises":
            assert g[1] == want[1]
        else:
            torch.testing.assert_close(g[1], want[1])
