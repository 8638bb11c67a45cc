"""`graphed` and `ungraphed`: what they set on a model and how it is put back.

`graphed` sets four instance attributes, all recorded so `ungraphed` restores the model exactly:
- `model.forward`: the DecodeStep dispatcher around the forward the model had (with its signature, which
  generate inspects);
- `model.generate`: transformers' generate with `cache_implementation="static"` unless the call passes a
  cache or a cache implementation (its own or in its generation config); the model's generation_config
  is not touched, so a user's `past_key_values=StaticCache(...)` still works;
- `model._prepare_static_cache` (over transformers' method): caches from the pool;
- `model._valid_auto_compile_criteria`: False, so `generate` does not wrap the graphed forward in
  torch.compile (transformers compiles the decode step of a static cache on CUDA by itself).
With `defer_stop` (the default) the pool's caches are registered with stop_check.py, whose wrapper
around transformers' `DeferredStopCheck.is_supported` (installed once per process, transformers' own
answer for any other cache) lets generate read its stop flag a step late on them.
With `decode_attention` (the default) it also gives the text config's `_attn_implementation` the name
of Gems' decode attention (attention.py) in place of `sdpa`, and puts `sdpa` back.
"""
from __future__ import annotations

from typing import Optional

from torch import nn

from . import stop_check
from .attention import install as install_attention
from .pool import CachePool, capacity_bucket
from .step import DecodeStep

ATTR = "_gems_decode"
INSTANCE_ATTRS = ("forward", "generate", "_prepare_static_cache", "_valid_auto_compile_criteria",
                  "_previous_max_cache_length")


class Graphed:
    """What `graphed` changed on one model (kept as ``model._gems_decode`` until `ungraphed`)."""

    def __init__(self, model, options: dict):
        self.options = options
        self.saved = {k: (k in model.__dict__, model.__dict__.get(k)) for k in INSTANCE_ATTRS}
        forward = model.__dict__.get("forward") or type(model).forward.__get__(model)
        self.step = DecodeStep(model, forward, max_batch=options["max_batch"],
                               max_cache_len=options["max_cache_len"], warmups=options["warmups"],
                               verify=options["verify"])
        self.pool = CachePool(options["max_caches"], self.evict)
        # generate checks its stop condition one step late on the pooled caches (stop_check.py)
        self.defer_stop = options["defer_stop"] and stop_check.install()
        self.prepare_hf = type(model)._prepare_static_cache.__get__(model)
        self.generate_hf = model.__dict__.get("generate") or type(model).generate.__get__(model)
        # decode steps' attention by Gems' kernel, on the cache's keys as they are (attention.py)
        self.restore_attention = install_attention(model) if options["decode_attention"] else None

    def generate(self, *args, **kwargs):
        """transformers' generate, with a static cache unless the call chooses a cache (or none)."""
        gc = kwargs.get("generation_config")
        use_cache = kwargs.get("use_cache", getattr(gc or self.generate_hf.__self__.generation_config,
                                                    "use_cache", True))
        if kwargs.get("past_key_values") is None and kwargs.get("cache_implementation") is None \
                and getattr(gc, "cache_implementation", None) is None and use_cache is not False:
            kwargs["cache_implementation"] = "static"
        return self.generate_hf(*args, **kwargs)

    def prepare_static_cache(self, model, cache_implementation, batch_size, max_cache_len,
                             prefill_chunk_size=None, model_kwargs=None, **rest):
        """transformers' `_prepare_static_cache`, answered from the pool; what the pool does not serve
        gets transformers' own fresh cache, whose steps run eager (said once)."""
        from .kv_cache import static_cache    # imports transformers: only once a model generates
        o = self.options
        bucket = capacity_bucket(max_cache_len, o["min_cache_len"], o["max_cache_len"])
        why = None
        if cache_implementation != "static":
            why = f"cache_implementation={cache_implementation!r} is not pooled"
        elif prefill_chunk_size is not None:
            why = "chunked prefill (prefill_chunk_size) is not pooled"
        elif batch_size > o["max_batch"]:
            why = f"batch {batch_size} > max_batch {o['max_batch']}"
        elif bucket is None:
            why = f"{max_cache_len} positions > max_cache_len {o['max_cache_len']}"
        if why is not None:
            cache = self.prepare_hf(cache_implementation=cache_implementation, batch_size=batch_size,
                                    max_cache_len=max_cache_len, prefill_chunk_size=prefill_chunk_size,
                                    model_kwargs=model_kwargs, **rest)
            self.step.eager_caches[cache] = f"{why}: this generate call's decode steps run eager"
            return cache
        key = (batch_size, bucket, model.dtype, model.device)
        config = model.config.get_text_config(decoder=True)
        # its full-attention layers write a step's keys and values in one launch (kv_cache.py)
        cache = self.pool.get(key, lambda: static_cache(config, bucket))
        # a pooled cache refused for the last call (its tensors reallocated by beam search) starts over
        self.step.eager_caches.pop(cache, None)
        if self.defer_stop:
            stop_check.defer(cache)
        return cache

    def evict(self, cache):
        self.step.drop(cache)
        stop_check.forget(cache)

    def undo(self, model):
        ours = model.__dict__.get("forward") is self.step
        for k, (had, old) in self.saved.items():
            if k == "forward" and not ours:
                continue    # replaced since (gems.unpatch after graphed): not ours to put back
            if had:
                object.__setattr__(model, k, old)
            else:
                model.__dict__.pop(k, None)
        self.pool.clear()
        self.step.graphs.clear()
        if self.restore_attention is not None:
            self.restore_attention()
        return ours


