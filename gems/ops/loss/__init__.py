"""Losses: nll_loss forward and backward (what cross_entropy calls after log_softmax)."""
from . import nll_loss  # noqa: F401
