"""sort and topk along one dim: bitonic networks over 64-bit keys that carry (value, index).

What Hugging Face's sampling calls: TopKLogitsWarper `torch.topk(scores, k)` (k ~ 50) and
TopPLogitsWarper `torch.sort(scores)` on rows of a vocabulary (32000 for Llama 2), batch 1-16.

Keys. Each element becomes one int64 that orders like (value, index):

    key = (vkey(x) XOR flip) << B | index        flip = -1 (all ones) for "largest first", else 0

vkey is a monotone integer image of the value: the integer itself for integer dtypes (int32 at most:
int64 values leave no bits for the index, so int64 goes to ATen), and for floats (read as fp32, which
holds fp16/bf16 exactly) the IEEE bits with the magnitude bits flipped for negatives, so the signed
integer order is the float order; -0.0 maps to +0.0's key (ATen treats them as equal: a stable sort
keeps their input order) and every NaN to one key above +inf (ATen sorts NaN as the largest value:
last ascending, first descending, ties among NaNs in input order). Keys are distinct (the index),
so sorting them ascending is a stable sort, descending or not: equal values keep index order, as
ATen's stable=True gives (its default, unstable sort may order ties any way: ours is a valid answer
there too). Values are not decoded from keys: each output value is read back from the input at its
index, so the sign of zero and NaN payloads come out exactly as stored.

Network. `_bitonic` sorts each row of a [ROWS, 2^LOG_N] tile held in registers, viewed as a
hypercube [ROWS, 2, ..., 2]: a compare-and-swap along bit j pairs elements differing in that bit
(partner = pair sum - self: one add-reduction over a size-2 axis, exact in wrapping int64). For a
top-k it runs only the first log2(KP) merge stages (sorted runs of KP), then repeatedly keeps the
elementwise min of neighbouring runs (a run ascending against one descending: the KP smallest of
both) and re-sorts the halved tile, log2(N/KP) times. (tl.sort/tl.topk do the same on GPUs, but their
xor-reduction runs element by element in the CPU interpreter: 175 s for one 32768-row sort, 0.8 s
here.)

Paths and expected cost (not measured: no GPU time; estimates for an H100):
* rows up to `sort_max` (16384) elements, sort or a topk the next path does not take: one program
  per row (short rows packed several per program, up to `tile` elements); log2(n)(log2(n)+1)/2
  compare-and-swap passes over the keys in registers (120 for 32768), one read of the row for the
  keys and one gathered re-read (cached) for the values. A batch of 1-16 rows keeps 1-16 SMs busy:
  latency-bound, likely tens of microseconds for a 32000-element row.
* topk of a row longer than `chunk` (4096) with KP = next_pow2(k) <= chunk / 2: stage 1 gives each
  chunk of each row its KP smallest keys (grid rows x chunks: 16 x 8 programs for the sampling case,
  filling the GPU; 21 + 6 * 7 passes over 4096 keys for KP = 64) into an int64 workspace
  [rows, chunks, KP]; stage 2 selects the KP smallest of those candidates per row (512 for
  32000 / 4096 * 64) and writes the first k. The input is read once; the workspace is small.
* longer rows otherwise (sort beyond `sort_max`, a large k of such a row): runs of `run` (512 on the
  GPU) elements are sorted (stage 1 with KP = run) into a [rows, runs * run] key buffer, then ceil(log2(runs))
  merge passes (`merge_runs`, one program per output tile of `run` keys) double the sorted runs,
  reading and writing the keys once each (8 bytes per element); the last writes the first k values
  and indices. 32000 elements (Llama 2's vocab): 63 run sorts and 6 passes per row; measured on an
  H200 at [16, 32000] fp32: 0.075 ms against ATen's 0.110 (runs of 1024: 0.135).
* rows beyond 2^31 elements go to ATen (the index would not fit the key).
topk's `sorted=False` gets sorted output (any order of the right set is valid).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch._prims_common import is_non_overlapping_and_dense_or_false

from ...registry import FLOATS, Unsupported, register
from ...runtime import backend, kernel
from ...runtime.utils import cdiv, empty, next_pow2, prepare_out, wrap_dim
from ..reduce.reduction import mrk_plan

# int64 is left out: its values fill the whole key (no bits for the index). bool sorts as 0/1;
# ATen's topk rejects bool on CPU, so it is not declared there (ATen raises its own error).
SORT_DTYPES = FLOATS + (torch.int8, torch.int16, torch.int32, torch.uint8, torch.bool)
TOPK_DTYPES = FLOATS + (torch.int8, torch.int16, torch.int32, torch.uint8)

_PAD = tl.constexpr(2 ** 63 - 1)   # the key of a padding slot: after every real key

# sort_max: longest row (padded to a power of two) one program sorts; tile: elements per program when
# short rows are packed; chunk: topk stage-1 elements per program; run: the sorted chunks that long
# rows are merged from (and the merge tile). Untuned starting points. sort_max is bounded by shared
# memory: the compiled network stages the whole tile there, 8 bytes a key, and 32768 keys (256 KiB)
# exceed an H100's 227 KiB per block; 16384 take 128 KiB. run=512, probes=32 (the merge search's
# candidates per step), one warp per program: a sort of [16, 32000] fp32 (TopPLogitsWarper) takes
# 60 us of device time against ATen's 77 and 86-111 us with runs of 1024 or 2048 at 1-4 warps; 0.075 ms
# per call through the dispatcher against ATen's 0.110 (H200; runs of 1024 with the
# scalar binary search, the earlier default: 0.140). Short runs sort in registers quickly, the extra
# merge passes are cheap at this size, and one warp per program keeps the most programs per SM.
# chunk_warps: topk's stage 1 (one program per 4096 elements of a row), 8 warps: k=50 of [16, 32000]
# fp32 in 30.1 us of device time against ATen's 49.0 (4 warps: 39.7; chunks of 1024 or 2048 at 1-8
# warps: 37-66; H200, out-of-tree sweep of profiler sums).
_CONFIGS = {
    "cuda": dict(sort_max=16384, tile=4096, chunk=4096, chunk_warps=8, run=512, probes=32, merge_warps=1),
    # the interpreter runs programs one by one in Python (a few wide ones are fastest); the GPU's
    # sort_max and chunk, so that the tests' rows take the same paths as on the GPU
    "interpreter": dict(sort_max=16384, tile=1024, chunk=4096, chunk_warps=None, run=16384, probes=4,
                        merge_warps=None),
}


def _cfg():
    return _CONFIGS[backend().name]


@triton.jit
def _merge(h, s: tl.constexpr, ALTERNATE: tl.constexpr):
    """Sort every bitonic run of 2^s elements of the hypercube h: ascending, or (ALTERNATE) descending
    where index bit s is 1. Step i compares pairs differing in index bit s-1-i: the lower index keeps
    the min (the max in a descending run), the upper one the other.
    (Written inline, without helper calls: the interpreter re-patches the language per jit call.)"""
    ND: tl.constexpr = len(h.shape)
    if ALTERNATE:
        desc = tl.reshape(tl.arange(0, 2), [1] * (ND - 1 - s) + [2] + [1] * s)
    else:
        desc = 0
    for i in tl.static_range(s):
        # axis ND - s + i holds index bit s-1-i. (Written out, not named: compiled code may not re-bind
        # a constexpr name in a loop, and an unannotated name would make it a tensor)
        # a + b - self is the partner; int64 wrap-around keeps it exact for any keys. (tl.sum's own
        # combine, called directly: the interpreter runs it with numpy, and tl.sum is one more jit call)
        partner = tl.reduce(h, ND - s + i, tl.standard._sum_combine, keep_dims=True) - h
        upper = tl.reshape(tl.arange(0, 2), [1] * (ND - s + i) + [2] + [1] * (s - 1 - i))
        h = tl.where((upper ^ desc) != 0, tl.maximum(h, partner), tl.minimum(h, partner))
    return h


@triton.jit
def _bitonic(keys, ROWS: tl.constexpr, LOG_N: tl.constexpr, LOG_K: tl.constexpr):
    """The 2^LOG_K smallest of each row of keys [ROWS, 2^LOG_N], ascending (LOG_K = LOG_N: a full sort).

    Passes: LOG_K (LOG_K + 1) / 2 compare-and-swaps over the tile, then per halving one min and LOG_K
    compare-and-swaps over the remaining half."""
    h = tl.reshape(keys, [ROWS] + [2] * LOG_N)
    for s in tl.static_range(1, LOG_K + 1):
        h = _merge(h, s, s < LOG_N)
    for s in tl.static_range(LOG_K + 1, LOG_N + 1):
        # runs of 2^LOG_K alternate ascending / descending: the min of a pair of runs is a bitonic
        # run holding the 2^LOG_K smallest of both
        h = tl.min(h, len(h.shape) - 1 - LOG_K)
        h = _merge(h, LOG_K, s < LOG_N)
    return tl.reshape(h, [ROWS, 2 ** LOG_K])


@triton.jit
def _keys(x, idx, valid, IS_FLOAT: tl.constexpr, FLIP: tl.constexpr, B: tl.constexpr):
    """key = (vkey(x) ^ flip) << B | idx (module docstring); padding slots get _PAD.

    Floats are keyed from their bits with integer operations only: the GPU's float compares and
    conversions flush subnormals to zero, which would tie them with 0. A 16-bit float's bits are
    shifted into the top half: sign-magnitude order is value order in any IEEE width, and only the
    infinity's pattern (INF, for the NaN test) differs between the layouts."""
    if IS_FLOAT:
        if x.dtype == tl.float32:
            bits = x.to(tl.int32, bitcast=True)
            INF: tl.constexpr = 0x7F800000
        else:
            bits = x.to(tl.int16, bitcast=True).to(tl.int32) << 16
            INF: tl.constexpr = 0x7F800000 if x.dtype == tl.bfloat16 else 0x7C000000
        mag = bits & 0x7FFFFFFF
        # negative floats: flip the magnitude bits so that larger magnitudes order lower
        v = bits ^ ((bits >> 31) & 0x7FFFFFFF)
        v = tl.where(mag == 0, 0, v)                    # -0.0 ties with +0.0
        v = tl.where(mag > INF, 0x7FC00000, v)   # every NaN: one value above +inf in every layout
        v = v.to(tl.int64)
    else:
        v = x.to(tl.int64)
    if FLIP:
        v = ~v
    key = (v << B) | idx.to(tl.int64)
    return tl.where(valid, key, _PAD)


