"""gems.decode.graphed: generate through the graphed decode path gives plain generate's greedy tokens,
ungraphed restores the model, and (GEMS_TEST_DEVICE=cuda) the captured graphs replay what eager computes.

On the CPU no graph is captured: the tests check the static-cache path, the pool, the notices and the
restore; the CUDA tests check capture, replay and the first-replay check."""
from __future__ import annotations

import warnings

import pytest
import torch
from decode_models import VOCAB, prompt, tiny_llama
from harness import DEVICE, ON_GPU
from transformers import StaticCache

import gems
import gems.decode as D


def gen(model, ids, n, **kw):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=0, **kw)


def sample(model, ids, n, seed, **kw):
    """generate with temperature, top-k and top-p sampling from a fixed seed."""
    torch.manual_seed(seed)
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                              do_sample=True, temperature=0.8, top_k=20, top_p=0.9, pad_token_id=0, **kw)


def snapshot(model):
    return ({k: v for k, v in model.__dict__.items()}, model.generation_config.to_dict())


@pytest.mark.parametrize("batch", [1, 2])
def test_greedy_tokens_match_plain_generate(batch):
    model = tiny_llama()
    ids = prompt(batch, 7)
    ref = gen(model, ids, 16)             # plain generate: dynamic cache, eager
    D.graphed(model, max_batch=2, max_cache_len=64, min_cache_len=16)
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            got = gen(model, ids, 16)
            again = gen(model, ids, 16)    # the pooled cache, reset in place
        cache_notes = [str(x.message) for x in w if "gems.decode" in str(x.message)]
        counts = D.graph_counts(model)
    finally:
        D.ungraphed(model)
    assert got.shape == (batch, 7 + 16)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    torch.testing.assert_close(again, ref, rtol=0, atol=0)
    if not ON_GPU:
        # said once, not per step or per call
        assert len([m for m in cache_notes if "no CUDA graphs" in m]) == 1, cache_notes
        assert counts["eager"] == 2 * 15 and counts["captured"] == 0
    else:
        assert counts["captured"] >= 1 and counts["replayed"] == 2 * 15 and counts["eager"] == 0


def test_one_token_prompt():
    """A one-token prompt's prefill is a [B, 1] forward too: on a fresh cache it runs eager, on the pooled
    cache of the next call it is one more step (on CUDA, a replay): the tokens are plain generate's."""
    model = tiny_llama()
    ids = prompt(2, 1)
    ref = gen(model, ids, 6)
    D.graphed(model, max_batch=2, max_cache_len=32)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = [gen(model, ids, 6) for _ in range(2)]
    finally:
        D.ungraphed(model)
    for g in got:
        torch.testing.assert_close(g, ref, rtol=0, atol=0)


def test_static_cache_is_pooled_and_bucketed():
    model = tiny_llama()
    D.graphed(model, max_batch=2, max_cache_len=64, min_cache_len=16)
    caches = []
    orig = model.forward

    def spy(*a, **k):
        caches.append(k.get("past_key_values"))
        return orig(*a, **k)
    try:
        object.__setattr__(model, "forward", spy)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            gen(model, prompt(1, 5), 4)          # 9 positions -> the 16 bucket
            gen(model, prompt(1, 6), 4)          # 10 -> 16 again: the same cache object
            gen(model, prompt(1, 20), 4)         # 24 -> the 24 bucket (1.5 x 16)
        object.__setattr__(model, "forward", orig)
    finally:
        D.ungraphed(model)
    first, second, third = caches[0], caches[5], caches[10]
    assert isinstance(first, StaticCache) and first is second and third is not first
    assert first.get_max_length() == 16 and third.get_max_length() == 24


def test_over_the_limits_runs_eager_with_one_warning():
    model = tiny_llama()
    ids = prompt(3, 5)
    ref = gen(model, ids, 6)
    D.graphed(model, max_batch=2, max_cache_len=64, min_cache_len=16)
    try:
        with pytest.warns(UserWarning, match="batch 3 > max_batch 2"):
            got = gen(model, ids, 6)
        long_ids = prompt(1, 70)
        long_ref = None
        with pytest.warns(UserWarning, match="> max_cache_len 64"):
            long_got = gen(model, long_ids, 4)
    finally:
        D.ungraphed(model)
    long_ref = gen(model, long_ids, 4)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    torch.testing.assert_close(long_got, long_ref, rtol=0, atol=0)


