"""gems.fused.rope against HF's apply_rotary_pos_emb computed in float64 (forward and gradients)."""
import pytest
import torch

from harness import DEVICE, DTYPES, FLOAT_IDS, assert_close, make

from gems.fused import rotary
from gems.runtime.plan import NO_PLAN
from gems.fused.rotary import reference_rope, rope


def _inputs(B, HQ, HKV, S, D, dtype, ud=1, hf_view=True, cos_batch=None):
    """q/k like HF's projections: [B, S, H, D] viewed and transposed to [B, H, S, D] (ud=1)."""
    if ud == 1 and hf_view:
        q = make((B, S, HQ * D), dtype).view(B, S, HQ, D).transpose(1, 2)
        k = make((B, S, HKV * D), dtype).view(B, S, HKV, D).transpose(1, 2)
    elif ud == 1:
        q, k = make((B, HQ, S, D), dtype), make((B, HKV, S, D), dtype)
    else:
        q, k = make((B, S, HQ, D), dtype), make((B, S, HKV, D), dtype)
    cb = B if cos_batch is None else cos_batch
    # HF: cos/sin = cat(freqs, freqs).cos() in q's dtype; random values here (halves differ) test more
    cos = make((cb, S, D), dtype, low=-1, high=1)
    sin = make((cb, S, D), dtype, low=-1, high=1)
    return q, k, cos, sin


def _check(q, k, cos, sin, dtype, ud=1, interleaved=False):
    qg, kg = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
    # the same strides as the originals (clone keeps dense layouts; rebuild views if not dense)
    if qg.stride() != q.stride():
        qg = torch.empty_strided(q.shape, q.stride(), dtype=q.dtype, device=q.device).copy_(q).requires_grad_()
        kg = torch.empty_strided(k.shape, k.stride(), dtype=k.dtype, device=k.device).copy_(k).requires_grad_()
    out = rope(qg, kg, cos, sin, unsqueeze_dim=ud, interleaved=interleaved)
    assert out[0].dtype == dtype and out[1].dtype == dtype
    assert out[0].shape == q.shape and out[1].shape == k.shape
    r64 = [t.detach().cpu().double().requires_grad_() for t in (q, k)]
    ref = reference_rope(r64[0], r64[1], cos.cpu().double(), sin.cpu().double(), unsqueeze_dim=ud,
                         interleaved=interleaved)
    low = reference_rope(q, k, cos, sin, unsqueeze_dim=ud, interleaved=interleaved) if dtype != torch.float32 else None
    assert_close(out, ref, dtype, low, msg="rope")
    gq, gk = make(q.shape, dtype), make(k.shape, dtype)
    got = torch.autograd.grad(out, (qg, kg), (gq, gk))
    want = torch.autograd.grad(ref, r64, (gq.cpu().double(), gk.cpu().double()))
    aten = None
    if dtype != torch.float32:
        ql, kl = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
        aten = torch.autograd.grad(reference_rope(ql, kl, cos, sin, unsqueeze_dim=ud, interleaved=interleaved),
                                   (ql, kl), (gq, gk))
    assert_close(got, want, dtype, aten, msg="rope grad")
    return out, got


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: FLOAT_IDS[d])
@pytest.mark.parametrize("D", [64, 80])
@pytest.mark.parametrize("S", [1, 7])
def test_rope_gqa_hf_views(dtype, D, S):
    q, k, cos, sin = _inputs(2, 4, 2, S, D, dtype)
    assert S == 1 or not q.is_contiguous()
    out, grads = _check(q, k, cos, sin, dtype)
    assert out[0].stride() == q.stride()      # q's layout kept (the transpose back to [B, S, H*D] is free)
    assert grads[0].stride() == q.stride()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: FLOAT_IDS[d])
def test_rope_unsqueeze_dim_2(dtype):
    q, k, cos, sin = _inputs(2, 4, 2, 5, 64, dtype, ud=2)
    _check(q, k, cos, sin, dtype, ud=2)


@pytest.mark.parametrize("D", [96, 128])
def test_rope_head_dims_cos_batch_1(D):
    q, k, cos, sin = _inputs(3, 4, 4, 3, D, torch.float32, hf_view=False, cos_batch=1)
    _check(q, k, cos, sin, torch.float32)


def test_rope_strided_non_dense_and_expanded_cos():
    # q a slice of a fused qkv projection (not dense), k contiguous; cos an expanded [B, S, D]
    B, S, H, D = 2, 3, 4, 64
    qkv = make((B, S, 3 * H * D))
    q = qkv[..., : H * D].view(B, S, H, D).transpose(1, 2)
    k = make((B, H, S, D))
    cos = make((1, S, D), low=-1, high=1).expand(B, S, D)
    sin = make((B, S, D), low=-1, high=1)
    out, _ = _check(q, k, cos, sin, torch.float32)
    assert out[0].is_contiguous()


