"""Normalizations over a dim: softmax / log_softmax and layer_norm, forward and backward."""
from . import layer_norm, softmax  # noqa: F401
