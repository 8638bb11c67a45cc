"""stack: join equally shaped tensors along a new dim, through cat.py's kernel (no copy of its own).

    stack(tensors, d) = cat(tensors, d).view(sizes with n inserted at d)     d < ndim
                      = cat([t.unsqueeze(d) for t in tensors], d)            d == ndim (a new last dim)

which is how ATen computes it, so the result has ATen's dtype (promotion over the inputs) and strides
(the first form keeps cat's memory format: stacking channels_last [N, C, H, W] inputs along dim 1
gives ATen's strides, not contiguous ones). Both forms are views around one cat: cat's kernels, their
out= handling and call plans; inputs cat leaves to ATen send stack to ATen too (counted under stack).

Inputs of one dtype, shape and strides (the usual case: a decode loop's token ids, per-layer outputs)
go to cat's uniform path (cat_uniform: one launch per 64 inputs) with the first input, or its one
unsqueezed view, as the geometry for all: no view per input and no per-input checks beyond cat's one
equality pass. Otherwise cat's general path (one launch per 4 inputs) on the inputs or their views.
"""
from __future__ import annotations

from ...registry import Unsupported, register
from ...runtime.utils import resize_like_aten, wrap_dim
from .cat import ALL, cat, cat_uniform, uniform_inputs


@register("stack", "stack.out", category="copy", dtypes=ALL)
def stack(tensors, dim=0, *, out=None):
    """Inputs of one shape joined along a new dim: cat's kernel, viewed (as ATen's stack does)."""
    tensors = list(tensors)
    if not tensors:
        raise RuntimeError("stack expects a non-empty TensorList")
    if out is not None and any(t is out for t in tensors):
        # ATen resizes out, and so that input, before its checks: what it raises or answers follows from that
        raise Unsupported("out is one of the inputs")
    same = uniform_inputs(tensors)     # one dtype, shape and strides: cat's uniform path, no view per input
    shape = list(tensors[0].shape)
    if not same:
        for i, t in enumerate(tensors[1:], 1):
            if list(t.shape) != shape:
                raise RuntimeError(f"stack expects each tensor to be equal size, but got {shape} at entry 0 "
                                   f"and {list(t.shape)} at entry {i}")
            if t.dtype not in ALL:
                raise Unsupported(f"dtype {t.dtype}")
    nd = len(shape)
    d = wrap_dim(dim, nd + 1)
    sizes = shape[:d] + [len(tensors)] + shape[d:]
    if d < nd:
        joined = shape[:d] + [shape[d] * len(tensors)] + shape[d + 1:]
        if out is None:
            return _cat(tensors, d, None, same).view(sizes)     # splitting a dim is always a view
        if list(out.shape) != sizes:
            resize_like_aten(out, sizes)
        try:
            flat = out.view(joined)
        except RuntimeError:
            flat = None                             # out's strides do not join: cat the unsqueezed views
        if flat is not None:
            _cat(tensors, d, flat, same)
            return out
    if same:
        # the unsqueezed views differ only in their addresses: the first one gives the geometry
        return cat_uniform(tensors[0].unsqueeze(d), tensors, d, out)
    return cat([t.unsqueeze(d) for t in tensors], d, out=out)


def _cat(tensors, d, out, same):
    return cat_uniform(tensors[0], tensors, d, out) if same else cat(tensors, d, out=out)
