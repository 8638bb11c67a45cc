"""stack: join equally shaped tensors along a new dim, through cat.py's kernel (no copy of its own).

    stack(tensors, d) = cat(tensors, d).view(sizes with n inserted at d)     d < ndim
                      = cat([t.unsqueeze(d) for t in tensors], d)            d == ndim (a new last dim)

which is how ATen computes it, so the result has ATen's dtype (promotion over the inputs) and strides
(the first form keeps cat's memory format: stacking channels_last [N, C, H, W] inputs along dim 1
gives ATen's strides, not contiguous ones). Both forms are views around one cat: cat's kernel, one
launch per 4 inputs, its out= handling and call plans; inputs cat leaves to ATen send stack to ATen
too (counted under stack).
"""
from __future__ import annotations

from ..registry import Unsupported, register
from ..runtime.utils import resize_like_aten, wrap_dim
from .cat import ALL, cat


@register("stack", "stack.out", category="copy", dtypes=ALL)
def stack(tensors, dim=0, *, out=None):
    """Inputs of one shape joined along a new dim: cat's kernel, viewed (as ATen's stack does)."""
    tensors = list(tensors)
    if not tensors:
        raise RuntimeError("stack expects a non-empty TensorList")
    shape = list(tensors[0].shape)
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
            return cat(tensors, d).view(sizes)     # splitting a dim is always a view
        if list(out.shape) != sizes:
            resize_like_aten(out, sizes)
        try:
            flat = out.view(joined)
        except RuntimeError:
            flat = None                             # out's strides do not join: cat the unsqueezed views
        if flat is not None:
            cat(tensors, d, out=flat)
            return out
    return cat([t.unsqueeze(d) for t in tensors], d, out=out)
