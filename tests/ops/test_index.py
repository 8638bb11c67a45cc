"""gather, scatter (src / value; functional, out=, in-place) and index_select (gems/ops/shape/index.py)
against ATen: copies, so results must be equal bit for bit, with ATen's dtype and strides; every dtype,
int32 and int64 indices, any dim (negative too), non-contiguous inputs, indices and outputs, 0-dim and
empty tensors, more dims than the kernel's four that merge, scatter's number conversion (and its
overflow errors), duplicate scatter indices (any written value may win: only that is asserted),
out-of-range indices raising like ATen on the CPU, shape/dtype errors, fallbacks, plans."""
import pytest
import torch

import gems
from harness import DEVICE, DTYPES, FLOAT_IDS, ON_GPU, make, served

ALL_DT = DTYPES + [torch.float64, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]
SCATTER_DT = [d for d in ALL_DT if d != torch.float64]   # copy_'s kernel (the functional form's copy) leaves it
DT_IDS = lambda d: FLOAT_IDS.get(d, str(d).replace("torch.", ""))   # noqa: E731
A = torch.ops.aten


def _make(shape, dtype):
    return make(shape, dtype, low=0 if dtype == torch.uint8 else -3.0, high=100 if dtype == torch.uint8 else 3.0)


def _same(got, want, msg=""):
    assert got.dtype == want.dtype, f"{msg}: dtype {got.dtype} vs {want.dtype}"
    assert got.shape == want.shape, f"{msg}: shape {tuple(got.shape)} vs {tuple(want.shape)}"
    if want.numel() > 1:
        assert got.stride() == want.stride(), f"{msg}: strides {got.stride()} vs {want.stride()}"
    # bitwise: NaN where ATen has NaN (torch.equal calls NaN unequal), the sign of zeros
    g, w = got.cpu(), want.cpu()
    if w.is_floating_point():
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[w.element_size()]
        g, w = g.view(bits), w.view(bits)
    assert torch.equal(g, w), f"{msg}: values differ"


def _check(op, fn, *args, **kw):
    want = fn(*args, **kw)
    with served(op), gems.use_gems():
        got = fn(*args, **kw)
    _same(got, want, op)
    return got


def _idx(high, shape, dtype=torch.int64):
    return torch.randint(0, high, shape, dtype=dtype).to(DEVICE)


def _perm_rows(rows, n, k=None):
    """Each row a permutation of range(n) (first k): scatter indices without duplicates."""
    return torch.stack([torch.randperm(n)[:k or n] for _ in range(rows)]).to(DEVICE)


# ------------------------------------------------------------------------------------------ gather
@pytest.mark.parametrize("dtype", ALL_DT, ids=DT_IDS)
def test_gather_dtypes_and_dims(dtype):
    x = _make((5, 37, 4), dtype)
    for idt in (torch.int64, torch.int32):
        _check("gather", torch.gather, x, 1, _idx(37, (5, 50, 4), idt))       # index longer than self along dim
        _check("gather", torch.gather, x, -1, _idx(4, (3, 7, 2), idt))        # smaller than self elsewhere
        _check("gather", torch.gather, x, 0, _idx(5, (6, 37, 4), idt))
        _check("gather", torch.gather, x, -3, _idx(5, (2, 1, 3), idt))


def test_gather_layouts_and_edges():
    x = make((6, 40))
    _check("gather", torch.gather, x.t(), 0, _idx(6, (25, 6)).t().contiguous().t())   # transposed self/index
    _check("gather", torch.gather, x[:, ::3], 1, _idx(14, (6, 20))[:, ::2])            # step-sliced
    _check("gather", torch.gather, x, 1, _idx(40, (1, 9)).expand(6, 9))               # expanded index
    y = make((2, 3, 4, 5, 6)).permute(0, 1, 4, 2, 3)                                   # 5 dims, permuted
    _check("gather", torch.gather, y, 2, _idx(6, (2, 3, 9, 4, 5)))
    z = make((2, 3, 4, 5, 6))                                                          # 5 dims that merge
    _check("gather", torch.gather, z, 4, _idx(6, (2, 3, 4, 5, 9)))
    # 0-dim self and index, a 1-element index of a 0-dim self, empty index (no checks at all in ATen)
    s = torch.tensor(2.5, device=DEVICE)
    _check("gather", torch.gather, s, 0, torch.tensor(0, device=DEVICE))
    _check("gather", torch.gather, s, 0, torch.tensor([0, 0], device=DEVICE))
    _check("gather", torch.gather, make((4,)), 0, torch.tensor(3, device=DEVICE))
    _check("gather", torch.gather, x, 1, torch.zeros(0, 3, dtype=torch.long, device=DEVICE))
    # the decode pattern: one column per row of [batch, vocab]
    v = make((3, 1000))
    _check("gather", torch.gather, v, -1, _idx(1000, (3, 1)))


