"""sort and topk along one dim (bitonic networks)."""
from . import sort  # noqa: F401
