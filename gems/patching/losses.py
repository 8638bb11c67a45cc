"""The losses `gems.patch` routes through `gems.fused`: transformers' ForCausalLMLoss (on the logits, or
fused with the LM head so that training computes no logits) and BertForMaskedLM's loss."""
from __future__ import annotations

import functools
import inspect

import torch
from torch import nn

from .. import fused as F


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


def causal_lm_forward(cls_forward, out_cls, base_attr="model"):
    """A forward for a causal LM instance: with labels in training mode, the loss from the last hidden state
    of its base model (the attribute `base_attr`) by fused_linear_cross_entropy and logits=None; anything
    else runs the class's own forward."""

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
        outputs = getattr(self, base_attr)(**named, **extra)
        hidden = outputs[0]
        sl = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        loss = causal_lm_linear_loss(hidden[:, sl, :], self.lm_head, labels, **extra)
        rest = {f: getattr(outputs, f, None) for f in out_cls.__dataclass_fields__ if f not in ("loss", "logits")}
        out = out_cls(loss=loss, logits=None, **rest)
        return out if return_dict else out.to_tuple()
    return forward


def masked_lm_forward(cls_forward, out_cls):
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

