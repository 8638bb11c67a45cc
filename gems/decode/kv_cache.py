"""The static KV cache layer of graphed decode: the new keys and values written and the position advanced
in one launch.

transformers' `StaticLayer.update` costs five kernels per layer and step: `arange` and an add for the
positions, the counter's `add_`, and an `index_copy_` each for keys and values. A decode step of a
32-layer model is then 160 launches that move a few KB each; inside a CUDA graph each still costs its
launch slot and ramp-up on the device. `AppendingStaticLayer` does the same in one:

    pos = length                                   (the layer's device counter, read by every program)
    keys[:, :, pos:pos+L] = k;  values[:, :, pos:pos+L] = v
    length = pos + L                               (by the last program to finish: a ticket)

Grid (B * H, ceil(L / BLOCK_L)): a program copies BLOCK_L positions of one (batch, head) for both
tensors. Every program reads `length` before it takes a ticket (a barrier of its threads, then an
acq_rel atomic add on a per-layer int32); the program that draws the last ticket has therefore seen
every other program's read, stores `pos + L` and puts the ticket back to 0. Bytes: the new keys and values read once and written once,
plus one 8-byte counter read per program.

The position also lives on the host (`cumulative_length_int`, the name transformers' sliding-window
layers use, so capture.py advances it after each replay): a write past the cache's capacity raises
IndexError before anything is launched, as `index_copy_` would, instead of writing out of bounds.
`AppendingSlidingWindowLayer` does the same for a sliding window's updates that leave it not yet full
(transformers' `index_copy_` branch, the only one a graph replays); filling or rolling the window
stays transformers'.

Inputs the kernel does not take (another device than Gems launches on, a dtype other than the cache's,
shapes that do not match, gradients, tracing by torch.compile) go through transformers' own update.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from transformers.cache_utils import StaticCache, StaticLayer, StaticSlidingWindowLayer

from ..fused import library
from ..runtime import kernel
from ..runtime.utils import cdiv, next_pow2


@triton.jit
def _copy_rows(SRC, DST, b, h, pos, ls, lmask, s_b, s_h, s_l, s_d, d_b, d_h, d_l, d_d, D,
               BLOCK_D: tl.constexpr):
    """DST[b, h, pos + ls] = SRC[b, h, ls] for the rows in lmask."""
    ds = tl.arange(0, BLOCK_D)
    mask = lmask[:, None] & (ds < D)[None, :]
    x = tl.load(SRC + b * s_b + h * s_h + ls[:, None] * s_l + ds[None, :] * s_d, mask=mask)
    tl.store(DST + b * d_b + h * d_h + (pos + ls)[:, None] * d_l + ds[None, :] * d_d, x, mask=mask)


@kernel
@triton.jit
def kv_append_kernel(K, V, KN, VN, LEN, TICKET, H, L, DK, DV,
                     k_b, k_h, k_l, k_d, v_b, v_h, v_l, v_d,
                     kn_b, kn_h, kn_l, kn_d, vn_b, vn_h, vn_l, vn_d,
                     BLOCK_L: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr):
    """K[b, h, LEN + l] = KN[b, h, l] and V likewise for l < L; then LEN += L (the module docstring)."""
    bh = tl.program_id(0)
    lb = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    pos = tl.load(LEN).to(tl.int64)
    ls = (lb * BLOCK_L + tl.arange(0, BLOCK_L)).to(tl.int64)
    lmask = ls < L
    _copy_rows(KN, K, b, h, pos, ls, lmask, kn_b, kn_h, kn_l, kn_d, k_b, k_h, k_l, k_d, DK, BLOCK_DK)
    _copy_rows(VN, V, b, h, pos, ls, lmask, vn_b, vn_h, vn_l, vn_d, v_b, v_h, v_l, v_d, DV, BLOCK_DV)
    programs = tl.num_programs(0) * tl.num_programs(1)
    # every thread of the program has its LEN loaded (its stores used it) before the ticket is taken
    tl.debug_barrier()
    if tl.atomic_add(TICKET, 1, sem="acq_rel") == programs - 1:
        tl.store(LEN, pos + L)
        tl.store(TICKET, 0)


def append(keys, values, k, v, length, ticket):
    """Write k [B, H, L, Dk] and v [B, H, L, Dv] into keys / values [B, H, capacity, D] at the position
    `length` (a 0-dim int64 device tensor) and advance it by L, in one launch. The caller checks shapes,
    dtypes and capacity (AppendingStaticLayer.update)."""
    B, H, L, DK = k.shape
    DV = v.shape[-1]
    if B * H * L == 0:
        return
    bdk, bdv = next_pow2(DK), next_pow2(DV)
    block_l = max(1, min(next_pow2(L), 4096 // max(bdk, bdv)))
    kv_append_kernel[(B * H, cdiv(L, block_l))](
        keys, values, k, v, length, ticket, H, L, DK, DV,
        *keys.stride(), *values.stride(), *k.stride(), *v.stride(), block_l, bdk, bdv,
        num_warps=4 if block_l * max(bdk, bdv) >= 2048 else 1)


class _OneLaunch:
    """What both layers share: the ticket tensor, the test for inputs the kernel takes, the launch."""

    ticket = None

    def lazy_initialization(self, key_states, value_states) -> None:
        super().lazy_initialization(key_states, value_states)
        self.ticket = torch.zeros((), dtype=torch.int32, device=self.device)

    def fusable(self, k, v) -> bool:
        return (k.shape[-2] > 0 and not torch.compiler.is_compiling()
                and k.device.type == library.device_type() and k.device == self.keys.device
                and k.dtype == self.keys.dtype and v.dtype == self.values.dtype and k.dim() == v.dim() == 4
                and k.shape[:2] == v.shape[:2] == self.keys.shape[:2] and k.shape[2] == v.shape[2]
                and k.shape[3] == self.keys.shape[3] and v.shape[3] == self.values.shape[3]
                and not (torch.is_grad_enabled() and (k.requires_grad or v.requires_grad)))

    def append(self, k, v):
        append(self.keys, self.values, k, v, self.cumulative_length, self.ticket)
        self.cumulative_length_int += k.shape[-2]
        return self.keys, self.values


class AppendingStaticLayer(_OneLaunch, StaticLayer):
    """transformers' StaticLayer whose `update` is one launch (`append`) where Gems can run it."""

    def __init__(self, max_cache_len: int, **kwargs):
        super().__init__(max_cache_len, **kwargs)
        self.cumulative_length_int = 0

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        if not self.fusable(key_states, value_states):
            self.cumulative_length_int += n    # first, as transformers advances its counter before writing
            return super().update(key_states, value_states, *args, **kwargs)
        if self.cumulative_length_int + n > self.max_cache_len:
            raise IndexError(f"static KV cache: writing {n} positions at position {self.cumulative_length_int} "
                             f"overflows its capacity of {self.max_cache_len} (give generate a larger max_length "
                             f"or the cache a larger max_cache_len)")
        return self.append(key_states, value_states)

    def reset(self) -> None:
        super().reset()
        self.cumulative_length_int = 0


class AppendingSlidingWindowLayer(_OneLaunch, StaticSlidingWindowLayer):
    """transformers' StaticSlidingWindowLayer whose updates that leave the window not yet full (the
    only ones a graph replays) are one launch; the updates that fill or roll the window are transformers'."""

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.cumulative_length_int + key_states.shape[-2] <= self.max_cache_len \
                and self.fusable(key_states, value_states):
            return self.append(key_states, value_states)
        return super().update(key_states, value_states, *args, **kwargs)


def static_cache(config, max_cache_len: int) -> StaticCache:
    """transformers' StaticCache for `config`, its layers the one-launch ones above."""
    cache = StaticCache(config=config, max_cache_len=max_cache_len)
    swap = {StaticLayer: lambda n: AppendingStaticLayer(max_cache_len=n),
            StaticSlidingWindowLayer: lambda n: AppendingSlidingWindowLayer(max_cache_len=n, sliding_window=n)}
    cache.layers = [swap[type(layer)](layer.max_cache_len) if type(layer) in swap else layer
                    for layer in cache.layers]
    return cache
