"""Declaring pointwise ops: one scalar body, every ATen overload variant.

See the package docstring (gems/codegen/__init__.py) for the API. This module holds the per-call
machinery: the generated per-overload wrappers (hot path), the general path (promotion, broadcast,
output allocation/resizing, in-place checks, layout planning) and the kernel cache.
"""
from __future__ import annotations

import math
import threading

import torch
import torch._prims_common as pc

from ..registry import FLOATS, Unsupported, register
from ..runtime import alloc
from ..runtime import plan as _plan
from ..runtime.backends import backend
from ..runtime.utils import cdiv, resize_like_aten
from . import layout, source
from .result_layout import fresh_strides

_T = torch.Tensor
_KIND = pc.ELEMENTWISE_TYPE_PROMOTION_KIND
PROMOTIONS = {
    "default": _KIND.DEFAULT,
    "int_to_float": _KIND.INT_TO_FLOAT,
    "always_bool": _KIND.ALWAYS_BOOL,
    "no_opmath": _KIND.NO_OPMATH,
    "bool_to_long": _KIND.BOOL_TO_LONG,
}
_TL = {
    torch.float32: "tl.float32", torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16",
    torch.int8: "tl.int8", torch.int16: "tl.int16", torch.int32: "tl.int32", torch.int64: "tl.int64",
    torch.uint8: "tl.uint8", torch.bool: "tl.int1",
}
# dtypes a kernel may compute in (fp16/bf16 are computed in fp32 by the promotion's opmath rule)
_COMPUTE_OK = frozenset([torch.float32, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool])
_NUMBERS = (bool, int, float)


class _Overload:
    """One ATen overload of an op: how its schema's arguments map to operands/scalars/outputs."""

    def __init__(self, op, name):
        self.op = op
        self.name = name
        base, ov = name.split(".", 1) if "." in name else (name, "default")
        schema = getattr(getattr(torch.ops.aten, base), ov)._schema
        self.schema = schema
        args = schema.arguments
        names = [a.name for a in args]
        self.outs = [a.name for a in args if a.alias_info is not None and a.alias_info.is_write]
        self.inplace = self.outs == ["self"] and base.endswith("_")
        if len(self.outs) not in (0, op.n_out) and not self.inplace:
            raise ValueError(f"{name}: {len(self.outs)} outputs in the schema, op declares {op.n_out}")
        for o in op.operands:
            if o not in names:
                raise ValueError(f"{name}: operand {o!r} not in schema {schema}")
        self.args = args
        self.names = names
        # operands, scalars and constexprs the schema types Scalar or float: ATen converts them to the
        # common dtype or its opmath type, with an overflow check (see number_misfit); Tensor
        # positions take wrapped numbers, which ATen converts modularly like Gems' kernels
        self.numbers = tuple(a.name for a in args if a.name in (*op.operands, *op.scalars, *op.constexprs) and
                             str(a.type).replace("Optional[", "").rstrip("]") in ("number", "float"))


