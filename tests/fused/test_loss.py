"""gems.fused.cross_entropy and fused_linear_cross_entropy against torch's cross_entropy in float64."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from harness import DEVICE, DTYPES, FLOAT_IDS, assert_close, make

from gems.fused import cross_entropy_loss as L
from gems.fused import linear_cross_entropy as LCE
from gems.fused.cross_entropy_loss import cross_entropy, reference_cross_entropy
from gems.fused.linear_cross_entropy import fused_linear_cross_entropy, reference_fused_linear_cross_entropy

dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: FLOAT_IDS[d])


def _target(N, V, ignored=(), ignore_index=-100):
    t = torch.randint(0, V, (N,))
    for i in ignored:
        t[i] = ignore_index
    return t.to(DEVICE)


def _check_ce(x, t, dtype, **kw):
    """Forward and gradient vs F.cross_entropy in float64 (and the flash-attention rule at dtype)."""
    xg = x.detach().clone().requires_grad_()
    out = cross_entropy(xg, t, **kw)
    assert out.dtype == kw.get("out_dtype", None) or out.dtype == dtype
    kw_t = {k: v for k, v in kw.items() if k != "out_dtype"}
    w = kw_t.pop("weight", None)
    x64 = x.detach().cpu().double().requires_grad_()
    ref = F.cross_entropy(x64, t.cpu(), weight=None if w is None else w.cpu().double(), **kw_t)
    low = None
    if dtype != torch.float32:
        xl = x.detach().clone().requires_grad_()
        low = F.cross_entropy(xl, t, weight=None if w is None else w.to(dtype), **kw_t)
    assert_close(out, ref, dtype if out.dtype == dtype else torch.float32, low if out.dtype == dtype else None,
                 msg="ce")
    g = make(out.shape, out.dtype)
    (got,) = torch.autograd.grad(out, xg, g)
    assert got.dtype == dtype and got.shape == x.shape
    (want,) = torch.autograd.grad(ref, x64, g.cpu().double())
    aten = torch.autograd.grad(low, xl, g.to(low.dtype)) if low is not None else None
    assert_close(got, want, dtype, aten, msg="ce grad")
    return out, got


@dtypes
@pytest.mark.parametrize("V", [517, 1000])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_ce_reductions_ignore(dtype, V, reduction):
    x = make((9, V), dtype)
    t = _target(9, V, ignored=(2, 7))
    _check_ce(x, t, dtype, reduction=reduction)


@dtypes
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_ce_label_smoothing(dtype, reduction):
    x = make((7, 517), dtype)
    t = _target(7, 517, ignored=(3,))
    _check_ce(x, t, dtype, reduction=reduction, label_smoothing=0.1)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_ce_many_blocks(reduction, monkeypatch):
    # force small blocks: the online log-sum-exp crosses 4 blocks of 256 (the last one ragged)
    monkeypatch.setitem(L._CONFIGS, (1000, torch.float32), (256, 2, False, 256, 2))
    x = make((5, 1000))
    t = _target(5, 1000, ignored=(1,), ignore_index=7)
    _check_ce(x, t, torch.float32, reduction=reduction, ignore_index=7, label_smoothing=0.1)


@pytest.mark.parametrize("single", [True, False])
def test_ce_grad_output_one_and_backward_twice(single, monkeypatch):
    # mean/sum: the gradient is written in forward; backward with grad_output == 1 leaves it as is
    monkeypatch.setitem(L._CONFIGS, (300, torch.float32), (512, 1, True, 128, 1) if single else (128, 1, False, 128, 1))
    x = make((5, 300), requires_grad=True)
    t = _target(5, 300, ignored=(0,))
    for red in ("mean", "sum"):
        out = cross_entropy(x, t, reduction=red, label_smoothing=0.05)
        (g,) = torch.autograd.grad(out, x, retain_graph=True)
        x2 = x.detach().double().requires_grad_()
        (w,) = torch.autograd.grad(F.cross_entropy(x2, t, reduction=red, label_smoothing=0.05), x2)
        assert_close(g, w, torch.float32)
        with pytest.raises(RuntimeError, match="twice"):
            torch.autograd.grad(out, x)
    # "none" keeps the logits: backward may run twice
    out = cross_entropy(x, t, reduction="none")
    a = torch.autograd.grad(out.sum(), x, retain_graph=True)[0]
    b = torch.autograd.grad(out.sum(), x)[0]
    assert torch.equal(a, b)


@dtypes
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_ce_class_weights(dtype, reduction, label_smoothing):
    x = make((7, 517), dtype)
    t = _target(7, 517, ignored=(3,))
    w = make((517,), torch.float32, low=0.2, high=2.0)
    _check_ce(x, t, dtype, reduction=reduction, label_smoothing=label_smoothing, weight=w)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_ce_class_weights_many_blocks(reduction, monkeypatch):
    monkeypatch.setitem(L._CONFIGS, (600, torch.float32), (128, 1, False, 128, 1))
    x = make((4, 600))
    t = _target(4, 600, ignored=(2,))
    w = make((600,), low=0.2, high=2.0)
    _check_ce(x, t, torch.float32, reduction=reduction, label_smoothing=0.2, weight=w)


def test_ce_llama_vocab():
    x = make((3, 32000), low=-8, high=8)
    t = _target(3, 32000)
    _check_ce(x, t, torch.float32)


@dtypes
def test_ce_single_row_and_fp32_out(dtype):
    x = make((1, 517), dtype)
    t = _target(1, 517)
    _check_ce(x, t, dtype)
    out = cross_entropy(x, t, reduction="sum", out_dtype=torch.float32)
    assert out.dtype == torch.float32
    ref = F.cross_entropy(x.double(), t, reduction="sum")
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_ce_all_ignored():
    x = make((4, 300), requires_grad=True)
    t = torch.full((4,), -100, device=DEVICE)
    out = cross_entropy(x, t)
    assert torch.isnan(out)
    (g,) = torch.autograd.grad(out, x)
    (w,) = torch.autograd.grad(F.cross_entropy(x, t), x)
    torch.testing.assert_close(g, w, equal_nan=True)
    assert cross_entropy(x, t, reduction="sum").item() == 0.0


def test_ce_strided_logits_and_target():
    big = make((6, 2 * 517))
    x = big[:, ::2]                       # stride along V is 2
    tt = _target(12, 517)
    t = tt[::2]
    _check_ce(x, t, torch.float32, reduction="none")


def test_ce_out_of_range_target_is_nan():
    x = make((3, 50))
    t = torch.tensor([1, 50, 2], device=DEVICE)
    out = cross_entropy(x, t, reduction="none")
    assert torch.isnan(out[1]) and not torch.isnan(out[0]) and not torch.isnan(out[2])


def test_ce_errors():
    x = make((3, 50))
    t = _target(3, 50)
    with pytest.raises(ValueError, match="weight must be"):
        cross_entropy(x, t, weight=torch.ones(49, device=DEVICE))
    with pytest.raises(NotImplementedError, match="class weights"):
        cross_entropy(x, t, weight=torch.ones(50, device=DEVICE, requires_grad=True))
    with pytest.raises(ValueError, match="2-D"):
        cross_entropy(x[0], t[0])
    with pytest.raises(TypeError, match="int64"):
        cross_entropy(x, t.float())
    with pytest.raises(ValueError, match="reduction"):
        cross_entropy(x, t, reduction="avg")
    with pytest.raises(ValueError, match="label_smoothing"):
        cross_entropy(x, t, label_smoothing=1.5)
    with pytest.raises(ValueError, match="3 elements"):
        cross_entropy(x, t[:2])
    with pytest.raises(TypeError, match="dtype"):
        cross_entropy(x.double(), t)


def test_ce_reference_matches_torch():
    x = make((5, 77), torch.float64)
    t = _target(5, 77, ignored=(0,))
    for red in ("mean", "sum", "none"):
        torch.testing.assert_close(reference_cross_entropy(x, t, reduction=red, label_smoothing=0.2),
                                   F.cross_entropy(x, t, reduction=red, label_smoothing=0.2))


# --------------------------------------------------------------------------- fused linear + CE
def _check_flce(N, H, V, dtype, chunk, bias=True, reduction="mean", label_smoothing=0.0, ignored=(3,)):
    h, w = make((N, H), dtype, low=-1, high=1), make((V, H), dtype, low=-1, high=1)
    b = make((V,), dtype, low=-1, high=1) if bias else None
    t = _target(N, V, ignored=ignored)
    args = [h, w, b] if bias else [h, w]
    kw = dict(reduction=reduction, label_smoothing=label_smoothing)
    gout = make((N,), dtype)    # per-row output gradient for reduction="none"

    def run(fn, xs, **extra):
        xs = [x.detach().clone().requires_grad_() for x in xs]
        hb = xs[2] if bias else None
        out = fn(xs[0], xs[1], t.to(xs[0].device), hb, **kw, **extra)
        g = gout if out.dim() else torch.tensor(1.5)
        grads = torch.autograd.grad(out, xs, g.to(device=out.device, dtype=out.dtype))
        return out, grads

    got = run(fused_linear_cross_entropy, args, chunk_size=chunk)
    ref = run(reference_fused_linear_cross_entropy, [a.cpu().double() for a in args])
    low = run(reference_fused_linear_cross_entropy, args) if dtype != torch.float32 else (None, None)
    assert got[0].dtype == dtype
    # grad_weight is accumulated chunk by chunk in the weight's dtype (one rounding per chunk)
    n_chunks = -(-N // chunk)
    assert_close(got[0], ref[0], dtype, low[0], msg="flce loss")
    for i, (g, r) in enumerate(zip(got[1], ref[1])):
        a = low[1][i] if low[1] is not None else None
        rtol = TOL_LOW[dtype] * n_chunks if dtype != torch.float32 and i == 1 else None
        assert_close(g, r, dtype, a, rtol=rtol, msg=f"flce grad {['hidden', 'weight', 'bias'][i]}")


TOL_LOW = {torch.float16: 1e-3, torch.bfloat16: 8e-3}


@dtypes
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_flce_chunks_ragged(dtype, reduction):
    _check_flce(37, 16, 100, dtype, chunk=8, reduction=reduction)


def test_flce_no_bias_smoothing_one_chunk():
    _check_flce(20, 24, 130, torch.float32, chunk=64, bias=False, label_smoothing=0.1)


def test_flce_none_smoothing_chunks():
    _check_flce(19, 16, 70, torch.float32, chunk=5, reduction="none", label_smoothing=0.1, ignored=(0, 18))


def test_flce_default_chunk_and_frozen_weight():
    N, H, V = 12, 8, 50
    h = make((N, H), requires_grad=True)
    w = make((V, H))                      # frozen: no grad_weight buffer, no dW GEMM
    t = _target(N, V)
    out = fused_linear_cross_entropy(h, w, t)
    (g,) = torch.autograd.grad(out, h)
    h2 = h.detach().clone().requires_grad_()
    ref = F.cross_entropy(h2 @ w.t(), t)
    (g2,) = torch.autograd.grad(ref, h2)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g, g2, rtol=1e-5, atol=1e-6)
    # the low-memory rule gives the same result (one chunk here too: N is small)
    lo = fused_linear_cross_entropy(h, w, t, chunk_size="low_memory")
    torch.testing.assert_close(lo, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="low_memory"):
        fused_linear_cross_entropy(h, w, t, chunk_size="small")
    with pytest.raises(ValueError, match="low_memory"):
        fused_linear_cross_entropy(h, w, t, chunk_size=True)
    assert LCE.default_chunk(N) == N
    assert LCE.default_chunk(4096) == 2048 and LCE.default_chunk(2048) == 2048 and LCE.default_chunk(100000) == 2048
    assert LCE.chunk_rows(N, H, V) == N
    assert LCE.chunk_rows(4096, 4096, 32000) == 512
    assert LCE.chunk_rows(1024, 4096, 128256) == 256
    assert LCE.chunk_rows(65536, 4096, 32000) == 4096


def test_flce_no_grad_and_errors():
    h, w = make((9, 8)), make((30, 8))
    t = _target(9, 30)
    with torch.no_grad():
        out = fused_linear_cross_entropy(h, w, t, chunk_size=4)
    torch.testing.assert_close(out, F.cross_entropy(h @ w.t(), t), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        out = fused_linear_cross_entropy(h, w, t, chunk_size=4, reduction="none")
    torch.testing.assert_close(out, F.cross_entropy(h @ w.t(), t, reduction="none"), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="does not match"):
        fused_linear_cross_entropy(h, w[:, :4], t)
    with pytest.raises(TypeError, match="dtype"):
        fused_linear_cross_entropy(h, w.half(), t)


def test_flce_backward_twice_raises():
    h, w = make((6, 8), requires_grad=True), make((20, 8), requires_grad=True)
    out = fused_linear_cross_entropy(h, w, _target(6, 20))
    out.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="twice"):
        out.backward()


class _Sizes(TorchDispatchMode):
    """Records the element count of every tensor an ATen op returns."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(o, torch.Tensor):
                self.shapes.append((func, tuple(o.shape)))
        return out


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_flce_never_materializes_full_logits(reduction):
    N, H, V, C = 64, 8, 120, 16
    h, w, b = make((N, H), requires_grad=True), make((V, H), requires_grad=True), make((V,), requires_grad=True)
    t = _target(N, V, ignored=(5,))
    with _Sizes() as mode:
        out = fused_linear_cross_entropy(h, w, t, b, chunk_size=C, reduction=reduction)
        out.sum().backward()
    big = [(f, s) for f, s in mode.shapes if len(s) == 2 and V in s]
    assert big, "no logits chunk seen"
    # every V-wide tensor produced is at most one chunk of logits ([C, V]) or the weight's own shape
    assert all(s in ((V, H), (C, V), (V, C)) or (s[0] <= C and s[1] == V) for _, s in big), big
    # (1-D results left out: the interpreter copies storages as bytes)
    assert max(torch.Size(s).numel() for _, s in mode.shapes if len(s) > 1) < N * V
    # the unfused path does materialize [N, V]
    with _Sizes() as mode2:
        F.cross_entropy(h @ w.t() + b, t).backward()
    assert any(s == (N, V) for _, s in mode2.shapes)


