"""native_dropout / native_dropout_backward (gems/ops/random/dropout.py): the same distribution as ATen, not
the same bits, so the contract is tested: the kept fraction within a binomial bound, kept values equal
to x * scale exactly (ATen's scale on this device), dropped ones 0, a bool mask consistent with the
output, reproducibility under torch.manual_seed, successive calls differ, train=False / p=0 / p=1
like ATen, backward = grad * mask * scale through autograd, fallbacks counted."""
import math

import pytest
import torch
import torch.nn.functional as F

import gems
from harness import DEVICE, DTYPES, ON_GPU, assert_close, dtype_params, make, served

nd = torch.ops.aten.native_dropout
ndb = torch.ops.aten.native_dropout_backward


def aten_scale(p):
    """ATen's fp32 scale on this device: the kept value of a 1 in its own dropout."""
    torch.manual_seed(1)
    out, mask = nd(torch.ones(256, device=DEVICE), p, True)
    assert mask.any()
    return out[mask][0].item()


def _run(x, p, train=True):
    with served("native_dropout"), gems.use_gems():
        return nd(x, p, train)


@dtype_params()
@pytest.mark.parametrize("p", [0.1, 0.5, 0.8])
def test_contract(p, dtype):
    n = 4099 if not ON_GPU else 1 << 20
    x = make((n,), dtype)
    torch.manual_seed(0)
    out, mask = _run(x, p)
    assert mask.dtype == torch.bool and mask.shape == x.shape and out.dtype == dtype and out.shape == x.shape
    q = 1 - p
    kept = mask.sum().item()
    bound = 5 * math.sqrt(n * p * q)
    assert abs(kept - n * q) <= bound, (kept, n * q, bound)
    s = aten_scale(p)
    want = (x.float() * s).to(dtype)
    assert torch.equal(out[mask].cpu(), want[mask].cpu()), "kept values are not x * scale"
    assert (out[~mask] == 0).all(), "dropped values are not 0"
    # the mask is consistent with the output (inputs are never 0)
    assert torch.equal(mask, out != 0)


def test_layout_of_the_randomness():
    # a 2-D input: the kept pattern is no function of the row or column alone (no stripes), and
    # successive calls differ; the same seed repeats the same mask
    x = make((64, 67))
    torch.manual_seed(123)
    _, m1 = _run(x, 0.5)
    _, m2 = _run(x, 0.5)
    torch.manual_seed(123)
    _, m3 = _run(x, 0.5)
    assert torch.equal(m1, m3)
    assert not torch.equal(m1, m2)
    rows = m1.float().mean(1)
    cols = m1.float().mean(0)
    assert rows.min() > 0.15 and rows.max() < 0.85 and cols.min() > 0.15 and cols.max() < 0.85
    # the four uniforms of one Philox call feed four different elements: neighbours are independent
    same = (m1[:, :-1] == m1[:, 1:]).float().mean().item()
    assert abs(same - 0.5) < 0.05, same


@dtype_params()
def test_eval_and_edge_probabilities(dtype):
    x = make((5, 7), dtype)
    x[0, 0] = float("nan")
    for p, train in [(0.3, False), (0.0, True), (1.0, True), (0.0, False), (1.0, False)]:
        # deterministic cases: the same answer as ATen on this device (incl. NaN: CUDA's p = 1 gives
        # zeros, the CPU's x * 0 * 0 keeps NaN)
        want = nd(x, p, train)
        got = _run(x, p, train)
        assert got[0].dtype == want[0].dtype and got[1].dtype == want[1].dtype
        assert torch.equal(got[1].cpu(), want[1].cpu()), (p, train)
        assert torch.equal(got[0].cpu().nan_to_num(7.0), want[0].cpu().nan_to_num(7.0)), (p, train)
        assert got[0].data_ptr() != x.data_ptr()
    # train=None is training
    torch.manual_seed(5)
    _, m = _run(make((300,), dtype), 0.5, None)
    assert 0 < m.sum().item() < 300


@dtype_params()
def test_backward_direct(dtype):
    g = make((6, 9), dtype)
    mask = torch.rand(6, 9, device=DEVICE) < 0.6
    for scale in (1 / 0.6, 0.0, 1.0, 2.0):
        want = ndb(g.double(), mask, scale)
        with served("native_dropout_backward"), gems.use_gems():
            got = ndb(g, mask, scale)
        assert_close(got, want.cpu(), dtype, aten=ndb(g, mask, scale))