def test_gather_out():
    x, i = make((4, 9)), _idx(9, (4, 5))
    for out in (torch.empty(0, device=DEVICE), torch.empty(5, 4, device=DEVICE).t()):
        want = torch.gather(x, 1, i)
        with served("gather.out"), gems.use_gems():
            got = torch.gather(x, 1, i, out=out)
        assert got is out and torch.equal(out.cpu(), want.cpu())


# ----------------------------------------------------------------------------------------- scatter
@pytest.mark.parametrize("dtype", SCATTER_DT, ids=DT_IDS)
def test_scatter_src_dtypes(dtype):
    x = _make((5, 37), dtype)
    src = _make((6, 40), dtype)
    for idt in (torch.int64, torch.int32):
        i = _perm_rows(5, 37, 20).to(idt)
        _check("scatter.src", torch.scatter, x, 1, i, src)           # src larger than index
        _check("scatter.src", torch.scatter, x, -1, i[:3, :4], src)
        j = _perm_rows(37, 5).t().contiguous().to(idt)               # rows permuted along dim 0
        _check("scatter.src", torch.scatter, x, 0, j, src)


@pytest.mark.parametrize("dtype", SCATTER_DT, ids=DT_IDS)
def test_scatter_value_dtypes(dtype):
    x = _make((4, 30), dtype)
    i = _perm_rows(4, 30, 12)
    values = [1, 2.75, -3, True] if dtype != torch.uint8 else [1, 2.75, 255, True]
    if dtype.is_floating_point:
        # compared bit for bit: -0.0 and NaN (a float operation on the GPU would change their bits),
        # 1e-5 (subnormal in fp16), 0.1 (rounded twice by c10: to float, then to half/bfloat16),
        # the largest values in range (3e38: fp32 and bf16 only)
        values += [float("inf"), float("-inf"), float("nan"), -0.0, 0.1, 1e-30, 1e-5, 65504.0]
        values += [3.0e38] if dtype != torch.float16 else []
    for v in values:
        got = _check("scatter.value", torch.scatter, x, 1, i, v)
        if dtype.is_floating_point and v != v:
            assert torch.isnan(got).sum() == i.numel()


def test_scatter_inplace_and_out():
    x, src = make((6, 50)), make((30, 50))
    # (view of self, dim, index): contiguous, transposed, step-sliced, row-sliced
    cases = [(lambda t: t, 1, _perm_rows(6, 50, 30)),
             (lambda t: t.t(), 0, _perm_rows(6, 50, 20).t()),
             (lambda t: t[:, ::2], 1, _perm_rows(6, 25, 10)),
             (lambda t: t[1:5], -1, _perm_rows(4, 50, 7))]
    for view, dim, i in cases:
        for value in (None, -1.5):
            arg = src[:i.shape[0], :i.shape[1]] if value is None else value
            want = view(x.clone()).scatter_(dim, i, arg)
            y = x.clone()
            with served("scatter_.src" if value is None else "scatter_.value"), gems.use_gems():
                r = view(y).scatter_(dim, i, arg)
            assert r.data_ptr() == view(y).data_ptr() and r.stride() == view(y).stride()
            assert torch.equal(view(y).cpu(), want.cpu())
            m = torch.ones_like(y, dtype=torch.bool)    # outside the view nothing changed
            view(m).fill_(False)
            assert torch.equal(y[m].cpu(), x[m].cpu())
    # out= variants (a wrong shape is resized, a transposed out written through its strides)
    i = _perm_rows(6, 50, 30)
    for name, fn, arg in (("scatter.src_out", A.scatter.src_out, src), ("scatter.value_out", A.scatter.value_out, 2.0)):
        want = fn(x, 1, i, arg, out=torch.empty(0, device=DEVICE))
        for out in (torch.empty(0, device=DEVICE), torch.empty(50, 6, device=DEVICE).t()):
            with served(name), gems.use_gems():
                got = fn(x, 1, i, arg, out=out)
            assert got is out and torch.equal(out.cpu(), want.cpu())


def test_scatter_layouts_and_edges():
    x = make((7, 33)).t()                       # non-contiguous self: the result is contiguous like ATen's
    _check("scatter.value", torch.scatter, x, 0, _perm_rows(7, 33, 5).t(), 9.0)
    _check("scatter.src", torch.scatter, x, 1, _perm_rows(33, 7, 3), make((40, 10))[:, ::2])
    s = torch.tensor(1.5, device=DEVICE)
    _check("scatter.value", torch.scatter, s, 0, torch.tensor(0, device=DEVICE), 4.0)
    _check("scatter.src", torch.scatter, s, 0, torch.tensor([0], device=DEVICE), make((1,)))
    _check("scatter.value", torch.scatter, make((3, 4)), 1, torch.zeros(0, 2, dtype=torch.long, device=DEVICE), 1.0)
    # top-p's call: a bool mask scattered back through the sort permutation, [batch, vocab]
    logits = make((2, 300))
    s_logits, s_idx = torch.sort(logits)
    mask = torch.softmax(s_logits, -1).cumsum(-1) <= 0.1
    _check("scatter.src", lambda m: m.scatter(1, s_idx, m), mask)


