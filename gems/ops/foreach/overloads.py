"""The _foreach_* overloads: ATen's argument lists, per overload kind, mapped onto launch.py's one-launch
kernel (the formulas and what is served are in launch.py's docstring).
"""
from __future__ import annotations

import math

from ...codegen.generator import range_limit
from ...registry import FLOATS, Unsupported, register
from ...runtime.abi import FOREACH_NO_SCALAR, FOREACH_SCALAR, FOREACH_SCALARLIST, FOREACH_TENSOR
from ..reduce.vector_norm import vector_norm
from .launch import LIMITS, S_TABLE, S_TENSOR, S_TENSORS, launch, scalar_value


def _doc(fn, text):
    fn.__doc__ = text
    return fn


def _alpha(alpha, dtype):
    # ATen's add/sub check alpha's kind ("Boolean alpha only supported for Boolean results."): let it
    if isinstance(alpha, bool):
        raise Unsupported("bool alpha")
    return scalar_value(alpha, dtype, "alpha")


def _no_bool_sub(op, numbers):
    # ATen's sub rejects a bool operand ("Subtraction, the `-` operator, with a bool tensor is not
    # supported"): let it raise
    if op == "sub" and any(isinstance(v, bool) for v in numbers):
        raise Unsupported("sub with a bool number")


def _scalar_variant(op, inplace):
    label = "exponent" if op == "pow" else "scalar"

    def fn(self, scalar):
        _no_bool_sub(op, (scalar,))
        return launch(op, [self], inplace, s=scalar_value(scalar, self[0].dtype if self else None, label))
    return _doc(fn, f"{op} of every tensor with a Scalar: one launch")


def _list_variant(op, inplace, with_alpha):
    if with_alpha:
        def fn(self, other, *, alpha=1):
            a = _alpha(alpha, self[0].dtype) if self else 1.0
            return _with_list(op, self, other, inplace, a)
    else:
        def fn(self, other):
            return _with_list(op, self, other, inplace, 1.0)
    return _doc(fn, f"{op} of two tensor lists elementwise (or with one 0-dim tensor per tensor): one launch")


def _with_list(op, self, other, inplace, alpha):
    if other and all(t.dim() == 0 for t in other) and not all(t.dim() == 0 for t in self):
        # one 0-dim tensor per tensor (capturable Adam's bias corrections): a per-tensor scalar. ATen's
        # loop computes self[i] op other[i], whose dtype is self's unless self[i] is 0-dim too: then
        # the two promote, and a functional result would take the other dtype. (In place the result
        # is self's dtype; CUDA's TensorIterator then computes with the scalar unrounded, where the
        # kernel rounds it to self's dtype for every tensor: within half an ulp of the scalar.)
        if not inplace and any(t.dim() == 0 for t in self) and any(t.dtype is not self[0].dtype for t in other):
            raise Unsupported("0-dim tensors of both lists with different dtypes")
        return launch(op, [self], inplace, alpha=alpha, smode=S_TENSORS, stensor=other)
    return launch(op, [self, other], inplace, alpha=alpha)


def _scalarlist_variant(op, inplace):
    def fn(self, scalars):
        _no_bool_sub(op, scalars)
        return launch(op, [self], inplace, smode=S_TABLE, svals=scalars)
    return _doc(fn, f"{op} of every tensor with its own Scalar: one launch")


def _tensor_variant(op, inplace, with_alpha):
    if with_alpha:
        def fn(self, other, *, alpha=1):
            a = _alpha(alpha, self[0].dtype) if self else 1.0
            return launch(op, [self], inplace, alpha=a, smode=S_TENSOR, stensor=_scalar_tensor(other, self))
    else:
        def fn(self, other):
            return launch(op, [self], inplace, smode=S_TENSOR, stensor=_scalar_tensor(other, self))
    return _doc(fn, f"{op} of every tensor with a 0-dim tensor's value (no host read): one launch")


