"""Special values through every registered pointwise overload, and through the reductions, norms and
GEMMs the models use: NaN, +-inf, -0.0, values that overflow, subnormals, integer extremes.

Gems' result must be ATen's on the same device: the same NaNs, infinities and signs of zero, finite
values within the dtype's tolerance (or within 2x ATen's own error against float64, the suite's
rule). The only accepted differences are the rows of docs/known-differences.md, read from there.
Differences that are bugs still to fix are listed in KNOWN_BUGS below, per device, as strict xfails:
fixing one makes its test fail until the entry is removed.
"""
from __future__ import annotations

import itertools
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import gems
from gems import registry
from harness import DEVICE

DOC = Path(__file__).resolve().parents[2] / "docs" / "known-differences.md"
INF, NAN = float("inf"), float("nan")
SPECIALS = [NAN, INF, -INF, 0.0, -0.0, 3.0e38, -3.0e38, 1e-40, -1e-40, 1.0, -1.0, 0.5, -2.5, 100.0, -100.0,
            88.8, -88.8, 1e-7]
NUMBERS = [2.0, 0.0, INF, -INF, NAN, -1.5]   # Python number arguments (-0.0: see test_negative_zero_number)
INT_NUMBERS = [2, 0, -1]
# arguments that are not operands: a value ATen accepts
FIXED = {"is_result": [False], "self_is_result": [False], "rounding_mode": ["trunc", "floor"], "decimals": [1],
         "threshold": [1.0], "beta": [1.0], "negative_slope": [0.01], "min_val": [-1.0], "max_val": [1.0],
         "alpha": [1.0], "scale": [1.0], "input_scale": [1.0], "approximate": ["none", "tanh"]}

# Bugs found by this sweep, not yet fixed: {overload: {device: why}}. Not differences to
# document: each is ATen's answer that Gems should give.
# (addcdiv's CUDA entry is gone: with the quotient as div_rn it passes on an H100)
KNOWN_BUGS = {}


# ----------------------------------------------------------------------------- known differences
def _known_rows():
    rows = []
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 5 or not cells[0].startswith("`"):
            continue
        ops = re.findall(r"`([^`]+)`", cells[0])
        inputs, value = (re.fullmatch(r"`(.+)`", c).group(1) for c in cells[1:3])
        rows.append((set(ops), compile(inputs, str(DOC), "eval"), compile(value, str(DOC), "eval")))
    return rows


ROWS = _known_rows()
_ENV = {"inf": INF, "nan": NAN, "isnan": math.isnan, "isinf": math.isinf, "isfinite": math.isfinite, "abs": abs,
        "__builtins__": {}}


class _Names(dict):
    def __missing__(self, key):   # an argument this overload does not have
        return None


def _documented(base, values, g, a):
    """Whether a row of the table accepts Gems' value `g` (ATen's `a`) for inputs {schema name: value}."""
    names = _Names(_ENV)   # lookups try these locals first: the functions must be in them
    names.update(values)
    names.update(g=g, a=a)
    for ops, inputs, value in ROWS:
        if base.rstrip("_") not in ops:
            continue
        try:
            if eval(inputs, _ENV, names) and eval(value, _ENV, names):   # noqa: S307 - our own doc
                return True
        except (TypeError, ZeroDivisionError, OverflowError):
            continue
    return False


def test_known_differences_table_is_read():
    assert len(ROWS) >= 5
    assert all(ops for ops, _, _ in ROWS)
    # every op named there is one Gems registers
    bases = {i.base.rstrip("_") for i in registry.all_impls()}
    for ops, _, _ in ROWS:
        assert ops <= bases, ops - bases


# ------------------------------------------------------------------------------------ comparing
def _tol(dtype):
    return {torch.float32: (1e-5, 1e-30), torch.float16: (1e-3, 6e-8), torch.bfloat16: (8e-3, 1e-30)}.get(dtype, (0, 0))


def _mismatches(g, a, ref):
    """Flat indices where Gems' tensor `g` differs from ATen's `a` (ref: ATen in float64, or None)."""
    if a.dtype != g.dtype or a.shape != g.shape:
        return None
    if not a.is_floating_point():
        return (g != a).flatten().nonzero().flatten().tolist()
    gf, af = g.detach().cpu().double().flatten(), a.detach().cpu().double().flatten()
    gn, an = torch.isnan(gf), torch.isnan(af)
    bad = gn != an
    both = ~gn & ~an
    special = both & (torch.isinf(af) | torch.isinf(gf) | (af == 0) | (gf == 0))
    bad |= special & ((gf != af) | (torch.signbit(gf) != torch.signbit(af)))
    rtol, atol = _tol(a.dtype)
    fin = both & ~special
    off = fin & ((gf - af).abs() > rtol * af.abs() + atol)
    if off.any() and ref is not None:
        r = ref.detach().cpu().double().flatten()
        # the suite's rule: within 2x ATen's own error against float64
        off &= ~((gf - r).abs() <= 2 * (af - r).abs() + rtol * r.abs() + atol)
    bad |= off
    return bad.nonzero().flatten().tolist()


