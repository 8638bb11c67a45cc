import pytest
import torch
import torch.nn.functional as F

import gems
from gems.ops.blas import convolution as conv_mod
from harness import DEVICE, ON_GPU, assert_close, check_grad, dtype_params, make, served

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def _no_tf32():
    # ATen's fp32 convolutions use TF32 on the GPU by default (cudnn.allow_tf32); the fp32 bounds below
    # are those of a full-fp32 sum, so both ATen and Gems are asked for full fp32 (Gems reads the flag)
    old = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32 = old


def _bound32(k, mag):
    """Deterministic bound of a k-term fp32 sum, (k + 1) 2^-24 sum|a||b| (mag, from float64): any summation
    order or split lands inside it, a missing or misplaced tap (>= 1e-6 in magnitude here) does not."""
    return (k + 1) * 2.0 ** -24 * mag + 1e-7


def _check(got, ref, mag, k, dtype, aten_at_dtype, msg):
    if got is None or ref is None:
        assert got is None and ref is None, f"{msg}: defined {got is not None} vs {ref is not None}"
        return
    assert got.dtype == aten_at_dtype.dtype and got.stride() == aten_at_dtype.stride(), \
        f"{msg}: dtype/strides {got.dtype} {got.stride()} vs ATen's {aten_at_dtype.dtype} {aten_at_dtype.stride()}"
    if dtype == torch.float32:
        err = (got.detach().cpu().double() - ref).abs()
        bound = _bound32(k, mag)
        assert not got.isnan().any() and (err <= bound).all(), f"{msg}: worst {(err / bound).max():.2f}x the bound"
    else:
        assert_close(got, ref, dtype, aten_at_dtype, msg=msg)


def _cpu64(t):
    return None if t is None else t.detach().cpu().double()


def _abs64(t):
    return None if t is None else t.detach().cpu().double().abs()


# (input shape, weight shape, stride, padding, dilation): odd H, W, C, O (no multiple of any block),
# padding wider than a tap, strides that skip input rows (grad_input positions no tap reaches), dilation,
# a 1x1 kernel, and CLIP's patch embedding in small (stride = kernel)
CASES = [
    ((2, 3, 7, 9), (5, 3, 3, 2), (1, 1), (1, 0), (1, 1)),
    ((1, 5, 9, 8), (6, 5, 3, 3), (2, 3), (2, 1), (1, 1)),
    ((2, 4, 10, 7), (3, 4, 2, 3), (1, 2), (0, 2), (3, 2)),
    ((3, 6, 5, 5), (7, 6, 1, 1), (2, 1), (0, 0), (1, 1)),
    ((2, 3, 12, 12), (5, 3, 4, 4), (4, 4), (0, 0), (1, 1)),
]
CASE_IDS = ["s1p1", "stride2x3", "dilated", "1x1", "patch"]


def _conv(x, w, b, case):
    return aten.convolution(x, w, b, case[2], case[3], case[4], False, [0, 0], 1)


def _run_forward(x, w, b, case, dtype):
    with served("convolution"), gems.use_gems():
        y = F.conv2d(x, w, b, case[2], case[3], case[4])
    ref = _conv(_cpu64(x), _cpu64(w), _cpu64(b), case)
    mag = _conv(_abs64(x), _abs64(w), _abs64(b), case)
    _check(y, ref, mag, w[0].numel(), dtype, F.conv2d(x, w, b, case[2], case[3], case[4]), "convolution")


@dtype_params()
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("has_bias", [False, True], ids=["nobias", "bias"])
def test_forward(case, has_bias, dtype):
    x, w = make(case[0], dtype), make(case[1], dtype)
    b = make((case[1][0],), dtype) if has_bias else None
    _run_forward(x, w, b, case, dtype)


def _layouts(case, dtype):
    """Non-contiguous inputs: channels-last input or weight (ATen then returns channels-last), a batch
    sliced with a step, H and W swapped in memory."""
    shape, wshape = case[0], case[1]
    cl = torch.channels_last
    x, w = make(shape, dtype), make(wshape, dtype)
    big = make((shape[0] * 2,) + tuple(shape[1:]), dtype)
    hw = make(shape[:2] + (shape[3], shape[2]), dtype).transpose(2, 3)
    return [("x-channels-last", x.to(memory_format=cl), w), ("w-channels-last", x, w.to(memory_format=cl)),
            ("both-channels-last", x.to(memory_format=cl), w.to(memory_format=cl)),
            ("sliced-batch", big[::2], w), ("hw-transposed", hw, w.transpose(2, 3).contiguous().transpose(2, 3))]


@dtype_params()
@pytest.mark.parametrize("case", CASES[:2], ids=CASE_IDS[:2])
def test_forward_layouts(case, dtype):
    b = make((case[1][0],), dtype)
    for name, x, w in _layouts(case, dtype):
        _run_forward(x, w, b, case, dtype)


