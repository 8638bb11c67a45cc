"""One call to put `gems.fused` into a built Hugging Face model, and one call to take it out.

    import gems
    report = gems.patch(model)        # in place; returns what was replaced (also model._gems_patch)
    gems.enable()                     # composes: the unfused remainder runs on Gems' ATen ops
    ...
    gems.unpatch(model)               # the exact original module objects and attributes again

    with gems.patched(model, cross_entropy=False):
        model.generate(...)

What is replaced, by ``model.config.model_type`` (and the nested ``text_config`` / ``vision_config`` of
Llava), for transformers 5.x (written against 5.17):

=====================  ============================================================================
llama, mistral, qwen2  every ``*RMSNorm`` -> a module calling ``gems.fused.rms_norm`` with the same
(Aquila is built as    weight Parameter (``rms_norm``); each decoder layer's residual add + post-attention
Llama: model_type      norm -> ``add_rms_norm`` (``rms_norm``); the MLP's act(gate) * up ->
'llama')               ``silu_and_mul`` / ``gelu_and_mul`` (``swiglu``); the attention's
                       ``apply_rotary_pos_emb`` -> ``gems.fused.rope`` (``rope``)
bert                   each ``BertLayer`` -> one function computing the same without its 16 submodule
                       calls, query/key/value as one GEMM (``encoder_layer``; checked per call:
                       gems/encoder_layer.py); BertForMaskedLM's loss -> ``cross_entropy``; with
                       ``layer_norm=True`` (opt-in, see `patch`): every ``nn.LayerNorm`` ->
                       ``gems.fused.layer_norm``, and in BertSelfOutput / BertOutput dropout(dense(h)) +
                       input then LayerNorm -> dropout as before, then ``add_layer_norm``
llava                  the language model as its own type (above); with ``layer_norm=True``, in the
                       CLIP vision tower every ``nn.LayerNorm`` and each encoder layer's residual add +
                       second norm; the loss as for causal LMs
clip_vision_model      as Llava's vision tower
causal LMs             with labels in training mode: the loss from the last hidden state with
                       ``fused_linear_cross_entropy``, **logits are not computed (``logits=None``)**;
                       otherwise (eval, or ``fused_linear_cross_entropy=False``) the logits are
                       computed and, with ``cross_entropy=True``, their loss by ``cross_entropy``.
                       Labels are shifted, ``ignore_index``, ``shift_labels`` and
                       ``num_items_in_batch`` handled like transformers' ``ForCausalLMLoss``.
=====================  ============================================================================

Not fused: the MLP's residual add with the next layer's input norm (a decoder layer must return the
summed hidden state: ``output_hidden_states`` records it); CLIP's quick_gelu MLP and Llava's projector
(not gated). A model of remote-code type 'aquila' is refused: build it as ``LlamaForCausalLM`` (its
architecture), as ``models/`` does.

Everything is per model instance: replaced submodules keep their names and Parameter objects (so
``state_dict()`` keys, tied weights and optimizer state are unchanged), forwards are set on the instances,
and no module global of transformers is modified (RoPE: the attention forward runs as a copy of the same
function whose globals map ``apply_rotary_pos_emb`` to Gems'; a later change to that module global is not
seen by patched models). ``unpatch`` puts the original objects back. A module that already has an
instance forward or an accelerate hook (``device_map``, offloading) is left as is and counted in the
report's notes.

Patching a patched model with the same options is a no-op returning the existing report; with other
options it raises (``unpatch`` first). ``patched()`` unpatches on exit only what it patched itself.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import types
from dataclasses import dataclass, field

import torch
from torch import nn

from . import fused as F

__all__ = ["patch", "unpatch", "patched", "PatchReport", "SUPPORTED"]

OPTIONS = ("rms_norm", "rope", "swiglu", "cross_entropy", "fused_linear_cross_entropy", "layer_norm", "encoder_layer")
# model_type -> (class-name prefix, family)
_DECODERS = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}
_ENCODERS = {"bert": "Bert"}
_VISION = {"clip_vision_model": "CLIP", "clip": "CLIP"}
_TOP = {"llava": "Llava"}
SUPPORTED = tuple(sorted({*_DECODERS, *_ENCODERS, *_TOP, "clip_vision_model"}))
_ATTR = "_gems_patch"


# ------------------------------------------------------------------------------------------- report
@dataclass
class PatchReport:
    """What `gems.patch` replaced: per fused op, the qualified names of the modules it now runs in."""

    model_type: str
    options: dict
    replaced: dict = field(default_factory=dict)    # fused op -> [module names]
    notes: list = field(default_factory=list)       # what was left alone, and why
    _undo: list = field(default_factory=list, repr=False)

    def add(self, op: str, name: str):
        self.replaced.setdefault(op, []).append(name or "<model>")

    def counts(self) -> dict:
        return {k: len(v) for k, v in self.replaced.items()}

    def to_dict(self) -> dict:
        return {"model_type": self.model_type, "options": dict(self.options), "replaced": self.counts(),
                "modules": {k: list(v) for k, v in self.replaced.items()}, "notes": list(self.notes)}

    def summary(self) -> str:
        parts = [f"{op} x{n}" for op, n in self.counts().items()]
        s = f"gems.patch({self.model_type}): " + (", ".join(parts) if parts else "nothing replaced")
        return s + "".join(f"; {n}" for n in self.notes)

    __str__ = summary


# ---------------------------------------------------------------------------------- replacement modules
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


def _decoder_layer_forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                           use_cache=False, position_embeddings=None, **kwargs):
    """Llama/Mistral/Qwen2 decoder layer (transformers 5.17) with the residual add and the post-attention
    RMSNorm in one `add_rms_norm`."""
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(
        hidden_states=hidden_states,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        use_cache=use_cache,
        position_embeddings=position_embeddings,
        **kwargs,
    )
    w, eps, kw = _norm_args(self.post_attention_layernorm)
    hidden_states, residual = F.add_rms_norm(hidden_states, residual, w, eps, **kw)
    hidden_states = self.mlp(hidden_states)
    return residual + hidden_states


def _clip_layer_forward(self, hidden_states, attention_mask, **kwargs):
    """CLIP encoder layer (transformers 5.17) with the residual add and layer_norm2 in one `add_layer_norm`."""
    residual = hidden_states
    hidden_states = self.layer_norm1(hidden_states)
    hidden_states, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask, **kwargs)
    ln = self.layer_norm2
    hidden_states, residual = F.add_layer_norm(hidden_states, residual, ln.weight, ln.bias, ln.eps)
    hidden_states = self.mlp(hidden_states)
    return residual + hidden_states


def _bert_output_forward(self, hidden_states, input_tensor):
    """BertSelfOutput / BertOutput: dropout exactly as before (a no-op in eval or at p=0), then the residual
    add and LayerNorm in one `add_layer_norm`."""
    hidden_states = self.dropout(self.dense(hidden_states))
    ln = self.LayerNorm
    return F.add_layer_norm(hidden_states, input_tensor, ln.weight, ln.bias, ln.eps)[0]


def _silu_mlp_forward(self, x):
    return self.down_proj(F.silu_and_mul(self.gate_proj(x), self.up_proj(x)))


def _gelu_mlp_forward(self, x):
    return self.down_proj(F.gelu_and_mul(self.gate_proj(x), self.up_proj(x), approximate="none"))


def _gelu_tanh_mlp_forward(self, x):
    return self.down_proj(F.gelu_and_mul(self.gate_proj(x), self.up_proj(x), approximate="tanh"))


def _gems_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    """transformers' apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1) through `gems.fused.rope`."""
    return F.rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)


