"""Fused attention behind F.scaled_dot_product_attention (gems/ops/attention/).

Reference: SDPA's math in float64 on CPU (softmax(q k^T * scale + mask) v; a row with no visible key
gives 0, SDPA's convention); low precision by the flash-attention rule (error <= 2x ATen's own error in
that dtype + atol). Every SDPA test asserts Gems served the fused overload ATen picks on the device
(CPU: _scaled_dot_product_flash_attention_for_cpu; CUDA: cuDNN / flash / efficient).
"""
import contextlib
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import gems
from gems.ops.attention import overloads as AO
from gems.ops.attention import sdpa as A
from harness import DEVICE, DTYPES, ON_GPU, assert_close, dtype_params, make


def gems_on():
    """Gems with its default selection (the attention group is in it)."""
    return gems.use_gems()

FUSED = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
         "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
HEAD_DIMS = (64, 80, 96, 128) if ON_GPU else (16, 32, 64)
ATOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def ref_attention(q, k, v, mask=None, causal=False, scale=None):
    """SDPA's math in the inputs' dtype (use float64): GQA by repeating heads, top-left causal."""
    Hq, Hk = q.shape[1], k.shape[1]
    if Hq != Hk:
        k = k.repeat_interleave(Hq // Hk, 1)
        v = v.repeat_interleave(Hq // Hk, 1)
    s = q @ k.transpose(-1, -2) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    if causal:
        L, S = s.shape[-2:]
        s = s.masked_fill(~torch.ones(L, S, dtype=torch.bool, device=s.device).tril(), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.to(s.dtype)
    p = torch.softmax(s, -1)
    p = torch.where(torch.isnan(p), torch.zeros_like(p), p)    # fully masked rows: 0
    return p @ v


def aten_choice(fn):
    """The fused overload ATen itself runs for fn() (Gems off), or None (math path)."""
    seen = []

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Mode():
        fn()
    return next((n for n in seen if n in FUSED), None)


@contextlib.contextmanager
def served_attention(fn, backward=False):
    """Assert Gems served the fused forward ATen picks for fn, and its backward overload when asked
    (skip if ATen takes the math path)."""
    name = aten_choice(fn)
    if name is None:
        pytest.skip("ATen runs SDPA's math path for this input here: no fused overload to serve")
    names = [name] + ([name + "_backward"] if backward else [])
    before = {n: gems.dispatch.op_runtime(n).served for n in names}
    yield name
    for n in names:
        got = gems.dispatch.op_runtime(n).served
        assert got > before[n], f"Gems did not serve aten::{n}: {gems.stats().get(n + '.default')}"


def qkv(B, Hq, Hk, Sq, Sk, D, dtype, requires_grad=False, low=-2.0, high=2.0):
    return (make((B, Hq, Sq, D), dtype, low=low, high=high, requires_grad=requires_grad),
            make((B, Hk, Sk, D), dtype, low=low, high=high, requires_grad=requires_grad),
            make((B, Hk, Sk, D), dtype, low=low, high=high, requires_grad=requires_grad))


def make_mask(kind, B, H, Sq, Sk, dtype):
    if kind is None:
        return None
    g = torch.Generator().manual_seed(Sq * 31 + Sk)
    if kind == "bool_pad":        # BERT: [B, 1, 1, Sk] padding, the last keys of batch 1 masked
        m = torch.ones(B, 1, 1, Sk, dtype=torch.bool)
        m[-1, ..., Sk - Sk // 3:] = False
    elif kind == "bool_full":     # [B, 1, Sq, Sk] random keep (at least key 0 kept)
        m = torch.rand(B, 1, Sq, Sk, generator=g) > 0.4
        m[..., 0] = True
    elif kind == "add_pad":       # additive [B, 1, 1, Sk] with -inf padding, broadcast over heads and rows
        m = torch.zeros(B, 1, 1, Sk)
        m[-1, ..., Sk - Sk // 3:] = float("-inf")
        m = m.to(dtype)
    elif kind == "add_head":      # additive [1, H, Sq, Sk] (ALiBi-like), broadcast over batch
        m = (torch.randn(1, H, Sq, Sk, generator=g) * 2).to(dtype)
    else:
        raise ValueError(kind)
    return m.to(DEVICE)


# (B, Hq, Hk, Sq, Sk, causal, mask, scale): ragged lengths (not multiples of any block), Sq != Sk both ways
CASES = {
    "plain": (1, 2, 2, 24, 24, False, None, None),
    "causal_ragged": (2, 2, 2, 37, 37, True, None, None),
    "causal_sq<sk": (1, 2, 2, 19, 40, True, None, None),
    "causal_sq>sk": (1, 2, 2, 40, 19, True, None, None),
    "gqa": (1, 4, 2, 21, 33, False, None, None),
    "gqa_causal": (1, 4, 1, 33, 33, True, None, None),
    "gqa_wide": (2, 4, 2, 20, 70, False, None, None),
    "bool_pad": (2, 2, 2, 17, 17, False, "bool_pad", None),
    "bool_full": (2, 2, 2, 20, 29, False, "bool_full", None),
    "add_pad": (2, 2, 2, 23, 23, False, "add_pad", None),
    "add_head": (1, 3, 3, 18, 26, False, "add_head", None),
    "scale": (1, 2, 2, 20, 31, False, None, 0.37),
}
if ON_GPU:   # real sizes too: several blocks of the GPU configs
    CASES.update({
        "big_causal": (2, 8, 8, 300, 300, True, None, None),
        "big_gqa": (1, 8, 2, 257, 513, False, None, None),
        "big_pad": (4, 4, 4, 200, 200, False, "bool_pad", None),
    })


def _run(case, D, dtype, grads, ctx=contextlib.nullcontext):
    with ctx():
        _run_case(case, D, dtype, grads)


def _run_case(case, D, dtype, grads):
    B, Hq, Hk, Sq, Sk, causal, mkind, scale = CASES[case]
    q, k, v = qkv(B, Hq, Hk, Sq, Sk, D, dtype, requires_grad=grads)
    mask = make_mask(mkind, B, Hq, Sq, Sk, dtype)
    kw = dict(attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=Hq != Hk)

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, **kw)

    g = make((B, Hq, Sq, D), dtype)
    with served_attention(lambda: sdpa(q, k, v), backward=grads), gems_on():
        out = sdpa(q, k, v)
        got = torch.autograd.grad(out, (q, k, v), g) if grads else ()
    r = [t.detach().cpu().double().requires_grad_(grads) for t in (q, k, v)]
    rmask = mask.cpu() if mask is not None else None
    ref = ref_attention(*r, mask=rmask, causal=causal, scale=scale)
    refg = torch.autograd.grad(ref, r, g.cpu().double()) if grads else ()
    aten, ateng = None, None
    if dtype != torch.float32:
        aout = sdpa(q, k, v)
        aten = aout
        ateng = torch.autograd.grad(aout, (q, k, v), g) if grads else ()
    assert_close(out, ref, dtype, aten, atol=ATOL[dtype], msg=f"out {case}")
    if grads:
        assert_close(list(got), list(refg), dtype, list(ateng) if ateng is not None else None, atol=ATOL[dtype],
                     rtol=1e-5 if dtype == torch.float32 else None, msg=f"grad {case}")


@dtype_params()
@pytest.mark.parametrize("case", list(CASES))
def test_sdpa_forward(case, dtype):
    _run(case, HEAD_DIMS[0] if not ON_GPU else 128, dtype, grads=False)


@dtype_params()
@pytest.mark.parametrize("D", HEAD_DIMS)
def test_sdpa_head_dims(D, dtype):
    _run("causal_ragged", D, dtype, grads=False)


BWD_CASES = ["plain", "causal_ragged", "causal_sq<sk", "causal_sq>sk", "gqa_causal", "gqa_wide", "add_head", "bool_pad",
             "scale"]
if ON_GPU:
    BWD_CASES += ["big_causal", "big_gqa", "big_pad"]


@dtype_params()
@pytest.mark.parametrize("case", BWD_CASES)
def test_sdpa_backward(case, dtype):
    D = 128 if ON_GPU else 32
    _run(case, D, dtype, grads=True)


@pytest.mark.parametrize("D", HEAD_DIMS)
def test_sdpa_backward_head_dims(D):
    _run("gqa_causal", D, DTYPES[-1] if ON_GPU else torch.float16, grads=True)


@dtype_params()
@pytest.mark.parametrize("Sk", [150, 1000] if ON_GPU else [150])
def test_decode_split_kv(Sk, dtype):
    """One query against a long KV cache: split-KV (several programs per head) and the combine kernel."""
    B, H, D = 1, 2, HEAD_DIMS[-1] if ON_GPU else 32
    # a split needs >= 2 x SPLIT_MIN_KEYS and SPLIT_FROM_KEYS keys on the GPU (2 blocks on CPU)
    long_kv = Sk >= (max(2 * A.SPLIT_MIN_KEYS, A.SPLIT_FROM_KEYS) if ON_GPU else 64)
    assert (A.num_splits(B, H, 1, Sk, D, dtype, False, torch.device(DEVICE)) > 1) == long_kv

    def check(q, k, v, msg, mask=None, **kw):
        """Gems' SDPA (served) against float64, with ATen's own error as the allowance."""
        if mask is not None:
            kw["attn_mask"] = mask
        with served_attention(lambda: F.scaled_dot_product_attention(q, k, v, **kw)), gems_on():
            out = F.scaled_dot_product_attention(q, k, v, **kw)
        ref = ref_attention(*(t.cpu().double() for t in (q, k, v)), mask=mask.cpu() if mask is not None else None,
                            causal=kw.get("is_causal", False))
        aten = F.scaled_dot_product_attention(q, k, v, **kw) if dtype != torch.float32 else None
        assert_close(out, ref, dtype, aten, atol=ATOL[dtype], msg=msg)

    check(*qkv(B, H, H, 1, Sk, D, dtype), "decode")
    # GQA decode (the group's heads packed into one program per KV head), with a padding mask and a
    # few query rows (speculative decoding), split and not; causal (top-left: rows see keys <= row)
    decode_cases = ((2, 4, 2, 3, "bool_pad", False, ON_GPU), (1, 8, 2, 1, None, False, True),
                    (1, 4, 1, 5, "add_head", False, True), (1, 4, 2, 3, None, True, False),
                    (1, 4, 4, 1, "add_head", False, False))    # one query: a per-head bias read as one row
    for B, Hq, Hk, Sq, mkind, causal, split in decode_cases:
        if split and long_kv:
            assert A.num_splits(B, Hq, Sq, Sk, D, dtype, causal, torch.device(DEVICE), Hkv=Hk) > 1
        check(*qkv(B, Hq, Hk, Sq, Sk, D, dtype), f"decode gqa {B, Hq, Hk, Sq, mkind, causal}",
              mask=make_mask(mkind, B, Hq, Sq, Sk, dtype), enable_gqa=True, is_causal=causal)
    # a head dim that is not a power of two (the combine's masked columns)
    D2 = 80 if ON_GPU else 24
    check(*qkv(1, 2, 2, 1, Sk, D2, dtype), f"decode head dim {D2}")


@dtype_params()
def test_decode_does_not_depend_on_the_cache_capacity(dtype):
    """A static-cache decode step over the same keys gives the same bits whatever the cache's capacity
    (the masked slots past the keys): a graph captured on a larger cache then replays what eager decode
    computes. Keys per tile chosen from the capacity broke it (a batch-32 decode over 144 keys against
    a 192-key cache summed the softmax in another order); the interpreter's decode tile is set to 32
    keys here so that 48 slots are a whole number of half tiles, as 192 are of 64-key ones on a GPU."""
    D = 128 if ON_GPU else 32
    B, H = (8, 32) if ON_GPU else (2, 2)           # rows >= the SMs (132; the interpreter's 4)
    L, small, big = (140, 144, 192) if ON_GPU else (40, 48, 64)
    bd = max(16, 1 << (D - 1).bit_length())
    ieee = dtype == torch.float32
    if not ON_GPU:
        A.set_config("decode", bd, ieee, (16, 32, 1, 1))
    try:
        q, k, v = qkv(B, H, H, 1, big, D, dtype)
        outs = []
        for cap in (small, big):
            kc, vc = torch.zeros_like(k[:, :, :cap]), torch.zeros_like(v[:, :, :cap])
            kc[:, :, :L], vc[:, :, :L] = k[:, :, :L], v[:, :, :L]
            mask = torch.zeros(B, 1, 1, cap, dtype=torch.bool, device=q.device)
            mask[..., :L] = True
            with served_attention(lambda: F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask)), gems_on():
                outs.append(F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask))
    finally:
        if not ON_GPU:
            A.set_config("decode", bd, ieee, None)
    assert torch.equal(outs[0], outs[1]), (outs[0] - outs[1]).abs().max()
    ref = ref_attention(*(t[:, :, :L].cpu().double() if t is not q else t.cpu().double() for t in (q, k, v)))
    assert_close(outs[1], ref, dtype, None, atol=ATOL[dtype], msg="decode over a padded cache")


def test_split_decode_replays_its_plan(monkeypatch):
    """A split-KV decode (its workspaces of partial outputs, maxima and sums, and the combine launch)
    replays from the call plan: three calls of one signature with fresh data, only the first through the
    Python path, each against float64."""
    D, Sk = (128, 1021) if ON_GPU else (32, 163)     # a signature no other test plans
    dtype = DTYPES[-1]
    q, k, v = qkv(1, 2, 2, 1, Sk, D, dtype)
    assert A.num_splits(1, 2, 1, Sk, D, dtype, False, torch.device(DEVICE)) > 1
    name = aten_choice(lambda: F.scaled_dot_product_attention(q, k, v))
    if name is None:
        pytest.skip("ATen runs SDPA's math path for this input here")
    entered, forward = [], A.forward
    monkeypatch.setattr(A, "forward", lambda *a, **kw: entered.append(1) or forward(*a, **kw))
    impl = gems.registry.get(name)
    for i in range(3):
        q, k, v = qkv(1, 2, 2, 1, Sk, D, dtype)
        with torch.no_grad(), gems_on():
            out = F.scaled_dot_product_attention(q, k, v)
        ref = ref_attention(*(t.cpu().double() for t in (q, k, v)))
        aten = F.scaled_dot_product_attention(q, k, v) if dtype != torch.float32 else None
        assert_close(out, ref, dtype, aten, atol=ATOL[dtype], msg=f"call {i}")
    assert len(entered) == 1, f"the Python path ran {len(entered)} times: {gems.dispatch.op_runtime(impl.name).plans.reasons}"


def test_fully_masked_rows_match_aten():
    """A row with no visible key: ATen's own answer for the overload it picks (0 on CPU, efficient,
    flash; cuDNN's bool conversion uses -65504, i.e. uniform attention) -- same values as ATen."""
    dtype = DTYPES[-1] if ON_GPU else torch.float32
    B, H, Sq, Sk, D = 2, 2, 12, 20, HEAD_DIMS[0]
    q, k, v = qkv(B, H, H, Sq, Sk, D, dtype)
    for mask in (torch.ones(B, 1, Sq, Sk, dtype=torch.bool), torch.zeros(B, 1, Sq, Sk, dtype=dtype)):
        if mask.dtype == torch.bool:
            mask[:, :, 3] = False
            mask[1, :, 7] = False
        else:
            mask[:, :, 3] = float("-inf")
            mask[1, :, 7] = float("-inf")
        mask = mask.to(DEVICE)
        fn = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # noqa: E731
        with served_attention(fn), gems_on():
            out = fn()
        aten = fn()
        assert torch.equal(torch.isnan(out), torch.isnan(aten))
        torch.testing.assert_close(out, aten, atol=ATOL[dtype] * 2, rtol=2e-2 if dtype != torch.float32 else 1e-5,
                                   equal_nan=True)
        assert (out[:, :, 3] == 0).all() or not (aten[:, :, 3] == 0).all()


def test_dropout_falls_back_with_reason_where_no_state_reaches_the_backward():
    # the flash overloads (CUDA's and the CPU one) carry no Philox state Gems can use to its backward:
    # dropout there goes to ATen, counted; cuDNN's and the efficient kernel's are served (tests below)
    q, k, v = qkv(1, 2, 2, 16, 16, HEAD_DIMS[0], DTYPES[-1] if ON_GPU else torch.float32)
    name = "_scaled_dot_product_flash_attention" if ON_GPU else "_scaled_dot_product_flash_attention_for_cpu"
    impl = gems.registry.get(name)
    before = gems.dispatch.op_runtime(impl.name).all_reasons().get("dropout", 0)
    with gems_on():
        try:
            if ON_GPU:
                torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.2)
            else:
                torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.2)
        except RuntimeError:
            pass    # ATen's own answer to the call (whatever it is) is what the user gets
    assert gems.dispatch.op_runtime(impl.name).all_reasons().get("dropout", 0) == before + 1
    with gems_on():
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    assert y.shape == q.shape


