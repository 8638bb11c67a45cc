"""constant_pad_nd and slice_backward: one kernel that writes every output element once,

    Y[c] = X[(c - lo) / step]   where, per dim, (c_d - lo_d) is a non-negative multiple of step_d
                                and (c_d - lo_d) / step_d < the input's size;
    Y[c] = value                elsewhere.

constant_pad_nd: lo = the left pad (negative pads crop: they read from inside the input), step = 1,
value = the pad value. slice_backward: Y = zeros(input_sizes) with grad_output written at
start::step of dim, i.e. lo = start, step = step on that dim and value = 0 (no separate zero fill).

The output is read in its memory order (channels_last stays channels_last) as Y[R, W]: W is the
innermost dim (a vector of columns per tile, no division unless a step applies there), and each row
index splits into at most four outer dims (unpadded dims whose input strides allow it are merged
first; the unused ones have size 1, which Triton specializes away). The input is read through its
own strides. Bytes moved: the output once, the input's overlapping part once.
"""
from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from ...codegen.generator import number_misfit
from ...registry import FLOATS, INTS, Unsupported, register
from ...runtime import backend, kernel
from ...runtime.utils import cdiv, empty, next_pow2, wrap_dim

DTYPES = FLOATS + INTS + (torch.bool,)
_INT64_FROM = 2 ** 31 - 1
_LEAD = 4


@triton.jit
def _axis(c, n_in, lo, step, stride):
    """(inside, offset) of output coordinate c along one axis."""
    d = c - lo
    q = d // step
    ok = (d >= 0) & (d - q * step == 0) & (q < n_in)
    return ok, q * stride


