"""gather, scatter (src / value, no reduce) and index_select: copies through an index tensor along dim d.

    gather:       out[c] = self[c with c_d := index[c]]                  c over index's shape
    scatter:      out[c with c_d := index[c]] = src[c]  (or value)       c over index's shape; out
                  starts as a copy of self (the functional and out= forms) or is self (scatter_)
    index_select: out[c] = self[c with c_d := index[c_d]]                c over out's shape

All three are one kernel, `index_copy`: a flat loop over an iteration space of at most four dims,
each element at coordinates c reading the index at c . s_idx, and reading / writing the other two
tensors at c . s_src / c . s_dst, where the indexed tensor's stride along d is replaced by 0 and
index * stride_d is added instead. index_select is gather with an index broadcast (stride 0) over
every dim but d. Before launching, adjacent dims merge where every tensor's strides allow (size-1
dims drop out), which leaves most calls with one or two dims (top-p's scatter of a [batch, vocab]
mask: two); a call needing more than four goes to ATen. Any strides, any dtype (a copy: exact),
int64 offsets where a tensor spans 2^31 elements.

Duplicate indices in scatter: the stores race and one of the written values wins, as in ATen (which
documents the result as nondeterministic). scatter's value is converted to self's dtype like ATen's
Scalar conversion (numbers that overflow it go to ATen, which raises); it reaches the kernel as a
fp32 (fp16/bf16/fp32 self) or integer argument, as c10 converts a double to half through float.

Out-of-range indices. ATen's CPU kernels raise (RuntimeError "index 5 is out of bounds for dimension
1 with size 4"; index_select an IndexError or RuntimeError by dim); its CUDA kernels stop the process
with a device-side assert. Checking on the host would cost a device synchronization per call on
CUDA, so there Gems does not: the kernel masks the bad element (gather / index_select write 0 there,
scatter writes nothing; never a read or write out of bounds) and asserts on the device under
TRITON_DEBUG=1 (docs/known-differences.md's rule for nll_loss and embedding). On the interpreter
(CPU tensors, no synchronization to pay) the index is checked on the host and ATen's error raised.
"""
from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from ...codegen.generator import number_misfit
from ...registry import ALL, Unsupported, register
from ...runtime import backend, kernel
from ...runtime.utils import cdiv, prepare_out, wrap_dim
from ..memory import has_internal_overlap, overlaps
from .copy import copy_fn

_INDEX_DTYPES = (torch.int64, torch.int32)
# the functional and out= scatters start with copy_'s kernel, which leaves float64 to ATen
SCATTER_DTYPES = tuple(d for d in ALL if d != torch.float64)
_BLOCK = {"cuda": 1024, "interpreter": 128}
_INT64_FROM = 2 ** 31 - 1
_DIMS = 4


@kernel
@triton.jit
def index_copy(Dst, Src, Idx, N, n1, n2, n3, sd0, sd1, sd2, sd3, ss0, ss1, ss2, ss3, si0, si1, si2, si3,
               bound, s_dim, value,
               SCATTER: tl.constexpr, HAS_SRC: tl.constexpr, BIG: tl.constexpr, BLOCK: tl.constexpr,
               VALUE_BITS: tl.constexpr = 0):
    """Element i of the iteration space [N / (n1 n2 n3), n1, n2, n3] at coordinates c:
    j = Idx[c . si] (masked unless 0 <= j < bound);
    gather (not SCATTER): Dst[c . sd] = Src[c . ss + j * s_dim]
    scatter:              Dst[c . sd + j * s_dim] = Src[c . ss]   (value when not HAS_SRC).
    VALUE_BITS (16, 32): value holds the bits of a float Dst's element, converted on the host."""
    if BIG:
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    else:
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < N
    # unused dims have size 1, which Triton specializes: their division and modulo fold away
    c3 = i % n3
    t = i // n3
    c2 = t % n2
    t = t // n2
    c1 = t % n1
    c0 = t // n1
    j = tl.load(Idx + (c0 * si0 + c1 * si1 + c2 * si2 + c3 * si3), mask=mask, other=0)
    ok = (j >= 0) & (j < bound)
    tl.device_assert(ok | ~mask, "index out of bounds")
    m = mask & ok
    if BIG:
        j = tl.where(ok, j, 0).to(tl.int64)
    else:
        j = tl.where(ok, j, 0).to(tl.int32)
    dst = c0 * sd0 + c1 * sd1 + c2 * sd2 + c3 * sd3
    src = c0 * ss0 + c1 * ss1 + c2 * ss2 + c3 * ss3
    if SCATTER:
        if HAS_SRC:
            v = tl.load(Src + src, mask=m)
        elif VALUE_BITS:
            # a float is written from its bits: any float operation on the GPU would turn a NaN into
            # the canonical one and 0 + -0.0 into +0.0, where ATen stores its own conversion's bits
            v = tl.zeros([BLOCK], tl.int32) + value
            if VALUE_BITS == 16:
                v = v.to(tl.int16)
            v = v.to(Dst.dtype.element_ty, bitcast=True)
        else:
            v = tl.zeros([BLOCK], tl.int32) + value     # the number's own type (int32 + int64 is int64)
        tl.store(Dst + (dst + j * s_dim), v.to(Dst.dtype.element_ty), mask=m)
    else:
        v = tl.load(Src + (src + j * s_dim), mask=m, other=0)
        tl.store(Dst + dst, v, mask=mask)


