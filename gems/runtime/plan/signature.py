"""Call signatures: one generated function per overload, from its schema, that keys everything a call's
signature decides (dtypes, shapes, strides, devices, 16-byte alignment, the values or classes of
non-tensor arguments, aliasing). The C++ fast path keys the same facts (the number classes are
defined once, in runtime/abi.py)."""
from __future__ import annotations

import itertools
import math

import torch

from ..abi import INF_RANGE, NUMBER_RANGES
from ..source import compile_source

_T = torch.Tensor


def schema_params(schema):
    """(python parameter list, [(name, type string, mutable)], defaults namespace) for a schema; the
    namespace is the caller's own (it adds to it)."""
    params, info, ns, _ = _schema_parts(schema)
    return params, info, dict(ns)


_SCHEMA_PARTS: dict = {}    # id(schema) -> (schema, parts): some schemas do not hash (List[int] defaults)


def _schema_parts(schema):
    """_params' parts and, per argument, (name, has a default, the default): a function of the
    overload alone, computed once (35 us of each recording on a CPU host). Do not mutate."""
    hit = _SCHEMA_PARTS.get(id(schema))
    if hit is not None and hit[0] is schema:
        return hit[1]
    params, info, ns = _params_uncached(schema)
    defaults = tuple((a.name, (a.has_default_value() if hasattr(a, "has_default_value")
                               else a.default_value is not None), a.default_value) for a in schema.arguments)
    parts = (params, info, ns, defaults)
    _SCHEMA_PARTS[id(schema)] = (schema, parts)    # (the schema kept: its id stays its own)
    return parts


def _params_uncached(schema):
    parts, info, ns, seen_kw = [], [], {}, False
    for i, a in enumerate(schema.arguments):
        if a.kwarg_only and not seen_kw:
            parts.append("*")
            seen_kw = True
        name = a.name
        has_default = a.has_default_value() if hasattr(a, "has_default_value") else a.default_value is not None
        if has_default or a.kwarg_only:
            ns[f"_D{i}"] = a.default_value if has_default else None
            parts.append(f"{name}=_D{i}")
        else:
            parts.append(name)
        mutable = a.alias_info is not None and a.alias_info.is_write
        info.append((name, str(a.type), mutable))
    return ", ".join(parts), info, ns


_TENSOR_SIG = "({0}.dtype, {0}.shape, {0}.stride(), {0}.data_ptr() & 15, {0}.get_device())"


def _num_sig(v):
    c = v.__class__
    if c is float:
        # -0.0 keys apart from 0.0 by its hex; a NaN's hex has no sign, so the sign is added
        return (c, v.hex()) if v == v else (c, "nan", _copysign(1.0, v))
    return (c, v)


def _dyn_sig(v):
    """Signature part of a per-call number: its class, sign, NaN-ness and range class (number_range),
    and for ints what Triton specializes a binary on (== 1 becomes a constant; divisibility by 16;
    the 32/64-bit range, which the range class holds), so a plan's binary is always the one Triton
    would pick for the value, and every check that reads a number's sign, zero-ness, NaN-ness or
    whether it fits a dtype (ATen's overflow check: gems.codegen.generator.number_misfit) decides
    the same for every call of the signature. The C++ fast path keys the same facts (the number
    classes: runtime/abi.py)."""
    c = v.__class__
    if c is float:
        if 0.0 < v <= 127.0 or (v == 0.0 and _copysign(1.0, v) > 0):
            return float            # the common case: non-negative, fits every dtype's range
        return _float_sig(v)
    if c is bool:
        return (bool, v)            # passed as 0/1: 1 is specialized
    if isinstance(v, int):
        if 2 <= v <= 127:
            return _SMALL_INT if v & 15 else _SMALL_INT16
        return (int, v == 1, v & 15 == 0, number_range(v), (v > 0) - (v < 0))
    return _float_sig(float(v)) if isinstance(v, float) else c   # float subclasses (numpy), complex


_SMALL_INT = (int, False, False, 0, 1)      # 2 <= v <= 127, v % 16 != 0
_SMALL_INT16 = (int, False, True, 0, 1)     # 16, 32, ..., 112


def number_range(v) -> int:
    """The range class of a number (not NaN); see NUMBER_RANGES."""
    for i, (lo, hi) in enumerate(NUMBER_RANGES):
        if lo <= v <= hi:
            return i
    return INF_RANGE if v in (float("inf"), float("-inf")) else len(NUMBER_RANGES)


def _float_sig(v):
    if v != v:
        return _NAN_NUMBER          # NaN-ness too: an op's check may send NaN numbers to ATen
    r, neg = number_range(v), _copysign(1.0, v) < 0
    # -0.0 keys apart from the negative numbers too: a kernel argument equal to 0 loses its sign
    # (number_misfit sends it to ATen), so x / -1.5's plan must not serve x / -0.0
    return float if r == 0 and not neg else (float, r, neg, v == 0.0)


_NAN_NUMBER = ("nan",)
_copysign = math.copysign


def _tensor_list_sig(ts):
    """Signature part of a tensor list: per element what a tensor argument keys (the length too)."""
    return tuple([(t.dtype, t.shape, t.stride(), t.data_ptr() & 15, t.get_device()) for t in ts])