class PointwiseOp:
    """A declared pointwise op; calling it runs the general path (tests use this directly)."""

    def __init__(self, names, body, promotion, operands, scalars, constexprs, promote, dtypes, operand_dtypes,
                 n_out, defaults, result_dtype, category, backward, check, doc, divisor=None, round_numbers=False,
                 iter_order=None, number_operands=True, result_layouts=None, cpu_exact_scalar=None):
        if not callable(promotion) and promotion not in PROMOTIONS:
            raise ValueError(f"promotion {promotion!r}: expected one of {sorted(PROMOTIONS)} or a callable")
        self.name = names[0] if names else getattr(body, "__name__", "op")
        self.body = body
        # a callable picks the kind from the constexpr values (div: rounding_mode None -> true division)
        self.kind = promotion if callable(promotion) else PROMOTIONS[promotion]
        self.operands = tuple(operands)
        self.scalars = tuple(scalars)
        self.constexprs = dict(constexprs) if isinstance(constexprs, dict) else {c: None for c in constexprs}
        self.promote = tuple(self.operands.index(p) for p in (promote if promote is not None else operands))
        self.dtypes = tuple(dict.fromkeys(dtypes))      # declared order: the op table stays stable
        self.operand_dtypes = {self.operands.index(k): tuple(v) for k, v in (operand_dtypes or {}).items()}
        self.n_out = n_out
        self.defaults = dict(defaults or {})
        self.result_dtype = result_dtype
        # the operand ATen's CPU kernels check for an integer zero (ZeroDivisionError), or None
        self.divisor = None if divisor is None else self.operands.index(divisor)
        # number operands (and 0-dim CPU tensors read on the host) are rounded to an fp16/bf16 common dtype
        # before the body, as ATen's TensorIterator converts CPU scalars to the common dtype and the
        # comparison kernels then read that value (x_half == 0.1 compares with half(0.1) on CPU and CUDA)
        self.round_numbers = round_numbers
        # the operand whose 0-dim value ATen's CPU kernel reads unrounded beside fp16/bf16 tensors, or None
        self.cpu_exact_scalar = None if cpu_exact_scalar is None else self.operands.index(cpu_exact_scalar)
        # what a fresh output's strides follow ATen's with (see the package docstring)
        self.iter_order = tuple(self.operands.index(o) for o in (iter_order or self.operands))
        self.number_operands = number_operands
        self.result_layouts = dict(result_layouts or {})
        self.doc = doc or (getattr(getattr(body, "fn", body), "__doc__", None) or "").strip().split("\n")[0]
        self.ident = f"{getattr(body, '__module__', '?')}.{getattr(getattr(body, 'fn', body), '__qualname__', '?')}"
        self._promo: dict = {}
        self._common: dict = {}
        self._kernels: dict = {}
        self._lock = threading.Lock()
        self.overloads = {}
        for n in names:
            ovl = _Overload(self, n)
            self.overloads[n] = ovl
            fn = _make_wrapper(self, ovl)
            fn.__doc__ = self.doc
            ovl.fn = fn
            dynamic = [a for a in self.operands + self.scalars if a in ovl.names]
            register(n, category=category, dtypes=_first_dtypes(self), backward=backward, check=check,
                     dynamic=dynamic)(fn)

    def unregistered_overload(self, name):
        """The wrapper for ATen overload `name` without registering it (clamp's optional bounds pick
        between several ops in a registered function of their own)."""
        ovl = _Overload(self, name)
        ovl.fn = _make_wrapper(self, ovl)
        self.overloads[name] = ovl
        return ovl.fn

    # ---- direct call (tests, fused code): general path, no registration involved
    def __call__(self, *operands, scalars=(), consts=(), out=None, inplace=False):
        outs = None if out is None else (list(out) if isinstance(out, (list, tuple)) else [out])
        mode = 1 if inplace else (2 if outs is not None else 0)
        return general(self, None, operands, tuple(scalars), tuple(consts), outs, mode)

    # ---- type promotion (cached per operand kinds and default dtype: int -> float follows it)
    @staticmethod
    def _kinds(operands):
        return tuple((a.dtype, a.dim() == 0) if isinstance(a, _T) else a.__class__ for a in operands) + \
            (torch.get_default_dtype(),)

    def promotion(self, operands, consts=()):
        key = self._kinds(operands) + consts
        r = self._promo.get(key)
        if r is None:
            promo = [operands[i] for i in self.promote]
            if not any(isinstance(a, _T) for a in promo):
                raise Unsupported("no tensor among the promoted operands")
            kind = PROMOTIONS[self.kind(*consts)] if callable(self.kind) else self.kind
            compute, result = pc.elementwise_dtypes(*promo, type_promotion_kind=kind)
            if self.result_dtype is not None:   # an operand's name: that tensor's dtype (see the package doc)
                result = operands[self.operands.index(self.result_dtype)].dtype if isinstance(
                    self.result_dtype, str) else self.result_dtype(compute, result)
            if compute in (torch.float16, torch.bfloat16):
                compute = torch.float32   # NO_OPMATH kinds: still compute in fp32, store rounded
            r = (compute, result)
            self._promo[key] = r
        return r

    def common_dtype(self, operands):
        """The promoted operands' common dtype (TensorIterator's, before opmath or int-to-float):
        the dtype ATen converts the call's Scalar arguments to."""
        key = self._kinds(operands)
        r = self._common.get(key)
        if r is None:
            promo = [operands[i] for i in self.promote]
            r = pc.elementwise_dtypes(*promo, type_promotion_kind=_KIND.DEFAULT)[1]
            self._common[key] = r
        return r

    def kernel(self, kind, rank, is_tensor, casts, scalar_cast):
        key = (kind, rank, is_tensor, casts, scalar_cast)
        k = self._kernels.get(key)
        if k is None:
            gen = source.flat_source if kind == "flat" else (lambda *a: source.nd_source(a[0], rank, *a[1:]))
            src = gen(self.ident, is_tensor, casts, len(self.scalars), scalar_cast, len(self.constexprs), self.n_out)
            k = source.load(src, self.body)
            self._kernels[key] = k
        return k