def test_user_static_cache():
    model = tiny_llama()
    ids = prompt(2, 5)
    ref = gen(model, ids, 8)
    D.graphed(model, max_batch=2, max_cache_len=64)
    seen = []
    orig = model.forward

    def spy(*a, **k):
        seen.append(k.get("past_key_values"))
        return orig(*a, **k)
    try:
        cache = StaticCache(config=model.config, max_cache_len=32)
        object.__setattr__(model, "forward", spy)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = gen(model, ids, 8, past_key_values=cache)
        object.__setattr__(model, "forward", orig)
    finally:
        D.ungraphed(model)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    assert all(c is cache for c in seen) and len(seen) == 8


def test_ungraphed_restores_exactly():
    model = tiny_llama()
    before_dict, before_gc = snapshot(model)
    D.graphed(model)
    assert "forward" in model.__dict__ and "generate" in model.__dict__
    assert model._supports_logits_to_keep()     # generate still sees the forward's parameters
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gen(model, prompt(1, 4), 3)
    assert D.graphed(model) is model          # again with the same options: a no-op
    with pytest.raises(RuntimeError, match="other options"):
        D.graphed(model, max_batch=1)
    assert D.ungraphed(model) is True
    after_dict, after_gc = snapshot(model)
    assert after_dict.keys() == before_dict.keys()
    assert all(after_dict[k] is before_dict[k] for k in before_dict)
    assert after_gc == before_gc
    assert D.ungraphed(model) is False


@pytest.mark.parametrize("pack", [False, True], ids=["", "pack_projections"])
def test_composes_with_patch_and_enable(pack):
    """gems.patch (also with q/k/v and gate/up packed), then graphed, with Gems' ATen ops on: the tokens of
    the plain model; undone in reverse."""
    model = tiny_llama()
    ids = prompt(2, 6)
    ref = gen(model, ids, 8)
    before_dict, _ = snapshot(model)
    gems.patch(model, pack_projections=pack)
    patched_forward = model.__dict__.get("forward")
    D.graphed(model, max_batch=2, max_cache_len=64)
    try:
        with gems.use_gems(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = gen(model, ids, 8)
    finally:
        D.ungraphed(model)
    assert model.__dict__.get("forward") is patched_forward
    gems.unpatch(model)
    assert model.__dict__.keys() == before_dict.keys()
    assert got.shape == ref.shape
    # Gems' kernels against ATen's: greedy tokens agree unless two logits nearly tie (not at this size)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


@pytest.mark.parametrize("tied", [False, True])
def test_weight_bytes_counts_what_a_step_reads(tied):
    """Every weight once; the input embedding only where the output projection shares it."""
    from gems.decode.timing import weight_bytes
    model = tiny_llama()
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    every = sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in
                                                           [*model.parameters(), *model.buffers()]}.values())
    emb = model.model.embed_tokens.weight
    assert weight_bytes(model) == every - (0 if tied else emb.numel() * emb.element_size())


@pytest.mark.skipif(not ON_GPU, reason="a device copy")
def test_copy_roof():
    from gems.decode.timing import copy_roof_gbps
    assert 50 < copy_roof_gbps() < 50_000


def test_bad_arguments():
    with pytest.raises(TypeError):
        D.graphed(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError):
        D.graphed(tiny_llama(), max_cache_len=8, min_cache_len=16)


def test_capacity_bucket():
    from gems.decode.pool import capacity_bucket
    assert [capacity_bucket(n, 16, 100) for n in (1, 16, 17, 24, 25, 33, 64, 65, 97, 100, 101)] == \
        [16, 16, 24, 24, 32, 48, 64, 96, 100, 100, None]
    # a 128-token prompt with 64 new tokens fits its bucket exactly; 4064 positions take 4096
    assert [capacity_bucket(n, 128, 4096) for n in (1, 129, 192, 193, 4064, 4097)] == \
        [128, 192, 192, 256, 4096, None]
    assert [capacity_bucket(n, 1, 8) for n in (1, 2, 3, 4, 5, 7)] == [1, 2, 3, 4, 6, 8]


