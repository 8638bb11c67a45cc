"""Differential fuzz: random calls of every registered overload, ATen alone vs Gems (`use_gems(include=[op])`).

Each case (tests/fuzz/fuzz_gen.py) runs twice on copies of the same inputs; the two runs must agree on
whether they raise (the same exception type, the same message), and otherwise on each result's dtype,
shape, strides (where the result is not a view: a separate class), values (exact for ints and bool,
the same NaNs and infinities, finite values within the dtype's tolerance or within 2x ATen's own error
against float64, tests/harness.py's rule) and on every tensor argument afterwards (in-place and out=).

Bounded in CI: a fixed number of cases per overload (ROUNDS, by category: about 70 s on a CI-class CPU
through the interpreter; the same cases on every machine); GEMS_FUZZ_SECONDS=N fuzzes for N seconds
instead, shared among the categories by their number of overloads; GEMS_FUZZ_SEED picks other cases; GEMS_FUZZ_OPS=name,name fuzzes only those overloads and
GEMS_FUZZ_CASE=i runs only case i of each (a mismatch row names its seed and index); GEMS_FUZZ_SHARDS=n
splits each category into n tests for parallel workers. On the GPU, 1800 fuzzing seconds over 16 workers:
`GEMS_TEST_DEVICE=cuda GEMS_FUZZ_SECONDS=1800 GEMS_FUZZ_SHARDS=16 python -m pytest -n 16 tests/fuzz`
(scripts/gpu_check.sh fuzz).
"""
from __future__ import annotations

import math
import os
import sys
import time
import warnings

import pytest
import torch

import gems
from gems import registry
from harness import DEVICE, TOL

from fuzz_gen import Case, Skip, clone_args, make_case, skip_reason

SECONDS = float(os.environ.get("GEMS_FUZZ_SECONDS", "0"))
# cases per overload without GEMS_FUZZ_SECONDS: the CI run (the overloads of a category take turns)
ROUNDS = {"blas": 16, "copy": 30, "index": 30, "norm": 50, "other": 100, "pointwise": 24, "reduction": 24}
SEED = int(os.environ.get("GEMS_FUZZ_SEED", "0"))
# each category's overloads split into this many tests (every other SHARDS-th overload), each with its
# share of the category's time: a time-bounded run keeps every pytest-xdist worker busy
SHARDS = max(1, int(os.environ.get("GEMS_FUZZ_SHARDS", "1")))
ONLY = [registry.canonical(n) for n in os.environ.get("GEMS_FUZZ_OPS", "").split(",") if n]
CASE = os.environ.get("GEMS_FUZZ_CASE")
VERBOSE = bool(os.environ.get("GEMS_FUZZ_VERBOSE"))
BACKEND = "cuda" if DEVICE == "cuda" else "interpreter"

# Documented differences (docs/known-differences.md) the fuzz meets: (op base, class) -> why. Where
# `special` is True a value difference is accepted only for a case whose inputs hold special values.
KNOWN_DIFFERENCES = {
    ("gelu", "value"): (True, "gelu(+inf), gelu of huge inputs: the exact limit"),
    ("cosh", "value"): (False, "cosh near fp32's limit: ATen's CPU vector path overflows"),
    ("sinh", "value"): (False, "sinh near fp32's limit: ATen's CPU vector path overflows"),
    ("fmod", "value"): (True, "fmod of huge quotients: exact in Gems, NaN on ATen's CPU"),
    ("remainder", "value"): (True, "remainder of huge quotients: exact in Gems, NaN on ATen's CPU"),
    ("elu_backward", "value"): (True, "a NaN self: ATen's CPU vector path on every element"),
    ("hardswish_backward", "value"): (True, "a NaN self: ATen's CPU vector path on every element"),
    ("hardtanh_backward", "value"): (True, "a NaN self: ATen's CPU vector path on every element"),
    ("logit_backward", "value"): (True, "a NaN self: ATen's CPU vector path on every element"),
    ("_softmax_backward_data", "value"): (True, "fp16/bf16 products grad * y past the dtype's range: NaN on "
                                                "ATen's CUDA kernel, fp32 products in Gems"),
    ("add", "value"): (True, "self + alpha * other past fp32's range beside an infinity: one fused multiply-add "
                             "(ATen's CPU vector path, CUDA), NaN on ATen's CPU scalar tail"),
    ("sub", "value"): (True, "self - alpha * other past fp32's range beside an infinity: as add"),
}
# Bugs the fuzz found that are not fixed yet: (op base or overload, class) -> one line. Printed in the
# table, not failed: remove an entry with its fix.
KNOWN_BUGS = {
}

# ATen's own failures on a valid call (its message): not Gems' to copy; printed, not failed
# (message, the ops it is known from, or None for any) -> why
ATEN_FAILURES = {("could not create a primitive descriptor", None): "oneDNN rejects this layout (gelu_backward)",
                 # no indices with scale_grad_by_freq: ATen's CUDA kernel launches a grid of zero blocks
                 # (the CPU answers zeros, as Gems does)
                 ("CUDA error: invalid argument", ("embedding_dense_backward",)): "a launch of zero blocks"}

CATEGORIES = sorted({i.category for i in registry.all_impls(BACKEND)})


def _impls(category):
    return [i for i in registry.all_impls(BACKEND) if i.category == category and (not ONLY or i.name in ONLY)]


# ----------------------------------------------------------------------------- running and comparing
def _run(op, case, gems_on):
    args, kwargs = clone_args(case.args), clone_args(case.kwargs)
    try:
        with warnings.catch_warnings():   # ATen's deprecation notes (resized out=, ...) are not results
            warnings.simplefilter("ignore")
            out = _call(op, case, args, kwargs, gems_on)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
    except Exception as e:   # noqa: BLE001
        return e, args, kwargs
    return out, args, kwargs


