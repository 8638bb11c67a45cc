"""embedding (row gather) and embedding_dense_backward (deterministic segmented row sums).

Forward: out[i, :] = weight[idx[i], :]. One program per (index, column block): the index is read once,
the row is copied with 16-byte vectors (the weight's column stride is specialized to 1 when it is),
offsets are int64 (row * stride passes 2**31 for large tables). Bytes moved: n * D * 2 * itemsize.

Backward: grad_weight[r, :] = sum_{i : idx[i] == r} grad[i, :]  (/ count(r) with scale_grad_by_freq;
zero for r == padding_idx). Atomics would make fp32 sums depend on scheduling, so like ATen's CUDA
kernel we sort: a stable sort groups equal indices into runs, a binary search gives each row its run
[lo, hi). Up to _SORT_MAX indices (every training step we model: 4 x 1024, 32 x 128) one program sorts
(index << SHIFT | position) keys with `tl.sort` (unique keys: a stable sort for free) and another
kernel binary-searches the run bounds, so the whole backward is Gems kernels and a call plan (and the
C++ fast path) can replay it; beyond that `torch.sort` + `searchsorted` (no plan, full host path).
Then two kernels, with a fixed summation order, hence bitwise deterministic:

  A. the sorted positions are cut into chunks of CHUNK; one program per (chunk, column block) walks
     its chunk in order and sums each run. A run wholly inside the chunk is final and written to its
     output row; a run crossing the chunk's start or end leaves a partial sum in Partial[chunk, 0]
     (the chunk's first run) or Partial[chunk, 1] (its last run).
  B. one program per (output row, column block): rows with no run (or the padding row) get zeros,
     runs spanning several chunks sum their chunks' partials in chunk order, single-chunk runs were
     written by A and are left alone.

So every output row is written exactly once (no zero-fill pass), the gradient is read exactly once,
and a very frequent index (BERT's token_type_ids, all zeros) is summed by many programs in parallel
instead of one. Accumulation is fp32; the result has the gradient's dtype.

With only a few indices (n <= _FEW) there is nothing to sort for: one kernel, one program per output
row, reads all n indices (n * 8 bytes, from L2) and sums the gradient rows whose index is its row, in
position order. The sort, bounds and chunk kernels were each a launch of ~4 us before the V x D write
could start (H100: 97 us against ATen's 86.5 for 8 indices into 32000 x 4096 bf16).
"""
import torch
import triton
import triton.language as tl

from ...registry import FLOATS, register
from ...runtime import backend, kernel
from ...runtime.utils import cdiv, empty, next_pow2, prepare_out, zeros

_INDEX_DTYPES = (torch.int32, torch.int64)


@kernel
@triton.jit
def embedding_fwd(W, Idx, Out, V, D, s_idx, s_w0, s_w1, BLOCK_D: tl.constexpr):
    """Out[i, d] = W[Idx[i], d]."""
    i = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    row = tl.load(Idx + i * s_idx).to(tl.int64)
    ok = (row >= 0) & (row < V)
    # ATen's CUDA kernel asserts on the device too (active under TRITON_DEBUG=1); the mask keeps an
    # out-of-range index from reading outside the table when asserts are compiled out
    tl.device_assert(ok, "embedding: index out of range in self")
    mask = cols < D
    x = tl.load(W + row * s_w0 + cols * s_w1, mask=mask & ok, other=float("nan"))
    tl.store(Out + i * D + cols, x, mask=mask)


@triton.jit
def _segment_sum(f1, v1, f2, v2):
    # segmented scan operator: a run start (flag 1) resets the running sum
    return f1 | f2, tl.where(f2 != 0, v2, v1 + v2)


