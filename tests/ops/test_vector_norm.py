"""linalg_vector_norm (gems/ops/reduce/vector_norm.py on reduction.py's kernels) and what clip_grad_norm_
calls, against ATen in float64: every order kind, dims lists, keepdim, dtype=, non-contiguous inputs,
0-dim and empty tensors (0 where the norm has an identity, ATen's error where it has none), the split
path, out=, and torch.nn.utils.clip_grad_norm_ (foreach) served end to end."""
import math

import pytest
import torch

import gems
from gems.ops.reduce import reduction
from harness import DEVICE, assert_close, check_op, dtype_params, layouts, make, served, to_ref

A = torch.ops.aten
NAME = "linalg_vector_norm.default"
ORDS = [2, math.inf, -math.inf, 1, 0, 3.5, -1.5]


def _norm(x, ord=2, dim=None, keepdim=False, dtype=None):
    return A.linalg_vector_norm(x, ord, dim, keepdim, dtype=dtype)


@pytest.mark.parametrize("ord", ORDS)
@pytest.mark.parametrize("shape,dim", [((37,), None), ((5, 300), [1]), ((300, 5), [0]), ((4, 5, 6), [0, 2]),
                                       ((4, 5, 6), [-1, 0]), ((3, 4), []), ((), None), ((2, 3, 4), [1])])
@dtype_params()
def test_orders_and_dims(ord, shape, dim, dtype):
    for keepdim in (False, True):
        check_op(_norm, (make(shape, dtype), ord, dim, keepdim), dtype=dtype, served_ops=(NAME,))


@pytest.mark.parametrize("ord", [2, math.inf, 1])
@dtype_params()
def test_layouts(ord, dtype):
    for name, x in layouts((6, 40), dtype):
        for dim in (None, [0], [1]):
            check_op(_norm, (x, ord, dim), dtype=dtype, served_ops=(NAME,))


def test_dtype_argument():
    x = make((5, 70), torch.float16)
    with served(NAME), gems.use_gems():
        out = _norm(x, 2, [1], False, torch.float32)
    assert out.dtype == torch.float32
    assert_close(out, _norm(to_ref(x), 2, [1]), torch.float32)
    with served(NAME), gems.use_gems():
        y = torch.linalg.vector_norm(make((20,)), dtype=torch.float64)
    assert y.dtype == torch.float64
    with gems.use_gems(), pytest.raises(RuntimeError, match="without narrowing"):
        torch.linalg.vector_norm(make((20,)), dtype=torch.float16)


@pytest.mark.parametrize("ord", ORDS)
def test_empty(ord):
    e = make((0,))
    if ord >= 0 and ord != math.inf:
        with served(NAME), gems.use_gems():
            y = _norm(e, ord)
        assert y.item() == 0 and y.dtype == torch.float32
    else:
        with gems.use_gems(), pytest.raises(RuntimeError, match="does not have an identity"):
            _norm(e, ord)
    # reduced dim non-empty, kept dim empty: an empty result for every order
    with gems.use_gems():
        assert _norm(make((0, 3)), ord, [1]).shape == (0,)


def test_special_values():
    x = make((50,))
    x[7] = float("nan")
    for ord in ORDS:
        with served(NAME), gems.use_gems():
            got = _norm(x, ord)
        assert_close(got, _norm(to_ref(x), ord), torch.float32, msg=str(ord))
    y = make((50,))
    y[3] = float("inf")
    for ord in (2, math.inf, 1):
        with gems.use_gems():
            assert _norm(y, ord).item() == math.inf


def test_split_path():
    # long reductions split over programs: the second stage takes the sqrt / root, not the first
    for ord in ORDS:
        check_op(_norm, (make((3000,)), ord), dtype=torch.float32, served_ops=(NAME,))
        check_op(_norm, (make((2, 3000)), ord, [1]), dtype=torch.float32, served_ops=(NAME,))
        check_op(_norm, (make((2000, 3)), ord, [0]), dtype=torch.float32, served_ops=(NAME,))


def test_reduced_dims_apart_strided():
    # dims that cannot merge: two passes, the transform on the first, the finish on the second
    x = make((4, 6, 5, 3)).permute(0, 2, 1, 3)
    for ord in ORDS:
        check_op(_norm, (x, ord, [0, 2]), dtype=torch.float32, served_ops=(NAME,))


def test_out():
    x = make((4, 33))
    out = torch.empty(4, device=DEVICE)
    with served("linalg_vector_norm.out"), gems.use_gems():
        r = torch.linalg.vector_norm(x, 2, dim=[1], out=out)
    assert r is out
    assert_close(out, torch.linalg.vector_norm(x.double(), dim=[1]), torch.float32)


def test_unsupported_goes_to_aten():
    gems.reset_stats()
    with gems.use_gems(), pytest.raises(RuntimeError, match="floating point"):
        _norm(torch.arange(5), 2)


@dtype_params()
def test_clip_grad_norm(dtype):
    # Hugging Face's Trainer: clip_grad_norm_(params, max_grad_norm=1.0) every step, foreach
    shapes = [(7, 5), (5,), (40, 3), (), (1, 65)]
    grads = [make(s, dtype) for s in shapes]

    def params(gs, dt):
        ps = []
        for g in gs:
            p = torch.nn.Parameter(torch.zeros(g.shape, dtype=dt, device=DEVICE))
            p.grad = g.to(dt).clone()
            ps.append(p)
        return ps
    mine, ref = params(grads, dtype), params([g.double() for g in grads], torch.float64)
    gems.reset_stats()
    with served("_foreach_norm.Scalar", NAME, "_foreach_mul_.Tensor"), gems.use_gems():
        total = torch.nn.utils.clip_grad_norm_(mine, 1.0, foreach=True)
    st = gems.stats()
    for name in ("_foreach_norm.Scalar", NAME):
        assert not st.get(name, {}).get("fallback"), st.get(name)
    want = torch.nn.utils.clip_grad_norm_(ref, 1.0, foreach=True)
    assert_close(total, want, dtype)
    assert_close([p.grad for p in mine], [p.grad for p in ref], dtype, rtol=3e-3 if dtype == torch.float16 else None)


@pytest.mark.skipif(DEVICE != "cpu", reason="ATen's CPU kernel's rule: one element per result is |x|")
@pytest.mark.parametrize("ord", [2, 3, 1, 0.5, -1, math.inf, -math.inf, 0])
def test_one_element_per_result_near_the_fp32_limit(ord):
    # a reduction of one element per result: ATen's CPU answers |x| (3e38 here, where x^2 overflows)
    x = torch.tensor([[3e38, 1.0], [-2e38, 5.0], [0.0, -7.0]])
    cases = [(x[:1, :1], None), (x[:, :1], 1), (x[:, :1], (1,)), (x[:1], 0)]
    for t, dim in cases:
        want = torch.linalg.vector_norm(t, ord, dim)
        with served("linalg_vector_norm.default"), gems.use_gems():
            got = torch.linalg.vector_norm(t, ord, dim)
        assert torch.equal(got, want), (ord, dim, got, want)
