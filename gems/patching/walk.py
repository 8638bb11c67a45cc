"""The walk over a model that finds what `gems.patch` replaces, by structure, and replaces it through the
report's undo log.

Each module is recognized by what it holds (a 1-D weight and an eps: an RMSNorm; gate/up/down
projections and an activation: a gated MLP; a forward calling a module-global apply_rotary_pos_emb:
rotary attention; `experts` beside a router: a sparse-MoE block) and replaced only where
gems/patching/probes.py proves the replacement computes what the module's own forward computes.
What is recognized but not proven goes to the report's `left` list with the reason.

Per-family code only where structure cannot decide: BERT's encoder layer as one function
(bert_layer.py, its own per-call checks; any layer running BertLayer's code, as RoBERTa's does), CLIP's
encoder layer and GPT-2's block with add_layer_norm, and the decoder layer whose residual add + norm is
fused (its forward must be transformers' Llama decoder layer's own code, compared instruction by
instruction).
"""
from __future__ import annotations

import importlib
import inspect
import types

from torch import nn

from . import probes
from .packed import GROUPS, Pack, first_forward, packable, sibling_forward
from .losses import causal_lm_forward, causal_lm_loss, masked_lm_forward
from .modules import (ACT_FORWARDS, MLP_FORWARDS, GemsLayerNorm, GemsRMSNorm, bert_output_forward, clip_layer_forward,
                      decoder_layer_forward, gpt2_block_forward, moe_decoder_layer_forward, rope_forward)
from .report import PatchReport

# the model types the tests build and check family by family (tests/fused/test_families.py); any other
# model is walked the same way
TESTED = ("bert", "clip_vision_model", "gemma", "gemma2", "gemma3_text", "glm4", "gpt2", "gpt_neox", "granite",
          "llama", "llava", "mistral", "mixtral", "olmo2", "phi3", "qwen2", "qwen3", "qwen3_moe", "roberta", "vit")