def _first_dtypes(op):
    # the dispatcher checks the first tensor argument against these; the rest is checked per call
    first = op.operand_dtypes.get(0)
    return tuple(first if first is not None else op.dtypes)


def _norm_const(v):
    return "none" if v is None else v


# --------------------------------------------------------------------------------------------
# general path
# --------------------------------------------------------------------------------------------

def _overlap_check(out, t):
    """ATen's assert_no_partial_overlap / internal overlap rule, as RuntimeError."""
    if out is t or t.numel() == 0 or out.numel() == 0:
        return
    if out.untyped_storage().data_ptr() != t.untyped_storage().data_ptr():
        return
    isz = out.element_size()
    a0 = out.data_ptr()
    a1 = a0 + (layout.max_offset(out.shape, out.stride()) + 1) * isz
    b0 = t.data_ptr()
    b1 = b0 + (layout.max_offset(t.shape, t.stride()) + 1) * t.element_size()
    if a1 <= b0 or b1 <= a0:
        return
    if not (_dense(out) and _dense(t)):
        return   # ATen: too hard to tell, computes anyway
    if a0 == b0 and a1 == b1 and out.stride() == t.stride():
        return   # full overlap (same elements): fine
    raise RuntimeError("unsupported operation: some elements of the input tensor and the written-to tensor "
                       "refer to a single memory location. Please clone() the tensor before performing the "
                       "operation.")


def _dense(t):
    sizes, sts = layout.collapse(tuple(t.shape), [tuple(t.stride())], list(range(t.dim())))
    return sts[0][-1] == 1 and len(sizes) == 1 or t.numel() <= 1


def _resize_out(out, shape, strides):
    if tuple(out.shape) == tuple(shape):
        return out
    resize_like_aten(out, shape, stacklevel=6)
    if tuple(out.stride()) != tuple(strides) and len(shape):
        out.as_strided_(shape, strides)
    return out


def _dtype_name(d):
    return {torch.float32: "Float", torch.float16: "Half", torch.bfloat16: "BFloat16", torch.float64: "Double",
            torch.int64: "Long", torch.int32: "Int", torch.int16: "Short", torch.int8: "Char",
            torch.uint8: "Byte", torch.bool: "Bool"}.get(d, str(d))


def _operand_values(op, operands, on_cuda, dyn):
    """Kernel values of the operands: tensors as they are, numbers as Python scalars, 0-dim CPU tensors
    beside device tensors read on the host (`.item()`). Fills `dyn` {operand index: expression source}
    for what a call plan must take from each call, and returns (values, first device tensor)."""
    vals, ref = [], None
    for i, a in enumerate(operands):
        if isinstance(a, _T):
            if on_cuda and a.dim() == 0 and not a.is_cuda:
                with _plan.quiet():        # a sanctioned host read: the plan repeats it per call
                    vals.append(a.item())
                dyn[i] = ".item()"
                continue
            allowed = op.operand_dtypes.get(i, op.dtypes)
            if a.dtype not in allowed:
                raise Unsupported(f"dtype {a.dtype}")
            if a.is_complex():
                raise Unsupported("complex")
            if ref is None:
                ref = a
            vals.append(a)
        elif a.__class__ in _NUMBERS:
            vals.append(int(a) if a.__class__ is bool else a)   # the interpreter has no i1 scalars
            dyn[i] = "int" if a.__class__ is bool else ""
        elif isinstance(a, _NUMBERS):   # subclasses of Python numbers (numpy scalars): plain values
            conv = bool if isinstance(a, bool) else int if isinstance(a, int) else float
            vals.append(int(a) if conv is bool else conv(a))
            dyn[i] = "int" if conv in (bool, int) else "float"
        else:
            raise Unsupported(f"operand of type {type(a).__name__}")
    return vals, ref


