"""Fused attention behind scaled_dot_product_attention: overloads.py registers the ATen overloads, sdpa.py
validates, picks a kernel and launches it; kernels.py holds the Triton kernels, gluon_fwd.py / gluon_bwd.py
the Hopper Gluon forward and backward."""
from . import overloads  # noqa: F401