@kernel
@triton.jit
def select_rows(X, WS, V, I, R, N, K, sM, sN, sK, KO, oM, oN, oK, k, NC,
                IS_FLOAT: tl.constexpr, FLIP: tl.constexpr, FROM_WS: tl.constexpr, B: tl.constexpr,
                ROWS: tl.constexpr, LOG_N: tl.constexpr, LOG_K: tl.constexpr):
    """Per row j: keys of the row (or, FROM_WS, its NC stage-1 candidates WS[j, :]), the 2^LOG_K smallest
    ascending; the first k written: I[j, p] = index, V[j, p] = X[j, index].

    Row j reads X[(j // K) * sM + n * sN + (j % K) * sK] and writes at (j // KO) * oM + p * oN + (j % KO) * oK.
    Offsets are int64 throughout: their cost is nothing next to the network."""
    j = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    rmask = j < R
    xbase = (j // K) * sM + (j % K) * sK
    n = tl.arange(0, 2 ** LOG_N)[None, :]
    if FROM_WS:
        valid = rmask & (n < NC)
        keys = tl.load(WS + j * NC + n, mask=valid, other=_PAD)
    else:
        valid = rmask & (n < N)
        x = tl.load(X + xbase + n.to(tl.int64) * sN, mask=valid, other=0)
        keys = _keys(x, n, valid, IS_FLOAT, FLIP, B)
    top = _bitonic(keys, ROWS, LOG_N, LOG_K)
    p = tl.arange(0, 2 ** LOG_K)[None, :]
    idx = top & ((1 << B) - 1)
    m = rmask & (p < k)
    # values re-read at their index (cached: the row was just read) rather than decoded from keys
    v = tl.load(X + xbase + idx * sN, mask=m, other=0)
    obase = (j // KO) * oM + (j % KO) * oK + p.to(tl.int64) * oN
    tl.store(V + obase, v, mask=m)
    tl.store(I + obase, idx, mask=m)


@kernel
@triton.jit
def chunk_keys(X, WS, N, K, sM, sN, sK, NCH,
               IS_FLOAT: tl.constexpr, FLIP: tl.constexpr, B: tl.constexpr,
               LOG_C: tl.constexpr, LOG_K: tl.constexpr):
    """WS[j, c, :] = the 2^LOG_K smallest keys of chunk c (2^LOG_C elements) of row j, ascending
    (padding keys where the chunk holds fewer; LOG_K = LOG_C: the sorted chunk). Keys carry the index
    in the whole row."""
    j = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    n = c.to(tl.int64) * (2 ** LOG_C) + tl.arange(0, 2 ** LOG_C)[None, :]
    valid = n < N
    x = tl.load(X + (j // K) * sM + (j % K) * sK + n * sN, mask=valid, other=0)
    keys = _keys(x, n, valid, IS_FLOAT, FLIP, B)
    top = _bitonic(keys, 1, LOG_C, LOG_K)
    tl.store(WS + (j * NCH + c) * (2 ** LOG_K) + tl.arange(0, 2 ** LOG_K)[None, :], top)


@kernel
@triton.jit
def merge_runs(WS, OUT, X, V, I, NP, L, N, K, sM, sN, sK, KO, oM, oN, oK, k,
               LAST: tl.constexpr, B: tl.constexpr, LOG_T: tl.constexpr, PROBES: tl.constexpr):
    """Merge the sorted runs of L keys of each row of WS [rows, NP] pairwise; this program makes output
    tile g (positions g*T .. g*T+T-1, T = 2^LOG_T) of row j. Merge path: a binary search on the tile's
    start diagonal t0 finds how many of the t0 keys before it come from run A (a; b = t0 - a from B);
    the tile is then the T smallest of A[a:a+T] and B[b:b+T]: min(A segment, B segment reversed) is a
    bitonic sequence holding exactly those (a half-cleaner), sorted by LOG_T compare-and-swap passes.
    Writes OUT[j, tile], or (LAST) the positions < k as values and indices.
    The search probes PROBES candidates per step with one vector load each side, narrowing [lo, hi)
    (PROBES + 1)-fold: 2-3 dependent steps instead of log2(L) (each a global-memory round trip, the
    latency every program of a pass waits through)."""
    j = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1).to(tl.int64) * (2 ** LOG_T)
    a0 = (start // (2 * L)) * (2 * L)
    len_a = tl.minimum(L, NP - a0)
    b0 = a0 + len_a
    len_b = tl.maximum(tl.minimum(L, NP - b0), 0)
    t0 = start - a0
    row = WS + j * NP
    lo = tl.maximum(t0 - len_b, 0)
    hi = tl.minimum(t0, len_a)
    # keys are distinct: a is the least count with A[a] > B[t0 - a - 1]; take(m) = A[m] < B[t0 - m - 1]
    # is true below it and false from it on. Probes m_s = lo + s * step (s < PROBES, m_s < hi): c of
    # them true puts a in (m_{c-1}, m_c]
    s = tl.arange(0, PROBES)
    while lo < hi:
        step = (hi - lo + PROBES - 1) // PROBES
        mid = lo + s * step
        ok = mid < hi
        take = ok & (tl.load(row + a0 + mid, mask=ok, other=0) < tl.load(row + b0 + t0 - mid - 1, mask=ok, other=0))
        c = tl.sum(take.to(tl.int64), axis=0)
        hi = tl.minimum(hi, lo + c * step)
        lo = tl.where(c > 0, lo + (c - 1) * step + 1, lo)
    b = t0 - lo
    i = tl.arange(0, 2 ** LOG_T)[None, :]
    ka = tl.load(row + a0 + lo + i, mask=lo + i < len_a, other=_PAD)
    rb = b + (2 ** LOG_T - 1) - i
    kb = tl.load(row + b0 + rb, mask=rb < len_b, other=_PAD)
    h = tl.reshape(tl.minimum(ka, kb), [1] + [2] * LOG_T)
    h = tl.reshape(_merge(h, LOG_T, False), [1, 2 ** LOG_T])
    p = start + i
    if LAST:
        idx = h & ((1 << B) - 1)
        m = p < k
        v = tl.load(X + (j // K) * sM + (j % K) * sK + idx * sN, mask=m, other=0)
        obase = (j // KO) * oM + (j % KO) * oK + p * oN
        tl.store(V + obase, v, mask=m)
        tl.store(I + obase, idx, mask=m)
    else:
        tl.store(OUT + j * NP + p, h)


def _log2(n):
    return n.bit_length() - 1


def _warps(elems):
    # ~32 int64 keys per thread (64 registers); untuned
    return max(1, min(32, next_pow2(elems // 1024)))


def _rows(x, d):
    """(x, rows, N, (K, sM, sN, sK)): x read as X[(j // K) * sM + n * sN + (j % K) * sK] for row j
    (rows in the logical order of the kept dims), copied to contiguous when its strides do not merge."""
    if x.dim() == 0:
        return x, 1, 1, (1, 0, 0, 0)
    plan = mrk_plan(x.shape, x.stride(), {d})
    if plan is None:
        x = x.contiguous()   # kept dims that do not merge into two strided groups: one copy
        plan = mrk_plan(x.shape, x.stride(), {d})
    M, sM, N, sN, K, sK = plan
    return x, M * K, x.shape[d], (K, sM, sN, sK)


def _out_addr(shape, d):
    """(KO, oM, oN, oK) of a contiguous output of `shape` (row j as _rows numbers them)."""
    if not shape:
        return 1, 0, 0, 0
    ko = 1
    for s in shape[d + 1:]:
        ko *= s
    return ko, shape[d] * ko, ko, 1


def _dense(x):
    """ATen's sort gives its outputs the input's strides when those are non-overlapping and dense."""
    return x.is_contiguous() or is_non_overlapping_and_dense_or_false(x)


def _path(n, k):
    """How rows of n elements give their first k keys: "single" (one program per row), "chunks"
    (per-chunk candidates, then one selection: a small k of a long row) or "merge" (sorted chunks merged
    pass by pass: long rows)."""
    cfg = _cfg()
    kp = next_pow2(k)
    chunk = cfg["chunk"]
    if n > chunk and 2 * kp <= chunk and cdiv(n, chunk) * kp <= cfg["sort_max"]:
        return "chunks"
    if next_pow2(n) <= cfg["sort_max"]:
        return "single"
    if n > 2 ** 31:   # the index gets at most 31 bits of a key, next to a 32-bit value
        raise Unsupported(f"rows of {n} elements: indices beyond 31 bits", signature=True)
    return "merge"


def _run(path, x, v, i, rows, n, addr, out_addr, k, flip):
    """Write the first k of each row's key order into v / i (addressing from _rows / _out_addr)."""
    cfg = _cfg()
    K, sM, sN, sK = addr
    KO, oM, oN, oK = out_addr
    is_float, flip = int(x.dtype.is_floating_point), int(flip)
    log_kp = _log2(next_pow2(k))
    if path == "single":
        log_n = _log2(next_pow2(n))
        rows_per = min(next_pow2(rows), max(1, cfg["tile"] >> log_n))
        select_rows[(cdiv(rows, rows_per),)](x, x, v, i, rows, n, K, sM, sN, sK, KO, oM, oN, oK, k, 0,
                                             is_float, flip, 0, log_n, rows_per, log_n, log_kp,
                                             num_warps=_warps(rows_per << log_n))
        return
    chunk = cfg["chunk"]
    log_c = _log2(chunk)
    nch = cdiv(n, chunk)
    b = _log2(next_pow2(n))   # index bits: the whole row's
    if path == "chunks":
        ws = empty((rows, nch, 1 << log_kp), torch.int64, x.device)
        chunk_keys[(rows, nch)](x, ws, n, K, sM, sN, sK, nch, is_float, flip, b, log_c, log_kp,
                                num_warps=cfg["chunk_warps"] or _warps(chunk))
        nc = nch << log_kp
        log_nc = _log2(next_pow2(nc))
        select_rows[(rows,)](x, ws, v, i, rows, n, K, sM, sN, sK, KO, oM, oN, oK, k, nc,
                             is_float, flip, 1, b, 1, log_nc, log_kp, num_warps=_warps(1 << log_nc))
        return
    # merge: sorted runs, then ceil(log2(runs)) passes merging them pairwise into the other buffer;
    # the last pass writes the first k as values and indices
    run = cfg["run"]
    nrun = cdiv(n, run)
    npad = nrun * run
    src, dst = empty((rows, npad), torch.int64, x.device), empty((rows, npad), torch.int64, x.device)
    warps = cfg["merge_warps"] or _warps(run)
    chunk_keys[(rows, nrun)](x, src, n, K, sM, sN, sK, nrun, is_float, flip, b, _log2(run), _log2(run),
                             num_warps=warps)
    length = run
    while length < npad:
        merge_runs[(rows, nrun)](src, dst, x, v, i, npad, length, n, K, sM, sN, sK, KO, oM, oN, oK, k,
                                 int(2 * length >= npad), b, _log2(run), cfg["probes"], num_warps=warps)
        src, dst = dst, src
        length *= 2


def _sort(x, dim, descending, values=None, indices=None):
    d = wrap_dim(dim, x.dim())
    shape = tuple(x.shape)
    n = shape[d] if shape else 1
    path = _path(n, n)
    if values is None and indices is None and x.dim() and _dense(x):
        # ATen's outputs take a dense input's strides. Viewed in memory order (dims by stride) the input
        # and both outputs are contiguous, so one addressing serves all three whatever the permutation
        v = empty(shape, x.dtype, x.device, x.stride())
        i = empty(shape, torch.int64, x.device, x.stride())
        if x.numel() == 0:
            return v, i
        perm = sorted(range(x.dim()), key=lambda a: -x.stride(a))
        xp, vp, ip = x.permute(perm), v.permute(perm), i.permute(perm)
        xp, rows, n, addr = _rows(xp, perm.index(d))
        out_addr = addr
    else:
        v = prepare_out(values, shape, x.dtype, x.device)
        i = prepare_out(indices, shape, torch.int64, x.device)
        if x.numel() == 0:
            return v, i
        xp, vp, ip = x, v, i
        xp, rows, n, addr = _rows(x, d)
        out_addr = _out_addr(shape, d)
    _run(path, xp, vp, ip, rows, n, addr, out_addr, n, descending)
    return v, i


@register("sort", "sort.values", category="other", dtypes=SORT_DTYPES)
def sort(self, dim=-1, descending=False, *, values=None, indices=None):
    """Stable sort: bitonic in one program up to 32768 elements, merged sorted chunks beyond."""
    return _sort(self, dim, descending, values, indices)


@register("sort.stable", "sort.values_stable", category="other", dtypes=SORT_DTYPES)
def sort_stable(self, *, stable, dim=-1, descending=False, values=None, indices=None):
    """sort with an explicit stable= (always stable here: ties keep input order)."""
    return _sort(self, dim, descending, values, indices)


@register("topk", "topk.values", category="other", dtypes=TOPK_DTYPES)
def topk(self, k, dim=-1, largest=True, sorted=True, *, values=None, indices=None):
    """k largest (smallest), sorted: per-chunk candidates then one selection for a small k of a long row."""
    d = wrap_dim(dim, self.dim())
    shape = list(self.shape)
    n = shape[d] if shape else 1
    if not 0 <= k <= n:
        raise RuntimeError("selected index k out of range")
    if shape:
        out_shape, k_out = shape[:d] + [k] + shape[d + 1:], k
    elif k == 0:
        raise Unsupported("0-dim input with k=0")   # ATen answers with the element: its own corner
    else:
        out_shape, k_out = [], 1
    path = _path(n, max(k_out, 1))
    v = prepare_out(values, out_shape, self.dtype, self.device)
    i = prepare_out(indices, out_shape, torch.int64, self.device)
    if v.numel() == 0:
        return v, i
    x, rows, n, addr = _rows(self, d)
    _run(path, x, v, i, rows, n, addr, _out_addr(out_shape, d), k_out, largest)
    return v, i