def _broadcast_shape(shapes):
    """torch.broadcast_shapes without its Python layer (that costs ~10-80 us; this ~0.3 us a pair)."""
    if not shapes:
        return ()
    shape = shapes[0]
    for s in shapes[1:]:
        if s != shape:
            shape = torch._C._infer_size(torch.Size(shape), torch.Size(s))
    return tuple(shape)


def _check_inplace(self_t, shape, result, tens):
    """ATen's checks for an in-place call; self is the output."""
    if tuple(self_t.shape) != shape:
        raise RuntimeError(f"output with shape {list(self_t.shape)} doesn't match the broadcast shape {list(shape)}")
    if not torch.can_cast(result, self_t.dtype):
        raise RuntimeError(f"result type {_dtype_name(result)} can't be cast to the desired output type "
                           f"{_dtype_name(self_t.dtype)}")
    if self_t.dtype not in _TL:
        raise Unsupported(f"dtype {self_t.dtype}")
    _check_no_internal_overlap(self_t)
    for v in tens:
        _overlap_check(self_t, v)
    return [self_t]


def _check_no_internal_overlap(o):
    # ATen decides: most ops raise there, but fill_, zero_ and masked_fill_ write expanded tensors
    if layout.internal_overlap(o.shape, o.stride()):
        raise Unsupported("the written-to tensor has elements that share an address")


def _outputs(op, ovl, operands, outs, mode, shape, result, device, tens):
    """The tensors the kernel writes: self (in-place), the caller's out= (checked, resized like ATen)
    or fresh ones laid out as ATen lays them (result_layout.fresh_strides)."""
    if mode == 1:
        return _check_inplace(outs[0], shape, result, tens)
    fresh = fresh_strides(op, ovl, operands, shape, device.type, result)
    if mode == 0:
        return [alloc.empty(shape, result, device, fresh) for _ in range(op.n_out)]
    out_list = []
    for o in outs:
        if o.dtype != result:
            raise Unsupported("out dtype differs from the result dtype")
        if o.device != device:
            raise Unsupported("out on another device")
        o = _resize_out(o, shape, fresh)
        _check_no_internal_overlap(o)
        for v in tens:
            _overlap_check(o, v)
        out_list.append(o)
    return out_list