def _leaves(x):
    return [t for t in (x if isinstance(x, (tuple, list)) else [x]) if isinstance(t, torch.Tensor)]


# ATen's own CPU kernels die of SIGFPE on INT_MIN // -1: division-like ops get INT_MIN + 1 instead
_DIVIDES = ("div", "remainder", "fmod", "floor_divide")


def _operands(dtype, n_tensors, names, divides=False):
    if dtype.is_floating_point:
        x = torch.tensor(SPECIALS, dtype=torch.float32).to(dtype)
    elif dtype == torch.bool:
        x = torch.tensor([True, False] * 9)
    else:
        info = torch.iinfo(dtype)
        low = info.min + 1 if divides else info.min
        vals = [0, 1, -1, 2, -2, 7, info.max, low, info.max - 1, 3, -3, 5, 31, 63, -64, 100, -100, 64]
        x = torch.tensor([max(info.min, min(info.max, v)) for v in vals], dtype=dtype)
    n = x.numel()
    ts = [x] if n_tensors == 1 else [x.repeat_interleave(n), x.repeat(n)] if n_tensors == 2 else \
        [x.repeat_interleave(n), x.repeat(n), x.flip(0).repeat(n)]
    for i, name in enumerate(names):
        if name in ("mask", "condition"):
            ts[i] = (torch.arange(ts[i].numel()) % 3 == 0)
        elif name == "value":   # masked_fill.Tensor, fill_.Tensor: a 0-dim value
            ts[i] = x[0] if dtype.is_floating_point else x[6]
    return [t.to(DEVICE) for t in ts]


def _pointwise_overloads():
    out = []
    for impl in registry.all_impls(gems.backend().name):
        schema = registry.aten_overload(impl.name)._schema
        if impl.category != "pointwise" or any(a.alias_info is not None and a.alias_info.is_write
                                               for a in schema.arguments):
            continue   # out= and in-place variants run the same kernels
        out.append(impl.name)
    return out


def _call_combos(schema, dtype):
    pos = [a for a in schema.arguments if not a.kwarg_only or not a.has_default_value()]
    choices = []
    for a in pos:
        t = str(a.type).replace("Optional[", "").rstrip("]")
        if t == "Tensor":
            choices.append(["T"])
        elif a.name in FIXED:
            choices.append(FIXED[a.name])
        elif t == "number":
            choices.append(NUMBERS if dtype.is_floating_point else INT_NUMBERS)
        elif a.has_default_value():
            choices.append([None])
        else:
            return pos, None
    return pos, list(itertools.product(*choices))[:48]


@pytest.mark.parametrize("name", _pointwise_overloads())
def test_special_values_follow_aten(name, request):
    bug = KNOWN_BUGS.get(name, {}).get(DEVICE)
    if bug:
        request.applymarker(pytest.mark.xfail(reason=f"known bug: {bug}", strict=True))
    impl = registry.get(name)
    op = registry.aten_overload(name)
    schema = op._schema
    tensor_args = [a for a in schema.arguments if str(a.type) in ("Tensor", "Optional[Tensor]") and not a.kwarg_only]
    if len(tensor_args) > 3:
        pytest.skip("more than three tensor operands")
    failures, calls = [], 0
    for dtype in (torch.float32, torch.float16, torch.int32, torch.bool):
        if dtype not in impl.dtypes:
            continue
        pos, combos = _call_combos(schema, dtype)
        if combos is None:
            pytest.skip(f"an argument the sweep cannot choose: {[a.name for a in pos]}")
        ts = _operands(dtype, len(tensor_args), [a.name for a in tensor_args], impl.base.rstrip("_") in _DIVIDES)
        for combo in combos:
            args, kwargs, numbers, ti, named = [], {}, [], 0, {}
            for a, v in zip(pos, combo):
                if v == "T":
                    v, ti = ts[ti], ti + 1
                    named[a.name] = v
                elif v is None:
                    continue
                elif "number" in str(a.type):
                    numbers.append(v)
                    named[a.name] = v
                (kwargs.__setitem__(a.name, v) if a.kwarg_only else args.append(v))
            try:
                want = op(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - ATen's error must be Gems' too
                with gems.use_gems(), pytest.raises(type(e)):
                    op(*args, **kwargs)
                continue
            with gems.use_gems():
                got = op(*args, **kwargs)
            calls += 1
            ref = None
            if dtype.is_floating_point:
                try:
                    ref = op(*[x.double().cpu() if isinstance(x, torch.Tensor) and x.is_floating_point() else
                               x.cpu() if isinstance(x, torch.Tensor) else x for x in args], **kwargs)
                except Exception:  # noqa: BLE001 - no float64 reference for this call
                    ref = None
            for k, (g, a) in enumerate(zip(_leaves(got), _leaves(want))):
                r = _leaves(ref)[k] if ref is not None else None
                bad = _mismatches(g, a, r)
                if bad is None:
                    failures.append(f"{dtype} {numbers}: output {k} is {g.dtype}{list(g.shape)}, ATen "
                                    f"{a.dtype}{list(a.shape)}")
                    continue
                gf, af = g.detach().cpu().flatten(), a.detach().cpu().flatten()
                for i in bad:
                    ins = [t.flatten()[i % t.numel()].item() for t in ts]
                    values = {k: (v.flatten()[i % v.numel()].item() if isinstance(v, torch.Tensor) else v)
                              for k, v in named.items()}
                    gi, ai = gf[i].item(), af[i].item()
                    if dtype.is_floating_point and _documented(impl.base, values, gi, ai):
                        continue
                    failures.append(f"{str(dtype)[6:]} inputs {ins} numbers {numbers}: Gems {gi!r}, ATen {ai!r}")
                    break
    assert calls, "no call was made"
    assert not failures, f"aten::{name} differs from ATen ({len(failures)} cases):\n  " + "\n  ".join(failures[:8])


def test_negative_zero_number_keeps_its_sign():
    # Triton folds a scalar argument equal to 0 into its zero constant (the interpreter's
    # semantic.scalar_constant; CUDA too), losing -0.0's sign: such numbers key their own signature
    # and go to ATen (codegen.generator.number_misfit)
    x = torch.tensor([0.0, 1.0, INF, -INF], device=DEVICE)
    for fn in (lambda t: t * -0.0, lambda t: t + -0.0, lambda t: t / -0.0, lambda t: torch.clamp_max(t, -0.0),
               lambda t: torch.clamp_min(t, -0.0), lambda t: t.masked_fill(t > 0.5, -0.0)):
        want = fn(x)
        with gems.use_gems():
            got = fn(x)
        assert torch.equal(torch.signbit(got), torch.signbit(want)) and torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))


