"""The attention of a graphed model's decode steps: Gems' attention kernel called with the cache's keys
and values as they are.

transformers' `sdpa` attention, on a decode step over a static cache, adds launches per layer that do
no attention: the step's mask is not None (it masks the cache's unwritten positions), so
`sdpa_attention_forward` repeats the keys and values of a grouped-query model (`repeat_kv`: two copies
of the whole cache per layer, and attention then reads the group's keys `groups` times), and
`F.scaled_dot_product_attention` turns the bool mask into a float one per layer (two fills and a
`where`). Gems' attention kernel reads a bool mask as it is and indexes a query head's key head as
h // groups, so one launch (two where the keys are split over programs) does the layer's attention.

`graphed` registers this function with transformers under the name NAME (with `sdpa_mask`, the
masks of `sdpa`) and gives it to the model's text config in place of `sdpa`; `ungraphed` puts `sdpa`
back. Steps of at most DECODE_QUERIES queries with a mask (or a single query) take Gems' kernel;
everything else (prefill, gradients, dropout, a position bias, a device Gems does not launch on,
shapes the kernel leaves to ATen) runs transformers' `sdpa_attention_forward` unchanged.
Differences from SDPA: none in what is computed, except a query row whose mask hides every key: it
gives 0 (ATen's CPU answer; on CUDA SDPA gives NaN, or through cuDNN an average of every value). A
decode step of `generate` never has such a row: the new token always sees itself.
"""
from __future__ import annotations

import torch

from ..fused import library
from ..ops.attention.sdpa import attend
from ..registry import Unsupported

NAME = "gems_decode_sdpa"
DECODE_QUERIES = 16    # the attention kernel's decode form (GQA groups packed per program) goes this far


def decode_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                     **kwargs):
    """transformers' attention-interface signature; returns (output [B, Sq, Hq, D], None)."""
    sq = query.shape[2] if query.dim() == 4 else 0
    mask_ok = attention_mask is None or attention_mask.dtype in (torch.bool, query.dtype)   # as SDPA accepts
    if (0 < sq <= DECODE_QUERIES and (attention_mask is not None or sq == 1) and mask_ok and not dropout
            and kwargs.get("position_bias") is None and query.device.type == library.device_type()
            and not (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad))
            and not torch.compiler.is_compiling()):
        try:
            out = attend(query, key, value, attention_mask, scaling)
        except Unsupported:
            pass
        else:
            return out.transpose(1, 2).contiguous(), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward  # optional dependency
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


_registered = False


def install(model):
    """Give the model's text config NAME in place of `sdpa` (registering NAME with transformers once);
    returns a function that puts the old implementation back, or None when the model does not use sdpa."""
    global _registered
    from transformers import AttentionInterface    # optional dependency: imported once a model is graphed
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    config = model.config.get_text_config(decoder=True)
    if getattr(config, "_attn_implementation_internal", None) != "sdpa":
        return None
    if not _registered:
        AttentionInterface.register(NAME, decode_attention)
        AttentionMaskInterface.register(NAME, sdpa_mask)
        _registered = True
    config._attn_implementation_internal = NAME

    def restore():
        if config._attn_implementation_internal == NAME:     # unless the user chose another since
            config._attn_implementation_internal = "sdpa"
    return restore
