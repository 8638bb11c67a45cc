"""Fused attention behind scaled_dot_product_attention: sdpa.py registers the overloads and picks a kernel;
kernels.py holds the Triton kernels, gluon_fwd.py / gluon_bwd.py the Hopper Gluon forward and backward."""
from . import sdpa  # noqa: F401
