"""multinomial with one sample per row (what sampling decoders call): Philox in Triton.

    out[b] = argmax_{v : p[b, v] > 0} p[b, v] / E[b, v],   E[b, v] = -log(1 - u[b, v]) ~ Exp(1)

The winner of this exponential race is class v with probability p[b, v] / sum_v p[b, v], the
categorical distribution ATen samples (it draws with the same race for one sample, with its own
exponentials); the contract is that distribution, not ATen's bits. Classes with p = 0 score -1 and can
never win against a positive p (whose score is >= 0 even where p / E underflows), so they are never
drawn; ties go to the smaller index. Computation in fp32 (fp16/bf16 probabilities are read exactly).

Uniforms: the vocabulary is walked in blocks of BLOCK_V = 4 Q classes; one Philox call (tl.rand4x)
gives 4 uniforms, the j-th for class blk * BLOCK_V + j * Q + k of counter

    offset + b * C + blk * Q + k,   C = cdiv(V, BLOCK_V) * Q   (counters per row)

so every (row, class) has its own (counter, j), the partial last block included (a row's range is C
wide, not cdiv(V, 4)), and Philox runs once per 4 classes instead of once per class.

Grid (row tiles, SPLIT): SPLIT programs share a row's vocabulary (chosen from the SM count, so a few
rows still fill the GPU), each walking its range with per-lane best (score, index). A program packs
its best per row into one int64 whose order is the race's, key(score) << 32 | (2^24 - 1 - index) with
key = float bits + 2 for score >= 0, 1 for -1 (p = 0), 0 for -2 (no class), and takes an atomic max
into a zeroed int64 workspace [B keys | status | one arrival counter per row tile]: the larger score
wins, on a tie the smaller index. The program that arrives last at its tile's counter decodes the
tile's keys into Out (the races of all SPLIT programs are done by then). Two launches (the workspace's
zero fill and the kernel); bytes: p read once, 8 B written per row, 8 (B + tiles + 1) B of workspace.

Invalid input raises ATen's RuntimeErrors: a negative, infinite or NaN probability anywhere ("probability
tensor contains either `inf`, `nan` or element < 0"), else a row without a positive entry ("invalid
multinomial distribution (sum of probabilities <= 0)"). Every program reports the first (code 2), the
decoding program the second (a key < 2: code 1); the workspace's status word keeps the worse (atomic
max), the host reads it once, a device synchronization that ATen's own checks pay too. So nothing but
the one read leaves the device, and an out= is written only after the check (a fresh result is copied
into it).

Served: 1-D or 2-D floating probabilities, num_samples = 1 (with or without replacement: the same for
one sample). More samples, empty inputs, more than 2^24 classes and CUDA graph capture go to ATen.

Randomness: each call takes a fresh (seed, offset) from torch's generator for the device, or the
`generator=` passed: on CUDA the generator's seed and Philox offset, advanced by the B * C counters
used (rounded up to the multiple of 4 the generator requires); on the interpreter's CPU tensors a seed
drawn from the CPU generator. `torch.manual_seed` makes runs reproducible, successive calls differ.
The seed is a per-call value a call plan cannot see: plan=False.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...registry import FLOATS, AtenError, Unsupported, register
from ...runtime import backend, kernel
from ...runtime.utils import cdiv, empty, next_pow2, resize_like_aten, target_programs, zeros

# tile: classes x rows per program and block; max_v: widest vocabulary block (4 sub-blocks of max_v / 4
# lanes); the row's blocks are split over programs until a call has about programs_per_sm x SMs of them
# (at most max_split per row: the grid's second dimension). The interpreter runs a program in ~0.1 s
# whatever its size: wide row tiles, but narrow blocks and up to 4 splits whatever the program count, so
# that test shapes walk several blocks per split, several splits per row and (B > 64) several row tiles.
_CONFIGS = {"cuda": dict(tile=2048, max_v=2048, programs_per_sm=4, max_split=1024),
            "interpreter": dict(tile=2048, max_v=32, programs=1 << 20, max_split=4)}
_MAX_CATEGORIES = 2 ** 24        # ATen's limit (fp32 represents every index exactly; 24-bit packing)
_INT64_FROM = 2 ** 31 - 1
_BAD_VALUE, _ZERO_ROW = 2, 1     # status codes, the worse one wins (ATen checks values first)


@triton.jit
def _race(P, pb, v, sV, V, bmask, u, best, best_i, bad, BIG: tl.constexpr):
    """One sub-block of Q classes v [1, Q] with its uniforms u: the lanes' running best (score, index)."""
    mask = bmask[:, None] & (v < V)
    if BIG:
        p = tl.load(P + pb + v.to(tl.int64) * sV, mask=mask, other=0.0).to(tl.float32)
    else:
        p = tl.load(P + pb + v * sV, mask=mask, other=0.0).to(tl.float32)
    bad |= ((p < 0) | (p != p) | (p == float("inf"))).to(tl.int32)    # masked lanes read 0
    e = -tl.log(1.0 - u)          # Exp(1); u = 1 gives inf (score 0), u = 0 gives -0.0 (score inf)
    score = tl.where(p > 0, tl.where(e > 0, p / e, float("inf")), -1.0)
    score = tl.where(mask, score, -2.0)
    w = score > best              # a lane sees its classes in increasing order: a tie keeps the earlier
    return tl.where(w, score, best), tl.where(w, v, best_i), bad