@pytest.mark.parametrize("direction", ["gems_fwd_aten_bwd", "aten_fwd_gems_bwd"])
def test_mixed_forward_backward(direction):
    """ATen's backward accepts Gems' forward outputs (out, logsumexp layout) and the other way round:
    a backward run outside the use_gems scope of its forward."""
    dtype = DTYPES[-1] if ON_GPU else torch.float32
    B, Hq, Hk, S, D = 1, 4, 2 if not ON_GPU else 4, 29, HEAD_DIMS[0]
    q, k, v = qkv(B, Hq, Hk, S, S, D, dtype, requires_grad=True)
    g = make((B, Hq, S, D), dtype)
    kw = dict(is_causal=True, enable_gqa=Hq != Hk)
    fwd_ctx = gems_on() if direction == "gems_fwd_aten_bwd" else contextlib.nullcontext()
    bwd_ctx = gems_on() if direction == "aten_fwd_gems_bwd" else contextlib.nullcontext()
    with served_attention(lambda: F.scaled_dot_product_attention(q, k, v, **kw)) if direction.startswith("gems") \
            else contextlib.nullcontext():
        with fwd_ctx:
            out = F.scaled_dot_product_attention(q, k, v, **kw)
    with bwd_ctx:
        got = torch.autograd.grad(out, (q, k, v), g)
    r = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    ref = ref_attention(*r, causal=True)
    refg = torch.autograd.grad(ref, r, g.cpu().double())
    aten = None
    if dtype != torch.float32:
        aout = F.scaled_dot_product_attention(q, k, v, **kw)
        aten = list(torch.autograd.grad(aout, (q, k, v), g))
    assert_close(list(got), list(refg), dtype, aten, atol=ATOL[dtype], rtol=1e-5 if dtype == torch.float32 else None,
                 msg=direction)


