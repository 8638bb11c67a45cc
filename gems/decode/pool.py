"""The static KV caches that graphed decode steps run on: one per (batch, capacity bucket, dtype, device),
kept across `generate` calls.

A CUDA graph replays the addresses it was captured with. transformers' `generate` builds a fresh
`StaticCache` on every call, so a graph captured on one call's cache would be stale on the next. The
pool hands `generate` the same cache (reset in place: `StaticCache.reset` zeroes the tensors and the
length counters without reallocating) for every call of the same bucket, so its graphs replay.

Capacity buckets are powers of two and the midpoints 1.5x above them (..., 128, 192, 256, 384, ...)
from `min_len` up to the `max_cache_len` given to `graphed`: a call needing n positions gets the
smallest bucket >= n. Attention runs over the bucket's whole length (masked), so a bucket costs up to
1.5x the attention work of an exact fit (a 128-token prompt with 64 new tokens fits 192 exactly, where
the next power of two read a third more K and V per step), and the number of caches and graphs stays
logarithmic in the lengths met.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional


def capacity_bucket(n: int, min_len: int, max_len: int) -> Optional[int]:
    """The smallest power of two or 1.5x a power of two >= max(n, min_len), at most max_len (max_len
    itself when the bucket would pass it); None when n > max_len."""
    if n > max_len:
        return None
    n = max(int(n), int(min_len), 1)
    p = 1 << (n - 1).bit_length()       # the smallest power of two >= n
    mid = p // 2 + p // 4               # 1.5x the power of two below it
    c = mid if p >= 4 and mid >= n else p
    return min(c, max_len)


class CachePool:
    """Least recently used `StaticCache`s by key; `evict` is called with a cache dropped from the pool
    (its graphs go with it)."""

    def __init__(self, limit: int, evict):
        self.limit, self.evict = limit, evict
        self.caches: OrderedDict = OrderedDict()

    def get(self, key, make):
        cache = self.caches.get(key)
        if cache is not None:
            self.caches.move_to_end(key)
            cache.reset()
            return cache
        while len(self.caches) >= self.limit:
            _, old = self.caches.popitem(last=False)
            self.evict(old)
        cache = self.caches[key] = make()
        return cache

    def __contains__(self, cache) -> bool:
        return any(c is cache for c in self.caches.values())

    def clear(self):
        for c in self.caches.values():
            self.evict(c)
        self.caches.clear()
