"""_foreach_* ops (gems/ops/foreach/) against ATen in float64: every registered overload on lists of
mixed shapes (0-dim, empty, more chunks than one, odd sizes), in place and functional; one launch per
call; the optimizers' steps (AdamW / Adam / SGD with foreach=True, capturable too) against the same
step in float64; special values; what goes to ATen (non-contiguous, mixed dtypes, different shapes,
overlapping in-place operands, numbers out of range), and ATen's errors."""
import importlib
import re
from array import array

import pytest
import torch

import gems
from gems import registry
from harness import (DEVICE, ON_GPU, assert_close, count_launches, dtype_params, make, optimizer_steps, served, to_ref,
                     while_compiling)
from gems.ops.foreach import launch as foreach
from gems.runtime.abi import FOREACH_MAX_TABLES

A = torch.ops.aten
# 0-dim, empty, odd sizes, and (the interpreter's chunks are 32 elements) one to three chunks with a
# partial block
SHAPES = [(3, 5), (37,), (), (0,), (2, 3, 4), (65,)]
NAMES = sorted(i.name for i in registry.all_impls() if i.name.startswith("_foreach_"))


@pytest.fixture(autouse=True)
def _small_chunks(request, monkeypatch):
    # the interpreter's programs cover 4096 elements: the tests cut the small tensors above into chunks
    # of 32 (blocks of 16) instead, so that they meet every edge (test_large_tensors keeps the real ones)
    if "large_tensors" not in request.node.name:
        monkeypatch.setitem(foreach.CONFIGS, "interpreter", dict(BLOCK=16, CHUNK=32, num_warps=1))


def _op(name):
    base, ov = name.split(".")
    return getattr(getattr(A, base), ov)


def _base(name):
    return name.split(".")[0][len("_foreach_"):].rstrip("_")


def _list(dtype, low=-3.0, high=3.0, shapes=SHAPES):
    return [make(s, dtype, low=low, high=high) for s in shapes]


def _args(name, dtype, n=len(SHAPES)):
    """(args, kwargs) for one call: lists whose values keep every op finite in fp16 (positive bases
    for pow and sqrt, divisors away from zero), numbers of each kind the schema asks for."""
    base = _base(name)
    shapes = SHAPES[:n]
    args, kwargs, lists = [], {}, 0
    for a in _op(name)._schema.arguments:
        ty = str(a.type)
        if ty == "List[Tensor]":
            if base in ("sqrt", "pow") and a.name == "self":
                v = _list(dtype, 0.5, 3.0, shapes)
            elif a.name == "exponent":
                v = _list(dtype, -2.0, 2.0, shapes)
            elif (base in ("div",) and lists == 1) or (base == "addcdiv" and lists == 2) or base == "reciprocal":
                v = _list(dtype, 0.5, 3.0, shapes)
            else:
                v = _list(dtype, shapes=shapes)
            lists += 1
        elif ty == "List[number]":
            v = ([2, 0.5, -1, 1.5, 3, -2] if base == "pow" else [1.5, -2, 0.25, 3, -0.5, 2.5])[:n]
        elif ty == "number":
            v = {"scalar": 1.7, "exponent": 1.5, "weight": 0.3, "value": 0.7, "self": 0.9, "alpha": 0.5,
                 "ord": 2}[a.name]
        elif ty == "Tensor" and a.name == "other":
            v = make((), dtype, low=0.5, high=3.0)
        elif ty == "Tensor" and a.name == "scalars":
            v = make((n,), torch.float32).cpu()   # ATen takes the packed scalars on the CPU only
        elif ty == "Optional[int]" and a.name == "dtype":
            continue   # _foreach_norm's dtype: the default (the tensors' dtype)
        else:
            raise AssertionError(f"{name}: argument {a.name} of type {ty}")
        (kwargs.__setitem__(a.name, v) if a.kwarg_only else args.append(v))
    return args, kwargs


def _clone(x, memo):
    """A copy of an argument; a tensor or list met twice is copied once (aliasing is kept)."""
    if isinstance(x, (torch.Tensor, list)):
        if id(x) not in memo:
            memo[id(x)] = x.clone() if isinstance(x, torch.Tensor) else [_clone(v, memo) for v in x]
        return memo[id(x)]
    return x


def _copies(args, kwargs):
    memo = {}
    return [_clone(a, memo) for a in args], {k: _clone(v, memo) for k, v in kwargs.items()}


def _call(name, args, kwargs):
    """The op's result: its returned list, or (in place) the written list 0, after checking that the
    in-place variant returned None and wrote into the very tensors it was given."""
    op = _op(name)
    if name.split(".")[0].endswith("_"):
        ptrs = [t.data_ptr() for t in args[0]]
        assert op(*args, **kwargs) is None
        assert [t.data_ptr() for t in args[0]] == ptrs
        return args[0]
    return list(op(*args, **kwargs))


def check(name, args, kwargs, dtype, fresh=None):
    """Gems (asserting it served the call) vs float64 ATen, within the harness's tolerance or 2x
    ATen's own error at this dtype. `fresh()` gives the (args, kwargs) of each run (default: copies
    of `args`, aliasing kept); the reference takes float64 copies of `args`."""
    fresh = fresh or (lambda: _copies(args, kwargs))
    with served(name), gems.use_gems():
        got = _call(name, *fresh())
    ref = _call(name, to_ref(args), to_ref(kwargs))
    aten = _call(name, *fresh())
    assert all(g.dtype == dtype for g in got)
    assert_close(got, ref, dtype, aten, msg=name)
    return got, ref