def _call(op, case, args, kwargs, gems_on):
    if gems_on:
        with gems.use_gems(include=[case.name]):
            return op(*args, **kwargs)
    return op(*args, **kwargs)


def _tensors(v, path="result"):
    if isinstance(v, torch.Tensor):
        yield path, v
    elif isinstance(v, (list, tuple)):
        for i, x in enumerate(v):
            yield from _tensors(x, f"{path}[{i}]")
    elif isinstance(v, dict):
        for k, x in v.items():
            yield from _tensors(x, f"{path}.{k}")


def _strides(t):
    """The strides that matter: those of dims longer than 1 (none for an empty tensor)."""
    if t.numel() == 0:
        return ()
    return tuple(s for s, n in zip(t.stride(), t.shape) if n > 1)


def _value_diff(g, a, case, args, kwargs, path="result"):
    """None when Gems' `g` (the output at `path`) agrees with ATen's `a` (same dtype and shape), else a
    description."""
    g, a = g.detach().cpu(), a.detach().cpu()
    if not a.is_floating_point() and not a.is_complex():
        return None if torch.equal(g, a) else f"{int((g != a).sum())}/{a.numel()} elements differ"
    g64, a64 = g.double(), a.double()
    nan_g, nan_a = torch.isnan(g64), torch.isnan(a64)
    if not torch.equal(nan_g, nan_a):
        return f"NaN pattern differs ({int(nan_g.sum())} vs {int(nan_a.sum())})"
    inf = torch.isinf(a64) | torch.isinf(g64)
    if not torch.equal(g64[inf], a64[inf]):
        # an accumulation (a GEMM, a sum) near the dtype's limit: ATen's order may overflow where Gems'
        # does not; accepted where Gems' finite value is the float64 reference's
        ref = _reference(case, path) if registry.get(case.name).category in ("blas", "reduction", "norm") else None
        if ref is None or ref.shape != a.shape or not _near(g64[inf], ref.double()[inf], a.dtype):
            return "infinities differ"
        g64, a64 = g64.masked_fill(inf, 0), a64.masked_fill(inf, 0)
    rtol, atol = TOL.get(a.dtype, TOL[torch.float32])
    fin = ~(nan_a | inf)
    err = (g64 - a64).abs()[fin]
    bad = err > atol + 2 * rtol * a64.abs()[fin]
    if not bad.any():
        return None
    # the suite's rule against a float64 reference: within the tolerance, or 2x ATen's own error
    ref = _reference(case, path)
    if ref is not None and ref.shape == a.shape:
        r = ref.double()[fin]
        bound = torch.clamp(atol + rtol * r.abs(), min=2 * (a64[fin] - r).abs().nan_to_num(0).max().item() + atol)
        if not ((g64[fin] - r).abs() > bound).any():
            return None
    j = int(bad.nonzero()[0])
    return f"{int(bad.sum())}/{a.numel()} off, worst {err.max().item():.3g}: Gems {g64[fin][j].item()}, ATen {a64[fin][j].item()}"


def _near(g, r, dtype):
    """Gems' values `g` are the float64 reference `r`'s: within the tolerance, or the reference rounded
    to the dtype (a float64 value past the dtype's range rounds to that infinity)."""
    rtol, atol = TOL.get(dtype, TOL[torch.float32])
    close = torch.isfinite(r) & ((g - r).abs() <= atol + 2 * rtol * r.abs())
    return bool((close | (g == r.to(dtype).double())).all())


def _result_index(case, path):
    """Which tensor of the call's result `path` names: result[i], the i-th out= argument, or the
    argument an in-place op writes and returns (0 for a single result); None for another input."""
    if path == "result":
        return 0
    if path == "args[0]":
        first = registry.aten_overload(case.name)._schema.arguments[0]
        return 0 if first.alias_info is not None and first.alias_info.is_write else None
    if path.startswith("result["):
        return int(path[len("result["):].split("]")[0])
    if path.startswith("kwargs."):
        outs = [a.name for a in registry.aten_overload(case.name)._schema.arguments
                if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write]
        name = path[len("kwargs."):]
        return outs.index(name) if name in outs else None
    return None


def _reference(case, path="result"):
    """ATen's result on the inputs in float64 (the tensor of the result that `path` names), or None."""
    i = _result_index(case, path)
    if i is None:
        return None

    def up(v):
        if isinstance(v, torch.Tensor):
            return v.detach().cpu().double() if v.is_floating_point() else v.detach().cpu()
        if isinstance(v, (list, tuple)):
            return type(v)(up(x) for x in v)
        return v
    kwargs = {k: up(v) for k, v in clone_args(case.kwargs).items()}
    if kwargs.get("dtype") is not None:
        return None
    try:
        out = registry.aten_overload(case.name)(*up(clone_args(case.args)), **kwargs)
    except Exception:   # noqa: BLE001
        return None
    if isinstance(out, torch.Tensor):
        return out if i == 0 else None
    return dict(_tensors(out)).get(f"result[{i}]")


def _message(e):
    return str(e).strip().splitlines()[0] if str(e).strip() else ""


