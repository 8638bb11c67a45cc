"""Helpers every op wrapper shares: dim wrapping, `out=` handling, launch arithmetic.

Allocation lives in runtime/alloc.py (call plans record it); `empty` is re-exported here for the ops.

`out=` is handled here once: ATen resizes a wrongly shaped `out` (warning when it held data), and
rejects a dtype it cannot hold; an `out` Gems cannot write directly (non-contiguous) goes to ATen.
"""
from __future__ import annotations

import functools
import warnings

import torch

from ..registry import Unsupported
from .alloc import empty, zeros  # noqa: F401 - the ops allocate through these

# triton.cdiv / triton.next_power_of_2 are constexpr_functions in triton 3.6: ~1.5 us per host call.
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else 1


def as_rows(t, M: int, N: int):
    """(t, or a contiguous copy of it where no view reads it as M rows of N with unit column stride; the
    row stride). Row kernels take the tensor's data pointer and that stride only: passing the argument
    itself rather than a view of it lets a call plan name it (also when two arguments are views of one
    buffer, like `gate, up = gate_up.chunk(2, -1)`)."""
    # a 2-d tensor is read as-is only when its own rows are the M rows: with several trailing dims in
    # one row (a 2-d normalized shape), its row stride says nothing about the stride within a row
    if t.dim() == 2 and t.shape[1] == N and (N == 1 or t.stride(1) == 1):
        return t, (t.stride(0) if M > 1 else N)
    try:
        v = t.view(M, N)
    except RuntimeError:
        v = None
    if v is None or (N > 1 and v.stride(1) != 1):
        v = t.contiguous().view(M, N)
        return v, (v.stride(0) if M > 1 else N)
    return t, (v.stride(0) if M > 1 else N)


def sm_count(device) -> int:
    """Streaming multiprocessors of a CUDA device (a torch.device or an index; no index: the current
    device), read once per device."""
    index = device if device is None or isinstance(device, int) else device.index
    return _sm_count(torch.cuda.current_device() if index is None else index)


@functools.lru_cache(maxsize=None)
def promote_types(a, b):
    """torch.promote_types, computed once per dtype pair: a function of the dtypes alone, and an ATen op
    that a plan's recording watches like any other (6 us per call under its mode on a CPU host)."""
    return torch.promote_types(a, b)


@functools.lru_cache(maxsize=16)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def target_programs(cfg, device) -> int:
    """How many programs a launch that splits its work aims at: a backend config's fixed `programs`
    (the interpreter's, small so that tests split), else `programs_per_sm` x the device's SMs."""
    if "programs" in cfg:
        return cfg["programs"]
    return cfg["programs_per_sm"] * sm_count(device)


def span(t) -> int:
    """Elements from a tensor view's first to its last addressed element, inclusive (by its strides):
    what a kernel's element offsets must hold (past 2**31 - 1 they need 64 bits)."""
    return 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()) if n > 0)


def wrap_dim(dim: int, ndim: int) -> int:
    """ATen's dim wrapping: 0-dim tensors accept dim 0 and -1; out of range is an IndexError."""
    n = max(ndim, 1)
    if not -n <= dim < n:
        raise IndexError(f"Dimension out of range (expected to be in range of [{-n}, {n - 1}], but got {dim})")
    return dim % n


def wrap_dims(dims, ndim: int) -> list[int]:
    """Reduction dims: None or [] mean all dims; duplicates are an error like in ATen."""
    if dims is None or len(dims) == 0:
        return list(range(ndim))
    out = [wrap_dim(d, ndim) for d in dims]
    if len(set(out)) != len(out):
        raise RuntimeError(f"dim {dims} appears multiple times in the list of dims")
    return out


def resize_like_aten(out, shape, stacklevel=4):
    """Resize a wrongly shaped `out=` tensor the way ATen does, warning when it held elements."""
    if out.numel() != 0:
        warnings.warn(f"An output with one or more elements was resized since it had shape {list(out.shape)}, "
                      f"which does not match the required output shape {list(shape)}. This behavior is "
                      "deprecated, and in a future PyTorch release outputs will not be resized unless they have "
                      "zero elements. You can explicitly reuse an out tensor t by resizing it, inplace, to zero "
                      "elements with t.resize_(0).", UserWarning, stacklevel=stacklevel)
    out.resize_(shape)


def prepare_out(out, shape, dtype, device, contiguous=True):
    """A tensor of `shape`/`dtype` to write into: a new one, or the caller's `out` (resized like ATen);
    contiguous=False accepts an `out` of any strides (kernels that write through its strides)."""
    if out is None:
        return empty(shape, dtype, device)
    if out.dtype != dtype:
        raise Unsupported("out dtype differs from the result dtype")
    if out.device != device:
        raise Unsupported("out on another device")
    shape = tuple(shape)
    if tuple(out.shape) != shape:
        resize_like_aten(out, shape, stacklevel=5)
    if contiguous and not out.is_contiguous():
        raise Unsupported("non-contiguous out")
    return out


def num_warps_for(block: int, lo: int = 1, hi: int = 16) -> int:
    """Warps for a program working on `block` elements: ~8 elements per thread, 16-byte vectors."""
    w = block // 256
    return max(lo, min(hi, next_pow2(w) if w > 0 else 1))
