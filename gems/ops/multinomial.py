"""multinomial with one sample per row (what sampling decoders call): Philox in Triton.

    out[b] = argmax_{v : p[b, v] > 0} p[b, v] / E[b, v],   E[b, v] = -log(1 - u[b, v]) ~ Exp(1)

u uniform from Philox(seed, offset + b * V + v). The winner of this exponential race is class v with
probability p[b, v] / sum_v p[b, v], the categorical distribution ATen samples (it draws with the
same race for one sample, with its own exponentials); the contract is that distribution, not ATen's
bits. One pass over p: each program owns a tile of rows and walks the vocabulary in blocks, every
lane keeping its best (score, index); ties go to the smaller index. Classes with p = 0 score -1 and
can never win against a positive p (whose score is >= 0 even where p / E underflows), so they are
never drawn. Computation in fp32 (fp16/bf16 probabilities are read exactly).

Invalid input raises ATen's RuntimeErrors: a negative, infinite or NaN probability anywhere ("probability
tensor contains either `inf`, `nan` or element < 0"), else a row without a positive entry ("invalid
multinomial distribution (sum of probabilities <= 0)"). The same pass finds both and records the worse
in a one-element status word (atomic max; 2 and 1); the host reads it once, a device synchronization
that ATen's own checks pay too. So nothing but the one read leaves the device, and an out= is written
only after the check (a fresh result is copied into it).

Served: 1-D or 2-D floating probabilities, num_samples = 1 (with or without replacement: the same for
one sample). More samples, empty inputs, more than 2^24 classes and CUDA graph capture go to ATen.

Randomness: each call takes a fresh (seed, offset) from torch's generator for the device, or the
`generator=` passed: on CUDA the generator's seed and Philox offset, advanced by the counters used
(rounded up to the multiple of 4 the generator requires); on the interpreter's CPU tensors a seed
drawn from the CPU generator. `torch.manual_seed` makes runs reproducible, successive calls differ.
The seed is a per-call value a call plan cannot see: plan=False.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..registry import FLOATS, AtenError, Unsupported, register
from ..runtime import backend, kernel
from ..runtime.utils import cdiv, empty, next_pow2, resize_like_aten, zeros

# tile: elements per program; max_v: widest vocabulary block. The interpreter's are small so that test
# shapes walk several blocks per row and several row tiles.
_CONFIGS = {"cuda": dict(tile=4096, max_v=2048), "interpreter": dict(tile=2048, max_v=32)}
_MAX_CATEGORIES = 2 ** 24        # ATen's limit (fp32 represents every index exactly)
_INT64_FROM = 2 ** 31 - 1
_BAD_VALUE, _ZERO_ROW = 2, 1     # status codes, the worse one wins (ATen checks values first)


@triton.jit
def _first_max(v1, i1, v2, i2):
    win = (v1 > v2) | ((v1 == v2) & (i1 < i2))
    return tl.where(win, v1, v2), tl.where(win, i1, i2)


@kernel
@triton.jit(do_not_specialize=["seed", "offset"])   # per-call values: no binary per divisibility class
def multinomial_one(P, Out, Status, B, V, sB, sV, seed, offset,
                    BIG: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr):
    """Out[b] = argmax_v (P[b, v] > 0 ? P[b, v] / -log(1 - u(offset + b * V + v)) : -1) for the rows b of
    this program; Status = max(Status, 2 if a p < 0, inf or NaN, else 1 if a row has no p > 0)."""
    b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    bmask = b < B
    b64 = b.to(tl.int64)
    vv = tl.arange(0, BLOCK_V)[None, :]
    if BIG:
        pb = b64[:, None] * sB
    else:
        pb = b[:, None] * sB
    best = tl.full([BLOCK_B, BLOCK_V], -2.0, tl.float32)
    best_i = tl.zeros([BLOCK_B, BLOCK_V], tl.int32)
    bad = tl.zeros([BLOCK_B, BLOCK_V], tl.int32)
    pos = tl.zeros([BLOCK_B, BLOCK_V], tl.int32)
    for start in range(0, V, BLOCK_V):
        v = start + vv
        mask = bmask[:, None] & (v < V)
        p = tl.load(P + pb + v * sV, mask=mask, other=0.0).to(tl.float32)
        bad |= (mask & ((p < 0) | (p != p) | (p == float("inf")))).to(tl.int32)
        pos |= (p > 0).to(tl.int32)
        # counters: offset + b * V + v (int64: B * V may pass 2^31)
        u = tl.rand(seed, offset + b64[:, None] * V + v)
        e = -tl.log(1.0 - u)          # Exp(1); u = 1 gives inf (score 0), u = 0 gives -0.0 (score inf)
        score = tl.where(p > 0, tl.where(e > 0, p / e, float("inf")), -1.0)
        score = tl.where(mask, score, -2.0)
        w = score > best              # lanes walk v upwards: a tie keeps the earlier index
        best = tl.where(w, score, best)
        best_i = tl.where(w, v, best_i)
    _, idx = tl.reduce((best, best_i), 1, _first_max)
    tl.store(Out + b, idx.to(tl.int64), mask=bmask)
    any_bad = tl.max(tl.max(bad, 1), 0)
    zero_row = tl.max(tl.where(bmask, 1 - tl.max(pos, 1), 0), 0)
    code = tl.where(any_bad > 0, 2, tl.where(zero_row > 0, 1, 0))
    tl.atomic_max(Status, code)


def _same_device(a, b):
    """torch.Generator(device="cuda") may carry no index: it is the current device's."""
    if a.type != b.type:
        return False
    cur = torch.cuda.current_device() if a.type == "cuda" else None
    return (cur if a.index is None else a.index) == (cur if b.index is None else b.index)


