"""Model recipes for gems-coverage: offline configs + builders, no weights, no network.

Four built-in models ship their public ``config.json`` values in ``gems_models/configs/`` (plus ``llama-1.1b``,
TinyLlama-1.1B's config, which resolves by name for ``gems-coverage bench`` but is not among the models
``report`` and ``roadmap`` cover by default):

=========================  ==========  =======================================================
name                       alias       built with
=========================  ==========  =======================================================
meta-llama/Llama-2-7b      llama2      ``LlamaForCausalLM``
bert-base-uncased          bert        ``BertForMaskedLM``
llava-hf/llava-1.5-7b-hf   llava       ``LlavaForConditionalGeneration`` (CLIP ViT-L/14-336 + Llama)
BAAI/Aquila-7B             aquila      ``LlamaForCausalLM`` with Aquila's config values (the original
                                       checkpoint uses remote code, ``AquilaForCausalLM``, which is the
                                       Llama architecture)
=========================  ==========  =======================================================

A model can also be named by a local ``config.json`` file, a local Hugging Face model folder (only its
``config.json`` is read; no weights are needed) or ``module:function`` (a function returning
``(model, inputs)``).

Every builder makes random weights: ``size="full"`` is the real architecture (use ``device="meta"`` to trace
a 7B model without memory), ``size="tiny"`` keeps the architecture with small dims for CPU runs.
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# one file per concern: recipes (names -> recipes), config (recipe -> transformers config, tiny variants),
# builder (config -> model with random weights), inputs (example inputs, the training loss)
from .recipes import (ALIASES, BUILTIN, EXTRA, ModelError, Recipe, builtin_names,  # noqa: E402
                      resolve, short_name)
from .config import CONFIG_DIR, load_config, tiny_config  # noqa: E402
from .inputs import make_inputs, training_loss  # noqa: E402
from .builder import ModelBundle, build, parse_dtype, run_defaults  # noqa: E402

__all__ = [
    "ModelError", "Recipe", "ModelBundle", "BUILTIN", "ALIASES", "builtin_names", "resolve", "build",
    "load_config", "tiny_config", "make_inputs", "training_loss", "parse_dtype", "EXTRA", "short_name",
    "CONFIG_DIR", "run_defaults",
]
