"""gems.decode.attention: the decode steps' attention by Gems' kernel gives what transformers' sdpa
attention gives (GQA without repeating the cache, bool and float masks), leaves everything else to it,
and `graphed` / `ungraphed` install and remove it."""
from __future__ import annotations

import pytest
import torch
from harness import DEVICE
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import gems.decode as D
from gems.decode import attention as A


class Module:
    """What the attention interface reads from the attention module."""
    def __init__(self, groups):
        self.num_key_value_groups = groups
        self.is_causal = True
        self.training = False


def qkv(batch, hq, hkv, sq, sk, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    # q and the new keys come from projections viewed [B, S, H, D] and transposed, as in the models
    q = torch.randn(batch, sq, hq, d, generator=g, dtype=dtype).to(DEVICE).transpose(1, 2)
    k = torch.randn(batch, hkv, sk, d, generator=g, dtype=dtype).to(DEVICE)
    v = torch.randn(batch, hkv, sk, d, generator=g, dtype=dtype).to(DEVICE)
    return q, k, v


def cache_mask(batch, sq, sk, written, dtype=torch.bool):
    """A static cache's decode mask: the first `written` positions visible (causal among the last sq)."""
    keep = torch.zeros(batch, 1, sq, sk, dtype=torch.bool)
    for i in range(sq):
        keep[:, :, i, :written - sq + i + 1] = True
    if dtype == torch.bool:
        return keep.to(DEVICE)
    return torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, float("-inf")).to(DEVICE)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("hq, hkv", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("sq", [1, 3])
@pytest.mark.parametrize("mask_dtype", [torch.bool, "float"])
def test_equals_transformers_sdpa(dtype, tol, hq, hkv, sq, mask_dtype):
    q, k, v = qkv(2, hq, hkv, sq, 40, 32, dtype)
    mask = cache_mask(2, sq, 40, 23, torch.bool if mask_dtype == torch.bool else dtype)
    m = Module(hq // hkv)
    got, w = A.decode_attention(m, q, k, v, mask, scaling=0.2)
    want, _ = sdpa_attention_forward(m, q, k, v, mask, scaling=0.2)
    ref, _ = sdpa_attention_forward(m, q.double(), k.double(), v.double(),
                                    mask if mask.dtype == torch.bool else mask.double(), scaling=0.2)
    assert w is None and got.shape == want.shape == (2, sq, hq, 32) and got.is_contiguous()
    # against float64: Gems' error no larger than ATen's own (plus the dtype's tolerance)
    err, aten_err = (got.double() - ref).abs().max(), (want.double() - ref).abs().max()
    assert err <= 2 * aten_err + tol, (err, aten_err)


def test_kernel_serves_decode_and_the_rest_goes_to_transformers(monkeypatch):
    served = []
    monkeypatch.setattr(A, "attend", lambda *a: served.append(a[0].shape[2]) or torch.full_like(a[0], 7.0))
    m = Module(2)
    q, k, v = qkv(1, 4, 2, 1, 16, 16, torch.float32)
    out, _ = A.decode_attention(m, q, k, v, cache_mask(1, 1, 16, 5))
    assert served == [1] and (out == 7.0).all()     # the stub's answer: the kernel path was taken
    served.clear()
    qp, kp, vp = qkv(1, 4, 2, 20, 20, 16, torch.float32)     # a prefill of 20 queries
    A.decode_attention(m, qp, kp, vp, cache_mask(1, 20, 20, 20))
    A.decode_attention(m, q, k, v, cache_mask(1, 1, 16, 5), dropout=0.1)           # dropout
    A.decode_attention(m, q.requires_grad_(), k, v, cache_mask(1, 1, 16, 5))      # gradients
    q3, k3, v3 = qkv(1, 4, 2, 3, 16, 16, torch.float32)
    A.decode_attention(m, q3, k3, v3, None)          # several queries, no mask: sdpa's causal form
    assert served == []


def test_a_float_mask_of_another_dtype_raises_what_sdpa_raises():
    q, k, v = qkv(1, 2, 1, 1, 8, 16, torch.float32)
    mask = cache_mask(1, 1, 8, 4, torch.float64)
    with pytest.raises(RuntimeError) as want:
        sdpa_attention_forward(Module(2), q, k, v, mask)
    with pytest.raises(type(want.value)):
        A.decode_attention(Module(2), q, k, v, mask)


def test_unsupported_inputs_go_to_transformers():
    """A head dim the kernel leaves to ATen (> 256): transformers' sdpa answers."""
    q, k, v = qkv(1, 2, 1, 1, 8, 320, torch.float32)
    mask = cache_mask(1, 1, 8, 4)
    got, _ = A.decode_attention(Module(2), q, k, v, mask)
    want, _ = sdpa_attention_forward(Module(2), q, k, v, mask)
    torch.testing.assert_close(got, want)


def tiny_llama():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).to(DEVICE).eval()


def test_graphed_installs_and_ungraphed_removes_it():
    model = tiny_llama()
    assert model.config._attn_implementation == "sdpa"
    D.graphed(model, max_cache_len=64)
    assert model.config._attn_implementation == A.NAME
    D.ungraphed(model)
    assert model.config._attn_implementation == "sdpa"
    D.graphed(model, max_cache_len=64, decode_attention=False)
    assert model.config._attn_implementation == "sdpa"
    D.ungraphed(model)


def test_a_model_on_eager_attention_is_left_alone():
    model = tiny_llama()
    model.set_attn_implementation("eager")
    D.graphed(model, max_cache_len=64)
    assert model.config._attn_implementation == "eager"
    D.ungraphed(model)
    assert model.config._attn_implementation == "eager"
