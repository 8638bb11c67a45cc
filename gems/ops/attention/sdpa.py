"""Fused attention (flash-attention style) behind `F.scaled_dot_product_attention`.

How SDPA reaches Gems. `scaled_dot_product_attention` is a composite op: it asks `_fused_sdp_choice`
for a backend and calls that backend's overload, whose autograd formula calls the matching
`backward` overload. Gems registers those overloads at the backend key, below Autograd, so SDPA's
own backend choice is untouched (with Gems off, or for an input Gems leaves to ATen, SDPA runs
exactly what it runs without Gems) and ATen's derivative formulas call Gems' backward:

  CUDA        `_scaled_dot_product_cudnn_attention` (+ `backward`): what torch 2.11 picks on H100/H200
              `_scaled_dot_product_flash_attention` (+ `backward`)
              `_scaled_dot_product_efficient_attention` (+ `backward`): masks, fp32
  CPU (the Triton interpreter backend)
              `_scaled_dot_product_flash_attention_for_cpu` (+ `backward`)

The math fallback (`_scaled_dot_product_attention_math`: what SDPA picks for dropout on CPU, nested
tensors, ...) is not a fused op and stays ATen's (its pieces, bmm / softmax, are Gems ops).

Each overload keeps ATen's output contract, so a forward from one side and a backward from the
other (a backward outside a `use_gems` scope) agree: the output in the layout ATen allocates (cuDNN:
query's dim order; flash: like query; efficient: [B, S, H, D] transposed; CPU: like query),
logsumexp in fp32 and natural log (flash [B, H, Sq]; cuDNN [B, H, Sq, 1] or none (None) when not
requested; efficient [B, H, ceil(Sq/32)*32] or [B, H, 0] when not requested; CPU [B, Sq, H]
transposed), philox seed/offset as empty-state tensors without dropout, undefined tensors where ATen
returns them.

Dropout (cuDNN's and the efficient kernel's overloads, whose Philox state travels from the forward to
the backward): P's entries are kept with probability 1 - p by a Philox mask that is a function of
(seed, offset, query row, key) only, so the backward's tiles can regenerate it; the softmax's denominator
and the logsumexp take every entry (as ATen's math: dropout after the softmax), the output is scaled by
1 / (1 - p). Same distribution as ATen's, not the same bits. Seed and offset come from the device's
default generator per call (`torch.manual_seed` reproduces a run; plans draw them per call) and the
forward kernel writes them into a (2,) int64 tensor returned as philox_seed (philox_offset is a view
of its second element), which the backward kernels read on the device. None of ATen's overloads returns
its state in that shape, so a backward handed ATen's state goes to ATen ("dropout state not from
Gems' forward"). A forward served by Gems with its backward run by ATen's kernel (a backward outside
the `use_gems` scope of its forward) would draw another mask: keep both in one scope. Dropout under
CUDA graph capture goes to ATen (the generator is read on the host).
Semantics follow SDPA's math reference: `is_causal` is top-left aligned when Sq != Sk (key j visible
to query i iff j <= i); a float `attn_bias`/`attn_mask` is added to the scaled scores, a bool one
keeps where True (SDPA converts bool masks to float before the fused ops; cuDNN's conversion uses
-65504, with which a fully masked row attends uniformly, as in ATen); a row with no visible key gives
0 (out) and 0 (lse), ATen's CPU answer (and SDPA's math convention). GQA: a key/value with fewer heads
(Hq % Hkv == 0) is indexed per query head as h // (Hq / Hkv), never repeated in memory. Masks are
read through their strides, broadcast dims with stride 0, never expanded in memory.

Left to ATen (counted in `gems.stats()` with the reason): dropout_p > 0 in the flash and CPU overloads
("dropout"; they carry no Philox state to their backward), head dim > 256,
value head dim != query head dim, varlen (cum_seq) backward, debug masks, a bias that needs its
gradient, empty sequences, inputs that are not 4-d.

Kernels and the math of each: gems/ops/attention/kernels.py (forward: online softmax in base 2,
unmasked key blocks below the causal diagonal, masked diagonal/ragged blocks; backward: delta, dK/dV
per key block, dQ per query block, deterministic). Head dims that are not a power of two (80, 96)
run in a padded BLOCK_D with masks; fp32 inputs (efficient attention on CUDA) use full-precision dots.
Decode (<= 16 queries): GQA groups are packed into one program per KV head, and when that still
leaves SMs idle the keys are split over programs (flash-decoding) and merged by a combine kernel that
reads every split of a row in one tile; on Hopper K and V arrive by TMA (DECODE_TMA). Device time
0.73-1.06x cuDNN's over 15 decode shapes, geomean 0.975 (H200).
Dropout: the forward's keep mask is stored (a bit per score, in words packed from the MMA's registers,
after [seed, offset] in the state tensor the overloads return as philox_seed) where it is no larger
than Q (Sk <= 16 * head dim, `dropout_bits_words`), so the backward kernels read it instead of
running Philox twice more; Philox numbers a 2 x 2 block of scores per call (queries i, i ^ 8, keys
j, j ^ 8), which Hopper's MMA layout keeps in one thread, so no tile goes through shared memory.
Launch configs: `launch_config` (per kind, padded head dim, fp32-or-not, GPU or interpreter), cached;
`set_config` overrides one (benchmarks/attention.py --sweep).

Hopper forward, head dim 128, no mask or dropout (prefill and training of Llama-2-class models): the
warp-specialized Gluon kernel of gems/ops/attention/gluon_fwd.py (a TMA loader warp, two consumer
warpgroups, FlashAttention-3's overlap of the next Q K^T with the softmax, one program per SM). cuDNN
runs a FlashAttention-3-class kernel on Hopper (500-620 TFLOP/s); the Triton kernel's structure took
1.19-1.36x its time there, and TMA loads or Triton's `warp_specialize` did not move it (docs/perf.md);
the Gluon kernel takes 0.79-0.99x at 2048-8192 tokens. The backward on the
same calls: gems/ops/attention/gluon_bwd.py (one program per 128 keys, dQ accumulated across programs
by TMA reduce-adds, so nothing is recomputed: 5 GEMMs per block pair where the Triton kernels' dK/dV
and dQ passes take 7; 1.02-1.09x cuDNN's backward against the Triton kernels' 1.19-1.52x).
Everything else (masks, dropout, decode, other head dims, fp32, other GPUs, operands TMA cannot
address) takes the Triton kernels.

Served by default: `gems.enable()` serves these overloads; they form the group "attention", so
`gems.enable(exclude=("attention",))` leaves SDPA to ATen. On an H200: forward 0.79-0.99x cuDNN's
time at Llama-2's prefill shapes, backward 1.02-1.09x, decode 0.73-1.06x (geomean 0.975),
BERT's attention dropout 0.90-0.95x forward+backward; the four models' `gems-coverage
parity` passes with these kernels in the path (docs/perf.md).

Call plans: every overload gets plans. The cuDNN and flash forwards return SymInts (max_q, max_k):
sizes, replayed as the recorded constants (without plans these calls took the Python path, 70-140 us of
host per call on an H100, as much as BERT's whole attention kernel).

Bias tiles: a mask shared by every query of a block (a padding mask [B, 1, 1, Sk] has stride 0 along
the queries; or a single query) is read as one vector per key block (the kernels' BIAS_ROW), not as a
[BLOCK_M, BLOCK_N] tile; such calls take the unmasked forward's configs.
"""
from __future__ import annotations