@kernel
@triton.jit
def pad_kernel(X, Y, value, R, W,
               inW, loW, stepW, sW,
               n1, n2, n3, in0, in1, in2, in3, lo0, lo1, lo2, lo3, st0, st1, st2, st3, s0, s1, s2, s3,
               BIG: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    """Y[r, w] (row r = (c0, c1, c2, c3) with sizes (., n1, n2, n3)) = X[sum_a q_a * s_a + qW * sW]
    where every axis' coordinate maps inside the input (see the module doc), else `value`."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    if BIG:
        r = r.to(tl.int64)
        w = w.to(tl.int64)
    c3 = r % n3
    q = r // n3
    c2 = q % n2
    q = q // n2
    c1 = q % n1
    c0 = q // n1
    ok0, o0 = _axis(c0, in0, lo0, st0, s0)
    ok1, o1 = _axis(c1, in1, lo1, st1, s1)
    ok2, o2 = _axis(c2, in2, lo2, st2, s2)
    ok3, o3 = _axis(c3, in3, lo3, st3, s3)
    okw, ow = _axis(w, inW, loW, stepW, sW)
    rm = r < R
    wm = w < W
    inside = (rm & ok0 & ok1 & ok2 & ok3)[:, None] & (wm & okw)[None, :]
    x = tl.load(X + (o0 + o1 + o2 + o3)[:, None] + ow[None, :], mask=inside)
    y = tl.where(inside, x, value)
    tl.store(Y + r[:, None] * W + w[None, :], y.to(Y.dtype.element_ty), mask=rm[:, None] & wm[None, :])


_CONFIGS = {"cuda": dict(tile=4096, max_w=1024), "interpreter": dict(tile=256, max_w=32)}


def _memory_order(t):
    """t's dims outermost first in memory (t is dense in that order); None if it is not dense."""
    order = sorted(range(t.dim()), key=lambda d: -t.stride(d))
    expect = 1
    for d in reversed(order):
        if t.shape[d] != 1:
            if t.stride(d) != expect:
                return None
            expect *= t.shape[d]
    return order


def _run(x, y, axes, value):
    """axes: per output dim in y's memory order (out size, in size, lo, step, input stride)."""
    merged = []
    for a in axes:
        n, n_in, lo, step, s = a
        ident = n == n_in and lo == 0 and step == 1
        if ident and n == 1:
            continue
        if ident and merged:
            pn, pin, plo, pst, ps = merged[-1]
            if pn == pin and plo == 0 and pst == 1 and ps == s * n:
                merged[-1] = (pn * n, pin * n, 0, 1, s)
                continue
        merged.append(a)
    if not merged:
        merged = [(1, 1, 0, 1, 0)]
    lead, last = merged[:-1], merged[-1]
    if len(lead) > _LEAD:
        raise Unsupported("more than five dims after merging")
    lead = [(1, 1, 0, 1, 0)] * (_LEAD - len(lead)) + lead
    R = 1
    for n, *_ in lead:
        R *= n
    W, inW, loW, stepW, sW = last
    span = 1 + sum((n_in - 1) * s for _, n_in, _, _, s in merged if n_in > 0)
    big = max(R * W, span, max(abs(a[2]) for a in merged)) >= _INT64_FROM
    cfg = _CONFIGS[backend().name]
    bw = min(next_pow2(W), cfg["max_w"])
    br = min(next_pow2(R), max(1, cfg["tile"] // bw))
    nw = max(1, min(8, br * bw // 512))
    pad_kernel[(cdiv(R, br), cdiv(W, bw))](
        x, y, value, R, W, inW, loW, stepW, sW,
        lead[1][0], lead[2][0], lead[3][0],
        *[a[1] for a in lead], *[a[2] for a in lead], *[a[3] for a in lead], *[a[4] for a in lead],
        big, br, bw, num_warps=nw)


def _fill_value(value, dtype):
    """The pad value as the kernel argument that converts to `dtype` exactly like ATen's fill_, or
    Unsupported (ATen raises or converts in a way the kernel would not reproduce)."""
    if isinstance(value, torch.Tensor):
        raise Unsupported("tensor value")
    why = number_misfit(value, dtype)
    if why is not None:
        raise Unsupported(why)
    if dtype == torch.bool:
        return int(bool(value))
    if not dtype.is_floating_point:
        if isinstance(value, float) and not value.is_integer():
            raise Unsupported("a fractional value for an integer dtype")
        if dtype == torch.uint8 and value < 0:
            raise Unsupported("a negative value for uint8 (ATen wraps it)")
        return int(value)
    v = float(value)
    if dtype != torch.float32 and v == v and struct.unpack("f", struct.pack("f", v))[0] != v:
        # passed as an fp32 kernel argument: fp64 -> fp32 -> fp16 could round twice
        raise Unsupported("a value not exact in fp32 for a 16-bit dtype")
    return v


@register("constant_pad_nd", category="copy", dtypes=DTYPES)
def constant_pad_nd(self, pad, value=0):
    """Pad (or, with negative pads, crop) the last len(pad) / 2 dims with a constant, in one pass."""
    pad = [int(p) for p in pad]
    nd = self.dim()
    if len(pad) % 2:
        raise RuntimeError(f"Length of pad must be even but instead it equals {len(pad)}")
    if len(pad) // 2 > nd:
        raise RuntimeError(f"Length of pad should be no more than twice the number of dimensions of the input. "
                           f"Pad length is {len(pad)} while the input has {nd} dimensions.")
    meta = torch.empty_strided(self.shape, self.stride(), dtype=self.dtype, device="meta")
    # ATen first narrows the input by the negative pads, outer dims first, left then right: a pad
    # cropping more than is left raises narrow()'s error even where the output size is not negative
    view = meta
    for d in range(nd - len(pad) // 2, nd):
        left, right = pad[2 * (nd - 1 - d)], pad[2 * (nd - 1 - d) + 1]
        if left < 0:
            view = view.narrow(d, -left, view.shape[d] + left)
        if right < 0:
            view = view.narrow(d, 0, view.shape[d] + right)
    fill = _fill_value(value, self.dtype)
    lo = [0] * nd
    shape = list(self.shape)
    for j in range(len(pad) // 2):
        d = nd - 1 - j
        left, right = pad[2 * j], pad[2 * j + 1]
        n = self.shape[d] + left + right
        if n < 0:
            raise RuntimeError(f"The input size {self.shape[d]}, plus negative padding {left} and {right} resulted "
                               f"in a negative output size, which is invalid. Check dimension {d} of your input.")
        lo[d] = left
        shape[d] = n
    if all(p <= 0 for p in pad):
        # ATen returns a clone of the narrowed input: its strides follow clone's preserve_format rule
        strides = torch.empty_like(view, memory_format=torch.preserve_format).stride()
    else:
        from torch._prims_common import suggest_memory_format
        strides = torch.empty(shape, device="meta", memory_format=suggest_memory_format(meta)).stride()
    y = empty(shape, self.dtype, self.device, strides)
    if y.numel() == 0:
        return y
    order = _memory_order(y)
    if order is None:
        raise Unsupported("output strides not dense")
    axes = [(shape[d], self.shape[d], lo[d], 1, self.stride(d)) for d in order]
    _run(self, y, axes, fill)
    return y


@register("slice_backward", category="copy", dtypes=DTYPES, backward=True)
def slice_backward(grad_output, input_sizes, dim, start, end, step):
    """zeros(input_sizes) with grad_output written at start:end:step of dim, in one pass."""
    sizes = [int(s) for s in input_sizes]
    nd = len(sizes)
    if grad_output.dim() != nd:
        raise Unsupported("grad_output rank differs from input_sizes")
    d = wrap_dim(int(dim), nd)
    step = int(step)
    if step <= 0:
        raise RuntimeError("slice step must be positive")
    n = sizes[d]
    s, e = int(start), int(end)
    # ATen's slice normalization
    if s < 0:
        s += n
    if e < 0:
        e += n
    s = 0 if s < 0 else min(s, n)
    e = s if e < s else min(e, n)
    count = cdiv(e - s, step)
    want = list(sizes)
    want[d] = count
    if list(grad_output.shape) != want:
        raise Unsupported("grad_output's shape is not the slice's (ATen broadcasts or raises)")
    y = empty(sizes, grad_output.dtype, grad_output.device)
    if y.numel() == 0:
        return y
    zero = 0.0 if grad_output.dtype.is_floating_point else 0
    axes = [(sizes[i], grad_output.shape[i], s if i == d else 0, step if i == d else 1, grad_output.stride(i))
            for i in range(nd)]
    _run(grad_output, y, axes, zero)
    return y
