"""The pointwise generator: one scalar `@triton.jit` body -> every ATen overload variant of an op.

API (stable; op-declaration modules in gems/ops/ build on it)
-------------------------------------------------------------
    from gems.codegen import pointwise

    @triton.jit
    def _add(a, b, alpha):
        return a + alpha * b

    add = pointwise("add.Tensor", "add.Scalar", "add.out", "add.Scalar_out", "add_.Tensor", "add_.Scalar",
                    body=_add, promotion="default", operands=("self", "other"), scalars=("alpha",),
                    dtypes=FLOATS + INTS)

`pointwise(*names, body, promotion="default", operands=("self", "other"), scalars=(), constexprs=(),
           promote=None, dtypes=FLOATS, operand_dtypes=None, outputs=1, defaults=None,
           result_dtype=None, category="pointwise", backward=False, check=None, doc=None,
           divisor=None, round_numbers=False, iter_order=None, number_operands=True,
           result_layouts=None) -> PointwiseOp`

names        ATen overloads served, all variants of one op: functional (`.Tensor`, `.Scalar`,
             `.default`), `.out`-style (the schema's mutable kwarg-only args are the outputs) and in-place
             (`op_.X`: `self` is the output). Each overload's schema is read to map its arguments.
body         `@triton.jit def body(*operands, *scalars, *constexprs)`: receives the operand values
             already converted to the compute dtype (fp32 for fp16/bf16/fp32 — "opmath" —, the
             promoted integer type for integer ops, bool for bool ops), the `scalars` converted to the
             compute dtype too, and the constexprs; returns the result (a tuple when outputs > 1),
             which is cast to each output's dtype on store.
promotion    torch's ELEMENTWISE_TYPE_PROMOTION_KIND by name: "default", "int_to_float" (true div,
             exp on ints), "always_bool" (comparisons: compute in the promoted dtype, return bool),
             "no_opmath", "bool_to_long". Computed with `torch._prims_common.elementwise_dtypes` over
             the `promote` operands (default: all operands), cached per signature.
operands     schema argument names that are body operands, in body order. Each may arrive as a tensor
             or as a Python number (`x * 2.0` reaches `mul.Tensor` with a float; `.Scalar` overloads
             declare a Scalar): numbers are kernel scalar arguments, never tensors. 0-dim CPU tensors
             beside CUDA tensors are read on the host (`.item()`) and passed as scalars too.
scalars      schema Scalar arguments passed to the body as runtime scalars (alpha, threshold, value).
constexprs   schema arguments that select code (approximate="tanh", rounding_mode): tl.constexpr
             values of the body; None becomes "none".
defaults     values for scalars/constexprs an overload's schema lacks (div.Tensor has no rounding_mode).
promote      operands taking part in promotion (where: ("self", "other"), not condition); the others
             keep their dtype (`operand_dtypes={"condition": (torch.bool,)}` declares theirs).
dtypes       accepted dtypes of tensor operands; anything else goes to ATen (counted in gems.stats()).
result_dtype optional `f(compute, result) -> result` override, or an operand's name: the result takes
             that operand's dtype (mish_backward: ATen allocates grad_input with input's options, then
             computes in the common dtype and casts to it).
iter_order   the operands in the order ATen's TensorIterator takes them, when it differs from `operands`
             (threshold_backward: self, then grad_output; rsub: other, then self): the first operand
             with an opinion decides a fresh output's layout.
number_operands  whether ATen wraps a number at an operand position as a 0-dim tensor (add.Scalar,
             where.ScalarOther: True) or hands it to its kernel as a Scalar (pow.Tensor_Scalar's
             exponent, clamp's bounds: False). A 0-dim operand keeps TensorIterator off its fast setup,
             which decides the strides of size-1 dims.
result_layouts  {overload: "contiguous" | "like_self"} for overloads whose ATen implementation allocates
             the result itself instead of taking TensorIterator's layout: plainly contiguous (pow.Scalar,
             masked_fill) or `empty_like(self)` (hardtanh: self's strides when dense, else dense in
             self's memory order).
divisor      the operand ATen's CPU kernels check for an integer zero (remainder, fmod, div with a
             rounding mode): on the CPU backend such calls go to ATen, which raises ZeroDivisionError.

Numbers ATen converts with an overflow check (Scalar / float schema arguments) go to ATen when they do
not fit the common dtype by c10's rule; numbers at Tensor positions when they overflow a floating
common dtype (`generator.number_misfit`; what decides is part of a call plan's signature).

Per call: a generated per-overload wrapper looks up a prebuilt closure keyed by (operand dtypes or
number types, scalar types, constexpr values, out dtypes) when every tensor operand is contiguous with
one shape (the flat 1-D kernel); anything else takes `general()` in generator.py: promotion,
broadcasting, output strides as ATen lays them (result_layout.fresh_strides: TensorIterator's rule,
ATen-generated out= overloads contiguous), `out=` resize (with
ATen's warning) / in-place checks (broadcast growing self, overlap), then a launch of the flat kernel
or the strided nd kernel over the collapsed, stride-ordered dims (layout.plan). Kernels are generated
as source (source.py), written under `<gems cache dir>/codegen/`, and cached per (flat|nd, rank
after collapsing, operand tensor/scalar pattern, dtypes) — never per shape. Calling the PointwiseOp
object directly (`op(x, y, scalars=(1,), out=..., inplace=...)`) runs the general path.
"""
from .generator import PROMOTIONS, PointwiseOp, general, pointwise

__all__ = ["pointwise", "PointwiseOp", "PROMOTIONS", "general"]
