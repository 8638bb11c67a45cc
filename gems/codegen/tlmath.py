"""Scalar math helpers for op bodies that both the GPU and the Triton interpreter can run.

The interpreter has no libdevice, so these are written with tl core math only.
"""
import triton
import triton.language as tl


@triton.jit
def tanh(x):
    """tanh in fp32: exp form for |x| >= 0.25 (no cancellation there), odd Taylor series below
    (|x|**11 term < 1e-8 relative)."""
    ax = tl.abs(x)
    # propagate_nan: the GPU's min.f32 returns the non-NaN operand (the interpreter's numpy does not)
    e = tl.exp(-2.0 * tl.minimum(ax, 20.0, propagate_nan=tl.PropagateNan.ALL))
    big = (1.0 - e) / (1.0 + e)
    x2 = x * x
    small = ax * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0)))))
    r = tl.where(ax < 0.25, small, big)
    return tl.where(x < 0, -r, r)


@triton.jit
def sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def trunc(x):
    return tl.where(x < 0, tl.ceil(x), tl.floor(x))