_ROPE_SIGNATURE = ("q", "k", "cos", "sin", "unsqueeze_dim")
_rope_clones: dict = {}   # original attention forward -> its copy with Gems' rope in its globals


def _rope_forward(fn):
    """A copy of `fn` (an attention forward) whose global `apply_rotary_pos_emb` is Gems'; None if `fn`
    calls no compatible apply_rotary_pos_emb. The module's own globals are not touched."""
    if fn in _rope_clones:
        return _rope_clones[fn]
    clone = None
    orig = fn.__globals__.get("apply_rotary_pos_emb")
    if "apply_rotary_pos_emb" in fn.__code__.co_names and callable(orig):
        try:
            params = tuple(inspect.signature(orig).parameters)
        except (TypeError, ValueError):
            params = ()
        if params == _ROPE_SIGNATURE:
            g = dict(fn.__globals__)
            g["apply_rotary_pos_emb"] = _gems_apply_rotary_pos_emb
            clone = types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__, fn.__closure__)
            clone.__kwdefaults__ = fn.__kwdefaults__
            clone.__qualname__ = fn.__qualname__
            clone.__doc__ = fn.__doc__
            clone.__module__ = fn.__module__
    _rope_clones[fn] = clone
    return clone


# ------------------------------------------------------------------------------------------ losses
def _shifted(labels, ignore_index, shift_labels):
    if shift_labels is None:
        labels = nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:].contiguous()
    return shift_labels.reshape(-1)