# The CUDA overloads' wrappers run on CPU tensors too (through the interpreter): their output
# contracts (shapes, strides, dtypes of ATen's meta functions) and values are checked here on every
# machine; on the GPU the same wrappers are reached through SDPA above.
def _meta(op, *args, **kw):
    def m(a):
        return a.to("meta") if isinstance(a, torch.Tensor) else a
    return op(*[m(a) for a in args], **{k: m(v) for k, v in kw.items()})


@pytest.mark.parametrize("which", ["cudnn", "flash", "efficient"])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_cuda_overload_contracts(which, layout):
    dtype = torch.float32
    B, H, Sq, Sk, D = 2, 2, 21, 27, 32
    if layout == "bshd":    # HF's layout: [B, S, H, D] transposed to [B, H, S, D]
        q, k, v = (make((B, s, H, D), dtype).transpose(1, 2) for s in (Sq, Sk, Sk))
    else:
        q, k, v = qkv(B, H, H, Sq, Sk, D, dtype)
    bias = make_mask("add_pad", B, H, Sq, Sk, dtype) if which != "flash" else None
    scale = 0.3
    if which == "cudnn":
        op, fwd, bwd = torch.ops.aten._scaled_dot_product_cudnn_attention, AO.sdpa_cudnn, AO.sdpa_cudnn_backward
        args = (q, k, v, bias, True, 0.0, False, False)
    elif which == "flash":
        op, fwd, bwd = torch.ops.aten._scaled_dot_product_flash_attention, AO.sdpa_flash, AO.sdpa_flash_backward
        args = (q, k, v, 0.0, False, False)
    else:
        op, fwd, bwd = (torch.ops.aten._scaled_dot_product_efficient_attention, AO.sdpa_efficient,
                        AO.sdpa_efficient_backward)
        args = (q, k, v, bias, True, 0.0, False)
    res = fwd(*args, scale=scale)
    meta = _meta(op, *args, scale=scale)
    assert len(res) == len(meta)
    for i, (a, b) in enumerate(zip(res, meta)):
        if isinstance(b, torch.Tensor) and i < 2:
            assert a.shape == b.shape and a.dtype == b.dtype, (which, i, a.shape, b.shape)
            assert a.stride() == b.stride(), (which, i, a.stride(), b.stride())
        elif isinstance(b, int):
            assert a == b
        elif b is None:
            assert a is None
    out, lse = res[0], res[1]
    rq, rk, rv = (t.double().requires_grad_() for t in (q, k, v))
    ref = ref_attention(rq, rk, rv, mask=bias, scale=scale)
    assert_close(out, ref, dtype, None, rtol=1e-4, atol=1e-4, msg=which)
    s = (rq @ rk.transpose(-1, -2) * scale + (bias.double() if bias is not None else 0)).detach()
    want_lse = torch.logsumexp(s, -1)
    got_lse = lse.reshape(B, H, -1)[:, :, :Sq]
    fin = torch.isfinite(want_lse)
    assert (got_lse.double()[fin] - want_lse[fin]).abs().max() < 1e-4
    g = make(out.shape, dtype)
    refg = torch.autograd.grad(ref, (rq, rk, rv), g.double())
    if which == "cudnn":
        grads = bwd(g, q, k, v, out, lse, res[6], res[7], bias, None, None, Sq, Sk, 0.0, False, scale=scale)
    elif which == "flash":
        grads = bwd(g, q, k, v, out, lse, None, None, Sq, Sk, 0.0, False, res[6], res[7], scale=scale)
    else:
        grads = bwd(g, q, k, v, bias, out, lse, res[2], res[3], 0.0, [True, True, True, False], False, scale=scale)
        assert grads[3] is None
    assert_close(list(grads[:3]), list(refg), dtype, None, rtol=1e-4, atol=1e-4, msg=which + " grads")
    for gr, t in zip(grads[:3], (q, k, v)):
        assert gr.shape == t.shape and gr.dtype == t.dtype