def _dims(t):
    """Shape and strides, a 0-dim tensor as one element (ATen's ensure_nonempty_dim)."""
    return (tuple(t.shape), tuple(t.stride())) if t.dim() else ((1,), (0,))


def _collapse(shape, strides):
    """Merge adjacent dims where every stride list allows and drop size-1 dims: (sizes, strides per
    tensor), padded in front to _DIMS dims, or None if more dims remain."""
    sizes, out = [], [[] for _ in strides]
    for d, n in enumerate(shape):
        if n == 1:
            continue
        if sizes and all(o[-1] == s[d] * n for o, s in zip(out, strides)):
            sizes[-1] *= n
            for o, s in zip(out, strides):
                o[-1] = s[d]
        else:
            sizes.append(n)
            for o, s in zip(out, strides):
                o.append(s[d])
    if len(sizes) > _DIMS:
        return None
    pad = _DIMS - len(sizes)
    return [1] * pad + sizes, [[0] * pad + o for o in out]


def _span(shape, strides):
    return 1 + sum((n - 1) * abs(s) for n, s in zip(shape, strides) if n > 0)


def _launch(dst, src, idx, shape, s_dst, s_src, s_idx, bound, s_dim, value, scatter, value_bits=0):
    """index_copy over `shape` (the iteration space) with the given per-tensor strides."""
    n = 1
    for v in shape:
        n *= v
    if n == 0:
        return
    got = _collapse(shape, [s_dst, s_src, s_idx])
    if got is None:
        raise Unsupported("more than four dims after merging")
    sizes, (sd, ss, si) = got
    big = max(n, bound, _span(shape, s_dst) + bound * abs(s_dim), _span(shape, s_src) + bound * abs(s_dim),
              _span(shape, s_idx)) >= _INT64_FROM
    block = _BLOCK[backend().name]
    index_copy[(cdiv(n, block),)](dst, src, idx, n, sizes[1], sizes[2], sizes[3], *sd, *ss, *si, bound, s_dim, value,
                                  scatter, src is not None, big, block, value_bits, num_warps=4)


def _check_on_host(index, bound, error):
    # CPU tensors (the interpreter): no device synchronization to pay, and ATen's CPU kernels raise
    if index.device.type == "cpu" and index.numel():
        bad = (index < 0) | (index >= bound)
        if bool(bad.any()):
            raise error(int(index[bad].reshape(-1)[0]))


def _bounds_error(d, bound):
    def err(v):
        return RuntimeError(f"index {v} is out of bounds for dimension {d} with size {bound}")
    return err


def _prepare(out, shape, dtype, device):
    """A fresh contiguous result, or the caller's out (resized like ATen; any strides, no overlap)."""
    y = prepare_out(out, shape, dtype, device, contiguous=False)
    if out is not None and has_internal_overlap(y):
        raise Unsupported("out has overlapping elements (ATen raises)")
    return y


def _zero_stride(strides, d):
    return tuple(0 if i == d else s for i, s in enumerate(strides))