def _reduce_args(num_items_in_batch, device):
    """HF's reduction: sum / num_items_in_batch when given, else mean, as an fp32 loss. The divisor goes
    into the kernel (folded into the gradient it writes), and the fp32 loss is the kernel's own: no
    rounding of the sum to bf16, no rescaling pass in backward."""
    kw = {"out_dtype": torch.float32}
    if num_items_in_batch is None:
        kw["reduction"] = "mean"
    else:
        kw["reduction"] = "sum"
        kw["divisor"] = num_items_in_batch.to(device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch
    return kw


def causal_lm_loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None,
                   **kwargs):
    """transformers' ForCausalLMLoss (5.17) with `gems.fused.cross_entropy` (fp32 accumulation inside the
    kernel instead of an fp32 copy of the logits)."""
    target = _shifted(labels, ignore_index, shift_labels).to(logits.device)
    return F.cross_entropy(logits.reshape(-1, vocab_size), target, ignore_index=ignore_index,
                           **_reduce_args(num_items_in_batch, logits.device))


def causal_lm_linear_loss(hidden, lm_head, labels, num_items_in_batch=None, ignore_index=-100,
                          shift_labels=None, **kwargs):
    """ForCausalLMLoss of `lm_head(hidden)` computed by `gems.fused.fused_linear_cross_entropy` without
    the full logits."""
    h = hidden.reshape(-1, hidden.shape[-1])
    target = _shifted(labels, ignore_index, shift_labels).to(h.device)
    return F.fused_linear_cross_entropy(h, lm_head.weight, target, bias=lm_head.bias, ignore_index=ignore_index,
                                        **_reduce_args(num_items_in_batch, h.device))


def _return_dict(model, extra: dict) -> bool:
    """transformers' can_return_tuple rule (pops `return_dict` from `extra`)."""
    rd = model.config.return_dict if hasattr(model, "config") else True
    passed = extra.pop("return_dict", rd)
    return rd if passed is None else passed


def _bind(cls_forward, model, args, kwargs):
    """(named arguments, **kwargs dict) of a call of the class forward."""
    sig = inspect.signature(cls_forward)
    ba = sig.bind(model, *args, **kwargs)
    ba.apply_defaults()
    named = dict(ba.arguments)
    named.pop(next(iter(sig.parameters)))   # self
    extra = {}
    for p in sig.parameters.values():
        if p.kind is p.VAR_KEYWORD:
            extra = dict(named.pop(p.name, {}) or {})
        elif p.kind is p.VAR_POSITIONAL:
            if named.pop(p.name, ()):
                raise TypeError(f"{cls_forward.__qualname__}: unexpected positional arguments")
    return named, extra


def _causal_lm_forward(cls_forward, out_cls):
    """A forward for a causal LM instance: with labels in training mode, the loss from the last hidden state
    by fused_linear_cross_entropy and logits=None; anything else runs the class's own forward."""

    @functools.wraps(cls_forward)
    def forward(self, *args, **kwargs):
        if not self.training:       # eval and generate: the model's own forward, nothing bound
            return cls_forward(self, *args, **kwargs)
        named, extra = _bind(cls_forward, self, args, kwargs)
        labels = named.pop("labels", None)
        if labels is None:
            return cls_forward(self, *args, **kwargs)
        logits_to_keep = named.pop("logits_to_keep", 0)
        return_dict = _return_dict(self, extra)
        outputs = self.model(**named, **extra)
        hidden = outputs[0]
        sl = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        loss = causal_lm_linear_loss(hidden[:, sl, :], self.lm_head, labels, **extra)
        rest = {f: getattr(outputs, f, None) for f in out_cls.__dataclass_fields__ if f not in ("loss", "logits")}
        out = out_cls(loss=loss, logits=None, **rest)
        return out if return_dict else out.to_tuple()
    return forward


