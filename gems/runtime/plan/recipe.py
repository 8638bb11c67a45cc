"""The C++ recipe: a plan as data for the C++ fast path, which replays it without Python. Its codes and
limits are the contract in runtime/abi.py."""
from __future__ import annotations

import struct
from typing import Optional

import torch

from ..abi import (CONVERSIONS, FILL_NONE, FILL_POISON, FILL_ZEROS, LAUNCH_CUDA, LAUNCH_INTERPRETER,
                   LIST_ELEMENT_BITS, LIST_REF, MAX_PARAMS, PARAM_CONST, PARAM_DYN, PARAM_PHILOX, PARAM_TENSOR,
                   PARAM_TMA, PTR_TYPE, PTYPES, SRC_ALLOC, SRC_ARG, SRC_CONST_INT, SRC_LIST_ELEMENT, SRC_UNDEFINED)
from .launchers import interpreter_launch


class NoRecipe(Exception):
    """The plan uses something the C++ fast path does not replay (it keeps the Python plan)."""


def param_type(ty) -> Optional[int]:
    """The fast path's code (abi.PTYPES) of a Triton signature type: PTR_TYPE for a pointer, PTYPES'
    code for a number, None for what it cannot pass (a constexpr, a tuple, ...)."""
    if not isinstance(ty, str):
        return None
    return PTR_TYPE if ty.startswith("*") else PTYPES.get(ty)


def _pack(value, ty: str) -> int:
    """A constant kernel argument as the bits Triton's launcher would pass (little endian)."""
    if ty in ("fp32", "f32"):
        return struct.unpack("<I", struct.pack("<f", float(value)))[0]
    if ty == "fp64":
        return struct.unpack("<Q", struct.pack("<d", float(value)))[0]
    if ty in ("fp16", "bf16"):
        t = torch.tensor(float(value), dtype=torch.float16 if ty == "fp16" else torch.bfloat16)
        return int(t.view(torch.int16).item()) & 0xFFFF
    return int(value) & 0xFFFFFFFFFFFFFFFF