def check_fallback(name, fresh, reason, racy=False):
    """A call Gems leaves to ATen: not served, counted under `reason`, and ATen's answer exactly, or
    ATen's error where ATen raises (its CUDA kernels reject a number out of float's range that its CPU
    loop computes with). `racy`: ATen's CUDA answer is not defined (a tensor written twice by one
    launch: its blocks race), so on a GPU only the fallback is checked."""
    raised = _raised(lambda: _call(name, *fresh()))
    gems.reset_stats()
    if raised is None:
        with gems.use_gems():
            got = _call(name, *fresh())
        st = gems.stats()[name]
        assert st["served"] == 0 and st["reasons"] == {reason: 1}, st
        if racy and ON_GPU:
            return
        want = _call(name, *fresh())
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and torch.equal(g, w), name
    else:
        with gems.use_gems(), pytest.raises(raised[0], match=re.escape(raised[1])):
            _call(name, *fresh())
        st = gems.stats()[name]
        assert st["served"] == 0 and st["reasons"] == {reason: 1}, st


def test_every_optimizer_overload_is_served():
    # what AdamW / Adam / SGD call with foreach=True (capturable or not, amsgrad, maximize, L2 decay)
    used = {"_foreach_add_.Scalar", "_foreach_add_.Tensor", "_foreach_add_.List", "_foreach_add.List",
            "_foreach_mul_.Scalar", "_foreach_mul_.Tensor", "_foreach_mul.Tensor", "_foreach_lerp_.Scalar",
            "_foreach_addcmul_.Scalar", "_foreach_addcdiv_.Scalar", "_foreach_addcdiv_.ScalarList",
            "_foreach_sqrt.default", "_foreach_sqrt_.default", "_foreach_div_.ScalarList", "_foreach_div_.List",
            "_foreach_div_.Scalar", "_foreach_div_.Tensor", "_foreach_sub_.Scalar", "_foreach_neg.default",
            "_foreach_neg_.default", "_foreach_reciprocal_.default", "_foreach_maximum_.List",
            "_foreach_pow.ScalarAndTensor"}
    assert used <= set(NAMES), used - set(NAMES)
    assert len(NAMES) >= 70


@pytest.mark.parametrize("name", NAMES)
@dtype_params()
def test_overload(name, dtype):
    args, kwargs = _args(name, dtype)
    check(name, args, kwargs, dtype)


@pytest.mark.parametrize("name", [n for n in NAMES if registry.get(n).foreach is not None])
@dtype_params()
def test_cpp_serves_repeat_calls(name, dtype):
    # a call the C++ fast path serves whole (fastpath.cpp foreach_serve): the first call of its binary
    # facts runs the Python kernel, which hands over its binary; the next runs from C++ alone
    args, kwargs = _args(name, dtype)
    gems.reset_stats()
    for _ in range(2):
        check(name, args, kwargs, dtype)
    st = gems.stats()[name]
    assert st["served"] == 2 and st["fallback"] == 0, st
    with gems.use_gems():
        cpp = foreach._fast_lists() is not None
    if cpp:
        assert st["python"] <= 1, st


@pytest.mark.parametrize("shapes", [[(37,)], [(5,), (40,)], [(0,)] + [((i * 7) % 40 + 1,) if i % 4 else (0,)
                                                                  for i in range(20)] + [(0,)]],
                         ids=["one", "two", "22-with-empties"])
def test_list_lengths(shapes):
    # the program -> tensor search at its edges: one tensor (no search step), two, and 22 (5 steps)
    # with empty tensors between and at both ends
    xs, ys = _list(torch.float32, shapes=shapes), _list(torch.float32, shapes=shapes)
    check("_foreach_addcmul.Scalar", [xs, ys, ys], {"value": 0.5}, torch.float32)
    check("_foreach_sqrt_.default", [[t.abs() + 0.5 for t in xs]], {}, torch.float32)


def _python_path(monkeypatch, cpp_lists=True):
    """Every _foreach_* call on the Python path: the C++ fast path forgets the binaries it serves calls
    with and gets no new ones (with `cpp_lists=False` Python's own C++ passes are off too)."""
    monkeypatch.setattr(foreach, "_publish", lambda *a: None)
    for i in registry.all_impls():
        if i.foreach is not None and gems.dispatch.op_runtime(i.name).fast is not None:
            gems.dispatch.op_runtime(i.name).fast.clear()
    if not cpp_lists:
        monkeypatch.setattr(foreach, "_fast_lists", lambda: None)


def test_one_launch_per_call(monkeypatch):
    _python_path(monkeypatch)
    launches = count_launches(monkeypatch)
    xs = _list(torch.float32, shapes=[(5,), (40,), (3, 7), (), (70,)] * 3)
    dens = [t.abs() + 1 for t in xs]
    with gems.use_gems():
        torch._foreach_mul_(xs, 1.5)
        torch._foreach_addcdiv_(xs, xs, dens, [0.5] * len(xs))
        torch._foreach_sqrt(dens)
    assert launches == [foreach.foreach_kernel.name] * 3