def test_pow_half_with_a_sqrt_exponent():
    # ATen's CPU Half kernel takes C pow for the exponents 0.5 and -0.5 ((-inf) ** 0.5 = inf), its Float
    # kernel and CUDA sqrt and 1 / sqrt (NaN): on the CPU Gems leaves fp16 scalar powers to ATen
    x = torch.tensor([-INF, -0.0, 0.0, 4.0, -1.0, NAN, INF, 1e-3], dtype=torch.float16, device=DEVICE)
    with gems.use_gems():
        x ** 2.0                      # a plan for a positive float exponent must not serve 0.5 below
    for e in (0.5, -0.5):
        want = x ** e
        with gems.use_gems():
            got = x ** e
        assert torch.equal(torch.signbit(got), torch.signbit(want)) and torch.equal(got.isnan(), want.isnan())
        assert torch.allclose(got.nan_to_num(0.0), want.nan_to_num(0.0), rtol=1e-3)


# ------------------------------------------------------------- reductions, norms, softmax, GEMM
def _rows(dtype):
    """Rows with NaN, +inf, -inf, both infinities, a huge value, and finite ones."""
    r = torch.tensor([[1.0, 2.0, NAN, -1.0], [1.0, INF, 0.5, 2.0], [-INF, 1.0, 2.0, 0.0], [INF, -INF, 1.0, 2.0],
                      [3e38, 3e38, 1.0, -1.0], [1.0, -2.0, 0.5, 4.0], [-0.0, -0.0, -0.0, -0.0]])
    return r.to(dtype=dtype, device=DEVICE)


NON_POINTWISE = {
    "sum": (lambda x: x.sum(1), "sum.dim_IntList"),
    "sum_all": (lambda x: x.sum(), "sum.default"),
    "mean": (lambda x: x.mean(1), "mean.dim"),
    "amax": (lambda x: x.amax(1), "amax.default"),
    "softmax": (lambda x: torch.softmax(x, 1), "_softmax.default"),
    "log_softmax": (lambda x: torch.log_softmax(x, 1), "_log_softmax.default"),
    "layer_norm": (lambda x: F.layer_norm(x, (4,)), "native_layer_norm.default"),
    "mm": (lambda x: x @ torch.ones(4, 3, dtype=x.dtype, device=x.device), "mm.default"),
    "mm_t": (lambda x: torch.ones(3, 7, dtype=x.dtype, device=x.device) @ x, "mm.default"),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", sorted(NON_POINTWISE))
def test_special_values_in_reductions_norms_gemm(case, dtype):
    fn, served = NON_POINTWISE[case]
    x = _rows(dtype)
    want = fn(x)
    before = gems.dispatch.op_runtime(served).served
    with gems.use_gems():
        got = fn(x)
    assert gems.dispatch.op_runtime(served).served > before, f"Gems did not serve {served}"
    ref = fn(x.double().cpu())
    base = served.split(".")[0]
    for g, a, r in zip(_leaves(got), _leaves(want), _leaves(ref)):
        bad = _mismatches(g, a, r)
        if g.shape == x.shape:   # elementwise outputs: the table's rows apply per element
            xs, gs, as_ = x.cpu().flatten(), g.cpu().flatten(), a.cpu().flatten()
            bad = [i for i in bad if not _documented(base, {"self": xs[i].item()}, gs[i].item(), as_[i].item())]
        assert bad == [], f"{case}: Gems {g.flatten().tolist()} vs ATen {a.flatten().tolist()}"