def _seed_offset(device, counters, generator):
    """A fresh (seed, offset) per call from `generator`, or torch's default generator of `device`."""
    if device.type == "cuda":
        gen = generator
        if gen is None:
            gen = torch.cuda.default_generators[device.index if device.index is not None
                                                else torch.cuda.current_device()]
        off = gen.get_offset()
        gen.set_offset(off + cdiv(counters, 4) * 4)
        return gen.initial_seed() & 0x7FFFFFFFFFFFFFFF, off
    # CPU generator (the interpreter): no Philox offset; draw a seed from it
    return int(torch.randint(0, 2 ** 62, (), dtype=torch.int64, generator=generator).item()), 0


@register("multinomial", "multinomial.out", category="other", dtypes=FLOATS, plan=False)
def multinomial(self, num_samples, replacement=False, *, generator=None, out=None):
    """One sample per row of 1-D/2-D probabilities (exponential race, Philox); other counts go to ATen."""
    if num_samples != 1:
        raise Unsupported("num_samples != 1")
    if self.dim() not in (1, 2):
        raise Unsupported("not 1-D or 2-D (ATen raises)")
    if self.numel() == 0:
        raise Unsupported("empty input")
    V = self.shape[-1]
    if V > _MAX_CATEGORIES:
        raise Unsupported("more than 2^24 categories (ATen raises)")
    be = backend().name
    dev = self.device
    if be == "cuda" and torch.cuda.is_current_stream_capturing():
        raise Unsupported("CUDA graph capture")
    if generator is not None and not _same_device(generator.device, dev):
        raise Unsupported("generator on another device (ATen raises)")
    if out is not None:
        if out.dtype != torch.int64:
            raise Unsupported("out is not int64 (ATen raises)")
        if out.device != dev:
            raise Unsupported("out on another device")
    two_d = self.dim() == 2
    B = self.shape[0] if two_d else 1
    sB = self.stride(0) if two_d else 0
    sV = self.stride(-1)
    cfg = _CONFIGS[be]
    bv = min(next_pow2(V), cfg["max_v"])
    bb = min(next_pow2(B), max(1, cfg["tile"] // bv))
    res = empty((B, 1) if two_d else (1,), torch.int64, dev)
    status = zeros((1,), torch.int32, dev)
    seed, offset = _seed_offset(dev, B * V, generator)
    big = int(1 + (B - 1) * sB + (V - 1) * sV >= _INT64_FROM)
    multinomial_one[(cdiv(B, bb),)](self, res, status, B, V, sB, sV, seed, offset, big, bb, bv,
                                    num_warps=max(1, min(8, bb * bv // 512)))
    code = int(status.item())     # one synchronization, as ATen's own checks
    # ATen's messages, raised here: ATen's CUDA kernel would report them with a device-side assert
    if code == _BAD_VALUE:
        raise AtenError(RuntimeError("probability tensor contains either `inf`, `nan` or element < 0"))
    if code == _ZERO_ROW:
        raise AtenError(RuntimeError("invalid multinomial distribution (sum of probabilities <= 0)"))
    if out is None:
        return res
    if tuple(out.shape) != tuple(res.shape):
        resize_like_aten(out, res.shape)
    out.copy_(res)
    return out
