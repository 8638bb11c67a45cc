"""BERT's encoder layer as one function, for `gems.patch(model, encoder_layer=True)`.

Why: BERT-base training at 32 x 128 is host-bound (on an H200 its device time is about half of the
step), and a transformers 5.17 `BertLayer` spends much of its host time outside the ATen ops: 16
submodule calls (attention, self, query, key, value, output, dense, dropout, LayerNorm, intermediate,
its activation, output, dense, dropout, LayerNorm) and the attention-interface lookup, per layer and
step. `bert_layer_forward` computes what the original computes, reading each submodule's parameters
at call time, without those calls, and with query, key and value as one GEMM on their concatenated
weights (`FUSE_QKV`): the forward launches as many kernels (two cats and one GEMM for three GEMMs), the
backward one GEMM pair, one bias sum and one stack where the original runs three of each and two adds.
Measured on an H200 (BERT-base training 32 x 128, gems.patch + gems.enable()): the step 1.13x faster
with the fused QKV than without. Every other op is the original's, in the same order with the same
arguments (dropout masks included); with FUSE_QKV off the results are bit-identical to the class
forward's, with it on they differ by the GEMM's rounding.

It is taken only where it is the original's computation, checked on every call (`_parts`): an
encoder self-attention layer (no cross-attention, no KV cache, not causal) on the "sdpa" attention
implementation, no feed-forward chunking, plain `nn.Linear` / `nn.Dropout` / `nn.LayerNorm`
submodules (or gems.patch's own LayerNorm), and no hooks on any submodule it skips (transformers'
output-capturing hooks, or a user's). Anything else, including keyword arguments it does not know
(`output_attentions`), runs the class's own forward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as TF
from torch import nn
from torch.nn.modules import module as _module

from .. import fused

# keyword arguments that reach BertLayer from the model and that its encoder self-attention path ignores
# (BertModel passes position_ids down; sdpa_attention_forward drops what it does not name)
_BENIGN_KWARGS = frozenset({"position_ids", "cache_position", "num_items_in_batch", "output_hidden_states",
                            "use_cache", "return_dict"})
# the config's class overrides __getattribute__ (attribute_map): a microsecond per read through it
_getattribute = object.__getattribute__
_GLOBAL_HOOKS = (_module._global_forward_hooks, _module._global_forward_pre_hooks,
                 _module._global_backward_hooks, _module._global_backward_pre_hooks)


FUSE_QKV = True    # query, key and value as one GEMM (see the module docstring); False: bit-identical


def _hooked(m, own_forward=None) -> bool:
    """Whether calling m's forward directly would skip something its __call__ does: a hook, or an
    instance forward other than gems.patch's own `own_forward`."""
    if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
        return True
    f = m.__dict__.get("forward")
    return f is not None and getattr(f, "__func__", None) is not own_forward


def _parts(layer, classes):
    """The submodules of a BertLayer whose computation bert_layer_forward reproduces, or None.
    (Read through `_modules` and `__dict__`: nn.Module.__getattr__ and the config's attribute hooks cost
    microseconds each, and this runs for every layer of every step.)"""
    self_cls, gelu_cls, gems_ln, out_forward = classes
    try:
        mods = layer._modules
        att, inter, out = mods["attention"], mods["intermediate"], mods["output"]
        s, o = att._modules["self"], att._modules["output"]
        sm, om, im, outm = s._modules, o._modules, inter._modules, out._modules
        q, k, v, o_dense, o_drop, o_ln = sm["query"], sm["key"], sm["value"], om["dense"], om["dropout"], om["LayerNorm"]
        i_dense, out_dense, out_drop, out_ln = im["dense"], outm["dense"], outm["dropout"], outm["LayerNorm"]
        act = im.get("intermediate_act_fn") or inter.__dict__["intermediate_act_fn"]
    except KeyError:
        return None
    if (layer.chunk_size_feed_forward or type(s) is not self_cls or s.is_causal or att.is_cross_attention
            or _getattribute(s.config, "__dict__").get("_attn_implementation_internal") != "sdpa"
            or any(_GLOBAL_HOOKS)):
        return None
    lin = nn.Linear
    if not (type(q) is lin and type(k) is lin and type(v) is lin and type(o_dense) is lin and type(i_dense) is lin
            and type(out_dense) is lin and type(o_drop) is nn.Dropout and type(out_drop) is nn.Dropout
            and type(o_ln) is type(out_ln) and type(o_ln) in (nn.LayerNorm, gems_ln)):
        return None
    # _hooked's test written out over the instance dicts: 13 function calls per layer and step cost more
    # than the rest of this check
    for m in (att, s, q, k, v, o_dense, o_drop, o_ln, inter, i_dense, out_dense, out_drop, out_ln):
        d = m.__dict__
        if d["_forward_hooks"] or d["_forward_pre_hooks"] or d["_backward_hooks"] or d["_backward_pre_hooks"] \
                or "forward" in d:
            return None
    if _hooked(o, out_forward) or _hooked(out, out_forward):
        return None
    # GELUActivation is called as its function (a module call otherwise: its hooks then run as usual)
    act_fn = act.act if type(act) is gelu_cls and not _hooked(act) else act
    return s, q, k, v, o_dense, o_drop, o_ln, i_dense, act_fn, out_dense, out_drop, out_ln


