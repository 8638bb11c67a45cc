"""Declaring pointwise ops: one scalar body, every ATen overload variant.

See the package docstring (gems/codegen/__init__.py) for the API. This module holds the per-call
machinery: the generated per-overload wrappers (hot path), the general path (promotion, broadcast,
output allocation/resizing, in-place checks, layout planning) and the kernel cache.
"""
from __future__ import annotations

import itertools
import threading

import torch
import torch._prims_common as pc

from ..registry import Unsupported, register
from ..runtime.backend import backend
from . import layout, source

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
_LIM = layout.INT32_MAX

# launch configs of the strided (nd) kernel per backend: elements per program, the square tile used
# when an input is transposed relative to the output, warps. The flat kernel uses
# backend().config("pointwise").
ND_CONFIG = {
    "cuda": {"block": 4096, "square": 64, "num_warps": 8},
    "interpreter": {"block": 1024, "square": 32, "num_warps": 1},
}


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
        self.fast: dict = {}


def _default_repr(a):
    if a.default_value is None and not a.kwarg_only and a.alias_info is None:
        return None
    return a.default_value


class PointwiseOp:
    """A declared pointwise op; calling it runs the general path (tests use this directly)."""

    def __init__(self, names, body, promotion, operands, scalars, constexprs, promote, dtypes, operand_dtypes,
                 n_out, defaults, result_dtype, category, backward, check, doc):
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
        self.doc = doc or (getattr(getattr(body, "fn", body), "__doc__", None) or "").strip().split("\n")[0]
        self.ident = f"{getattr(body, '__module__', '?')}.{getattr(getattr(body, 'fn', body), '__qualname__', '?')}"
        self._promo: dict = {}
        self._kernels: dict = {}
        self._lock = threading.Lock()
        self.overloads = {}
        self.held_back = []
        for n in names:
            ovl = _Overload(self, n)
            self.overloads[n] = ovl
            fn = _make_wrapper(self, ovl)
            fn.__doc__ = self.doc
            ovl.fn = fn
            if not backward and not numbers_safe(ovl.schema):
                # ATen hands Python numbers to these overloads; until the dispatcher's fallback can pass
                # them back to ATen (gems.codegen.numbers), serving them would break every later
                # `x * 2.0` with Gems registered. They are callable through `op.overloads[n].fn`.
                self.held_back.append(n)
                continue
            register(n, category=category, dtypes=_first_dtypes(self), backward=backward, check=check)(fn)

    # ---- direct call (tests, fused code): general path, no registration involved
    def __call__(self, *operands, scalars=(), consts=(), out=None, inplace=False):
        outs = None if out is None else (list(out) if isinstance(out, (list, tuple)) else [out])
        mode = 1 if inplace else (2 if outs is not None else 0)
        res = general(self, None, operands, tuple(scalars), tuple(consts), outs, mode)
        return res

    # ---- type promotion (cached per operand kind signature)
    def promotion(self, operands, consts=()):
        key = tuple((a.dtype, a.dim() == 0) if isinstance(a, _T) else a.__class__ for a in operands) + consts
        r = self._promo.get(key)
        if r is None:
            promo = [operands[i] for i in self.promote]
            if not any(isinstance(a, _T) for a in promo):
                raise Unsupported("no tensor among the promoted operands")
            kind = PROMOTIONS[self.kind(*consts)] if callable(self.kind) else self.kind
            compute, result = pc.elementwise_dtypes(*promo, type_promotion_kind=kind)
            if self.result_dtype is not None:
                result = self.result_dtype(compute, result)
            if compute in (torch.float16, torch.bfloat16):
                compute = torch.float32   # NO_OPMATH kinds: still compute in fp32, store rounded
            r = (compute, result)
            self._promo[key] = r
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


def numbers_safe(schema) -> bool:
    """Whether registering an overload is safe: it has at most one positional Tensor argument (so ATen
    never hands it a Python number beside a tensor), or the dispatcher converts numbers back for ATen
    (`gems.dispatch.WRAPS_NUMBERS`)."""
    from .. import dispatch
    from .numbers import tensor_positions
    return getattr(dispatch, "WRAPS_NUMBERS", False) or len(tensor_positions(schema)) <= 1


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
    from ..ops.utils import resize_like_aten   # lazily: gems.ops imports the op modules, which import us
    resize_like_aten(out, shape, stacklevel=6)
    if tuple(out.stride()) != tuple(strides) and len(shape):
        out.as_strided_(shape, strides)
    return out