def general(op, ovl, operands, scalars, consts, outs, mode):
    """Any call: mode 0 functional, 1 in-place (outs = [self]), 2 out= (outs given).

    Stages: operand values -> promotion -> broadcast shape -> outputs -> layout plan -> launch. A
    dispatcher call records all of it once per signature as a call plan (runtime/plan.py); this
    function then runs again only for new signatures."""
    be = backend()
    dyn = {}
    vals, ref = _operand_values(op, operands, be.device_type == "cuda", dyn)
    for s in scalars:
        if s is not None and not isinstance(s, _NUMBERS):
            raise Unsupported(f"scalar of type {type(s).__name__}")
    kscal = tuple(int(s) if s.__class__ is bool else s for s in scalars)
    for (name, allowed), c in zip(op.constexprs.items(), consts):
        if allowed is not None and c not in allowed:
            raise Unsupported(f"{name}={c!r}")
    compute, result = op.promotion(operands, tuple(consts))
    if compute not in _COMPUTE_OK:
        raise Unsupported(f"compute dtype {compute}")
    tens = [v for v in vals if isinstance(v, _T)]
    shapes = [tuple(v.shape) for v in tens] + ([tuple(outs[0].shape)] if mode == 1 else [])
    shape = _broadcast_shape(shapes)
    if ref is None and mode == 0:
        raise Unsupported("no device tensor operand")
    device = ref.device if ref is not None else outs[0].device
    if ovl is not None and (ovl.numbers or dyn):
        _check_numbers(op, ovl, operands, scalars, consts)
    numel = 1
    for s in shape:
        numel *= s
    if op.divisor is not None and numel and device.type == "cpu" and compute in _INTEGRAL:
        if _has_zero(operands[op.divisor], compute):
            # ATen's CPU kernels raise ZeroDivisionError; its CUDA kernels return what the hardware's
            # division gives, which the bodies reproduce (codegen.tlmath.int_div0)
            raise Unsupported("integer division by zero")
    out_list = _outputs(op, ovl, operands, outs, mode, shape, result, device, tens)
    if numel == 0:
        return _ret(op, out_list)
    _note_dynamic(op, ovl, operands, scalars, dyn)
    is_tensor = tuple(isinstance(v, _T) for v in vals)
    ctl = _TL[compute]
    casts = tuple(ctl if i in op.promote else (_TL[v.dtype] if isinstance(v, _T) else None)
                  for i, v in enumerate(vals))
    if op.round_numbers:
        common = op.common_dtype(operands)
        if common in _REDUCED:
            # numbers, and 0-dim tensors of a wider dtype that did not take part in the promotion, go
            # through the common dtype (double -> float -> half, as c10 converts)
            casts = tuple((_TL[common], c or ctl) if not isinstance(v, _T) or v.dtype != common else c
                          for c, v in zip(casts, vals))
    else:
        common = op.common_dtype(operands)
        if common in _REDUCED:
            # ATen's kernels load each tensor as the common dtype before widening to opmath (a dynamic
            # cast on CUDA; TensorIterator's converted copy of a CPU scalar on the CPU): a 0-dim fp32
            # tensor beside bf16 ones (capturable Adam's steps) is rounded to bf16 first. Only a 0-dim
            # operand can be wider than the common dtype. The CPU's mul and div kernels read their
            # second operand's original value instead (op.cpu_exact_scalar).
            keep = op.cpu_exact_scalar if be.device_type == "cpu" else None
            casts = tuple((_TL[common], c) if i in op.promote and i != keep and isinstance(v, _T)
                          and v.dtype != common else c for i, (c, v) in enumerate(zip(casts, vals)))
    cvals = [_norm_const(c) for c in consts]
    # an overload's call is this one launch: nothing it writes has been written when it runs, so a
    # binary still compiling may let ATen answer an in-place or out= call too (runtime/background.py).
    # Another op's implementation calling an overload's function keeps that promise (it calls it
    # before writing anything: copy_fn); a direct call of the op (ovl None) promises nothing
    first = ovl is not None
    # layout plan over outputs + tensor operands
    out_st = tuple(out_list[0].stride())
    in_st = [layout.broadcast_strides(shape, tuple(v.shape), tuple(v.stride())) for v in tens]
    in_st += [tuple(o.stride()) for o in out_list[1:]]
    perm = sorted(range(len(shape)), key=lambda d: -out_st[d])
    sizes, sts, transposed = layout.plan(shape, out_st, in_st, perm)
    if sizes[0] == 1 and len(sizes) == 2 and all(s[-1] == 1 for s in sts):
        # every operand and output dense in the same order: the flat kernel
        cfg = be.config("pointwise")
        block = cfg["BLOCK"]
        k = op.kernel("flat", 1, is_tensor, casts, ctl)
        i64 = layout.needs_int64(numel, block, [])
        k.run((cdiv(numel, block),), (*vals, *kscal, *out_list, numel, *cvals, block, i64), cfg["num_warps"], 3,
              first=first)
        return _ret(op, out_list)
    ndc = be.config("pointwise_nd")
    bm, bn = layout.tile(sizes, transposed, ndc["block"], ndc["square"])
    nt_m, nt_n = cdiv(sizes[-2], bm), cdiv(sizes[-1], bn)
    padded = sizes[:-2] + [nt_m * bm, nt_n * bn]
    i64 = layout.needs_int64(numel, bm * bn, [(padded, s) for s in sts])
    grid = nt_m * nt_n
    for s in sizes[:-2]:
        grid *= s
    # kernel tensor order: tensor operands, then outputs (matching nd_source)
    n_in = len(tens)
    t_strides = sts[1:1 + n_in] + [sts[0]] + sts[1 + n_in:]
    flat_st = [x for s in t_strides for x in s]
    k = op.kernel("nd", len(sizes), is_tensor, casts, ctl)
    k.run((grid,), (*vals, *kscal, *out_list, *sizes, *flat_st, nt_m, nt_n, *cvals, bm, bn, i64),
          ndc["num_warps"], 3, first=first)
    return _ret(op, out_list)


_INTEGRAL = frozenset([torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8])
_REDUCED = frozenset([torch.float16, torch.bfloat16])


