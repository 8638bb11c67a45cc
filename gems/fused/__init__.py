"""Fused LLM ops that are not single ATen ops, reached through their own API (docs/design.md,
decision 10).

One file per op family (norms, gated, rotary, cross_entropy_loss, linear_cross_entropy), each in the
same order: the Triton kernels, the launch helpers (`_*_forward` / `_*_backward`), the
`torch.autograd.Function`, the custom operator torch.compile captures (`gems::<name>`, defined with
library.py's helper; docs/torch-compile.md), the public function, and last the plain PyTorch reference
(`<module>.reference_<name>`), so tests compare the two and users can read what it computes
(RMSNorm's kernels live in rms_norm_kernels.py, keeping norms.py readable). While a public function's
kernel compiles in the background, its reference answers the call (deferral.py). No file is named like an
op: importing `gems.fused.<file>` sets that attribute of the package, which would shadow the function.

    import gems.fused as F
    y = F.rms_norm(x, weight, eps)                    # Llama casting rule; offset=1.0 for Gemma
    h, residual = F.add_rms_norm(x, residual, weight, eps)
    a = F.silu_and_mul(gate, up)                      # silu(gate) * up
    q, k = F.rope(q, k, cos, sin)                     # Hugging Face apply_rotary_pos_emb contract
    loss = F.cross_entropy(logits, target)            # ignore_index, label_smoothing, reduction
    loss = F.fused_linear_cross_entropy(hidden, lm_head_weight, target)   # no full logits in memory
    y = F.moe_experts(x, topk_ids, topk_weights, gate_up_proj, down_proj)  # MoE experts, grouped GEMMs

The names resolve lazily (importing `gems` compiles nothing); `gems.patch(model)` swaps them into
Hugging Face models.
"""
import importlib

# public name -> module in this package
_WHERE = {
    "rms_norm": "norms", "add_rms_norm": "norms", "layer_norm": "norms", "add_layer_norm": "norms",
    "silu_and_mul": "gated", "swiglu": "gated", "gelu_and_mul": "gated",
    "rope": "rotary",
    "moe_experts": "moe",
    "cross_entropy": "cross_entropy_loss", "fused_linear_cross_entropy": "linear_cross_entropy",
}

__all__ = sorted(_WHERE)


def __getattr__(name):
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(f"module 'gems.fused' has no attribute {name!r}; fused ops: {', '.join(__all__)}")
    value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