def graphed(model, *, max_batch: int = 8, max_cache_len: int = 4096, min_cache_len: Optional[int] = None,
            max_caches: int = 4, warmups: int = 3, verify: bool = True, decode_attention: bool = True,
            defer_stop: bool = True):
    """Make `model.generate(...)` decode through CUDA graphs; returns the model.

    After this call `generate` uses a static KV cache (`cache_implementation="static"` unless the call
    passes its own cache or cache implementation: a user's StaticCache is graphed too); the prompt's
    forward (prefill) runs eagerly, and every one-token step is served by a CUDA graph captured once
    per (batch, cache-capacity bucket, step signature) and replayed. Caches come from a pool of at most
    `max_caches` StaticCaches, one per (batch <= max_batch, capacity bucket): powers of two and 1.5x
    powers of two from `min_cache_len` (default min(128, max_cache_len)) up to `max_cache_len`, reused (reset in place)
    by later generate calls, so their graphs replay. A call needing more is served eagerly by
    transformers' own cache, said once.

    Capture: `warmups` eager steps on a side stream first (compiles, tunes, records Gems' plans); the
    last under sync-error mode, so a step that synchronizes with the host raises GraphCaptureError, as
    does anything the capture refuses. With `verify`, each graph's first replay is compared with an
    eager step; on a mismatch that signature runs eager, with one warning.

    Without CUDA (the model on the CPU) the same static-cache path runs eagerly, said once: the API and
    its results are testable anywhere. Sampling (temperature, top-k, top-p) runs in generate's logits
    processors, eagerly, after the graph.

    Order with Gems: `gems.patch(model)` first, then `graphed(model)`; `gems.enable()` (or a
    `use_gems` scope) may be on or off: the active op selection is part of a graph's key, so each
    selection gets its own graph. Undo in reverse: `ungraphed(model)`, then `gems.unpatch(model)`.

    `decode_attention`: a model using transformers' `sdpa` attention runs its decode steps' attention
    in Gems' kernel, on the cache's keys and values and mask as they are (gems/decode/attention.py:
    no per-layer copy of a grouped-query cache, no per-layer mask conversion); its prefill keeps
    `sdpa`. False leaves the model's attention as it is.

    `defer_stop`: on the pooled caches, on CUDA, `generate` reads its stop condition one step late
    (transformers' DeferredStopCheck), so the host prepares and launches the next step while the GPU
    runs this one; when every sequence ends early on an end-of-sequence token one extra step runs and
    its token is dropped. Not when generate returns the cache (`return_dict_in_generate=True`).
    gems/decode/stop_check.py says what else it changes; False keeps transformers' per-step check."""
    if not isinstance(model, nn.Module) or not hasattr(model, "generate"):
        raise TypeError(f"gems.decode.graphed takes a transformers generative model, got {type(model).__name__}")
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError("gems.decode.graphed: encoder-decoder models are not supported (decoder-only LMs)")
    if not hasattr(type(model), "_prepare_static_cache"):
        raise ValueError("gems.decode.graphed: this transformers version has no _prepare_static_cache "
                         "(written for transformers 5.17)")
    if min_cache_len is None:
        min_cache_len = min(128, max_cache_len)
    if max_batch < 1 or min_cache_len < 1 or max_cache_len < min_cache_len or max_caches < 1 or warmups < 1:
        raise ValueError("gems.decode.graphed: need max_batch >= 1, 1 <= min_cache_len <= max_cache_len, "
                         "max_caches >= 1, warmups >= 1")
    options = dict(max_batch=max_batch, max_cache_len=max_cache_len, min_cache_len=min_cache_len,
                   max_caches=max_caches, warmups=warmups, verify=verify, decode_attention=bool(decode_attention),
                   defer_stop=bool(defer_stop))
    prev = model.__dict__.get(ATTR)
    if prev is not None:
        if prev.options != options:
            raise RuntimeError(f"gems.decode.graphed: the model is already graphed with other options "
                               f"({prev.options}); gems.decode.ungraphed(model) first")
        return model
    g = Graphed(model, options)
    object.__setattr__(model, "forward", g.step)
    object.__setattr__(model, "_prepare_static_cache",
                       lambda *a, **k: g.prepare_static_cache(model, *a, **k))
    object.__setattr__(model, "_valid_auto_compile_criteria", lambda *a, **k: False)
    object.__setattr__(model, "generate", g.generate)
    object.__setattr__(model, ATTR, g)
    return model