@pytest.mark.parametrize("which", ["cudnn", "efficient"])
def test_inference_forward_leaves_the_logsumexp_out(monkeypatch, which):
    """compute_log_sumexp=False (SDPA without grad): the same output, the kernel asked for no lse, and the
    lse result as ATen's kernel gives it (test_results_are_shaped_as_atens_kernel_returns_them checks that
    on a GPU): none from cuDNN (an undefined tensor), [B, H, 0] from the efficient kernel."""
    q, k, v = qkv(1, 2, 2, 19, 33, 32, torch.float32)
    asked, forward = [], A.forward
    monkeypatch.setattr(A, "forward", lambda *a, **kw: asked.append(a[7]) or forward(*a, **kw))
    fwd = AO.sdpa_cudnn if which == "cudnn" else AO.sdpa_efficient
    with_lse, without = fwd(q, k, v, None, True, 0.0, True), fwd(q, k, v, None, False, 0.0, True)
    assert asked[0] is not None and asked[1] is None
    assert torch.equal(with_lse[0], without[0])
    assert with_lse[1] is not None
    if which == "cudnn":
        assert without[1] is None
    else:
        assert tuple(without[1].shape) == (1, 2, 0)


@pytest.mark.skipif(not ON_GPU, reason="ATen's fused CUDA kernels are the reference")
@pytest.mark.parametrize("which,lse", [("cudnn", True), ("cudnn", False), ("efficient", True),
                                      ("efficient", False), ("flash", True)])
