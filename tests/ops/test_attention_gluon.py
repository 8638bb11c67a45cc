"""The warp-specialized Gluon attention forward and backward (gems/ops/attention/gluon_fwd.py,
gluon_bwd.py), reached through SDPA.

Gluon has no interpreter: these tests run on a Hopper GPU only (the CPU suite compiles every config for
sm_90 in tests/core/test_gpu_compile.py). Reference: SDPA's math in float64; outputs by the
flash-attention rule (error <= 2x ATen's own bf16/fp16 error + atol), the logsumexp against float64.
Gradients against float64 autograd by the same rule. Each test asserts the Gluon kernel ran (its `launch` entered), so none passes on the Triton kernel.
"""
import math

import pytest
import torch
import torch.nn.functional as F

import gems
from gems.ops.attention import gluon_fwd as G
from gems.ops.attention import gluon_bwd as GB
from harness import DEVICE, ON_GPU, assert_close, check_descriptor_plan, make

hopper = pytest.mark.skipif(not ON_GPU or not torch.cuda.is_available()
                            or torch.cuda.get_device_capability()[0] != 9,
                            reason="the Gluon attention kernel runs on Hopper GPUs only")

ATOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def qkv(B, Hq, Hk, Sq, Sk, D, dtype, layout, requires_grad=False):
    """Q, K, V as [B, H, S, D] views; 'bshd': Hugging Face's memory order (heads inside the sequence)."""
    def one(H, S):
        if layout == "bshd":
            t = make((B, S, H, D), dtype, low=-2.0, high=2.0).transpose(1, 2)
        else:
            t = make((B, H, S, D), dtype, low=-2.0, high=2.0)
        return t.detach().requires_grad_(requires_grad)
    return one(Hq, Sq), one(Hk, Sk), one(Hk, Sk)


def reference(q, k, v, causal, scale):
    """(out, logsumexp) in float64 on the CPU: GQA by repeated heads, top-left causal."""
    q, k, v = (t.detach().cpu().double() for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def _counting(monkeypatch, module):
    calls, launch = [], module.launch
    monkeypatch.setattr(module, "launch", lambda *a, **k: calls.append(1) or launch(*a, **k))
    return calls


@pytest.fixture
def entered(monkeypatch):
    """Counts calls of gluon_fwd.launch."""
    return _counting(monkeypatch, G)


@pytest.fixture
def entered_bwd(monkeypatch):
    """Counts calls of gluon_bwd.launch."""
    return _counting(monkeypatch, GB)


def grads(q, k, v, g, causal):
    """(Gems' grads, float64 grads on the CPU, ATen's grads at q's dtype) of SDPA's output against g."""
    kw = dict(is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
    with gems.use_gems():
        got = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, **kw), (q, k, v), g)
    r = [t.detach().cpu().double().requires_grad_(True) for t in (q, k, v)]
    rep = q.shape[1] // k.shape[1]
    ref = F.scaled_dot_product_attention(r[0], r[1].repeat_interleave(rep, 1), r[2].repeat_interleave(rep, 1),
                                         is_causal=causal)
    refg = torch.autograd.grad(ref, r, g.cpu().double())
    aten = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, **kw), (q, k, v), g)
    return list(got), list(refg), list(aten)


# (B, Hq, Hk, Sq, Sk, causal): ragged lengths (no multiple of 128), Sq != Sk both ways, GQA, one
# tile's rows split across the two consumers (Sq 65-127), a key block shorter than the ring, more
# tiles than SMs (persistent programs walk several)
SHAPES = [(1, 4, 4, 256, 256, True), (2, 4, 4, 1000, 1000, False), (1, 8, 2, 777, 777, True),
          (2, 3, 3, 300, 517, False), (1, 4, 4, 517, 300, True), (1, 4, 4, 200, 1000, True),
          (2, 2, 2, 100, 100, True), (1, 2, 1, 17, 40, False), (1, 32, 4, 512, 512, True),
          (2, 32, 8, 1000, 1000, True)]