def test_rope_matches_transformers():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    q, k, cos, sin = _inputs(1, 4, 2, 6, 64, torch.float32)
    got = rope(q, k, cos, sin, position_ids=torch.arange(6)[None])
    want = apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(got, want, rtol=1.3e-6, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: FLOAT_IDS[d])
@pytest.mark.parametrize("D", [64, 80])
def test_rope_interleaved(dtype, D):
    # GLM's pairs (2j, 2j + 1) by cos[..., j]: HF views with grouped-query heads, both layouts
    _check(*_inputs(2, 4, 2, 5, D, dtype), dtype, interleaved=True)
    _check(*_inputs(1, 3, 1, 4, D, dtype, ud=2), dtype, ud=2, interleaved=True)
    # the second halves of cos/sin are not read: GLM's function ignores them
    q, k, cos, sin = _inputs(1, 2, 2, 3, D, torch.float32, hf_view=False)
    a = rope(q, k, cos, sin, interleaved=True)
    cos[..., D // 2:], sin[..., D // 2:] = 7.0, -7.0
    b = rope(q, k, cos, sin, interleaved=True)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_rope_interleaved_matches_transformers():
    from transformers.models.glm4.modeling_glm4 import apply_rotary_pos_emb
    q, k, cos, sin = _inputs(2, 4, 2, 6, 64, torch.float32, cos_batch=1)
    got = rope(q, k, cos, sin, interleaved=True)
    want = apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(got, want, rtol=1.3e-6, atol=1e-5)
    # gradients for cos/sin: through the reference
    cos.requires_grad_()
    g = torch.autograd.grad(rope(q, k, cos, sin, interleaved=True)[0].sum(), cos)
    c2 = cos.detach().clone().requires_grad_()
    w = torch.autograd.grad(apply_rotary_pos_emb(q, k, c2, sin)[0].sum(), c2)
    torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_rope_cos_sin_grad_fallback():
    q, k, cos, sin = _inputs(2, 2, 2, 3, 64, torch.float32, hf_view=False, cos_batch=1)
    cos.requires_grad_()
    sin.requires_grad_()
    out = rope(q, k, cos, sin)
    g = torch.autograd.grad(out[0].sum() + 2 * out[1].sum(), (cos, sin))
    c2, s2 = cos.detach().clone().requires_grad_(), sin.detach().clone().requires_grad_()
    ref = reference_rope(q, k, c2, s2)
    w = torch.autograd.grad(ref[0].sum() + 2 * ref[1].sum(), (c2, s2))
    torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_rope_bad_inputs():
    q, k, cos, sin = _inputs(1, 2, 2, 3, 64, torch.float32, hf_view=False)
    with pytest.raises(ValueError, match="unsqueeze_dim"):
        rope(q, k, cos, sin, unsqueeze_dim=0)
    with pytest.raises(ValueError, match="partial rotary"):
        rope(q, k, cos[..., :32], sin[..., :32])
    with pytest.raises(ValueError, match="4-D"):
        rope(q[0], k, cos, sin)
    with pytest.raises(TypeError, match="dtype"):
        rope(q.double(), k, cos, sin)
    # float64 q and k (a model moved to float64) run the reference, as the other fused ops
    got = rope(q.double(), k.double(), cos, sin)
    want = reference_rope(q.double(), k.double(), cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(TypeError, match="cos must be a tensor"):
        rope(q.requires_grad_(), k, 1.0, sin)
    q.requires_grad_(False)
    with pytest.raises(ValueError, match="even"):
        rope(q[..., :63], k[..., :63], cos[..., :63], sin[..., :63])


def test_rope_plans_cached():
    """A repeated signature runs its call plan (runtime/planned.py): no new recording, same answer."""
    q, k, cos, sin = _inputs(2, 4, 2, 3, 64, torch.float32)
    with torch.no_grad():
        a = rope(q, k, cos, sin)
        built = rotary._run.cache.built
        p = rotary._run.cache.plans[rotary._run._sig(q, k, cos, sin, 1, False, None, False)]
        assert p is not NO_PLAN and callable(p)      # a plan, not "keep the full path"
        b = rope(q, k, cos, sin)
        assert rotary._run.cache.built == built
    c = rope(q.clone().requires_grad_(), k.clone().requires_grad_(), cos, sin)
    for x, y, z in zip(a, b, c):
        assert torch.equal(x, y) and torch.equal(x, z.detach())
        assert x.stride() == y.stride()
