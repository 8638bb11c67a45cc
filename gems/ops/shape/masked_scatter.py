"""masked_scatter (functional, out=, in-place) and masked_scatter_backward.

    out[p] = source.flatten()[rank(p)]   where mask[p], rank(p) = #True positions before p
    out[p] = self[p]                     elsewhere
    masked_scatter_backward: g[rank(p)] = grad[p] for the True p, zeros after the last rank

Positions p run over the broadcast shape of self and mask (self's shape in place) in row-major
order, so rank(p) is an exclusive prefix sum of the broadcast mask. Llava's call is
`inputs_embeds.masked_scatter(mask[B, S, 1] -> [B, S, H], image_features)`: each image token's row
takes the next H feature values. Three launches:

1. `mask_count`: per block of BLOCK positions, how many are True;
2. `block_scan`: one program turns those counts into each block's first rank (an exclusive scan,
   carried across chunks), the entry after the last block being the total;
3. `scatter_masked` (`gather_masked` for the backward): within a block, rank = the block's first
   rank + a `tl.cumsum` of the mask; True positions read source[rank] (write g[rank]).

Every tensor is read through its strides at the broadcast shape, with the dims merged as far as all
operands allow (at most four left, else ATen runs it). Bytes moved: the mask read twice (count,
scatter), self once where the mask is False, source once where it is True, the output written once.

Call plans: the kernels' arguments follow from the call's signature (on the CPU the host read below
keeps a shortage-possible signature on the full path: a recording sees the `.item()`).

The source-size check. ATen requires source to hold at least as many elements as the mask has True
positions. Its CPU kernel raises; its CUDA kernel (`launch_masked_scatter_kernel`) checks
asynchronously with a device-side assert, without a host sync. Gems does the same on CUDA: when
source.numel() is below the number of positions (a shortage is possible at all; Llava's call is such
a case), the scan is `block_scan_checked`, compiled with debug=True so that its `tl.device_assert`
on the total stays in the binary (Triton drops asserts otherwise). A shortage then ends the CUDA
context with a device-side assert before the scatter runs, as ATen's does; nothing wrong is ever
returned, and the call costs no host synchronization (it cost one per Llava forward before). On the
CPU (the interpreter) Gems reads the total on the host (`.item()`) and a shortage is `Unsupported`:
ATen then runs the call and raises its error. masked_scatter_backward reads its total on the host on
every device (an output smaller than the True count is an error in ATen, whose masked_select syncs on
CUDA anyway).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...codegen.layout import broadcast_strides, collapse, contiguous_strides, needs_int64
from ...registry import ALL, Unsupported, register
from ...runtime import backend, kernel
from ...runtime.utils import cdiv, empty, prepare_out, zeros
from ..memory import has_internal_overlap, overlaps

_DIMS = 4
# block: positions per program (the unit of the counts); scan: chunk of counts per step of the scan.
# The interpreter's are small so the tests' shapes span many blocks and several scan chunks.
_CONFIGS = {"cuda": dict(block=1024, scan=1024, num_warps=4), "interpreter": dict(block=64, scan=16, num_warps=1)}


@triton.jit
def _coords(f, n1, n2, n3):
    """Flat row-major position f -> (c0, c1, c2, c3) over sizes (., n1, n2, n3)."""
    c3 = f % n3
    q = f // n3
    c2 = q % n2
    q = q // n2
    c1 = q % n1
    c0 = q // n1
    return c0, c1, c2, c3


@kernel
@triton.jit
def mask_count(Mask, Counts, numel, n1, n2, n3, sm0, sm1, sm2, sm3, BIG: tl.constexpr, BLOCK: tl.constexpr):
    """Counts[b] = number of True mask positions among b * BLOCK ... (b + 1) * BLOCK - 1."""
    pid = tl.program_id(0)
    if BIG:
        pid = pid.to(tl.int64)
    f = pid * BLOCK + tl.arange(0, BLOCK)
    c0, c1, c2, c3 = _coords(f, n1, n2, n3)
    m = tl.load(Mask + c0 * sm0 + c1 * sm1 + c2 * sm2 + c3 * sm3, mask=f < numel, other=0)
    tl.store(Counts + pid, tl.sum(m.to(tl.int32), 0).to(tl.int64))


@triton.jit
def _scan(Counts, nblocks, CHUNK: tl.constexpr):
    carry = tl.full([], 0, tl.int64)
    for start in range(0, nblocks + 1, CHUNK):
        i = start + tl.arange(0, CHUNK)
        c = tl.load(Counts + i, mask=i < nblocks, other=0)
        tl.store(Counts + i, carry + tl.cumsum(c, 0) - c, mask=i <= nblocks)
        carry += tl.sum(c, 0)
    return carry


@kernel
@triton.jit
def block_scan(Counts, nblocks, CHUNK: tl.constexpr):
    """Counts[b] <- Counts[0] + ... + Counts[b - 1] for b = 0 .. nblocks (in place; Counts[nblocks],
    read as 0, becomes the total)."""
    _scan(Counts, nblocks, CHUNK)


# debug=True keeps the device assert (Triton compiles asserts out otherwise); its integer overflow
# checks cost nothing in this one-program scan
@kernel
@triton.jit(debug=True)
def block_scan_checked(Counts, nblocks, limit, CHUNK: tl.constexpr):
    """block_scan, then a device-side assert that the total is at most `limit` (source's elements):
    ATen's CUDA check, without a host synchronization."""
    total = _scan(Counts, nblocks, CHUNK)
    tl.device_assert(total <= limit, "masked_scatter: expected source to have at least as many elements "
                                     "as the ones in the mask")


@kernel
@triton.jit
def scatter_masked(Self, Mask, Src, Out, Ranks, numel, n1, n2, n3, sm0, sm1, sm2, sm3, ss0, ss1, ss2, ss3,
            so0, so1, so2, so3, INPLACE: tl.constexpr, BIG: tl.constexpr, BLOCK: tl.constexpr):
    """Out[p] = Src[rank(p)] where Mask[p], else Self[p] (INPLACE: Out is Self, only True p written);
    rank(p) = Ranks[block] + the True positions before p in its block."""
    pid = tl.program_id(0)
    if BIG:
        pid = pid.to(tl.int64)
    f = pid * BLOCK + tl.arange(0, BLOCK)
    inside = f < numel
    c0, c1, c2, c3 = _coords(f, n1, n2, n3)
    m = tl.load(Mask + c0 * sm0 + c1 * sm1 + c2 * sm2 + c3 * sm3, mask=inside, other=0) != 0
    mi = m.to(tl.int32)
    rank = tl.load(Ranks + pid) + (tl.cumsum(mi, 0) - mi)
    take = inside & m
    src = tl.load(Src + rank, mask=take)
    out_offs = c0 * so0 + c1 * so1 + c2 * so2 + c3 * so3
    if INPLACE:
        tl.store(Out + out_offs, src, mask=take)
    else:
        x = tl.load(Self + c0 * ss0 + c1 * ss1 + c2 * ss2 + c3 * ss3, mask=inside & ~m)
        tl.store(Out + out_offs, tl.where(m, src, x), mask=inside)


@kernel
@triton.jit
def gather_masked(Grad, Mask, Out, Ranks, numel, n_out, nblocks, n1, n2, n3, sm0, sm1, sm2, sm3, sg0, sg1, sg2, sg3,
           BIG: tl.constexpr, BLOCK: tl.constexpr):
    """Out[rank(p)] = Grad[p] for the True p of block pid (rank(p) < n_out); Out[o] = 0 for the o of
    block pid at or after the total. The two sets are disjoint: no order between programs needed."""
    pid = tl.program_id(0)
    if BIG:
        pid = pid.to(tl.int64)
    f = pid * BLOCK + tl.arange(0, BLOCK)
    inside = f < numel
    c0, c1, c2, c3 = _coords(f, n1, n2, n3)
    m = tl.load(Mask + c0 * sm0 + c1 * sm1 + c2 * sm2 + c3 * sm3, mask=inside, other=0) != 0
    mi = m.to(tl.int32)
    # programs past the last block of positions only zero-fill (their f are all outside)
    rank = tl.load(Ranks + tl.minimum(pid, nblocks)) + (tl.cumsum(mi, 0) - mi)
    take = inside & m & (rank < n_out)
    g = tl.load(Grad + c0 * sg0 + c1 * sg1 + c2 * sg2 + c3 * sg3, mask=take)
    tl.store(Out + rank, g, mask=take)
    total = tl.load(Ranks + nblocks)
    tl.store(Out + f, tl.zeros([BLOCK], Out.dtype.element_ty), mask=(f >= total) & (f < n_out))


def _geometry(shape, strides_list):
    """(sizes n1..n3, [4 strides per operand]) of the row-major positions of `shape`, merged; None
    when more than four dims remain."""
    sizes, sts = collapse(tuple(shape), [tuple(s) for s in strides_list], list(range(len(shape))))
    if len(sizes) > _DIMS:
        return None
    pad = _DIMS - len(sizes)
    return [1] * pad + sizes, [[0] * pad + list(s) for s in sts]


def _ranks(mask_t, shape, m_st, sizes, numel, big, cfg, limit=None):
    """Per block its first rank (Ranks[nblocks] = the total): launches 1 and 2; with `limit`, the scan
    also asserts on the device that the total is at most `limit`."""
    nblocks = cdiv(numel, cfg["block"])
    ranks = empty((nblocks + 1,), torch.int64, mask_t.device)
    if nblocks:
        mask_count[(nblocks,)](mask_t, ranks, numel, sizes[1], sizes[2], sizes[3], *m_st, big, cfg["block"],
                               num_warps=cfg["num_warps"])
    if limit is None:
        block_scan[(1,)](ranks, nblocks, cfg["scan"], num_warps=cfg["num_warps"])
    else:
        block_scan_checked[(1,)](ranks, nblocks, limit, cfg["scan"], num_warps=cfg["num_warps"])
    return ranks, nblocks


def _check_args(self, mask, source, *a, **k):
    # ATen raises for both; let it
    if mask.dtype != torch.bool:
        return f"mask dtype {mask.dtype}"
    if source.dtype != self.dtype:
        return "source dtype differs from self's"
    return None


def _masked_scatter(self, mask, source, out=None, inplace=False):
    if inplace:
        shape = tuple(self.shape)
        if mask.dim() > self.dim() or torch.broadcast_shapes(mask.shape, self.shape) != self.shape:
            raise Unsupported("mask does not expand to self's shape (ATen raises)")
        if has_internal_overlap(self):
            raise Unsupported("self has overlapping elements (ATen raises)")
        if overlaps(self, source) or overlaps(self, mask):
            raise Unsupported("source or mask shares memory with self")
        y = self
    else:
        shape = tuple(torch.broadcast_shapes(self.shape, mask.shape))
        if out is not None and any(overlaps(out, t) for t in (self, mask, source)):
            raise Unsupported("out shares memory with an input")
        y = prepare_out(out, shape, self.dtype, self.device)
    numel = y.numel()
    if numel == 0:
        return y
    geo = _geometry(shape, [broadcast_strides(shape, mask.shape, mask.stride()),
                            broadcast_strides(shape, self.shape, self.stride()),
                            y.stride() if inplace else contiguous_strides(shape)])
    if geo is None:
        raise Unsupported("more than four dims after merging")
    sizes, (m_st, s_st, o_st) = geo
    cfg = _CONFIGS[backend().name]
    big = needs_int64(numel, cfg["block"], [(shape, broadcast_strides(shape, t.shape, t.stride()))
                                            for t in (mask, self, y)])
    short = source.numel() < numel        # a shortage is possible at all
    on_gpu = backend().name == "cuda"
    ranks, nblocks = _ranks(mask, shape, m_st, sizes, numel, big, cfg,
                            limit=source.numel() if short and on_gpu else None)
    if short and not on_gpu and int(ranks[nblocks].item()) > source.numel():
        # ATen's CPU kernel raises: let it (nothing is written yet); CUDA asserted in the scan
        raise Unsupported("source has fewer elements than the mask's True positions (ATen raises)")
    # ATen reads a contiguous source too; an empty one is never read (any valid pointer will do)
    src = source.contiguous() if source.numel() else y
    scatter_masked[(nblocks,)](self, mask, src, y, ranks, numel, sizes[1], sizes[2], sizes[3], *m_st, *s_st,
                               *o_st, inplace, big, cfg["block"], num_warps=cfg["num_warps"])
    return y


@register("masked_scatter", "masked_scatter.out", category="index", dtypes=ALL, check=_check_args)
def masked_scatter(self, mask, source, *, out=None):
    """self with its (broadcast) mask's True positions taken from source, in row-major order."""
    return _masked_scatter(self, mask, source, out)


@register("masked_scatter_", category="index", dtypes=ALL, check=_check_args)
def masked_scatter_(self, mask, source):
    """In place: self's True mask positions take source's elements in row-major order."""
    return _masked_scatter(self, mask, source, inplace=True)


def _bool_mask(grad_output, mask, sizes):
    return None if mask.dtype == torch.bool else f"mask dtype {mask.dtype} (ATen raises)"


@register("masked_scatter_backward", category="index", dtypes=ALL, backward=True, check=_bool_mask)
def masked_scatter_backward(grad_output, mask, sizes):
    """source's gradient: grad at the True mask positions in row-major order, then zeros."""
    sizes_out = [int(s) for s in sizes]
    if any(s < 0 for s in sizes_out):
        raise Unsupported("negative size (ATen raises)")
    n_out = 1
    for s in sizes_out:
        n_out *= s
    shape = tuple(torch.broadcast_shapes(grad_output.shape, mask.shape))
    numel = 1
    for s in shape:
        numel *= s
    if numel == 0:
        return zeros(sizes_out, grad_output.dtype, grad_output.device)   # nothing selected
    y = empty(sizes_out, grad_output.dtype, grad_output.device)
    geo = _geometry(shape, [broadcast_strides(shape, mask.shape, mask.stride()),
                            broadcast_strides(shape, grad_output.shape, grad_output.stride())])
    if geo is None:
        raise Unsupported("more than four dims after merging")
    sizes, (m_st, g_st) = geo
    cfg = _CONFIGS[backend().name]
    big = needs_int64(max(numel, n_out), cfg["block"],
                      [(shape, broadcast_strides(shape, t.shape, t.stride())) for t in (mask, grad_output)])
    ranks, nblocks = _ranks(mask, shape, m_st, sizes, numel, big, cfg)
    if n_out < numel and int(ranks[nblocks].item()) > n_out:
        raise Unsupported("sizes hold fewer elements than the mask's True positions (ATen raises)")
    grid = max(nblocks, cdiv(n_out, cfg["block"]))
    if grid:
        gather_masked[(grid,)](grad_output, mask, y, ranks, numel, n_out, nblocks, sizes[1], sizes[2], sizes[3], *m_st,
                        *g_st, big, cfg["block"], num_warps=cfg["num_warps"])
    return y
