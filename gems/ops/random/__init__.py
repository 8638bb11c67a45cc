"""Ops that draw random numbers (Philox in Triton): dropout and multinomial."""
from . import dropout, multinomial  # noqa: F401
