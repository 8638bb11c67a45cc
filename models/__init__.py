"""Model recipes for gems-coverage: offline configs + builders, no weights, no network.

Four built-in models ship their public ``config.json`` values in ``models/configs/`` (plus ``llama-1.1b``,
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

import copy
import importlib
import inspect
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

CONFIG_DIR = Path(__file__).resolve().parent / "configs"

__all__ = [
    "ModelError", "Recipe", "ModelBundle", "BUILTIN", "ALIASES", "builtin_names", "resolve", "build",
    "load_config", "tiny_config", "make_inputs", "training_loss", "parse_dtype",
]


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


def _read_json(path: Path) -> dict:
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
    cfg = _read_json(path)
    if "model_type" not in cfg:
        raise ModelError(f"{path}: malformed config: no 'model_type'")
    return Recipe(name=key, kind=_kind_of(cfg), config_dict=cfg, source="config",
                  note=f"local config {path}")


def _recipe_from_function(key: str, mod: str, fn: str) -> Recipe:
    try:
        module = importlib.import_module(mod)
    except ImportError as e:
        raise ModelError(f"{key}: cannot import module '{mod}': {e}") from None
    f = getattr(module, fn, None)
    if not callable(f):
        raise ModelError(f"{key}: module '{mod}' has no function '{fn}'")
    return Recipe(name=key, kind="custom", factory=f, source="function", note=f"{mod}.{fn}()")


# -------------------------------------------------------------------------------------------- configs
# Remote-code model types that are plain Llama underneath.
_LLAMA_LIKE = {"aquila": "llama"}


def load_config(recipe: Recipe, size: str = "full"):
    """The transformers config object of a recipe (full size or tiny)."""
    if recipe.factory is not None:
        raise ModelError(f"{recipe.name}: a module:function model has no config")
    if size not in ("full", "tiny"):
        raise ModelError(f"unknown size '{size}' (full or tiny)")
    d = copy.deepcopy(recipe.config_dict) if recipe.config_dict is not None else \
        _read_json(CONFIG_DIR / recipe.config_file)
    if size == "tiny":
        d = _merge(d, recipe.tiny) if recipe.tiny else tiny_config(d)
    return _config_from_dict(d, recipe.name)


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
    CONFIG_MAPPING = _transformers().CONFIG_MAPPING
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


# --------------------------------------------------------------------------------------------- building
@dataclass
class ModelBundle:
    """A built model plus everything needed to run it."""

    recipe: Recipe
    model: Any
    config: Any
    size: str
    device: str
    dtype: Any
    inputs: dict = field(default_factory=dict)         # forward kwargs (inference)
    train_inputs: dict = field(default_factory=dict)   # forward kwargs with labels (training)
    custom_args: tuple = ()                            # positional inputs of module:function models

    @property
    def kind(self) -> str:
        return self.recipe.kind


_DTYPES = {"float32": "float32", "fp32": "float32", "float": "float32", "float16": "float16",
           "fp16": "float16", "half": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float64": "float64", "fp64": "float64", "double": "float64"}


def run_defaults(device_type: str, size=None, dtype=None, seq_len=None):
    """(size, dtype name, torch dtype, seq_len) with the tools' defaults filled in: a tiny fp32 model
    on CPU (the interpreter is slow), the full-size bf16 model elsewhere."""
    size = size or ("tiny" if device_type == "cpu" else "full")
    if dtype is None:
        dtype = "float32" if device_type == "cpu" else "bfloat16"
    if seq_len is None:
        seq_len = 8 if size == "tiny" else 128
    return size, dtype, parse_dtype(dtype), seq_len


def parse_dtype(name):
    import torch
    if isinstance(name, torch.dtype):
        return name
    key = _DTYPES.get(str(name).lower().replace("torch.", ""))
    if key is None:
        raise ModelError(f"unknown dtype '{name}' (float32, float16, bfloat16, float64)")
    return getattr(torch, key)


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise ModelError(f"the model recipes need transformers ({e}); install it with "
                         f"pip install 'transformers>=5' (or the 'models' extra: pip install -e '.[models]')") from None
    return transformers


def _model_class(recipe: Recipe, config):
    transformers = _transformers()
    if recipe.kind == "llava":
        return transformers.LlavaForConditionalGeneration
    archs = getattr(config, "architectures", None) or []
    for a in archs:
        cls = getattr(transformers, a, None)
        if cls is not None and hasattr(cls, "_from_config"):
            return cls
    if recipe.kind == "masked_lm":
        return transformers.AutoModelForMaskedLM
    return transformers.AutoModelForCausalLM


def build(name_or_recipe, *, size: str = "full", device="meta", dtype="float32", batch: int = 1,
          seq_len: int = 16, seed: int = 0, attn_implementation: Optional[str] = None,
          dropout: Optional[float] = None) -> ModelBundle:
    """Build a model with random weights on ``device`` (meta for tracing), plus example inputs.

    ``dropout=0.0`` zeroes every dropout probability in the config (parity runs use it so that training
    is deterministic); None keeps the model's own values.
    """
    import torch
    recipe = name_or_recipe if isinstance(name_or_recipe, Recipe) else resolve(name_or_recipe)
    dt = parse_dtype(dtype)
    dev = torch.device(device)
    if batch < 1 or seq_len < 1:
        raise ModelError("batch and seq-len must be >= 1")
    torch.manual_seed(seed)
    if recipe.factory is not None:
        return _build_custom(recipe, size=size, device=dev, dtype=dt, batch=batch, seq_len=seq_len)
    config = load_config(recipe, size)
    if dropout is not None:
        _set_dropout(config, dropout)
    if attn_implementation:
        config._attn_implementation = attn_implementation
    cls = _model_class(recipe, config)
    prev = torch.get_default_dtype()
    try:
        if dt.is_floating_point:
            torch.set_default_dtype(dt)
        with dev:
            if cls.__name__.startswith("Auto"):
                model = cls.from_config(config)
            else:
                model = cls._from_config(config)
    except ModelError:
        raise
    except Exception as e:
        raise ModelError(f"{recipe.name}: cannot build the model from its config: "
                         f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    finally:
        torch.set_default_dtype(prev)
    model = model.to(dtype=dt)
    model.eval()
    bundle = ModelBundle(recipe=recipe, model=model, config=config, size=size, device=str(dev), dtype=dt)
    bundle.inputs, bundle.train_inputs = make_inputs(recipe.kind, config, batch=batch, seq_len=seq_len,
                                                     device=dev, dtype=dt, seed=seed)
    return bundle


def _set_dropout(config, p: float):
    for c in (config, getattr(config, "text_config", None), getattr(config, "vision_config", None)):
        if c is None:
            continue
        for k in list(vars(c)):
            if ("dropout" in k and isinstance(getattr(c, k), float)) or k in ("attention_dropout",):
                setattr(c, k, p)


def _build_custom(recipe: Recipe, *, size, device, dtype, batch, seq_len) -> ModelBundle:
    import torch
    f = recipe.factory
    try:
        params = inspect.signature(f).parameters
    except (TypeError, ValueError):
        params = {}
    offered = dict(device=device, dtype=dtype, size=size, batch=batch, seq_len=seq_len)
    accepts_kw = any(p.kind == p.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in offered.items() if accepts_kw or k in params}
    try:
        out = f(**kwargs)
    except Exception as e:
        raise ModelError(f"{recipe.name}: the function raised {type(e).__name__}: {e}") from None
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], torch.nn.Module)):
        raise ModelError(f"{recipe.name}: the function must return (model, inputs) with a torch.nn.Module")
    model, inputs = out
    b = ModelBundle(recipe=recipe, model=model, config=getattr(model, "config", None), size=size,
                    device=str(device), dtype=dtype)
    if isinstance(inputs, dict):
        b.inputs = dict(inputs)
    elif isinstance(inputs, (tuple, list)):
        b.custom_args = tuple(inputs)
    elif isinstance(inputs, torch.Tensor):
        b.custom_args = (inputs,)
    else:
        raise ModelError(f"{recipe.name}: inputs must be a dict of kwargs, a tuple of args or a tensor")
    b.train_inputs = dict(b.inputs)
    return b


# ---------------------------------------------------------------------------------------------- inputs
def make_inputs(kind: str, config, *, batch: int, seq_len: int, device, dtype, seed: int = 0):
    """Realistic example inputs: (inference kwargs, training kwargs with labels).

    Token ids are random in the normal-token range (special tokens and the image token excluded); attention
    masks are all ones (a batch of equal-length prompts, the common serving case); BERT gets a [CLS]/[SEP]
    frame, token types and MLM labels on ~15% of the positions; Llava gets ``image_seq_length`` image
    tokens after BOS, pixel values in the CLIP-normalized range and labels that ignore the image positions.
    """
    import torch
    g = torch.Generator().manual_seed(seed + 1)
    if kind == "llava":
        tc = config.text_config
        vocab = tc.vocab_size
        n_img = int(getattr(config, "image_seq_length", 0) or _image_tokens(config))
        img_id = int(config.image_token_index)
        hi = min(vocab, img_id) if img_id > 3 else vocab
        text = torch.randint(3, hi, (batch, seq_len), generator=g)
        ids = torch.cat([torch.full((batch, 1), 1), torch.full((batch, n_img), img_id), text], dim=1)
        vc = config.vision_config
        pix = torch.randn(batch, getattr(vc, "num_channels", 3), vc.image_size, vc.image_size, generator=g)
        mask = torch.ones_like(ids)
        labels = ids.clone()
        labels[:, : 1 + n_img] = -100
        inf = dict(input_ids=ids, attention_mask=mask, pixel_values=pix)
        tr = dict(inf, labels=labels)
    elif kind == "masked_lm":
        vocab = config.vocab_size
        ids = torch.randint(5, vocab, (batch, seq_len), generator=g)
        if seq_len >= 3:
            ids[:, 0] = min(101, vocab - 1)   # [CLS]
            ids[:, -1] = min(102, vocab - 1)  # [SEP]
        mask = torch.ones_like(ids)
        tt = torch.zeros_like(ids)
        labels = torch.full_like(ids, -100)
        pick = torch.rand(batch, seq_len, generator=g) < 0.15
        pick[:, 1 if seq_len > 2 else 0] = True   # at least one masked position per row
        labels[pick] = ids[pick]
        masked = ids.clone()
        masked[pick] = min(103, vocab - 1)        # [MASK]
        inf = dict(input_ids=ids, attention_mask=mask, token_type_ids=tt)
        tr = dict(input_ids=masked, attention_mask=mask, token_type_ids=tt, labels=labels)
    else:
        vocab = getattr(config, "vocab_size", None) or 256
        ids = torch.randint(3, vocab, (batch, seq_len), generator=g)
        bos = getattr(config, "bos_token_id", None)
        if isinstance(bos, int) and 0 <= bos < vocab:
            ids[:, 0] = bos
        mask = torch.ones_like(ids)
        inf = dict(input_ids=ids, attention_mask=mask)
        tr = dict(inf, labels=ids.clone())

    def move(d):
        out = {}
        for k, v in d.items():
            v = v.to(device)
            if v.is_floating_point():
                v = v.to(dtype)
            out[k] = v
        return out
    return move(inf), move(tr)


def _image_tokens(config) -> int:
    vc = config.vision_config
    n = (vc.image_size // vc.patch_size) ** 2
    if getattr(config, "vision_feature_select_strategy", "default") == "full":
        n += 1
    return n


def training_loss(outputs):
    """The loss of a forward output: ``.loss`` when the model computed one, else the mean of the output."""
    import torch
    loss = getattr(outputs, "loss", None)
    if loss is None and isinstance(outputs, dict):
        loss = outputs.get("loss")
    if loss is not None:
        return loss
    t = outputs
    if not isinstance(t, torch.Tensor):
        leaves = [x for x in (outputs.values() if isinstance(outputs, dict) else outputs)
                  if isinstance(x, torch.Tensor) and x.is_floating_point()]
        if not leaves:
            raise ModelError("the model output has no floating-point tensor to build a loss from")
        t = leaves[0]
    return t.float().mean()