def make_recipe(schema, rec, guards, launches, refs, direct):
    """The plan as data for the C++ fast path (the layout the C++ side parses; its codes: runtime/abi.py):
    (guards, allocations, launches, results), every tensor named by (SRC_ARG, schema argument index)
    or (SRC_ALLOC, allocation index), or (SRC_LIST_ELEMENT, argument index << LIST_ELEMENT_BITS |
    element index) for a tensor-list element (`tensors[2]`); a guard's other tensor is an argument
    index, or LIST_REF + that code. A result may also be (SRC_UNDEFINED, 0, None): undefined, or
    (SRC_CONST_INT, value, None): a constant int."""
    index = {a.name: i for i, a in enumerate(schema.arguments)}

    def src(name):
        if name in index:
            return SRC_ARG, index[name]
        if name.endswith("]"):
            arg, _, elem = name[:-1].partition("[")
            if int(elem) >= 1 << LIST_ELEMENT_BITS:
                raise NoRecipe
            return SRC_LIST_ELEMENT, index[arg] << LIST_ELEMENT_BITS | int(elem)
        return SRC_ALLOC, int(name[1:])

    def other(name):
        kind, i = src(name)
        return i if kind == SRC_ARG else LIST_REF + i

    g = tuple((index[m], other(n), em, ev) for m, n, em, ev in guards)
    allocs = []
    for t, zero, poison in rec.allocs:
        fill = FILL_ZEROS if zero else FILL_POISON if poison else FILL_NONE
        allocs.append((tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device), fill))
    ls = []
    for lc, entry, grid, parts, (nw, ns_, maxnreg), dev_index in launches:
        params = []
        if direct:
            kernel = entry[0]
            _, _, function, coop, pdl, _meta = entry
            md = kernel.metadata
            if coop or pdl or getattr(md, "num_ctas", 1) != 1:
                raise NoRecipe
            types = list(kernel.src.signature.values())
            if len(types) != len(parts):
                raise NoRecipe
            metas = iter(getattr(md, "tensordesc_meta", None) or ())
            for ty, (kind, v) in zip(types, parts):
                if ty == "constexpr":
                    continue
                if not isinstance(ty, str):
                    raise NoRecipe
                if ty.startswith("tensordesc") != (kind == "desc"):
                    raise NoRecipe
                if kind == "desc":
                    r, d = v
                    tmap, shape, strides = tensor_map(d, next(metas, None))
                    params.append((PARAM_TMA, *src(r.name), r.off, tmap))
                    params += [(PARAM_CONST, PTYPES["i32"], _pack(x, "i32")) for x in shape]
                    params += [(PARAM_CONST, PTYPES["i64"], _pack(x, "i64")) for x in strides]
                elif kind == "tensor":
                    if not ty.startswith("*"):
                        raise NoRecipe
                    params.append((PARAM_TENSOR, *src(v.name), v.off, None))
                elif ty not in PTYPES:
                    raise NoRecipe
                elif kind == "dyn":
                    name, conv = v
                    params.append((PARAM_DYN, index[name], CONVERSIONS[conv], PTYPES[ty]))
                elif kind == "philox":
                    if ty != "i64":
                        raise NoRecipe
                    which, increment = v
                    params.append((PARAM_PHILOX, which, increment, dev_index))
                else:
                    if v is None:
                        raise NoRecipe
                    params.append((PARAM_CONST, PTYPES[ty], _pack(v, ty)))
            if len(params) > MAX_PARAMS:
                raise NoRecipe     # the C++ replay's parameter array; the Python plan still serves
            ls.append((LAUNCH_CUDA, int(function), grid, 32 * md.num_warps, int(md.shared), dev_index, tuple(params)))
        else:
            for kind, v in parts:
                if kind == "desc":
                    raise NoRecipe     # the interpreter's descriptors stay with the Python plan
                if kind == "tensor":
                    if v.view is False:
                        raise NoRecipe
                    params.append((PARAM_TENSOR, *src(v.name), 0, v.view))
                elif kind == "dyn":
                    name, conv = v
                    params.append((PARAM_DYN, index[name], CONVERSIONS[conv], 0))
                else:
                    params.append((PARAM_CONST, None, v))
            ls.append((LAUNCH_INTERPRETER, interpreter_launch(lc.fn, grid, nw, ns_, maxnreg), None, None, None, None,
                       tuple(params)))
    res = []
    for r in refs:
        if r is None:
            res.append((SRC_UNDEFINED, 0, None))
            continue
        if r.__class__ is int:
            res.append((SRC_CONST_INT, r, None))     # a constant int result
            continue
        if r.view is False:
            raise NoRecipe
        res.append((*src(r.name), r.view))
    return (g, tuple(allocs), tuple(ls), tuple(res))



# Triton's TMA data type codes differ between the compiler's metadata and the driver's enum
# (driver.py TMA_DTYPE_DEVICE_TO_HOST): 8, 9, 10 map to 10, 8, 9
_TMA_DTYPE_TO_DRIVER = {8: 10, 9: 8, 10: 9}


def tensor_map(d, meta):
    """The C++ recipe's form of host descriptor `d` for a kernel compiled with TMA metadata `meta`
    (one entry of `tensordesc_meta`): ((address, driver data type, dims, byte strides, box, swizzle,
    out-of-bounds fill), shape, strides), the parameters Triton's launcher passes for it
    (driver.make_tensordesc_arg: the encoded map, then the shape as i32 and the strides as i64), with
    the encoding's arrays innermost first as driver.c's fillTMADescriptor gives them to
    cuTensorMapEncodeTiled. A kernel lowered without TMA metadata (descriptors decomposed into
    pointers) gets no recipe."""
    if meta is None or d.strides[-1] != 1:
        raise NoRecipe
    shape = list(d.shape)
    if meta["fp4_padded"]:
        shape[-1] *= 2
    size = meta["elem_size"]
    block = list(meta["block_size"])
    if len(block) != len(shape) or not 1 <= len(shape) <= 5:
        raise NoRecipe
    fill = 1 if d.padding == "nan" else 0
    dtype = _TMA_DTYPE_TO_DRIVER.get(meta["elem_type"], meta["elem_type"])
    tmap = (d.base.data_ptr(), dtype, tuple(reversed(shape)), tuple(size * s for s in reversed(d.strides[:-1])),
            tuple(reversed(block)), meta["swizzle"], fill)
    return tmap, shape, list(d.strides)
