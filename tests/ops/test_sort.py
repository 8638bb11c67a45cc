"""sort (every overload) and topk / topk.values (gems/ops/sort/sort.py) against ATen on the same device.

Values must equal ATen's exactly; indices must be a permutation (sort) or distinct positions (topk)
that reproduce the values bit for bit (`gather(x, idx)`: the sign of zero and NaN included), and for
stable=True equal ATen's indices (ties in input order). Covered: fp32/fp16 (bf16 on GPU) and the integer
dtypes, NaN / inf / -0.0 / dtype extremes, ties, 0-dim, empty, odd sizes, negative dims, layouts,
output strides, out= (values=/indices=), topk largest/sorted, both topk paths (one program per row; per-
chunk candidates then a selection) on vocab-sized rows, ATen's errors and the counted fallbacks.
"""
import contextlib
import re

import pytest
import torch

import gems
import gems.ops.sort.sort  # noqa: F401  (auto-imported by gems; named here so a rename breaks loudly)
from harness import DEVICE, DTYPES, FLOAT_IDS, layouts, make, served

INT_DT = [torch.int8, torch.int16, torch.int32, torch.uint8]
SORT_DT = DTYPES + INT_DT + [torch.bool]
TOPK_DT = DTYPES + INT_DT
DT_IDS = lambda d: FLOAT_IDS.get(d, str(d).replace("torch.", ""))   # noqa: E731
NAN, INF = float("nan"), float("inf")


def _bits(t):
    """A tensor whose equality is bitwise equality of t (floats viewed as integers of their width)."""
    t = t.detach().cpu()
    if t.is_floating_point():
        return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def _same_values(got, want, msg):
    assert got.dtype == want.dtype and got.shape == want.shape, \
        f"{msg}: {got.dtype}{tuple(got.shape)} vs {want.dtype}{tuple(want.shape)}"
    g, w = got.detach().cpu(), want.detach().cpu()
    if g.is_floating_point():
        assert torch.equal(g.isnan(), w.isnan()), f"{msg}: NaN positions differ"
        g, w = g.masked_fill(g.isnan(), 0), w.masked_fill(w.isnan(), 0)
    assert torch.equal(g, w), f"{msg}: values differ (first at {int((g != w).flatten().nonzero()[0])})"


def _reproduces(x, dim, values, idx, msg):
    """idx are distinct valid positions along dim and gather(x, idx) is `values` bit for bit."""
    assert idx.dtype == torch.int64 and idx.shape == values.shape, msg
    xd = x.detach().cpu()
    ic = idx.cpu()
    if xd.dim() == 0:
        assert ic.item() == 0, msg
        assert torch.equal(_bits(values), _bits(xd)), msg
        return
    n = xd.shape[dim]
    if ic.numel():
        assert int(ic.min()) >= 0 and int(ic.max()) < n, f"{msg}: index out of range"
        s = ic.sort(dim).values
        assert bool((s.narrow(dim, 1, s.shape[dim] - 1) != s.narrow(dim, 0, s.shape[dim] - 1)).all()), \
            f"{msg}: repeated index"
    # gathered as bits: ATen's CPU gather of bf16 goes through float and rewrites NaNs as 0xFFFF
    assert torch.equal(_bits(xd).gather(dim, ic), _bits(values)), f"{msg}: gather(x, idx) != values"


def check_sort(x, dim=-1, descending=False, stable=None, expect_served=True, on_cpu=False):
    """One sort call through the overload its arguments select; returns Gems' (values, indices).
    `on_cpu`: ATen's answer on the CPU is the reference (see _SPECIAL)."""
    if stable is None:
        fn, name = (lambda t: torch.sort(t, dim, descending)), "sort.default"
    else:
        fn, name = (lambda t: torch.sort(t, dim=dim, descending=descending, stable=stable)), "sort.stable"
    want = fn(x.cpu() if on_cpu else x)
    with (served(name) if expect_served else contextlib.nullcontext()), gems.use_gems():
        got = fn(x)
    msg = f"sort {x.dtype}{tuple(x.shape)} dim={dim} desc={descending} stable={stable}"
    _same_values(got.values, want.values, msg)
    _reproduces(x, dim, got.values, got.indices, msg)
    if stable:
        assert torch.equal(got.indices.cpu(), want.indices.cpu()), f"{msg}: stable indices differ from ATen's"
        # the sign of zeros (NaN payloads: _reproduces checked them against the input)
        num = ~want.values.cpu().isnan() if want.values.is_floating_point() else slice(None)
        assert torch.equal(_bits(got.values)[num], _bits(want.values)[num]), f"{msg}: bits differ (sign of zero?)"
    assert got.values.stride() == want.values.stride(), f"{msg}: strides {got.values.stride()} vs " \
                                                        f"{want.values.stride()}"
    return got