def _run_backward(g, x, w, case, mask, dtype):
    args = ([w.shape[0]], case[2], case[3], case[4], False, [0, 0], 1, mask)
    with served("convolution_backward"), gems.use_gems():
        got = aten.convolution_backward(g, x, w, *args)
    at_dtype = aten.convolution_backward(g, x, w, *args)
    ref = aten.convolution_backward(_cpu64(g), _cpu64(x), _cpu64(w), *args)
    mag = aten.convolution_backward(_abs64(g), _abs64(x), _abs64(w), *args)
    O, C, KH, KW = w.shape
    # terms per element: grad_input sums over (o, kh, kw), grad_weight and grad_bias over (n, oh, ow)
    ks = (O * KH * KW, g.shape[0] * g.shape[2] * g.shape[3], g.shape[0] * g.shape[2] * g.shape[3])
    for i, name in enumerate(("grad_input", "grad_weight", "grad_bias")):
        _check(got[i], ref[i], mag[i], ks[i], dtype, at_dtype[i], name)
    return got


@dtype_params()
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_backward(case, dtype):
    x, w = make(case[0], dtype), make(case[1], dtype)
    g = make(tuple(_conv(x, w, None, case).shape), dtype)
    _run_backward(g, x, w, case, [True, True, True], dtype)


@pytest.mark.parametrize("mask", [[True, False, False], [False, True, False], [False, False, True],
                                  [False, True, True]], ids=str)
def test_backward_output_mask(mask):
    case = CASES[1]
    x, w = make(case[0]), make(case[1])
    g = make(tuple(_conv(x, w, None, case).shape))
    _run_backward(g, x, w, case, mask, torch.float32)


@dtype_params()
def test_backward_layouts(dtype):
    case = CASES[1]
    for name, x, w in _layouts(case, dtype):
        shape = tuple(_conv(x, w, None, case).shape)
        # grad_output contiguous and channels-last (autograd passes it in the output's format)
        for gg in (make(shape, dtype), make(shape, dtype).to(memory_format=torch.channels_last)):
            _run_backward(gg, x, w, case, [True, True, True], dtype)


@dtype_params()
def test_backward_patch_layouts(dtype, monkeypatch):
    # stride = kernel without padding (a patch embedding): grad_weight is one GEMM over x's patches;
    # H and W not multiples of the stride (rows and columns no patch covers), every layout of
    # _layouts, grad_output contiguous and channels-last; the patch path must be the one taken
    case = ((3, 3, 14, 13), (5, 3, 4, 4), (4, 4), (0, 0), (1, 1))
    taken = []
    real = conv_mod._patch_grad_weight
    monkeypatch.setattr(conv_mod, "_patch_grad_weight", lambda *a: taken.append(1) or real(*a))
    for name, x, w in _layouts(case, dtype):
        shape = tuple(_conv(x, w, None, case).shape)
        for gg in (make(shape, dtype), make(shape, dtype).to(memory_format=torch.channels_last)):
            n = len(taken)
            _run_backward(gg, x, w, case, [True, True, True], dtype)
            assert len(taken) == n + 1, name


@pytest.mark.parametrize("n", [1, 4])
def test_patch_grad_weight_batches(n):
    # one image: its 144 patches in 2 chunks as the GEMM's batch; four images: the images as the batch
    case = ((n, 3, 48, 49), (5, 3, 4, 4), (4, 4), (0, 0), (1, 1))
    x, w = make(case[0]), make(case[1])
    for gg in (make(tuple(_conv(x, w, None, case).shape)), make((n, 5, 12, 12)).to(memory_format=torch.channels_last)):
        _run_backward(gg, x, w, case, [False, True, False], torch.float32)


def test_grad_weight_split_and_direct():
    # the interpreter's target is 4 programs: one O x K tile with a long M splits it (fp32 partials
    # summed by reduction.py); K = 3*7*7 = 147 > 4 tiles of 32 writes the weight directly
    case = ((3, 2, 9, 11), (4, 2, 2, 2), (1, 1), (0, 0), (1, 1))
    x, w = make(case[0]), make(case[1])
    _run_backward(make(tuple(_conv(x, w, None, case).shape)), x, w, case, [False, True, False], torch.float32)
    case = ((1, 3, 9, 9), (5, 3, 7, 7), (1, 1), (1, 1), (1, 1))
    x, w = make(case[0]), make(case[1])
    _run_backward(make(tuple(_conv(x, w, None, case).shape)), x, w, case, [False, True, False], torch.float32)


def test_empty_batch():
    case = CASES[0]
    x, w, b = make((0,) + case[0][1:]), make(case[1]), make((case[1][0],))
    _run_forward(x, w, b, case, torch.float32)
    g = make(tuple(_conv(x, w, None, case).shape))
    gi, gw, gb = _run_backward(g, x, w, case, [True, True, True], torch.float32)
    assert gi.numel() == 0 and (gw == 0).all() and (gb == 0).all()