def test_an_optimizer_step_whose_kernel_is_compiling_is_answered_by_aten():
    # with background compilation an in-place optimizer op's one launch is its first write: while its
    # binary compiles ATen answers the whole call, on arguments nothing has written yet
    r = while_compiling(["foreach_kernel", "fused_adamw_kernel"], """
        torch.manual_seed(0)
        xs = [torch.randn(n, device=dev) for n in (5, 40, 7)]
        want = [x * 1.5 + 2 for x in xs]
        ps = [torch.nn.Parameter(torch.randn(n, device=dev)) for n in (5, 40)]
        qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
        for p, q in zip(ps, qs):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        torch.optim.AdamW(qs, lr=0.1, fused=True).step()          # ATen's step
        with gems.use_gems():
            torch._foreach_mul_(xs, 1.5)
            torch._foreach_add_(xs, 2.0)
            torch.optim.AdamW(ps, lr=0.1, fused=True).step()
        report(ok=all(torch.equal(x, w) for x, w in zip(xs, want)) and all(torch.equal(p, q) for p, q in zip(ps, qs)))
    """)
    # every launch asked was declared the call's first write and found the call deferrable (AdamW's own
    # step count goes through _foreach_add_ too)
    assert r["asked"] and all(first and deferring for _, first, deferring in r["asked"]), r
    assert {name for name, _, _ in r["asked"]} == {"foreach_kernel", "fused_adamw_kernel"}, r
    assert r["ok"], r
    compiling = {k for k, v in r["aten"].items() if "kernel not compiled yet" in v}
    assert {"_foreach_mul_.Scalar", "_foreach_add_.Scalar", "_fused_adamw_.default"} <= compiling, r["aten"]


@pytest.mark.parametrize("name", ["_foreach_div_.List", "_foreach_mul.List", "_foreach_add_.List",
                                  "_foreach_sub.List", "_foreach_maximum_.List", "_foreach_pow.List"])
@dtype_params()
def test_zero_dim_tensor_per_tensor(name, dtype):
    # a List variant whose second list holds one 0-dim tensor per tensor (capturable Adam divides by
    # its bias corrections so), also of another dtype: each program reads its tensor's scalar
    xs = _list(dtype, 0.5, 3.0)
    kw = {"alpha": 0.5} if "add" in name or "sub" in name else {}
    for sdt in (dtype, torch.float32):
        ss = [make((), sdt, low=0.5, high=2.0) for _ in xs]
        if not name.split(".")[0].endswith("_"):
            xs = [x for x in xs if x.dim()]     # a 0-dim self would promote with a 0-dim fp32 other
            ss = ss[:len(xs)]
        check(name, [xs, ss], kw, dtype)
    # the same 0-dim tensor at the same position: one lane reads and writes it
    zs = [make((), dtype, low=0.5, high=2.0) for _ in range(3)]
    if name.split(".")[0].endswith("_"):
        check(name, [[xs[0]] + zs, [make((), dtype, low=0.5, high=2.0)] + zs], kw, dtype)


@dtype_params()
def test_zero_dim_tensor_per_tensor_fallbacks(dtype):
    a, z = make((5,), dtype), make((), dtype)
    # scalars of different dtypes
    s32, s64 = make((), torch.float32), make((), torch.float64)
    check_fallback("_foreach_mul.List", lambda: ([[a.clone(), a.clone()], [s32, s64]], {}),
                   "0-dim tensors of a non-float or of several dtypes")
    # functional, a 0-dim self with another dtype's 0-dim other: the result would promote
    other = torch.float16 if dtype == torch.float32 else torch.float32
    so = make((), other)
    check_fallback("_foreach_mul.List", lambda: ([[a.clone(), z.clone()], [so, so]], {}),
                   "0-dim tensors of both lists with different dtypes")
    # .Tensor: a 0-dim tensor of the list beside a scalar tensor of another dtype promotes per tensor
    # (fp16 / fp32 is fp32 for the 0-dim one only). A served call of the same list without the 0-dim
    # tensor first, so that the C++ fast path has its binary and must refuse the call by itself
    for name in ("_foreach_div.Tensor", "_foreach_add.Tensor"):
        with gems.use_gems():
            _call(name, [[a.clone(), a.clone()], so], {})
        check_fallback(name, lambda: ([[a.clone(), z.clone()], so.clone()], {}),
                       "a 0-dim tensor beside a scalar tensor of another dtype")
    # a scalar that is an element of a tensor written at another position
    check_fallback("_foreach_div_.List", lambda: ([[(c := a.clone()), z.clone()], [z.clone(), c[2]]], {}),
                   "overlapping in-place operands")
    # ... or the first element of the tensor written at its own position: ATen's loop raises
    big = make((65,), dtype)
    fresh = lambda: ([[(c := big.clone())], [c[0]]], {})   # noqa: E731
    typ, msg = _raised(lambda: _call("_foreach_div_.List", *fresh()))
    with gems.use_gems(), pytest.raises(typ, match=re.escape(msg)):
        _call("_foreach_div_.List", *fresh())


@dtype_params()
def test_large_tensors(dtype):
    # the backend's own chunks (2048 elements on the GPU, 4096 interpreted): several per tensor, a
    # partial last one (masked), and a tensor of whole chunks only (every chunk unmasked)
    shapes = [(3, 4097), (5000,), (7,), (), (2, 4096)]
    xs, ys = _list(dtype, shapes=shapes), _list(dtype, shapes=shapes)
    check("_foreach_lerp_.Scalar", [xs, ys, 0.3], {}, dtype)
    check("_foreach_addcdiv.ScalarList", [xs, ys, [t.abs() + 0.5 for t in ys], [0.5, -1.0, 2, 0.25, -0.75]], {}, dtype)