def _masked_lm_forward(cls_forward, out_cls):
    """BertForMaskedLM's forward with its loss (CrossEntropyLoss over the logits) by
    `gems.fused.cross_entropy`."""

    @functools.wraps(cls_forward)
    def forward(self, *args, **kwargs):
        named, extra = _bind(cls_forward, self, args, kwargs)
        labels = named.pop("labels", None)
        if labels is None:
            return cls_forward(self, *args, **kwargs)
        return_dict = _return_dict(self, extra)
        out = cls_forward(self, **named, **extra, labels=None, return_dict=True)
        logits = out.logits
        loss = F.cross_entropy(logits.reshape(-1, self.config.vocab_size), labels.reshape(-1).to(logits.device))
        loss = loss.to(logits.dtype)
        rest = {f: getattr(out, f, None) for f in out_cls.__dataclass_fields__ if f != "loss"}
        out = out_cls(loss=loss, **rest)
        return out if return_dict else out.to_tuple()
    return forward


# ------------------------------------------------------------------------------------------ patching
class _Patcher:
    def __init__(self, model, opts: dict, report: PatchReport):
        self.model, self.opts, self.r = model, opts, report
        self.done: set = set()     # ids of modules already handled
        self.skipped: list = []    # modules left alone (their own forward or hook)

    # undo records: ("module", parent, name, original) | ("attr", obj, name, had, old)
    def set_module(self, parent, name, new, old):
        parent._modules[name] = new
        self.r._undo.append(("module", parent, name, old))

    def set_attr(self, obj, name, value):
        had = name in obj.__dict__
        self.r._undo.append(("attr", obj, name, had, obj.__dict__.get(name)))
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
        P = _DECODERS[mt]
        norm_cls, layer_cls = self._cls(modeling, f"{P}RMSNorm"), self._cls(modeling, f"{P}DecoderLayer")
        mlp_cls, attn_cls = self._cls(modeling, f"{P}MLP"), self._cls(modeling, f"{P}Attention")
        o = self.opts
        for name, mod in list(root.named_modules(prefix=prefix)):
            if id(mod) in self.done:
                continue
            if o["rms_norm"] and layer_cls is not None and type(mod) is layer_cls:
                if _signature(layer_cls.forward) == _DECODER_LAYER_PARAMS:
                    if self.set_forward(mod, _decoder_layer_forward, name):
                        self.r.add("add_rms_norm", name)
                    self.done.add(id(mod))
                else:
                    self.r.notes.append(f"{name}: {layer_cls.__name__}.forward differs from transformers 5.17's; "
                                        f"residual add + norm left unfused")
            elif o["swiglu"] and mlp_cls is not None and type(mod) is mlp_cls:
                fwd = _mlp_forward(mod)
                if fwd is None:
                    self.r.notes.append(f"{name}: activation {type(getattr(mod, 'act_fn', None)).__name__} has no "
                                        f"fused gated form; MLP left as is")
                elif self.set_forward(mod, fwd, name):
                    self.r.add("silu_and_mul" if fwd is _silu_mlp_forward else "gelu_and_mul", name)
                self.done.add(id(mod))
            elif o["rope"] and attn_cls is not None and type(mod) is attn_cls:
                clone = _rope_forward(attn_cls.forward)
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
                if self.set_forward(mod, _bert_output_forward, name):
                    self.r.add("add_layer_norm", name)
                self.done.add(id(mod))
        self.patch_layer_norms(root, prefix)

    def patch_bert_layers(self, root, prefix: str, modeling):
        """Each BertLayer as one function (gems/encoder_layer.py): its computation without the 16 submodule
        calls, query/key/value as one GEMM; it checks on every call that it computes what the class's
        forward would, and runs that forward otherwise."""
        from transformers.activations import GELUActivation

        from .encoder_layer import make_bert_layer_forward
        layer_cls, self_cls = self._cls(modeling, "BertLayer"), self._cls(modeling, "BertSelfAttention")
        if layer_cls is None or self_cls is None:
            return
        if _signature(layer_cls.forward) != _BERT_LAYER_PARAMS:
            self.r.notes.append(f"BertLayer.forward differs from transformers 5.17's; encoder layers left as is")
            return
        fwd = make_bert_layer_forward((self_cls, GELUActivation, GemsLayerNorm, _bert_output_forward))
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
                    if self.set_forward(mod, _clip_layer_forward, name):
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
            if self.set_forward(m, _causal_lm_forward(type(m).forward, out_cls), ""):
                self.r.add("fused_linear_cross_entropy", "")


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


