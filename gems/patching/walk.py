"""The walk over a Hugging Face model that finds what `gems.patch` replaces, by transformers class (per
model type), and replaces it through the report's undo log."""
from __future__ import annotations

import importlib
import inspect
import sys
import types

from torch import nn

from .losses import causal_lm_forward, causal_lm_loss
from .modules import (GemsLayerNorm, GemsRMSNorm, bert_output_forward, clip_layer_forward, decoder_layer_forward,
                      mlp_forward, rope_forward, silu_mlp_forward)
from .report import PatchReport

# model_type -> class-name prefix in its transformers modeling module
DECODERS = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}
ENCODERS = {"bert": "Bert"}
VISION = {"clip_vision_model": "CLIP", "clip": "CLIP"}
TOP = {"llava": "Llava"}


class Patcher:
    """One walk over a model (or a part of it, under a qualified-name prefix): each patch_* method finds
    the modules of one architecture by their transformers class and replaces them, once each
    (`done`), logging every change in the report."""

    def __init__(self, model, opts: dict, report: PatchReport):
        self.model, self.opts, self.r = model, opts, report
        self.done: set = set()     # ids of modules already handled
        self.skipped: list = []    # modules left alone (their own forward or hook)

    # every change is logged in the report, so that gems.unpatch (or a failed patch) puts it back
    def set_module(self, parent, name, new, old):
        parent._modules[name] = new
        self.r.log_module(parent, name, old)

    def set_attr(self, obj, name, value):
        self.r.log_attr(obj, name)
        object.__setattr__(obj, name, value)

    def set_forward(self, mod, fn, name: str) -> bool:
        """Set `fn` as the instance's forward, unless it already has one of its own (False)."""
        if self.foreign(mod, name):
            return False
        self.set_attr(mod, "forward", types.MethodType(fn, mod))
        return True

    def foreign(self, mod, name: str) -> bool:
        """A module with its own instance forward or an accelerate hook (device_map, offloading) is left
        as is: replacing it would drop that wrapper."""
        if "forward" in mod.__dict__ or "_hf_hook" in mod.__dict__:
            self.skipped.append(name or "<model>")
            return True
        return False

    def _cls(self, modeling, name):
        return getattr(modeling, name, None)

    def patch_decoder(self, root, prefix: str, mt: str):
        """Llama-architecture decoder modules under `root` (a *Model, *ForCausalLM or Llava's language model)."""
        modeling = _modeling(mt)
        P = DECODERS[mt]
        norm_cls, layer_cls = self._cls(modeling, f"{P}RMSNorm"), self._cls(modeling, f"{P}DecoderLayer")
        mlp_cls, attn_cls = self._cls(modeling, f"{P}MLP"), self._cls(modeling, f"{P}Attention")
        o = self.opts
        for name, mod in list(root.named_modules(prefix=prefix)):
            if id(mod) in self.done:
                continue
            if o["rms_norm"] and layer_cls is not None and type(mod) is layer_cls:
                if _signature(layer_cls.forward) == _DECODER_LAYER_PARAMS:
                    if self.set_forward(mod, decoder_layer_forward, name):
                        self.r.add("add_rms_norm", name)
                    self.done.add(id(mod))
                else:
                    self.r.notes.append(f"{name}: {layer_cls.__name__}.forward differs from transformers 5.17's; "
                                        f"residual add + norm left unfused")
            elif o["swiglu"] and mlp_cls is not None and type(mod) is mlp_cls:
                fwd = mlp_forward(mod)
                if fwd is None:
                    self.r.notes.append(f"{name}: activation {type(getattr(mod, 'act_fn', None)).__name__} has no "
                                        f"fused gated form; MLP left as is")
                elif self.set_forward(mod, fwd, name):
                    self.r.add("silu_and_mul" if fwd is silu_mlp_forward else "gelu_and_mul", name)
                self.done.add(id(mod))
            elif o["rope"] and attn_cls is not None and type(mod) is attn_cls:
                clone = rope_forward(attn_cls.forward)
                if clone is None:
                    self.r.notes.append(f"{name}: no apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim) in "
                                        f"{attn_cls.__name__}.forward; RoPE left as is")
                elif self.set_forward(mod, clone, name):
                    self.r.add("rope", name)
                self.done.add(id(mod))
        if o["rms_norm"] and norm_cls is not None:
            self._replace(root, prefix, lambda m: type(m) is norm_cls and _is_rms(m),
                          lambda m: GemsRMSNorm(m.weight, m.variance_epsilon), "rms_norm")

    def patch_layer_norms(self, root, prefix: str):
        if self.opts["layer_norm"]:
            self._replace(root, prefix, _plain_layer_norm, GemsLayerNorm, "layer_norm")

    def patch_bert(self, root, prefix: str):
        modeling = _modeling("bert")
        if self.opts["encoder_layer"]:
            self.patch_bert_layers(root, prefix, modeling)
        if not self.opts["layer_norm"]:
            return
        classes = tuple(c for c in (self._cls(modeling, "BertSelfOutput"), self._cls(modeling, "BertOutput")) if c)
        for name, mod in list(root.named_modules(prefix=prefix)):
            if type(mod) in classes and id(mod) not in self.done and _plain_layer_norm(mod.LayerNorm):
                if self.set_forward(mod, bert_output_forward, name):
                    self.r.add("add_layer_norm", name)
                self.done.add(id(mod))
        self.patch_layer_norms(root, prefix)

    def patch_bert_layers(self, root, prefix: str, modeling):
        """Each BertLayer as one function (bert_layer.py): its computation without the 16 submodule
        calls, query/key/value as one GEMM; it checks on every call that it computes what the class's
        forward would, and runs that forward otherwise."""
        from transformers.activations import GELUActivation

        # deferred like transformers above: only patching a BERT model needs the fused BERT layer
        from .bert_layer import make_bert_layer_forward
        layer_cls, self_cls = self._cls(modeling, "BertLayer"), self._cls(modeling, "BertSelfAttention")
        if layer_cls is None or self_cls is None:
            return
        if _signature(layer_cls.forward) != _BERT_LAYER_PARAMS:
            self.r.notes.append(f"BertLayer.forward differs from transformers 5.17's; encoder layers left as is")
            return
        fwd = make_bert_layer_forward((self_cls, GELUActivation, GemsLayerNorm, bert_output_forward))
        for name, mod in list(root.named_modules(prefix=prefix)):
            if type(mod) is layer_cls and id(mod) not in self.done:
                if self.set_forward(mod, fwd, name):
                    self.r.add("encoder_layer", name)
                self.done.add(id(mod))

    def patch_clip(self, root, prefix: str):
        if not self.opts["layer_norm"]:
            return
        layer_cls = self._cls(_modeling("clip"), "CLIPEncoderLayer")
        for name, mod in list(root.named_modules(prefix=prefix)):
            if layer_cls is not None and type(mod) is layer_cls and id(mod) not in self.done:
                if _signature(layer_cls.forward) == ("self", "hidden_states", "attention_mask", "kwargs") \
                        and _plain_layer_norm(mod.layer_norm2):
                    if self.set_forward(mod, clip_layer_forward, name):
                        self.r.add("add_layer_norm", name)
                self.done.add(id(mod))
        self.patch_layer_norms(root, prefix)

    def _replace(self, root, prefix, match, make, op):
        for pname, parent in list(root.named_modules(prefix=prefix)):
            for cname, child in list(parent._modules.items()):
                if child is None or id(child) in self.done or not match(child):
                    continue
                qual = f"{pname}.{cname}" if pname else cname
                if self.foreign(child, qual):
                    self.done.add(id(child))
                    continue
                new = make(child)
                self.set_module(parent, cname, new, child)
                self.done.add(id(child))
                self.done.add(id(new))
                self.r.add(op, qual)

    def patch_causal_lm_loss(self, mt: str, out_cls_name: str):
        m, o = self.model, self.opts
        if not (o["cross_entropy"] or o["fused_linear_cross_entropy"]):
            return
        if not (hasattr(m, "lm_head") and hasattr(m, "model") and isinstance(m.lm_head, nn.Linear)):
            self.r.notes.append(f"{type(m).__name__} has no lm_head: loss left as is")
            return
        from transformers.loss.loss_utils import ForCausalLMLoss
        if m.loss_function is not ForCausalLMLoss:
            self.r.notes.append(f"{type(m).__name__}.loss_function is not ForCausalLMLoss: loss left as is")
            return
        if o["cross_entropy"]:
            self.set_attr(m, "_loss_function", causal_lm_loss)   # transformers' per-instance loss_function
            self.r.add("cross_entropy", "")
        if o["fused_linear_cross_entropy"]:
            out_cls = getattr(sys.modules[type(m).__module__], out_cls_name)
            if self.set_forward(m, causal_lm_forward(type(m).forward, out_cls), ""):
                self.r.add("fused_linear_cross_entropy", "")


# the forward signatures (transformers 5.17) that the replacement forwards take over
_DECODER_LAYER_PARAMS = ("self", "hidden_states", "attention_mask", "position_ids", "past_key_values",
                         "use_cache", "position_embeddings", "kwargs")
_BERT_LAYER_PARAMS = ("self", "hidden_states", "attention_mask", "encoder_hidden_states", "encoder_attention_mask",
                      "past_key_values", "kwargs")


def _signature(fn) -> tuple:
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return ()


def _is_rms(m) -> bool:
    w = getattr(m, "weight", None)
    return isinstance(w, nn.Parameter) and w.dim() == 1 and isinstance(getattr(m, "variance_epsilon", None), float)


def _plain_layer_norm(m) -> bool:
    return (type(m) is nn.LayerNorm and len(m.normalized_shape) == 1 and m.weight is not None
            and m.bias is not None)


def _modeling(mt: str):
    return importlib.import_module(f"transformers.models.{mt}.modeling_{mt}")