@dtype_params()
def test_exponent_special_cases(dtype):
    # pow's uniform branches for a Scalar exponent: 2, 3, 0.5, -1 (and a general one)
    for e in (2, 3.0, 0.5, -1, 0.75):
        check("_foreach_pow.Scalar", [_list(dtype, 0.5, 3.0)], {"exponent": e}, dtype)


def _views(flat, shapes, start):
    out, k = [], start
    for s in shapes:
        n = 1
        for d in s:
            n *= d
        out.append(flat[k:k + n].view(s))
        k += n
    return out


@dtype_params()
def test_views_of_one_buffer(dtype):
    # flattened parameters (views of one buffer) at odd element offsets: not 16-byte aligned
    flat = make((200,), dtype)
    shapes = [(15,), (37,), (), (0,), (2, 3, 4)]
    ys = _list(dtype, shapes=shapes)
    xs = _views(flat, shapes, 1)
    assert xs[0].data_ptr() % 16
    fresh = lambda: ([_views(flat.clone(), shapes, 1), [y.clone() for y in ys]], {"alpha": 0.5})   # noqa: E731
    check("_foreach_add_.List", [xs, ys], {"alpha": 0.5}, dtype, fresh)
    check("_foreach_mul.Scalar", [xs, 1.7], {}, dtype, lambda: ([_views(flat.clone(), shapes, 1), 1.7], {}))


@dtype_params()
def test_inplace_aliasing_served(dtype):
    # x += x and v += g * g: the same tensor at the same position is read and written by one lane
    xs = _list(dtype)
    check("_foreach_add_.List", [xs, xs], {"alpha": 0.5}, dtype)
    gs = _list(dtype)
    check("_foreach_addcmul_.Scalar", [xs, gs, gs], {"value": 0.25}, dtype)


@dtype_params()
def test_fallbacks_stay_correct(dtype):
    other = torch.float16 if dtype == torch.float32 else torch.float32
    t, v, m, f = make((4, 6), dtype), make((9,), dtype), make((3,), other), make((40,), dtype)
    a, b, s = make((5,), dtype), make((37,), dtype), make((), dtype)
    rows = [
        # non-contiguous tensors
        ("_foreach_mul.Scalar", lambda: ([[t.clone().t(), v.clone()[::2]], 2.5], {}), "non-contiguous tensor"),
        # mixed dtypes: ATen promotes the functional result
        ("_foreach_add.List", lambda: ([[a.clone(), m.clone()], [a.clone(), m.clone()]], {}),
         "tensors of different dtypes"),
        # shapes that differ: ATen's loop broadcasts
        ("_foreach_mul.List", lambda: ([[t.clone(), a.clone()], [t[:1].clone(), a[:1].clone()]], {}),
         "tensors of different shapes"),
        # the same tensor twice in the written list: ATen applies the op twice
        ("_foreach_add_.Scalar", lambda: ([[(c := a.clone()), c], 1.5], {}), "overlapping in-place operands", True),
        # overlapping views
        ("_foreach_mul_.Scalar", lambda: ([[(g := f.clone())[0:10], g[5:15]], 1.5], {}),
         "overlapping in-place operands"),
        # an input at one position meeting the tensor written at another
        ("_foreach_add_.List", lambda: ([[a.clone(), (d := b.clone())], [d[:5], b.clone()]], {}),
         "overlapping in-place operands"),
        # a 0-dim scalar tensor that is one of the written tensors
        ("_foreach_mul_.Tensor", lambda: ([[a.clone(), (c := s.clone())], c], {}), "overlapping in-place operands"),
    ]
    for name, fresh, reason, *racy in rows:
        check_fallback(name, fresh, reason, *racy)


@dtype_params()
def test_numbers_out_of_range_go_to_aten(dtype):
    big = 1e6 if dtype == torch.float16 else 1e39
    xs = _list(dtype)
    range_reason = f"scalar: out of {dtype}'s range"
    check_fallback("_foreach_add.Scalar", lambda: ([[x.clone() for x in xs], big], {}), range_reason)
    check_fallback("_foreach_div.ScalarList", lambda: ([[x.clone() for x in xs], [1.5, big, 2, 3, 4, 5]], {}),
                   f"scalars: out of {dtype}'s range")
    # -0.0 as a kernel argument would lose its sign: it goes to ATen; in a list it keeps it
    check_fallback("_foreach_mul.Scalar", lambda: ([[x.clone() for x in xs], -0.0], {}),
                   "scalar: -0.0 (the sign of a zero number does not reach Triton's kernels)")
    got, ref = check("_foreach_mul.ScalarList", [xs, [-0.0, 1, 2, 3, 4, 5]], {}, dtype)
    assert torch.equal(torch.signbit(got[0]).cpu(), torch.signbit(ref[0]))   # ref: on the CPU


NAN, INF = float("nan"), float("inf")


