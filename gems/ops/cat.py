"""cat: concatenation along a dim, all inputs in one launch (per 4 inputs), any strides and dtypes.

The output is allocated in ATen's memory format (channels_last when every input suggests it, else
contiguous) and read in its memory order: there it is dense, so with the cat dim at position p of
that order it is a matrix Out[R, Wtot] with R = the product of the sizes before p and
Wtot = (sum of the inputs' cat sizes) * I, I = the product of the sizes after p. Input k is the
column block Out[:, off_k : off_k + W_k] with W_k = C_k * I and off_k = (C_0 + ... + C_{k-1}) * I.
Each input is read through its own strides as X_k[f_k(r) + g_k(w)], where its outer dims (before p)
and its (cat, inner) dims each merge into at most two stride groups:

    f_k(r) = (r // (R1_k R2_k)) * sR0_k + (r // R2_k % R1_k) * sR1_k + (r % R2_k) * sR2_k
    g_k(w) = (w // W1_k) * sW0_k + (w % W1_k) * sW1_k

(unused groups have size 1, which Triton specializes: no division left). Three outer groups cover
[B, H, S, D] views of [B, S, H, D] projections (rotate_half's halves of transposed queries in
prefill and training), two inner ones a cat along S of such a view (a KV cache's first keys);
contiguous inputs, slices and expanded tensors merge further. An input needing more stride groups
goes to ATen.

One kernel launch serves up to _SLOTS inputs (cat2_kernel, with half the launch arguments, exactly
two): each input's [R, W_k] block is cut into [BLOCK_R, BLOCK_W] tiles, the tiles of all inputs are
numbered consecutively, and a program finds its input from the running tile counts (scalar compares,
no wasted programs). More than _SLOTS inputs take one launch per _SLOTS. Values are cast to the result dtype on store (ATen's promotion over all
inputs). Bytes moved: read once, written once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..registry import FLOATS, INTS, Unsupported, register
from ..runtime import backend, kernel
from ..runtime.utils import cdiv, empty, next_pow2, resize_like_aten, wrap_dim

ALL = FLOATS + INTS + (torch.bool, torch.float64)
_SLOTS = 4
_INT64_FROM = 2 ** 31 - 1


@triton.jit
def _cat_tile(X, Out, t, R, Wtot, W, off, R1, R2, sR0, sR1, sR2, W1, sW0, sW1,
              BIG: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    """Tile t of input X's block: Out[r, off + w] = X[f(r) + g(w)] for r < R, w < W (see module doc)."""
    nwb = tl.cdiv(W, BLOCK_W)
    tr = t // nwb
    tw = t - tr * nwb
    if BIG:
        r = tr.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        w = tw.to(tl.int64) * BLOCK_W + tl.arange(0, BLOCK_W)
    else:
        r = tr * BLOCK_R + tl.arange(0, BLOCK_R)
        w = tw * BLOCK_W + tl.arange(0, BLOCK_W)
    rq = r // R2
    r2 = r - rq * R2
    r0 = rq // R1
    r1 = rq - r0 * R1
    w0 = w // W1
    w1 = w - w0 * W1
    src = (r0 * sR0 + r1 * sR1 + r2 * sR2)[:, None] + (w0 * sW0 + w1 * sW1)[None, :]
    mask = (r < R)[:, None] & (w < W)[None, :]
    x = tl.load(X + src, mask=mask)
    tl.store(Out + r[:, None] * Wtot + (off + w)[None, :], x.to(Out.dtype.element_ty), mask=mask)


