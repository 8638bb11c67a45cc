"""gems.decode.kv_cache: the one-launch static KV cache layer writes what transformers' StaticLayer writes
(keys, values, the position counter), keeps its host count in step, and refuses an overflow as
index_copy_ does."""
from __future__ import annotations

import pytest
import torch
from harness import DEVICE
from transformers import LlamaConfig, MistralConfig, StaticCache
from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

from gems.decode import kv_cache
from gems.decode.kv_cache import AppendingSlidingWindowLayer, AppendingStaticLayer, append, static_cache


def config(**kw):
    return LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, **kw)


def kv(batch, heads, n, d, dtype, layout):
    """New keys or values [batch, heads, n, d] in the layouts models pass: the projection's transposed
    view, a contiguous tensor, a slice of a wider one, and an expanded (broadcast) batch."""
    if layout == "transposed":
        return torch.randn(batch, n, heads, d, dtype=dtype, device=DEVICE).transpose(1, 2)
    if layout == "sliced":
        return torch.randn(batch, heads, n + 3, 2 * d, dtype=dtype, device=DEVICE)[:, :, 1:n + 1, ::2]
    if layout == "expanded":
        return torch.randn(1, heads, n, d, dtype=dtype, device=DEVICE).expand(batch, heads, n, d)
    return torch.randn(batch, heads, n, d, dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("layout", ["transposed", "contiguous", "sliced", "expanded"])
def test_updates_equal_transformers_static_layer(dtype, layout, monkeypatch):
    torch.manual_seed(0)
    launches = []
    monkeypatch.setattr(kv_cache, "append", lambda *a: launches.append(1) or append(*a))
    ours, ref = AppendingStaticLayer(max_cache_len=24), StaticLayer(max_cache_len=24)
    for n in (7, 1, 1, 5, 1, 9):       # a prompt, decode steps, a second chunk, up to exactly full
        k, v = kv(3, 2, n, 16, dtype, layout), kv(3, 2, n, 16, dtype, layout)
        got, want = ours.update(k, v), ref.update(k, v)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert int(ours.cumulative_length) == int(ref.cumulative_length) == ours.cumulative_length_int
        assert int(ours.ticket) == 0
    assert ours.cumulative_length_int == 24 and len(launches) == 6    # each update was the one launch


def test_value_head_dim_may_differ_from_the_keys():
    ours, ref = AppendingStaticLayer(max_cache_len=8), StaticLayer(max_cache_len=8)
    for n in (3, 1):
        k, v = torch.randn(2, 3, n, 24, device=DEVICE), torch.randn(2, 3, n, 8, device=DEVICE)
        got, want = ours.update(k, v), ref.update(k, v)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_an_overflow_raises_index_error_and_writes_nothing():
    layer = AppendingStaticLayer(max_cache_len=8)
    layer.update(torch.randn(1, 2, 6, 16, device=DEVICE), torch.randn(1, 2, 6, 16, device=DEVICE))
    keys = layer.keys.clone()
    with pytest.raises(IndexError, match="overflows its capacity of 8"):
        layer.update(torch.randn(1, 2, 3, 16, device=DEVICE), torch.randn(1, 2, 3, 16, device=DEVICE))
    assert torch.equal(layer.keys, keys) and int(layer.cumulative_length) == 6 == layer.cumulative_length_int
    ref = StaticLayer(max_cache_len=8)       # what transformers' layer raises for the same overflow
    ref.update(torch.randn(1, 2, 6, 16), torch.randn(1, 2, 6, 16))
    with pytest.raises(IndexError):
        ref.update(torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16))


def test_reset_starts_over():
    layer = AppendingStaticLayer(max_cache_len=8)
    k = torch.randn(1, 2, 5, 16, device=DEVICE)
    layer.update(k, k)
    layer.reset()
    assert layer.cumulative_length_int == 0 and int(layer.cumulative_length) == 0 and not layer.keys.any()
    layer.update(k[:, :, :2], k[:, :, :2])
    assert torch.equal(layer.keys[:, :, :2], k[:, :, :2]) and int(layer.cumulative_length) == 2