@dtype_params()
def test_special_values(dtype):
    sp = [torch.tensor(v, dtype=dtype, device=DEVICE) for v in
          ([NAN, INF, -INF, 0.0, -0.0, 1.0, -2.0], [1.0, NAN, 0.0, -0.0, INF, -INF, 2.0])]
    for name, extra in (("_foreach_maximum.List", [sp[::-1]]), ("_foreach_minimum.List", [sp[::-1]]),
                        ("_foreach_div.List", [sp[::-1]]), ("_foreach_maximum.Scalar", [NAN]),
                        ("_foreach_minimum.ScalarList", [[0.5, NAN]]), ("_foreach_lerp.Scalar", [sp[::-1], 0.75]),
                        ("_foreach_neg.default", []), ("_foreach_sqrt.default", []),
                        ("_foreach_reciprocal.default", []), ("_foreach_pow.Scalar", [0.5]),
                        ("_foreach_addcdiv.Scalar", [sp, sp[::-1], 0.5])):
        if name == "_foreach_pow.Scalar" and (dtype == torch.float16 or ON_GPU):
            # ATen's CPU Half kernel and its CUDA foreach kernels are C pow for 0.5 too ((-inf) ** 0.5
            # is inf, not sqrt's NaN): their own answer, not the CPU's float64 one, is the reference there
            want = torch._foreach_pow([sp[0].clone(), sp[1].clone()], 0.5)
            with served(name), gems.use_gems():
                got = torch._foreach_pow([sp[0].clone(), sp[1].clone()], 0.5)
            assert all(torch.equal(g.isnan(), w.isnan()) and torch.equal(g.nan_to_num(0), w.nan_to_num(0))
                       for g, w in zip(got, want)), (got, want)
            continue
        got, ref = check(name, [sp] + extra, {}, dtype)
        if "maximum" in name or "minimum" in name:
            continue   # a +-0.0 tie may give either zero (docs/known-differences.md; ATen's kernels differ)
        for g, r in zip(got, ref):      # the sign of zeros too (assert_close cannot see it)
            z = r == 0
            assert torch.equal(torch.signbit(g.cpu()[z]), torch.signbit(r[z])), name