def test_first_replay_check_tolerance():
    """The check that decides between a replay and the eager fallback: within the dtype's tolerance
    (scaled to the logits' magnitude) passes; past it, NaN against a number, or another shape fails."""
    from gems.decode.capture import mismatch
    ref = torch.tensor([[[1.0, -40.0, 3.0]]])
    assert mismatch(ref.clone(), ref) is None
    assert mismatch(ref + 3e-3, ref) is None                # 1e-4 x 40
    assert "max |graph - eager|" in mismatch(ref + torch.tensor([0.0, 0.0, 5e-3]), ref)
    assert mismatch(torch.full_like(ref, float("nan")), ref) is not None
    assert mismatch(ref[..., :2], ref) is not None
    half = ref.half()
    assert mismatch(half + 0.3, half) is None                # 1e-2 x 40
    assert mismatch(half + 0.5, half) is not None


# ------------------------------------------------------------------------------------------------ CUDA
cuda_only = pytest.mark.skipif(not ON_GPU, reason="CUDA graphs: GEMS_TEST_DEVICE=cuda")


def replay_against_eager(model, inputs, n, capacity, *, gems_on=False, warns=None):
    """Greedy decode of `n` tokens, graphed, against the eager decode on a static cache of `capacity`
    positions (the bucket graphed picks: the same computation); fp32 tokens equal, logits within 1e-5.
    Returns the graph counts."""
    import contextlib
    from gems.decode.timing import generate_greedy
    config = model.config.get_text_config(decoder=True)
    scope = gems.use_gems() if gems_on else contextlib.nullcontext()
    with scope:
        ref, ref_logits = generate_greedy(model, inputs, n, pad_token_id=0, disable_compile=True,
                                          past_key_values=StaticCache(config=config, max_cache_len=capacity))
        D.graphed(model, max_batch=inputs["input_ids"].shape[0], max_cache_len=capacity)
        try:
            with pytest.warns(UserWarning, match=warns) if warns else contextlib.nullcontext():
                got, logits = generate_greedy(model, inputs, n, pad_token_id=0)
            counts = D.graph_counts(model)
        finally:
            D.ungraphed(model)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    torch.testing.assert_close(torch.stack(logits), torch.stack(ref_logits), rtol=1e-5, atol=1e-5)
    return counts


def mask_of(ids):
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


@cuda_only
@pytest.mark.parametrize("gems_on", [False, True, "packed"], ids=["aten", "gems", "gems-packed"])
def test_cuda_replay_matches_eager(gems_on):
    """32 tokens: graphed decode's tokens equal the eager static-cache decode's, in fp32, with and
    without Gems' ATen ops (and with gems.patch's packed projections); every one-token step after the
    first capture is a replay."""
    model = tiny_llama()
    if gems_on == "packed":
        gems.patch(model, pack_projections=True)
    counts = replay_against_eager(model, mask_of(prompt(2, 9)), 32, 128, gems_on=bool(gems_on))
    assert counts == {"captured": 1, "replayed": 31, "eager": 0}


@cuda_only
@pytest.mark.parametrize("gems_on", [False, True], ids=["aten", "gems"])
def test_cuda_sliding_window_replay_matches_eager(gems_on):
    """A sliding-window model (Mistral): the graph replays while the window fills, the host counter a
    replay cannot advance is advanced by the dispatcher, the steps that roll the window run eager, and
    the tokens equal the eager static-cache decode's in fp32."""
    counts = replay_against_eager(tiny_mistral(window=16), mask_of(prompt(2, 5)), 20, 64, gems_on=gems_on,
                                  warns=r"sliding window \(or the static cache\) is full")
    assert counts == {"captured": 1, "replayed": 11, "eager": 8}


@cuda_only
def test_cuda_llava_replay_matches_eager():
    """Llava's language model after its (eager) prefill: the replayed steps give the eager static-cache
    decode's tokens and logits in fp32."""
    import gems_models as M
    b = M.build(M.resolve("llava"), size="tiny", device=DEVICE, dtype="float32", batch=1, seq_len=8, seed=0)
    counts = replay_against_eager(b.model.eval(), b.inputs, 12, 64)
    assert counts == {"captured": 1, "replayed": 11, "eager": 0}