import functools
import math

import torch

from ...registry import FLOATS, Unsupported
from ...runtime import backend, kernel, plan
from ...runtime.backends import unserved_dtypes
from ...runtime.alloc import empty
from ...runtime.utils import cdiv, next_pow2, sm_count, span
from . import kernels as K
from ..blas import tma as gemm_tma
from . import gluon_bwd, gluon_fwd

_fwd = kernel(K.attn_fwd)
_combine = kernel(K.attn_combine)
_pre = kernel(K.attn_bwd_pre)
_dkdv = kernel(K.attn_bwd_dkdv)
_dq = kernel(K.attn_bwd_dq)
_gsum = kernel(K.attn_bwd_group_sum)

_LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256

# Launch configs: kind -> (BLOCK_M, BLOCK_N, num_warps, num_stages). `set_config` overrides one
# (benchmarks/attention.py --sweep uses it to try others on the GPU).
_OVERRIDES: dict = {}


def set_config(kind: str, block_d: int, ieee: bool, cfg):
    """Force the launch config of one (kind, padded head dim, fp32) bucket; cfg None restores the table."""
    if cfg is None:
        _OVERRIDES.pop((kind, block_d, ieee), None)
    else:
        _OVERRIDES[(kind, block_d, ieee)] = tuple(cfg)
    launch_config.cache_clear()


