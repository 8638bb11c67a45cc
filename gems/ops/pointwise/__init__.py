"""Elementwise ops declared through gems.codegen's `pointwise(...)` generator: unary math, arithmetic,
binary (comparisons, logical and bitwise ops, pow, min/max), ternary/select, activations."""
from . import activation, arith, binary, ternary, unary  # noqa: F401