@kernel
@triton.jit
def embedding_bwd_chunks(G, S, P, Lo, Out, Partial, n, V, D, s_g0, s_g1, padding_idx,
                         SCALE: tl.constexpr, CHUNK: tl.constexpr, BLOCK_D: tl.constexpr):
    """Runs of equal sorted indices S[start:end] (grad rows G[P[i]]): final sums -> Out, cut runs -> Partial.

    The chunk's CHUNK gradient rows are loaded as one tile (all loads in flight at once) and summed per
    run by a segmented inclusive scan down the rows; the row where a run ends holds the run's sum.
    A run [Lo[r], Lo[r+1]) is final here when it lies inside [start, end), else it is cut and its sum
    goes to Partial[chunk, 0] (the run holding position `start`) or Partial[chunk, 1].
    """
    c = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    start = c * CHUNK
    end = tl.minimum(start + CHUNK, n)
    pos = start + tl.arange(0, CHUNK)
    valid = pos < end
    r = tl.load(S + pos, mask=valid, other=-1)
    r_prev = tl.load(S + pos - 1, mask=valid & (pos > start), other=-1)
    r_next = tl.load(S + pos + 1, mask=valid & (pos + 1 < end), other=-1)
    first = ((pos == start) | (r != r_prev)).to(tl.int32)
    last = valid & ((pos + 1 == end) | (r != r_next))
    j = tl.load(P + pos, mask=valid, other=0)
    x = tl.load(G + j[:, None] * s_g0 + cols[None, :] * s_g1, mask=valid[:, None] & cmask[None, :], other=0.0)
    flags = tl.broadcast_to(first[:, None], (CHUNK, BLOCK_D))
    _, sums = tl.associative_scan((flags, x.to(tl.float32)), 0, _segment_sum)

    in_range = (r >= 0) & (r < V)
    lo = tl.load(Lo + r, mask=last & in_range, other=0)
    hi = tl.load(Lo + r + 1, mask=last & in_range, other=0)
    cut = (lo < start) | (hi > end)
    final = last & in_range & ~cut & (r != padding_idx)
    y = sums
    if SCALE:
        y = sums / tl.maximum(hi - lo, 1).to(tl.float32)[:, None]
    tl.store(Out + r.to(tl.int64)[:, None] * D + cols[None, :], y.to(Out.dtype.element_ty),
             mask=final[:, None] & cmask[None, :])
    slot = tl.where(lo <= start, 0, 1)
    tl.store(Partial + (c.to(tl.int64) * 2 + slot)[:, None] * D + cols[None, :], sums,
             mask=(last & in_range & cut)[:, None] & cmask[None, :])


@kernel
@triton.jit
def embedding_bwd_rows(Lo, Out, Partial, D, padding_idx,
                       SCALE: tl.constexpr, CHUNK: tl.constexpr, BLOCK_D: tl.constexpr):
    """Out[r] = 0 for rows without a run (or the padding row); sum of chunk partials for multi-chunk runs.

    Nearly every row of a vocabulary-sized table is a zero row: this kernel is a V x D write (V * D *
    itemsize bytes), whose speed is the size of one program's write (BLOCK_D: _rows_block)."""
    r = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    lo = tl.load(Lo + r)
    hi = tl.load(Lo + r + 1)
    out = Out + r.to(tl.int64) * D + cols
    if (hi == lo) | (r == padding_idx):
        tl.store(out, tl.zeros((BLOCK_D,), dtype=Out.dtype.element_ty), mask=cmask)
    else:
        cf = lo // CHUNK
        cl = (hi - 1) // CHUNK
        if cf != cl:
            # in chunk cf the run is the first run (slot 0) iff it starts the chunk, else its last (slot 1)
            slot = tl.where(lo == cf * CHUNK, 0, 1)
            acc = tl.load(Partial + (cf * 2 + slot) * D + cols, mask=cmask, other=0.0)
            for c in range(cf + 1, cl + 1):
                acc += tl.load(Partial + c * 2 * D + cols, mask=cmask, other=0.0)
            if SCALE:
                acc = acc / (hi - lo).to(tl.float32)
            tl.store(out, acc.to(Out.dtype.element_ty), mask=cmask)