def test_results_are_shaped_as_atens_kernel_returns_them(which, lse):
    """Every result of a fused forward overload as ATen's own CUDA kernel returns it: None where ATen's is
    undefined, a tensor where ATen's is one, the output and logsumexp of the same shape and dtype (values:
    the other tests). Not the meta kernels: cuDNN's gives the logsumexp a shape where its kernel returns
    none, which gems-coverage parity caught on an H200."""
    q, k, v = qkv(1, 2, 2, 40, 40, 64, torch.bfloat16)
    op = getattr(torch.ops.aten, f"_scaled_dot_product_{which}_attention")
    if which == "flash":
        fwd, args = AO.sdpa_flash, (q, k, v, 0.0, True, False)
    else:
        fwd = AO.sdpa_cudnn if which == "cudnn" else AO.sdpa_efficient
        args = (q, k, v, None, lse, 0.0, True) + ((False,) if which == "cudnn" else ())
    with gems.use_gems(include=[]):
        try:
            ref = op(*args)
        except RuntimeError as e:    # not available on this GPU / build
            pytest.skip(f"ATen's {which} kernel: {e}")
    got = fwd(*args)
    assert len(got) == len(ref)
    for i, (g, r) in enumerate(zip(got, ref)):
        if isinstance(g, torch.Tensor) or isinstance(r, torch.Tensor) or g is None or r is None:
            assert (g is None) == (r is None), (which, lse, i, g, r)
            if i < 2 and r is not None:
                assert g.shape == r.shape and g.dtype == r.dtype, (which, lse, i, g.shape, r.shape)


