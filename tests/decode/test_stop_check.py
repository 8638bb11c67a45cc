"""gems.decode's deferred stop check (gems/decode/stop_check.py): which generate calls take transformers'
DeferredStopCheck, and that a generate ending early on end-of-sequence tokens returns what plain
generate returns though it runs one more step.

On the CPU the deferred loop runs with a stand-in for torch.Event (the CPU has no events) and the
CUDA-only rule lifted; with GEMS_TEST_DEVICE=cuda it runs on real graphs and events."""
from __future__ import annotations

import warnings

import pytest
import torch
from decode_models import prompt, tiny_llama
from harness import ON_GPU
from transformers import StaticCache
from transformers.generation import utils as gen_utils

import gems.decode as D
from gems.decode import stop_check


def generate(model, ids, n, **kw):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")     # the CPU's "no CUDA graphs" notice
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                              pad_token_id=0, **kw)


def pooled_cache(model, ids):
    """The pool's cache a generate of `model` ran on (after one generate)."""
    return next(iter(model.__dict__[D.api.ATTR].pool.caches.values()))


def decode_steps(model) -> int:
    """One-token steps run so far: replays and eager steps (a capture's step is its first replay)."""
    counts = D.graph_counts(model)
    return counts["replayed"] + counts["eager"]


class HostEvent:
    """torch.Event for the CPU, where work is done when it is issued."""

    def __init__(self, *a, **k):
        pass

    def record(self, *a, **k):
        pass

    def synchronize(self):
        pass


@pytest.fixture
def deferral_anywhere(monkeypatch):
    """The deferred loop on any device: on the CPU, events that are done at once and the CUDA-only rule
    lifted (stop_check.deferred is what the wrapped is_supported asks)."""
    if not ON_GPU:
        rule = stop_check.deferred
        monkeypatch.setattr(torch, "Event", HostEvent)
        monkeypatch.setattr(stop_check, "deferred",
                            lambda device, cache, returned, assistant: rule("cuda", cache, returned, assistant))


def is_supported(device, cache, returned):
    return gen_utils.DeferredStopCheck.is_supported(torch.device(device), cache, returned, is_assistant=False)


def test_which_calls_defer():
    """A pooled cache defers on CUDA when generate does not return it; transformers' own answer for
    every other cache (no deferral off mps), after ungraphed, and with defer_stop=False."""
    model = tiny_llama()
    ids = prompt(1, 5)
    D.graphed(model, max_batch=1, max_cache_len=64)
    try:
        generate(model, ids, 3)
        pooled = pooled_cache(model, ids)
        assert is_supported("cuda", pooled, False)
        assert not is_supported("cuda", pooled, True)        # returned: a StaticCache cannot be cropped
        assert not is_supported("cpu", pooled, False)
        assert not gen_utils.DeferredStopCheck.is_supported(torch.device("cuda"), pooled, False, is_assistant=True)
        other = StaticCache(config=model.config, max_cache_len=16)
        assert not is_supported("cuda", other, False)
    finally:
        D.ungraphed(model)
    assert not is_supported("cuda", pooled, False)           # the pool's eviction forgets it
    D.graphed(model, max_batch=1, max_cache_len=64, defer_stop=False)
    try:
        generate(model, ids, 3)
        assert not is_supported("cuda", pooled_cache(model, ids), False)
    finally:
        D.ungraphed(model)


def test_install_is_idempotent_and_keeps_transformers_answer():
    assert stop_check.install() and stop_check.install()
    wrapped = gen_utils.DeferredStopCheck.__dict__["is_supported"].__func__
    original = wrapped.gems_wraps
    assert getattr(original, "gems_wraps", None) is None      # wrapped once, not twice
    for device in ("cpu", "cuda", "mps"):
        for returned in (False, True):
            assert is_supported(device, None, returned) == original(torch.device(device), None, returned,
                                                                    is_assistant=False)


@pytest.mark.parametrize("defer", [True, False], ids=["deferred", "per-step"])
def test_early_end_of_sequence_returns_plain_generates_tokens(defer, deferral_anywhere):
    """Both rows end on an end-of-sequence token well before max_new_tokens: the graphed generate's
    sequences equal plain generate's (dynamic cache, per-step check); deferred, it ran one step more
    (dropped by transformers), which the step counts show."""
    model = tiny_llama()
    ids = prompt(2, 6)
    free = generate(model, ids, 12, min_new_tokens=12)[:, 6:]        # the greedy tokens without a stop
    eos = [int(free[0, 2]), int(free[1, 4])]                         # row 0 ends by step 3, row 1 by 5
    ref = generate(model, ids, 12, eos_token_id=eos)
    assert ref.shape[1] - 6 < 12, "the test needs an early stop"
    D.graphed(model, max_batch=2, max_cache_len=64, defer_stop=defer)
    try:
        got = generate(model, ids, 12, eos_token_id=eos)
        steps = decode_steps(model)
        again = generate(model, ids, 12, eos_token_id=eos)          # the pooled cache, reset
    finally:
        D.ungraphed(model)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    torch.testing.assert_close(again, ref, rtol=0, atol=0)
    new = ref.shape[1] - 6
    assert steps == (new if defer else new - 1)    # one-token steps after the prefill (+1 deferred)


def test_max_new_tokens_runs_no_extra_step(deferral_anywhere):
    """Stopped by max_new_tokens alone, a deferred generate runs exactly the steps it returns."""
    model = tiny_llama()
    ids = prompt(2, 6)
    ref = generate(model, ids, 10, min_new_tokens=10)
    D.graphed(model, max_batch=2, max_cache_len=64)
    try:
        got = generate(model, ids, 10, min_new_tokens=10)
        steps = decode_steps(model)
    finally:
        D.ungraphed(model)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    assert steps == 9