def _raised(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - ATen's exception is what the test compares with
        return type(e), str(e).split("\n")[0]
    return None


def test_errors_are_atens():
    xs, ys = _list(torch.float32, shapes=[(3,), (4,)]), _list(torch.float32, shapes=[(3,)])
    s1 = torch.tensor([2.0], device=DEVICE)
    for fn in (lambda: torch._foreach_add_([], 1.0),
               lambda: torch._foreach_add(xs, ys),
               lambda: torch._foreach_mul_(xs, [1.0]),
               lambda: torch._foreach_mul(xs, s1),
               lambda: torch._foreach_add_(xs, xs, alpha=True),
               lambda: torch._foreach_addcdiv_(xs, xs, xs, torch.tensor([1.0, 2.0, 3.0], device=DEVICE)),
               lambda: torch._foreach_addcmul(xs, xs, xs, torch.tensor(1.0, device=DEVICE)),
               lambda: torch._foreach_add(xs, [make((2,)), make((4,))])):
        raised = _raised(fn)
        if raised is None:
            assert ON_GPU, "ATen's CPU loop raises for each of these"   # (CUDA's may take bool alpha)
            continue
        typ, msg = raised
        with gems.use_gems(), pytest.raises(typ, match=re.escape(msg)):
            fn()


def test_sub_with_a_bool_number_raises_as_aten():
    # ATen's sub rejects a bool operand; the C++ fast path too (a served call first, so that it has the
    # binary for the bool call's facts)
    xs = _list(torch.float32, shapes=[(3,), (5,)])
    for name, good, bad in (("_foreach_sub.Scalar", 2.0, True), ("_foreach_sub_.Scalar", 1, False),
                            ("_foreach_sub.ScalarList", [1.0, 2.0], [1.0, True]),
                            ("_foreach_sub_.ScalarList", [1.0, 2.0], [False, True])):
        typ, msg = _raised(lambda: _op(name)([x.clone() for x in xs], bad))
        assert "with a bool tensor is not supported" in msg
        gems.reset_stats()
        with gems.use_gems():
            for _ in range(2):
                _op(name)([x.clone() for x in xs], good)
                with pytest.raises(typ, match=re.escape(msg)):
                    _op(name)([x.clone() for x in xs], bad)
        st = gems.stats()[name]
        assert st["served"] == 2 and st["reasons"] == {"sub with a bool number": 2}, st
    # add takes a bool number (True is 1), as in ATen
    check("_foreach_add.Scalar", [xs, True], {}, torch.float32)


def _same_values(got, want):
    """Bit for bit, NaN and infinities included."""
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(torch.isnan(g), torch.isnan(w)), (g, w)
        assert torch.equal(g.nan_to_num(0), w.nan_to_num(0)), (g, w)


@pytest.mark.parametrize("op", ["addcmul", "addcdiv"])
def test_addcmul_addcdiv_near_the_fp32_limit(op):
    # ATen's order of the product and the quotient on this device: its CPU loop runs addcmul/addcdiv
    # per tensor, (value * t1) * t2 and (value * t1) / t2, where value * t1 = 4e38 overflows; its CUDA
    # kernels compute value * (t1 * t2) and value * (t1 / t2) = 5e37. The non-foreach op agrees.
    t2v = 0.125 if op == "addcmul" else 8.0
    self = [torch.tensor([0.0, 1.0, -INF, 3e38], device=DEVICE), torch.tensor([2.0], device=DEVICE)]
    t1 = [torch.tensor([1e38, -1e38, 1e38, 1e38], device=DEVICE), torch.tensor([3e38], device=DEVICE)]
    t2 = [torch.tensor([t2v, t2v, t2v, t2v], device=DEVICE), torch.tensor([1e-30 if op == "addcmul" else 1e30],
                                                                          device=DEVICE)]
    for kind, value in (("Scalar", 4.0), ("Scalar", 1.0), ("ScalarList", [4.0, 1e20]), ("Tensor", None)):
        for inplace in ("", "_"):
            name = f"_foreach_{op}{inplace}.{kind}"
            v = torch.tensor([4.0, -1e10]) if kind == "Tensor" else value
            fresh = lambda: ([[t.clone() for t in self], t1, t2, v], {})   # noqa: E731
            with served(name), gems.use_gems():
                got = _call(name, *fresh())
            want = _call(name, *fresh())
            _same_values(got, want)
            if kind == "Scalar":
                per_op = getattr(torch, op)(self[0], t1[0], t2[0], value=value)
                _same_values(got[:1], [per_op])
    if not ON_GPU:   # the CPU's order: the overflow is ATen's, not the reference's
        assert torch.isinf(want[0][0]) and torch.isinf(want[1][0])


def test_norm_of_one_element_near_the_fp32_limit():
    # |x| exactly, as ATen's CPU reduction of one element answers (x^2 would overflow in fp32)
    xs = [torch.tensor([-3e38], device=DEVICE), torch.tensor(2e38, device=DEVICE),
          torch.tensor([[NAN]], device=DEVICE), torch.tensor([-0.0], device=DEVICE),
          torch.tensor([60000.0], device=DEVICE).half(), torch.tensor([0.0, 0.0], device=DEVICE)]
    for ord in (2, 3.0, 1, 0.5, -1, 0, INF):
        with served("_foreach_norm.Scalar"), gems.use_gems():
            got = torch._foreach_norm(xs, ord)
        want = [torch.linalg.vector_norm(x.double().cpu(), ord).to(x.dtype) for x in xs]
        _same_values([g.cpu() for g in got], want)
        if not ON_GPU:   # ATen's CPU: the same (its CUDA kernel squares: inf for the first two)
            _same_values(got, torch._foreach_norm(xs, ord))
    # two elements: the sum of squares (2e40) overflows fp32 in ATen on both devices, and in Gems
    two = [torch.tensor([1e20, 1e20], device=DEVICE)]
    with gems.use_gems():
        got = torch._foreach_norm(two, 2)
    _same_values(got, torch._foreach_norm(two, 2))
    assert torch.isinf(got[0])


# ------------------------------------------------------------------------------------ optimizers
PARAM_SHAPES = [(4, 7), (37,), (), (3, 2, 5), (70,)]


def _steps(make_opt, dtype, steps, on):
    return optimizer_steps(make_opt, dtype, steps, on, PARAM_SHAPES, 1234)


OPTIMIZERS = {
    "adamw": (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01, foreach=True),
              ["_foreach_mul_.Scalar", "_foreach_lerp_.Scalar", "_foreach_addcmul_.Scalar", "_foreach_sqrt.default",
               "_foreach_div_.ScalarList", "_foreach_add_.Scalar", "_foreach_addcdiv_.ScalarList"]),
    "adamw-amsgrad-maximize": (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01, amsgrad=True,
                                                            maximize=True, foreach=True),
                               ["_foreach_maximum_.List", "_foreach_neg.default"]),
    "adam-l2": (lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.01, foreach=True), ["_foreach_add.List"]),
    "sgd-momentum": (lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, foreach=True),
                     ["_foreach_mul_.Scalar", "_foreach_add_.List"]),
    "sgd-nesterov-decay": (lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-2,
                                                      dampening=0.0, foreach=True),
                           ["_foreach_add.List", "_foreach_add_.List", "_foreach_mul_.Scalar"]),
}


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@dtype_params()
def test_optimizer_step(opt, dtype):
    make_opt, used = OPTIMIZERS[opt]
    gems.reset_stats()
    with served(*used):
        got = _steps(make_opt, dtype, 3, True)
    fe = {k: v for k, v in gems.stats().items() if k.startswith("_foreach_")}
    assert not any(v["fallback"] for v in fe.values()), fe
    ref = _steps(make_opt, torch.float64, 3, False)
    aten = _steps(make_opt, dtype, 3, False)
    assert_close(got, ref, dtype, aten, msg=opt)


@dtype_params()
def test_adamw_capturable(dtype, monkeypatch):
    # capturable=True keeps the step counts on the device and computes the bias corrections with
    # _foreach ops (pow.ScalarAndTensor, sub_, neg_, div_, reciprocal_, sqrt_): what CUDA graphs use.
    # torch allows it for accelerators only; the check is lifted for the test, whose float64 reference
    # runs on the CPU (and, on the interpreter, Gems' too)
    adam = importlib.import_module("torch.optim.adam")
    monkeypatch.setattr(adam, "_get_capturable_supported_devices",
                        lambda supports_xla=True: ["cpu", "cuda"])
    make_opt = lambda ps: torch.optim.AdamW(ps, lr=torch.tensor(1e-2, device=ps[0].device), weight_decay=0.01,  # noqa: E731
                                            amsgrad=True, foreach=True, capturable=True)
    gems.reset_stats()
    with served("_foreach_pow.ScalarAndTensor", "_foreach_sub_.Scalar", "_foreach_neg_.default",
                "_foreach_div_.Tensor", "_foreach_reciprocal_.default", "_foreach_sqrt_.default",
                "_foreach_div_.List", "_foreach_addcdiv_.Scalar", "_foreach_maximum_.List"):
        got = _steps(make_opt, dtype, 2, True)
    fe = {k: v for k, v in gems.stats().items() if k.startswith("_foreach_")}
    # 16-bit: the 0-dim parameter beside fp32 lr-derived tensors computes in fp32 in ATen's per-tensor
    # loop (test_zero_dim_tensor_per_tensor_fallbacks): that call alone goes to ATen
    zero_dim = {"a 0-dim tensor beside a scalar tensor of another dtype"}
    assert not any(v["fallback"] and (dtype == torch.float32 or set(v["reasons"]) != zero_dim)
                   for v in fe.values()), fe
    ref = _steps(make_opt, torch.float64, 2, False)
    aten = _steps(make_opt, dtype, 2, False)
    assert_close(got, ref, dtype, aten, msg="adamw capturable")