@kernel
@triton.jit
def cat_kernel(Out, R, Wtot,
               X0, W_0, off0, R1_0, R2_0, sR0_0, sR1_0, sR2_0, W1_0, sW0_0, sW1_0,
               T1, X1, W_1, off1, R1_1, R2_1, sR0_1, sR1_1, sR2_1, W1_1, sW0_1, sW1_1,
               T2, X2, W_2, off2, R1_2, R2_2, sR0_2, sR1_2, sR2_2, W1_2, sW0_2, sW1_2,
               T3, X3, W_3, off3, R1_3, R2_3, sR0_3, sR1_3, sR2_3, W1_3, sW0_3, sW1_3,
               N: tl.constexpr, BIG: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    """Out[r, off_k + w] = X_k[f_k(r) + g_k(w)] for the N (<= 4) inputs k of this launch; program
    ids [T_k, T_{k+1}) are input k's tiles (T_0 = 0)."""
    pid = tl.program_id(0)
    if N == 1:
        _cat_tile(X0, Out, pid, R, Wtot, W_0, off0, R1_0, R2_0, sR0_0, sR1_0, sR2_0, W1_0, sW0_0, sW1_0,
                  BIG, BLOCK_R, BLOCK_W)
    elif pid < T1:
        _cat_tile(X0, Out, pid, R, Wtot, W_0, off0, R1_0, R2_0, sR0_0, sR1_0, sR2_0, W1_0, sW0_0, sW1_0,
                  BIG, BLOCK_R, BLOCK_W)
    elif N == 2:
        _cat_tile(X1, Out, pid - T1, R, Wtot, W_1, off1, R1_1, R2_1, sR0_1, sR1_1, sR2_1, W1_1, sW0_1, sW1_1,
                  BIG, BLOCK_R, BLOCK_W)
    elif pid < T2:
        _cat_tile(X1, Out, pid - T1, R, Wtot, W_1, off1, R1_1, R2_1, sR0_1, sR1_1, sR2_1, W1_1, sW0_1, sW1_1,
                  BIG, BLOCK_R, BLOCK_W)
    elif N == 3:
        _cat_tile(X2, Out, pid - T2, R, Wtot, W_2, off2, R1_2, R2_2, sR0_2, sR1_2, sR2_2, W1_2, sW0_2, sW1_2,
                  BIG, BLOCK_R, BLOCK_W)
    elif pid < T3:
        _cat_tile(X2, Out, pid - T2, R, Wtot, W_2, off2, R1_2, R2_2, sR0_2, sR1_2, sR2_2, W1_2, sW0_2, sW1_2,
                  BIG, BLOCK_R, BLOCK_W)
    else:
        _cat_tile(X3, Out, pid - T3, R, Wtot, W_3, off3, R1_3, R2_3, sR0_3, sR1_3, sR2_3, W1_3, sW0_3, sW1_3,
                  BIG, BLOCK_R, BLOCK_W)


@kernel
@triton.jit
def cat2_kernel(Out, R, Wtot,
                X0, W_0, off0, R1_0, R2_0, sR0_0, sR1_0, sR2_0, W1_0, sW0_0, sW1_0,
                T1, X1, W_1, off1, R1_1, R2_1, sR0_1, sR1_1, sR2_1, W1_1, sW0_1, sW1_1,
                BIG: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    """cat_kernel for exactly two inputs (the models' calls): half the launch arguments to pass."""
    pid = tl.program_id(0)
    if pid < T1:
        _cat_tile(X0, Out, pid, R, Wtot, W_0, off0, R1_0, R2_0, sR0_0, sR1_0, sR2_0, W1_0, sW0_0, sW1_0,
                  BIG, BLOCK_R, BLOCK_W)
    else:
        _cat_tile(X1, Out, pid - T1, R, Wtot, W_1, off1, R1_1, R2_1, sR0_1, sR1_1, sR2_1, W1_1, sW0_1, sW1_1,
                  BIG, BLOCK_R, BLOCK_W)


# tile: elements per program; max_w: widest tile along the columns. The interpreter's are small so
# the tests' small shapes still cut inputs into several tiles.
_CONFIGS = {"cuda": dict(tile=4096, max_w=2048), "interpreter": dict(tile=256, max_w=64)}


def _skipped(t) -> bool:
    # ATen's legacy rule: 1-D tensors of size 0 take no part in the shape checks or the result
    return t.dim() == 1 and t.shape[0] == 0


def _groups(dims, most):
    """(size, stride) pairs, outermost first, merged where one spans the next, as `most` groups
    (sizes of all but the outermost, then the strides; unused groups have size 1 and stride 0);
    None if more are needed."""
    out = []
    for n, s in dims:
        if n == 1:
            continue
        if out and out[-1][1] == s * n:
            out[-1] = (out[-1][0] * n, s)
        else:
            out.append((n, s))
    if len(out) > most:
        return None
    out += [(1, 0)] * (most - len(out))
    return tuple(n for n, _ in out[1:]) + tuple(s for _, s in out)


def _memory_format(tensors):
    """ATen's cat output format: the inputs' common suggested format (every input votes, skipped
    ones too), contiguous when any suggests contiguous or they differ."""
    from torch._prims_common import suggest_memory_format
    fmt = None
    for t in tensors:
        f = suggest_memory_format(t)
        if f == torch.contiguous_format or (fmt is not None and f != fmt):
            return torch.contiguous_format
        fmt = f
    return fmt


_ORDERS = {torch.channels_last: (0, 2, 3, 1), torch.channels_last_3d: (0, 2, 3, 4, 1)}


def _overlap(a, b) -> bool:
    if a.numel() == 0 or b.numel() == 0 or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    lo_a, hi_a = a.data_ptr(), a.data_ptr() + _span(a) * a.element_size()
    lo_b, hi_b = b.data_ptr(), b.data_ptr() + _span(b) * b.element_size()
    return lo_a < hi_b and lo_b < hi_a


def _span(t) -> int:
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 0)


def _dense(t) -> bool:
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1)
    expect = 1
    for s, n in dims:
        if s != expect:
            return False
        expect *= n
    return True