@kernel
@triton.jit(do_not_specialize=["seed", "offset"])   # per-call values: no binary per divisibility class
def multinomial_one(P, Out, Work, B, V, sB, sV, C, CHUNK, seed, offset,
                    BIG: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr):
    """Races the rows of tile program_id(0) over classes [program_id(1) * CHUNK, + CHUNK) (CHUNK a
    multiple of BLOCK_V): Work[b] = max(Work[b], packed best); Work[B] = max(status); the tile's last
    program (counter Work[B + 1 + tile]) writes Out[b] = index of Work[b]. Work starts zeroed."""
    tile = tl.program_id(0)
    Q: tl.constexpr = BLOCK_V // 4
    b = tile * BLOCK_B + tl.arange(0, BLOCK_B)
    bmask = b < B
    b64 = b.to(tl.int64)
    k = tl.arange(0, Q)[None, :]
    if BIG:
        pb = b64[:, None] * sB
    else:
        pb = b[:, None] * sB
    ctr = offset + b64[:, None] * C + k                   # int64: B * C may pass 2^31
    lo = tl.program_id(1) * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    best = tl.full([BLOCK_B, Q], -2.0, tl.float32)
    best_i = tl.zeros([BLOCK_B, Q], tl.int32)
    bad = tl.zeros([BLOCK_B, Q], tl.int32)
    for start in range(lo, hi, BLOCK_V):
        u0, u1, u2, u3 = tl.rand4x(seed, ctr + start // 4)   # start // 4 = blk * Q
        v = start + k
        best, best_i, bad = _race(P, pb, v, sV, V, bmask, u0, best, best_i, bad, BIG)
        best, best_i, bad = _race(P, pb, v + Q, sV, V, bmask, u1, best, best_i, bad, BIG)
        best, best_i, bad = _race(P, pb, v + 2 * Q, sV, V, bmask, u2, best, best_i, bad, BIG)
        best, best_i, bad = _race(P, pb, v + 3 * Q, sV, V, bmask, u3, best, best_i, bad, BIG)
    # scores >= 0 order as their float bits; the low word decreases with the index (ties: smaller wins)
    key = tl.where(best >= 0, best.to(tl.int32, bitcast=True) + 2, tl.where(best == -1.0, 1, 0))
    packed = (key.to(tl.int64) << 32) | (16777215 - best_i).to(tl.int64)
    tl.atomic_max(Work + b, tl.max(packed, 1), mask=bmask)
    any_bad = tl.max(tl.max(bad, 1), 0)
    tl.atomic_max(Work + B, tl.where(any_bad > 0, 2, 0).to(tl.int64))
    # all threads' maxima above are issued before this program counts itself as arrived (the acq_rel
    # counter add then orders them before the last program's reads)
    tl.debug_barrier()
    arrived = tl.atomic_add(Work + B + 1 + tile, 1)
    if arrived == tl.num_programs(1) - 1:
        # atomic reads: see the other programs' maxima at the point of coherence, not a stale cache line
        w = tl.atomic_add(Work + b, tl.zeros([BLOCK_B], tl.int64), mask=bmask)
        tl.store(Out + b, 16777215 - (w & 16777215), mask=bmask)
        zero_row = tl.max((bmask & (w < (2 << 32))).to(tl.int32), 0)      # key < 2: no p > 0
        tl.atomic_max(Work + B, tl.where(zero_row > 0, 1, 0).to(tl.int64))


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
    bv = max(4, min(next_pow2(V), cfg["max_v"]))        # 4 sub-blocks of bv / 4 lanes
    bb = min(next_pow2(B), max(1, cfg["tile"] // bv))
    tiles = cdiv(B, bb)
    nblk = cdiv(V, bv)
    # split each row's blocks over programs until the call has about `programs` of them
    programs = target_programs(cfg, dev)
    per = cdiv(nblk, min(nblk, cfg["max_split"], max(1, cdiv(programs, tiles))))   # blocks per program
    split = cdiv(nblk, per)
    counters = nblk * bv // 4                            # per row: C
    res = empty((B, 1) if two_d else (1,), torch.int64, dev)
    work = zeros((B + 1 + tiles,), torch.int64, dev)    # keys | status | arrival counters
    seed, offset = _seed_offset(dev, B * counters, generator)
    big = int(1 + (B - 1) * sB + (V - 1) * sV >= _INT64_FROM)
    multinomial_one[(tiles, split)](self, res, work, B, V, sB, sV, counters, per * bv, seed, offset,
                                    big, bb, bv, num_warps=max(1, min(8, bb * bv // 512)))
    code = int(work[B].item())     # one synchronization, as ATen's own checks
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