def test_cpp_table_cache():
    # the C++ path keeps each table's upload by its content: the same tensors again reuse it
    with gems.use_gems():
        fast = foreach._fast_lists()
    if fast is None:
        pytest.skip("the C++ fast path is off (GEMS_FAST=0) or could not be built")
    xs = _list(torch.float32)
    with gems.use_gems():
        for _ in range(2):
            torch._foreach_mul_(xs, 1.0)     # the first may run Python (and publish the binary)
        n = fast.foreach_tables()
        torch._foreach_mul_(xs, 1.0)
        assert fast.foreach_tables() == n
        ys = _list(torch.float32)
        torch._foreach_mul_(ys, 1.0)
        assert fast.foreach_tables() == min(n + 1, FOREACH_MAX_TABLES)


@pytest.mark.skipif(not ON_GPU, reason="the table's device copy and its cache exist on the GPU only")
def test_table_cache_on_gpu(monkeypatch):
    _python_path(monkeypatch)
    xs = _list(torch.float32)
    with gems.use_gems():
        torch._foreach_mul_(xs, 1.0)
        n = len(foreach._TABLES)
        torch._foreach_mul_(xs, 1.0)
        assert len(foreach._TABLES) == n              # the same tensors: the cached copy
        torch._foreach_mul_(_list(torch.float32), 1.0)
        assert len(foreach._TABLES) == min(n + 1, FOREACH_MAX_TABLES)
    # a CPU 0-dim tensor next to GPU lists: read on the host, served
    check("_foreach_mul.Tensor", [xs, torch.tensor(2.5)], {}, torch.float32)


@pytest.mark.parametrize("ord", [2, float("inf"), 1, -float("inf"), 0, 3.0])
@dtype_params()
def test_norm(ord, dtype):
    # one 0-dim result per tensor in its dtype; empty tensors only where the norm has an identity
    shapes = [s for s in SHAPES if ord >= 0 and ord != float("inf") or s != (0,)] + [(2, 300)]
    check("_foreach_norm.Scalar", [_list(dtype, shapes=shapes)], {"ord": ord}, dtype)


def test_norm_dtype_and_errors():
    xs = _list(torch.float16, shapes=[(3, 5), (37,)])
    with served("_foreach_norm.Scalar"), gems.use_gems():
        got = torch.ops.aten._foreach_norm(xs, 2, dtype=torch.float32)
    assert all(g.dtype == torch.float32 and g.dim() == 0 for g in got)
    assert_close(got, [torch.linalg.vector_norm(x.double()) for x in xs], torch.float32)
    with gems.use_gems(), pytest.raises(RuntimeError, match="infinity norm on an empty tensor"):
        torch.ops.aten._foreach_norm([make((3,)), make((0,))], float("inf"))


@dtype_params()
def test_uniform_scalar_list(dtype):
    # one value for every tensor (Adam's step sizes) is passed as a kernel argument: the same answer
    xs, ys, zs = _list(dtype), _list(dtype), _list(dtype, 0.5, 3.0)
    check("_foreach_addcdiv_.ScalarList", [xs, ys, zs, [-0.25] * len(xs)], {}, dtype)
    check("_foreach_div.ScalarList", [xs, [1.5] * len(xs)], {}, dtype)
    # zeros stay in the table: -0.0 keeps its sign (x * -0.0 is -0.0 for x > 0)
    got, ref = check("_foreach_mul.ScalarList", [[x.abs() for x in xs], [-0.0] * len(xs)], {}, dtype)
    for g, r in zip(got, ref):
        assert torch.equal(torch.signbit(g).cpu(), torch.signbit(r))


@pytest.mark.parametrize("path", ["python", "cpp"])
def test_launch_cache_follows_addresses_and_shapes(path, monkeypatch):
    # the Python path (no fast path) keeps launches by addresses and shapes: a repeat call with the
    # same tensors reuses its launch (no new table); a view of the same memory with another shape, a
    # new tensor, or in-place operands that overlap are decided again. The C++ path decides per call.
    if path == "python":
        _python_path(monkeypatch, cpp_lists=False)
    else:
        with gems.use_gems():
            if foreach._fast_lists() is None:
                pytest.skip("the C++ fast path is off (GEMS_FAST=0) or could not be built")
    foreach._LAUNCHES.clear()
    xs = _list(torch.float32, shapes=[(4, 6), (37,)])
    with gems.use_gems():
        torch._foreach_mul_(xs, 1.5)
        torch._foreach_mul_(xs, 0.5)
        assert len(foreach._LAUNCHES) == (1 if path == "python" else 0)
        flat = [xs[0].view(6, 4), xs[1]]           # the same addresses, another shape
        torch._foreach_mul_(flat, 2.0)
        assert len(foreach._LAUNCHES) == (2 if path == "python" else 0)
    check("_foreach_add.List", [flat, [x.clone() for x in flat]], {"alpha": 0.5}, torch.float32)
    # overlapping in-place operands: the verdict is kept with the launch key, both calls go to ATen
    g = make((40,))
    want = g.clone()
    gems.reset_stats()
    with gems.use_gems():
        for _ in range(2):
            torch._foreach_mul_([g[0:10], g[5:15]], 1.5)
    torch._foreach_mul_([want[0:10], want[5:15]], 1.5)
    torch._foreach_mul_([want[0:10], want[5:15]], 1.5)
    assert torch.equal(g, want)
    assert gems.stats()["_foreach_mul_.Scalar"]["reasons"] == {"overlapping in-place operands": 2}