@cuda_only
def test_cuda_host_sync_raises():
    """A step that synchronizes with the host cannot be captured: a clear error, not a wrong replay."""
    model = tiny_llama()
    inner = model.model.norm.forward

    def syncing(x):
        if x.shape[1] == 1:
            float(x.abs().max())    # a device-to-host read
        return inner(x)
    model.model.norm.forward = syncing
    D.graphed(model, max_batch=2, max_cache_len=64)
    try:
        with pytest.raises(D.GraphCaptureError, match="synchronizes with the host"):
            gen(model, prompt(1, 5), 4)
    finally:
        D.ungraphed(model)


@cuda_only
def test_cuda_bad_replay_falls_back_with_one_warning():
    """A step whose result depends on host state the graph froze: the first replay differs from eager,
    so the step runs eager (right tokens) and one warning says so."""
    model = tiny_llama()
    ids = prompt(1, 5)
    ref = gen(model, ids, 8, cache_implementation="static", disable_compile=True)
    inner = model.model.norm.forward
    calls = {"n": 0}

    def frozen(x):
        if x.shape[1] == 1:
            calls["n"] += 1   # the graph freezes the scale of its capture-time call
            return inner(x) * (1.0 + 0.5 * (calls["n"] % 2))
        return inner(x)
    model.model.norm.forward = frozen
    D.graphed(model, max_batch=1, max_cache_len=64)
    try:
        with pytest.warns(UserWarning, match="first replay disagreed"):
            got = gen(model, ids, 8)
        counts = D.graph_counts(model)
    finally:
        D.ungraphed(model)
    # eager from the first replay on: each step scaled by the parity of its call, never the graph's frozen one
    assert counts["captured"] == 1 and counts["eager"] == 7 and counts["replayed"] == 0
    assert got.shape == ref.shape


@cuda_only
def test_cuda_beam_search_runs_eager_after_reorder():
    """Beam search reallocates the cache's tensors (reorder_cache): the graph is not replayed on them."""
    model = tiny_llama()
    ids = prompt(1, 5)
    ref = gen(model, ids, 8, num_beams=2, cache_implementation="static", disable_compile=True)
    D.graphed(model, max_batch=2, max_cache_len=64)
    try:
        with pytest.warns(UserWarning, match="reallocated"):
            got = gen(model, ids, 8, num_beams=2)
        plain = gen(model, ids, 8)         # the pooled cache of the next call is graphed again
        counts = D.graph_counts(model)
    finally:
        D.ungraphed(model)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    assert plain.shape == (1, 13) and counts["replayed"] >= 7


# ------------------------------------------------------------------ the dispatcher on the CPU, graphs faked
class FakeGraph:
    """Stands in for torch.cuda.CUDAGraph on the CPU: `replay` runs the captured step again on the static
    buffers and writes the results into the capture's output tensors, as a replay writes its static
    output. It re-runs Python, so it cannot show what a real graph freezes (the CUDA tests do)."""

    def __init__(self, fn, out, layers):
        self.fn, self.out, self.layers = fn, out, layers

    def replay(self):
        from gems.decode import capture as C
        # a real replay runs no Python: the sliding-window layers' host counters stay where they were
        counted = [(layer, layer.cumulative_length_int) for layer in C.host_counted(self.layers)]
        new = self.fn()
        for layer, n in counted:
            layer.cumulative_length_int = n
        self.out.logits.copy_(new.logits)


@pytest.fixture
def fake_graphs(monkeypatch):
    import contextlib

    from gems.decode import capture as C
    from gems.decode import step as S

    class Stream:
        def wait_stream(self, other):
            pass

    def capture(self, cache, pool):
        saved = C.save_lengths(self.layers)
        out = self.forward(**self.static, past_key_values=cache)
        C.restore_lengths(self.layers, saved)    # a capture records, it does not run
        self.graph = FakeGraph(lambda: self.forward(**self.static, past_key_values=cache), out, self.layers)
        self.out = out
    monkeypatch.setattr(S, "graphs_available", lambda device: True)
    monkeypatch.setattr(C.StepGraph, "capture", capture)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)