def compare(case):
    """[(class, detail)] of the differences between ATen's and Gems' runs of `case`."""
    op = registry.aten_overload(case.name)
    a, a_args, a_kwargs = _run(op, case, False)
    g, g_args, g_kwargs = _run(op, case, True)
    a_err, g_err = isinstance(a, Exception), isinstance(g, Exception)
    if a_err and any(m in str(a) and (ops is None or case.name.split(".")[0] in ops) for m, ops in ATEN_FAILURES):
        return [("aten-bug", _message(a))]
    if a_err or g_err:
        if a_err != g_err:
            return [("exception", f"ATen: {_message(a) if a_err else 'answers'}; Gems: "
                                  f"{type(g).__name__ + ': ' + _message(g) if g_err else 'answers'}")]
        if type(a) is not type(g):
            return [("exception", f"ATen {type(a).__name__}, Gems {type(g).__name__}: {_message(g)}")]
        if _message(a) != _message(g):
            return [("message", f"ATen {_message(a)!r}, Gems {_message(g)!r}")]
        return []
    if case.name.split(".")[0] in ("sort", "topk") and isinstance(a, tuple):
        return _sort_diff(case, g, a)
    found = []
    ours = list(_tensors(g)) + list(_tensors(g_args, "args")) + list(_tensors(g_kwargs, "kwargs"))
    theirs = list(_tensors(a)) + list(_tensors(a_args, "args")) + list(_tensors(a_kwargs, "kwargs"))
    if [p for p, _ in ours] != [p for p, _ in theirs] or type(g) is not type(a):
        return [("shape", f"results differ in structure: {type(g).__name__} vs {type(a).__name__}")]
    if not isinstance(a, (torch.Tensor, list, tuple)) and a is not None and not (
            a == g or (isinstance(a, float) and math.isnan(a) and math.isnan(g))):
        return [("value", f"result {g!r} vs {a!r}")]
    for (path, gt), (_, at) in zip(ours, theirs):
        if gt.dtype != at.dtype:
            found.append(("dtype", f"{path}: {gt.dtype} vs {at.dtype}"))
        elif tuple(gt.shape) != tuple(at.shape):
            found.append(("shape", f"{path}: {tuple(gt.shape)} vs {tuple(at.shape)}"))
        else:
            d = _value_diff(*_documented_elements(case, path, gt, at), case, g_args, g_kwargs, path)
            if d:
                found.append(("value", f"{path}: {d}"))
            if _strides(gt) != _strides(at) and not path.startswith("args"):
                found.append(("stride", f"{path}: {tuple(gt.stride())} vs {tuple(at.stride())}"))
    return found


# ----------------------------------------------------------------------------- documented differences
# Rows of docs/known-differences.md that concern some elements of a result: the element set and what is
# accepted there. Where the row holds, ATen's value is replaced by Gems' before the comparison; every
# other element is compared as always.
FP32_MAX = torch.finfo(torch.float32).max


def _call_args(case):
    names = [x.name for x in registry.aten_overload(case.name)._schema.arguments]
    return dict(zip(names, case.args), **case.kwargs)


def _overflowing_terms(a, b, alpha=1.0):
    """Per element of alpha * (a @ b) (batched or not): whether some fp32 sum of its terms may overflow
    in some order: a term is infinite or NaN, the terms' magnitudes add up past fp32's range, or alpha
    times a factor does (in float64; ATen's CPU BLAS may scale either operand by alpha first)."""
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    t = (a.unsqueeze(-1) * b.unsqueeze(-3)).abs()     # [..., M, K, N]
    scaled = (((a.abs() * abs(alpha)).amax(-1, keepdim=True) > FP32_MAX)
              | ((b.abs() * abs(alpha)).amax(-2, keepdim=True) > FP32_MAX)) if a.shape[-1] else False
    # the sum before alpha too: cuBLAS (and Gems) scale the fp32 sum, which may overflow for alpha < 1
    return t.isnan().any(-2) | ~((t * abs(alpha)).sum(-2) <= FP32_MAX) | ~(t.sum(-2) <= FP32_MAX) | scaled


def _gemm_flags(case, shape):
    """mm, addmm, bmm (docs/known-differences.md, the GEMM row): the elements whose sums of products may
    overflow fp32 or meet an infinity; addmm with a non-finite alpha: every element."""
    c = _call_args(case)
    a, b = (c["self"], c["mat2"]) if "mat1" not in c else (c["mat1"], c["mat2"])
    alpha = c.get("alpha", 1)
    if not isinstance(alpha, (int, float)):
        return None
    flags = _overflowing_terms(a, b, alpha if math.isfinite(alpha) else 1.0)
    if not math.isfinite(alpha):
        flags = torch.ones_like(flags)
    return flags if tuple(flags.shape) == tuple(shape) else None


def _softmax_bwd_flags(case, shape):
    """_softmax_backward_data (its row): the slices along dim whose sum(grad * output) may overflow fp32
    in some order, or meets a non-finite term."""
    c = _call_args(case)
    g, y = c["grad_output"].detach().cpu().double(), c["output"].detach().cpu().double()
    if g.dim() == 0 or g.shape != y.shape:
        return None
    t = (g * y).abs()
    d = c["dim"]
    flags = (t.isnan().any(d, keepdim=True) | ~(t.sum(d, keepdim=True) <= FP32_MAX)).expand(g.shape)
    return flags if tuple(flags.shape) == tuple(shape) else None


def _softmax_bwd_all(case, shape):
    """_softmax_backward_data: every element (_softmax_bwd_accepts decides)."""
    flags = _softmax_bwd_flags(case, shape)
    return None if flags is None else torch.ones_like(flags)


def _softmax_bwd_accepts(case, path, g, a, flags):
    """y * (grad - sum(grad * y)): either non-finite where that sum may overflow (the row above), else
    within |y| * n * 2^-23 * sum(|grad * y|) of ATen's, the order of summation's bound."""
    c = _call_args(case)
    gr, y, d = c["grad_output"].detach().cpu().double(), c["output"].detach().cpu().double(), c["dim"]
    over = _softmax_bwd_flags(case, g.shape)
    bound = y.abs() * gr.shape[d] * 2.0 ** -23 * (gr * y).abs().sum(d, keepdim=True)
    return flags & ((over & ~(torch.isfinite(g) & torch.isfinite(a))) | ((g - a).abs() <= bound))


def _log_softmax_bwd_flags(case, shape):
    """_log_softmax_backward_data (its row): every element, with its bound on the sum's rounding."""
    c = _call_args(case)
    g = c["grad_output"]
    return None if g.dim() == 0 or tuple(g.shape) != tuple(shape) else torch.ones(tuple(shape), dtype=torch.bool)


