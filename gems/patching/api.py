"""`gems.patch`, `gems.unpatch` and `gems.patched`: the options, the model types, and the report's life
(kept on the model as ``model._gems_patch`` until unpatched)."""
from __future__ import annotations

import contextlib

from torch import nn

from .. import fused as F
from .losses import masked_lm_forward
from .report import PatchReport
from .walk import DECODERS, ENCODERS, TOP, VISION, Patcher

OPTIONS = ("rms_norm", "rope", "swiglu", "cross_entropy", "fused_linear_cross_entropy", "layer_norm", "encoder_layer")
SUPPORTED = tuple(sorted({*DECODERS, *ENCODERS, *TOP, "clip_vision_model"}))
_ATTR = "_gems_patch"


def _model_type(model) -> str:
    cfg = getattr(model, "config", None)
    mt = getattr(cfg, "model_type", None)
    if not mt:
        raise TypeError(f"gems.patch: {type(model).__name__} has no config.model_type; gems.patch takes a "
                        f"Hugging Face model of a supported type ({', '.join(SUPPORTED)})")
    return mt


def _unsupported(what: str) -> ValueError:
    return ValueError(f"gems.patch: model type '{what}' is not supported; supported: {', '.join(SUPPORTED)} "
                      f"(Aquila: build it as LlamaForCausalLM, as gems_models/ does; Llava with a "
                      f"{'/'.join(DECODERS)} language model and a CLIP vision tower)")


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
    """Replace, in place, the parts of a Hugging Face `model` that `gems.fused` serves (see the package
    docstring, gems/patching/__init__.py); returns a PatchReport (also kept as ``model._gems_patch`` until `unpatch`).

    `layer_norm` is off by default: a fused LayerNorm (+ residual add) replaces only two ATen ops and
    saves one elementwise pass, less than the host cost of its autograd Function where the step is
    host-bound. Measured on an H200 (BERT-base training 32 x 128, gems.enable(), time vs ATen eager):
    1.065x faster with it, 1.239x without, 1.152x unpatched (docs/perf.md).

    `encoder_layer` (BERT) runs each BertLayer as one function, with query, key and value as one GEMM,
    for the same reason: the host time of its 16 submodule calls and of the backward's extra launches
    (gems/patching/bert_layer.py says when it steps aside)."""
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
    p = Patcher(model, opts, report)
    cls = type(model).__name__
    try:
        if mt in DECODERS:
            _check_ops(opts, _needed(opts, decoder=True, causal=cls.endswith("ForCausalLM")))
            p.patch_decoder(model, "", mt)
            if cls.endswith("ForCausalLM"):
                p.patch_causal_lm_loss(mt, "CausalLMOutputWithPast")
        elif mt in ENCODERS:
            masked = cls == "BertForMaskedLM"
            _check_ops(opts, _needed(opts, bert=True, masked=masked))
            p.patch_bert(model, "")
            if masked and opts["cross_entropy"]:
                from transformers.modeling_outputs import MaskedLMOutput
                if p.set_forward(model, masked_lm_forward(type(model).forward, MaskedLMOutput), ""):
                    report.add("cross_entropy", "")
        elif mt in TOP:
            text_mt = getattr(getattr(model.config, "text_config", None), "model_type", None)
            vis_mt = getattr(getattr(model.config, "vision_config", None), "model_type", None)
            if text_mt not in DECODERS:
                raise _unsupported(f"llava with a '{text_mt}' language model")
            causal = cls == "LlavaForConditionalGeneration"
            _check_ops(opts, _needed(opts, decoder=True, causal=causal, clip=vis_mt in VISION))
            inner = model.model if hasattr(model, "model") else model
            lm, vt = getattr(inner, "language_model", None), getattr(inner, "vision_tower", None)
            if lm is not None:
                p.patch_decoder(lm, _qual(model, lm), text_mt)
            if vt is not None:
                if vis_mt in VISION:
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
        report.undo()
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


def unpatch(model):
    """Undo `gems.patch(model)`: the original module objects and attributes, exactly. Returns the report
    that was undone, or None when the model was not patched."""
    report = model.__dict__.pop(_ATTR, None)
    if report is not None:
        report.undo()
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