def _mlp_forward(mlp):
    from transformers import activations as A
    if not all(isinstance(getattr(mlp, n, None), nn.Linear) for n in ("gate_proj", "up_proj", "down_proj")):
        return None
    act = getattr(mlp, "act_fn", None)
    if type(act) in (A.SiLUActivation, nn.SiLU):
        return _silu_mlp_forward
    if type(act) is A.GELUActivation and getattr(act, "act", None) is nn.functional.gelu:
        return _gelu_mlp_forward
    if type(act) is getattr(A, "GELUTanh", ()) or (type(act) is nn.GELU and act.approximate == "tanh"):
        return _gelu_tanh_mlp_forward
    if type(act) is nn.GELU and act.approximate == "none":
        return _gelu_mlp_forward
    return None


def _modeling(mt: str):
    import importlib
    return importlib.import_module(f"transformers.models.{mt}.modeling_{mt}")


def _model_type(model) -> str:
    cfg = getattr(model, "config", None)
    mt = getattr(cfg, "model_type", None)
    if not mt:
        raise TypeError(f"gems.patch: {type(model).__name__} has no config.model_type; gems.patch takes a "
                        f"Hugging Face model of a supported type ({', '.join(SUPPORTED)})")
    return mt


def _unsupported(what: str) -> ValueError:
    return ValueError(f"gems.patch: model type '{what}' is not supported; supported: {', '.join(SUPPORTED)} "
                      f"(Aquila: build it as LlamaForCausalLM, as models/ does; Llava with a "
                      f"{'/'.join(_DECODERS)} language model and a CLIP vision tower)")


def _options(kw: dict) -> dict:
    return {k: bool(kw[k]) for k in OPTIONS}


def _check_ops(opts: dict, needed: set):
    """Every fused op the patch will call must be importable now, not at the first forward."""
    missing = []
    for name in sorted(needed):
        try:
            getattr(F, name)
        except (AttributeError, ImportError) as e:
            missing.append(f"{name} ({type(e).__name__}: {e})")
    if missing:
        raise RuntimeError("gems.patch: these fused ops are not available: " + "; ".join(missing)
                           + ". Pass the option that uses them as False to patch without them.")


