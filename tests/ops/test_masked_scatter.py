import subprocess
import sys

import pytest
import torch

import gems
from harness import DEVICE, ON_GPU, check_grad, check_op, dtype_params, make

EXACT = dict(rtol=0, atol=0)
OTHER_DTYPES = [torch.int8, torch.int16, torch.uint8, torch.int32, torch.int64, torch.bool, torch.float64]


def _ms(self, mask, source):
    return torch.masked_scatter(self, mask, source)


def _mask(shape, p=0.5):
    m = torch.rand(shape, device=DEVICE) < p
    if m.numel():
        m.view(-1)[0] = True    # never an all-False mask, whatever the draw
    return m


def _llava(B=2, S=9, H=33, dtype=torch.float32, extra=0):
    """inputs_embeds [B, S, H], the image-token mask [B, S, 1] and image_features [n_image_tokens, H]."""
    embeds = make((B, S, H), dtype)
    tokens = _mask((B, S, 1), 0.4)
    n = int(tokens.sum())
    return embeds, tokens, make((n + extra, H), dtype)


@dtype_params()
def test_llava_layout(dtype):
    embeds, tokens, feats = _llava(dtype=dtype)
    out = check_op(lambda e, m, f: e.masked_scatter(m.expand_as(e), f), (embeds, tokens, feats), dtype=dtype,
                   served_ops=["masked_scatter"], **EXACT)
    assert torch.equal(out[tokens.expand_as(out)], feats.flatten())
    # transformers passes the mask already expanded; the broadcast mask must give the same
    check_op(_ms, (embeds, tokens, feats), dtype=dtype, served_ops=["masked_scatter"], **EXACT)
    # a longer row than a GPU block, and unused trailing source elements
    check_op(_ms, _llava(2, 40, 33, dtype, extra=5), dtype=dtype, served_ops=["masked_scatter"], **EXACT)


@dtype_params()
@pytest.mark.parametrize("shape", [(7,), (5, 13), (3, 4, 5), (2, 3, 4, 5, 3)])
def test_random_masks(shape, dtype):
    n = 1
    for s in shape:
        n *= s
    for p in (0.1, 0.5, 1.0):
        check_op(_ms, (make(shape, dtype), _mask(shape, p), make((n,), dtype)), dtype=dtype,
                 served_ops=["masked_scatter"], **EXACT)


@pytest.mark.parametrize("dtype", OTHER_DTYPES, ids=str)
def test_integer_bool_float64(dtype):
    low = 0 if dtype == torch.uint8 else -100
    x, src = make((6, 11), dtype, low=low, high=100), make((70,), dtype, low=low, high=100)
    check_op(_ms, (x, _mask((6, 11)), src), dtype=dtype, served_ops=["masked_scatter"], **EXACT)


def test_layouts_and_broadcast():
    x = make((8, 6)).t()                                    # transposed self
    m = _mask((6, 16))[:, ::2]                              # step-sliced mask
    src = make((6, 9)).t()                                  # non-contiguous source: read in row-major order
    check_op(_ms, (x, m, src), dtype=torch.float32, served_ops=["masked_scatter"], **EXACT)
    # self broadcast against the mask: the result has the broadcast shape
    out = check_op(_ms, (make((3, 1)), _mask((1, 4)), make((12,))), dtype=torch.float32,
                   served_ops=["masked_scatter"], **EXACT)
    assert out.shape == (3, 4) and out.is_contiguous()
    check_op(_ms, (make((1, 5)).expand(4, 5), _mask((4, 1)), make((25,))), dtype=torch.float32,
             served_ops=["masked_scatter"], **EXACT)
    # 0-dim self, mask and source
    check_op(_ms, (make(()), torch.tensor(True, device=DEVICE), make((2,))), dtype=torch.float32,
             served_ops=["masked_scatter"], **EXACT)
    check_op(_ms, (make((3,)), torch.tensor([False, True, False], device=DEVICE), make(())), dtype=torch.float32,
             served_ops=["masked_scatter"], **EXACT)
    # empty: nothing to do; an all-False mask with an empty source copies self
    with gems.use_gems():
        assert _ms(make((0, 4)), _mask((0, 4)), make((3,))).shape == (0, 4)
    check_op(_ms, (make((4, 5)), torch.zeros(4, 5, dtype=torch.bool, device=DEVICE), make((0,))),
             dtype=torch.float32, served_ops=["masked_scatter"], **EXACT)


def test_too_many_dims_go_to_aten():
    x = make((2, 3, 2, 3, 2, 3)).permute(5, 4, 3, 2, 1, 0)   # six dims that do not merge
    impl = gems.registry.get("masked_scatter")
    before = gems.dispatch.op_runtime(impl.name).fell_back
    check_op(_ms, (x, _mask(x.shape), make((216,))), dtype=torch.float32, **EXACT)
    assert gems.dispatch.op_runtime(impl.name).fell_back == before + 1


def test_out_variant():
    op = torch.ops.aten.masked_scatter.out
    x, m, src = make((5, 7)), _mask((5, 7)), make((35,))
    want = torch.masked_scatter(x, m, src)
    out = torch.full((5, 7), float("nan"), device=DEVICE)
    with gems.use_gems():
        op(x, m, src, out=out)
        assert torch.equal(out, want)
        wrong = torch.full((3,), float("nan"), device=DEVICE)
        with pytest.warns(UserWarning, match="resized"):
            op(x, m, src, out=wrong)
        assert torch.equal(wrong, want)
    impl = gems.registry.get("masked_scatter.out")
    before = gems.dispatch.op_runtime(impl.name).served, gems.dispatch.op_runtime(impl.name).fell_back
    big = make((80,))
    want_big = torch.masked_scatter(x, m, big[40:75].clone())
    with gems.use_gems():
        op(x, m, big[40:75], out=big[:35].view(5, 7))        # same storage, no overlap: served
        src2 = src.clone()
        op(x, m, src2, out=src2.view(5, 7))                   # out is the source: ATen decides
    assert (gems.dispatch.op_runtime(impl.name).served, gems.dispatch.op_runtime(impl.name).fell_back) == (before[0] + 1, before[1] + 1)
    assert torch.equal(big[:35].view(5, 7), want_big) and torch.equal(src2.view(5, 7), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int32, torch.bool], ids=str)
