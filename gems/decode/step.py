"""The forward `graphed` installs on a model: decode steps (input_ids [B, 1] on an initialized static
cache) replay a CUDA graph, everything else (prefill, a dynamic cache, grad mode, ...) runs the
model's own forward.

A graph is kept per cache and per step signature: the batch, each tensor argument's shape, dtype and
strides, the other arguments' values, Gems' active op selection, the model's `gems.patch` report and
its weights' storage (a `model.to(...)` or a reload captures anew). The cache tensors' addresses are
in the graph, so graphs belong to a cache: the pooled ones (gems/decode/pool.py) live as long as the
pool keeps the cache, those of a user's own `StaticCache` as long as that cache.
"""
from __future__ import annotations

import inspect
import warnings
import weakref

import torch

from ..dispatch import active_config
from .capture import StepGraph

# the keyword arguments a graphed step may carry besides its tensors (generate passes use_cache and
# return_dict); any other one runs the step eagerly
PLAIN_ARGS = {"use_cache": (True, None), "return_dict": (True, None), "output_attentions": (False, None),
              "output_hidden_states": (False, None)}
TENSOR_ARGS = ("input_ids", "attention_mask", "position_ids", "cache_position")   # the last: remote code
# graphs per cache (generate needs one; more means arguments that vary from step to step)
MAX_SIGNATURES = 8


def static_layers(cache) -> bool:
    """Whether every layer of `cache` is a StaticLayer (its position lives in a device tensor) or a
    StaticSlidingWindowLayer (a device tensor and a host int, which capture.py advances per replay), or
    Gems' one-launch form of either (kv_cache.py)."""
    from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

    from .kv_cache import AppendingSlidingWindowLayer, AppendingStaticLayer    # imports transformers too
    kinds = (StaticLayer, AppendingStaticLayer, StaticSlidingWindowLayer, AppendingSlidingWindowLayer)
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) in kinds for layer in layers)


def window_full(cache, step_len: int) -> bool:
    """Whether a layer counting its positions on the host would pass its capacity in this step: a
    sliding window's update then rolls the window (a branch the graph, captured before, does not hold);
    an AppendingStaticLayer's raises the IndexError of a full cache (which a replay could not)."""
    return any(layer.cumulative_length_int + step_len > layer.max_cache_len
               for layer in cache.layers if hasattr(layer, "cumulative_length_int"))


def graphs_available(device) -> bool:
    """Whether steps on `device` can be captured (CUDA graphs: CUDA tensors)."""
    return device.type == "cuda"


