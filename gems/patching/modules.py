"""The replacements `gems.patch` puts into a model: modules holding the original Parameters, and forwards
set on instances, each computing what the transformers 5.17 class computes through `gems.fused`.

`gems.fused` is read as a module attribute at call time (``F.rms_norm``), so what the package binds
when the patched model runs is what runs (tests bind stand-ins there).
"""
from __future__ import annotations

import inspect
import sys
import types

import torch
from torch import nn

from .. import fused as F
from .probes import proves_partial_rope, prove_rope


class GemsRMSNorm(nn.Module):
    """RMSNorm through `gems.fused.rms_norm`, holding the replaced module's own weight Parameter."""

    def __init__(self, weight: nn.Parameter, eps: float, casting: str = "llama", offset: float = 0.0):
        super().__init__()
        self.weight = weight
        self.variance_epsilon = eps
        self.casting = casting
        self.offset = offset

    def forward(self, hidden_states):
        return F.rms_norm(hidden_states, self.weight, self.variance_epsilon, offset=self.offset,
                          casting=self.casting)

    def extra_repr(self):
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, gems.fused"


class GemsLayerNorm(nn.Module):
    """nn.LayerNorm over the last dimension through `gems.fused.layer_norm`, with the same Parameters."""

    def __init__(self, ln: nn.LayerNorm):
        super().__init__()
        self.normalized_shape = ln.normalized_shape
        self.eps = ln.eps
        self.elementwise_affine = True
        self.weight = ln.weight
        self.bias = ln.bias

    def forward(self, x):
        return F.layer_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self):
        return f"{self.normalized_shape}, eps={self.eps}, gems.fused"


# ---------------------------------------------------------------------------------------- forwards
def _norm_args(norm):
    """(weight, eps, rms keyword arguments) of an original or replaced RMSNorm."""
    if isinstance(norm, GemsRMSNorm):
        return norm.weight, norm.variance_epsilon, {"offset": norm.offset, "casting": norm.casting}
    return norm.weight, norm.variance_epsilon, {"offset": 0.0, "casting": "llama"}


def _add_norm_layer(self, hidden_states, **attn_kwargs):
    """A pre-norm decoder layer's body with the residual add and the post-attention RMSNorm in one
    `add_rms_norm`; attn_kwargs go to self_attn as the layer's own forward passes them."""
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(hidden_states=hidden_states, **attn_kwargs)
    w, eps, kw = _norm_args(self.post_attention_layernorm)
    hidden_states, residual = F.add_rms_norm(hidden_states, residual, w, eps, **kw)
    return mlp_plus_residual(self.mlp, hidden_states, residual)


# rows up to which the MLP's closing residual add goes into the down projection's GEMM: decode steps
# (a GEMM over so few rows streams the weight; reading the residual in its epilogue costs nothing)
ADD_IN_GEMM_MAX_ROWS = 32


def mlp_plus_residual(mlp, x, residual):
    """residual + mlp(x). For a decode step of a patched gated MLP without autograd, the add is the
    down projection's GEMM epilogue (addmm: one launch less per layer, the sum rounded once instead of
    twice); otherwise as the layer's own code computes it."""
    act = getattr(getattr(mlp.forward, "__func__", None), "gated_input", None)
    down = getattr(mlp, "down_proj", None)
    if (act is None or type(down) is not nn.Linear or down.bias is not None or torch.is_grad_enabled()
            or residual.numel() > ADD_IN_GEMM_MAX_ROWS * residual.shape[-1] or residual.dtype != down.weight.dtype
            or _hooked(mlp) or _hooked(down) or torch.is_autocast_enabled(residual.device.type)):
        return residual + mlp(x)
    h = act(mlp, x)
    n = residual.shape[-1]
    return torch.addmm(residual.reshape(-1, n), h.reshape(-1, h.shape[-1]), down.weight.t()).view(residual.shape)


def _hooked(m) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks or nn.modules.module._global_forward_hooks
                or nn.modules.module._global_forward_pre_hooks)


def decoder_layer_forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                          use_cache=False, position_embeddings=None, **kwargs):
    """Llama/Mistral/Qwen2 decoder layer (transformers 5.17) with the residual add and the post-attention
    RMSNorm in one `add_rms_norm`."""
    return _add_norm_layer(self, hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                           past_key_values=past_key_values, use_cache=use_cache,
                           position_embeddings=position_embeddings, **kwargs)