def test_int64_offsets(monkeypatch):
    # 64-bit offsets are taken from 2**31 elements on; lowered here so the int64 path runs on small shapes
    monkeypatch.setattr(conv_mod, "_INT64_FROM", 0)
    case = CASES[1]
    x, w, b = make(case[0]), make(case[1]), make((case[1][0],))
    _run_forward(x, w, b, case, torch.float32)
    _run_backward(make(tuple(_conv(x, w, None, case).shape)), x, w, case, [True, True, True], torch.float32)


def test_clip_patch_embedding_grad():
    # Llava's vision tower in small: CLIP's patch embedding is a stride-14 14x14 conv without bias
    x, w = make((2, 3, 28, 28)), make((16, 3, 14, 14))
    fn = lambda x, w: F.conv2d(x, w, None, stride=14)  # noqa: E731
    with served("convolution"), gems.use_gems():
        y = fn(x, w)
    ref = fn(x.double(), w.double())
    assert_close(y, ref, torch.float32, atol=_bound32(588, fn(x.double().abs(), w.double().abs())).max().item())
    # terms per gradient element: grad_weight N*OH*OW = 8, grad_input O = 16 (stride = kernel: each input
    # pixel meets one tap per output channel); |grad_out|, |x|, |w| <= 3
    check_grad(fn, [x, w], dtype=torch.float32, served_ops=["convolution", "convolution_backward"],
               atol=_bound32(16, 9.0 * 16))


@pytest.mark.skipif(not ON_GPU, reason="Llava's full-size shape: GPU run only")
@dtype_params()
def test_llava_clip_patch_embedding(dtype):
    # CLIP ViT-L/14-336: x [1, 3, 336, 336], weight [1024, 3, 14, 14], stride 14, no bias -> [1, 1024, 24, 24]
    case = ((1, 3, 336, 336), (1024, 3, 14, 14), (14, 14), (0, 0), (1, 1))
    x, w = make(case[0], dtype), make(case[1], dtype)
    _run_forward(x, w, None, case, dtype)
    _run_backward(make((1, 1024, 24, 24), dtype), x, w, case, [False, True, False], dtype)


@pytest.mark.skipif(not ON_GPU, reason="TF32 exists on the GPU only")
def test_tf32_follows_cudnn_flag():
    case = CASES[0]
    x, w = make(case[0]), make(case[1])
    torch.backends.cudnn.allow_tf32 = True   # the fixture restores it
    with served("convolution"), gems.use_gems():
        y = F.conv2d(x, w, None, 1, (1, 0))
    assert_close(y, _conv(_cpu64(x), _cpu64(w), None, case), torch.float32, rtol=2e-3, atol=2e-2)
    assert conv_mod._precision(torch.float32) == "tf32"
    torch.backends.cudnn.allow_tf32 = False
    assert conv_mod._precision(torch.float32) == "ieee"


def _fallbacks(name):
    return gems.stats().get(name, {}).get("fallback", 0)


@pytest.mark.parametrize("what", ["groups", "conv1d", "conv3d", "transposed"])
def test_unsupported_runs_aten(what):
    calls = {
        "groups": (lambda: F.conv2d(make((1, 4, 6, 6)), make((6, 2, 3, 3)), groups=2)),
        "conv1d": (lambda: F.conv1d(make((2, 3, 9)), make((4, 3, 3)))),
        "conv3d": (lambda: F.conv3d(make((1, 2, 4, 4, 4)), make((3, 2, 2, 2, 2)))),
        "transposed": (lambda: F.conv_transpose2d(make((1, 3, 5, 5)), make((3, 2, 3, 3)), stride=2)),
    }
    before = _fallbacks("convolution.default")
    torch.manual_seed(0)
    with gems.use_gems():
        got = calls[what]()
    torch.manual_seed(0)
    assert_close(got, calls[what]().double(), torch.float32, atol=1e-4)
    assert _fallbacks("convolution.default") == before + 1


@pytest.mark.parametrize("what", ["channels", "kernel-too-big", "bias-size", "negative-padding", "zero-stride"])
def test_rejects_like_aten(what):
    x, w = make((1, 3, 5, 5)), make((4, 3, 3, 3))
    calls = {
        "channels": lambda: F.conv2d(x, make((4, 2, 3, 3))),
        "kernel-too-big": lambda: F.conv2d(x, make((4, 3, 6, 3))),
        "bias-size": lambda: F.conv2d(x, w, make((3,))),
        "negative-padding": lambda: aten.convolution(x, w, None, [1, 1], [-1, 0], [1, 1], False, [0, 0], 1),
        "zero-stride": lambda: aten.convolution(x, w, None, [0, 1], [0, 0], [1, 1], False, [0, 0], 1),
    }
    with pytest.raises(RuntimeError):
        calls[what]()
    with gems.use_gems(), pytest.raises(RuntimeError):
        calls[what]()