def every_layout_and_dtype(shapes):
    """Hopper-only test over `shapes` x both memory orders x both 16-bit dtypes."""
    def mark(test):
        for m in (pytest.mark.parametrize("shape", shapes, ids=[f"{s}" for s in shapes]),
                  pytest.mark.parametrize("layout", ["bhsd", "bshd"]),
                  pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"]), hopper):
            test = m(test)
        return test
    return mark


@every_layout_and_dtype(SHAPES)
def test_forward_matches_float64(shape, layout, dtype, entered):
    B, Hq, Hk, Sq, Sk, causal = shape
    q, k, v = qkv(B, Hq, Hk, Sq, Sk, 128, dtype, layout)
    kw = dict(is_causal=causal, enable_gqa=Hq != Hk)
    with gems.use_gems():
        out = F.scaled_dot_product_attention(q, k, v, **kw)
    assert entered, "the Gluon kernel did not run"
    ref, _ = reference(q, k, v, causal, 1 / math.sqrt(128))
    assert_close(out, ref, dtype, F.scaled_dot_product_attention(q, k, v, **kw), atol=ATOL[dtype], msg=f"{shape}")


CONFIGS = [(128, 2, True, False), (128, 2, True, True), (128, 2, False, True), (64, 3, True, True),
           (64, 4, True, False), (64, 2, False, True)]


@hopper
@pytest.mark.parametrize("cfg", CONFIGS, ids=[f"{c}" for c in CONFIGS])
@pytest.mark.parametrize("shape", [(2, 4, 2, 333, 333, True), (1, 4, 4, 200, 517, False), (1, 4, 4, 200, 517, True),
                                   (4, 16, 4, 700, 700, True)])
def test_every_config_and_the_logsumexp(cfg, shape, entered):
    """Every (BLOCK_N, STAGES, OVERLAP, PERSISTENT) variant, and the logsumexp the backward reads; the last
    shape has 384 tiles, so persistent programs walk several, of different lengths. Causal with key
    blocks of 64, the first warpgroup skips a tile's last block (more keys than queries: every tile)."""
    B, Hq, Hk, Sq, Sk, causal = shape
    q, k, v = qkv(B, Hq, Hk, Sq, Sk, 128, torch.bfloat16, "bshd")
    o = torch.empty_like(q)
    lse = torch.empty((B, Hq, Sq), dtype=torch.float32, device=DEVICE)
    scale = 0.37
    G.set_config(128, cfg)
    try:
        G.launch(q, k, v, o, lse, causal, scale * 1.4426950408889634)
    finally:
        G.set_config(128, None)
    ref, rlse = reference(q, k, v, causal, scale)
    aten = F.scaled_dot_product_attention(q, k.repeat_interleave(Hq // Hk, 1), v.repeat_interleave(Hq // Hk, 1),
                                          is_causal=causal, scale=scale)
    assert_close(o, ref, torch.bfloat16, aten, atol=ATOL[torch.bfloat16], msg=f"{cfg}")
    assert_close(lse, rlse, torch.float32, atol=1e-4, rtol=1e-5, msg=f"lse {cfg}")


@hopper
def test_training_gradients_use_its_logsumexp(entered):
    """A training step: the Gluon forward's output and logsumexp feed Gems' backward kernels."""
    q, k, v = qkv(1, 8, 2, 300, 300, 128, torch.bfloat16, "bshd", requires_grad=True)
    g = make((1, 8, 300, 128), torch.bfloat16)
    kw = dict(is_causal=True, enable_gqa=True)
    with gems.use_gems():
        out = F.scaled_dot_product_attention(q, k, v, **kw)
        got = torch.autograd.grad(out, (q, k, v), g)
    assert entered
    _, refg, ateng = grads(q, k, v, g, True)
    assert_close(list(got), refg, torch.bfloat16, ateng, atol=ATOL[torch.bfloat16], msg="grads")


# (B, Hq, Hk, Sq, Sk, causal): as SHAPES, plus one query row and 16 (the Triton forward's decode kernel
# feeds the Gluon backward), keys never seen by a causal query (Sk > Sq), one key block with two
# programs' worth of GQA heads
BWD_SHAPES = SHAPES + [(1, 4, 4, 1, 300, False), (2, 4, 2, 16, 16, True), (1, 2, 2, 100, 450, True),
                       (1, 16, 1, 130, 130, False)]


@every_layout_and_dtype(BWD_SHAPES)
def test_backward_matches_float64(shape, layout, dtype, entered_bwd):
    B, Hq, Hk, Sq, Sk, causal = shape
    q, k, v = qkv(B, Hq, Hk, Sq, Sk, 128, dtype, layout, requires_grad=True)
    g = make((B, Hq, Sq, 128), dtype)
    got, refg, aten = grads(q, k, v, g, causal)
    assert entered_bwd, "the Gluon backward did not run"
    assert_close(got, refg, dtype, aten, atol=ATOL[dtype], msg=f"{shape}")


@hopper
def test_backward_repeat_calls_replay_a_plan_with_descriptors(entered_bwd):
    """Backward calls of one signature: the Python path once, then the plan with the seven
    descriptors (Q, K, V, dO, lse2, delta and the fp32 dQ accumulator) rebuilt per call, replayed by the
    C++ path. Inside a use_gems() scope, autograd's device thread takes the Python path for the first
    Gems call of each backward (it keys that graph task to the scope), so the C++ replays are checked
    under gems.enable(), as a training loop runs, on one backward holding three calls."""
    name = "_scaled_dot_product_cudnn_attention_backward.default"
    impl = gems.registry.get(name)
    hits = gems.dispatch.op_runtime(impl.name).fast.hits if gems.dispatch.op_runtime(impl.name).fast is not None else 0
    for i in range(3):
        q, k, v = qkv(1, 8, 2, 333, 333, 128, torch.bfloat16, "bshd", requires_grad=True)
        g = make((1, 8, 333, 128), torch.bfloat16)
        got, refg, aten = grads(q, k, v, g, True)
        assert_close(got, refg, torch.bfloat16, aten, atol=ATOL[torch.bfloat16], msg=f"call {i}")
    trips = [qkv(1, 8, 2, 333, 333, 128, torch.bfloat16, "bshd", requires_grad=True) for _ in range(3)]
    g = make((1, 8, 333, 128), torch.bfloat16)
    gems.enable()
    try:
        outs = [F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True) for q, k, v in trips]
        got = torch.autograd.grad(outs, [t for trip in trips for t in trip], [g] * 3)
    finally:
        gems.disable()
    for i, (q, k, v) in enumerate(trips):
        aten = torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                                   (q, k, v), g)
        _, refg, _ = grads(q, k, v, g, True)
        assert_close(list(got[3 * i:3 * i + 3]), refg, torch.bfloat16, list(aten), atol=ATOL[torch.bfloat16],
                     msg=f"one backward, call {i}")
    assert len(entered_bwd) == 1, f"the Python path ran {len(entered_bwd)} times: {gems.dispatch.op_runtime(impl.name).plans.reasons}"
    check_descriptor_plan(impl, hits, descriptors=7)