def patch(model, *, rms_norm: bool = True, rope: bool = True, swiglu: bool = True, cross_entropy: bool = True,
          fused_linear_cross_entropy: bool = True, layer_norm: bool = False, encoder_layer: bool = True) -> PatchReport:
    """Replace, in place, the parts of a Hugging Face `model` that `gems.fused` serves (see the module
    docstring); returns a PatchReport (also kept as ``model._gems_patch`` until `unpatch`).

    `layer_norm` is off by default: a fused LayerNorm (+ residual add) replaces only two ATen ops and
    saves one elementwise pass, less than the host cost of its autograd Function where the step is
    host-bound. Measured on an H200 (BERT-base training 32 x 128, gems.enable(), time vs ATen eager):
    1.065x faster with it, 1.239x without, 1.152x unpatched (docs/perf.md, 2026-11-27).

    `encoder_layer` (BERT) runs each BertLayer as one function, with query, key and value as one GEMM,
    for the same reason: the host time of its 16 submodule calls and of the backward's extra launches
    (gems/encoder_layer.py says when it steps aside)."""
    opts = _options(dict(rms_norm=rms_norm, rope=rope, swiglu=swiglu, cross_entropy=cross_entropy,
                         fused_linear_cross_entropy=fused_linear_cross_entropy, layer_norm=layer_norm,
                         encoder_layer=encoder_layer))
    if not isinstance(model, nn.Module):
        raise TypeError(f"gems.patch takes a torch.nn.Module, got {type(model).__name__}")
    prev = model.__dict__.get(_ATTR)
    if prev is not None:
        if prev.options == opts:
            return prev
        raise RuntimeError(f"gems.patch: the model is already patched with other options ({prev.options}); "
                           f"gems.unpatch(model) first")
    mt = _model_type(model)
    report = PatchReport(model_type=mt, options=opts)
    p = _Patcher(model, opts, report)
    cls = type(model).__name__
    try:
        if mt in _DECODERS:
            _check_ops(opts, _needed(opts, decoder=True, causal=cls.endswith("ForCausalLM")))
            p.patch_decoder(model, "", mt)
            if cls.endswith("ForCausalLM"):
                p.patch_causal_lm_loss(mt, "CausalLMOutputWithPast")
        elif mt in _ENCODERS:
            masked = cls == "BertForMaskedLM"
            _check_ops(opts, _needed(opts, bert=True, masked=masked))
            p.patch_bert(model, "")
            if masked and opts["cross_entropy"]:
                from transformers.modeling_outputs import MaskedLMOutput
                if p.set_forward(model, _masked_lm_forward(type(model).forward, MaskedLMOutput), ""):
                    report.add("cross_entropy", "")
        elif mt in _TOP:
            text_mt = getattr(getattr(model.config, "text_config", None), "model_type", None)
            vis_mt = getattr(getattr(model.config, "vision_config", None), "model_type", None)
            if text_mt not in _DECODERS:
                raise _unsupported(f"llava with a '{text_mt}' language model")
            causal = cls == "LlavaForConditionalGeneration"
            _check_ops(opts, _needed(opts, decoder=True, causal=causal, clip=vis_mt in _VISION))
            inner = model.model if hasattr(model, "model") else model
            lm, vt = getattr(inner, "language_model", None), getattr(inner, "vision_tower", None)
            if lm is not None:
                p.patch_decoder(lm, _qual(model, lm), text_mt)
            if vt is not None:
                if vis_mt in _VISION:
                    p.patch_clip(vt, _qual(model, vt))
                else:
                    report.notes.append(f"vision tower '{vis_mt}' is not supported: left as is")
            if causal:
                p.patch_causal_lm_loss(mt, "LlavaCausalLMOutputWithPast")
        elif mt == "clip_vision_model":     # a CLIP vision tower on its own (Llava's)
            _check_ops(opts, _needed(opts, clip=True))
            p.patch_clip(model, "")
        else:
            raise _unsupported(mt)
    except BaseException:
        _undo(report)
        raise
    if p.skipped:
        report.notes.append(f"{len(p.skipped)} module(s) with their own forward or an accelerate hook left as is "
                            f"(first: {p.skipped[0]})")
    object.__setattr__(model, _ATTR, report)
    return report


def _qual(model, sub) -> str:
    for n, m in model.named_modules():
        if m is sub:
            return n
    return ""


def _needed(opts, decoder=False, causal=False, bert=False, masked=False, clip=False) -> set:
    n = set()
    if decoder:
        if opts["rms_norm"]:
            n |= {"rms_norm", "add_rms_norm"}
        if opts["swiglu"]:
            n |= {"silu_and_mul", "gelu_and_mul"}
        if opts["rope"]:
            n.add("rope")
    if causal:
        if opts["cross_entropy"]:
            n.add("cross_entropy")
        if opts["fused_linear_cross_entropy"]:
            n.add("fused_linear_cross_entropy")
    if (bert or clip) and opts["layer_norm"]:
        n |= {"layer_norm", "add_layer_norm"}
    if masked and opts["cross_entropy"]:
        n.add("cross_entropy")
    return n


def _undo(report: PatchReport):
    for rec in reversed(report._undo):
        if rec[0] == "module":
            _, parent, name, old = rec
            parent._modules[name] = old
        else:
            _, obj, name, had, old = rec
            if had:
                object.__setattr__(obj, name, old)
            else:
                obj.__dict__.pop(name, None)
    report._undo.clear()


def unpatch(model):
    """Undo `gems.patch(model)`: the original module objects and attributes, exactly. Returns the report
    that was undone, or None when the model was not patched."""
    report = model.__dict__.pop(_ATTR, None)
    if report is not None:
        _undo(report)
    return report


@contextlib.contextmanager
def patched(model, **options):
    """`gems.patch(model, **options)` for the block; unpatched on exit (also on an exception) unless the
    model was already patched before the block."""
    already = model.__dict__.get(_ATTR) is not None
    report = patch(model, **options)
    try:
        yield report
    finally:
        if not already:
            unpatch(model)
