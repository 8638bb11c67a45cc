"""Copy-like ops: fill_ (Scalar, Tensor), zero_, copy_ (casts, strides, broadcast src into self) and
_to_copy (dtype casts on the same device), declared through gems.codegen.

Re-entry: the Triton interpreter copies storages with copy_ while a Gems kernel runs; the dispatcher's
depth guard sends every call made inside Gems to ATen, so copy_ never recurses into itself.
"""
import torch
import triton
import triton.language as tl

from ...codegen import pointwise
from ...registry import FLOATS, INTS, Unsupported, register
from ...runtime import alloc
from ..memory import preserved_strides

ALL = FLOATS + INTS + (torch.bool,)


@triton.jit
def _fill(a, v):
    """value (self is only an operand for its shape/dtype; the select folds its load away)"""
    return tl.where(a == a, v, v)


@triton.jit
def _fill_tensor(a, v):
    """value[()] cast to self's dtype"""
    w = v.to(a.dtype)
    return tl.where(a == a, w, w)


@triton.jit
def _zero(a):
    """0"""
    return tl.zeros_like(a)


@triton.jit
def _copy(s):
    """src, cast to self's dtype on store (float -> int truncates, -> bool is != 0, like ATen)"""
    return s


def _fill_value_0dim(self, value, *a, **k):
    return None if value.dim() == 0 else "value is not 0-dim (ATen raises)"


fill = pointwise("fill_.Scalar", body=_fill, operands=("self",), scalars=("value",), dtypes=ALL)
fill_tensor = pointwise("fill_.Tensor", body=_fill_tensor, operands=("self", "value"), promote=("self",),
                        operand_dtypes={"value": ALL}, dtypes=ALL, check=_fill_value_0dim)
zero = pointwise("zero_", body=_zero, operands=("self",), dtypes=ALL)


def _copy_check(self, src, non_blocking=False):
    if not isinstance(src, torch.Tensor):
        return "Python number as src"   # a wrapped number ATen copies in (copysign of ints)
    if self.device != src.device:
        return "copy across devices"
    if self.dtype not in ALL or src.dtype not in ALL:
        return "dtype"
    return _float_to_uint8(src.dtype, self.dtype, self.device)


def _float_to_uint8(src, dst, device):
    # c10 casts a float to uint8 through int64 (C's float -> unsigned cast is undefined for negative
    # values: -3.7 stores 253); the GPU's direct conversion saturates (0). The interpreter's numpy cast
    # goes through an integer as c10 does
    if dst is torch.uint8 and src.is_floating_point and device.type == "cuda":
        return "float to uint8 on CUDA (c10 casts through int64)"
    return None


# copy_: src is the only operand; `self` is the in-place output. Any cast is allowed, so the declared
# result dtype is bool (castable to every dtype) — it only feeds the in-place can_cast check.
copy = pointwise("copy_", body=_copy, operands=("src",), dtypes=ALL, result_dtype=lambda c, r: torch.bool,
                 category="copy", check=_copy_check)
# copy_'s registered function, for ops that start by copying into a tensor they write: its launch is
# declared the call's first write (codegen/generator.py), so call it before writing anything else
copy_fn = copy.overloads["copy_"].fn

_KEEP = (None, torch.preserve_format, torch.contiguous_format)


@register("_to_copy", category="copy", dtypes=ALL)
def _to_copy(self, *, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False,
             memory_format=None):
    """self.to(dtype) as a fresh tensor (same device; preserve_format keeps dense strides, like ATen)"""
    if not isinstance(self, torch.Tensor):
        raise Unsupported("Python number as self")   # ATen converts wrapped numbers with _to_copy
    if device is not None and torch.device(device) != self.device:
        raise Unsupported("device change")
    if layout not in (None, torch.strided):
        raise Unsupported(f"layout {layout}")
    if pin_memory:
        raise Unsupported("pin_memory")
    if memory_format not in _KEEP:
        raise Unsupported(f"memory_format {memory_format}")
    dt = self.dtype if dtype is None else dtype
    if dt not in ALL:
        raise Unsupported(f"dtype {dt}")
    why = _float_to_uint8(self.dtype, dt, self.device)
    if why:
        raise Unsupported(why)
    strides = None
    if memory_format in (None, torch.preserve_format):
        strides = preserved_strides(self)
        if strides is None:
            raise Unsupported("preserve_format of an overlapping or non-dense tensor")
    out = alloc.empty(self.shape, dt, self.device, strides)
    if self.numel():
        copy_fn(out, self)
    return out



_CLONE_FORMATS = (None, torch.preserve_format, torch.contiguous_format, torch.channels_last,
                  torch.channels_last_3d)


@register("clone", category="copy", dtypes=ALL)
def clone(self, *, memory_format=None):
    """A copy of self (preserve_format keeps dense strides, else the suggested format; contiguous,
    channels_last, channels_last_3d as asked), through copy_'s kernel."""
    if memory_format not in _CLONE_FORMATS:
        raise Unsupported(f"memory_format {memory_format}")
    if self.is_neg() or self.is_conj():
        raise Unsupported("negative or conjugate view")
    mf = torch.preserve_format if memory_format is None else memory_format
    # preserve_format keeps a non-overlapping, dense tensor's own strides (an empty one's too, zero
    # strides included, which the meta device's empty_like would not keep); otherwise ATen's
    # empty_like decides (dense strides inferred, the asked format, channels_last's rank check raising
    # like ATen), on the meta device, which allocates nothing
    strides = preserved_strides(self) if mf == torch.preserve_format else None
    if strides is None:
        meta = torch.empty_strided(self.shape, self.stride(), dtype=self.dtype, device="meta")
        strides = torch.empty_like(meta, memory_format=mf).stride()
    out = alloc.empty(self.shape, self.dtype, self.device, strides)
    if self.numel():
        copy_fn(out, self)
    return out