def test_scatter_duplicates_write_one_of_the_values():
    x = make((3, 8))
    i = torch.tensor([[1, 1, 1, 5], [0, 0, 7, 7], [2, 3, 2, 3]], device=DEVICE)
    src = torch.arange(1, 37, dtype=torch.float32, device=DEVICE).reshape(3, 12)
    with served("scatter.src"), gems.use_gems():
        got = torch.scatter(x, 1, i, src)
    for r in range(3):
        for c in range(8):
            writers = [src[r, k].item() for k in range(4) if i[r, k] == c]
            if writers:
                assert got[r, c].item() in writers, (r, c, got[r, c].item(), writers)
            else:
                assert got[r, c].item() == x[r, c].item()


# ------------------------------------------------------------------------------------ index_select
@pytest.mark.parametrize("dtype", ALL_DT, ids=DT_IDS)
def test_index_select_dtypes(dtype):
    x = _make((6, 37, 3), dtype)
    for idt in (torch.int64, torch.int32):
        _check("index_select", torch.index_select, x, 1, _idx(37, (50,), idt))
        _check("index_select", torch.index_select, x, 0, _idx(6, (4,), idt))
        _check("index_select", torch.index_select, x, -1, _idx(3, (5,), idt))


def test_index_select_layouts_and_edges():
    x = make((9, 40))
    _check("index_select", torch.index_select, x.t(), 0, _idx(40, (7,)))
    _check("index_select", torch.index_select, x[:, ::2], 1, _idx(20, (30,))[::2])   # strided index
    _check("index_select", torch.index_select, x, 1, torch.tensor(5, device=DEVICE))  # 0-dim index
    _check("index_select", torch.index_select, x, 0, torch.zeros(0, dtype=torch.long, device=DEVICE))
    _check("index_select", torch.index_select, torch.tensor(3.0, device=DEVICE), 0, torch.tensor([0], device=DEVICE))
    _check("index_select", torch.index_select, torch.tensor(3.0, device=DEVICE), 0, torch.tensor(0, device=DEVICE))
    _check("index_select", torch.index_select, make((0, 4)), 1, _idx(4, (3,)))
    _check("index_select", torch.index_select, make((2, 3, 4, 5, 6)).permute(1, 0, 4, 2, 3), 2, _idx(6, (8,)))
    want = torch.index_select(x, 1, _idx(40, (3,)))
    for out in (torch.empty(0, device=DEVICE), torch.empty(3, 9, device=DEVICE).t()):
        i = _idx(40, (3,))
        want = torch.index_select(x, 1, i)
        with served("index_select.out"), gems.use_gems():
            got = torch.index_select(x, 1, i, out=out)
        assert got is out and torch.equal(out.cpu(), want.cpu())


# ------------------------------------------------------------------------------------------ errors
def _rejects():
    x = make((3, 4))
    i = torch.tensor([[0, 2], [1, 1]], device=DEVICE)
    t = lambda v: torch.tensor(v, device=DEVICE)   # noqa: E731
    rows = [
        lambda: torch.gather(x, 1, i.float()),                           # index dtype
        lambda: torch.gather(x, 1, i.to(torch.int16)),
        lambda: torch.gather(x, 1, t([0, 1])),                           # rank
        lambda: torch.gather(x, 0, torch.zeros(2, 5, dtype=torch.long, device=DEVICE)),   # size
        lambda: torch.gather(x, 2, i),                                   # dim
        lambda: torch.scatter(x, 1, i, make((2, 2), torch.float64)),     # src dtype
        lambda: torch.scatter(x, 1, i, make((2, 1))),                    # src too small
        lambda: torch.scatter(x.to(torch.int8), 1, i, 300),              # value overflows int8
        lambda: torch.scatter(x.half(), 1, i, 1e6),                      # value overflows fp16
        lambda: torch.scatter(x.to(torch.uint8), 1, i, -1.5),
        lambda: torch.scatter(x.int(), 1, i, float("nan")),
        lambda: x.clone().scatter_(1, i, x.clone()[:2, :2].t()),         # fine in ATen: control row
        lambda: (lambda y: y.scatter_(1, i, y))(x.clone()),              # src overlaps self
        lambda: x.clone()[:1].expand(3, 4).scatter_(1, i, 1.0),          # self overlaps itself
        lambda: torch.index_select(x, 1, t([[1]])),                      # not a vector
        lambda: torch.index_select(x, 1, t([1.0])),
        lambda: torch.index_select(t(5.0), 0, t([0, 0])),
    ]
    if not ON_GPU:   # out of range: ATen's CPU kernels raise (CUDA asserts on the device)
        rows += [
            lambda: torch.index_select(make((3, 0)), 1, t([0])),      # (an empty dim)
            lambda: torch.gather(x, 1, i + 3),
            lambda: torch.gather(x, 1, i - 2),
            lambda: torch.scatter(x, 1, i + 3, make((2, 2))),
            lambda: torch.scatter(x, 0, i - 1, 5.0),
            lambda: x.clone().scatter_(1, i * 4, 5.0),
            lambda: torch.index_select(x, 0, t([3])),
            lambda: torch.index_select(x, 1, t([0, -1])),
            lambda: torch.index_select(x, 1, t([4]).int()),
            lambda: torch.index_select(make((4,)), 0, t(4)),
        ]
    return rows