@hopper
def test_backward_left_to_the_triton_kernels(entered_bwd, monkeypatch):
    """A mask, dropout and head dim 64 take the Triton backward (still Gems'); `enabled = False` too."""
    q, k, v = qkv(1, 2, 2, 200, 200, 128, torch.bfloat16, "bhsd", requires_grad=True)
    q64, k64, v64 = qkv(1, 2, 2, 200, 200, 64, torch.bfloat16, "bhsd", requires_grad=True)
    mask = torch.rand(200, 200, device=DEVICE) > 0.3
    calls = [((q, k, v), dict(attn_mask=mask)), ((q, k, v), dict(dropout_p=0.3, is_causal=True)),
             ((q64, k64, v64), dict(is_causal=True))]
    for i, (inputs, kw) in enumerate(calls):
        with gems.use_gems():
            out = F.scaled_dot_product_attention(*inputs, **kw)
            gs = torch.autograd.grad(out, inputs, torch.ones_like(out))
        assert all(torch.isfinite(t).all() for t in gs), f"call {i}"   # (values: tests/ops/test_attention.py)
    assert not entered_bwd
    monkeypatch.setattr(GB, "enabled", False)
    with gems.use_gems():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert not entered_bwd


@hopper
def test_repeat_calls_replay_a_plan_with_descriptors(entered):
    """Three calls of one signature with fresh data: only the first runs the Python path; the plan
    rebuilds the four descriptors per call, and the C++ fast path replays it (descriptor parameters)."""
    name = "_scaled_dot_product_cudnn_attention.default"
    impl = gems.registry.get(name)
    hits = gems.dispatch.op_runtime(impl.name).fast.hits if gems.dispatch.op_runtime(impl.name).fast is not None else 0
    for i in range(3):
        q, k, v = qkv(2, 4, 4, 384, 384, 128, torch.bfloat16, "bshd")
        with gems.use_gems():
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        ref, _ = reference(q, k, v, True, 1 / math.sqrt(128))
        assert_close(out, ref, torch.bfloat16, F.scaled_dot_product_attention(q, k, v, is_causal=True),
                     atol=ATOL[torch.bfloat16], msg=f"call {i}")
    assert len(entered) == 1, f"the Python path ran {len(entered)} times: {gems.dispatch.op_runtime(impl.name).plans.reasons}"
    check_descriptor_plan(impl, hits, descriptors=4)