def test_unsupported_inputs_fall_back():
    """Head dim > 256 and a value head dim different from the query's go to ATen, counted."""
    name = "_scaled_dot_product_flash_attention_for_cpu" if not ON_GPU else None
    if name is None:
        pytest.skip("CPU overload; on CUDA SDPA does not pick a fused kernel for these")
    impl = gems.registry.get(name)
    q = make((1, 1, 4, 272), torch.float32)
    with gems_on():
        y = F.scaled_dot_product_attention(q, q, q)
    assert gems.dispatch.op_runtime(impl.name).all_reasons().get("head dim > 256", 0) >= 1
    assert_close(y, ref_attention(*(q.double(),) * 3), torch.float32)
    q = make((1, 2, 8, 16), torch.float32)
    with gems_on():
        y = F.scaled_dot_product_attention(q, q, q, scale=-0.5)
    assert gems.dispatch.op_runtime(impl.name).all_reasons().get("scale <= 0 or not finite", 0) >= 1
    assert_close(y, ref_attention(*(q.double(),) * 3, scale=-0.5), torch.float32)


def test_operands_past_32_bit_offsets_go_to_aten():
    # positions x strides are 32-bit in the kernels: an operand addressing 2**31 elements or more must be
    # refused (Unsupported -> ATen), not wrap. Meta tensors: the sizes are real, no memory is allocated.
    from gems.registry import Unsupported

    def meta(shape, strides):
        return torch.empty_strided(shape, strides, dtype=torch.bfloat16, device="meta")
    # Q as a view of a fused [B, S, 3, H, D] QKV projection, seen as [B, H, S, D]: (S - 1) x 3HD >= 2**31
    # while Q itself (and O) holds under 2**31 elements
    S, H, D = 174764, 32, 128
    q = meta((1, H, S, D), (S * 3 * H * D, D, 3 * H * D, 1))
    assert q.numel() < 2**31
    kv = meta((1, H, 128, D), (128 * H * D, 128 * D, D, 1))
    with pytest.raises(Unsupported, match=r"2\*\*31"):
        A.validate(q, kv, kv, None, 0.0)
    # a full [Sq, Sk] mask of 46341 x 46341 with small Q/K/V strides
    n = 46341
    q = meta((1, 1, n, 64), (n * 64, n * 64, 64, 1))
    mask = meta((1, 1, n, n), (n * n, n * n, n, 1)).bool()
    with pytest.raises(Unsupported, match=r"2\*\*31"):
        A.validate(q, q, q, mask, 0.0)
    # just under: accepted
    q = meta((1, 1, 4096, 64), (4096 * 64, 4096 * 64, 64, 1))
    assert A.validate(q, q, q, meta((1, 1, 4096, 4096), (0, 0, 4096, 1)), 0.0) == (1, 1, 1, 4096, 4096, 64)
    A._offsets_fit(meta((2**15, 2**16 - 1), (2**16 - 1, 1)))