@pytest.mark.skipif(ON_GPU, reason="the CPU stand-in for CUDA graphs")
def test_dispatcher_with_fake_graphs(fake_graphs):
    """Static buffers, one capture per cache and signature, replays, the first-replay check, the pool
    across calls and the eager path after beam search reallocates the cache: greedy tokens equal plain
    generate's."""
    model = tiny_llama()
    ids = prompt(2, 7)
    ref = gen(model, ids, 12)
    beam_ref = gen(model, ids[:1], 6, num_beams=2)
    D.graphed(model, max_batch=2, max_cache_len=64, min_cache_len=32)
    try:
        got = gen(model, ids, 12)
        counts_one = D.graph_counts(model)
        again = gen(model, ids, 12)            # the pooled cache and its graph
        counts_two = D.graph_counts(model)
        with pytest.warns(UserWarning, match="reallocated"):
            beam = gen(model, ids[:1], 6, num_beams=2)
    finally:
        D.ungraphed(model)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    torch.testing.assert_close(again, ref, rtol=0, atol=0)
    torch.testing.assert_close(beam, beam_ref, rtol=0, atol=0)
    assert counts_one == {"captured": 1, "replayed": 11, "eager": 0}
    assert counts_two == {"captured": 1, "replayed": 22, "eager": 0}


@pytest.mark.skipif(ON_GPU, reason="the CPU stand-in for CUDA graphs")
def test_dispatcher_refuses_a_wrong_first_replay(fake_graphs, monkeypatch):
    """A replay whose logits differ from the eager step's: the eager result is used, one warning, and
    that signature runs eager from then on."""
    monkeypatch.setattr(FakeGraph, "replay", lambda self: self.out.logits.add_(1.0))
    model = tiny_llama()
    ids = prompt(1, 5)
    ref = gen(model, ids, 8)
    D.graphed(model, max_batch=1, max_cache_len=64)
    try:
        with pytest.warns(UserWarning, match="first replay disagreed") as w:
            got = gen(model, ids, 8)
        counts = D.graph_counts(model)
    finally:
        D.ungraphed(model)
    assert len([x for x in w if "first replay" in str(x.message)]) == 1
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    assert counts == {"captured": 1, "replayed": 0, "eager": 7}


@pytest.mark.skipif(ON_GPU, reason="the CPU stand-in for CUDA graphs")
def test_dispatcher_runs_uncaptured_arguments_eager(fake_graphs):
    """An argument a graph does not capture (hidden states asked for) runs the step eagerly, said once."""
    model = tiny_llama()
    ids = prompt(1, 5)
    ref = gen(model, ids, 5)
    D.graphed(model, max_batch=1, max_cache_len=64)
    try:
        with pytest.warns(UserWarning, match="output_hidden_states=True is not captured"):
            out = gen(model, ids, 5, output_hidden_states=True, return_dict_in_generate=True)
        counts = D.graph_counts(model)
    finally:
        D.ungraphed(model)
    torch.testing.assert_close(out.sequences, ref, rtol=0, atol=0)
    assert counts == {"captured": 0, "replayed": 0, "eager": 4}


def tiny_mistral(window, seed=0):
    from transformers import MistralConfig, MistralForCausalLM
    torch.manual_seed(seed)
    cfg = MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                        sliding_window=window)
    return MistralForCausalLM(cfg).to(DEVICE, torch.float32).eval()


@pytest.mark.skipif(ON_GPU, reason="the CPU stand-in for CUDA graphs")
def test_dispatcher_sliding_window(fake_graphs):
    """Sliding-window layers: steps replay while the window is not full (the host counter advanced per
    replay), the steps that roll a full window run eager, and the tokens equal the eager static-cache
    decode's."""
    model = tiny_mistral(window=16)
    ids = prompt(1, 5)
    ref = gen(model, ids, 20, cache_implementation="static", disable_compile=True)
    D.graphed(model, max_batch=1, max_cache_len=64)
    try:
        with pytest.warns(UserWarning, match="sliding window \\(or the static cache\\) is full"):
            got = gen(model, ids, 20)
        counts = D.graph_counts(model)
    finally:
        D.ungraphed(model)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    # positions 5..15 fit the window (11 steps; the first captures and replays), 16..23 roll it
    assert counts == {"captured": 1, "replayed": 11, "eager": 8}