def check_topk(x, k, dim=-1, largest=True, sorted=True, on_cpu=False):
    want = torch.topk(x.cpu() if on_cpu else x, k, dim, largest, sorted)
    with served("topk.default"), gems.use_gems():
        got = torch.topk(x, k, dim, largest, sorted)
    msg = f"topk {x.dtype}{tuple(x.shape)} k={k} dim={dim} largest={largest} sorted={sorted}"
    if sorted:
        _same_values(got.values, want.values, msg)
    else:   # any order of the right set: compare sorted copies
        _same_values(got.values.sort(dim).values, want.values.sort(dim).values, msg)
    _reproduces(x, dim, got.values, got.indices, msg)
    return got


def ties(shape, dtype, levels=5):
    """Many equal values (stability is visible), never zero."""
    t = torch.randint(1, levels + 1, shape) * torch.where(torch.rand(shape) < 0.5, -1, 1)
    if dtype == torch.uint8:
        t = t.abs()
    if dtype == torch.bool:
        return (t > 0).to(DEVICE)
    return t.to(dtype).to(DEVICE)


def values_for(shape, dtype):
    """Random values of any dtype, never zero (uint8 in [1, 200], other integers in [-100, 100])."""
    if dtype.is_floating_point or dtype == torch.bool:
        return make(shape, dtype)
    lo, hi = (1, 200) if dtype == torch.uint8 else (-100, 100)
    return make(shape, dtype, low=lo, high=hi)


# ------------------------------------------------------------------------------------------ sort
@pytest.mark.parametrize("dtype", SORT_DT, ids=DT_IDS)
def test_sort_dtypes(dtype):
    x = values_for((7, 33), dtype)
    for desc in (False, True):
        check_sort(x, -1, desc)
        check_sort(x, 0, desc, stable=True)
        check_sort(ties((5, 40), dtype), 1, desc, stable=True)
        check_sort(ties((5, 40), dtype), -2, desc, stable=False)