def test_inplace(dtype):
    views = [((4, 9, 6), lambda t: t, (4, 9, 1)), ((6, 9), lambda t: t.t(), (9, 6)),
             ((3, 16), lambda t: t[:, ::2], (8,))]
    for shape, view, mshape in views:
        base, mask = make(shape, dtype), _mask(mshape)
        src = make((400,), dtype)
        parent, ref_parent = base.clone(), base.clone()
        y = view(parent)
        view(ref_parent).masked_scatter_(mask, src)
        with gems.use_gems():
            ret = y.masked_scatter_(mask, src)
        assert ret is y and torch.equal(parent, ref_parent)   # the view's elements and nothing else
    assert gems.dispatch.op_runtime("masked_scatter_").served >= 3
    # ATen rejects these, and so must Gems (same exception type)
    with gems.use_gems():
        with pytest.raises(RuntimeError):   # an expanded self: overlapping written elements
            make((1, 3), dtype).expand(2, 3).masked_scatter_(_mask((2, 3)), make((6,), dtype))
        with pytest.raises(RuntimeError):   # the mask does not expand to self's shape
            make((3, 4), dtype).masked_scatter_(_mask((2, 3, 4)), make((24,), dtype))


@pytest.mark.filterwarnings("ignore:masked_scatter_ received a mask with dtype torch.uint8")
def test_rejected_inputs_raise_like_aten():
    x, m = make((4, 5)), _mask((4, 5))
    cases = [(x, m.to(torch.uint8), make((20,))),              # a non-bool mask
             (x, m, make((20,), torch.float64)),               # source dtype differs
             (x, _mask((3, 5)), make((20,)))]                  # shapes that do not broadcast
    if not ON_GPU:   # ATen's CUDA kernel checks this one with a device-side assert (module doc)
        cases.append((x, torch.ones(4, 5, dtype=torch.bool, device=DEVICE), make((19,))))
    for args in cases:
        with pytest.raises(RuntimeError):
            torch.masked_scatter(*args)
        with pytest.raises(RuntimeError), gems.use_gems():
            torch.masked_scatter(*args)


@dtype_params()
def test_backward_through_self_and_source(dtype):
    embeds, tokens, feats = _llava(dtype=dtype, extra=3)   # 3 unused source elements: zero gradient
    # the masks are inputs too (not captured): the float64 reference runs on the CPU
    check_grad(lambda e, t, f: e.masked_scatter(t, f), [embeds, tokens, feats], dtype=dtype,
               served_ops=["masked_scatter", "masked_scatter_backward"], **EXACT)
    check_grad(lambda e, m, f: e.masked_scatter(m, f),
               [make((6, 7), dtype).t().contiguous().t(), _mask((6, 7)), make((5, 9), dtype)],
               dtype=dtype, served_ops=["masked_scatter_backward"], **EXACT)


def test_backward_op_directly():
    op = torch.ops.aten.masked_scatter_backward
    g = make((2, 9, 33))
    tokens = _mask((2, 9, 1), 0.4)
    n = int(tokens.sum()) * 33
    for args in [(g, tokens, [n]), (g, tokens, [n + 150]), (g, tokens.expand(2, 9, 33), [n // 33, 33]),
                 (make((33, 18)).t(), _mask((18, 1)), [600]), (make((0, 3)), _mask((0, 3)), [4])]:
        check_op(op, args, dtype=torch.float32, served_ops=["masked_scatter_backward"], **EXACT)
    with gems.use_gems():
        with pytest.raises(RuntimeError):       # fewer output elements than True positions
            op(g, tokens, [n - 1])
        with pytest.raises(RuntimeError):       # ATen's masked_select takes only bool masks
            op(g, tokens.to(torch.uint8), [n])


_SHORTAGE = """
import contextlib
import torch, gems
x = torch.randn(4, 5, device="cuda")
m = torch.ones(4, 5, dtype=torch.bool, device="cuda")
src = torch.randn(19, device="cuda")      # one element short of the mask's 20 True positions
with gems.use_gems() if {on} else contextlib.nullcontext():
    y = x.masked_scatter(m, src)
print("served", gems.dispatch.op_runtime("masked_scatter").served, flush=True)
torch.cuda.synchronize()
print("no error", flush=True)
"""


@pytest.mark.skipif(not ON_GPU, reason="CUDA's check: a device-side assert (the CPU raises, tested above)")
def test_shortage_is_a_device_side_assert_like_aten():
    # ATen's CUDA kernel ends the context with a device-side assert, and so does Gems' checked scan
    # (no host sync): each runs in a fresh process, since the context does not survive it
    for on in (False, True):
        r = subprocess.run([sys.executable, "-c", _SHORTAGE.format(on=on)], capture_output=True, text=True,
                           timeout=600)
        assert r.returncode != 0 and "no error" not in r.stdout, (on, r.stdout, r.stderr[-2000:])
        assert "device-side assert" in r.stderr, (on, r.stderr[-2000:])
        if on:   # Gems' own assert fired (its message, printed by the device), not ATen's
            assert "at least as many elements" in r.stdout + r.stderr, r.stderr[-2000:]
