"""One decode step as a CUDA graph: static input buffers, eager warm-up, capture, replay, and the check
of the first replay against an eager step.

Warm-up: the step runs eagerly `warmups` times on a side stream before capture, so every kernel the
step launches is compiled, autotuned and has its call plan recorded (Gems' first calls do host work a
graph cannot hold). Three by default: a signature's first call compiles and tunes, its second records
the call plan (GEMS_PLAN_AFTER=2), the third replays the plan as the capture will. The last warm-up runs under `torch.cuda.set_sync_debug_mode("error")`: an op that
synchronizes with the host (`.item()`, `nonzero`, a device-to-host copy) cannot be captured, and
raises GraphCaptureError here rather than failing obscurely inside the capture.

The warm-ups and the check run the step on the live cache: each writes the KV of the current position
and advances the layers' `cumulative_length` counters. The counters are saved before and put back after
each, so the real step (the first replay) writes that position again with the same values.

Sliding-window layers (`StaticSlidingWindowLayer`) also count positions in a Python int, which picks
the branch their `update` takes and the mask's size. A replay runs no Python, so the int is advanced
after each replay, and the capture (which runs the Python once) puts it back. The graph holds the
branch of a window not yet full; the dispatcher replays it only while the window stays under its size.

The first replay is compared with an eager step on the same inputs (logits, per-dtype tolerance scaled
to the logits' magnitude); a mismatch marks the graph bad, the step is redone eagerly, and the caller
runs that shape eagerly from then on.
"""
from __future__ import annotations

import contextlib

import torch

from ..runtime import background

# max |graph - eager| allowed, as a fraction of max(1, max |eager logits|)
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}


class GraphCaptureError(RuntimeError):
    """The decode step cannot be captured into a CUDA graph (a host sync, an op capture forbids)."""


def save_lengths(layers) -> list:
    """Each layer's position counters: the device tensor and, on sliding-window layers, the host int."""
    return [(layer.cumulative_length.clone(), getattr(layer, "cumulative_length_int", None)) for layer in layers]


def restore_lengths(layers, saved):
    for layer, (t, n) in zip(layers, saved):
        layer.cumulative_length.copy_(t)
        if n is not None:
            layer.cumulative_length_int = n


def host_counted(layers) -> list:
    """The layers whose position is also a Python int (sliding-window layers)."""
    return [layer for layer in layers if hasattr(layer, "cumulative_length_int")]


@contextlib.contextmanager
def sync_errors():
    """Host syncs raise for the block (the process's previous sync debug mode is put back)."""
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(prev)


def cache_tensors(cache) -> list:
    out = []
    for layer in cache.layers:
        out += [layer.keys, layer.values, layer.cumulative_length]
    return out


def clone_tree(v, cache):
    """A step's output with its tensors copied out of the graph's static memory (the next replay
    overwrites it) and the cache passed through."""
    if v is cache:
        return cache
    if isinstance(v, torch.Tensor):
        return v.clone()
    if isinstance(v, (tuple, list)) and not hasattr(v, "keys"):
        return type(v)(clone_tree(x, cache) for x in v)
    if hasattr(v, "keys") and hasattr(v, "items"):     # a transformers ModelOutput (or a dict)
        return type(v)(**{k: clone_tree(x, cache) for k, x in v.items()})
    return v


def main_tensor(out):
    """The output the check compares: `logits`, else the first tensor."""
    t = getattr(out, "logits", None)
    if isinstance(t, torch.Tensor):
        return t
    items = out.values() if hasattr(out, "values") else out if isinstance(out, (tuple, list)) else (out,)
    return next((x for x in items if isinstance(x, torch.Tensor)), None)


def mismatch(got, ref):
    """None when `got` matches `ref` within TOLERANCE, else a description of the difference."""
    if got is None or ref is None or got.shape != ref.shape:
        return "the outputs' shapes differ"
    tol = TOLERANCE.get(ref.dtype, 1e-4) * max(1.0, float(ref.detach().abs().float().nan_to_num().max()))
    if not torch.isclose(got.float(), ref.float(), rtol=0.0, atol=tol, equal_nan=True).all():
        diff = (got.float() - ref.float()).abs().nan_to_num(float("inf")).max()
        return f"max |graph - eager| = {float(diff):.3g} > {tol:.3g}"
    return None