def _dtype_name(d):
    return {torch.float32: "Float", torch.float16: "Half", torch.bfloat16: "BFloat16", torch.float64: "Double",
            torch.int64: "Long", torch.int32: "Int", torch.int16: "Short", torch.int8: "Char",
            torch.uint8: "Byte", torch.bool: "Bool"}.get(d, str(d))


def general(op, ovl, operands, scalars, consts, outs, mode):
    """Any call: mode 0 functional, 1 in-place (outs = [self]), 2 out= (outs given)."""
    from ..ops import utils as _utils   # lazily: gems.ops imports the op modules, which import us
    be = backend()
    on_cuda = be.device_type == "cuda"
    # 0-dim CPU tensors beside device tensors are read on the host, once, and passed as scalars
    vals = []
    ref = None
    for i, a in enumerate(operands):
        if isinstance(a, _T):
            if on_cuda and a.dim() == 0 and not a.is_cuda:
                vals.append(a.item())
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
        elif isinstance(a, _NUMBERS):   # subclasses of Python numbers (numpy scalars): plain values
            vals.append(bool(a) if isinstance(a, bool) else int(a) if isinstance(a, int) else float(a))
        else:
            raise Unsupported(f"operand of type {type(a).__name__}")
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
    tens = [(i, v) for i, v in enumerate(vals) if isinstance(v, _T)]
    shapes = [tuple(v.shape) for _, v in tens]
    if mode == 1:
        self_t = outs[0]
        shapes.append(tuple(self_t.shape))
    shape = tuple(torch.broadcast_shapes(*shapes)) if shapes else ()
    if ref is None and mode == 0:
        raise Unsupported("no device tensor operand")
    device = ref.device if ref is not None else outs[0].device

    # outputs
    if mode == 1:
        self_t = outs[0]
        if tuple(self_t.shape) != shape:
            raise RuntimeError(f"output with shape {list(self_t.shape)} doesn't match the broadcast shape {list(shape)}")
        if not torch.can_cast(result, self_t.dtype):
            raise RuntimeError(f"result type {_dtype_name(result)} can't be cast to the desired output type "
                               f"{_dtype_name(self_t.dtype)}")
        if self_t.dtype not in _TL:
            raise Unsupported(f"dtype {self_t.dtype}")
        if any(s == 0 and n > 1 for n, s in zip(self_t.shape, self_t.stride())):
            raise RuntimeError("unsupported operation: more than one element of the written-to tensor refers to a "
                               "single memory location. Please clone() the tensor before performing the operation.")
        for _, v in tens:
            _overlap_check(self_t, v)
        out_list = [self_t]
    else:
        perm = None
        tstrides = [layout.broadcast_strides(shape, tuple(v.shape), tuple(v.stride())) for _, v in tens]
        if all(v.is_contiguous() and tuple(v.shape) == shape for _, v in tens):
            fresh = layout.contiguous_strides(shape)
        else:
            perm = layout.output_perm(shape, tstrides)
            fresh = layout.strides_for_perm(shape, perm)
        if mode == 2:
            out_list = []
            for o in outs:
                if o.dtype != result:
                    raise Unsupported("out dtype differs from the result dtype")
                if o.device != device:
                    raise Unsupported("out on another device")
                o = _resize_out(o, shape, fresh)
                if any(s == 0 and n > 1 for n, s in zip(o.shape, o.stride())):
                    raise RuntimeError("unsupported operation: more than one element of the written-to tensor "
                                       "refers to a single memory location. Please clone() the tensor before "
                                       "performing the operation.")
                for _, v in tens:
                    _overlap_check(o, v)
                out_list.append(o)
        else:
            out_list = [_utils.empty(shape, result, device, None if perm is None else fresh) for _ in range(op.n_out)]
    numel = 1
    for s in shape:
        numel *= s
    if numel == 0:
        return _ret(op, out_list, mode)

    is_tensor = tuple(isinstance(v, _T) for v in vals)
    ctl = _TL[compute]
    casts = tuple(ctl if i in op.promote else (_TL[v.dtype] if isinstance(v, _T) else None)
                  for i, v in enumerate(vals))
    cvals = [_norm_const(c) for c in consts]
    # layout plan over outputs + tensor operands
    out_st = tuple(out_list[0].stride())
    in_st = [layout.broadcast_strides(shape, tuple(v.shape), tuple(v.stride())) for _, v in tens]
    in_st += [tuple(o.stride()) for o in out_list[1:]]
    perm = sorted(range(len(shape)), key=lambda d: -out_st[d])
    sizes, sts, transposed = layout.plan(shape, out_st, in_st, perm)
    ptrs = [v for _, v in tens]
    flat = sizes[0] == 1 and len(sizes) == 2 and all(s[-1] == 1 for s in sts)
    if flat:
        cfg = be.config("pointwise")
        block = cfg["BLOCK"]
        k = op.kernel("flat", 1, is_tensor, casts, ctl)
        i64 = layout.needs_int64(numel, block, [])
        k.run((_utils.cdiv(numel, block),), (*vals, *kscal, *out_list, numel, *cvals, block, i64),
              cfg["num_warps"], 3)
        if ovl is not None:
            _install_fast(op, ovl, operands, vals, scalars, consts, out_list, mode, shape, result, compute, k)
        return _ret(op, out_list, mode)
    ndc = ND_CONFIG.get(be.name, ND_CONFIG["cuda"])
    bm, bn = layout.tile(sizes, transposed, ndc["block"], ndc["square"])
    r = len(sizes)
    nt_m, nt_n = _utils.cdiv(sizes[-2], bm), _utils.cdiv(sizes[-1], bn)
    padded = sizes[:-2] + [nt_m * bm, nt_n * bn]
    i64 = layout.needs_int64(numel, bm * bn, [(padded, s) for s in sts])
    grid = nt_m * nt_n
    for s in sizes[:-2]:
        grid *= s
    # kernel tensor order: tensor operands, then outputs (matching nd_source)
    t_strides = sts[1:1 + len(tens)] + [sts[0]] + sts[1 + len(tens):]
    flat_st = [x for s in t_strides for x in s]
    k = op.kernel("nd", r, is_tensor, casts, ctl)
    k.run((grid,), (*vals, *kscal, *out_list, *sizes, *flat_st, nt_m, nt_n, *cvals, bm, bn, i64),
          ndc["num_warps"], 3)
    return _ret(op, out_list, mode)


