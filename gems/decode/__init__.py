"""Decode through CUDA graphs: `model.generate(...)` with each one-token step captured once and replayed.

    import gems
    gems.patch(model)                                  # optional, first
    gems.enable()                                      # optional
    gems.decode.graphed(model, max_batch=8, max_cache_len=4096)
    out = model.generate(ids, max_new_tokens=64)       # prefill eager, decode steps replay graphs
    gems.decode.ungraphed(model)                       # the model exactly as before

A decode step is host-bound: the host issues every kernel launch of every layer for one token. A graph
replays the whole step's launches in one call. docs/decode.md says what is captured and what is not.

api.py: graphed / ungraphed; step.py: the forward that picks graph or eager; capture.py: warm-up,
capture, replay and the first replay's check; pool.py: the static caches graphs are bound to; kv_cache.py:
their layers' one-launch update; stop_check.py: generate's stop check one step late on those caches.
"""
from .api import graph_counts, graphed, replay_ms, ungraphed
from .capture import GraphCaptureError

__all__ = ["graphed", "ungraphed", "graph_counts", "replay_ms", "GraphCaptureError"]