def _log_softmax_bwd_accepts(case, path, g, a, flags):
    """grad - exp(output) * sum(grad): where the sum cancels, its order decides its rounding, which
    exp(output) scales: accepted within exp(output) * n * eps * sum(|grad|) of ATen's value (fp32
    sums; both are that close to the float64 answer)."""
    c = _call_args(case)
    gr, y, d = c["grad_output"].detach().cpu().double(), c["output"].detach().cpu().double(), c["dim"]
    n = gr.shape[d] if gr.dim() else 1
    bound = y.exp() * gr.abs().sum(d, keepdim=True) * n * 2.0 ** -23
    return flags & ((g - a).abs() <= bound)


def _sum_flags(case, shape):
    """sum and mean (their row): every element of an fp32 result, with its bound on the order of summation
    (a mean's error is its sum's divided by the count: within the sum's bound too)."""
    x = _call_args(case).get("self")
    ok = isinstance(x, torch.Tensor) and x.dtype == torch.float32 and x.numel() > 1
    return torch.ones(tuple(shape), dtype=torch.bool) if ok else None


def _sum_accepts(case, path, g, a, flags):
    """An fp32 sum of n terms lies within (n - 1) * 2^-24 * sum(|x|) of the exact sum in any order: accepted
    within n * 2^-23 * sum(|x|) of ATen's (sum(|x|) over the whole input bounds every output's terms).
    Where the finite terms' sum(|x|) reaches fp32's range, a partial sum can overflow in some orders and
    not in others (and meet an infinity of the other sign: NaN): there either side may be non-finite."""
    x = _call_args(case)["self"].detach().cpu().double()
    finite = x[torch.isfinite(x)]
    overflows = bool(finite.abs().sum() >= torch.finfo(torch.float32).max)
    return flags & (((g - a).abs() <= x.numel() * 2.0 ** -23 * x.abs().sum())
                    | (overflows & ~(torch.isfinite(g) & torch.isfinite(a))))


def _cumsum_flags(case, shape):
    """cumsum (its row): every element of an fp32 result, with its bound on the order of summation."""
    c = _call_args(case)
    x = c.get("self")
    if not isinstance(x, torch.Tensor) or x.numel() < 2:
        return None
    result = c.get("dtype") or x.dtype
    return torch.ones(tuple(shape), dtype=torch.bool) if result == torch.float32 else None


def _cumsum_accepts(case, path, g, a, flags):
    """Each output is the fp32 sum of a prefix of its slice along dim, within (n - 1) * 2^-24 * sum(|x|) of
    the exact sum in any order: accepted within n * 2^-23 * sum(|x|) over the slice of ATen's value (ATen's
    CPU kernel accumulates fp32 in double, its CUDA scan and Gems' in fp32). Where a slice's finite terms'
    sum(|x|) reaches fp32's range, a partial sum can overflow in some orders and not in others."""
    c = _call_args(case)
    x = c["self"].detach().cpu().double()
    if x.dim() == 0:
        return None
    dim = c["dim"] % x.dim()
    mag = x.nan_to_num(0.0, 0.0, 0.0).abs().sum(dim, keepdim=True)
    n = x.shape[dim]
    overflows = mag >= torch.finfo(torch.float32).max
    return flags & (((g - a).abs() <= n * 2.0 ** -23 * mag)
                    | (overflows & ~(torch.isfinite(g) & torch.isfinite(a))))


def _gelu_tanh_band(case, shape):
    """gelu_backward, tanh (its row): a non-finite grad where 1 + tanh(inner) is near 2^-25, the last
    value ATen's fp32 tanh rounds to -1 (its derivative 0: NaN), which its own tanh's rounding decides."""
    c = _call_args(case)
    if c.get("approximate") != "tanh":
        return None
    gr, x = c["grad_output"].detach().cpu().double(), c["self"].detach().cpu().double()
    inner = 0.7978845608028654 * (x + 0.044715 * x ** 3)
    flags = ~torch.isfinite(gr) & (inner.abs() > 8.5) & (inner.abs() < 9.5)
    flags = torch.broadcast_to(flags, torch.broadcast_shapes(flags.shape, tuple(shape)))
    return flags if tuple(flags.shape) == tuple(shape) else None


def _gelu_bwd_cpu_mixed(case):
    """gelu_backward on the CPU with one 16-bit and one fp32 operand (an fp32 result): ATen's CPU kernel
    computes in the 16-bit type (its fp32 result holds 16-bit roundings; a gradient past fp16's range
    becomes inf, and inf times an underflowed derivative NaN), CUDA and Gems in fp32."""
    c = _call_args(case)
    gr, x = c.get("grad_output"), c.get("self")
    half = (torch.float16, torch.bfloat16)
    return (DEVICE == "cpu" and isinstance(gr, torch.Tensor) and isinstance(x, torch.Tensor)
            and gr.dtype != x.dtype and (gr.dtype in half or x.dtype in half))


def _gelu_bwd_flags(case, shape):
    """gelu_backward's rows, by element: the tanh band (_gelu_tanh_band); mixed 16-bit / fp32 operands on
    the CPU (every element); and where the derivative is below fp32's resolution of 1 (Gems keeps it,
    _gelu_bwd_accepts): the tanh form with 1 + tanh(inner) < 2^-25 and a finite grad, the exact form
    with 1 + erf(x / sqrt(2)) < 2^-25 and an infinite grad."""
    c = _call_args(case)
    gr, x = c.get("grad_output"), c.get("self")
    if not (isinstance(gr, torch.Tensor) and isinstance(x, torch.Tensor)):
        return None
    gr, x = torch.broadcast_tensors(gr.detach().cpu().double(), x.detach().cpu().double())
    if c.get("approximate") == "tanh":
        tail = (0.7978845608028654 * (x + 0.044715 * x ** 3) < -9.01) & torch.isfinite(gr)
    else:
        tail = (x < -5.45) & torch.isinf(gr)
    flags = tail
    band = _gelu_tanh_band(case, shape)
    if band is not None:
        flags = flags | band
    if _gelu_bwd_cpu_mixed(case):
        flags = torch.ones_like(flags)
    return flags if tuple(flags.shape) == tuple(shape) else None