def _scalar_tensor(t, tensors):
    if t.dim() != 0:
        raise Unsupported("scalar tensor with dims")   # ATen raises
    if t.is_complex():
        raise Unsupported("complex scalar tensor")
    if tensors and t.dtype is not tensors[0].dtype and any(x.dim() == 0 for x in tensors):
        # ATen computes self[i] op other per tensor there: a 0-dim self[i] and the 0-dim scalar tensor
        # compute in the wider dtype (fp16 / fp32 is fp32: the result's dtype, or in place the value
        # before its rounding), where dimensioned tensors read the scalar in their own
        raise Unsupported("a 0-dim tensor beside a scalar tensor of another dtype")
    return t


def _unary_variant(op, inplace):
    def fn(self):
        return launch(op, [self], inplace)
    return _doc(fn, f"{op} of every tensor: one launch")


def _names(base, kind, inplace=True):
    sfx = "" if kind == "default" else "." + kind
    return [f"_foreach_{base}{sfx}"] + ([f"_foreach_{base}_{sfx}"] if inplace else [])


# how the C++ fast path reads a call (csrc/foreach_serve.h ForeachSpec): the schema positions of the
# kernel's input lists, of its number and the number's kind (abi.FOREACH_*), of alpha
def _spec(lists, scalar=-1, skind=FOREACH_NO_SCALAR, alpha=-1):
    # limits: per dtype the C++ fast path may serve whole, the numbers that fit it (range class, largest
    # finite value)
    return dict(lists=lists, scalar=scalar, skind=skind, alpha=alpha,
                limits={d: (range_limit(d), lim) for d, lim in LIMITS.items()})


def _reg(names, make, host_args=(), spec=None):
    for name in names:
        register(name, category="pointwise", dtypes=FLOATS, plan=False, host_args=host_args,
                 foreach=spec)(make(name.split(".")[0].endswith("_")))


for _op, _kinds in (("add", ("Scalar", "List", "ScalarList", "Tensor")), ("sub", ("Scalar", "List", "ScalarList")),
                    ("mul", ("Scalar", "List", "ScalarList", "Tensor")), ("div", ("Scalar", "List", "ScalarList", "Tensor")),
                    ("maximum", ("Scalar", "List", "ScalarList")), ("minimum", ("Scalar", "List", "ScalarList")),
                    ("pow", ("Scalar", "List", "ScalarList"))):
    _with_alpha = _op in ("add", "sub")
    for _k in _kinds:
        _make = {"Scalar": lambda ip, o=_op: _scalar_variant(o, ip),
                 "List": lambda ip, o=_op, a=_with_alpha: _list_variant(o, ip, a),
                 "ScalarList": lambda ip, o=_op: _scalarlist_variant(o, ip),
                 "Tensor": lambda ip, o=_op, a=_with_alpha: _tensor_variant(o, ip, a)}[_k]
        _alpha_at = 2 if _with_alpha else -1
        _reg(_names(_op, _k), _make, spec={"Scalar": _spec([0], 1, FOREACH_SCALAR),
                                           "List": _spec([0, 1], alpha=_alpha_at),
                                           "ScalarList": _spec([0], 1, FOREACH_SCALARLIST),
                                           "Tensor": _spec([0], 1, FOREACH_TENSOR, _alpha_at)}[_k])

for _op in ("sqrt", "neg", "reciprocal"):
    _reg(_names(_op, "default"), lambda ip, o=_op: _unary_variant(o, ip), spec=_spec([0]))


@register("_foreach_zero_", category="pointwise", dtypes=FLOATS, plan=False, foreach=_spec([0]))
def foreach_zero_(self):
    """Zero every tensor: one launch"""
    return launch("zero", [self], True)


@register("_foreach_pow.ScalarAndTensor", category="pointwise", dtypes=FLOATS, plan=False,
          foreach=_spec([1], 0, FOREACH_SCALAR))