class StepGraph:
    """A captured decode step for one cache and one input signature. Holds the cache's layer list (and
    so its tensors: their addresses are in the graph) but not the cache object."""

    def __init__(self, forward, cache, kwargs: dict):
        self.forward = forward
        self.layers = cache.layers
        # the tensors whose addresses the graph holds: kept alive here, and compared by identity before
        # each replay (beam search's reorder_cache replaces them)
        self.tensors = cache_tensors(cache)
        self.names = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
        self.host_counted = host_counted(self.layers)
        self.step_len = kwargs["input_ids"].shape[1] if isinstance(kwargs.get("input_ids"), torch.Tensor) else 1
        self.static = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()
                       if k != "past_key_values"}
        self.graph = self.out = None
        self.verified = False
        self.bad = None     # why this graph is not replayed (its first replay disagreed with eager)
        self.last_end = None

    def holds(self, cache) -> bool:
        """Whether `cache` still has the tensors the graph was captured on."""
        return cache.layers is self.layers and all(a is b for a, b in zip(cache_tensors(cache), self.tensors))

    def load(self, kwargs):
        for k in self.names:
            self.static[k].copy_(kwargs[k])

    def warm_up(self, cache, n: int):
        saved = save_lengths(self.layers)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        try:
            # Gems' kernels compile here, on this thread, not in the background: the capture must find
            # them all (ATen's answers would be recorded into the graph)
            with torch.cuda.stream(side), background.inline():
                for i in range(n):
                    if i == n - 1 and n > 1:
                        try:
                            with sync_errors():
                                self.forward(**self.static, past_key_values=cache)
                        except RuntimeError as e:
                            if "synchroniz" not in str(e):
                                raise
                            raise GraphCaptureError(
                                f"gems.decode: the decode step synchronizes with the host, which a CUDA graph "
                                f"cannot capture ({e}). Run the model without it (gems.decode.ungraphed(model)) "
                                f"or remove the syncing op from the step") from e
                    else:
                        self.forward(**self.static, past_key_values=cache)
                    restore_lengths(self.layers, saved)
        finally:
            torch.cuda.current_stream().wait_stream(side)

    def capture(self, cache, pool):
        g = torch.cuda.CUDAGraph()
        saved = save_lengths(self.layers)
        background.wait()    # no compile thread at work while the stream captures
        try:
            with torch.cuda.graph(g, pool=pool), background.inline():
                out = self.forward(**self.static, past_key_values=cache)
        except GraphCaptureError:
            raise
        except Exception as e:  # noqa: BLE001 -- whatever capture refused, said with its cause
            raise GraphCaptureError(f"gems.decode: capturing the decode step into a CUDA graph failed: "
                                    f"{type(e).__name__}: {e}") from e
        finally:
            restore_lengths(self.layers, saved)   # the capture ran the Python once, and no kernel
        self.graph, self.out = g, out

    def replay(self, cache, kwargs):
        self.load(kwargs)
        self.graph.replay()
        end = None
        for layer in self.host_counted:
            end = layer.cumulative_length_int = layer.cumulative_length_int + self.step_len
        self.last_end = end     # the host position after this graph's latest replay (replay_ms)
        # copied out at once: the pool is shared by every graph of the model, and another graph's replay
        # may reuse this one's output memory
        return clone_tree(self.out, cache)

    def replay_ms(self, runs: int):
        """Device milliseconds of one replay alone (the median of `runs`, CUDA events around each), or
        None where the cache's last step was not this graph's replay (a later eager step, a reset, a
        layer without a host counter). Before each replay the position counters are moved back one step,
        so the replay writes the last step's position again, with the values that step wrote (its
        inputs are still in the static buffers); they are put back after each, and the cache is left as
        the step left it."""
        last = self.host_counted[-1] if self.host_counted else None
        if last is None or len(self.host_counted) != len(self.layers) or last.cumulative_length_int != self.last_end:
            return None
        saved = save_lengths(self.layers)
        back = [(t - self.step_len, n - self.step_len) for t, n in saved]
        times = []
        try:
            for _ in range(max(1, runs)):
                restore_lengths(self.layers, back)
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                self.graph.replay()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
        finally:
            restore_lengths(self.layers, saved)
        return sorted(times)[len(times) // 2]

    def first_replay(self, cache, kwargs):
        """(output, None) after checking the replay against an eager step, or (eager output, why) when
        they differ (the graph is then marked bad)."""
        saved = save_lengths(self.layers)
        ref = self.forward(**kwargs)
        ref_t = main_tensor(ref)
        ref_t = ref_t.clone() if ref_t is not None else None
        restore_lengths(self.layers, saved)
        out = self.replay(cache, kwargs)
        self.verified = True
        why = mismatch(main_tensor(out), ref_t)
        if why is None:
            return out, None
        self.bad = why
        restore_lengths(self.layers, saved)
        return self.forward(**kwargs), why