def moe_decoder_layer_forward(self, hidden_states, position_embeddings=None, attention_mask=None, position_ids=None,
                              past_key_values=None, **kwargs):
    """Mixtral's decoder layer (transformers 5.17; its argument order, no use_cache) with the residual add
    and the post-attention RMSNorm in one `add_rms_norm`."""
    return _add_norm_layer(self, hidden_states, position_embeddings=position_embeddings,
                           attention_mask=attention_mask, position_ids=position_ids,
                           past_key_values=past_key_values, **kwargs)


def _add_layer_norm(ln, x, residual):
    """(ln(x + residual), x + residual), the add and the norm in one `add_layer_norm` where that computes
    the same: x and residual of one dtype, autocast off (autocast runs LayerNorm in fp32, and x + residual
    of two dtypes promotes); else the add and the module as before."""
    if x.dtype == residual.dtype and not torch.is_autocast_enabled(x.device.type):
        return F.add_layer_norm(x, residual, ln.weight, ln.bias, ln.eps)
    s = x + residual
    return ln(s), s


def clip_layer_forward(self, hidden_states, attention_mask, **kwargs):
    """CLIP encoder layer (transformers 5.17) with the residual add and layer_norm2 in one `add_layer_norm`."""
    residual = hidden_states
    hidden_states = self.layer_norm1(hidden_states)
    hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask, **kwargs)
    hidden_states, residual = _add_layer_norm(self.layer_norm2, hidden_states, residual)
    hidden_states = self.mlp(hidden_states)
    return residual + hidden_states


def gpt2_block_forward(self, hidden_states, past_key_values=None, attention_mask=None, encoder_hidden_states=None,
                       encoder_attention_mask=None, use_cache=False, **kwargs):
    """GPT-2 block (transformers 5.17) with the attention's residual add and ln_2 in one `add_layer_norm`;
    a call with cross-attention (encoder_hidden_states) runs the class's own forward."""
    if encoder_hidden_states is not None:
        return type(self).forward(self, hidden_states, past_key_values, attention_mask, encoder_hidden_states,
                                  encoder_attention_mask, use_cache, **kwargs)
    residual = hidden_states
    hidden_states = self.ln_1(hidden_states)
    attn_output, _ = self.attn(hidden_states, past_key_values=past_key_values, attention_mask=attention_mask,
                               use_cache=use_cache, **kwargs)
    hidden_states, residual = _add_layer_norm(self.ln_2, attn_output, residual)
    return residual + self.mlp(hidden_states)


def bert_output_forward(self, hidden_states, input_tensor):
    """BertSelfOutput / BertOutput: dropout exactly as before (a no-op in eval or at p=0), then the residual
    add and LayerNorm in one `add_layer_norm`."""
    hidden_states = self.dropout(self.dense(hidden_states))
    return _add_layer_norm(self.LayerNorm, hidden_states, input_tensor)[0]


def _gated_mlp(gated_input):
    """A gated MLP's forward, down_proj(gated_input(self, x)); the down projection's input stays reachable
    as the forward's `gated_input` (mlp_plus_residual)."""
    def forward(self, x):
        return self.down_proj(gated_input(self, x))
    forward.gated_input = gated_input
    forward.__name__ = forward.__qualname__ = gated_input.__name__.strip("_").replace("_input", "_mlp_forward")
    return forward


def _silu_input(self, x):
    return F.silu_and_mul(self.gate_proj(x), self.up_proj(x))


def _gelu_input(self, x):
    return F.gelu_and_mul(self.gate_proj(x), self.up_proj(x), approximate="none")


def _gelu_tanh_input(self, x):
    return F.gelu_and_mul(self.gate_proj(x), self.up_proj(x), approximate="tanh")


# a fused gate_up_proj (Phi-3, GLM4): [gate; up] along the last dim; the halves are row-strided views,
# which the gated kernels read in place
def _silu_gate_up_input(self, x):
    gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
    return F.silu_and_mul(gate, up)


def _gelu_gate_up_input(self, x):
    gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
    return F.gelu_and_mul(gate, up, approximate="none")


def _gelu_tanh_gate_up_input(self, x):
    gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
    return F.gelu_and_mul(gate, up, approximate="tanh")


silu_mlp_forward = _gated_mlp(_silu_input)
gelu_mlp_forward = _gated_mlp(_gelu_input)
gelu_tanh_mlp_forward = _gated_mlp(_gelu_tanh_input)
silu_gate_up_forward = _gated_mlp(_silu_gate_up_input)
gelu_gate_up_forward = _gated_mlp(_gelu_gate_up_input)
gelu_tanh_gate_up_forward = _gated_mlp(_gelu_tanh_gate_up_input)