def _gelu_bwd_accurate(case):
    """grad_output * gelu'(self) in float64, 1 + tanh and 1 - tanh formed without cancellation."""
    c = _call_args(case)
    gr, x = c["grad_output"].detach().cpu().double(), c["self"].detach().cpu().double()
    if c.get("approximate") == "tanh":
        k, z = 0.7978845608028654, 0.7978845608028654 * (x + 0.044715 * x ** 3)
        p, m = 2 / (1 + torch.exp(-2 * z)), 2 / (1 + torch.exp(2 * z))      # 1 + tanh(z), 1 - tanh(z)
        d = 0.5 * p + 0.5 * x * (p * m) * k * (1 + 3 * 0.044715 * x * x)
    else:
        d = 0.5 * torch.erfc(-x / math.sqrt(2)) + x * torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    return gr * d


def _gelu_bwd_accepts(case, path, g, a, flags):
    """The tanh band: either side non-finite. A derivative below fp32's resolution of 1 (ATen's 1 + tanh
    or 1 + erf rounds it to 0: 0 for a finite grad, NaN for an infinite one): Gems' value where it is the
    accurate one (within 1e-4, or the same infinity). Mixed operands on the CPU: Gems' value where the
    harness's fp32 rule accepts it against that accurate value, with ATen's own fp32 computation of the
    operands as ATen's error."""
    if path != "result":
        return None
    band = _gelu_tanh_band(case, g.shape)
    ok = torch.zeros(g.shape, dtype=torch.bool) if band is None else _either_non_finite(case, path, g, a, band)
    exact = _gelu_bwd_accurate(case)
    ok = ok | (flags & ((g == exact) | ((g - exact).abs() <= 1e-4 * exact.abs())))
    if _gelu_bwd_cpu_mixed(case):
        c = _call_args(case)
        gr, x = torch.broadcast_tensors(c["grad_output"].float(), c["self"].float())
        try:    # (contiguous: oneDNN, behind ATen's CPU kernel, rejects some layouts)
            a32 = torch.ops.aten.gelu_backward(gr.contiguous(), x.contiguous(),
                                               approximate=c.get("approximate", "none")).cpu().double()
        except RuntimeError:
            return ok
        rtol, atol = TOL[torch.float32]
        # the harness's rule against float64: within tolerance, or within twice ATen's own fp32 error
        err = (g - exact).abs()
        ok = ok | (err <= atol + rtol * exact.abs()) | (err <= 2 * (a32 - exact).abs() + atol)
        ok = ok | (torch.isnan(g) & torch.isnan(a32))
    return ok


def _either_non_finite(case, path, g, a, flags):
    """At flagged elements: accepted where Gems' or ATen's value is not finite (the order of an IEEE sum
    decides which of NaN, +-inf or a finite value it ends at)."""
    return flags & ~(torch.isfinite(g) & torch.isfinite(a))


def _exact_mean(values):
    """The correctly rounded mean of finite values (NaN where one is not finite or the sum overflows)."""
    try:
        return math.fsum(values) / len(values)
    except (OverflowError, ValueError):
        return float("nan")


def _layer_norm_accepts(case, path, g, a, _flags):
    """native_layer_norm (its rows): in a row holding an infinity, a NaN or |x| >= 2^63, ATen's Welford
    lanes may overflow: there Gems' value must be the float64 reference's (mean: +-inf or NaN where the
    row holds infinities; the reference's Welford answers NaN), ATen's may be anything. In y of a
    constant row times an infinite weight: Gems' NaN (0 * inf) where ATen's is not finite."""
    c = _call_args(case)
    x, ns = c["input"].detach().cpu().double(), [int(n) for n in c["normalized_shape"]]
    N = math.prod(ns)
    out = path[-2] if path.startswith("result[") else path[-1] if path.startswith("kwargs.out") else None
    if N == 0 or x.numel() == 0 or out is None:   # (None: the input tensors after the call)
        return None
    rows = x.reshape(-1, N)
    gr, ar = g.reshape(len(rows), -1), a.reshape(len(rows), -1)
    ok = torch.zeros(gr.shape, dtype=torch.bool)
    w = c.get("weight")
    if out == "0" and w is not None and not torch.isfinite(w).all():
        const = (rows == rows[:, :1]).all(1, keepdim=True) & torch.isfinite(rows).all(1, keepdim=True)
        inf_w = ~torch.isfinite(w.detach().cpu().double().reshape(1, N))
        ok |= const & inf_w & gr.isnan() & ~torch.isfinite(ar)
    if out == "1":   # the mean: within the order of summation's bound of ATen's (Welford's lanes)
        ok |= (gr - ar).abs() <= N * 2.0 ** -23 * rows.abs().mean(1, keepdim=True)
    up = (lambda t: None if t is None else t.detach().cpu().double())
    ref = torch.ops.aten.native_layer_norm(x, ns, up(w), up(c.get("bias")), c["eps"])[int(out)]
    rr = ref.reshape(len(rows), -1)
    # the float64 answer rounded to the dtype (an infinity past its range: a weight near fp32's largest
    # value times a normalized x, where ATen's CPU grouping x * (rstd w) + (b - mean rstd w) meets inf - inf)
    ok |= gr == rr.to(c["input"].dtype).double()
    odd = (~torch.isfinite(rows) | (rows.abs() >= 2.0 ** 63)).any(1)
    if odd.any():
        rtol, atol = TOL.get(c["input"].dtype, TOL[torch.float32])
        near = ((gr - rr).abs() <= atol + 2 * rtol * rr.abs()) | (gr.isnan() & rr.isnan()) | (gr == rr)
        if out == "1":   # the mean of a row holding infinities: that infinity (NaN for both signs)
            near |= ~torch.isfinite(gr) & (~torch.isfinite(rows)).any(1, keepdim=True)
            # a finite row's exact mean (ATen's float64 Welford rounds at the scale of its largest value)
            exact = torch.tensor([_exact_mean(r) for r in rows.tolist()], dtype=torch.float64)[:, None]
            near |= torch.isfinite(exact) & ((gr - exact).abs() <= atol + 2 * rtol * exact.abs())
            # ... or within any fp32 order of summation's bound of it, as ATen's mean above (ATen's is NaN
            # where its Welford lanes overflow; huge values that cancel leave the small ones to the order)
            near |= torch.isfinite(exact) & ((gr - exact).abs() <= N * 2.0 ** -23 * rows.abs().mean(1, keepdim=True))
        ok |= odd[:, None] & near
    return ok.reshape(g.shape)