@register("cat", "cat.out", category="copy", dtypes=ALL)
def cat(tensors, dim=0, *, out=None):
    """Concatenation along a dim: one launch per 4 inputs, any strides, mixed dtypes promoted like ATen."""
    tensors = list(tensors)
    if not tensors:
        raise ValueError("torch.cat(): expected a non-empty list of Tensors")
    dev = tensors[0].device
    be = backend()
    for i, t in enumerate(tensors):
        if t.layout != torch.strided:
            raise Unsupported(f"layout {t.layout}")
        if t.dtype not in ALL:
            raise Unsupported(f"dtype {t.dtype}")
        if t.device != dev or t.device.type != be.device_type:
            raise Unsupported("tensors on different devices")
        if t.dim() == 0:
            raise RuntimeError(f"zero-dimensional tensor (at position {i}) cannot be concatenated")
    if be.device_type == "cuda" and dev.index != torch.cuda.current_device():
        raise Unsupported("tensors on a non-current device")
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    kept = [t for t in tensors if not _skipped(t)]
    if not kept:
        shape, d = [0], 0
    else:
        ref = kept[0]
        nd = ref.dim()
        d = wrap_dim(dim, nd)
        shape = list(ref.shape)
        total = 0
        for i, t in enumerate(tensors):
            if _skipped(t):
                continue
            if t.dim() != nd:
                raise RuntimeError(f"Tensors must have same number of dimensions: got {nd} and {t.dim()}")
            for j in range(nd):
                if j != d and t.shape[j] != shape[j]:
                    raise RuntimeError(f"Sizes of tensors must match except in dimension {d}. Expected size "
                                       f"{shape[j]} but got size {t.shape[j]} for tensor number {i} in the list.")
            total += t.shape[d]
        shape[d] = total
    fmt = _memory_format(tensors) if kept else torch.contiguous_format

    if out is None:
        strides = None
        if fmt != torch.contiguous_format:
            strides = torch.empty(shape, device="meta", memory_format=fmt).stride()
        y = empty(shape, dtype, dev, strides)
        order = _ORDERS.get(fmt, tuple(range(len(shape))))
    else:
        if not torch.can_cast(dtype, out.dtype):
            raise TypeError(f"torch.cat(): input types can't be cast to the desired output type {out.dtype}")
        if out.dtype != dtype:
            raise Unsupported("out dtype differs from the result dtype")
        if out.device != dev:
            raise Unsupported("out on another device")
        for t in tensors:
            if _overlap(out, t):
                if _dense(out) and _dense(t):
                    raise RuntimeError("unsupported operation: some elements of the input tensor and the written-to "
                                       "tensor refer to a single memory location. Please clone() the tensor before "
                                       "performing the operation.")
                raise Unsupported("out overlaps an input")
        if list(out.shape) != shape:
            resize_like_aten(out, shape)
            if fmt != torch.contiguous_format:
                out.resize_(shape, memory_format=fmt)   # ATen restrides a resized out to the format
        if out.is_contiguous():
            order = tuple(range(len(shape)))
        elif out.dim() in (4, 5) and out.is_contiguous(
                memory_format=torch.channels_last if out.dim() == 4 else torch.channels_last_3d):
            order = _ORDERS[torch.channels_last if out.dim() == 4 else torch.channels_last_3d]
        else:
            raise Unsupported("out is not dense in a memory format")
        y = out
    if y.numel() == 0:
        return y

    p = order.index(d)
    oshape = [shape[i] for i in order]
    R = 1
    for n in oshape[:p]:
        R *= n
    inner = 1
    for n in oshape[p + 1:]:
        inner *= n
    wtot = shape[d] * inner
    slots = []
    off = 0
    big = R * wtot >= _INT64_FROM
    for t in kept:
        c = t.shape[d]
        if t.numel():
            st = t.stride()
            f = _groups([(t.shape[i], st[i]) for i in order[:p]], 3)
            g = _groups([(t.shape[i], st[i]) for i in order[p:]], 2)
            if f is None or g is None:
                raise Unsupported("an input whose strides need more than two groups per side")
            slots.append((t, c * inner, off * inner, f, g))
            big = big or _span(t) >= _INT64_FROM
        off += c
    cfg = _CONFIGS[be.name]
    maxw = max(s[1] for s in slots)
    bw = min(next_pow2(maxw), cfg["max_w"])
    br = min(next_pow2(R), max(1, cfg["tile"] // bw))
    nw = max(1, min(8, br * bw // 512))
    rt = cdiv(R, br)
    for g0 in range(0, len(slots), _SLOTS):
        group = slots[g0:g0 + _SLOTS]
        args = [y, R, wtot]
        start = 0
        if len(group) == 2:
            (t0, w0, o0, f0, g0_), (t1, w1, o1, f1, g1) = group
            t_1 = rt * cdiv(w0, bw)
            cat2_kernel[(t_1 + rt * cdiv(w1, bw),)](y, R, wtot, t0, w0, o0, *f0, *g0_, t_1, t1, w1, o1, *f1, *g1,
                                                    big, br, bw, num_warps=nw)
            continue
        for k in range(_SLOTS):
            if k:
                args.append(start)
            if k < len(group):
                t, w, o, f, g = group[k]
                args += [t, w, o, *f, *g]
                start += rt * cdiv(w, bw)
            else:
                args += [None, 0, 0, 1, 1, 0, 0, 0, 1, 0, 0]
        cat_kernel[(start,)](*args, len(group), big, br, bw, num_warps=nw)
    return y
