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
                       gems/patching/bert_layer.py); BertForMaskedLM's loss -> ``cross_entropy``; with
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
architecture), as ``gems_models/`` does.

Everything is per model instance: replaced submodules keep their names and Parameter objects (so
``state_dict()`` keys, tied weights and optimizer state are unchanged), forwards are set on the instances,
and no module global of transformers is modified (RoPE: the attention forward runs as a copy of the same
function whose globals map ``apply_rotary_pos_emb`` to Gems'; a later change to that module global is not
seen by patched models). ``unpatch`` puts the original objects back. A module that already has an
instance forward or an accelerate hook (``device_map``, offloading) is left as is and counted in the
report's notes.

Patching a patched model with the same options is a no-op returning the existing report; with other
options it raises (``unpatch`` first). ``patched()`` unpatches on exit only what it patched itself.

The package, by job: `api.py` (patch / unpatch / patched: the options, which parts of the walk run for
which model type, the report's life), `walk.py` (the model types' transformers classes and the walk over
a model's modules that finds what to replace), `modules.py` (the replacement modules and forwards),
`losses.py` (the causal-LM and masked-LM losses), `bert_layer.py` (BERT's encoder layer as one
function), `report.py` (what was replaced, and how to undo it).
"""
from .api import OPTIONS, SUPPORTED, patch, patched, unpatch
from .report import PatchReport

__all__ = ["patch", "unpatch", "patched", "PatchReport", "SUPPORTED", "OPTIONS"]