def _add_norm(x, residual, ln, gems_ln):
    """LayerNorm(x + residual), as BertSelfOutput / BertOutput compute it (fused when gems.patch replaced
    the LayerNorm: the same computation as its add_layer_norm forward of those modules)."""
    if type(ln) is gems_ln:
        return fused.add_layer_norm(x, residual, ln.weight, ln.bias, ln.eps)[0]
    return TF.layer_norm(x + residual, ln.normalized_shape, ln.weight, ln.bias, ln.eps)


def make_bert_layer_forward(classes):
    """The forward for BertLayer instances; `classes` = (BertSelfAttention, GELUActivation, gems.patch's
    LayerNorm class, gems.patch's BertSelfOutput/BertOutput forward function)."""
    gems_ln = classes[2]

    def bert_layer_forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None,
                           encoder_attention_mask=None, past_key_values=None, **kwargs):
        parts = None
        if (encoder_hidden_states is None and past_key_values is None
                and (not kwargs or _BENIGN_KWARGS.issuperset(kwargs))):
            parts = _parts(self, classes)
        if parts is None:
            return type(self).forward(self, hidden_states, attention_mask, encoder_hidden_states,
                                      encoder_attention_mask=encoder_attention_mask,
                                      past_key_values=past_key_values, **kwargs)
        s, q, k, v, o_dense, o_drop, o_ln, i_dense, act, out_dense, out_drop, out_ln = parts
        # BertSelfAttention + transformers' sdpa_attention_forward (not causal: is_causal=False)
        shape = hidden_states.shape[:-1]
        heads = (*shape, -1, s.attention_head_size)
        if FUSE_QKV and q.bias is not None and k.bias is not None and v.bias is not None:
            # one [.., 3 x hidden] GEMM: 3 launches forward either way (two cats), but backward runs one
            # GEMM pair, one bias sum and one stack instead of three of each plus two adds
            w = torch.cat((q.weight, k.weight, v.weight))
            b = torch.cat((q.bias, k.bias, v.bias))
            ql, kl, vl = (t.transpose(1, 2) for t in
                          TF.linear(hidden_states, w, b).view(*shape, 3, -1, s.attention_head_size).unbind(-3))
        else:
            ql = TF.linear(hidden_states, q.weight, q.bias).view(*heads).transpose(1, 2)
            kl = TF.linear(hidden_states, k.weight, k.bias).view(*heads).transpose(1, 2)
            vl = TF.linear(hidden_states, v.weight, v.bias).view(*heads).transpose(1, 2)
        a = TF.scaled_dot_product_attention(
            ql, kl, vl, attn_mask=attention_mask, dropout_p=s.dropout.p if s.training else 0.0, scale=s.scaling,
            is_causal=False)
        a = a.transpose(1, 2).contiguous().reshape(*shape, -1).contiguous()
        # BertSelfOutput: dropout(dense(a)), then LayerNorm(+ hidden_states)
        a = TF.dropout(TF.linear(a, o_dense.weight, o_dense.bias), o_drop.p, o_drop.training, o_drop.inplace)
        a = _add_norm(a, hidden_states, o_ln, gems_ln)
        # BertIntermediate, BertOutput
        h = act(TF.linear(a, i_dense.weight, i_dense.bias))
        h = TF.dropout(TF.linear(h, out_dense.weight, out_dense.bias), out_drop.p, out_drop.training,
                       out_drop.inplace)
        return _add_norm(h, a, out_ln, gems_ln)

    return bert_layer_forward