def test_cpp_list_check_agrees_with_python():
    # the C++ fast path's pass over the lists (csrc/fastpath.cpp foreach_lists) must decide as
    # uniform_lists does, with its reasons
    from gems.runtime import fast as fastpath
    with gems.use_gems():
        fast = foreach._fast_lists()
    if fast is None:
        pytest.skip("the C++ fast path is off (GEMS_FAST=0) or could not be built")
    a, b = _list(torch.float32), _list(torch.float32)
    other = torch.float16 if DEVICE == "cpu" else torch.bfloat16
    cases = [[a], [a, b], [a, b, b],
             [a, [b[0].to(other)] + b[1:]],                     # dtypes
             [a, b[:1] + [b[1].t() if b[1].dim() == 2 else b[1]] + b[2:]],
             [[make((4, 6)).t()] + a[1:], b],                  # non-contiguous
             [a, [b[0].reshape(-1)] + b[1:]]]                  # shapes
    for lists in cases:
        try:
            foreach.uniform_lists(lists)
            want = None
        except gems.registry.Unsupported as e:
            want = str(e)
        assert fast.foreach_lists(lists) == want
    # the functional results' allocation: list 0's shapes, dtype and device, contiguous, fresh memory
    outs = fast.foreach_empty(a)
    assert [(o.shape, o.dtype, o.device, o.is_contiguous()) for o in outs] == \
        [(t.shape, t.dtype, t.device, True) for t in a]
    assert not {o.data_ptr() for o in outs if o.numel()} & {t.data_ptr() for t in a}
    assert fastpath.loaded() is not None


def test_cpp_table_agrees_with_python():
    # the C++ pass's overlap verdict and table (csrc/fastpath.cpp foreach_table) against Python's
    # lists_overlap and table(), which serve without the fast path: same verdicts, byte-identical tables
    with gems.use_gems():
        fast = foreach._fast_lists()
    if fast is None:
        pytest.skip("the C++ fast path is off (GEMS_FAST=0) or could not be built")
    chunk = foreach.CONFIGS[gems.runtime.backend().name]["CHUNK"]
    g = make((64,))
    a, b = _list(torch.float32), _list(torch.float32)
    sv = array("d", [0.5 + i for i in range(len(a))])
    s0 = [make(()) for _ in a]
    cases = [  # (lists, inplace, extra kind)
        ([a], True, None), ([a, b], True, None), ([a, b, b], True, "svals"), ([a, a], True, None),
        ([a, b], False, None), ([a, b], True, "s0"), ([a, b], True, "shared"),
        ([[g[0:10], g[5:15]]], True, None),                    # written twice over the same memory
        ([[g[0:10], g[20:30]], [g[20:30], g[40:50]]], True, None),   # read where another is written
        ([[g[0:10], g[20:30]], [g[0:10], g[20:30]]], True, None),    # the same position: safe
        ([[g[0:10], g[20:30]]], True, "shared_in"),             # a shared scalar inside a written one
        ([[g[0:0], g[0:0]]], True, None),                       # nothing to visit
    ]
    for lists, inplace, kind in cases:
        n = len(lists[0])
        outs = None if inplace else [torch.empty_like(t) for t in lists[0]]
        extra, own, shared, reads_extra = [], None, None, []
        if kind == "svals":
            extra = [array("d", list(sv[:n])).tobytes()]
        elif kind == "s0":
            extra = [array("q", [t.data_ptr() for t in s0[:n]]).tobytes()]
            own = (extra[0], 4)
            reads_extra = [([t.data_ptr() for t in s0[:n]], [4] * n, True)]
        elif kind in ("shared", "shared_in"):
            x = g[2:3] if kind == "shared_in" else make(())
            shared = (x.data_ptr(), 4)
            reads_extra = [([x.data_ptr()], [4], False)]
        cols = lists if outs is None else lists + [outs]
        got = fast.foreach_table(cols, inplace, len(lists), extra, own, shared, chunk)
        numel = [t.numel() for t in lists[0]]
        nbytes = [k * 4 for k in numel]
        ptr_cols = [[t.data_ptr() for t in lst] for lst in cols]
        reads = [(p, nbytes, True) for p in ptr_cols[1:len(lists)]] + reads_extra
        if inplace and foreach.lists_overlap(lists[0], nbytes, reads):
            assert got[0] == "overlap", (kind, got[0])
            continue
        assert got[0] != "overlap", kind
        py_extra = [array("q", e) for e in extra]
        t = foreach.table(lists[0], numel, ptr_cols, py_extra, chunk)
        if t is None:
            assert got[0] == "empty"
            continue
        tab, total, top, base, aligned = t
        assert got[0] is None
        assert got[1] == bytes(array("q", tab.cpu().tolist()))
        assert got[2:] == (total, top, next(i for i, k in enumerate(numel) if k), aligned)