@dtype_params()
def test_backward_through_autograd(dtype):
    p = 0.4
    x = make((8, 33), dtype).requires_grad_(True)
    g = make((8, 33), dtype)
    torch.manual_seed(3)
    with served("native_dropout", "native_dropout_backward"), gems.use_gems():
        out, mask = nd(x, p, True)
        out.backward(g)
    want = (g.float() * mask * (1 / (1 - p))).to(dtype)
    assert_close(x.grad, want.double().cpu(), dtype)
    if ON_GPU:   # on CUDA F.dropout calls native_dropout (the CPU takes a bernoulli_ path)
        x.grad = None
        with served("native_dropout", "native_dropout_backward"), gems.use_gems():
            y = F.dropout(x, p, training=True)
            y.backward(g)
        keep = y != 0
        assert_close(x.grad, (g.float() * keep * (1 / (1 - p))).to(dtype).double().cpu(), dtype)


def test_fallbacks_are_counted():
    gems.reset_stats()
    x = make((6, 5)).t()
    with gems.use_gems():
        out, mask = nd(x, 0.5, True)
        nd(make((0, 3)), 0.5, True)
        if ON_GPU:   # ATen's CUDA kernel wants a bool mask and raises; its CPU kernel takes a float one
            with pytest.raises(RuntimeError, match="Bool"):
                ndb(make((3, 4)), torch.ones(3, 4, device=DEVICE), 2.0)
        else:
            ndb(make((3, 4)), torch.ones(3, 4, device=DEVICE), 2.0)
    assert out.shape == x.shape
    assert gems.stats()["native_dropout.default"]["fallback"] == 2
    assert gems.stats()["native_dropout_backward.default"]["fallback"] == 1


@pytest.mark.skipif(not ON_GPU, reason="bf16 is left to ATen by the interpreter backend")
def test_bf16_gpu():
    x = make((4096,), torch.bfloat16)
    out, mask = _run(x, 0.25)
    s = aten_scale(0.25)
    assert torch.equal(out[mask], (x.float() * s).to(torch.bfloat16)[mask])


@pytest.mark.skipif(not ON_GPU, reason="per-call Philox state in plans is CUDA's (the interpreter seeds from "
                                       "the CPU generator, an ATen op: no plan)")
def test_planned_dropout_draws_fresh_state_per_call():
    """A repeat signature runs from its call plan (the C++ fast path where loaded) and still reads and
    advances the CUDA generator per call: the same bits as the full path from the same state, the
    generator advanced by the counters used, successive calls different, manual_seed reproducible."""
    from gems.ops.random import dropout as D
    x = make((3, 5000))
    _run(x, 0.3)                       # the signature's plan is built here
    _run(x, 0.3)
    st = gems.plan_stats()["native_dropout.default"]
    assert st["plans"] >= 1, st
    gen = torch.cuda.default_generators[x.device.index or 0]
    torch.manual_seed(7)
    full = D.native_dropout(x, 0.3, True)          # the implementation itself: no plan
    after_full = gen.get_offset()
    torch.manual_seed(7)
    before = gen.get_offset()
    planned = _run(x, 0.3)
    assert gen.get_offset() == after_full == before + math.ceil(x.numel() / 4096) * 1024
    assert torch.equal(planned[0], full[0]) and torch.equal(planned[1], full[1])
    again = _run(x, 0.3)
    assert not torch.equal(again[1], planned[1])
    torch.manual_seed(7)
    assert torch.equal(_run(x, 0.3)[1], planned[1])
    # the Python plan (what runs without the C++ fast path) draws the same state the same way
    plans = [q for q in gems.dispatch.op_runtime("native_dropout.default").plans.plans.values()
             if "_philox(" in (getattr(q, "__gems_source__", None) or "")
             and "_empty_strided((3, 5000)," in q.__gems_source__]        # this test's signature
    assert plans, "no Python plan reads the generator per call"
    torch.manual_seed(7)
    py = plans[-1](x, 0.3, True)
    assert torch.equal(py[0], full[0]) and torch.equal(py[1], full[1]) and gen.get_offset() == after_full


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs")
def test_dropout_in_a_cuda_graph_goes_to_aten():
    """Under capture the plan declines (its state is read on the host, a graph would freeze it) and the
    full path hands the call to ATen, whose graph-safe Philox gives each replay a fresh mask."""
    x = make((4096,))
    _run(x, 0.5)
    _run(x, 0.5)                       # planned from here on
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    gems.reset_stats()
    with torch.cuda.stream(s), gems.use_gems():
        with torch.cuda.graph(g, stream=s):
            out, mask = nd(x, 0.5, True)
    torch.cuda.current_stream().wait_stream(s)
    st = gems.stats()["native_dropout.default"]
    assert st["fallback"] == 1 and st["served"] == 0, st
    g.replay()
    m1 = mask.clone()
    g.replay()
    assert not torch.equal(m1, mask)
