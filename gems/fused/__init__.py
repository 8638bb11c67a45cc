"""Fused LLM ops that are not single ATen ops, reached through their own API (design decision 10).

Each is a `torch.autograd.Function` over Triton kernels with a plain PyTorch reference beside it
(`<module>.reference_<name>`), so tests compare the two and users can read what it computes.

    import gems.fused as F
    y = F.rms_norm(x, weight, eps)                    # Llama casting rule; offset=1.0 for Gemma
    h, residual = F.add_rms_norm(x, residual, weight, eps)
    a = F.silu_and_mul(gate, up)                      # silu(gate) * up
    q, k = F.rope(q, k, cos, sin)                     # Hugging Face apply_rotary_pos_emb contract
    loss = F.cross_entropy(logits, target)            # ignore_index, label_smoothing, reduction
    loss = F.fused_linear_cross_entropy(hidden, lm_head_weight, target)   # no full logits in memory

The names resolve lazily (importing `gems` compiles nothing); `gems.patch(model)` swaps them into
Hugging Face models.
"""
import importlib

# public name -> module in this package
_WHERE = {
    "rms_norm": "norms", "add_rms_norm": "norms", "layer_norm": "norms", "add_layer_norm": "norms",
    "silu_and_mul": "gated", "swiglu": "gated", "gelu_and_mul": "gated",
    "rope": "rotary",
    "cross_entropy": "loss", "fused_linear_cross_entropy": "loss",
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
