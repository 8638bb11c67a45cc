"""`gems.patch`, `gems.unpatch` and `gems.patched`: the options, the model types, and the report's life
(kept on the model as ``model._gems_patch`` until unpatched)."""
from __future__ import annotations

import contextlib

from torch import nn

from .. import fused as F
from ..runtime import tritonkey
from .report import PatchReport
from .walk import TESTED, Patcher

OPTIONS = ("rms_norm", "rope", "swiglu", "cross_entropy", "fused_linear_cross_entropy", "layer_norm", "encoder_layer",
           "moe", "moe_torch_gemm", "activation", "pack_projections")
SUPPORTED = TESTED      # the families checked one by one in the tests; any other model is walked the same way
_ATTR = "_gems_patch"
# a report's entry -> the gems.fused ops its replacement calls
_OPS = {"rms_norm": ("rms_norm",), "add_rms_norm": ("add_rms_norm",), "silu_and_mul": ("silu_and_mul",),
        "gelu_and_mul": ("gelu_and_mul",), "rope": ("rope",), "cross_entropy": ("cross_entropy",),
        "fused_linear_cross_entropy": ("fused_linear_cross_entropy",), "layer_norm": ("layer_norm",),
        "add_layer_norm": ("add_layer_norm",), "encoder_layer": (), "activation": (), "packed_linear": ()}


def _model_type(model) -> str:
    cfg = getattr(model, "config", None)
    return getattr(cfg, "model_type", None) or type(model).__name__


def _options(kw: dict) -> dict:
    return {k: bool(kw[k]) for k in OPTIONS}


def _check_ops(report: PatchReport):
    """Every fused op the patched model will call must be importable now, not at the first forward."""
    missing = []
    for name in sorted({op for k in report.replaced for op in _OPS.get(k, ())}):
        try:
            getattr(F, name)
        except (AttributeError, ImportError) as e:
            missing.append(f"{name} ({type(e).__name__}: {e})")
    if missing:
        raise RuntimeError("gems.patch: these fused ops are not available: " + "; ".join(missing)
                           + ". Pass the option that uses them as False to patch without them.")


def patch(model, *, rms_norm: bool = True, rope: bool = True, swiglu: bool = True, cross_entropy: bool = True,
          fused_linear_cross_entropy: bool = True, layer_norm: bool = False, encoder_layer: bool = True,
          moe: bool = True, moe_torch_gemm: bool = True, activation: bool = True,
          pack_projections: bool = False, strict: bool = False) -> PatchReport:
    """Replace, in place, the parts of a model that `gems.fused` serves and that are proven to compute
    what the model's own modules compute (see the package docstring, gems/patching/__init__.py); returns
    a PatchReport (also kept as ``model._gems_patch`` until `unpatch`). Parts recognized but not proven
    are left as is and listed in ``report.left``; with `strict`, any such part (one a fused op exists
    for) raises ValueError and the model is left unpatched.

    `layer_norm` is off by default: a fused LayerNorm (+ residual add) replaces only two ATen ops and
    saves one elementwise pass, less than the host cost of its autograd Function where the step is
    host-bound. Measured on an H200 (BERT-base training 32 x 128, gems.enable(), time vs ATen eager):
    1.065x faster with it, 1.239x without, 1.152x unpatched (docs/perf.md).

    `encoder_layer` (BERT) runs each BertLayer as one function, with query, key and value as one GEMM,
    for the same reason: the host time of its 16 submodule calls and of the backward's extra launches
    (gems/patching/bert_layer.py says when it steps aside).

    `moe`: sparse-MoE blocks through gems/patching/moe.py where it is installed and takes the block.
    `moe_torch_gemm`: their experts' six GEMMs through torch's grouped GEMM (bf16 on Hopper; Gems' kernels
    around them: gems/fused/moe_grouped.py) instead of Gems' Triton grouped GEMMs, whose backward is the
    slower one. Elsewhere (other dtypes, other GPUs) the Triton kernels serve either way. On an H200, a
    4-layer Mixtral training step (bf16, 4 x 1024) ran 1.44x ATen with it and 1.15x with the Triton
    GEMMs (docs/perf.md).

    `activation`: an activation module computing SiLU, GELU or GELU-tanh from several torch operations
    (GPT-2's gelu_new: eight kernels forward, each rounding to the model's dtype) runs the one torch
    operator instead (F.gelu(x, approximate="tanh")), proven on a probe input; Gems' kernel serves it
    under gems.enable().

    `pack_projections`: sibling Linears that read one input (q/k/v projections, gate/up) as one GEMM in
    calls that record no gradient (inference, decode): their weights become views of one tensor
    (gems/patching/packed.py; unpatch before `save_pretrained`, which refuses shared storage). Off by
    default: it targets batch-1 decode, where each GEMM's start costs, and there it gained little (an
    H200, Llama-2-7B graphed decode: 5.79 ms per token against 5.87 unpacked, docs/perf.md), while the
    shared storage changes what a model's state dict holds."""
    opts = _options(dict(rms_norm=rms_norm, rope=rope, swiglu=swiglu, cross_entropy=cross_entropy,
                         fused_linear_cross_entropy=fused_linear_cross_entropy, layer_norm=layer_norm,
                         encoder_layer=encoder_layer, moe=moe, moe_torch_gemm=moe_torch_gemm,
                         activation=activation, pack_projections=pack_projections))
    if not isinstance(model, nn.Module):
        raise TypeError(f"gems.patch takes a torch.nn.Module, got {type(model).__name__}")
    first = next(model.parameters(), None)
    if first is not None and first.is_cuda:
        tritonkey.start()   # the fused kernels' first compiles start from Triton's key (runtime/tritonkey.py)
    prev = model.__dict__.get(_ATTR)
    if prev is not None:
        if prev.options != opts:
            raise RuntimeError(f"gems.patch: the model is already patched with other options ({prev.options}); "
                               f"gems.unpatch(model) first")
        if strict and prev.unproven():
            raise _strict_error(prev)
        return prev
    report = PatchReport(model_type=_model_type(model), options=opts)
    p = Patcher(model, opts, report)
    try:
        losses = p.prove_losses()     # first: it runs the model's own forward, before anything is replaced
        p.walk(model)
        p.patch_losses(*losses)
        _check_ops(report)
        if strict and report.unproven():
            raise _strict_error(report)
    except BaseException:
        report.undo()
        raise
    if p.skipped:
        report.notes.append(f"{len(p.skipped)} module(s) with their own forward or an accelerate hook left as is "
                            f"(first: {p.skipped[0]})")
    object.__setattr__(model, _ATTR, report)
    return report


def _strict_error(report) -> ValueError:
    un = report.unproven()
    return ValueError(f"gems.patch(strict=True): {len(un)} part(s) of this {report.model_type} model were recognized "
                      f"but not proven equivalent to a fused op: "
                      + "; ".join(f"{e['module']} ({e['op']}): {e['why']}" for e in un[:8])
                      + ("; ..." if len(un) > 8 else ""))


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