def _ret(op, outs, mode):
    return outs[0] if op.n_out == 1 else tuple(outs)


# --------------------------------------------------------------------------------------------
# hot path: per overload, a generated wrapper that goes straight to a prebuilt closure
# --------------------------------------------------------------------------------------------

def _install_fast(op, ovl, operands, vals, scalars, consts, out_list, mode, shape, result, compute, k):
    """After a flat launch, prebuild the closure serving the same signature without any analysis."""
    if not shape or any(isinstance(a, _T) and (a.dim() == 0 or not a.is_contiguous() or tuple(a.shape) != shape)
                        for a in operands):
        return
    if any(not isinstance(a, (_T,) + _NUMBERS) for a in operands):
        return
    if mode == 1 and not out_list[0].is_contiguous():
        return
    if mode == 2 and any(not o.is_contiguous() for o in out_list):
        return
    key = _fast_key(operands, scalars, consts, out_list if mode else None)
    if key in ovl.fast:
        return
    ovl.fast[key] = _build_fast(op, ovl, operands, scalars, mode, result, k, consts)


def _fast_key(operands, scalars, consts, outs):
    key = tuple(a.dtype if isinstance(a, _T) else a.__class__ for a in operands)
    key += tuple(s.__class__ for s in scalars) + tuple(consts)
    if outs:
        key += tuple(o.dtype for o in outs)
    return key


def _build_fast(op, ovl, operands, scalars, mode, result, k, consts):
    from ..ops import utils as _utils
    cfg = backend().config("pointwise")
    block, warps = cfg["BLOCK"], cfg["num_warps"]
    n_ops = len(operands)
    ops = [f"x{i}" for i in range(n_ops)]
    scal = [f"s{i}" for i in range(len(op.scalars))]
    # bool numbers go to the kernel as ints (the interpreter has no i1 scalars); key has the class
    pass_ops = [f"int({o})" if operands[i].__class__ is bool else o for i, o in enumerate(ops)]
    pass_scal = [f"int({x})" if scalars[i].__class__ is bool else x for i, x in enumerate(scal)]
    outs = [f"y{j}" for j in range(op.n_out)]
    tens = [f"x{i}" for i in range(n_ops) if isinstance(operands[i], _T)]
    ref = "y0" if mode else tens[0]
    cvals = ", ".join(repr(_norm_const(c)) for c in consts)
    lines = [f"def fast({', '.join(ops + scal + (outs if mode else []))}):",
             f"    n = {ref}.numel()"]
    if mode == 0:
        for y in outs:
            lines.append(f"    {y} = _empty({tens[0]}.shape, _RDT, {tens[0]}.device)")
    lines += ["    if n:",
              f"        _K.run(((n + {block - 1}) // {block},), ({', '.join(pass_ops + pass_scal + outs)}, n, "
              f"{cvals + ', ' if cvals else ''}{block}, n > {_LIM - block}), {warps}, 3)",
              f"    return {outs[0] if op.n_out == 1 else '(' + ', '.join(outs) + ')'}"]
    ns = {"_empty": _utils.empty, "_RDT": result, "_K": k}
    exec("\n".join(lines), ns)
    return ns["fast"]