def test_autocast_result_dtype_and_grads():
    # under autocast torch runs the LM head in the autocast dtype and cross_entropy in fp32
    dt = torch.float16 if DEVICE == "cpu" else torch.bfloat16
    N, H, V = 10, 8, 64
    h, w = make((N, H), low=-1, high=1, requires_grad=True), make((V, H), low=-1, high=1, requires_grad=True)
    t = _target(N, V, ignored=(4,))
    with torch.autocast(DEVICE, dtype=dt):
        out = fused_linear_cross_entropy(h, w, t, chunk_size=4)
        ref = F.cross_entropy(torch.nn.functional.linear(h, w), t)
        assert out.dtype == ref.dtype == torch.float32
        logits = (h @ w.t()).detach().requires_grad_()
        assert logits.dtype == dt
        ce = cross_entropy(logits, t)
        assert ce.dtype == torch.float32
    gh, gw = torch.autograd.grad(out, (h, w))
    rh, rw = torch.autograd.grad(ref, (h, w))
    assert gh.dtype == gw.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(gh, rh, rtol=1e-2, atol=2e-3)
    torch.testing.assert_close(gw, rw, rtol=1e-2, atol=2e-3)
    torch.testing.assert_close(ce, F.cross_entropy(logits.float(), t), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fused_linear", [False, True])
def test_divisor_like_hf_num_items_in_batch(fused_linear):
    # HF's ForCausalLMLoss with num_items_in_batch: sum / num_items; the division is folded into the
    # gradient written in forward (backward gets grad_output == 1 and has nothing to scale)
    N, H, V = 11, 8, 90
    h, w = make((N, H), low=-1, high=1, requires_grad=True), make((V, H), low=-1, high=1, requires_grad=True)
    t = _target(N, V, ignored=(2, 3))
    num = torch.tensor(7, device=DEVICE)
    if fused_linear:
        out = fused_linear_cross_entropy(h, w, t, reduction="sum", divisor=num, chunk_size=4)
    else:
        out = cross_entropy(h @ w.t(), t, reduction="sum", divisor=num)
    ref = F.cross_entropy(h @ w.t(), t, reduction="sum") / num
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    got = torch.autograd.grad(out * 0.5, (h, w))
    want = torch.autograd.grad(ref * 0.5, (h, w))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="divisor"):
        cross_entropy(h.detach() @ w.detach().t(), t, divisor=3.0)     # only with reduction="sum"
    out = cross_entropy(h.detach() @ w.detach().t(), t, reduction="sum", divisor=2.5)    # no grad, a float
    torch.testing.assert_close(out, F.cross_entropy(h @ w.t(), t, reduction="sum") / 2.5, rtol=1e-5, atol=1e-5)


def test_no_grad_mode_writes_no_gradients():
    # under torch.no_grad() autograd.Function still reports needs_input_grad: no gradient work then
    N, H, V = 12, 8, 40
    x = make((N, V), requires_grad=True)
    h, w = make((N, H), requires_grad=True), make((V, H), requires_grad=True)
    t = _target(N, V)
    with torch.no_grad(), _Sizes() as mode:
        a = cross_entropy(x, t)
        b = fused_linear_cross_entropy(h, w, t, chunk_size=4)
    allocs = [s for f, s in mode.shapes if f in (torch.ops.aten.empty.memory_format, torch.ops.aten.zeros.default)]
    assert (N, V) not in allocs and (N, H) not in allocs and (V, H) not in allocs, allocs
    assert not a.requires_grad and not b.requires_grad
    torch.testing.assert_close(a, F.cross_entropy(x, t), rtol=1e-5, atol=1e-5)
