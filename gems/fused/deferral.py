"""A fused op's call while its kernels compile in the background: its plain PyTorch reference answers.

Why: gems.patch's fused modules launch their kernels outside the dispatcher, so a fresh process's
first step compiled each of them on the calling thread, one after the other (a patched 1.1B Llama's
first step waited 8.8 s of its 12 s for them on an H200; with this module that step took 6 s;
docs/perf.md, Cold start), while every ATen op around them was already answered by ATen as its
kernel compiled (runtime/background.py).

How: `@deferrable` over a public function marks its call deferrable while it runs (the forwards of
these ops write only tensors they allocate, so nothing is half written when a launch stops), and a
launch that misses then hands its compile to the pool and raises NotCompiled; the function's reference
(`reference_<name>` beside it, the same signature and semantics) answers the call instead, as one
autograd node whose forward and backward run ATen's own kernels (a Gems kernel compiled for the
reference's ops would serve no later call, and would hold up the ones that do: through the
dispatcher, the patched 1.1B's first step queued 120 compiles instead of 60 and took 15.7 s). A
forward that ran its kernels keeps its autograd.Function, whose backward may meet a kernel still
compiling: `backward` runs its launch function the same way and, on a miss, takes the gradients of
the reference (`reference_grads`, recomputed from the saved inputs). Per call, on a hit, this costs
two thread-local writes and a check (about 0.3 us on a CPU).
gems.warmup's collecting run raises NotCompiled at every uncompiled launch, so the same paths keep its
step going with right values.

Counted per op in gems.stats() as `fused::<name>`, reason "kernel not compiled yet". Results differ
from the kernels' only within the op's tolerance, as ATen's answers for ATen ops do. A CUDA graph's
capture, `background.inline()` and GEMS_COMPILE=inline compile on the calling thread as before.

fused_linear_cross_entropy's reference would hold the full [N, V] logits the op exists to avoid: its
answer is the reference chunk by chunk, each chunk's logits recomputed in backward. Not deferred:
moe_experts, and the backward of fused_linear_cross_entropy with reduction="none".
"""
from __future__ import annotations

import functools

import torch

from ..runtime import background, collect, reentry, settings


def deferrable(fn=None, *, answer: str | None = None):
    """Decorator: while a kernel `fn` launches compiles in the background, `reference_<fn name>` from
    fn's module (or the function of it named `answer`) answers the call (see the module docstring)."""
    if fn is None:
        return lambda f: deferrable(f, answer=answer)
    name = fn.__name__
    ref = answer or "reference_" + name
    is_compiling = torch.compiler.is_compiling

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if is_compiling():     # Dynamo traces the custom-operator path (library.py) only
            return fn(*args, **kwargs)
        out = launched(fn, args, kwargs)
        if out is MISSED:
            background.count_answer(name)
            return by_reference(fn.__globals__[ref], args, kwargs)
        return out
    return call


def by_reference(reference, args, kwargs):
    """reference(*args, **kwargs) as one autograd node whose forward and backward run ATen's own kernels
    (see _ByReference); the positional tensors are its differentiable inputs."""
    pos = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

    def call(*tensors):
        a = list(args)
        for i, t in zip(pos, tensors):
            a[i] = t
        return reference(*a, **kwargs)
    return _ByReference.apply(call, *(args[i] for i in pos))


class _ByReference(torch.autograd.Function):
    """The reference's answer under the re-entry guard: its ATen calls run ATen's kernels, not Gems'
    (whose compiles for them would serve no later call once the fused kernels are in, and would share
    the pool and the GIL with the ones that do); backward recomputes the reference on the saved inputs
    and takes its gradients."""

    @staticmethod
    def forward(ctx, call, *tensors):
        ctx.call = call
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*tensors)
        with reentry.guard():
            return call(*tensors)

    @staticmethod
    def backward(ctx, *grads):
        with reentry.guard():
            return (None,) + reference_grads(ctx.call, ctx.saved_tensors, ctx.needs_input_grad[1:], grads)


def backward(name, launch, args, grads_by_reference):
    """`launch(*args)` of a backward, or `grads_by_reference()` while one of its kernels compiles."""
    out = launched(launch, args, {})
    if out is MISSED:
        background.count_answer(name)
        with reentry.guard():
            return grads_by_reference()
    return out


MISSED = object()   # what `launched` returns for a launch whose kernel is not compiled yet


def launched(fn, args, kwargs):
    """fn(*args, **kwargs) marked deferrable, or MISSED when a kernel it launches is not compiled yet
    (gems.warmup's collecting run raises NotCompiled without the mark)."""
    if not settings.BACKGROUND_COMPILE:
        try:
            return fn(*args, **kwargs)
        except collect.not_compiled():
            return MISSED
    prev = set_deferring(True)
    try:
        return fn(*args, **kwargs)
    except collect.not_compiled():
        return MISSED
    finally:
        set_deferring(prev)


set_deferring = background.set_deferring


def reference_grads(reference, inputs, needs, grads):
    """The gradients of `reference(*inputs)` with respect to the inputs whose `needs` is true (None for
    the others and for an input the outputs do not depend on), for output gradients `grads` (None: the
    output got none). The inputs are detached: the reference is recomputed on its own small graph."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(bool(n)) if isinstance(t, torch.Tensor) else t
                  for t, n in zip(inputs, needs)]
        outs = reference(*leaves)
        outs = outs if isinstance(outs, tuple) else (outs,)
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        wanted = [t for t, n in zip(leaves, needs) if n]
        got = (torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
               if pairs and wanted else [None] * len(wanted))
    it = iter(got)
    return tuple(next(it) if n else None for n in needs)
