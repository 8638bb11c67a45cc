"""generate's stop check one step late on graphed caches: the host queues the next step while the GPU
runs this one.

After every token transformers' `generate` reads `unfinished_sequences.max() == 0` on the host, which
waits for the device to finish the step. Then the host prepares the next step's inputs (the mask, the
positions), launches it and, after it, the logits processors and stopping criteria. With the step one
graph replay, all of that host work is time the GPU idles: on an H200 host 0.7 ms of a 6.3 ms batch-32
Llama-2-7B token and 0.7 ms of a 4.9 ms batch-1 one (docs/perf.md).

transformers ships the remedy, `DeferredStopCheck`: the flag is copied to pinned host memory without
blocking and read one step later, so the host stays a step ahead. transformers turns it on for `mps`
only. For a cache from `graphed`'s pool (pool.py), `generate` here also takes it on CUDA. What that
changes, besides the time:
- when every sequence has stopped on an end-of-sequence token before `max_new_tokens`, one more step runs
  before the loop ends and transformers drops its token (the returned tokens, scores and logits are
  those without deferral); its keys and values stay in the pooled cache past the returned length,
  which the next `generate` resets;
- a sampling generate then draws once more at the very end, after every returned token (the same
  tokens for the same seed);
- a streamer gets each token one step later.
Not taken when generate returns the cache (`return_dict_in_generate=True`, a user's own cache):
transformers would then crop the extra step back out of it, and a StaticCache cannot be cropped
(transformers keeps the per-step check there, as without Gems). Nor for an assisted generation.

The decision is transformers' `DeferredStopCheck.is_supported`, wrapped once per process (`install`):
caches not registered here (`defer`) get transformers' own answer.
"""
from __future__ import annotations

import weakref

import torch

# the pooled caches whose generate defers its stop check (a cache leaves with the pool's eviction)
_DEFERRED: "weakref.WeakSet" = weakref.WeakSet()


def defer(cache):
    """Let `generate` on `cache` check its stop condition one step late (on CUDA, cache not returned)."""
    _DEFERRED.add(cache)


def forget(cache):
    _DEFERRED.discard(cache)


def deferred(device, cache, cache_is_returned: bool, is_assistant: bool) -> bool:
    """Whether generate on `device` with `cache` defers its stop check by Gems' rule (module docstring)."""
    return (cache is not None and not cache_is_returned and not is_assistant
            and torch.device(device).type == "cuda" and cache in _DEFERRED)


def install() -> bool:
    """Wrap transformers' `DeferredStopCheck.is_supported` (once per process) so registered caches defer
    on CUDA; False where this transformers has no DeferredStopCheck (the stop check then stays per step)."""
    try:
        from transformers.generation import utils
    except ImportError:
        return False
    cls = getattr(utils, "DeferredStopCheck", None)
    own = cls.__dict__.get("is_supported") if cls is not None else None
    if not isinstance(own, staticmethod):
        return False
    original = own.__func__
    if getattr(original, "gems_wraps", None) is not None:
        return True

    def is_supported(device, cache, cache_is_returned, is_assistant=False):
        return deferred(device, cache, cache_is_returned, is_assistant) or \
            original(device, cache, cache_is_returned, is_assistant=is_assistant)
    is_supported.gems_wraps = original
    is_supported.__doc__ = original.__doc__
    cls.is_supported = staticmethod(is_supported)
    return True