def ungraphed(model):
    """Undo `graphed(model)`: the model's forward, methods and generation config as before, the caches
    and graphs freed. Returns True when the model was graphed. If `model.forward` was replaced since
    (gems.unpatch after graphed), that forward is left and a warning says so."""
    import warnings
    g = model.__dict__.pop(ATTR, None)
    if g is None:
        return False
    if not g.undo(model):
        warnings.warn("gems.decode.ungraphed: model.forward was replaced after graphed() (gems.unpatch before "
                      "ungraphed?); it is left as it is now", stacklevel=2)
    return True


def graph_counts(model) -> dict:
    """{'captured', 'replayed', 'eager'}: the graphed model's decode steps so far (empty when not graphed)."""
    g = model.__dict__.get(ATTR)
    return dict(g.step.counts) if g is not None else {}


def replay_ms(model, runs: int = 20) -> Optional[float]:
    """Device milliseconds of one decode-step graph's replay alone, without generate's per-step work
    around it (the median of `runs`): the graph that served the last decode step of a cache, replayed on
    that step's inputs at that step's position (the cache is left as the step left it). None when no
    cache's last step was a replay. What `generate` spends per token beyond it is its work outside the
    graph (its small kernels, and host work the GPU waits for)."""
    g = model.__dict__.get(ATTR)
    for graphs in reversed(list(g.step.graphs.values()) if g is not None else ()):
        for s in reversed(list(graphs.values())):
            if s.graph is not None and s.bad is None:
                ms = s.replay_ms(runs)
                if ms is not None:
                    return ms
    return None