# Special values are checked against ATen's CPU answer, the documented order (every NaN, -NaN too,
# largest; -0.0 and +0.0 equal, so a stable sort keeps their input order). ATen's CUDA kernels depart
# from it by path and size: -NaN sorts first on the radix path (pytorch/pytorch#190781), NaN handling of
# topk has differed by dtype (#117617), and -0.0 / +0.0 order (#162235). docs/known-differences.md.
_SPECIAL = dict(on_cpu=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_sort_special_values(dtype):
    row = [0.0, -0.0, 1.5, NAN, -0.0, 0.0, -INF, NAN, INF, -1.5, -NAN, 0.0]
    x = torch.tensor([row, row[::-1]], dtype=dtype, device=DEVICE)
    for desc in (False, True):
        check_sort(x, 1, desc, stable=True, **_SPECIAL)   # NaN last ascending / first descending; +-0 in input order
        check_sort(x, 1, desc, **_SPECIAL)
    big = torch.finfo(dtype)
    check_sort(torch.tensor([big.max, big.tiny, -big.max, -big.tiny, big.tiny / 4, -big.tiny / 4], dtype=dtype,
                            device=DEVICE), 0, False, stable=True, **_SPECIAL)   # subnormals, extremes


@pytest.mark.parametrize("dtype", INT_DT, ids=DT_IDS)
def test_sort_integer_extremes(dtype):
    info = torch.iinfo(dtype)
    x = torch.tensor([info.max, info.min, 1, info.max, info.min + 1, info.max - 1, info.min], dtype=dtype,
                     device=DEVICE)
    check_sort(x, 0, False, stable=True)
    check_sort(x, 0, True, stable=True)


def test_sort_shapes_and_dims():
    check_sort(make(()), 0)                        # 0-dim
    check_sort(make(()), -1, True, stable=True)
    check_sort(make((0, 5)), 1)                    # empty
    check_sort(make((5, 0)), 1, stable=True)
    check_sort(make((1,)), 0)
    check_sort(make((3, 1, 4)), 1, True, stable=True)   # sort dim of size 1
    for shape in [(1, 3), (3, 2), (2, 5, 7), (4, 3, 129)]:
        for dim in range(-len(shape), len(shape)):
            check_sort(ties(shape, torch.float32), dim, dim % 2 == 0, stable=True)
    check_sort(make((300, 6)), 1, stable=True)     # many short rows packed per program


def test_sort_layouts():
    for name, x in layouts((6, 37)):
        check_sort(x, 1, False, stable=True)
        check_sort(x, 0, True, stable=True)
    x = make((3, 4, 5, 6)).permute(2, 0, 3, 1)     # dense: output keeps the input's strides
    for dim in range(4):
        check_sort(x, dim, stable=True)
    x = make((4, 6, 8))[:, ::2, 1:]                # not dense: contiguous outputs
    check_sort(x, 1, stable=True)
    check_sort(x, -1, True)


def test_sort_vocab_rows():
    # TopPLogitsWarper: torch.sort(scores, descending=False) on [batch, vocab] logits
    x = make((2, 32000), torch.float16)            # fp16: many ties
    check_sort(x, -1, False)
    check_sort(x, -1, False, stable=True)
    check_sort(make((1, 32000)), -1, True, stable=True)


def test_sort_out_variants():
    x = ties((4, 9), torch.float32)
    for stable, name in ((None, "sort.values"), (True, "sort.values_stable")):
        want = torch.sort(x, dim=1, descending=True, stable=bool(stable))
        v = torch.empty(4, 9, device=DEVICE)
        i = torch.empty(4, 9, dtype=torch.int64, device=DEVICE)
        kw = {} if stable is None else {"stable": stable}
        with served(name), gems.use_gems():
            r = torch.sort(x, dim=1, descending=True, out=(v, i), **kw)
        assert r[0] is v and r[1] is i
        _same_values(v, want.values, name)
        _reproduces(x, 1, v, i, name)
        if stable:
            assert torch.equal(i.cpu(), want.indices.cpu()), name
    v, i = torch.empty(2, device=DEVICE), torch.empty(2, dtype=torch.int64, device=DEVICE)
    with served("sort.values_stable"), gems.use_gems(), pytest.warns(UserWarning, match="resized"):
        torch.sort(x, stable=True, out=(v, i))
    assert v.shape == x.shape
    _reproduces(x, -1, v, i, "resized out")
    # an out of another dtype: ATen's error
    with gems.use_gems(), pytest.raises(RuntimeError):
        torch.sort(x, out=(torch.empty(0, dtype=torch.int32, device=DEVICE), torch.empty(0, dtype=torch.int64,
                                                                                           device=DEVICE)))


def test_sort_long_rows():
    # beyond one program's block: sorted runs merged pass by pass (an odd number of runs on both backends)
    check_sort(make((1, 3 * 16384)), -1, stable=True)     # no padding: a multiple of the run on both backends
    check_sort(ties((2, 40000), torch.float16, levels=50), -1, True, stable=True)
    check_sort(values_for((40000, 1), torch.int16), 0, stable=True)   # a strided row
    x = make((1, 40000))
    x[0, ::7] = NAN
    x[0, 1::7] = -0.0
    x[0, 2::7] = 0.0
    check_sort(x, -1, True, stable=True)


def test_sort_errors_and_fallbacks():
    x = make((3, 4))
    with gems.use_gems(), pytest.raises(IndexError):
        torch.sort(x, 2)
    gems.reset_stats()
    for dt in (torch.int64, torch.float64):        # not computed (int64 fills the key) / not served
        y = values_for((3, 5), torch.int64) if dt == torch.int64 else make((3, 5), dt)
        check_sort(y, -1, expect_served=False)
    s = gems.stats()["sort.default"]
    assert s["served"] == 0 and s["fallback"] == 2, s


# ------------------------------------------------------------------------------------------ topk
@pytest.mark.parametrize("dtype", TOPK_DT, ids=DT_IDS)
def test_topk_dtypes(dtype):
    x = values_for((6, 45), dtype)
    for largest in (True, False):
        check_topk(x, 5, -1, largest)
        check_topk(x, 3, 0, largest)
        check_topk(ties((4, 50), dtype), 7, 1, largest)
        check_topk(x, 4, 1, largest, sorted=False)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_topk_special_values(dtype):
    row = [0.0, -0.0, 1.5, NAN, -0.0, 0.0, -INF, NAN, INF, -1.5, 0.0]
    x = torch.tensor([row, row[::-1]], dtype=dtype, device=DEVICE)
    for k in (1, 2, 4, 11):
        check_topk(x, k, 1, True, **_SPECIAL)      # NaN counts as the largest
        check_topk(x, k, 1, False, **_SPECIAL)


def test_topk_shapes_and_k():
    check_topk(make(()), 1)
    check_topk(make(()), 1, -1, False)
    check_topk(make((0, 4)), 2)                    # no rows
    check_topk(make((3, 0)), 0)                    # empty row, k = 0
    check_topk(make((3, 5)), 0)
    for n in (1, 2, 3, 17, 64, 100):
        for k in sorted({1, n // 2 + 1, n}):
            check_topk(make((3, n)), k)
    for shape in [(2, 5, 7), (3, 4, 6, 2)]:
        for dim in range(-len(shape), len(shape)):
            check_topk(ties(shape, torch.float32), 2, dim, dim % 2 == 0)
    for name, x in layouts((9, 40)):
        check_topk(x, 6, 1)
        check_topk(x, 4, 0, False)


def test_topk_vocab_rows():
    # TopKLogitsWarper: torch.topk(scores, top_k) on [batch, vocab] logits; rows longer than one chunk go
    # through per-chunk candidates (stage 1) and one selection among them (stage 2)
    check_topk(make((2, 32000)), 50)
    check_topk(make((1, 32000), torch.float16), 50)
    check_topk(ties((2, 5000), torch.float32, levels=3), 40)          # ties across chunks
    check_topk(make((2, 5000)), 64, largest=False, sorted=False)
    check_topk(make((5000, 2)), 30, 0)                                # a strided long dim
    check_topk(make((1, 70000)), 5)                                   # beyond one block: two stages only
    check_topk(make((2, 5000)), 3000)                                 # large k: the whole row in one program
    check_topk(make((1, 40000)), 5000)                                # large k, long row: merged runs
    # the answer concentrated in one place: the row's last elements (a last chunk of 5), its first ones,
    # across a chunk boundary, or all k inside one chunk (each chunk must keep k candidates, not k / chunks)
    ramp = torch.arange(3 * 4096 + 5, dtype=torch.float32, device=DEVICE) - 0.5
    for row in (ramp, ramp.flip(0), ramp.roll(4096 + 25), ramp.roll(9000)):
        check_topk(row[None], 50)
        check_topk(row[None], 50, largest=False)


def test_topk_out_variant():
    x = make((5, 30))
    want = torch.topk(x, 4, 1, False)
    v = torch.empty(5, 4, device=DEVICE)
    i = torch.empty(5, 4, dtype=torch.int64, device=DEVICE)
    with served("topk.values"), gems.use_gems():
        r = torch.topk(x, 4, 1, False, out=(v, i))
    assert r[0] is v and r[1] is i
    _same_values(v, want.values, "topk.values")
    _reproduces(x, 1, v, i, "topk.values")
    v, i = torch.empty(3, device=DEVICE), torch.empty(3, dtype=torch.int64, device=DEVICE)
    with served("topk.values"), gems.use_gems(), pytest.warns(UserWarning, match="resized"):
        torch.topk(x, 4, out=(v, i))
    assert v.shape == (5, 4)
    _same_values(v, torch.topk(x, 4).values, "resized out")


def test_topk_errors_and_fallbacks():
    x = make((3, 5))
    with gems.use_gems():
        for k in (6, -1):
            with pytest.raises(RuntimeError, match="out of range"):
                torch.topk(x, k)
        with pytest.raises(RuntimeError, match="out of range"):
            torch.topk(make(()), 2)
        with pytest.raises(IndexError):
            torch.topk(x, 1, 2)
    # bool: not declared, ATen decides (it raises "not implemented for 'Bool'" on CPU and CUDA)
    try:
        torch.topk(x > 0, 1)
    except RuntimeError as e:
        with gems.use_gems(), pytest.raises(RuntimeError, match=re.escape(str(e).split("\n")[0][:40])):
            torch.topk(x > 0, 1)
    gems.reset_stats()
    with gems.use_gems():
        r = torch.topk(make(()), 0)                # 0-dim, k=0: ATen answers with the element
    assert r.values.shape == () and gems.stats()["topk.default"]["fallback"] == 1
    with gems.use_gems():
        torch.topk(values_for((3, 5), torch.int64), 2)
    assert gems.stats()["topk.default"]["fallback"] == 2


def test_repeat_calls_run_a_plan():
    empty_info = {"plans": 0, "no_plan": 0}
    for name, call in (("topk.default", lambda t: check_topk(t, 50)),
                       ("sort.default", lambda t: check_sort(t, -1, False))):
        before = gems.dispatch.plan_stats().get(name, empty_info)
        for _ in range(3):
            call(make((3, 4100)))
        info = gems.dispatch.plan_stats()[name]
        assert info["plans"] == before["plans"] + 1 and info["no_plan"] == before["no_plan"], (name, before, info)