class DecodeStep:
    """The graphed forward's state: options, the graphs per cache, the notices already given."""

    def __init__(self, model, forward, *, max_batch: int, max_cache_len: int, warmups: int, verify: bool):
        self.model_ref = weakref.ref(model)
        self.forward = forward          # the model's forward when graphed() was called
        # generate reads the forward's parameters (which kwargs it takes, logits_to_keep): the same as before
        self.__signature__ = inspect.signature(forward)
        self.max_batch, self.max_cache_len = max_batch, max_cache_len
        self.warmups, self.verify = warmups, verify
        self.graphs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # cache -> {key: StepGraph}
        self.eager_caches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cache -> why eager
        self.facts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # cache -> (static layers, capacity)
        self.said: set = set()
        self.mempool = None
        self.counts = {"replayed": 0, "captured": 0, "eager": 0}

    # -------------------------------------------------------------------------------- notices
    def say(self, why: str):
        """One warning per distinct reason for the model's life under `graphed`."""
        if why not in self.said:
            self.said.add(why)
            warnings.warn(f"gems.decode: {why}", stacklevel=3)

    def drop(self, cache):
        self.graphs.pop(cache, None)

    # -------------------------------------------------------------------------------- the forward
    def __call__(self, *args, **kwargs):
        cache = kwargs.get("past_key_values")
        ids = kwargs.get("input_ids")
        if args or cache is None or not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[1] != 1 \
                or kwargs.get("inputs_embeds") is not None or not getattr(cache, "is_initialized", False):
            # not a one-token step on a filled cache: a prefill (a one-token prompt's too), or no cache
            return self.forward(*args, **kwargs)
        why = self.refusal(cache, ids, kwargs)
        if why is not None:
            self.counts["eager"] += 1
            self.say(why)
            return self.forward(**kwargs)
        return self.graphed_step(cache, kwargs)

    def refusal(self, cache, ids, kwargs):
        """Why this one-token step runs eagerly, or None when a graph serves it."""
        if cache in self.eager_caches:
            return self.eager_caches[cache]
        facts = self.facts.get(cache)
        if facts is None:     # per cache, once: neither changes while the cache lives
            facts = self.facts[cache] = (static_layers(cache), cache.get_max_length())
        is_static, capacity = facts
        if not is_static:
            return (f"the cache is a {type(cache).__name__} with other than static layers (a dynamic or "
                    f"offloaded cache): decode steps run eager")
        if not graphs_available(ids.device):
            return (f"no CUDA graphs on {ids.device.type}: decode steps run eagerly on the static cache "
                    f"(the same computation, without capture)")
        if torch.cuda.is_current_stream_capturing():
            return "a graph is being captured around the step: it runs inside it, eagerly"
        if torch.is_grad_enabled():
            return "grad mode is on: decode steps run eager (generate runs under no_grad)"
        model = self.model_ref()
        if model is not None and model.training:
            return "the model is in training mode: decode steps run eager"
        if ids.shape[0] > self.max_batch:
            return f"batch {ids.shape[0]} > max_batch {self.max_batch}: decode steps run eager"
        if capacity > self.max_cache_len:
            return f"a cache of {capacity} positions > max_cache_len {self.max_cache_len}: runs eager"
        if window_full(cache, ids.shape[1]):
            return "a sliding window (or the static cache) is full: the steps that roll the window run eager"
        for k, v in kwargs.items():
            if k == "past_key_values":
                continue
            if k in TENSOR_ARGS:
                if v is not None and (not isinstance(v, torch.Tensor) or v.device != ids.device):
                    return f"{k} is not a tensor on {ids.device} (a dict of masks?): decode steps run eager"
                if k == "attention_mask" and v is not None and v.shape[-1] != capacity:
                    # a 2D mask growing by one each step would need a graph per step
                    return "the attention mask does not span the cache's capacity: decode steps run eager"
            elif k == "logits_to_keep":
                if not isinstance(v, int):
                    return "logits_to_keep is not an int: decode steps run eager"
            elif k not in PLAIN_ARGS or isinstance(v, torch.Tensor) or v not in PLAIN_ARGS[k]:
                what = type(v).__name__ if isinstance(v, torch.Tensor) else repr(v)
                return f"argument {k}={what} is not captured: decode steps run eager"
        return None

    def key(self, kwargs):
        model = self.model_ref()
        first = next(model.parameters(), None) if model is not None else None
        sig = tuple(sorted((k, (tuple(v.shape), v.dtype, v.stride()) if isinstance(v, torch.Tensor) else v)
                           for k, v in kwargs.items() if k != "past_key_values"))
        return (sig, active_config(), id(model.__dict__.get("_gems_patch")) if model is not None else None,
                first.data_ptr() if first is not None else None)

    def graphed_step(self, cache, kwargs):
        graphs = self.graphs.setdefault(cache, {})
        key = self.key(kwargs)
        step = graphs.get(key)
        if step is not None and not step.holds(cache):
            # the cache reallocated its tensors under the graph (beam search's reorder_cache)
            self.graphs.pop(cache, None)
            why = "the cache's tensors were reallocated (beam search reorders the cache): decode steps run eager"
            self.eager_caches[cache] = why
            self.counts["eager"] += 1
            self.say(why)
            return self.forward(**kwargs)
        if step is None and len(graphs) >= MAX_SIGNATURES:
            self.counts["eager"] += 1
            self.say(f"more than {MAX_SIGNATURES} step signatures on one cache: the others run eager")
            return self.forward(**kwargs)
        if step is None:
            step = StepGraph(self.forward, cache, kwargs)
            step.warm_up(cache, self.warmups)
            if self.mempool is None:
                self.mempool = torch.cuda.graph_pool_handle()
            step.capture(cache, self.mempool)
            graphs[key] = step
            self.counts["captured"] += 1
        if step.bad is not None:
            self.counts["eager"] += 1
            return self.forward(**kwargs)
        if self.verify and not step.verified:
            out, why = step.first_replay(cache, kwargs)
            if why is not None:
                self.counts["eager"] += 1
                self.say(f"a CUDA graph's first replay disagreed with the eager step ({why}): this step "
                         f"signature runs eager from now on")
            else:
                self.counts["replayed"] += 1
            return out
        self.counts["replayed"] += 1
        return step.replay(cache, kwargs)