class Patcher:
    """One walk over a model: finds, proves and replaces, once per module (`done`), logging every change
    in the report (replacements) and every recognized but unproven part (`left`)."""

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

    # ------------------------------------------------------------------------------------ the walk
    def walk(self, root, prefix: str = ""):
        o = self.opts
        mods = [(n, m) for n, m in root.named_modules(prefix=prefix)]
        if o["moe"]:
            self.patch_moe(root, prefix)
            mods = [(n, m) for n, m in root.named_modules(prefix=prefix)]
        if o["encoder_layer"]:
            self.patch_bert_layers(mods)
        if o["layer_norm"]:
            self.patch_add_norm_layers(mods)
            self.patch_dense_add_norms(mods)
        for name, mod in mods:
            if id(mod) in self.done:
                continue
            form = probes.gated_mlp_form(mod)
            if form is not None and o["swiglu"]:
                self.patch_mlp(mod, name, form)
            elif form is None and probes.looks_like_plain_mlp(mod):
                self.r.leave(name, "mlp", "not gated (no gate/up projections): no fused op", strict=False)
            if o["rope"] and "apply_rotary_pos_emb" in _code_names(type(mod).forward):
                self.patch_rope(mod, name)
            if o["activation"] and not mod._modules:
                kind = probes.composite_activation(mod)
                if kind is not None and self.set_forward(mod, ACT_FORWARDS[kind], name):
                    self.r.add("activation", name)
        if o["pack_projections"]:
            self.patch_packed(mods)
        if o["rms_norm"]:
            self._replace(root, prefix, probes.looks_like_rms_norm, self.rms_replacement, "rms_norm")
            self.patch_decoder_layers(root, prefix)
        if o["layer_norm"]:
            self._replace(root, prefix, probes.plain_layer_norm, GemsLayerNorm, "layer_norm")

    def patch_mlp(self, mod, name, form):
        kind = probes.prove_gated_mlp(mod, form)
        if kind not in ("silu", "gelu", "gelu_tanh"):
            self.r.leave(name, "mlp", kind)
        else:
            fwd, op = MLP_FORWARDS[(form, kind)]
            if self.set_forward(mod, fwd, name):
                self.r.add(op, name)
        self.done.add(id(mod))

    def patch_rope(self, mod, name):
        clone, why = rope_forward(type(mod).forward)
        if clone is None:
            self.r.leave(name, "rope", why)
        elif self.set_forward(mod, clone, name):
            self.r.add("rope", name)

    def rms_replacement(self, m):
        proof = probes.prove_rms_norm(m)
        if isinstance(proof, str):
            return proof
        casting, offset, eps = proof
        return GemsRMSNorm(m.weight, eps, casting=casting, offset=offset)

    def patch_decoder_layers(self, root, prefix):
        """A decoder layer whose forward is transformers' Llama (or Mixtral) decoder layer's own code: its
        residual add + post-attention norm as one add_rms_norm (the norm must have been replaced above)."""
        for name, mod in root.named_modules(prefix=prefix):
            if id(mod) in self.done or not all(hasattr(mod, a) for a in
                                               ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")):
                continue
            self.done.add(id(mod))
            fwd = _decoder_layer_form(type(mod).forward)
            if fwd is None:
                self.r.leave(name, "add_rms_norm", "its forward is not the Llama or Mixtral decoder layer's: residual "
                             "add and norm left unfused", strict=False)
            elif not isinstance(mod.post_attention_layernorm, GemsRMSNorm):
                self.r.leave(name, "add_rms_norm", "its post-attention norm was not replaced")
            elif self.set_forward(mod, fwd, name):
                self.r.add("add_rms_norm", name)

    def patch_packed(self, mods):
        """Sibling Linears reading one input (q/k/v, gate/up) as one GEMM when no gradient is recorded
        (packed.py: any calling code gets the separate Linears' results)."""
        for name, mod in mods:
            for group in GROUPS:
                lins = [mod._modules.get(n) for n in group]
                if not all(isinstance(m, nn.Module) for m in lins) or any(id(m) in self.done for m in lins):
                    continue
                what = "+".join(group)
                if any(self.foreign(m, f"{name}.{n}") for m, n in zip(lins, group)):
                    continue
                why = packable(lins)
                if why is not None:
                    self.r.leave(name, "packed_linear", f"{what}: {why}", strict=False)
                    continue
                pack = Pack(lins)
                self.r.log_call(pack.unpack)
                for i, m in enumerate(lins):
                    self.done.add(id(m))
                    self.set_attr(m, "_gems_pack", pack)
                    self.set_attr(m, "_gems_pack_index", i)
                    self.set_attr(m, "forward", types.MethodType(first_forward if i == 0 else sibling_forward, m))
                self.r.add("packed_linear", f"{name}: {what}" if name else what)

    def patch_moe(self, root, prefix):
        """Sparse-MoE blocks (experts beside a router) through gems/patching/moe.py's patch_moe_block,
        imported only when a model has one and tolerated absent."""
        blocks = [(n, m) for n, m in root.named_modules(prefix=prefix)
                  if isinstance(getattr(m, "experts", None), nn.Module)
                  and isinstance(getattr(m, "gate", getattr(m, "router", None)), nn.Module)]
        if not blocks:
            return
        try:
            from .moe import patch_moe_block   # only a model with MoE blocks needs it; tolerated absent
        except ImportError as e:
            for n, _ in blocks:
                self.r.leave(n, "moe", f"gems.patching.moe is not available ({e})")
            return
        for pname, parent in list(root.named_modules(prefix=prefix)):
            for cname, child in list(parent._modules.items()):
                if not any(child is b for _, b in blocks) or id(child) in self.done:
                    continue
                qual = f"{pname}.{cname}" if pname else cname
                self.done.add(id(child))
                if self.foreign(child, qual):
                    continue
                new = patch_moe_block(child, "torch" if self.opts["moe_torch_gemm"] else "triton")
                if new is None:
                    self.r.leave(qual, "moe", "patch_moe_block does not handle this block")
                    continue
                self.set_module(parent, cname, new, child)
                self.done.update(id(m) for m in new.modules())
                self.r.add("moe", qual)

    # ---------------------------------------------------------------- per-family layers (layer_norm, BERT)
    def patch_bert_layers(self, mods):
        """Each BERT encoder layer as one function (bert_layer.py): its computation without the 16
        submodule calls, query/key/value as one GEMM; it checks on every call that it computes what the
        class's forward would, and runs that forward otherwise. A layer is BERT's when its forward and
        its submodules' forwards are BertLayer's code (RoBERTa's copies are)."""
        B = _modeling("bert")
        layer_cls = getattr(B, "BertLayer", None)
        if layer_cls is None:
            return
        layers = [(n, m) for n, m in mods if id(m) not in self.done and _same_code(type(m).forward, layer_cls.forward)
                  and _bert_parts_same(m, B)]
        if not layers:
            return
        from transformers.activations import GELUActivation

        # deferred: only a BERT-like model needs the fused BERT layer
        from .bert_layer import make_bert_layer_forward
        if _signature(layer_cls.forward) != _BERT_LAYER_PARAMS:
            self.r.notes.append("BertLayer.forward differs from transformers 5.17's; encoder layers left as is")
            return
        forwards = {}    # self-attention class -> the layer forward checking for it
        for name, mod in layers:
            self_cls = type(mod.attention.self)
            if self_cls not in forwards:
                forwards[self_cls] = make_bert_layer_forward((self_cls, GELUActivation, GemsLayerNorm,
                                                              bert_output_forward))
            if self.set_forward(mod, forwards[self_cls], name):
                self.r.add("encoder_layer", name)
            self.done.add(id(mod))

    def patch_add_norm_layers(self, mods):
        """Layers whose forward is a family's own code (a copy counts) with a residual add before a plain
        LayerNorm (_ADD_NORM_LAYERS): that add and norm as one add_layer_norm."""
        for mt, cls_name, norm, fwd in _ADD_NORM_LAYERS:
            cls = getattr(_modeling(mt), cls_name, None)
            if cls is None or _signature(cls.forward) != _signature(fwd):
                continue   # another transformers version: its code, not ours
            for name, mod in mods:
                if id(mod) in self.done or not _same_code(type(mod).forward, cls.forward):
                    continue
                self.done.add(id(mod))
                if not probes.plain_layer_norm(getattr(mod, norm, None)):
                    self.r.leave(name, "add_layer_norm", f"its {norm} is not a plain LayerNorm", strict=False)
                elif self.set_forward(mod, fwd, name):
                    self.r.add("add_layer_norm", name)

    def patch_dense_add_norms(self, mods):
        """LayerNorm(dropout(dense(h)) + input) modules (BertSelfOutput / BertOutput and their copies):
        dropout as before, then add_layer_norm."""
        for name, mod in mods:
            if (id(mod) in self.done or _signature(type(mod).forward) != ("self", "hidden_states", "input_tensor")
                    or not isinstance(getattr(mod, "LayerNorm", None), nn.LayerNorm)):
                continue
            why = probes.prove_dense_add_norm(mod)
            self.done.add(id(mod))
            if why is not None:
                self.r.leave(name, "add_layer_norm", why, strict=False)
            elif self.set_forward(mod, bert_output_forward, name):
                self.r.add("add_layer_norm", name)

    def _replace(self, root, prefix, match, make, op):
        for pname, parent in list(root.named_modules(prefix=prefix)):
            for cname, child in list(parent._modules.items()):
                if child is None or id(child) in self.done or not match(child):
                    continue
                qual = f"{pname}.{cname}" if pname else cname
                self.done.add(id(child))
                if self.foreign(child, qual):
                    continue
                new = make(child)
                if isinstance(new, str):
                    self.r.leave(qual, op, new)
                    continue
                self.set_module(parent, cname, new, child)
                self.done.add(id(new))
                self.r.add(op, qual)

    # ------------------------------------------------------------------------------------ the losses
    def prove_losses(self):
        """The loss checks run the model's own forward: before anything is replaced (`patch_losses` after)."""
        m, o = self.model, self.opts
        if isinstance(getattr(m, "lm_head", None), nn.Linear) and (o["cross_entropy"] or o["fused_linear_cross_entropy"]):
            return "causal", probes.prove_causal_lm(m)
        if type(m).__name__.endswith("ForMaskedLM") and o["cross_entropy"]:
            return "masked", probes.prove_masked_lm(m)
        return None, None

    def patch_losses(self, kind, proof):
        m, o = self.model, self.opts
        if kind == "causal":
            if o["cross_entropy"]:
                if proof["cross_entropy"] is None:
                    self.set_attr(m, "_loss_function", causal_lm_loss)   # transformers' per-instance loss_function
                    self.r.add("cross_entropy", "")
                else:
                    self.r.leave("<model>", "cross_entropy", proof["cross_entropy"])
            if o["fused_linear_cross_entropy"]:
                why = proof["fused_linear_cross_entropy"]
                base = getattr(m, "base_model_prefix", "") or "model"
                if why is None and getattr(m, base, None) is not probes.base_model(m):
                    base = "model"
                if why is not None:
                    self.r.leave("<model>", "fused_linear_cross_entropy", why)
                elif self.set_forward(m, causal_lm_forward(type(m).forward, proof["out_cls"], base), ""):
                    self.r.add("fused_linear_cross_entropy", "")
        elif kind == "masked":
            from transformers.modeling_outputs import MaskedLMOutput
            if proof is not None:
                self.r.leave("<model>", "cross_entropy", proof)
            elif self.set_forward(m, masked_lm_forward(type(m).forward, MaskedLMOutput), ""):
                self.r.add("cross_entropy", "")


# the forward signatures (transformers 5.17) that the replacement forwards take over
_DECODER_LAYER_PARAMS = ("self", "hidden_states", "attention_mask", "position_ids", "past_key_values",
                         "use_cache", "position_embeddings", "kwargs")
# (family, layer class, the LayerNorm after the residual add, the forward with both in one add_layer_norm)
_ADD_NORM_LAYERS = (("clip", "CLIPEncoderLayer", "layer_norm2", clip_layer_forward),
                    ("gpt2", "GPT2Block", "ln_2", gpt2_block_forward))
_BERT_LAYER_PARAMS = ("self", "hidden_states", "attention_mask", "encoder_hidden_states", "encoder_attention_mask",
                      "past_key_values", "kwargs")


# (family, decoder layer class, its forward's parameters, the forward with add_rms_norm), in the order tried
_DECODER_LAYERS = (("llama", "LlamaDecoderLayer", _DECODER_LAYER_PARAMS, decoder_layer_forward),
                   ("mixtral", "MixtralDecoderLayer", ("self", "hidden_states", "position_embeddings", "attention_mask",
                                                       "position_ids", "past_key_values", "kwargs"),
                    moe_decoder_layer_forward))


def _decoder_layer_form(forward):
    """The replacement forward for a decoder layer whose forward is one of _DECODER_LAYERS' own code, or None
    (a family's module is imported only when the ones before it do not match)."""
    for family, cls_name, params, replacement in _DECODER_LAYERS:
        if _signature(forward) != params:
            continue
        ref = getattr(_modeling(family), cls_name, None)
        if ref is not None and _same_code(forward, ref.forward):
            return replacement
    return None


def _signature(fn) -> tuple:
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return ()


def _code_names(fn) -> tuple:
    code = getattr(fn, "__code__", None)
    return code.co_names if code is not None else ()


def _same_code(a, b) -> bool:
    """Whether functions a and b run the same instructions on the same names and constants (their
    docstrings and line numbers aside): a family's copy of a transformers forward."""
    ca, cb = getattr(a, "__code__", None), getattr(b, "__code__", None)
    if ca is None or cb is None:
        return False
    if ca is cb:
        return True

    def consts(c):
        return tuple(k for k in c.co_consts if not (isinstance(k, str) and k == (c.co_consts[0] if c.co_consts else None)))
    return (ca.co_code == cb.co_code and ca.co_names == cb.co_names and ca.co_varnames == cb.co_varnames
            and consts(ca) == consts(cb))


def _bert_parts_same(layer, B) -> bool:
    """Whether the submodules a BERT layer function recomputes run BERT's own forwards."""
    parts = (("attention", "BertAttention"), ("attention.self", "BertSelfAttention"),
             ("attention.output", "BertSelfOutput"), ("intermediate", "BertIntermediate"), ("output", "BertOutput"))
    for path, cls in parts:
        m = layer
        for a in path.split("."):
            m = getattr(m, a, None)
        ref = getattr(B, cls, None)
        if not isinstance(m, nn.Module) or ref is None or not _same_code(type(m).forward, ref.forward):
            return False
    return True


def _modeling(mt: str):
    return importlib.import_module(f"transformers.models.{mt}.modeling_{mt}")