def _logit_flags(case, shape):
    """logit (its rows): fp16 elements at or past a clamp bound, which ATen's CPU Half kernel rounds to
    fp16; every element for eps > 0.5, whose bounds cross (ATen's CPU vector and scalar paths differ)."""
    c = _call_args(case)
    x, eps = c["self"], c.get("eps")
    if eps is not None and eps > 0.5 and tuple(x.shape) == tuple(shape):
        return torch.ones(tuple(shape), dtype=torch.bool)
    if eps is None or not 0 < eps < 0.5 or x.dtype != torch.float16 or tuple(x.shape) != tuple(shape):
        return None
    x = x.detach().cpu().double()
    return (x > 1 - eps - 0.00025) | (x < eps + 6e-8)


def _logit_accepts(case, path, g, a, flags):
    """At flagged elements: Gems' value finite, positive on the upper bound's side, negative on the lower's;
    for eps > 0.5 an infinity where ATen's is one (which one depends on ATen's path)."""
    c = _call_args(case)
    if c.get("eps") is not None and c["eps"] > 0.5:
        return flags & torch.isinf(g) & torch.isinf(a)
    x = c["self"].detach().cpu().double()
    return flags & torch.isfinite(g) & ((g > 0) == (x > 0.5))


def _every_element(case, shape):
    return torch.ones(tuple(shape), dtype=torch.bool)


def _layer_norm_bwd_accepts(case, path, g, a, flags):
    """native_layer_norm_backward (its row): the formula's terms cancel (or, with non-finite and huge
    inputs, overflow), and how they are grouped decides the rounding and which non-finite value results
    (ATen's CPU kernel folds x into per-row coefficients, b * x + c, which cancels catastrophically for
    huge x). Accepted where Gems' and ATen's values are both non-finite, or Gems' is within the order of
    arithmetic's bound of the float64 answer of the grouped formula dx = rstd (gw - mean(gw) - xhat
    mean(gw xhat)), dw = sum(g xhat), db = sum(g) (gw = g * w, xhat = (x - mean) rstd): (n + 4) 2^-23
    times the sum of its terms' magnitudes."""
    c = _call_args(case)
    out = _result_index(case, path)
    ns = [int(n) for n in c["normalized_shape"]]
    N = math.prod(ns)
    x = c["input"].detach().cpu().double()
    if out is None or N == 0 or x.numel() == 0:
        return None
    up = (lambda t: t.detach().cpu().double())
    x, go = x.reshape(-1, N), up(c["grad_out"]).reshape(-1, N)
    mean, rstd = up(c["mean"]).reshape(-1, 1), up(c["rstd"]).reshape(-1, 1)
    w = up(c["weight"]).reshape(1, N) if c.get("weight") is not None else torch.ones(1, N, dtype=torch.float64)
    M = x.shape[0]
    gw, xhat = go * w, (x - mean) * rstd
    if out == 0:
        ref = rstd * (gw - gw.mean(1, keepdim=True) - xhat * (gw * xhat).mean(1, keepdim=True))
        mag = rstd.abs() * (gw.abs() + gw.abs().mean(1, keepdim=True) + xhat.abs() * (gw * xhat).abs().mean(1, keepdim=True))
        n = N
    else:
        t = go * xhat if out == 1 else go
        ref, mag, n = t.sum(0, keepdim=True), t.abs().sum(0, keepdim=True), M
    ref, mag = ref.reshape(g.shape), mag.reshape(g.shape)
    rtol, atol = TOL.get(c["input"].dtype, TOL[torch.float32])
    near = (g - ref).abs() <= atol + 2 * rtol * ref.abs() + (n + 4) * 2.0 ** -23 * mag
    # terms whose magnitudes sum past fp32's largest value: a partial sum overflows in some orders and not
    # in others (as sum and mean), so an infinity there is the order's, not an error
    over = ~torch.isfinite(g) & (mag >= torch.finfo(torch.float32).max)
    return flags & ((~torch.isfinite(g) & ~torch.isfinite(a)) | (torch.isfinite(ref) & near) | over)


def _cpu_half_alpha_flags(case, shape):
    """add / sub and their foreach forms, fp16 on the CPU with an alpha other than 1 (their row of the
    interpreter's vector-path rule): every element."""
    c = _call_args(case)
    alpha, x = c.get("alpha", 1), c.get("self")
    x0 = x[0] if isinstance(x, (list, tuple)) and x else x
    if DEVICE == "cuda" or not isinstance(alpha, (int, float)) or alpha == 1 or \
            not isinstance(x0, torch.Tensor) or x0.dtype != torch.float16:
        return None
    return torch.ones(tuple(shape), dtype=torch.bool)