def foreach_pow_scalar_and_tensor(self, exponent):
    """A Scalar to the power of every tensor: one launch"""
    return launch("rpow", [exponent], False, s=scalar_value(self, exponent[0].dtype if exponent else None, "self"))


def _lerp_variant(kind, inplace):
    if kind == "List":
        def fn(self, tensors1, weights):
            return launch("lerp", [self, tensors1, weights], inplace)
    elif kind == "Scalar":
        def fn(self, tensors1, weight):
            return launch("lerp", [self, tensors1], inplace, s=scalar_value(weight, self[0].dtype if self else None, "weight"))
    else:
        def fn(self, tensors1, weight):
            return launch("lerp", [self, tensors1], inplace, smode=S_TABLE, svals=weight)
    return _doc(fn, "lerp of two tensor lists (weights per element, one Scalar or one per tensor): one launch")


for _k, _sp in (("List", _spec([0, 1, 2])), ("Scalar", _spec([0, 1], 2, FOREACH_SCALAR)),
                ("ScalarList", _spec([0, 1], 2, FOREACH_SCALARLIST))):
    _reg(_names("lerp", _k), lambda ip, k=_k: _lerp_variant(k, ip), spec=_sp)


def _pointwise_variant(op, kind, inplace):
    if kind == "Scalar":
        def fn(self, tensor1, tensor2, value=1):
            v = scalar_value(value, self[0].dtype if self else None, "value")
            return launch(op, [self, tensor1, tensor2], inplace, s=v)
    elif kind == "ScalarList":
        def fn(self, tensor1, tensor2, scalars):
            return launch(op, [self, tensor1, tensor2], inplace, smode=S_TABLE, svals=scalars)
    else:
        def fn(self, tensor1, tensor2, scalars):
            # ATen reads the packed scalars on the host (a CPU tensor, whatever the lists' device) and
            # runs its ScalarList kernel: so does Gems. Anything else ATen rejects: it raises its error
            if (scalars.device.type != "cpu" or scalars.dim() != 1 or not scalars.is_contiguous()
                    or scalars.numel() != len(self) or scalars.is_complex()):
                raise Unsupported("scalars is not a contiguous 1-D CPU tensor of one value per tensor")
            return launch(op, [self, tensor1, tensor2], inplace, smode=S_TABLE, svals=scalars.tolist())
    return _doc(fn, f"{op} of three tensor lists (value: a Scalar, one per tensor, or a 1-D tensor): one launch")


for _op in ("addcmul", "addcdiv"):
    for _k in ("Scalar", "ScalarList", "Tensor"):
        # (.Tensor: ATen's packed scalars read on the host stay on the Python path)
        _reg(_names(_op, _k), lambda ip, o=_op, k=_k: _pointwise_variant(o, k, ip),
             host_args=("scalars",) if _k == "Tensor" else (),
             spec={"Scalar": _spec([0, 1, 2], 3, FOREACH_SCALAR), "ScalarList": _spec([0, 1, 2], 3, FOREACH_SCALARLIST),
                   "Tensor": None}[_k])


@register("_foreach_norm.Scalar", category="reduction", dtypes=FLOATS, plan=False)
def foreach_norm(self, ord=2, dtype=None):
    """Vector norm of every tensor (0-dim results in the tensor's dtype or `dtype`): for now one
    reduction (linalg_vector_norm's kernels) per tensor, not one launch."""
    # TODO one launch: per-chunk partials through the pointer table into an fp32 workspace, then a
    # second small launch summing each tensor's chunks and taking the root
    if len(self) == 0:
        raise Unsupported("empty tensor list")   # ATen raises
    # a one-element tensor's p-norm is |x| exactly (ATen's CPU answers |x| for a reduction of one
    # element; its CUDA kernel squares x, which overflows from 1.8e19 in fp32): the max-norm gives it
    # without forming x^p, chosen from the shape alone
    one = math.inf if ord != 0 and not isinstance(ord, bool) else ord
    return [vector_norm(t, one if t.numel() == 1 else ord, None, False, dtype=dtype) for t in self]