def test_inputs_the_kernel_does_not_take_go_through_transformers_update():
    """A dtype other than the cache's: transformers' update decides (index_copy_ raises); gradients:
    transformers' update records them; the host count follows either way."""
    layer = AppendingStaticLayer(max_cache_len=8)
    layer.update(torch.randn(1, 2, 2, 16, device=DEVICE), torch.randn(1, 2, 2, 16, device=DEVICE))
    with pytest.raises(RuntimeError):
        layer.update(torch.randn(1, 2, 1, 16, device=DEVICE, dtype=torch.float64),
                     torch.randn(1, 2, 1, 16, device=DEVICE, dtype=torch.float64))
    k = torch.randn(1, 2, 1, 16, device=DEVICE, requires_grad=True)
    keys, _ = layer.update(k, k.detach())
    # transformers advanced its counter for the refused write too; the host count follows it
    assert keys.requires_grad and layer.cumulative_length_int == int(layer.cumulative_length) == 4


def test_an_empty_update_changes_nothing():
    layer = AppendingStaticLayer(max_cache_len=8)
    layer.update(torch.randn(2, 2, 3, 16, device=DEVICE), torch.randn(2, 2, 3, 16, device=DEVICE))
    keys = layer.keys.clone()
    layer.update(torch.randn(2, 2, 0, 16, device=DEVICE), torch.randn(2, 2, 0, 16, device=DEVICE))
    assert torch.equal(layer.keys, keys) and int(layer.cumulative_length) == 3 == layer.cumulative_length_int


def test_append_fills_exactly_the_rows_at_the_position():
    """The kernel alone, against a plain-indexing reference, at an offset inside the cache."""
    keys, values = torch.zeros(2, 3, 16, 8, device=DEVICE), torch.zeros(2, 3, 16, 4, device=DEVICE)
    length = torch.tensor(5, device=DEVICE)
    ticket = torch.zeros((), dtype=torch.int32, device=DEVICE)
    k, v = torch.randn(2, 3, 4, 8, device=DEVICE), torch.randn(2, 3, 4, 4, device=DEVICE)
    append(keys, values, k, v, length, ticket)
    want_k, want_v = torch.zeros_like(keys), torch.zeros_like(values)
    want_k[:, :, 5:9], want_v[:, :, 5:9] = k, v
    assert torch.equal(keys, want_k) and torch.equal(values, want_v)
    assert int(length) == 9 and int(ticket) == 0


def test_static_cache_swaps_both_kinds_of_layers():
    cache = static_cache(config(), 32)
    assert [type(layer) for layer in cache.layers] == [AppendingStaticLayer] * 2
    assert all(layer.max_cache_len == 32 for layer in cache.layers)
    mistral = MistralConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, sliding_window=16)
    layers = static_cache(mistral, 32).layers
    assert all(type(layer) is AppendingSlidingWindowLayer and layer.max_cache_len == 16 for layer in layers)
    assert type(StaticCache(config=config(), max_cache_len=32).layers[0]) is StaticLayer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("steps", [(5, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1), (3, 4, 9, 1, 2), (12, 1, 1, 1, 1, 7, 1)])
def test_sliding_window_updates_equal_transformers(dtype, steps, monkeypatch):
    """Filling, reaching and rolling a window of 16: the one-launch updates while it is not yet full,
    transformers' from there on; keys, values, returned states and both counters as transformers'."""
    torch.manual_seed(0)
    launches = []
    monkeypatch.setattr(kv_cache, "append", lambda *a: launches.append(1) or append(*a))
    ours = AppendingSlidingWindowLayer(max_cache_len=32, sliding_window=16)
    ref = StaticSlidingWindowLayer(max_cache_len=32, sliding_window=16)
    fused = 0
    for n in steps:
        fused += ours.cumulative_length_int + n <= 16
        k, v = kv(2, 2, n, 8, dtype, "transposed"), kv(2, 2, n, 8, dtype, "contiguous")
        got, want = ours.update(k, v), ref.update(k, v)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert torch.equal(ours.keys, ref.keys) and torch.equal(ours.values, ref.values)
        assert ours.cumulative_length_int == ref.cumulative_length_int
        assert int(ours.cumulative_length) == int(ref.cumulative_length)
    assert len(launches) == fused > 0