def number_misfit(v, dtype) -> str | None:
    """Why ATen may treat Python number `v` otherwise than a kernel computing in `dtype` does (then the
    call goes to ATen, which raises or answers as it does), or None.

    ATen converts Scalar arguments (alpha, clamp bounds, fill values, pow's exponent, ...) to the
    common dtype or its opmath type, by op and by device, with c10::checked_convert's overflow check
    ("value cannot be converted to type int8_t without overflow"). Gems does not model which op
    converts to what: a number that does not fit the common dtype by c10's rule is left to ATen
    (ints into an unsigned dtype wrap down to -max; floats into integers must be finite and within
    [lowest, max]; to bool nothing overflows). What decides is part of a call plan's signature
    (runtime.plan._dyn_sig: class, sign, NaN-ness and range class), so plans never see such a call.
    """
    if dtype is torch.bool or isinstance(v, bool):
        return None                       # c10: conversions to and from bool never overflow
    limit = _RANGE_LIMIT.get(dtype)
    if limit is None:
        return f"a number with {dtype} tensors"
    if v != v:                            # NaN: fine for floating dtypes, an overflow for integers
        return None if dtype.is_floating_point else f"NaN with {dtype} tensors"
    if v == 0 and isinstance(v, float) and math.copysign(1.0, v) < 0:
        # Triton folds a scalar argument equal to 0 into its zero constant, losing the sign: ATen
        # computes with -0.0 (x * -0.0 is -0.0 for x > 0); the signature keys -0.0 apart
        return "-0.0 (the sign of a zero number does not reach Triton's kernels)"
    r = _plan.number_range(v)
    if dtype.is_floating_point:
        return None if r <= limit or r == _plan.INF_RANGE else f"out of {dtype}'s range"
    if dtype is torch.uint8:              # c10: negative ints wrap down to -255, negative floats overflow
        return None if r <= limit and (isinstance(v, int) or v >= 0) else f"out of {dtype}'s range"
    return None if r <= limit else f"out of {dtype}'s range"


# the widest range class (runtime.plan.NUMBER_RANGES) that converts to each dtype without overflow
_RANGE_LIMIT = {torch.int8: 0, torch.uint8: 1, torch.int16: 2, torch.int32: 4, torch.int64: 5, torch.float16: 3,
                torch.bfloat16: 6, torch.float32: 7, torch.float64: 8}


def range_limit(dtype) -> int | None:
    """The widest number range class that fits `dtype` by number_misfit's rule (the C++ fast path's
    foreach checks use it), or None for a dtype no number is checked against."""
    return _RANGE_LIMIT.get(dtype)


def _check_numbers(op, ovl, operands, scalars, consts):
    """Numbers ATen may convert otherwise than Gems' kernels do go to ATen (Unsupported): those at
    Scalar / float arguments by number_misfit's rule; those at Tensor positions (wrapped numbers:
    ATen converts them to the common dtype, or reads them at opmath precision, by op and variant)
    when they do not fit a floating common dtype -- ints out of range wrap alike in both."""
    named = [(n, operands[i]) for i, n in enumerate(op.operands) if n in ovl.numbers]
    named += [(n, scalars[j]) for j, n in enumerate(op.scalars) if n in ovl.numbers]
    named += [(n, consts[j]) for j, n in enumerate(op.constexprs) if n in ovl.numbers]
    named = [(n, v) for n, v in named if v is not None and not isinstance(v, _T)]
    wrapped = [(n, v) for n, v in zip(op.operands, operands)
               if n not in ovl.numbers and isinstance(v, _NUMBERS) and not isinstance(v, bool)]
    if not named and not wrapped:
        return
    dtype = op.common_dtype(operands)
    for name, v in named:
        why = number_misfit(v, dtype)
        if why is not None:
            raise Unsupported(f"{name}: {why}")
    if dtype.is_floating_point:
        for name, v in wrapped:
            why = number_misfit(v, dtype)
            if why is not None:
                raise Unsupported(f"{name}: {why}")


def _has_zero(d, dtype) -> bool:
    """Whether an integer divisor holds a zero in `dtype` (a number out of its range may wrap to
    zero: it counts as one). A tensor's values change per call: its signature keeps the full path
    (on the CPU, the interpreter's test backend; CUDA never reads them)."""
    if isinstance(d, _T):
        _plan.taint("integer divisor checked for zeros per call (ATen's CPU kernels raise on one)")
        with _plan.quiet():
            return bool((d.to(dtype) == 0).any())     # as the kernel sees it (a wider 0-dim divisor wraps)
    return d == 0 or number_misfit(d, dtype) is not None


