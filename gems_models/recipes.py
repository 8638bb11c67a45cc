"""Recipes: the built-in models (configs shipped in gems_models/configs/), their aliases, and how a name,
a local config.json, a local model folder or module:function resolves to a recipe."""
from __future__ import annotations

import importlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional


class ModelError(ValueError):
    """Bad model input: unknown name, malformed config, unsupported mode. One line, no traceback."""


# --------------------------------------------------------------------------------------------- recipes
@dataclass(frozen=True)
class Recipe:
    """How to build one model: where its config comes from and what kind of inputs it takes."""

    name: str                       # canonical name (HF id for built-ins, the path or module:function otherwise)
    kind: str                       # causal_lm | masked_lm | llava | custom
    config_file: Optional[str] = None       # JSON file with the HF config (built-ins, local configs)
    config_dict: Optional[dict] = None      # already-parsed config (local folders/files)
    aliases: tuple = ()
    tiny: dict = field(default_factory=dict)   # overrides for the tiny variant (nested for llava)
    note: str = ""
    factory: Optional[Callable] = None     # module:function models
    source: str = "builtin"                 # builtin | config | function


_TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=4, vocab_size=256, max_position_embeddings=256)

BUILTIN: dict[str, Recipe] = {
    "meta-llama/Llama-2-7b": Recipe(
        name="meta-llama/Llama-2-7b", kind="causal_lm", config_file="llama-2-7b.json",
        aliases=("llama2", "llama-2-7b", "meta-llama/Llama-2-7b-hf"),
        tiny=dict(_TINY_LLAMA),
        note="Llama-2-7B (32 layers, hidden 4096, 32 heads, vocab 32000)"),
    "bert-base-uncased": Recipe(
        name="bert-base-uncased", kind="masked_lm", config_file="bert-base-uncased.json",
        aliases=("bert", "google-bert/bert-base-uncased"),
        tiny=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  vocab_size=256, max_position_embeddings=64),
        note="BERT base uncased, masked-LM head (12 layers, hidden 768, 12 heads)"),
    "llava-hf/llava-1.5-7b-hf": Recipe(
        name="llava-hf/llava-1.5-7b-hf", kind="llava", config_file="llava-1.5-7b-hf.json",
        aliases=("llava", "llava-1.5-7b", "llava-1.5-7b-hf"),
        tiny=dict(
            image_token_index=250, pad_token_id=0, image_seq_length=4, vocab_size=256,
            text_config=dict(_TINY_LLAMA),
            vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=2, image_size=28, patch_size=14, projection_dim=32)),
        note="LLaVA-1.5-7B: CLIP ViT-L/14 at 336 px + 2-layer GELU projector + Llama-2-7B-size decoder"),
    "BAAI/Aquila-7B": Recipe(
        name="BAAI/Aquila-7B", kind="causal_lm", config_file="aquila-7b.json",
        aliases=("aquila", "aquila-7b"),
        tiny=dict(_TINY_LLAMA, bos_token_id=1, eos_token_id=2, pad_token_id=0),
        note="Aquila-7B, built as LlamaForCausalLM with Aquila's config (vocab 100008, rms eps 1e-6, "
             "max pos 2048); the original remote-code AquilaForCausalLM is the Llama architecture"),
}

# Recipes that resolve by name but are not among the four built-ins that `report` and `roadmap` cover by
# default: the ~1.1B Llama that `gems-coverage bench` trains on one GPU. Its config is TinyLlama-1.1B's
# (TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T, same as its Chat-v1.0): hidden 2048, intermediate
# 5632, 22 layers, 32 heads / 4 KV heads, vocab 32000, rms eps 1e-5, max pos 2048, untied embeddings.
EXTRA: dict[str, Recipe] = {
    "TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T": Recipe(
        name="TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T", kind="causal_lm",
        config_file="llama-1.1b.json",
        aliases=("llama-1.1b", "tinyllama", "tinyllama-1.1b", "TinyLlama/TinyLlama-1.1B",
                 "TinyLlama/TinyLlama-1.1B-Chat-v1.0"),
        tiny=dict(_TINY_LLAMA, num_key_value_heads=2),   # keeps grouped-query attention
        note="Llama ~1.1B (TinyLlama-1.1B; grouped-query attention 32/4), for single-GPU training benchmarks"),
}
_RECIPES = {**BUILTIN, **EXTRA}

