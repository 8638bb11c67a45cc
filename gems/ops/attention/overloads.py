"""The ATen overloads behind `F.scaled_dot_product_attention` that Gems serves: the CPU one (the
interpreter backend) and the cuDNN, flash and efficient ones on CUDA, each keeping ATen's output
contract. What they share (validation, kernel choice, the forward and backward launches, the dropout
state) is in sdpa.py, whose docstring describes the whole.
"""
import torch

from ...registry import FLOATS, Unsupported, register
from ...runtime.utils import cdiv, empty
from . import sdpa


# ---------------------------------------------------------------------------------------------------
# CPU (interpreter backend): the overload SDPA picks on CPU

@register("_scaled_dot_product_flash_attention_for_cpu", category="other", dtypes=FLOATS,
          backends=("interpreter",),
          group="attention")
def sdpa_flash_cpu(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    """Fused attention forward (SDPA on CPU): causal, masks, GQA, online softmax."""
    B, Hq, Hkv, Sq, Sk, D = sdpa.validate(query, key, value, attn_mask, dropout_p)
    if is_causal and attn_mask is not None:
        raise Unsupported("is_causal with attn_mask")
    out = sdpa.alloc_like(query.shape, query)
    lse = sdpa.alloc_permuted((B, Hq, Sq), (0, 2, 1), torch.float32, query.device)
    sdpa.forward(query, key, value, attn_mask, bool(is_causal), sdpa.softmax_scale(query, scale), out, lse)
    return out, lse


@register("_scaled_dot_product_flash_attention_for_cpu_backward", category="other", dtypes=FLOATS, backward=True,
          backends=("interpreter",),
          group="attention")
def sdpa_flash_cpu_backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None,
                            scale=None):
    """Fused attention backward (dQ, dK, dV; deterministic, no atomics)."""
    sdpa.validate(query, key, value, attn_mask, dropout_p)
    if is_causal and attn_mask is not None:
        raise Unsupported("is_causal with attn_mask")
    if logsumexp.dtype != torch.float32:
        raise Unsupported("logsumexp dtype")
    dq, dk, dv = sdpa.grads_like(query, key, value, (0, 2, 1, 3))
    sdpa.backward(grad_out, query, key, value, out, logsumexp, attn_mask, bool(is_causal),
                  sdpa.softmax_scale(query, scale), dq, dk, dv)
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------------
# CUDA: the three fused overloads SDPA may pick

def _seed_offset_for(q, Sk, dropout_p):
    """(philox_seed, philox_offset) outputs: with dropout, the state tensor (filled by the forward
    kernel: [seed, offset] and the mask's bits) and a view of its offset; without, empty placeholders."""
    if dropout_p > 0.0:
        B, Hq, Sq, D = q.shape
        state = sdpa.new_dropout_state(q.device, sdpa.dropout_bits_words(B, Hq, Sq, Sk, D))
        return state, state[1]
    return _seed_offset(q.device)


def _seed_offset(device, dtype=torch.int64, seed_shape=()):
    # philox state: never read (dropout is not served, and with dropout_p = 0 no backward reads it);
    # empty rather than zeros: no fill kernels per call
    return empty(seed_shape, dtype, device), empty((), dtype, device)


@register("_scaled_dot_product_cudnn_attention", category="other", dtypes=FLOATS, backends=("cuda",),
          group="attention")
def sdpa_cudnn(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False,
               return_debug_mask=False, *, scale=None):
    """Fused attention forward in place of cuDNN's (SDPA's choice on H100/H200 with torch 2.11); dropout too."""
    B, Hq, Hkv, Sq, Sk, D = sdpa.validate(query, key, value, attn_bias, dropout_p, allow_dropout=True)
    if return_debug_mask:
        raise Unsupported("debug mask")
    out = sdpa.alloc_like((B, Hq, Sq, D), query)
    # cuDNN computes the logsumexp only when asked (training: SDPA asks when an input requires grad) and
    # otherwise returns none (an undefined tensor: None here; the meta kernel's [B, H, S, 1] is only a
    # shape), and so does Gems: inference skips the store in every tile's epilogue
    lse = empty((B, Hq, Sq, 1), torch.float32, query.device) if compute_log_sumexp else None
    seed, offset = _seed_offset_for(query, Sk, dropout_p)
    sdpa.forward(query, key, value, attn_bias, bool(is_causal), sdpa.softmax_scale(query, scale), out,
                 None if lse is None else lse[..., 0], dropout_p, seed)
    return out, lse, None, None, Sq, Sk, seed, offset, None


@register("_scaled_dot_product_cudnn_attention_backward", category="other", dtypes=FLOATS, backward=True,
          backends=("cuda",),
          group="attention")
