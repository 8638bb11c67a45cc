"""Ops that move elements without arithmetic: copies and casts, cat/stack, pad, gathers and scatters,
masked_scatter, tril/triu, embedding."""
from . import cat, copy, embedding, index, masked_scatter, pad, stack, triangular  # noqa: F401
