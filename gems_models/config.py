"""Configs: a recipe's transformers config object, full size or tiny (same architecture, small dims)."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Optional

from .recipes import ModelError, Recipe, read_json

CONFIG_DIR = Path(__file__).resolve().parent / "configs"


def import_transformers():
    try:
        import transformers
    except ImportError as e:
        raise ModelError(f"the model recipes need transformers ({e}); install it with "
                         f"pip install 'transformers>=5' (or the 'models' extra: pip install -e '.[models]')") from None
    return transformers


# -------------------------------------------------------------------------------------------- configs
# Remote-code model types that are plain Llama underneath.
_LLAMA_LIKE = {"aquila": "llama"}


def load_config(recipe: Recipe, size: str = "full", layers: Optional[int] = None):
    """The transformers config object of a recipe (full size or tiny); `layers` sets every stack's depth
    (the shapes of each layer's calls stay those of the model)."""
    if recipe.factory is not None:
        raise ModelError(f"{recipe.name}: a module:function model has no config")
    if size not in ("full", "tiny"):
        raise ModelError(f"unknown size '{size}' (full or tiny)")
    d = copy.deepcopy(recipe.config_dict) if recipe.config_dict is not None else \
        read_json(CONFIG_DIR / recipe.config_file)
    if size == "tiny":
        d = _merge(d, recipe.tiny) if recipe.tiny else tiny_config(d)
    if layers is not None:
        if layers < 1:
            raise ModelError(f"layers must be >= 1 (got {layers})")
        d = with_layers(d, layers)
    return _config_from_dict(d, recipe.name)


_DEPTH_KEYS = ("num_hidden_layers", "n_layer", "num_layers")


def with_layers(d: dict, n: int) -> dict:
    """A copy of an HF-style config dict whose layer stacks (the model's and every nested config's) hold
    `n` layers; per-layer lists (`layer_types`) are cut to match."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            v = with_layers(v, n)
        elif k in _DEPTH_KEYS and isinstance(v, int):
            v = n
        elif k == "layer_types" and isinstance(v, list):
            v = v[:n]
        out[k] = v
    return out


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def tiny_config(d: dict) -> dict:
    """Shrink any HF-style config dict to a tiny variant of the same architecture."""
    d = copy.deepcopy(d)

    def shrink(c: dict, hidden: int, heads: int, vocab: Optional[int]):
        if "hidden_size" in c:
            c["hidden_size"] = hidden
        for k in ("num_attention_heads", "n_head"):
            if k in c:
                c[k] = heads
        if "num_key_value_heads" in c and c["num_key_value_heads"]:
            c["num_key_value_heads"] = heads
        if "head_dim" in c:
            c["head_dim"] = hidden // heads
        for k in ("intermediate_size", "ffn_dim"):
            if k in c:
                c[k] = hidden * 2
        for k in ("num_hidden_layers", "n_layer"):
            if k in c:
                c[k] = 2
        if vocab is not None and "vocab_size" in c:
            c["vocab_size"] = vocab
            for k in ("bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "cls_token_id"):
                v = c.get(k)
                if isinstance(v, int) and v >= vocab:
                    c[k] = {"bos_token_id": 1, "eos_token_id": 2}.get(k, 0)
                elif isinstance(v, list):
                    c[k] = [x if x < vocab else 2 for x in v]
        if "max_position_embeddings" in c and isinstance(c["max_position_embeddings"], int):
            c["max_position_embeddings"] = min(c["max_position_embeddings"], 256)
        return c

    if "vision_config" in d and "text_config" in d:
        shrink(d["text_config"], 64, 4, 256)
        v = shrink(d["vision_config"], 32, 2, None)
        v["image_size"], v["patch_size"] = 28, 14
        if "projection_dim" in v:
            v["projection_dim"] = 32
        for k in ("image_token_index", "image_token_id"):
            if k in d:
                d[k] = 250
        d["image_seq_length"] = 4
        if "vocab_size" in d:
            d["vocab_size"] = 256
        if isinstance(d.get("pad_token_id"), int) and d["pad_token_id"] >= 256:
            d["pad_token_id"] = 0
    else:
        shrink(d, 64, 4, 256)
    return d


def _config_from_dict(d: dict, name: str):
    CONFIG_MAPPING = import_transformers().CONFIG_MAPPING
    d = copy.deepcopy(d)
    mt = d.get("model_type")
    if mt in _LLAMA_LIKE:
        d["model_type"] = _LLAMA_LIKE[mt]
        d["architectures"] = ["LlamaForCausalLM"]
        d.pop("auto_map", None)
        mt = d["model_type"]
    if mt not in CONFIG_MAPPING:
        raise ModelError(f"{name}: unsupported model_type '{mt}' (transformers has no such architecture)")
    d.pop("model_type", None)
    try:
        return CONFIG_MAPPING[mt](**d)
    except Exception as e:  # transformers validates dims/heads etc.
        msg = str(e).strip().splitlines()[-1].strip() if str(e).strip() else type(e).__name__
        raise ModelError(f"{name}: malformed config: {msg}") from None