ALIASES: dict[str, str] = {}
for _r in _RECIPES.values():
    ALIASES[_r.name.lower()] = _r.name
    for _a in _r.aliases:
        ALIASES[_a.lower()] = _r.name


def builtin_names() -> list[str]:
    return list(BUILTIN)


def short_name(name: str) -> str:
    r = BUILTIN.get(name)
    return r.aliases[0] if r and r.aliases else name


# ------------------------------------------------------------------------------------------ resolving
def resolve(name: str) -> Recipe:
    """Name, alias, local config.json, local HF folder or module:function -> Recipe (ModelError if none)."""
    if not isinstance(name, str) or not name.strip():
        raise ModelError("empty model name")
    key = name.strip()
    if key.lower() in ALIASES:
        return _RECIPES[ALIASES[key.lower()]]
    p = Path(key).expanduser()
    if p.is_dir():
        cfg = p / "config.json"
        if not cfg.is_file():
            raise ModelError(f"{key}: folder has no config.json")
        return _recipe_from_config(key, cfg)
    if p.is_file():
        return _recipe_from_config(key, p)
    if ":" in key and not key.startswith(("/", ".")):
        mod, _, fn = key.partition(":")
        if mod.replace(".", "").replace("_", "").isalnum() and fn.isidentifier():
            return _recipe_from_function(key, mod, fn)
    known = ", ".join(f"{r.name} ({r.aliases[0]})" for r in _RECIPES.values())
    raise ModelError(f"unknown model '{key}': not a built-in ({known}), a local config.json or model "
                     f"folder, or module:function")


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise ModelError(f"{path}: cannot read config: {e}") from None
    except json.JSONDecodeError as e:
        raise ModelError(f"{path}: malformed config JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(data, dict):
        raise ModelError(f"{path}: malformed config: expected a JSON object")
    return data


def _kind_of(cfg: dict) -> str:
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs and isinstance(archs[0], str) else ""
    if "vision_config" in cfg and "text_config" in cfg:
        return "llava"
    if arch.endswith("ForMaskedLM") or cfg.get("model_type") in ("bert", "roberta", "distilbert"):
        return "masked_lm"
    if arch.endswith(("ForCausalLM", "LMHeadModel")) or arch in ("AquilaModel",):
        return "causal_lm"
    if arch:
        return "custom"
    return "causal_lm"


def _recipe_from_config(key: str, path: Path) -> Recipe:
    cfg = read_json(path)
    if "model_type" not in cfg:
        raise ModelError(f"{path}: malformed config: no 'model_type'")
    return Recipe(name=key, kind=_kind_of(cfg), config_dict=cfg, source="config",
                  note=f"local config {path}")


def _import_user_module(mod: str):
    """Import a module:function model's module: installed or on PYTHONPATH first, else from the current
    folder (the console script, unlike `python -m`, has no current folder on sys.path).

    The current folder joins sys.path only for that one import and only when the module is not found
    elsewhere: kept there, a folder in it that shares a package's name (a clone named `gems` beside the
    user's files) would load as a namespace package in place of the editable install."""
    cwd = os.getcwd()
    try:
        return importlib.import_module(mod)
    except ModuleNotFoundError as e:
        if e.name != mod.partition(".")[0] or cwd in sys.path or "" in sys.path:
            raise
    sys.path.append(cwd)
    try:
        return importlib.import_module(mod)
    finally:
        sys.path.remove(cwd)


def _recipe_from_function(key: str, mod: str, fn: str) -> Recipe:
    try:
        module = _import_user_module(mod)
    except ImportError as e:
        raise ModelError(f"{key}: cannot import module '{mod}': {e}") from None
    f = getattr(module, fn, None)
    if not callable(f):
        raise ModelError(f"{key}: module '{mod}' has no function '{fn}'")
    return Recipe(name=key, kind="custom", factory=f, source="function", note=f"{mod}.{fn}()")