@hopper
def test_left_to_the_triton_kernel(entered, monkeypatch):
    """Masks, dropout, decode, head dims other than 128 and a misaligned operand take the Triton kernel
    (still served by Gems, still correct); `enabled = False` sends every call there."""
    q, k, v = qkv(1, 2, 2, 200, 200, 128, torch.bfloat16, "bhsd")
    mask = torch.rand(200, 200, device=DEVICE) > 0.3
    q64, k64, v64 = qkv(1, 2, 2, 200, 200, 64, torch.bfloat16, "bhsd")
    base = make((1, 2, 200 * 128 + 1), torch.bfloat16)
    qm = base[:, :, 1:].view(1, 2, 200, 128)          # 2 bytes off 16-byte alignment
    calls = [lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
             lambda: F.scaled_dot_product_attention(q[:, :, :5], k, v),
             lambda: F.scaled_dot_product_attention(q64, k64, v64, is_causal=True),
             lambda: F.scaled_dot_product_attention(qm, k, v, is_causal=True)]
    fused = [gems.registry.get(n) for n in ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention",
                                            "_scaled_dot_product_efficient_attention")]
    for i, fn in enumerate(calls):
        served = sum(gems.dispatch.op_runtime(f.name).served for f in fused)
        with gems.use_gems():
            out = fn()
        assert sum(gems.dispatch.op_runtime(f.name).served for f in fused) > served, f"call {i} was not served by Gems"
        assert torch.isfinite(out).all()     # (its values: tests/ops/test_attention.py)
    assert not entered
    monkeypatch.setattr(G, "enabled", False)
    with gems.use_gems():
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert not entered


def test_descriptor_conditions():
    """Which operands a TMA descriptor addresses in place (checked per signature, so a plan never
    replays a descriptor over a tensor it cannot address): runs on the CPU too."""
    x = torch.empty(2, 64, 8, 128, dtype=torch.bfloat16)
    assert G._tma_ok(x.transpose(1, 2))                            # Hugging Face's [B, S, H, D]
    assert G._tma_ok(torch.empty(2, 8, 64, 128, dtype=torch.float16))
    flat = torch.empty(2 * 8 * 64 * 128 + 8, dtype=torch.bfloat16)
    assert G._tma_ok(flat[8:].view(2, 8, 64, 128)) == (flat[8:].data_ptr() % 16 == 0)
    assert not G._tma_ok(flat[1:1 + 2 * 8 * 64 * 128].view(2, 8, 64, 128))   # base 2 bytes off
    assert not G._tma_ok(torch.empty(2, 8, 64, 130, dtype=torch.bfloat16)[..., :128])   # row stride 260 bytes
    assert not G._tma_ok(torch.empty(2, 1, 64, 128, dtype=torch.bfloat16).expand(2, 8, 64, 128))  # stride 0
    assert not G._tma_ok(torch.empty(2, 8, 128, 64, dtype=torch.bfloat16).transpose(2, 3))    # head dim strided


def test_backward_group_split():
    """How many programs share a KV head's query heads in the Gluon backward (each then adds dK/dV into
    fp32 sums): one while that gives two programs per SM, else the smallest divisor of the group that
    does, else the whole group. Runs on the CPU too."""
    assert GB.group_split(512, 4, 132) == 1              # MHA-sized grids keep dK/dV in one program
    assert GB.group_split(264, 4, 132) == 1              # exactly two per SM
    assert GB.group_split(263, 4, 132) == 2
    assert GB.group_split(64, 8, 132) == 8               # GQA 32/4 at 2048 tokens: 16 key blocks x 4 KV heads
    assert GB.group_split(100, 6, 132) == 3              # 2 is a divisor but 200 < 264
    assert GB.group_split(10, 6, 132) == 6               # never enough: every head its own program