@pytest.mark.skipif(not ON_GPU, reason="the CUDA overloads have no CPU kernel (their wrappers are checked above)")
@pytest.mark.parametrize("sdp", ["CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"])
@pytest.mark.parametrize("case", ["causal_ragged", "gqa_causal", "bool_pad", "big_causal", "causal_sq<sk"])
def test_each_cuda_backend(sdp, case):
    """Each fused CUDA overload, forced with sdpa_kernel: Gems serves it, forward and backward."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = getattr(SDPBackend, sdp)

    def ctx():
        return sdpa_kernel([backend])
    B, Hq, Hk, Sq, Sk, causal, mkind, scale = CASES[case]
    q, k, v = qkv(B, Hq, Hk, Sq, Sk, 128, torch.bfloat16)
    mask = make_mask(mkind, B, Hq, Sq, Sk, torch.bfloat16)
    try:
        with ctx():
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=Hq != Hk)
    except RuntimeError as e:
        pytest.skip(f"ATen cannot run {sdp} for {case} here: {str(e).splitlines()[0][:100]}")
    _run(case, 128, torch.bfloat16, grads=True, ctx=ctx)


def test_attention_is_served_by_default_and_is_a_group():
    """Plain use_gems()/enable() serve the fused overload SDPA picks; the group's name leaves all of it to
    ATen through exclude= (bit-identical to Gems off)."""
    q, k, v = qkv(1, 2, 2, 16, 16, HEAD_DIMS[0], DTYPES[-1] if ON_GPU else torch.float32)
    fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    name = aten_choice(fn)
    impl = gems.registry.get(name)
    assert impl.group == "attention"
    assert "attention" in gems.registry.groups()
    before = gems.dispatch.op_runtime(impl.name).served
    with gems.use_gems(exclude=("attention",)):
        out = fn()
    assert gems.dispatch.op_runtime(impl.name).served == before
    assert torch.equal(out, fn())
    with served_attention(fn), gems.use_gems():
        fn()


def test_forward_kind_and_gluon_config_rules():
    # decode first, then causal, dropout, a bias read as tiles; a plain (or BIAS_ROW) forward: fwd
    assert A._fwd_kind(False, False, False) == "fwd"
    assert [A._fwd_kind(False, True, False, False), A._fwd_kind(False, False, True, False),
            A._fwd_kind(False, False, False, True), A._fwd_kind(True, True, True, True),
            A._fwd_kind(False, True, True, True), A._fwd_kind(False, False, True, True)] == \
        ["fwd_causal", "fwd_bias", "fwd_dropout", "decode", "fwd_causal", "fwd_dropout"]
    # the Gluon forward: short keys take the loop without overlap, in key blocks of 64 when every tile has
    # its own program; long keys the overlapped loop
    from gems.ops.attention import gluon_fwd as AG
    assert AG.config(128, AG.SHORT_KEYS) == AG._SHORT[128]
    assert AG.config(128, AG.SHORT_KEYS, one_round=True) == AG._ONE_ROUND_SHORT[128]
    assert AG.config(128, AG.SHORT_KEYS + 1) == AG._CONFIGS[128]
    assert AG.config(128, AG.SHORT_KEYS + 1, one_round=True) == AG._CONFIGS[128]


def test_bias_row_is_chosen_only_where_every_row_of_a_block_shares_the_bias():
    # BIAS_ROW reads one bias vector per key block instead of a [BLOCK_M, BLOCK_N] tile; both paths are
    # run by the cases above (bool_pad/add_pad: rows share; bool_full/add_head: they do not)
    pad = make_mask("bool_pad", 2, 3, 9, 9, torch.float16).expand(2, 3, 9, 9)
    head = make_mask("add_head", 2, 3, 9, 9, torch.float16).expand(2, 3, 9, 9)
    assert A._bias_row(True, pad.stride(), 9)
    assert not A._bias_row(True, head.stride(), 9)
    assert A._bias_row(True, head[:, :, :1].stride(), 1)              # one query
    assert not A._bias_row(True, head[:, :, :1].stride(), 1, pack=True)   # GQA packing: rows are heads
    assert A._bias_row(True, pad[:, :, :1].stride(), 1, pack=True)
    assert not A._bias_row(False, pad.stride(), 9)


# ---------------------------------------------------------------------------------------------------
# dropout (cuDNN's and the efficient kernel's overloads carry Philox state from forward to backward):
# the same contract as ATen's -- statistics, not bits. The mask is recovered from the kernel itself
# (V = identity makes the output the dropped attention matrix), then the forward and all gradients
# with real V and the same seed are checked against float64 math with that explicit mask.

def _seeded(seed):
    torch.manual_seed(seed)     # CPU and CUDA generators (the CUDA Philox offset restarts at 0)


def _dropout_forward(q, k, v, mask, causal, p, seed):
    _seeded(seed)
    out, lse, _, _, _, _, state, offset, _ = AO.sdpa_cudnn(q, k, v, mask, True, p, causal)
    return out, lse, state, offset


DROPOUT_CASES = {
    "plain": (2, 2, 2, 40, False, None),
    "causal_gqa": (1, 4, 2, 37, True, None),
    "pad_mask": (2, 2, 2, 33, False, "bool_pad"),
}


@pytest.mark.parametrize("bits", [True, False], ids=["stored", "regenerated"])
@pytest.mark.parametrize("case", list(DROPOUT_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_dropout_forward_backward_match_math_with_the_kernels_mask(case, dtype, bits, monkeypatch):
    """The backward's mask is the forward's, whether it reads the forward's bits or runs Philox again."""
    monkeypatch.setattr(A, "DROPOUT_BITS", bits)
    _check_dropout(case, dtype)


# key blocks of 32, 64 and 128 in the forward (a stored word's half, whole words, two words per row
# pair) read back by backward blocks of other widths; the default test configs use 16 and 32
WIDE_BLOCKS = {"fwd_dropout": (32, 64), "fwd_causal": (16, 128), "dkdv": (32, 128), "dq": (16, 32)}


@pytest.mark.parametrize("wide", [dict(WIDE_BLOCKS), {**WIDE_BLOCKS, "fwd_dropout": (16, 32), "dkdv": (16, 64)}],
                         ids=["fwd64", "fwd32"])
@pytest.mark.parametrize("case", list(DROPOUT_CASES))
def test_dropout_stored_mask_across_block_widths(case, wide):
    try:
        for kind, (bm, bn) in wide.items():
            A.set_config(kind, 64, False, (bm, bn, 4, 2))
        _check_dropout(case, torch.float16)
    finally:
        for kind in wide:
            A.set_config(kind, 64, False, None)