def _cpu_half_alpha_accepts(case, path, g, a, flags):
    """ATen's CPU scalar tail computes self + alpha * other in fp16 arithmetic (alpha * other rounded to
    fp16 first), its vector path and CUDA in fp32: accepted where ATen's value is the tail's and Gems' is
    within one fp16 rounding of the exact value."""
    c = _call_args(case)
    x, y, alpha = c["self"], c["other"], c["alpha"]
    if isinstance(x, (list, tuple)):
        if not path.startswith(("result[", "args[0][")):
            return None
        i = int(path.rsplit("[", 1)[1].rstrip("]"))
        x, y = x[i], (y[i] if isinstance(y, (list, tuple)) else y)
    elif path not in ("result", "args[0]") and not path.startswith("kwargs."):
        return None
    if not isinstance(y, torch.Tensor):
        y = torch.tensor(y, dtype=torch.float16)
    if x.dtype != torch.float16 or y.dtype != torch.float16:
        return None
    sign = -1.0 if case.name.startswith(("sub", "_foreach_sub")) else 1.0
    x64, y64 = torch.broadcast_tensors(x.detach().cpu().double(), y.detach().cpu().double())
    if tuple(x64.shape) != tuple(g.shape):
        return None
    prod = (alpha * y64).half().float()
    tail = (x64.float() + sign * prod).half().double()
    exact = x64 + sign * alpha * y64
    return flags & (a == tail) & ((g - exact).abs() <= exact.abs() * 2.0 ** -10 + 2.0 ** -24)


def _nll_flags(case, shape):
    """nll_loss_forward, sum and mean (their row of the sum rule): the fp32 loss and total weight."""
    c = _call_args(case)
    x = c["self"]
    ok = int(c["reduction"]) != 0 and x.dtype == torch.float32 and x.dim() == 2 and x.shape[0] > 1
    return torch.ones(tuple(shape), dtype=torch.bool) if ok else None


def _nll_accepts(case, path, g, a, flags):
    """The loss is an fp32 sum of -w[t] * x[i, t] (divided by the summed weights for the mean): within the
    order of summation's bound of ATen's value, as for sum; and as for sum, where the finite terms of the
    loss or of the total weight reach fp32's range in magnitude, either side may be non-finite."""
    c = _call_args(case)
    out = _result_index(case, path)
    x, t = c["self"].detach().cpu().double(), c["target"].detach().cpu()
    keep = t != int(c["ignore_index"])
    if out is None or not bool((t[keep] < x.shape[1]).all() and (t[keep] >= 0).all()):
        return None
    w = c["weight"].detach().cpu().double() if c.get("weight") is not None else torch.ones(x.shape[1], dtype=torch.float64)
    wt = w[t[keep]]
    terms = wt * x[keep.nonzero().flatten(), t[keep]]
    n = max(int(keep.sum()), 1)
    if out == 1:
        bound = n * 2.0 ** -23 * wt.abs().sum()
    elif int(c["reduction"]) == 2:
        bound = n * 2.0 ** -23 * terms.abs().sum()
    else:
        W = wt.sum().abs()
        bound = n * 2.0 ** -23 * (terms.abs().sum() + a.abs().max() * wt.abs().sum()) / W if W > 0 else float("inf")
    big = torch.finfo(torch.float32).max
    overflows = any(bool(v[torch.isfinite(v)].abs().sum() >= big) for v in ((wt,) if out == 1 else (wt, terms)))
    return flags & (((g - a).abs() <= bound) | (overflows & ~(torch.isfinite(g) & torch.isfinite(a))))


DOCUMENTED = {"mm": (_gemm_flags, _either_non_finite), "addmm": (_gemm_flags, _either_non_finite),
              "bmm": (_gemm_flags, _either_non_finite),
              "_softmax_backward_data": (_softmax_bwd_all, _softmax_bwd_accepts),
              "_log_softmax_backward_data": (_log_softmax_bwd_flags, _log_softmax_bwd_accepts),
              "sum": (_sum_flags, _sum_accepts), "mean": (_sum_flags, _sum_accepts),
              "cumsum": (_cumsum_flags, _cumsum_accepts),
              "nll_loss_forward": (_nll_flags, _nll_accepts),
              **{op: (_cpu_half_alpha_flags, _cpu_half_alpha_accepts)
                 for op in ("add", "sub", "_foreach_add", "_foreach_sub")},
              "native_layer_norm": (lambda case, shape: True, _layer_norm_accepts),
              "native_layer_norm_backward": (_every_element, _layer_norm_bwd_accepts),
              "logit": (_logit_flags, _logit_accepts),
              "gelu_backward": (_gelu_bwd_flags, _gelu_bwd_accepts)}


def _documented_elements(case, path, g, a):
    """(g, a) with ATen's value replaced by Gems' where a documented row accepts Gems' (DOCUMENTED)."""
    base = case.name.split(".")[0].rstrip("_")
    if base not in DOCUMENTED or not g.is_floating_point() or g.shape != a.shape:
        return g, a
    flags_of, accepts = DOCUMENTED[base]
    flags = flags_of(case, g.shape)
    if flags is None:
        return g, a
    ok = accepts(case, path, g.detach().cpu().double(), a.detach().cpu().double(), flags)
    if ok is None or not ok.any():
        return g, a
    return g, torch.where(ok.to(a.device), g, a)