# (form, activation kind) -> (forward, fused op), the form and kind as gems/patching/probes.py proves them
MLP_FORWARDS = {
    ("split", "silu"): (silu_mlp_forward, "silu_and_mul"),
    ("split", "gelu"): (gelu_mlp_forward, "gelu_and_mul"),
    ("split", "gelu_tanh"): (gelu_tanh_mlp_forward, "gelu_and_mul"),
    ("fused", "silu"): (silu_gate_up_forward, "silu_and_mul"),
    ("fused", "gelu"): (gelu_gate_up_forward, "gelu_and_mul"),
    ("fused", "gelu_tanh"): (gelu_tanh_gate_up_forward, "gelu_and_mul"),
}


# composite activation modules (GPT-2's gelu_new) -> the one torch operator they compute, which
# gems.enable() serves with Gems' kernel (forward and backward one pass each)
def silu_forward(self, x):
    return torch.nn.functional.silu(x)


def gelu_forward(self, x):
    return torch.nn.functional.gelu(x)


def gelu_tanh_forward(self, x):
    return torch.nn.functional.gelu(x, approximate="tanh")


ACT_FORWARDS = {"silu": silu_forward, "gelu": gelu_forward, "gelu_tanh": gelu_tanh_forward}


def gems_rope_for(orig, partial: bool = False, interleaved: bool = False):
    """transformers' apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1) through `gems.fused.rope`
    where cos/sin are as wide as the heads (`interleaved`: GLM's pairwise form). Partial rotary (narrower
    cos/sin, GPT-NeoX / Phi-3 / GLM style): with `partial` (orig proven to rotate the first channels and
    pass the rest), the fused op on those channels (strided views, read in place) and the rest
    concatenated as orig does; else orig itself."""

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        d = cos.shape[-1]
        if d == q.shape[-1] and d == k.shape[-1]:
            return F.rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim, interleaved=interleaved)
        if partial and d % 2 == 0 and d < q.shape[-1] and d < k.shape[-1]:
            qe, ke = F.rope(q[..., :d], k[..., :d], cos, sin, unsqueeze_dim=unsqueeze_dim, interleaved=interleaved)
            return torch.cat([qe, q[..., d:]], dim=-1), torch.cat([ke, k[..., d:]], dim=-1)
        return orig(q, k, cos, sin, unsqueeze_dim)
    return apply_rotary_pos_emb


_ROPE_SIGNATURE = ("q", "k", "cos", "sin", "unsqueeze_dim")
_rope_clones: dict = {}   # original attention forward -> (its copy with Gems' rope in its globals, why not)


def _globals_module(fn) -> dict:
    """A copy of fn's globals as the namespace of a module of its own, registered in sys.modules:
    torch.compile reaches an inlined function's globals by the module named in them (`__name__`), so
    the copy must name a module whose namespace it is, or Dynamo's guards would read the original
    module's apply_rotary_pos_emb (and its closure) instead of Gems'."""
    mod = types.ModuleType(f"{fn.__globals__.get('__name__', 'module')}.gems_rope_{len(_rope_clones)}")
    name = mod.__name__
    mod.__dict__.update(fn.__globals__)
    mod.__dict__["__name__"] = name
    sys.modules[name] = mod
    return mod.__dict__


def rope_forward(fn):
    """(a copy of `fn`, an attention forward, whose global `apply_rotary_pos_emb` is Gems', None) or
    (None, why not): `fn` must call a module-global apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)
    that computes the fused op's RoPE (probes.prove_rope). The module's own globals are not touched."""
    if fn in _rope_clones:
        return _rope_clones[fn]
    orig = fn.__globals__.get("apply_rotary_pos_emb")
    if "apply_rotary_pos_emb" not in fn.__code__.co_names or not callable(orig):
        res = (None, "no module-global apply_rotary_pos_emb in its forward")
    else:
        try:
            params = tuple(inspect.signature(orig).parameters)
        except (TypeError, ValueError):
            params = ()
        why = "apply_rotary_pos_emb's signature is not (q, k, cos, sin, unsqueeze_dim)"
        interleaved = False
        if params == _ROPE_SIGNATURE:
            why = prove_rope(orig)
            if why is not None and prove_rope(orig, interleaved=True) is None:
                why, interleaved = None, True     # GLM's pairwise form
        if why is None:
            g = _globals_module(fn)
            g["apply_rotary_pos_emb"] = gems_rope_for(orig, proves_partial_rope(orig, interleaved), interleaved)
            clone = types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__, fn.__closure__)
            clone.__kwdefaults__ = fn.__kwdefaults__
            clone.__qualname__ = fn.__qualname__
            clone.__doc__ = fn.__doc__
            clone.__module__ = fn.__module__
            res = (clone, None)
        else:
            res = (None, why)
    _rope_clones[fn] = res
    return res