def _make_wrapper(op, ovl):
    """Python source of the registered function for one overload, with the fast path inlined."""
    args = ovl.args
    sig, seen_kw = [], False
    for a in args:
        if a.kwarg_only and not seen_kw:
            sig.append("*")
            seen_kw = True
        if a.kwarg_only or a.default_value is not None or (a.alias_info is None and _has_default(a)):
            dv = a.default_value if _has_default(a) else None
            sig.append(f"{a.name}={dv!r}")
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
    ops = list(op.operands)
    mode = 1 if ovl.inplace else (2 if ovl.outs else 0)
    outs = ovl.outs if mode == 2 else (["self"] if mode == 1 else [])
    tuple_of = lambda xs: "(" + "".join(x + ", " for x in xs) + ")"
    lines = [f"def {ovl.name.replace('.', '_')}({', '.join(sig)}):"]
    # fast path: every tensor operand contiguous, same (non-0-dim) shape; numbers anywhere
    n = len(ops)
    lines.append("    p = " + " + ".join(f"{1 << i} * isinstance({o}, _T)" for i, o in enumerate(ops)))
    first = True
    for pat in range(1, 1 << n):
        tens = [ops[i] for i in range(n) if pat >> i & 1]
        nums = [ops[i] for i in range(n) if not pat >> i & 1]
        refs = tens[0]
        conds = [f"{t}.is_contiguous()" for t in tens] + [f"{t}.shape == {refs}.shape" for t in tens[1:]]
        conds.append(f"{refs}.dim()")
        conds += [f"{x}.__class__ in _NUM" for x in nums]
        if mode == 1 and "self" not in ops:
            conds += ["self.is_contiguous()", f"self.shape == {refs}.shape"]
        if mode == 2:
            conds += [f"{o}.is_contiguous()" for o in outs] + [f"{o}.shape == {refs}.shape" for o in outs]
        if mode:
            conds += [f"_noov({o}, {t})" for o in outs for t in tens if not (mode == 1 and t == "self")]
        key = [f"{o}.dtype" if (pat >> i & 1) else f"{o}.__class__" for i, o in enumerate(ops)]
        key += [f"{s}.__class__" for s in scal] + consts + ([f"{o}.dtype" for o in outs] if mode else [])
        lines.append(f"    {'if' if first else 'elif'} p == {pat}:")
        first = False
        lines.append(f"        if {' and '.join(conds)}:")
        lines.append(f"            f = _FAST.get({tuple_of(key)})")
        lines.append("            if f is not None:")
        lines.append(f"                return f({', '.join(ops + scal + (outs if mode else []))})")
    lines.append(f"    return _G(_OP, _OVL, {tuple_of(ops)}, {tuple_of(scal)}, {tuple_of(consts)}, "
                 f"{'None' if mode == 0 else '[' + ', '.join(outs) + ']'}, {mode})")
    ns = {"_T": _T, "_NUM": frozenset(_NUMBERS), "_FAST": ovl.fast, "_G": general, "_OP": op, "_OVL": ovl,
          "_noov": _no_partial_overlap}
    src = "\n".join(lines)
    exec(src, ns)
    fn = ns[ovl.name.replace(".", "_")]
    fn.__gems_source__ = src
    return fn


def _has_default(a):
    try:
        return a.has_default_value()
    except AttributeError:
        return a.default_value is not None


def _no_partial_overlap(out, t):
    """Cheap hot-path test for contiguous tensors: the same memory or disjoint memory."""
    a, b = out.data_ptr(), t.data_ptr()
    if a == b:
        return out.dtype == t.dtype
    return a + out.numel() * out.element_size() <= b or b + t.numel() * t.element_size() <= a


def pointwise(*names, body, promotion="default", operands=("self", "other"), scalars=(), constexprs=(),
              promote=None, dtypes=None, operand_dtypes=None, outputs=1, defaults=None, result_dtype=None,
              category="pointwise", backward=False, check=None, doc=None) -> PointwiseOp:
    """Declare a pointwise op; see the package docstring."""
    from ..registry import FLOATS
    return PointwiseOp(names, body, promotion, operands, scalars, constexprs, promote,
                       dtypes if dtypes is not None else FLOATS, operand_dtypes, outputs, defaults, result_dtype,
                       category, backward, check, doc)