def test_sampling_draws_eagers_tokens(request):
    """Sampling (temperature, top-k, top-p, multinomial) runs in generate after the replay and the graph
    draws no random numbers: a seed gives the eager static-cache decode's tokens (and another seed other
    tokens: the draws are random, not greedy). Real graphs on CUDA, the stand-in on the CPU."""
    if not ON_GPU:
        request.getfixturevalue("fake_graphs")
    model = tiny_llama()
    ids = prompt(2, 6)
    ref = sample(model, ids, 12, seed=3, cache_implementation="static", disable_compile=True)
    other = sample(model, ids, 12, seed=4, cache_implementation="static", disable_compile=True)
    D.graphed(model, max_batch=2, max_cache_len=64)
    try:
        got = sample(model, ids, 12, seed=3)
        counts = D.graph_counts(model)
    finally:
        D.ungraphed(model)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    assert not torch.equal(ref, other)
    assert counts == {"captured": 1, "replayed": 11, "eager": 0}


@pytest.mark.skipif(ON_GPU, reason="the CPU stand-in for CUDA graphs")
def test_dispatcher_llava_language_model_after_its_prefill(fake_graphs):
    """Llava: the prefill (image features merged into the prompt) runs eager, the language model's
    one-token steps replay (generate drops pixel_values after the prefill); greedy tokens equal plain
    generate's."""
    import gems_models as M
    b = M.build(M.resolve("llava"), size="tiny", device=DEVICE, dtype="float32", batch=1, seq_len=8, seed=0)
    model = b.model.eval()
    kw = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref = model.generate(**b.inputs, **kw)
    D.graphed(model, max_batch=1, max_cache_len=64)
    try:
        with torch.no_grad():
            got = model.generate(**b.inputs, **kw)
        counts = D.graph_counts(model)
    finally:
        D.ungraphed(model)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    assert counts == {"captured": 1, "replayed": 9, "eager": 0}


def _replay_ms_keeps_the_cache(model, ids):
    """replay_ms: a positive time; the cache's positions and contents as generate left them (each replay
    writes the last step's position again, with the same values); None once the cache is reset; a
    later generate still gives plain generate's tokens."""
    ref = gen(model, ids, 12)
    assert D.replay_ms(model) is None                  # not graphed
    D.graphed(model, max_batch=2, max_cache_len=64, min_cache_len=32)
    try:
        assert D.replay_ms(model) is None              # graphed, nothing captured yet
        got = gen(model, ids, 12)
        g = model.__dict__["_gems_decode"]
        (cache, graphs), = g.step.graphs.items()
        state = lambda: [t.clone() for layer in cache.layers  # noqa: E731
                         for t in (layer.cumulative_length, layer.keys, layer.values)]
        before = state()
        ms = D.replay_ms(model, runs=5)
        after = state()
        again = gen(model, ids, 12)
        cache.reset()
        assert D.replay_ms(model) is None              # the cache's last step is not a replay any more
    finally:
        D.ungraphed(model)
    assert ms > 0
    # positions exactly; contents exactly on a GPU (the replay is the step's own graph), to the last bit
    # on the CPU stand-in (it runs the step's forward again, whose attention can round the last bit
    # otherwise); a write one position past the step's would put values where zeros are
    tol = 0 if ON_GPU else 1e-6
    for a, b in zip(before, after):
        torch.testing.assert_close(b, a, rtol=0, atol=tol if a.is_floating_point() else 0)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    torch.testing.assert_close(again, ref, rtol=0, atol=0)


@pytest.mark.skipif(ON_GPU, reason="the CPU stand-in for CUDA graphs")
def test_replay_ms_puts_the_positions_back(fake_graphs, monkeypatch):
    # the stand-in replay re-runs the step, which advances the layers' counters as a real replay does
    class Event:
        clock = [0.0]

        def __init__(self, enable_timing=False):
            pass

        def record(self):
            Event.clock[0] += 1.5
            self.t = Event.clock[0]

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return end.t - self.t
    monkeypatch.setattr(torch.cuda, "Event", Event)
    _replay_ms_keeps_the_cache(tiny_llama(), prompt(2, 7))


@cuda_only
def test_cuda_replay_ms_puts_the_positions_back():
    _replay_ms_keeps_the_cache(tiny_llama(), prompt(2, 7))
