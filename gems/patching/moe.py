"""Sparse-MoE blocks of transformers 5.x (written against 5.17) with their experts computed by
`gems.fused.moe_experts`: Mixtral, Qwen3-MoE and OLMoE.

`patch_moe_block(block)` returns a `GemsSparseMoeBlock` holding the block's own router (`gate`) and experts
(`experts`) modules (so Parameters, `state_dict()` keys and the hooks that record router logits are those of
the original), or None when it cannot show that the replacement computes what the block computes. What it
checks, against the transformers classes themselves:
  - the block, its router and its experts are exactly the classes of one family (a subclass may change the
    forward), none with an instance forward, an accelerate hook, or module hooks on the block or the experts
    (they would not run: the experts' forward is not called; the router's are kept, it is called);
  - the experts are the concatenated [gate; up] SwiGLU layout the class declares (`has_gate`, no bias, not
    transposed, `_apply_gate` transformers' default), activation SiLU, an experts implementation whose math
    is the eager loop's (eager, grouped_mm, batched_mm), weights [E, 2I, h] and [E, h, I] with E the
    router's expert count and h its hidden size.
The routing itself (softmax, top-k, `norm_topk_prob`, the weights' dtype) is the router's own forward, run
unchanged; Mixtral's training-time jitter noise is applied as its block does.
"""
from __future__ import annotations

import torch
from torch import nn

from .. import fused as F

# model type -> (module path, block, router, experts class names)
_FAMILIES = {
    "mixtral": ("transformers.models.mixtral.modeling_mixtral",
                "MixtralSparseMoeBlock", "MixtralTopKRouter", "MixtralExperts"),
    "qwen3_moe": ("transformers.models.qwen3_moe.modeling_qwen3_moe",
                  "Qwen3MoeSparseMoeBlock", "Qwen3MoeTopKRouter", "Qwen3MoeExperts"),
    "olmoe": ("transformers.models.olmoe.modeling_olmoe",
              "OlmoeSparseMoeBlock", "OlmoeTopKRouter", "OlmoeExperts"),
}
# experts implementations that compute the eager loop's function (transformers.integrations.moe)
_SAME_MATH = (None, "eager", "grouped_mm", "batched_mm")


class GemsSparseMoeBlock(nn.Module):
    """A transformers sparse-MoE block (Mixtral / Qwen3-MoE / OLMoE) whose experts run as grouped GEMMs.
    Same submodules (`gate`, `experts`) and so the same Parameters; returns what the block returns (the
    hidden states; router logits are recorded from `gate`, which runs as before)."""

    def __init__(self, block, family: str, gemm: str = "triton"):
        super().__init__()
        for name, sub in block._modules.items():     # the block's order: named_parameters() lists the same
            setattr(self, name, sub)
        self.family = family
        self.gemm = gemm
        self.top_k = block.gate.top_k
        self.jitter_noise = getattr(block, "jitter_noise", 0.0) if family == "mixtral" else 0.0
        self.train(block.training)

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        if self.training and self.jitter_noise > 0:
            # Mixtral's block scales its input in place by the same draw
            hidden_states *= torch.empty_like(hidden_states).uniform_(1.0 - self.jitter_noise,
                                                                       1.0 + self.jitter_noise)
        hidden_states = hidden_states.view(-1, hidden_dim)
        _, top_k_weights, top_k_index = self.gate(hidden_states)
        out = F.moe_experts(hidden_states, top_k_index, top_k_weights, self.experts.gate_up_proj,
                            self.experts.down_proj, gemm=self.gemm)
        return out.reshape(batch_size, sequence_length, hidden_dim)

    def extra_repr(self):
        e = self.experts
        return (f"{self.family}, experts={e.gate_up_proj.shape[0]}, top_k={self.top_k}, gems.fused.moe_experts "
                f"(gemm={self.gemm})")


def _classes(family):
    import importlib   # here: importing a transformers model module costs ~0.1 s, paid only by MoE models
    mod = importlib.import_module(_FAMILIES[family][0])
    return tuple(getattr(mod, n, None) for n in _FAMILIES[family][1:])


def _family(block):
    """The family whose block class is exactly type(block) (imports only modules already loaded)."""
    import sys   # here: only the module table is read
    for family, (path, name, *_) in _FAMILIES.items():
        mod = sys.modules.get(path)
        if mod is not None and type(block) is getattr(mod, name, None):
            return family
    return None


def _hooked(m, with_hooks=True):
    d = m.__dict__
    if "forward" in d or "_hf_hook" in d or "_old_forward" in d:
        return True
    return with_hooks and bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
                               or m._backward_pre_hooks)


def _default_gate(experts):
    import importlib   # here: transformers' MoE integration, loaded already by any model that has experts
    default = getattr(importlib.import_module("transformers.integrations.moe"), "_default_apply_gate", None)
    return "_apply_gate" not in experts.__dict__ and getattr(type(experts), "_apply_gate", None) is default


def _silu(act):
    from transformers import activations   # here: `import gems` does not import transformers
    return type(act) in (activations.SiLUActivation, nn.SiLU)


def patch_moe_block(module, gemm: str = "triton") -> nn.Module | None:
    """A `GemsSparseMoeBlock` computing what `module` computes, or None (see the module docstring); gemm:
    moe_experts' GEMM choice."""
    family = _family(module)
    if family is None:
        return None
    _, router_cls, experts_cls = _classes(family)
    if set(module._modules) != {"gate", "experts"} or module._parameters or module._buffers:
        return None
    gate, experts = module.gate, module.experts
    if type(gate) is not router_cls or type(experts) is not experts_cls:
        return None
    if _hooked(module) or _hooked(experts) or _hooked(gate, with_hooks=False):
        return None
    if not (getattr(experts, "has_gate", True) is True and getattr(experts, "has_bias", False) is False
            and getattr(experts, "is_transposed", False) is False
            and getattr(experts, "is_concatenated", True) is True and _default_gate(experts)):
        return None
    if not _silu(getattr(experts, "act_fn", None)):
        return None
    cfg = getattr(experts, "config", None)
    if getattr(cfg, "_experts_implementation", None) not in _SAME_MATH:
        return None
    gu, down, rw = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None), gate.weight
    if not all(isinstance(p, nn.Parameter) for p in (gu, down, rw)) or gu.dim() != 3 or down.dim() != 3 \
            or rw.dim() != 2:
        return None
    E, two_i, h = gu.shape
    if two_i % 2 or tuple(down.shape) != (E, h, two_i // 2) or tuple(rw.shape) != (E, h) \
            or gate.num_experts != E or gate.hidden_dim != h:
        return None
    if not (isinstance(gate.top_k, int) and 1 <= gate.top_k <= E):
        return None
    if family == "mixtral" and getattr(module, "top_k", gate.top_k) != gate.top_k:
        return None
    return GemsSparseMoeBlock(module, family, gemm)
