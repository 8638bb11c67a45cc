"""Reductions: sum/mean/amax and their planning and kernels (reduction.py), which argmax/argmin, all/any,
vector norms and cumsum reuse; logsumexp."""
from . import argmax, cumsum, logical, logsumexp, reduction, vector_norm  # noqa: F401
