"""Where tensors sit in memory: the checks op families make before they write (shared, so each lives once)."""
import torch

from ..codegen.layout import internal_overlap, non_overlapping_and_dense
from ..runtime.utils import span


def has_internal_overlap(t) -> bool:
    """Whether elements of `t` share an address, so writing it is what ATen rejects (never for an empty
    tensor: there is nothing to write; the pointwise generator applies the same rule)."""
    return internal_overlap(t.shape, t.stride())


def overlaps(a, b) -> bool:
    """Whether the bytes `a` spans meet the bytes `b` spans (same storage, intersecting address ranges)."""
    if a.numel() == 0 or b.numel() == 0 or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    lo_a, hi_a = a.data_ptr(), a.data_ptr() + span(a) * a.element_size()
    lo_b, hi_b = b.data_ptr(), b.data_ptr() + span(b) * b.element_size()
    return lo_a < hi_b and lo_b < hi_a


def non_overlapping_dense(t) -> bool:
    """Whether `t` fills its span exactly once: its strides, sorted ascending, are the contiguous strides of
    its sizes in that order (size-1 dims ignored)."""
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1)
    expect = 1
    for s, n in dims:
        if s != expect:
            return False
        expect *= n
    return True


def preserved_strides(t):
    """The strides ATen's preserve_format keeps (clone, _to_copy, empty_like): t's own when c10 flags t
    non-overlapping and dense (contiguous, channels_last, or dense in some order; every empty tensor is
    contiguous, zero strides included), else None."""
    if t.is_contiguous() or _dense_beyond_contiguous(t):
        return tuple(t.stride())
    return None


def _dense_beyond_contiguous(t) -> bool:
    """c10's is_non_overlapping_and_dense beyond plain contiguity."""
    return (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last)) or \
        (t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d)) or \
        non_overlapping_and_dense(tuple(t.shape), tuple(t.stride()))