def _sort_diff(case, g, a):
    """sort and topk: ties may be ordered either way (and topk(sorted=False) returns its k values in any
    order): the values must agree (as sorted sets where unordered), and Gems' indices must point at them."""
    names = [x.name for x in registry.aten_overload(case.name)._schema.arguments]
    call = dict(zip(names, case.args), **case.kwargs)
    x, dim = call["self"], call.get("dim", -1)
    if DEVICE == "cuda" and x.dim() == 0 and call.get("k") == 0:
        return []   # topk(k=0) of a 0-dim tensor: ATen's CUDA kernel returns before writing its 0-dim results
    (gv, gi), (av, ai) = g, a
    for path, gt, at in (("values", gv, av), ("indices", gi, ai)):
        if gt.dtype != at.dtype or gt.shape != at.shape:
            return [("dtype" if gt.dtype != at.dtype else "shape", f"{path}: {gt.dtype}{tuple(gt.shape)} vs "
                                                                       f"{at.dtype}{tuple(at.shape)}")]
    if av.dim() and call.get("sorted", True) is False:
        gv, av = gv.sort(dim).values, av.sort(dim).values
    d = _value_diff(gv, av, case, None, None)
    if d:
        return [("value", f"values: {d}")]
    picked = x.gather(dim, gi) if x.dim() else x.expand_as(gi) if (gi == 0).all() else None
    if picked is None or _value_diff(picked, g[0], case, None, None) is not None:
        return [("value", "indices: do not point at the values")]
    return []


def _allowed(case, cls):
    """'known difference', 'known bug' or None, and the allow-list's key."""
    base = case.name.split(".")[0]
    if base.endswith("_") and not base.endswith("__"):   # the in-place overload: its op's entries
        base = base[:-1]
    if cls == "aten-bug":
        return "ATen's failure", None
    special, _ = KNOWN_DIFFERENCES.get((base, cls), (None, ""))
    if special is not None and (not special or case.special):
        return "known difference", (base, cls)
    resized_out = any(isinstance(v, torch.Tensor) and v.numel() == 0 for v in case.kwargs.values())
    for key in ((case.name, cls), (base, cls), ("." + case.name.split(".")[1], cls)) + (
            (("out=", cls),) if resized_out else ()):
        if key in KNOWN_BUGS:
            return "known bug", key
    return None, None


# ----------------------------------------------------------------------------- the test
def _budget(category):
    # by the number of overloads, plus an even share so that the small families get more than one round
    weight = {c: len(_impls(c)) + 25 * bool(_impls(c)) for c in CATEGORIES}
    return SECONDS * weight[category] / sum(weight.values())


@pytest.mark.parametrize("shard", range(SHARDS))
@pytest.mark.parametrize("category", CATEGORIES)
def test_fuzz_against_aten(category, shard, capsys):
    impls = _impls(category)[shard::SHARDS]
    if not impls:
        pytest.skip("no overload of this category selected")
    deadline = time.monotonic() + _budget(category) / SHARDS if SECONDS else None
    rounds = ROUNDS.get(category, 20)

    def more(index):
        return index == 0 or (time.monotonic() < deadline if deadline is not None else index < rounds)
    skipped, rows, reached, cases, bugs = {}, [], set(), 0, set()
    live = []
    for impl in impls:
        why = skip_reason(impl.name)
        (skipped.__setitem__(impl.name, why) if why else live.append(impl))
    index = int(CASE) if CASE is not None else 0
    while live and more(index):
        for impl in list(live):
            if not more(index):
                break
            try:
                case = make_case(impl.name, SEED, index, DEVICE)
            except Skip as e:
                skipped[impl.name] = str(e)
                live.remove(impl)
                continue
            if VERBOSE:   # the case about to run, flushed: names the case that ends the process
                print(f"{SEED}:{index} {case.describe()}", file=sys.__stderr__, flush=True)
            served = gems.dispatch.op_runtime(impl.name).served
            for cls, detail in compare(case):
                allowed, key = _allowed(case, cls)
                rows.append((impl.name, f"{SEED}:{index}", cls, allowed, detail, case.describe()))
                if allowed == "known bug":
                    bugs.add(key)
            if gems.dispatch.op_runtime(impl.name).served > served:
                reached.add(impl.name)
            cases += 1
        if CASE is not None:
            break
        index += 1
    failing = [r for r in rows if r[3] is None]
    with capsys.disabled():
        tag = f"{category} {shard + 1}/{SHARDS}" if SHARDS > 1 else category
        print(f"\n[fuzz {tag}] {cases} cases, {len(reached)}/{len(impls)} overloads served by Gems, "
              f"{len(skipped)} skipped, {len(rows)} mismatches ({len(failing)} not allow-listed)")
        if skipped:
            print("  skipped: " + ", ".join(f"{n} ({w})" for n, w in sorted(skipped.items())))
        for name, where, cls, allowed, detail, call in rows:
            print(f"  {name:32} {where:>8} {cls:9} {allowed or 'FAIL':17} {detail[:160]}\n{'':44}{call[:200]}")
        for key in sorted(bugs):
            print(f"  KNOWN BUG {key[0]} ({key[1]}): {KNOWN_BUGS[key]}")
    if bugs:   # a warning reaches the summary under xdist too, where a worker's prints do not
        warnings.warn(f"fuzz {category}: known bugs met: " + "; ".join(
            f"{k[0]} ({k[1]}): {KNOWN_BUGS[k]}" for k in sorted(bugs)), UserWarning)
    assert not failing, f"{len(failing)} differences from ATen:\n" + "\n".join(
        f"{n} case {w} {c}: {d[:200]}\n    {call[:300]}" for n, w, c, _, d, call in failing)


def test_fuzz_finds_a_wrong_implementation():
    """The comparison itself: a Gems implementation that answers off by one, or raises where ATen
    answers, is reported (value, then exception); the right one is not."""
    impl = registry.get("neg.default")
    right = impl.fn
    case = Case("neg.default", 0, 0, [torch.randn(5, 7, device=DEVICE).t()], {})
    assert compare(case) == []
    try:
        impl.set_fn(lambda x: right(x) + 1)
        assert [c for c, _ in compare(case)] == ["value"]

        def raising(x):
            raise ValueError("boom")
        impl.set_fn(raising)
        assert [c for c, _ in compare(case)] == ["exception"]
    finally:
        impl.set_fn(right)
    assert compare(case) == []
