"""The strides ATen gives a pointwise op's fresh output, or its out= resized from another shape.

Three rules, by how ATen implements the overload:

* an out= overload that ATen's code generator derives from the functional op (native_functions.yaml
  `autogen:`: rsub.Scalar_out, __lshift__.Tensor_out, bitwise_and.Scalar_Tensor_out, ...) computes the
  functional result and copies it into `out` after resize_output, which lays a resized out contiguous;
* an overload whose ATen implementation allocates the result itself (the op's `result_layouts`:
  "contiguous", or "like_self" for empty_like(self));
* otherwise TensorIterator's (layout.result_strides) over the operands in the op's iteration order,
  as TensorIterator sees them: on the CPU an input whose dtype differs from the common dtype is first
  converted to it (`.to(common)`: a temporary keeping the input's strides when they are dense, else
  dense in its memory order, as empty_like), so an expanded input votes as a dense one; CUDA converts
  while loading, and every input keeps its strides.

The `autogen:` list is read once from the native_functions.yaml that torch ships in torchgen; without
that file no overload counts as generated (results keep TensorIterator's strides).
"""
from __future__ import annotations

import functools
import importlib.util
import os
import re

import torch

from . import layout

_WRAPPED = ((), (), True, False)    # a number ATen wraps as a 0-dim tensor
_AUTOGEN = re.compile(r"^\s*autogen:\s*(.+?)\s*$")


@functools.lru_cache(maxsize=1)
def generated_out_overloads() -> frozenset:
    """The overload names native_functions.yaml lists under `autogen:` (empty without the file)."""
    spec = importlib.util.find_spec("torchgen")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(root, "packaged", "ATen", "native", "native_functions.yaml")
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                names = [n.strip() for line in f if (m := _AUTOGEN.match(line)) for n in m.group(1).split(",")]
            return frozenset(n if "." in n else n + ".default" for n in names if n)
    return frozenset()


def layout_desc(t):
    """(shape, strides, contiguous, channels_last) of a tensor, what layout.result_strides reads."""
    return (tuple(t.shape), tuple(t.stride()), t.is_contiguous(),
            t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last))


def _converted_desc(t):
    """The layout of `t.to(other dtype)`: ATen's _to_copy keeps dense strides, else infers dense ones."""
    shape, strides, contiguous, channels_last = layout_desc(t)
    st = layout.like_strides(shape, strides, contiguous, channels_last)
    return (shape, st, st == layout.contiguous_strides(shape),
            len(shape) == 4 and st == layout.channels_last_strides(shape))


def _iterator_common_dtype(op, operands, result):
    """TensorIterator's common dtype: the promoted operands' dtype, the floating result's where integer
    inputs are promoted to float (true division, exp of ints)."""
    common = op.common_dtype(operands)
    if result.is_floating_point and not common.is_floating_point:
        return result
    return common


def fresh_strides(op, ovl, operands, shape, device_type, result):
    """The strides ATen gives a fresh (or resized) output of this call (see the module doc); once per
    call signature (a plan repeats the allocation it recorded)."""
    name = ovl.name if ovl is not None else None
    if name is not None and name in generated_out_overloads():
        return layout.contiguous_strides(shape)
    rule = op.result_layouts.get(name)
    if rule == "contiguous":
        return layout.contiguous_strides(shape)
    if rule == "like_self":
        return layout.like_strides(*layout_desc(operands[0]))
    convert = None
    if device_type == "cpu":
        common = _iterator_common_dtype(op, operands, result)
        convert = {i for i in op.promote if isinstance(operands[i], torch.Tensor) and operands[i].dtype != common}
    descs = []
    for i in op.iter_order:
        a = operands[i]
        if isinstance(a, torch.Tensor):
            descs.append(_converted_desc(a) if convert and i in convert and a.dim() else layout_desc(a))
        elif a is not None and op.number_operands:
            descs.append(_WRAPPED)
    return layout.result_strides(shape, descs)
