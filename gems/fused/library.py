"""The fused ops as torch custom operators (namespace `gems`), the form torch.compile captures.

Why. Dynamo traces Python: reaching an autograd.Function it inlines forward and backward, and so
Gems' launch path (plan recording, LaunchCache, Triton's launcher), which it cannot trace (a graph
break or a crash). A custom operator is one opaque node instead: Dynamo and AOTAutograd see only its
schema, its fake (meta) kernel, which gives the exact output shapes, dtypes and strides, and its
autograd formula, whose backward work is a custom operator too. The compiled graph then calls the
real kernel (the same planned launch helper eager mode runs) with real tensors.

When. Each public function in gems.fused takes this path only while `torch.compiler.is_compiling()`.
Eager calls keep the autograd.Function (or, without a graph, the bare launch): dispatching an
operator through the dispatcher and its autograd kernel costs more host time than Gems' whole
launch on a repeated signature, which is what the eager path is built to avoid.

Conventions shared by the families. Non-tensor arguments (eps, offset, casting as a bool, ignore_index,
...) are scalar arguments of the schema. An output that exists only for some arguments (the new
residual of add_rms_norm, a weight gradient that is not needed) is a `Tensor[]` of zero or one
tensors, so that one operator serves all the variants with a fake kernel that follows the same rule.
Tensors the backward needs (rstd, mean, lse, gradients computed in forward) are outputs of the forward
operator, saved by `setup_context`; nothing is kept on the side.
"""
from __future__ import annotations

import torch

from ..runtime import backend

NAMESPACE = "gems"
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")


def define(name, schema, impl, fake, *, backward=None, setup_context=None):
    """Define `gems::<name><schema>` with `impl` for every device (CompositeExplicitAutograd: the impl
    launches on whatever device its tensors are on) and `fake` as its meta kernel; with `backward`,
    register `backward(ctx, *grads)` (and `setup_context(ctx, inputs, output)`, which saves what it
    needs) as its autograd formula. Returns the operator overload to call."""
    _LIB.define(name + schema)
    _LIB.impl(name, impl, "CompositeExplicitAutograd")
    qualname = f"{NAMESPACE}::{name}"
    torch.library.register_fake(qualname, fake, lib=_LIB)
    if backward is not None:
        torch.library.register_autograd(qualname, backward, setup_context=setup_context, lib=_LIB)
    return getattr(getattr(torch.ops, NAMESPACE), name).default


def maybe(t):
    """An optional output as the `Tensor[]` of zero or one tensors that the schemas use."""
    return [] if t is None else [t]


def first(ts):
    """The optional output back from its `Tensor[]` form (None for an empty list)."""
    return ts[0] if len(ts) else None


@torch.compiler.assume_constant_result
def device_type():
    """The device type the active Gems backend launches on, or None without one. Dynamo calls it once
    while tracing and keeps the result as a constant instead of tracing backend detection (an
    lru_cache'd probe of the environment); in eager mode it is a plain call."""
    try:
        return backend().device_type
    except RuntimeError:
        return None


def optional_at(outputs, i):
    """A launch helper's result tuple with its optional output at position i in `Tensor[]` form."""
    return tuple(maybe(t) if j == i else t for j, t in enumerate(outputs))


class FunctionContext:
    """The part of an autograd.Function's ctx that the forward and backward bodies of the loss
    Functions use, so that a custom operator's impl runs those bodies unchanged outside autograd (the
    compiled and the eager path then launch the same kernels with the same arguments)."""

    def __init__(self, needs_input_grad=(), saved=()):
        self.needs_input_grad = tuple(needs_input_grad)
        self.saved_tensors = tuple(saved)

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


def placeholder(t, like):
    """`t`, or a 0-element tensor standing for an absent one in a fixed-length `Tensor[]` output."""
    return t if t is not None else like.new_empty((0,))