def sdpa_cudnn_backward(grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset, attn_bias,
                        cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, *, scale=None):
    """Fused attention backward in place of cuDNN's."""
    B, Hq, Hkv, Sq, Sk, D = sdpa.validate(query, key, value, attn_bias, dropout_p, allow_dropout=True)
    if cum_seq_q is not None and cum_seq_q.numel() or cum_seq_k is not None and cum_seq_k.numel():
        raise Unsupported("varlen")
    lse = logsumexp.reshape(B, Hq, Sq) if logsumexp.dim() == 4 else logsumexp
    if lse.dtype != torch.float32 or tuple(lse.shape) != (B, Hq, Sq):
        raise Unsupported("logsumexp layout")
    state = sdpa.dropout_state(philox_seed, query, key) if dropout_p > 0.0 else None
    dq, dk, dv = sdpa.grads_like(query, key, value)
    sdpa.backward(grad_out, query, key, value, out, lse, attn_bias, bool(is_causal), sdpa.softmax_scale(query, scale),
                  dq, dk, dv, dropout_p, state)
    return dq, dk, dv


@register("_scaled_dot_product_flash_attention", category="other", dtypes=FLOATS, backends=("cuda",),
          group="attention")
def sdpa_flash(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    """Fused attention forward in place of FlashAttention's."""
    B, Hq, Hkv, Sq, Sk, D = sdpa.validate(query, key, value, None, dropout_p)
    if return_debug_mask:
        raise Unsupported("debug mask")
    out = sdpa.alloc_like((B, Hq, Sq, D), query)
    lse = empty((B, Hq, Sq), torch.float32, query.device)
    sdpa.forward(query, key, value, None, bool(is_causal), sdpa.softmax_scale(query, scale), out, lse)
    rng, unused = _seed_offset(query.device, torch.uint64, (2,))
    return out, lse, None, None, Sq, Sk, rng, unused, empty((0,), query.dtype, query.device)


@register("_scaled_dot_product_flash_attention_backward", category="other", dtypes=FLOATS, backward=True,
          backends=("cuda",),
          group="attention")
def sdpa_flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                        is_causal, philox_seed, philox_offset, *, scale=None):
    """Fused attention backward in place of FlashAttention's."""
    B, Hq, Hkv, Sq, Sk, D = sdpa.validate(query, key, value, None, dropout_p)
    if cum_seq_q is not None and cum_seq_q.numel() or cum_seq_k is not None and cum_seq_k.numel():
        raise Unsupported("varlen")
    if logsumexp.dtype != torch.float32 or tuple(logsumexp.shape) != (B, Hq, Sq):
        raise Unsupported("logsumexp layout")
    dq, dk, dv = sdpa.grads_like(query, key, value)
    sdpa.backward(grad_out, query, key, value, out, logsumexp, None, bool(is_causal), sdpa.softmax_scale(query, scale),
                  dq, dk, dv)
    return dq, dk, dv


@register("_scaled_dot_product_efficient_attention", category="other", dtypes=FLOATS, backends=("cuda",),
          group="attention")
def sdpa_efficient(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None):
    """Fused attention forward in place of the memory-efficient kernel's (masks, fp32); dropout too."""
    B, Hq, Hkv, Sq, Sk, D = sdpa.validate(query, key, value, attn_bias, dropout_p, allow_dropout=True)
    out = sdpa.alloc_permuted((B, Hq, Sq, D), (0, 2, 1, 3), query.dtype, query.device)
    lse = empty((B, Hq, cdiv(Sq, 32) * 32 if compute_log_sumexp else 0), torch.float32, query.device)
    seed, offset = _seed_offset_for(query, Sk, dropout_p)
    sdpa.forward(query, key, value, attn_bias, bool(is_causal), sdpa.softmax_scale(query, scale), out,
                 lse[:, :, :Sq] if compute_log_sumexp else None, dropout_p, seed)
    return out, lse, seed, offset


@register("_scaled_dot_product_efficient_attention_backward", category="other", dtypes=FLOATS, backward=True,
          backends=("cuda",),
          group="attention")
def sdpa_efficient_backward(grad_out_, query, key, value, attn_bias, out, logsumexp, philox_seed, philox_offset,
                            dropout_p, grad_input_mask, is_causal=False, *, scale=None):
    """Fused attention backward in place of the memory-efficient kernel's."""
    B, Hq, Hkv, Sq, Sk, D = sdpa.validate(query, key, value, attn_bias, dropout_p, allow_dropout=True)
    if attn_bias is not None and len(grad_input_mask) > 3 and grad_input_mask[3]:
        raise Unsupported("attn_bias gradient")
    if logsumexp.dtype != torch.float32 or logsumexp.dim() != 3 or logsumexp.shape[2] < Sq:
        raise Unsupported("logsumexp layout")
    state = sdpa.dropout_state(philox_seed, query, key) if dropout_p > 0.0 else None
    dq, dk, dv = sdpa.grads_like(query, key, value)
    sdpa.backward(grad_out_, query, key, value, out, logsumexp[:, :, :Sq], attn_bias, bool(is_causal),
                  sdpa.softmax_scale(query, scale), dq, dk, dv, dropout_p, state)
    return dq, dk, dv, None