def _block_d(D, itemsize):
    if backend().name == "interpreter":
        return min(next_pow2(D), 1024), 1
    # 4 KiB of a row per program: 4 warps x 32 threads x 2 vectors of 16 bytes
    block = min(next_pow2(D), 4096 // itemsize)
    return block, max(1, min(8, block * itemsize // 1024))


def _check_indices(indices):
    if indices.dtype not in _INDEX_DTYPES:
        raise RuntimeError(f"Expected tensor for argument #1 'indices' to have one of the following scalar types: "
                           f"Long, Int; but got {indices.dtype} instead (while checking arguments for embedding)")


@register("embedding", "embedding.out", category="index", dtypes=FLOATS)
def embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False, *, out=None):
    """Row gather weight[indices] (int32/int64 indices of any shape; padding_idx matters in backward only)."""
    if weight.dim() != 2:
        raise RuntimeError("'weight' must be 2-D")
    _check_indices(indices)
    V, D = weight.shape
    y = prepare_out(out, tuple(indices.shape) + (D,), weight.dtype, weight.device)
    idx = indices.reshape(-1)   # a view (with a stride) when the layout allows
    n = idx.numel()
    if n and weight.device.type == "cpu":
        # the interpreter can check cheaply (no device sync) and raise like ATen's CPU kernel
        if bool((idx < 0).any()) or bool((idx >= V).any()):
            raise IndexError("index out of range in self")
    if n == 0 or D == 0:
        return y
    if V == 0:
        raise IndexError("index out of range in self")
    block, warps = _block_d(D, weight.element_size())
    embedding_fwd[(n, cdiv(D, block))](weight, idx, y, V, D, idx.stride(0), weight.stride(0), weight.stride(1), block,
                                       num_warps=warps)
    return y


@kernel
@triton.jit
def embedding_bwd_few(G, Idx, Out, n, D, s_idx, s_g0, s_g1, padding_idx,
                      SCALE: tl.constexpr, N_BLOCK: tl.constexpr, BLOCK_D: tl.constexpr):
    """Out[r] = sum of G[i] over the positions i with Idx[i] == r, in position order (fp32; / count with
    SCALE; zero for the padding row), for n <= N_BLOCK indices. Bytes moved: V * D * itemsize written,
    the matched gradient rows read once, n * index size per program from L2."""
    r = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    cmask = cols < D
    pos = tl.arange(0, N_BLOCK)
    idx = tl.load(Idx + pos * s_idx, mask=pos < n, other=-1)
    hits = tl.sum((idx == r).to(tl.int32), 0)
    out = Out + r.to(tl.int64) * D + cols
    if (hits == 0) | (r == padding_idx):
        tl.store(out, tl.zeros((BLOCK_D,), dtype=Out.dtype.element_ty), mask=cmask)
    else:
        acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
        row = G + cols * s_g1          # advanced by a pointer step: 64-bit, whatever i * s_g0 is
        for i in range(0, n):
            if tl.load(Idx + i * s_idx) == r:
                acc += tl.load(row, mask=cmask, other=0.0).to(tl.float32)
            row += s_g0
        if SCALE:
            acc = acc / hits.to(tl.float32)
        tl.store(out, acc.to(Out.dtype.element_ty), mask=cmask)


@kernel
@triton.jit
def embedding_bwd_sort(Idx, S, P, n, V, s_idx, SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    """S, P = the indices in stable sorted order and their positions, from one sort of unique keys
    index << SHIFT | position (2^SHIFT > n). Indices outside [0, V) are clamped to -1 or V first, so
    the shift cannot overflow and no garbage index lands on a real row (the later kernels skip them)."""
    pos = tl.arange(0, BLOCK)
    m = pos < n
    idx = tl.load(Idx + pos * s_idx, mask=m, other=0).to(tl.int64)
    idx = tl.where(idx < 0, -1, tl.where(idx >= V, V, idx))
    key = tl.where(m, (idx << SHIFT) | pos, 0x7FFFFFFFFFFFFFFF)   # padding keys sort last
    key = tl.sort(key)
    tl.store(S + pos, key >> SHIFT, mask=m)
    tl.store(P + pos, key & ((1 << SHIFT) - 1), mask=m)


@kernel
@triton.jit
def embedding_bwd_bounds(S, Lo, n, V, STEPS: tl.constexpr, BLOCK: tl.constexpr):
    """Lo[r] = #{i : S[i] < r} for r in [0, V]: a lower-bound binary search per row, STEPS =
    bit_length(n) halvings (each step at least halves every row's open interval)."""
    r = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    lo = tl.zeros([BLOCK], tl.int64)
    hi = tl.zeros([BLOCK], tl.int64) + n
    for _ in tl.static_range(STEPS):
        active = lo < hi
        mid = (lo + hi) // 2
        below = tl.load(S + mid, mask=active, other=0) < r
        lo = tl.where(active & below, mid + 1, lo)
        hi = tl.where(active & ~below, mid, hi)
    tl.store(Lo + r, lo, mask=r <= V)


# one program sorts up to this many indices (a 16384-key bitonic sort: 16 int64 keys per thread at 32 warps)
_SORT_MAX = 16384


def _sort_warps(block: int) -> int:
    """Warps of the one-program sort: at most 8 keys per thread up to 8192 keys. tl.sort's network is
    unrolled per thread, so the compile time follows the keys each thread holds: for sm_90 (Triton 3.6,
    front end to ptxas, on one core) 4096 keys took 5.5 s at 4 warps (32 per thread), 3.0 at 8, 2.2 at
    16; 16384 keys 10.0 s at 16 warps, 5.5 at 32. A model's first training step compiles it (4 x 1024
    tokens: 4096 indices), among ~75 kernels that mostly take 0.1-0.5 s each."""
    return max(4, min(32, block // 256))


def _run_launches(idx, V):
    """(sorted indices, their positions, run starts Lo[0..V], the launches that fill them) of a flat
    index tensor of n > _FEW indices, as int64: one sort and one binary search of Gems' up to _SORT_MAX
    indices, torch.sort and searchsorted (run now, no launch) beyond."""
    n = idx.numel()
    if n > _SORT_MAX:
        s, p = torch.sort(idx, stable=True)
        return s, p, torch.searchsorted(s, torch.arange(V + 1, dtype=s.dtype, device=s.device)), []
    s = empty((n,), torch.int64, idx.device)
    p = empty((n,), torch.int64, idx.device)
    lo = empty((V + 1,), torch.int64, idx.device)
    block = next_pow2(n)
    return s, p, lo, [
        (embedding_bwd_sort, (1,), (idx, s, p, n, V, idx.stride(0), max(1, (n - 1).bit_length()), block),
         _sort_warps(block)),
        (embedding_bwd_bounds, (cdiv(V + 1, 1024),), (s, lo, n, V, n.bit_length(), 1024), 4)]


# up to this many indices the backward is one kernel (embedding_bwd_few) instead of four: each of its
# V programs reads every index, so it stays small
_FEW = 64

# sorted positions per chunk of the backward's first kernel; small in the interpreter so that the
# tests' short index lists still cut runs across chunks
_CHUNK = {"cuda": 16, "interpreter": 4}


def _rows_block(D, itemsize):
    """(BLOCK_D, warps) of the backward's last kernel, nearly all of it a V x D zero write. Measured on
    an H100 (V 32000, D 4096, bf16): a program writing one row of up to 8 KiB at 4 warps
    reached 3.15 TB/s (ATen's zero fill: 3.2); 4 KiB 3.08, and several rows per program no better (8 rows
    of 4 KiB: 2.99)."""
    if backend().name == "interpreter":
        return min(next_pow2(D), 1024), 1
    return min(next_pow2(D), 8192 // itemsize), 4


_BWD_TILE = 8192  # elements of the chunk kernel's tile: 64 fp32 registers per thread at 4 warps


@register("embedding_dense_backward", "embedding_dense_backward.out", category="index", dtypes=FLOATS,
          backward=True)
def embedding_dense_backward(grad_output, indices, num_weights, padding_idx, scale_grad_by_freq, *, out=None):
    """grad_weight[r] = sum of grad rows whose index is r (sort-based, deterministic, fp32 sums)."""
    _check_indices(indices)
    V = int(num_weights)
    n = indices.numel()
    D = grad_output.shape[-1] if grad_output.dim() else 1
    if grad_output.numel() != n * D:  # ATen views grad as (n, D) and needs no more than that
        raise RuntimeError(f"embedding_dense_backward: grad_output shape {list(grad_output.shape)} does not match "
                           f"indices shape {list(indices.shape)}")
    y = prepare_out(out, (V, D), grad_output.dtype, grad_output.device)
    if V == 0 or D == 0:
        return y
    g = grad_output.reshape(n, D)   # a view whenever the layout allows; strides go to the kernel
    idx = indices.reshape(-1)
    pad = int(padding_idx)
    scale = bool(scale_grad_by_freq)
    rblock, rwarps = _rows_block(D, grad_output.element_size())
    if n <= _FEW:
        embedding_bwd_few[(V, cdiv(D, rblock))](g, idx, y, n, D, idx.stride(0), g.stride(0), g.stride(1), pad, scale,
                                                next_pow2(max(n, 1)), rblock, num_warps=rwarps)
        return y
    s, p, lo, launches = _run_launches(idx, V)
    chunk = _CHUNK[backend().name]
    block, _ = _block_d(D, grad_output.element_size())
    bblock = min(block, _BWD_TILE // chunk)  # a CHUNK x bblock fp32 tile stays in registers
    nchunks = cdiv(n, chunk)
    partial = empty((nchunks, 2, D), torch.float32, g.device)
    launches += [
        (embedding_bwd_chunks, (nchunks, cdiv(D, bblock)),
         (g, s, p, lo, y, partial, n, V, D, g.stride(0), g.stride(1), pad, scale, chunk, bblock), 4),
        (embedding_bwd_rows, (V, cdiv(D, rblock)), (lo, y, partial, D, pad, scale, chunk, rblock), rwarps)]
    # each kernel reads what the one before wrote: with background compilation a first call would
    # stop at its first uncompiled kernel and meet the next one only a step later; queued together
    for k, _, args, warps in launches:
        k.ahead(args, warps)
    for k, grid, args, warps in launches:
        k[grid](*args, num_warps=warps)
    return y