# ------------------------------------------------------------------------------------------ gather
def _gather_checks(self, d, index):
    if index.dtype not in _INDEX_DTYPES:
        raise RuntimeError("gather(): Expected dtype int32/int64 for index")
    if max(self.dim(), 1) != max(index.dim(), 1):
        raise RuntimeError("Index tensor must have the same number of dimensions as input tensor")
    sshape, ishape = _dims(self)[0], _dims(index)[0]
    for i, (a, b) in enumerate(zip(ishape, sshape)):
        if i != d and a > b:
            raise RuntimeError(f"Size does not match at dimension {i} expected index {list(index.shape)} to be no "
                               f"larger than self {list(self.shape)} apart from dimension {d}")


@register("gather", "gather.out", category="index", dtypes=ALL)
def gather(self, dim, index, *, sparse_grad=False, out=None):
    """out[c] = self[c with c_d := index[c]] (int32/int64 index of self's rank; any strides)."""
    d = wrap_dim(dim, self.dim())
    if index.device != self.device:
        raise Unsupported("index on another device")
    if index.numel() == 0:   # ATen checks nothing else then
        return _prepare(out, index.shape, self.dtype, self.device)
    _gather_checks(self, d, index)
    if out is not None and (overlaps(out, self) or overlaps(out, index)):
        raise Unsupported("out overlaps an input")
    bound = _dims(self)[0][d]
    _check_on_host(index, bound, _bounds_error(d, bound))
    y = _prepare(out, index.shape, self.dtype, self.device)
    shape, si = _dims(index)
    ss = _dims(self)[1]
    _launch(y, self, index, shape, _dims(y)[1], _zero_stride(ss, d), si, bound, ss[d], 0, False)
    return y


# ----------------------------------------------------------------------------------------- scatter
def _scatter_value(self, value):
    """The Python number scatter writes, converted like ATen's Scalar (overflow: ATen raises)."""
    if isinstance(value, complex) or self.dtype.is_complex:
        raise Unsupported("complex value")
    if self.dtype.is_floating_point and value == 0:
        return _float_bits(value, self.dtype)   # -0.0 too: its bits carry the sign to the kernel
    why = number_misfit(value, self.dtype)
    if why is not None:
        raise Unsupported(why)
    if self.dtype == torch.bool:
        return int(bool(value))
    if self.dtype.is_floating_point:
        return _float_bits(value, self.dtype)
    return int(value)       # a float truncates toward zero, as c10's conversion does


def _float_bits(value, dtype):
    """The bits (a signed int of the dtype's width) of `value` converted to `dtype` the way c10 converts
    a Scalar: double -> float, then float -> half (round to nearest even; NaN 0x7E00) or -> bfloat16
    (round to nearest even; NaN 0x7FC0). The caller has ruled out values beyond the dtype's range."""
    packed = struct.pack("<f", float(value))          # double -> float (round to nearest even)
    f32 = struct.unpack("<I", packed)[0]
    if dtype == torch.float32:
        bits, width = f32, 32
    elif dtype == torch.float16:
        bits, width = struct.unpack("<H", struct.pack("<e", struct.unpack("<f", packed)[0]))[0], 16
    else:   # bfloat16
        if (f32 & 0x7FFFFFFF) > 0x7F800000:
            bits = 0x7FC0 | (f32 >> 16 & 0x8000)
        else:
            bits = ((f32 + 0x7FFF + (f32 >> 16 & 1)) >> 16) & 0xFFFF
        width = 16
    return bits - (1 << width) if bits >> (width - 1) else bits