def _only_list_sig(ts):
    """_tensor_list_sig and the aliasing pattern of a call whose only tensors are this list's (cat):
    unrolled for two elements, the models' case (KV-cache append, rotate_half)."""
    if len(ts) == 2:
        a, b = ts
        return ((a.dtype, a.shape, a.stride(), a.data_ptr() & 15, a.get_device()),
                (b.dtype, b.shape, b.stride(), b.data_ptr() & 15, b.get_device()), a is b)
    return _tensor_list_sig(ts), _alias_pattern(ts)


def _alias_sig(tensors, lists):
    """Which of the call's tensors (top-level tensor arguments, then each list's elements) are the same
    object: None when all are distinct, else per tensor the position of its first occurrence."""
    objs = [t for t in tensors if isinstance(t, _T)]
    for ts in lists:
        objs += ts
    return _alias_pattern(objs)


def _alias_pattern(objs):
    ids = list(map(id, objs))
    if len(set(ids)) == len(ids):
        return None
    first = {}
    return tuple([first.setdefault(i, j) for j, i in enumerate(ids)])


def make_signature(schema, dynamic=frozenset(), on_cuda=False):
    """A function of the overload's arguments returning a hashable signature, or None when the schema
    has arguments a plan cannot key (lists of optional tensors, generators). A tensor list (`Tensor[]`)
    keys each element like a tensor argument; its elements join the aliasing pattern."""
    params, info, ns = schema_params(schema)
    parts, tensors, lists = [], [], []
    for name, ty, _ in info:
        opt = ty.startswith("Optional[")
        base = ty[9:-1] if opt else ty
        if base == "Tensor":
            # a Python number arrives at a Tensor position for wrapped numbers (`x * 2.0`)
            num = f"_dyn({name})" if name in dynamic else f"_num({name})"
            e = f"({_TENSOR_SIG.format(name)} if isinstance({name}, _T) else {num})"
            parts.append(f"(None if {name} is None else {e})" if opt else e)
            tensors.append(name)
        elif base in ("number", "int", "float", "bool", "SymInt"):
            # ints also carry dtypes, layouts and memory formats (by value)
            parts.append(f"_dyn({name})" if name in dynamic else f"(None if {name} is None else _num({name}))")
        elif base in ("List[int]", "List[bool]", "List[SymInt]"):
            parts.append(f"(None if {name} is None else tuple({name}))")
        elif base in ("str", "Device"):
            parts.append(name)
        elif ty == "List[Tensor]":
            # a tensor list (cat's `tensors`): per element what a tensor argument keys
            parts.append(f"_tlist({name})")
            lists.append(name)
            list_part = len(parts) - 1
        else:
            return None   # optional-tensor lists, generators, ...: no plan for this overload
    # aliasing between tensor arguments changes what a kernel may do (x + x vs x + y is harmless,
    # but a plan maps kernel arguments to argument positions, so the pattern is part of the key)
    if lists:
        # list elements count as tensor arguments: one identity pattern over all of them
        if not tensors and len(lists) == 1:
            parts[list_part] = f"_tlist1({lists[0]})"    # elements and their aliasing in one pass
        else:
            parts.append(f"_alias(({''.join(t + ', ' for t in tensors)}), ({', '.join(lists)},))")
    else:
        for a, b in itertools.combinations(tensors, 2):
            parts.append(f"{a} is {b}")
    if on_cuda:
        parts.append("_cur()")
    # int -> float promotions (true division, exp of ints, int tensor + 1.5) follow the default dtype
    parts.append("_ddt()")
    body = f"    return ({', '.join(parts)},)\n"
    plain = [name for name, ty, _ in info if ty == "Tensor"]
    if plain and not lists:
        # the common call, every Tensor argument a tensor: one flat tuple (no inner tuples to build
        # and hash; about 0.9 us less per two-tensor call on the Python path). It is longer than the
        # general form's tuple (4 more elements per tensor), so the two kinds of key never meet.
        flat = [_TENSOR_SIG.format(name)[1:-1] if name in plain else part
                for (name, _, _), part in zip(info, parts)] + parts[len(info):]
        test = " and ".join(f"isinstance({n}, _T)" for n in plain)
        body = f"    if {test}:\n        return ({', '.join(flat)},)\n" + body
    src = f"def sig({params}):\n{body}"
    ns.update(_T=_T, _num=_num_sig, _dyn=_dyn_sig, _cur=getattr(torch._C, "_cuda_getDevice", None),
              _ddt=torch.get_default_dtype, _tlist=_tensor_list_sig, _alias=_alias_sig,
              _tlist1=_only_list_sig)
    name = f"<gems signature {schema.name}.{schema.overload_name or 'default'}>"
    return compile_source(src, name, ns)["sig"]


def named_args(schema, args, kwargs) -> dict:
    """The call's arguments by schema name, defaults filled in."""
    out = {}
    n = len(args)
    for i, (name, has_default, default) in enumerate(_schema_parts(schema)[3]):
        if i < n:
            out[name] = args[i]
        elif name in kwargs:
            out[name] = kwargs[name]
        else:
            out[name] = default if has_default else None
    return out


def symint_returns(schema):
    """Per return of the schema: whether it is declared SymInt (a size). Python's schema objects show
    SymInt as `int`; the schema's text keeps the declaration."""
    text = str(schema).rpartition(") -> ")[2].strip()
    if text.startswith("("):
        text = text[1:-1]
    return [part.strip().startswith("SymInt ") or part.strip() == "SymInt" for part in text.split(",")]