def test_errors_like_aten():
    for k, f in enumerate(_rejects()):
        try:
            want = f()
        except Exception as e:   # noqa: BLE001
            want = type(e)
        with gems.use_gems():
            if isinstance(want, type):
                with pytest.raises(want):
                    f()
            else:
                got = f()
                _same(got, want, f"row {k}")


def test_fallbacks_counted():
    gems.reset_stats()
    x = make((2, 3, 4, 5, 6)).permute(4, 2, 0, 3, 1)     # five dims that do not merge: ATen
    with gems.use_gems():
        a = torch.gather(x, 1, _idx(4, (6, 4, 2, 5, 3)))
        torch.scatter(make((3, 4), torch.float64), 1, _perm_rows(3, 4, 2), 1.0)
    assert a.shape == (6, 4, 2, 5, 3)
    assert gems.stats()["gather.default"]["fallback"] == 1
    assert "four dims" in str(gems.stats()["gather.default"]["reasons"])
    assert gems.stats()["scatter.value"]["fallback"] == 1


def test_repeat_calls_use_a_plan():
    if not ON_GPU:
        pytest.skip("the interpreter checks indices on the host (ATen ops in the wrapper): no call plan")
    empty_info = {"plans": 0, "no_plan": 0}
    for op, fn in (("gather.default", lambda: torch.gather(make((4, 100)), 1, _idx(100, (4, 3)))),
                   ("index_select.default", lambda: torch.index_select(make((4, 100)), 1, _idx(100, (3,)))),
                   ("scatter.src", lambda: torch.scatter(make((4, 100)), 1, _perm_rows(4, 100, 9), make((4, 9))))):
        before = gems.dispatch.plan_stats().get(op, empty_info)
        for _ in range(3):
            with gems.use_gems():
                fn()
        info = gems.dispatch.plan_stats()[op]
        assert info["plans"] == before["plans"] + 1, (op, before, info)


def test_scatter_value_bits_follow_c10():
    # scatter's number reaches the kernel as the bits of c10's conversion (double -> float -> dtype):
    # random magnitudes over every exponent, exact ties of the narrowing roundings, subnormals, specials
    from gems.ops.shape.index import _float_bits
    g = torch.Generator().manual_seed(11)
    vals = (torch.randn(4000, generator=g, dtype=torch.float64)
            * torch.pow(2.0, torch.randint(-150, 128, (4000,), generator=g).double())).tolist()
    vals += [1 + 2 ** -11, 1 + 3 * 2 ** -11, 1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -24, 2 ** -149, 2 ** -150,
             2 ** -24, 2 ** -25, 3 * 2 ** -26, 65504.0, 65519.0, -0.0, 0.0, float("inf"), float("-inf"),
             3.3895e38, 1e-45, -1e-40]
    # NaN: c10's scalar conversions give the quiet NaN (torch's vectorized CPU cast to bf16 gives 0xFFFF)
    assert [_float_bits(float("nan"), d) for d in (torch.float32, torch.float16, torch.bfloat16)] == \
        [0x7FC00000, 0x7E00, 0x7FC0]
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        lim = torch.finfo(dtype).max
        ok = [v for v in vals if abs(v) <= lim or abs(v) == float("inf")]
        want = torch.tensor(ok, dtype=torch.float64).to(torch.float32).to(dtype)
        want = want.view({2: torch.int16, 4: torch.int32}[want.element_size()]).tolist()
        got = [_float_bits(v, dtype) for v in ok]
        bad = [(v, g_, w) for v, g_, w in zip(ok, got, want) if g_ != w]
        assert not bad, f"{dtype}: {bad[:5]}"