def _scatter(self, d, index, src, value, out, inplace):
    d = wrap_dim(d, self.dim())
    if index.device != self.device or (src is not None and src.device != self.device):
        raise Unsupported("tensors on different devices")
    if index.numel() and index.dtype not in _INDEX_DTYPES:
        raise RuntimeError("scatter(): Expected dtype int32/int64 for index")
    if src is not None and src.dtype != self.dtype:
        raise RuntimeError("scatter(): Expected self.dtype to be equal to src.dtype")
    if src is None:
        value = _scatter_value(self, value)
    if index.numel():
        n = max(self.dim(), 1)
        if max(index.dim(), 1) != n:
            raise RuntimeError("Index tensor must have the same number of dimensions as self tensor")
        if src is not None and max(src.dim(), 1) != n:
            raise RuntimeError("Index tensor must have the same number of dimensions as src tensor")
        ishape, sshape = _dims(index)[0], _dims(self)[0]
        srcshape = _dims(src)[0] if src is not None else None
        for i in range(n):
            if (i != d and ishape[i] > sshape[i]) or (srcshape is not None and ishape[i] > srcshape[i]):
                raise RuntimeError(f"Expected index {list(index.shape)} to be no larger than self "
                                   f"{list(self.shape)} apart from dimension {d}"
                                   + (f" and to be no larger size than src {list(src.shape)}" if src is not None
                                      else ""))
    written = self if inplace else out
    if written is not None:
        if has_internal_overlap(written):
            raise Unsupported("the written tensor has overlapping elements (ATen raises)")
        if overlaps(written, index) or (src is not None and overlaps(written, src)):
            raise Unsupported("the written tensor overlaps the index or src (ATen raises)")
        if not inplace and overlaps(written, self):
            raise Unsupported("out overlaps self")
    bound = _dims(self)[0][d]
    _check_on_host(index, bound, _bounds_error(d, bound))
    if inplace:
        y = self
    else:
        y = _prepare(out, self.shape, self.dtype, self.device)
        if y.numel():
            copy_fn(y, self)         # out starts as self (copy_'s kernel)
    shape, si = _dims(index)
    yd = _dims(y)[1]
    ss = _dims(src)[1] if src is not None else (0,) * len(shape)
    _launch(y, src, index, shape, _zero_stride(yd, d), ss, si, bound, yd[d], 0 if src is not None else value, True,
            y.element_size() * 8 if src is None and y.dtype.is_floating_point else 0)
    return y


@register("scatter.src", "scatter.src_out", category="index", dtypes=SCATTER_DTYPES)
def scatter_src(self, dim, index, src, *, out=None):
    """out = self, then out[c with c_d := index[c]] = src[c] (duplicate indices: one of them wins)."""
    return _scatter(self, dim, index, src, None, out, False)


@register("scatter.value", "scatter.value_out", category="index", dtypes=SCATTER_DTYPES)
def scatter_value(self, dim, index, value, *, out=None):
    """out = self, then out[c with c_d := index[c]] = value."""
    return _scatter(self, dim, index, None, value, out, False)


@register("scatter_.src", category="index", dtypes=SCATTER_DTYPES)
def scatter_src_(self, dim, index, src):
    """In-place scatter of src into self."""
    return _scatter(self, dim, index, src, None, None, True)


@register("scatter_.value", category="index", dtypes=SCATTER_DTYPES)
def scatter_value_(self, dim, index, value):
    """In-place scatter of a number into self."""
    return _scatter(self, dim, index, None, value, None, True)


# ------------------------------------------------------------------------------------ index_select
def _select_error(d, bound):
    def err(v):
        if d == 0:
            return IndexError("index out of range in self")
        return RuntimeError(f"INDICES element is out of DATA bounds, id={v} axis_dim={bound}")
    return err


@register("index_select", "index_select.out", category="index", dtypes=ALL)
def index_select(self, dim, index, *, out=None):
    """out[c] = self[c with c_d := index[c_d]] (a 1-D or 0-dim int32/int64 index; any strides)."""
    d = wrap_dim(dim, self.dim())
    if index.dim() > 1:
        raise IndexError("index_select(): Index is supposed to be a vector")
    if index.dtype not in _INDEX_DTYPES:
        raise RuntimeError("index_select(): Expected dtype int32 or int64 for index")
    if index.device != self.device:
        raise Unsupported("index on another device")
    n = index.numel()
    sshape, ss = _dims(self)
    bound = sshape[d]
    if self.dim() == 0 and n != 1:
        raise Unsupported("a 0-dim self with other than one index (ATen raises)")
    if bound == 0 and n:
        raise Unsupported("indexing an empty dim (ATen raises)")
    if out is not None and (overlaps(out, self) or overlaps(out, index)):
        raise Unsupported("out overlaps an input")
    _check_on_host(index, bound, _select_error(d, bound))
    oshape = list(self.shape)
    if oshape:
        oshape[d] = n
    y = _prepare(out, oshape, self.dtype, self.device)
    shape = list(sshape)
    shape[d] = n
    si = [0] * len(shape)
    si[d] = index.stride(0) if index.dim() else 0
    _launch(y, self, index, shape, _dims(y)[1], _zero_stride(ss, d), si, bound, ss[d], 0, False)
    return y