def _note_dynamic(op, ovl, operands, scalars, dyn):
    """Tell a recording call plan which kernel arguments come from the call: the numbers among the
    operands and scalars (keyed by class, not value, in the signature) and host-read 0-dim tensors.
    Kernel arguments start with the operands, then the scalars (flat_source / nd_source)."""
    rec = _plan.active()
    if rec is None:
        return
    n = len(op.operands)
    slots = {}
    named = [(i, op.operands[i], operands[i]) for i in dyn]
    # scalars the overload's schema lacks come from op.defaults: constants, baked into the plan
    named += [(n + j, op.scalars[j], v) for j, v in enumerate(scalars)
              if v is not None and (ovl is None or op.scalars[j] in ovl.names)]
    for pos, name, v in named:
        conv = dyn.get(pos, "") if pos < n else ("int" if v.__class__ is bool else "" if v.__class__ in _NUMBERS
                                                else "float")
        # the expression names the recorded call's argument: valid only if that argument is this very
        # value (a wrapper calling another op's overload with derived numbers would bake them in)
        if ovl is None or rec.values.get(name, _ABSENT) is not v:
            _plan.taint("numbers not taken from the call's own arguments")
            return
        if conv == ".item()" and not v.is_floating_point():
            # an integer read on the host: Triton specializes its value (== 1, % 16), which the
            # signature (the tensor's dtype and shape) cannot see
            _plan.taint("integer host scalar")
            return
        slots[pos] = (name, conv)
    _plan.dynamic(slots)


_ABSENT = object()


def _ret(op, outs):
    return outs[0] if op.n_out == 1 else tuple(outs)


def _make_wrapper(op, ovl):
    """The registered function of one overload: ATen's signature, mapped onto `general`."""
    args = ovl.args
    sig, seen_kw = [], False
    ns = {"_G": general, "_OP": op, "_OVL": ovl}
    for i, a in enumerate(args):
        if a.kwarg_only and not seen_kw:
            sig.append("*")
            seen_kw = True
        if a.kwarg_only or _has_default(a):
            ns[f"_D{i}"] = a.default_value if _has_default(a) else None
            sig.append(f"{a.name}=_D{i}")
        else:
            sig.append(a.name)

    def scalar_expr(name):
        if name in ovl.names:
            return name
        if name in op.defaults:
            return repr(op.defaults[name])
        raise ValueError(f"{ovl.name}: scalar {name!r} is neither in the schema nor in defaults")

    scal = [scalar_expr(s) for s in op.scalars]
    consts = [scalar_expr(c) for c in op.constexprs]
    mode = 1 if ovl.inplace else (2 if ovl.outs else 0)
    outs = ovl.outs if mode == 2 else (["self"] if mode == 1 else [])
    tuple_of = lambda xs: "(" + "".join(x + ", " for x in xs) + ")"
    fname = ovl.name.replace(".", "_")
    src = (f"def {fname}({', '.join(sig)}):\n"
           f"    return _G(_OP, _OVL, {tuple_of(op.operands)}, {tuple_of(scal)}, {tuple_of(consts)}, "
           f"{'None' if mode == 0 else '[' + ', '.join(outs) + ']'}, {mode})\n")
    fn = _plan.compile_source(src, f"<gems pointwise {ovl.name}>", ns)[fname]
    fn.__gems_source__ = src
    return fn


def _has_default(a):
    try:
        return a.has_default_value()
    except AttributeError:
        return a.default_value is not None


def pointwise(*names, body, promotion="default", operands=("self", "other"), scalars=(), constexprs=(),
              promote=None, dtypes=None, operand_dtypes=None, outputs=1, defaults=None, result_dtype=None,
              category="pointwise", backward=False, check=None, doc=None, divisor=None,
              round_numbers=False, iter_order=None, number_operands=True, result_layouts=None,
              cpu_exact_scalar=None) -> PointwiseOp:
    """Declare a pointwise op; see the package docstring."""
    return PointwiseOp(names, body, promotion, operands, scalars, constexprs, promote,
                       dtypes if dtypes is not None else FLOATS, operand_dtypes, outputs, defaults, result_dtype,
                       category, backward, check, doc, divisor, round_numbers, iter_order, number_operands,
                       result_layouts, cpu_exact_scalar)
