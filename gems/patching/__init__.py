"""One call to put `gems.fused` into a built Hugging Face model, and one call to take it out.

    import gems
    report = gems.patch(model)        # in place; returns what was replaced (also model._gems_patch)
    gems.enable()                     # composes: the unfused remainder runs on Gems' ATen ops
    ...
    gems.unpatch(model)               # the exact original module objects and attributes again

    with gems.patched(model, cross_entropy=False):
        model.generate(...)

What is replaced is decided by structure, for any model (transformers 5.x, written against 5.17): each
module is recognized by what it holds and replaced only where a check against its own forward proves the
fused op computes the same (gems/patching/probes.py: small random inputs, the module's forward against the
fused op's reference computation). Recognized but not proven: left as is and listed in ``report.left``
with the reason; ``gems.patch(model, strict=True)`` raises instead (and leaves the model unpatched).

=====================  ============================================================================
RMSNorm-like (1-D      -> ``GemsRMSNorm`` (``gems.fused.rms_norm``, same weight Parameter), with the
weight, eps; q/k norms casting rule and offset the check finds: Llama's ``weight * h.to(dtype)``,
too)                   Gemma's ``(h * (1 + w)).to(dtype)`` (offset 1), OLMo2's ``(w * h).to(dtype)``
                       (``rms_norm``)
decoder layer          residual add + post-attention norm -> ``add_rms_norm``, where the layer's forward
                       is transformers' Llama or Mixtral decoder layer's own code (Llama, Mistral, Qwen2/3,
                       Gemma, Qwen3-MoE, Mixtral, ...; Gemma 2/3, Phi-3, OLMo2, GLM4, Granite differ: left,
                       not strict)
gated MLP              down(act(gate(x)) * up(x)) with separate gate/up projections or one
                       ``gate_up_proj`` (Phi-3, GLM4), act proven SiLU / GELU / GELU-tanh ->
                       ``silu_and_mul`` / ``gelu_and_mul`` (``swiglu``); an ungated MLP (GPT-2, NeoX,
                       CLIP, ViT) has no fused op: listed, not strict
rotary attention       a forward calling a module-global ``apply_rotary_pos_emb`` proven to be the
                       rotate-half form, or GLM4's interleaved form -> ``gems.fused.rope``
                       (``rope``, ``interleaved=True`` for GLM4); partial rotary (cos narrower than
                       the head: GPT-NeoX, Phi-3, GLM4) the fused op on the rotated channels where the
                       function is proven to pass the rest through, else the original function
composite activation   a module without parameters computing SiLU / GELU / GELU-tanh from several torch
                       operations (GPT-2's ``gelu_new``, ``gelu_fast``) -> the one operator
                       (``F.gelu(x, approximate="tanh")``), proven on a probe input (``activation``)
sparse-MoE block       ``experts`` beside a router -> gems/patching/moe.py's ``patch_moe_block``
                       (``moe``), when it is present and takes the block; else left. Its experts'
                       GEMMs: torch's grouped GEMM for bf16 on Hopper (``moe_torch_gemm``), else Gems'
                       Triton grouped GEMMs
causal LM loss         an ``lm_head`` Linear whose forward calls ``loss_function`` (ForCausalLMLoss):
                       the loss -> ``cross_entropy``; with labels in training mode, where the logits are
                       exactly lm_head(the base model's last hidden state) and the loss is the loss
                       function's alone, the loss from the hidden state by
                       ``fused_linear_cross_entropy``, **logits not computed (``logits=None``)**
                       (Gemma 2's soft-capped, Granite's scaled logits and MoE router losses: left).
                       Labels shifted, ``ignore_index``, ``shift_labels`` and ``num_items_in_batch``
                       as in transformers' ``ForCausalLMLoss``
masked LM loss         ``*ForMaskedLM`` whose loss is the mean cross entropy of its logits (BERT,
                       RoBERTa) -> ``cross_entropy``
``layer_norm=True``    every plain ``nn.LayerNorm`` -> ``gems.fused.layer_norm``; LayerNorm(dropout(
(opt-in, see `patch`)  dense(h)) + input) modules (BertSelfOutput / BertOutput, RoBERTa's), CLIP's
                       encoder layer and GPT-2's block (the attention's residual add + ln_2): the
                       residual add + norm -> ``add_layer_norm`` (autocast or two dtypes: as before)
BERT layer (per       each layer whose forward and submodules' forwards are ``BertLayer``'s own code
family)                (BERT, RoBERTa) -> one function computing the same without its 16 submodule
                       calls, query/key/value as one GEMM (``encoder_layer``; checked per call:
                       gems/patching/bert_layer.py)
``pack_projections``   sibling ``nn.Linear``s reading one input (``q_proj``/``k_proj``/``v_proj``,
(opt-in)               ``gate_proj``/``up_proj``): their weights as rows of one tensor, one GEMM for the
                       group in calls that record no gradient, each its own otherwise
                       (gems/patching/packed.py: the separate Linears' results whatever calls them)
=====================  ============================================================================

Tested family by family (tests/fused/test_families.py, ``SUPPORTED``): llama, mistral, qwen2, qwen3,
gemma, gemma2, gemma3_text, phi3, gpt2, gpt_neox, olmo2, glm4, granite, mixtral, qwen3_moe, bert,
roberta, vit, clip_vision_model, llava. Not fused: the MLP's residual add with the next layer's input norm
(a decoder layer must return the summed hidden state: ``output_hidden_states`` records it).

Everything is per model instance: replaced submodules keep their names and Parameter objects (so
``state_dict()`` keys, tied weights and optimizer state are unchanged), forwards are set on the instances,
and no module global of transformers is modified (RoPE: the attention forward runs as a copy of the same
function whose globals map ``apply_rotary_pos_emb`` to Gems'; a later change to that module global is not
seen by patched models). ``unpatch`` puts the original objects back. A module that already has an
instance forward or an accelerate hook (``device_map``, offloading) is left as is and counted in the
report's notes.

Patching a patched model with the same options is a no-op returning the existing report; with other
options it raises (``unpatch`` first). ``patched()`` unpatches on exit only what it patched itself.

The package, by job: `api.py` (patch / unpatch / patched: the options, strict, the report's life),
`walk.py` (the walk over a model's modules that recognizes what to replace), `probes.py` (the checks that
prove a replacement equivalent), `modules.py` (the replacement modules and forwards),
`losses.py` (the causal-LM and masked-LM losses), `bert_layer.py` (BERT's encoder layer as one
function), `moe.py` (sparse-MoE blocks), `packed.py` (sibling Linears as one GEMM), `report.py` (what was
replaced, and how to undo it).
"""
from .api import OPTIONS, SUPPORTED, patch, patched, unpatch
from .report import PatchReport

__all__ = ["patch", "unpatch", "patched", "PatchReport", "SUPPORTED", "OPTIONS"]