def _check_dropout(case, dtype):
    B, Hq, Hk, S, causal, mkind = DROPOUT_CASES[case]
    D, p, seed = 64, 0.3, 1234
    mask = make_mask(mkind, B, Hq, S, S, dtype)
    q, k, v = qkv(B, Hq, Hk, S, S, D, dtype)
    # the kernel's mask: with V = I (D >= S) the output is P * Z / (1 - p)
    eye = torch.zeros(B, Hk, S, D, dtype=dtype)
    eye[:, :, torch.arange(S), torch.arange(S)] = 1
    eye = eye.to(DEVICE)
    dropped, _, _, _ = _dropout_forward(q, k, eye, mask, causal, p, seed)
    r = [t.detach().cpu().double() for t in (q, k, v)]
    probs = ref_attention(*r[:2], torch.eye(S, dtype=torch.float64).expand(B, Hk, S, S).contiguous(),
                          mask=mask.cpu() if mask is not None else None, causal=causal)
    live = probs > 1e-6                                   # entries P > 0: where Z is observable
    Z = (dropped[..., :S].detach().cpu().double() != 0)
    assert not (Z & ~live).any(), "a score P = 0 came out non-zero"
    frac = Z[live].double().mean().item()
    assert abs(frac - (1 - p)) < 0.04, f"kept {frac:.3f} of the entries, expected {1 - p}"
    # the forward with real V and the same seed uses the same mask
    out, lse, state, offset = _dropout_forward(q, k, v, mask, causal, p, seed)
    words = B * Hq * math.ceil(S / 16) * 8 * 4 if A.DROPOUT_BITS else 0   # 32 bytes per query pair (rows padded to 16) and 128 keys
    assert state.shape == (2 + words,) and state.dtype == torch.int64 and offset.shape == ()
    assert_close(dropped[..., :S], (probs * Z / (1 - p)).to(torch.float64), dtype, atol=ATOL[dtype],
                 msg="dropped probabilities")
    rq, rk, rv = (t.clone().requires_grad_() for t in r)
    kr, vr = rk.repeat_interleave(Hq // Hk, 1), rv.repeat_interleave(Hq // Hk, 1)
    s = rq @ kr.transpose(-1, -2) / math.sqrt(D)
    if causal:
        s = s.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask.cpu(), float("-inf"))
    ref = (torch.softmax(s, -1) * Z / (1 - p)) @ vr
    assert_close(out, ref, dtype, atol=ATOL[dtype], msg="dropout forward")
    g = make((B, Hq, S, D), dtype)
    ref.backward(g.cpu().double())
    dq, dk, dv = AO.sdpa_cudnn_backward(g, q, k, v, out, lse, state, offset, mask, None, None, S, S, p, causal)
    for name, got, want in (("dq", dq, rq.grad), ("dk", dk, rk.grad), ("dv", dv, rv.grad)):
        assert_close(got, want, dtype, atol=10 * ATOL[dtype], msg=f"dropout {name}")


def test_dropout_masks_differ_per_call_and_repeat_per_seed():
    q, k, v = qkv(1, 2, 2, 32, 32, 32, torch.float32)
    a = _dropout_forward(q, k, v, None, False, 0.5, 7)[0]
    b = _dropout_forward(q, k, v, None, False, 0.5, 7)[0]
    c = _dropout_forward(q, k, v, None, False, 0.5, 8)[0]
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)
    # p = 1 drops everything: zeros, as ATen's math
    z = _dropout_forward(q, k, v, None, False, 1.0, 7)[0]
    assert torch.count_nonzero(z) == 0


def test_dropout_backward_refuses_another_forwards_state():
    # ATen's own Philox state (cuDNN returns shape (1,), the efficient kernel ()) cannot regenerate Gems'
    # mask: such a backward goes to ATen instead of returning gradients of another mask
    q, k, v = qkv(1, 2, 2, 16, 16, 32, torch.float32)
    out, lse, state, offset = _dropout_forward(q, k, v, None, False, 0.2, 3)
    # nor can a state holding another shape's mask bits
    assert state.shape == (2 + 1 * 2 * 8 * 4,)    # [seed, offset], 32 bytes per query pair of <= 128 keys
    for bad in (torch.zeros(1, dtype=torch.int64, device=DEVICE), torch.zeros((), dtype=torch.int64, device=DEVICE),
                torch.zeros(state.shape[0] + 2, dtype=torch.int64, device=DEVICE)):
        with pytest.raises(gems.Unsupported, match="dropout state"):
            AO.sdpa_cudnn_backward(out, q, k, v, out, lse, bad, offset, None, None, None, 16, 16, 0.2, False)
    # and overloads without a state to carry (flash, the CPU kernel) leave dropout to ATen
    with pytest.raises(gems.Unsupported, match="dropout"):
        A.validate(q, k, v, None, 0.2)


@pytest.mark.skipif(not ON_GPU, reason="SDPA takes its math path for dropout on the CPU")
def test_sdpa_with_dropout_is_served_on_the_gpu():
    B, H, S, D, p = 2, 4, 128, 64, 0.25
    q, k, v = qkv(B, H, H, S, S, D, torch.bfloat16, requires_grad=True)
    fn = lambda: F.scaled_dot_product_attention(q, k, v, dropout_p=p)  # noqa: E731
    with served_attention(fn, backward=True), gems_on():
        out = fn()
        out.backward(torch.randn_like(out))
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all() and torch.isfinite(v.grad).all()
    # V = I: the dropped attention matrix; about 1 - p of it kept
    eye = torch.zeros(B, H, S, S, dtype=torch.bfloat16, device=DEVICE)
    eye[:, :, torch.arange(S), torch.arange(S)] = 1
    with gems_on():
        dropped = F.scaled_dot_product_attention(q.detach(), k.detach(), eye, dropout_p=p)
    frac = (dropped != 0).double().mean().item()
    assert abs(frac - (1 - p)) < 0.02
