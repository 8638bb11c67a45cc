"""Building: a model with random weights on a device (meta for tracing), plus its example inputs."""
from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from .config import import_transformers, load_config
from .inputs import make_inputs
from .recipes import ModelError, Recipe, resolve


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


def _model_class(recipe: Recipe, config):
    transformers = import_transformers()
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
          dropout: Optional[float] = None, layers: Optional[int] = None) -> ModelBundle:
    """Build a model with random weights on ``device`` (meta for tracing), plus example inputs.

    ``layers`` builds every layer stack that deep (a shallow copy makes the same calls per layer).

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
        if layers is not None:
            raise ModelError(f"{recipe.name}: a module:function model has no config whose layers can be set")
        return _build_custom(recipe, size=size, device=dev, dtype=dt, batch=batch, seq_len=seq_len)
    config = load_config(recipe, size, layers)
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


# A config key holds a dropout probability when its name says so: `*dropout*` (attention_dropout,
# hidden_dropout_prob, summary_first_dropout, classifier_dropout, ...), GPT-2's `*_pdrop`, `layerdrop`,
# `drop_path_rate`. Only float values in [0, 1] are probabilities; other values under such names
# (None, a bool switch, a count) are left alone.
_DROPOUT_KEY = re.compile(r"dropout|pdrop|layerdrop|drop_path|drop_prob|drop_rate", re.IGNORECASE)


def _set_dropout(config, p: float, _seen=None):
    """Set every dropout probability of a config, and of every config nested in it (text, vision,
    encoder, decoder, ...), to ``p``."""
    PretrainedConfig = import_transformers().PretrainedConfig
    seen = set() if _seen is None else _seen
    if id(config) in seen:
        return
    seen.add(id(config))
    for k, v in list(vars(config).items()):
        if isinstance(v, PretrainedConfig):
            _set_dropout(v, p, seen)
        elif (isinstance(v, float) and 0.0 <= v <= 1.0 and _DROPOUT_KEY.search(k)):
            setattr(config, k, p)


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