@functools.lru_cache(maxsize=256)
def launch_config(kind: str, block_d: int, ieee: bool, interp: bool):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of a kernel kind: fwd (no mask, or one shared by the
    queries: BIAS_ROW), fwd_bias (a mask read as tiles, not causal), fwd_dropout (not causal), fwd_causal,
    decode, dkdv, dq. tests/core/test_gpu_compile.py compiles every GPU entry for sm_90 (with a bias: the
    most shared memory) and checks it fits."""
    o = _OVERRIDES.get((kind, block_d, ieee))
    if o is not None:
        return o
    if interp:
        # the interpreter runs one program at a time: few, wide programs; several blocks per test shape
        return {"fwd": (32, 16, 1, 1), "fwd_bias": (32, 16, 1, 1),
                "fwd_dropout": (32, 16, 1, 1), "fwd_causal": (32, 16, 1, 1),
                "decode": (16, 16, 1, 1), "dkdv": (16, 32, 1, 1), "dq": (32, 16, 1, 1)}[kind]
    if ieee:   # fp32: register- and shared-memory-hungry full-precision dots
        return {"fwd": (64, 32, 4, 2), "fwd_bias": (64, 32, 4, 2),
                "fwd_dropout": (64, 32, 4, 2), "fwd_causal": (64, 32, 4, 2),
                "decode": (16, 32, 4, 2), "dkdv": (32, 32, 4, 2), "dq": (32, 32, 4, 2)}[kind]
    # sm90, fp16/bf16: the fastest of `python -m benchmarks.attention --sweep` on an H100
    # (docs/perf.md) at Llama-2's [B, 32, S, 128] (causal and not) and BERT's [32, 12, 512, 64] with its
    # padding mask. A mask's tiles are pipelined through shared memory too: 128 x 128 x 3 stages with a
    # bias tile needs 256 KiB at head dim 128 (sm_90 has 227), hence fwd_bias.
    # fwd_dropout (not causal): Philox's registers on top of the scores': 128 x 64 x 4 warps spills. At head
    # dim <= 64, 64 x 32 x 4 x 2 was the best of 36 over BERT's [32, 12, S, 64] with its padding mask, S = 128,
    # 256, 512: 0.92 / 1.02 / 1.06 of cuDNN's forward where the previous 64 x 64 x 4 x 2 took 1.05 / 1.24 /
    # 1.20 (H200, kernel time; the backward is the larger part of the pair).
    # fwd at head dim <= 64: 64 x 64 x 4 x 2 on an H200 (on an H100: 128 x 64 x 4 x 4). At BERT's
    # [32, 12, S, 64] with its padding mask it took 11.4 / 31.8 us at S128 / S256 against 14.4 / 37.9 for
    # 128 x 64 x 4 x 4 and cuDNN's 12.2 / 34.0; at S512 it was the best of the sweep's 36
    # configs, 108 us against 123
    if block_d <= 64:
        return {"fwd": (64, 64, 4, 2), "fwd_bias": (128, 64, 4, 4),
                "fwd_dropout": (64, 32, 4, 2), "fwd_causal": (64, 64, 4, 3),
                "decode": (16, 64, 4, 3), "dkdv": (32, 64, 4, 3), "dq": (64, 32, 4, 3)}[kind]
    if block_d <= 128:
        # decode: K/V by TMA (DECODE_TMA), 128 keys x 2 stages, from a sweep of 15 decode shapes on an H200
        # (geomean 0.975 of cuDNN's device time; 64 x 3 stages: 1.008)
        return {"fwd": (128, 128, 8, 3), "fwd_bias": (64, 64, 4, 3),
                "fwd_dropout": (64, 64, 4, 3), "fwd_causal": (64, 64, 4, 3),
                "decode": (16, 128, 4, 2), "dkdv": (64, 64, 4, 2), "dq": (128, 64, 8, 3)}[kind]
    return {"fwd": (64, 32, 8, 2), "fwd_bias": (64, 32, 8, 2),
            "fwd_dropout": (64, 32, 8, 2), "fwd_causal": (64, 32, 8, 2),
            "decode": (16, 32, 8, 2), "dkdv": (16, 32, 8, 2), "dq": (32, 16, 8, 2)}[kind]


def _fwd_kind(decode: bool, causal: bool, bias_tile: bool, dropout: bool = False) -> str:
    """bias_tile: a bias read as [BLOCK_M, BLOCK_N] tiles (not BIAS_ROW), which needs smaller blocks; so
    does dropout (Philox's registers)."""
    return ("decode" if decode else "fwd_causal" if causal else "fwd_dropout" if dropout else
            "fwd_bias" if bias_tile else "fwd")


@functools.lru_cache(maxsize=16)
def _sm_count(device_type: str, index) -> int:
    if device_type != "cuda":
        return 4     # the interpreter: small enough that test shapes exercise split-KV
    return sm_count(index)


def _interp(t) -> bool:
    return t.device.type != "cuda"


def _matching_strides(shape, ref):
    """Dense strides for `shape` with `ref`'s dim order (ATen's alloc_with_matching_layout/empty_like)."""
    order = sorted(range(len(shape)), key=lambda i: ref.stride(i), reverse=True)
    strides = [0] * len(shape)
    s = 1
    for i in reversed(order):
        strides[i] = s
        s *= max(shape[i], 1)
    return tuple(strides)


def alloc_like(shape, ref, dtype=None):
    return empty(tuple(shape), dtype or ref.dtype, ref.device, _matching_strides(shape, ref))


def alloc_permuted(shape, perm, dtype, device):
    """torch.empty_permuted: memory in `perm` order, logical `shape`."""
    phys = [shape[p] for p in perm]
    strides_phys = [0] * len(phys)
    s = 1
    for i in reversed(range(len(phys))):
        strides_phys[i] = s
        s *= max(phys[i], 1)
    strides = [0] * len(shape)
    for j, p in enumerate(perm):
        strides[p] = strides_phys[j]
    return empty(tuple(shape), dtype, device, tuple(strides))


def validate(q, k, v, bias, dropout_p, allow_dropout=False):
    """Raise Unsupported for inputs the kernels leave to ATen; returns (B, Hq, Hkv, Sq, Sk, D).
    allow_dropout: the overload carries Philox state from its forward to its backward (cuDNN's and the
    efficient kernel's); the others leave dropout to ATen."""
    if dropout_p and dropout_p > 0.0:
        if not allow_dropout:
            raise Unsupported("dropout")
        if not dropout_p <= 1.0:
            raise Unsupported("dropout_p > 1")
        if q.is_cuda and torch.cuda.is_current_stream_capturing():
            raise Unsupported("dropout under CUDA graph capture")   # the generator is read on the host
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise Unsupported("not 4-d")
    if q.is_nested or k.is_nested or v.is_nested:
        raise Unsupported("nested tensor")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in FLOATS:
        raise Unsupported("dtype mix")
    B, Hq, Sq, D = q.shape
    Bk, Hkv, Sk, Dk = k.shape
    if tuple(v.shape[:3]) != (Bk, Hkv, Sk) or Bk != B or Dk != D:
        raise Unsupported("shape mismatch")
    if v.shape[3] != D:
        raise Unsupported("value head dim differs")
    if D > MAX_HEAD_DIM:
        raise Unsupported(f"head dim > {MAX_HEAD_DIM}")
    if Hkv == 0 or Hq % Hkv:
        raise Unsupported("query heads not a multiple of key heads")
    if B * Hq * Sq * D == 0 or Sk == 0:
        raise Unsupported("empty")
    if bias is not None:
        if bias.dim() > 4 or not (bias.dtype == torch.bool or bias.dtype.is_floating_point):
            raise Unsupported("attn_bias shape/dtype")
        try:
            torch.broadcast_shapes(tuple(bias.shape), (B, Hq, Sq, Sk))
        except RuntimeError:
            raise Unsupported("attn_bias not broadcastable") from None
    # the kernels keep batch and head offsets in 64 bits but position x stride in 32 (a full [Sq, Sk]
    # mask of 46341 x 46341, or Q in Hugging Face's [B, S, H, D] layout past (S - 1) x H x D = 2**31):
    # an operand or result addressing 2**31 elements or more goes to ATen instead of wrapping
    if max(B * Hq * Sq * D, B * Hkv * Sk * D) >= _I32:
        raise Unsupported("2**31 elements or more (32-bit offsets)")
    _offsets_fit(q, k, v, bias)
    return B, Hq, Hkv, Sq, Sk, D


_I32 = 2**31


def _offsets_fit(*ts):
    """Raise Unsupported when a tensor's addressed range (first to last element, by its strides) reaches
    2**31 elements: the kernels' 32-bit position offsets would wrap."""
    if any(t is not None and span(t) >= _I32 for t in ts):
        raise Unsupported("2**31 elements or more (32-bit offsets)")


def _bias_args(bias, q, B, Hq, Sq, Sk):
    if bias is None:
        return q, (0, 0, 0, 0), False, False
    b = bias.expand(B, Hq, Sq, Sk)     # a view: broadcast dims get stride 0
    return b, b.stride(), True, bias.dtype == torch.bool


def _bias_row(has_bias, bst, Sq, pack=False) -> bool:
    """Whether every query of a block sees the same bias row (the kernels' BIAS_ROW): the expanded
    bias has stride 0 along the queries (a padding mask [B, 1, 1, Sk]) or there is one query, and, when
    a block packs a GQA group's heads, stride 0 along the heads too."""
    return has_bias and (bst[2] == 0 or Sq == 1) and (not pack or bst[1] == 0)


def softmax_scale(q, scale):
    if scale is None:
        return 1.0 / math.sqrt(q.shape[-1])
    scale = float(scale)
    if not scale > 0.0 or math.isinf(scale):   # the kernels take max(q k^T) * scale = max(q k^T * scale)
        raise Unsupported("scale <= 0 or not finite")
    return scale


def _strides4(t):
    return t.stride()


# split-KV decode: aim at this many programs per SM, each with at least this many keys (GPU). From
# sweeps of 15 decode shapes (KV 512-32768, batch 1-16, GQA 32/4 and 32/8) on an H200
# (docs/perf.md): 2 and 128 with the TMA decode config (geomean 0.975 of cuDNN's device time; 4 and
# 256 with the old one-split-at-a-time combine: 1.043); more, shorter programs pay the pipeline's
# prologue more often
SPLIT_PROGRAMS_PER_SM = 2
SPLIT_MIN_KEYS = 128
# and no split below this many keys (GPU): a split call is two dependent launches, and at 256 keys the
# second one's start costs more than the idle SMs (H200, B1 x 32 heads and GQA 32/4, 32/8:
# 2 splits 1.04-1.08x cuDNN's time per call, one program per head 0.95-0.99x; kernel time 0.81-0.90x
# either way); from 384 keys the split wins (3 splits: kernel 0.80-0.88x, one program 0.97-1.07x)
SPLIT_FROM_KEYS = 384
# the combine merges every split of a row in one [splits, head dim] tile
MAX_SPLITS = 64


def _splits(progs, Sk, sk_eff, BN, interp, device, decode):
    """(number of KV splits, keys per split): split-KV for decode-like calls (<= 16 queries) when one
    program per query block leaves SMs idle and the keys are long; each split keeps >= SPLIT_MIN_KEYS
    keys on the GPU. (Prefill never splits: its fp32 partials would cost more than the idle SMs.)"""
    sms = _sm_count(device.type, device.index)
    min_chunk = 2 * BN if interp else SPLIT_MIN_KEYS
    if not decode or progs >= sms or sk_eff < max(2 * min_chunk, 0 if interp else SPLIT_FROM_KEYS):
        return 1, Sk
    ns = min(cdiv(SPLIT_PROGRAMS_PER_SM * sms, progs), sk_eff // min_chunk, MAX_SPLITS)
    split_len = cdiv(cdiv(sk_eff, ns), BN) * BN
    ns = cdiv(sk_eff, split_len)
    return (ns, split_len) if ns > 1 else (1, Sk)


def num_splits(B, Hq, Sq, Sk, D, dtype, causal, device, Hkv=None) -> int:
    """How many KV splits the forward uses for these shapes (tests, benchmarks)."""
    BD = max(16, next_pow2(D))
    interp = device.type != "cuda"
    decode = Sq <= 16
    # (the mask does not change the decode kind, the only one that splits)
    BM, BN, _, _ = launch_config(_fwd_kind(decode, causal, False), BD, dtype == torch.float32, interp)
    if decode and Hkv is not None and Hkv != Hq:
        nm, nbh = _packed(B, Hq, Hkv, Sq, BM)
        return _splits(nm * nbh, Sk, min(Sk, Sq) if causal else Sk, BN, interp, device, True)[0]
    nm = cdiv(Sq, BM)
    return _splits(B * Hq * nm, Sk, min(Sk, nm * BM) if causal else Sk, BN, interp, device, decode)[0]


# decode (<= 16 queries) on Hopper reads K and V by TMA where their layout allows (see DECODE_TMA's
# measurement in docs/perf.md); False: pointer loads everywhere
DECODE_TMA = True


def _decode_tma(q, k, v) -> bool:
    return DECODE_TMA and gluon_fwd.tma_operands(q, k, v)


def _kv_desc(t, block_n):
    """Triton's host descriptor of K or V [B, Hkv, Sk, D] through its own strides, boxes of [1, 1, block_n, D]."""
    return gemm_tma.descriptor(t, list(t.shape), list(t.stride()), [1, 1, block_n, t.shape[3]])


def _packed(B, Hq, Hkv, Sq, BM):
    """(query blocks, programs along axis 1) of the GQA-decode packing: rows = (group head, query)."""
    return cdiv((Hq // Hkv) * Sq, BM), B * Hkv


def _keep_args(dropout_p):
    """(thr, inv_keep) of a dropout probability: keep iff a Philox uint32 < thr = keep * 2**32."""
    keep = 1.0 - dropout_p
    return min(int(keep * 2.0 ** 32), 2 ** 32 - 1), (0.0 if keep == 0.0 else 1.0 / keep)


# Dropout's mask is stored for the backward (a bit per score) instead of regenerated by Philox in both
# backward kernels when it is no larger than Q: Sk <= 16 * D keys (BERT: 512 <= 1024; Llama-2: up to
# 2048 tokens; longer: regenerated). False: always regenerate (tests compare the two).
DROPOUT_BITS = True


def dropout_bits_words(B, Hq, Sq, Sk, D) -> int:
    """int64 words of the stored dropout mask of these shapes (0: the mask is regenerated)."""
    if not DROPOUT_BITS or Sk > 16 * D:
        return 0
    # query pairs (i, i ^ 8; rows padded to 16) x keys padded to 128: kernels._query_pairs, _bits_row
    return B * Hq * cdiv(Sq, 16) * 8 * cdiv(Sk, 128) * K.MASK_BYTES_PER_128.value // 8


def new_dropout_state(device, words=0):
    """The tensor a dropout forward writes and its backward reads: [seed, offset], then `words` int64 of
    the keep mask's bits (`dropout_bits_words`). Shape (2 + words,) int64: none of ATen's fused overloads
    returns its Philox state so (cuDNN (1,), efficient (), flash uint64), so a backward handed ATen's
    state never passes `dropout_state` and goes to ATen."""
    return empty((2 + words,), torch.int64, device)


def dropout_state(philox_seed, q, k):
    """(state, DROPOUT mode of the backward kernels: 1 regenerate, 2 read the stored bits)."""
    if not (isinstance(philox_seed, torch.Tensor) and philox_seed.dtype == torch.int64 and
            philox_seed.dim() == 1 and philox_seed.device == q.device):
        raise Unsupported("dropout state not from Gems' forward")
    n = philox_seed.shape[0]
    if n == 2:
        return philox_seed, 1
    B, Hq, Sq, D = q.shape
    if n == 2 + dropout_bits_words(B, Hq, Sq, k.shape[2], D) and philox_seed.is_contiguous():
        return philox_seed, 2
    raise Unsupported("dropout state not from Gems' forward")


def forward(q, k, v, bias, causal, scale, o, lse, dropout_p=0.0, seed_out=None):
    """o [B, Hq, Sq, D] and lse [B, Hq, Sq] (or None) are written; any strides. dropout_p > 0: P's entries
    are dropped (Philox), the output scaled by 1 / (1 - p); (seed, offset) are written to `seed_out`
    (`new_dropout_state`) for the backward, and the mask's bits after them where it has room."""
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    group = Hq // Hkv
    BD = max(16, next_pow2(D))
    ieee = q.dtype == torch.float32
    interp = _interp(q)
    decode = Sq <= 16
    qk_scale = scale * _LOG2E
    bt, bst, has_bias, bias_bool = _bias_args(bias, q, B, Hq, Sq, Sk)
    # GQA decode: the group's query heads share one program per KV head (K/V read once per group); not
    # with dropout, whose Philox counters pair a block's rows within one head
    pack = decode and group > 1 and dropout_p == 0.0
    bias_row = _bias_row(has_bias, bst, Sq, pack)
    if not decode and not has_bias and dropout_p == 0.0 and gluon_fwd.supports(q, k, v, o):
        # Hopper, head dim 128, no mask: the warp-specialized Gluon kernel (gluon_fwd.py)
        gluon_fwd.launch(q, k, v, o, lse, causal, qk_scale)
        return
    kind = _fwd_kind(decode, causal, has_bias and not bias_row, dropout_p > 0.0)
    BM, BN, W, ST = launch_config(kind, BD, ieee, interp)
    if pack:
        nm, nbh = _packed(B, Hq, Hkv, Sq, BM)
        sk_eff = min(Sk, Sq) if causal else Sk
    else:
        nm, nbh = cdiv(Sq, BM), B * Hq
        sk_eff = min(Sk, nm * BM) if causal else Sk
    ns, split_len = _splits(nbh * nm, Sk, sk_eff, BN, interp, q.device, decode)
    tma = decode and D == BD and _decode_tma(q, k, v)
    kd, vd = (_kv_desc(k, BN), _kv_desc(v, BN)) if tma else (k, v)
    common = (*_strides4(q), *_strides4(k), *_strides4(v), *bst)
    drop = dropout_p > 0.0
    mode = (2 if seed_out.shape[0] > 2 else 1) if drop else 0

    def dropout_args(prefix):
        # (seed, offset, thr, inv_keep, SeedOut); seed's position in the launch's arguments for plans
        if not drop:
            return (0, 0, 0, 1.0, o)
        seed, offset = plan.philox_for(q.device, len(prefix), B * Hq * Sq * cdiv(Sk, 4))
        return (seed, offset, *_keep_args(dropout_p), seed_out)

    if ns > 1:
        op = empty((ns, B, Hq, Sq, D), torch.float32, q.device)
        mp = empty((ns, B, Hq, Sq), torch.float32, q.device)
        lp = empty((ns, B, Hq, Sq), torch.float32, q.device)
        ost = (op.stride(1), op.stride(2), op.stride(3), op.stride(4), op.stride(0))
        lst = (mp.stride(1), mp.stride(2), mp.stride(3), mp.stride(0))
        prefix = (q, k, v, kd, vd, bt, op, mp, lp, *common, *ost, *lst, Hq, group, Sq, Sk, D, qk_scale, split_len)
        _fwd.run((nm, nbh, ns),
                 (*prefix, *dropout_args(prefix),
                  BM, BN, BD, causal, has_bias, bias_bool, D == BD, ieee, True, False, False, pack, bias_row, mode, tma),
                 W, ST)
        store = lse is not None
        lt = lse if store else o
        lst2 = (lse.stride(0), lse.stride(1), lse.stride(2)) if store else (0, 0, 0)
        _combine.run((Sq, B * Hq),
                     (op, mp, lp, o, lt, ns, Hq, op.stride(0), op.stride(1), op.stride(2), op.stride(3),
                      mp.stride(0), mp.stride(1), mp.stride(2), mp.stride(3), *_strides4(o), *lst2,
                      next_pow2(ns), BD, D == BD, D, store), 4, 1)
        return
    store = lse is not None
    lt = lse if store else o
    lst = (lse.stride(0), lse.stride(1), lse.stride(2), 0) if store else (0, 0, 0, 0)
    prefix = (q, k, v, kd, vd, bt, o, lt, o, *common, *_strides4(o), 0, *lst, Hq, group, Sq, Sk, D, qk_scale, Sk)
    _fwd.run((nm, nbh, 1),
             (*prefix, *dropout_args(prefix),
              BM, BN, BD, causal, has_bias, bias_bool, D == BD, ieee, False, store,
              bool(causal) and nm > 1 and not pack, pack, bias_row, mode, tma), W, ST)


def backward(do, q, k, v, o, lse, bias, causal, scale, dq, dk, dv, dropout_p=0.0, state=None):
    """dq, dk, dv are written. dropout_p > 0: state is `dropout_state` of the forward's state tensor."""
    _offsets_fit(do, o)    # (q, k, v and the bias were checked by validate)
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    group = Hq // Hkv
    BD = max(16, next_pow2(D))
    ieee = q.dtype == torch.float32
    interp = _interp(q)
    qk_scale = scale * _LOG2E
    bt, bst, has_bias, bias_bool = _bias_args(bias, q, B, Hq, Sq, Sk)
    bias_row = _bias_row(has_bias, bst, Sq)
    drop = dropout_p > 0.0
    if not has_bias and not drop and gluon_bwd.supports(q, k, v, o, do, dq, dk, dv, scale):
        # Hopper, head dim 128, no mask: the warp-specialized Gluon kernel (gluon_bwd.py)
        gluon_bwd.launch(do, q, k, v, o, lse, dq, dk, dv, causal, scale)
        return
    delta = empty((B, Hq, Sq), torch.float32, q.device)
    BMp = 32 if interp else 64
    _pre.run((cdiv(Sq, BMp), B * Hq), (o, do, delta, Hq, Sq, D, *_strides4(o), *_strides4(do), BMp, BD), 4, 1)
    lst = (lse.stride(0) if lse.shape[0] > 1 else 0, lse.stride(1) if lse.shape[1] > 1 else 0, lse.stride(2))
    common = (*_strides4(q), *_strides4(k), *_strides4(v), *bst, *_strides4(do), *lst)
    even = D == BD
    dargs = (state[0], *_keep_args(dropout_p), state[1]) if drop else (do, 0, 1.0, 0)
    BM1, BN1, W1, S1 = launch_config("dkdv", BD, ieee, interp)
    nkb = cdiv(Sk, BN1)
    # GQA: one program per (key block, KV head) walks all GROUP query heads; with too few such
    # programs to fill the GPU, the group is split over programs writing fp32 partials, summed after
    ng = 1
    if group > 1 and nkb * B * Hkv < _sm_count(q.device.type, q.device.index):
        ng = group
    if ng == 1:
        _dkdv.run((nkb, B * Hkv),
                  (q, k, v, bt, do, lse, delta, dk, dv, *common, *_strides4(dk), 0, *_strides4(dv), 0,
                   Hq, Hkv, group, 1, Sq, Sk, D, qk_scale, scale, BM1, BN1, BD, causal, has_bias, bias_bool, even,
                   ieee, bias_row, *dargs), W1, S1)
    else:
        pk = empty((B, Hkv, ng, Sk, D), torch.float32, q.device)
        pv = empty((B, Hkv, ng, Sk, D), torch.float32, q.device)
        pst = (pk.stride(0), pk.stride(1), pk.stride(3), pk.stride(4), pk.stride(2))
        _dkdv.run((nkb, B * Hkv * ng),
                  (q, k, v, bt, do, lse, delta, pk, pv, *common, *pst, *pst,
                   Hq, Hkv, group, ng, Sq, Sk, D, qk_scale, scale, BM1, BN1, BD, causal, has_bias, bias_bool, even,
                   ieee, bias_row, *dargs), W1, S1)
        BNs = 32
        for part, out in ((pk, dk), (pv, dv)):
            _gsum.run((cdiv(Sk, BNs), B * Hkv),
                      (part, out, ng, Hkv, Sk, D, part.stride(0), part.stride(1), part.stride(2), part.stride(3),
                       *_strides4(out), BNs, BD), 4, 1)
    BM2, BN2, W2, S2 = launch_config("dq", BD, ieee, interp)
    _dq.run((cdiv(Sq, BM2), B * Hq),
            (q, k, v, bt, do, lse, delta, dq, *common, *_strides4(dq),
             Hq, group, Sq, Sk, D, qk_scale, scale, BM2, BN2, BD, causal, has_bias, bias_bool, even, ieee, bias_row,
             *dargs),
            W2, S2)


def grads_like(q, k, v, perm=None):
    if perm is not None:
        return (alloc_permuted(q.shape, perm, q.dtype, q.device), alloc_permuted(k.shape, perm, k.dtype, k.device),
                alloc_permuted(v.shape, perm, v.dtype, v.device))
    return alloc_like(q.shape, q), alloc_like(k.shape, k), alloc_like(v.shape, v)


def attend(q, k, v, mask, scale):
    """softmax(q k^T * scale + mask) v, forward only, for callers outside SDPA (gems.decode's attention):
    q [B, Hq, Sq, D], k and v [B, Hkv, Sk, D] with GQA indexed (never repeated), `mask` None, bool (keep
    where True) or float (added), broadcastable to [B, Hq, Sq, Sk]; `scale` None = 1 / sqrt(D). No
    causal flag, no dropout, no logsumexp. Raises Unsupported, before writing anything, for what the
    dispatcher would leave to ATen (the backend's unserved dtypes, validate)."""
    why = unserved_dtypes(backend()).get(q.dtype)
    if why is not None:     # what the dispatcher leaves to ATen on this backend (bf16 on the interpreter)
        raise Unsupported(why)
    validate(q, k, v, mask, 0.0)
    out = alloc_like(q.shape, q)
    forward(q, k, v, mask, False, softmax_scale(q, scale), out, None)
    return out
